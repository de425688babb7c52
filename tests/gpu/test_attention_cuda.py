"""Attention on CUDA (run on a GPU machine; CI deselects the ``gpu`` marker): fxshard's programs hold one
device-neutral ``fxshard::attention`` node whatever device they were traced on, run on CUDA with
F.scaled_dot_product_attention's own kernel choice (flash / cuDNN / memory-efficient), and match eager.

* ``test_cuda_traced_attention_is_one_node_and_runs``: traced on CUDA (fp32 picks the efficient kernel, bf16
  cuDNN), heads split over a 2-rank fake process group: no CUDA attention kernel in the programs, no fallback,
  and forward + backward run (the old crash: a traced ``view`` of the kernel's output layout).
* ``test_cuda_parity_one_rank_nccl``: every attention form of ``tests/test_attention.py`` on a 1-rank NCCL
  world, sharded vs unsharded, outputs and every gradient.
* ``test_cpu_traced_program_runs_on_cuda``: the global graph traced on CPU (and on meta) runs on CUDA.

``FXSHARD_GPU_TEST_DEVICE=cpu`` runs the same checks on CPU with gloo (a dry run of this file, not a GPU result).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from fxshard.ops.attention import ATTENTION, ATTENTION_BACKWARD
from tests.test_attention import B, D, FORMS, HEADS, T, _model

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("FXSHARD_GPU_TEST_DEVICE", "cuda")


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
