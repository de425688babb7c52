"""Attention on CUDA (run on a GPU machine; CI deselects the ``gpu`` marker): fxshard's programs hold one
device-neutral ``fxshard::attention`` node whatever device they were traced on, run on CUDA with
F.scaled_dot_product_attention's own kernel choice (flash / cuDNN / memory-efficient), and match eager.

* ``test_cuda_traced_attention_is_one_node_and_runs``: traced on CUDA, heads split over a 2-rank fake process
  group: no CUDA attention kernel in the programs, no fallback, and forward + backward run (the old crash: a
  traced ``view`` of the kernel's output layout).
* ``test_cuda_parity_one_rank_nccl``: every attention form of ``tests/test_attention.py`` on a 1-rank NCCL
  world, sharded vs unsharded, outputs and every gradient. Their head dim (4) keeps SDPA on its math and
  memory-efficient kernels, hence:
* ``test_each_fused_kernel_matches_eager``: bf16, head dims 64 and 128, SDPA held to one fused kernel
  (``sdpa_kernel``: flash, memory-efficient, cuDNN) around both the sharded and the eager run, outputs and
  every gradient (forward through the kernel, backward through its own backward under ``torch.func.vjp``).
* ``test_cpu_traced_program_runs_on_cuda``: the global graph traced on CPU (and on meta) runs on CUDA.

``FXSHARD_GPU_TEST_DEVICE=cpu`` runs the same checks on CPU with gloo (a dry run of this file, not a GPU result).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from fxshard.ops.attention import ATTENTION, ATTENTION_BACKWARD
from tests.gpu.test_cuda import DEVICE
from tests.test_attention import B, D, FORMS, HEADS, T, _model

pytestmark = pytest.mark.gpu


def _fresh_world(backend: str, world: int = 1):
    if dist.is_initialized():
        dist.destroy_process_group()
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        dist.init_process_group(backend if DEVICE == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=world)
    return init_device_mesh(DEVICE, (world,), mesh_dim_names=("tp",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_traced_attention_is_one_node_and_runs(dtype):
    mesh = _fresh_world("fake", 2)
    try:
        for form in ("causal", "gqa_enable", "learned_mask"):
            model = _model(form).to(DEVICE, dtype)
            x = torch.randn(B, T, D, device=DEVICE, dtype=dtype, requires_grad=True)
            sm = fxshard.shard(model, mesh, HEADS, example_inputs=(x,))
            ops = {str(n.target) for p in sm._programs() for n in p.gm.graph.nodes if n.op == "call_function"}
            assert str(ATTENTION) in ops and str(ATTENTION_BACKWARD) in ops, (form, ops)
            assert not [o for o in ops if "scaled_dot_product" in o], (form, ops)
            assert not any(p.fallbacks for p in sm._programs()), form
            sm(x).float().pow(2).sum().backward()  # collectives are no-ops here: this checks it runs
    finally:
        dist.destroy_process_group()


def test_cuda_parity_one_rank_nccl():
    mesh = _fresh_world("nccl", 1)
    try:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(B, T, D, generator=g).to(DEVICE)
        cot = torch.randn(B, T, D, generator=g).to(DEVICE)
        for form in FORMS:
            ref = _model(form).to(DEVICE)
            model = copy.deepcopy(ref)
            xr = x.clone().requires_grad_()
            (ref(xr) * cot).sum().backward()
            sm = fxshard.shard(model, mesh, HEADS, example_inputs=(x.clone().requires_grad_(),))
            xl = x.clone().requires_grad_()
            y = sm(xl)
            (y * cot).sum().backward()
            err = max((y - ref(x)).abs().max().item(), (xl.grad - xr.grad).abs().max().item())
            for name, p in sm.named_parameters():
                err = max(err, (p.grad - ref.get_parameter(name).grad).abs().max().item())
            assert err < 1e-4, (form, err)
    finally:
        dist.destroy_process_group()


class _Heads(nn.Module):
    """q/k/v/o projections around causal SDPA with ``heads`` heads of ``head_dim``."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.h, dim = heads, heads * head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.h, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


# the fused kernels eager would pick from (CPU has one, for the dry run)
KERNELS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"] if DEVICE == "cuda" else ["FLASH_ATTENTION"]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kernel", KERNELS)
def test_each_fused_kernel_matches_eager(kernel, head_dim):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = _fresh_world("nccl", 1)
    try:
        torch.manual_seed(0)
        ref = _Heads(4, head_dim).to(DEVICE, torch.bfloat16)
        model = copy.deepcopy(ref)
        x = torch.randn(2, 256, 4 * head_dim, device=DEVICE, dtype=torch.bfloat16)
        cot = torch.randn_like(x)
        with sdpa_kernel(getattr(SDPBackend, kernel)):  # only this kernel: eager raises if it cannot serve
            xr = x.clone().requires_grad_()
            want = ref(xr)
            (want * cot).sum().backward()
            sm = fxshard.shard(model, mesh, HEADS, example_inputs=(x.clone().requires_grad_(),))
            xl = x.clone().requires_grad_()
            got = sm(xl)
            (got * cot).sum().backward()
        scale = lambda t: max(1e-3, t.abs().max().item())  # noqa: E731
        errs = {"out": (got - want).abs().max().item() / scale(want),
                "x": (xl.grad - xr.grad).abs().max().item() / scale(xr.grad)}
        for name, p in sm.named_parameters():
            g = ref.get_parameter(name).grad
            errs[name] = (p.grad - g).abs().max().item() / scale(g)
        print(kernel, head_dim, {k: f"{v:.1e}" for k, v in errs.items()})
        assert max(errs.values()) <= 2e-2, (kernel, head_dim, errs)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_cpu_traced_program_runs_on_cuda(device):
    from fxshard.tracing.export import trace_forward

    ref = _model("learned_mask")
    with torch.device(device):
        model = _model("learned_mask")
    x = torch.randn(B, T, D)
    traced = trace_forward(model, (x.to(device),), {})
    assert ATTENTION in {n.target for n in traced.gm.graph.nodes}
    inputs = []
    for slot in traced.slots:
        if slot.kind == "param":
            inputs.append(ref.get_parameter(slot.names[0]).detach())
        elif slot.kind == "buffer":
            inputs.append(ref.get_buffer(slot.names[0]))
        else:
            inputs.append(x)
    want = ref(x)
    got = traced.gm(*[t.to(DEVICE) for t in inputs])
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert (got.cpu() - want).abs().max().item() < 1e-4
