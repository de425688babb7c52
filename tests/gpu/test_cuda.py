"""GPU checks: fxshard's programs on CUDA kernels, in fp32 and bf16 autocast, eager and compiled.

Run where CUDA is present: ``python -m pytest -m gpu tests/gpu`` (``scripts/gpu_check.sh`` runs them and
``benchmarks/gpu_step.py`` and keeps the logs). CI has no GPU and deselects the ``gpu`` marker (it says so).

What runs where:
* numerics (sharded program vs the same model run eagerly, loss and every gradient) on a 1-rank NCCL world:
  the CUDA path of every op (the attention node's CUDA kernels, autocast's casts, the joint graph split,
  torch.compile of the sharded module), for models built on CPU and on the meta device. Multi-rank numerics
  on the GPU: ``test_two_ranks.py`` (2 ranks sharing the GPU, real NCCL collectives); the CPU suite covers
  every rule on 2 and 4 gloo ranks.
* plans at real ranks: the fake process group stands in for 8 tensor-parallel ranks on one GPU (collectives
  are free no-ops, so values are not compared): no replicated fallback, attention one node split by heads,
  no CPU-only kernel in the program, and a training step runs on CUDA at tp=8 shapes.
* seed 002 as its author wrote it (bf16 on CUDA, ``torch.distributed.all_reduce`` inside the model).

``FXSHARD_GPU_TEST_DEVICE=cpu`` runs the same checks on CPU with gloo (a dry run of this file, not a GPU result).
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import warnings
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel
from fxshard.models import LlamaDecoder, make_tokens

pytestmark = pytest.mark.gpu

DEVICE = os.environ.get("FXSHARD_GPU_TEST_DEVICE", "cuda")
SMALL = dict(vocab=512, dim=256, n_heads=8, n_kv_heads=4, n_layers=2, hidden=512, max_seq=128)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _world(kind: str, world: int = 1) -> Iterator:
    """A default process group and a 1-D ``tp`` mesh on DEVICE: ``kind`` "real" (NCCL on CUDA, gloo on CPU,
    one rank) or "fake" (``world`` ranks seen from rank 0, collectives free)."""
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists")
    if kind == "real":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield init_device_mesh(DEVICE, (world if kind == "fake" else 1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def megatron_plan() -> dict:
    """Colwise wq/wk/wv/w1/w3, rowwise wo/w2, vocab-parallel embedding and head (loss parallel)."""
    plan: dict = {"tok_embeddings": RowwiseParallel(), "output": ColwiseParallel()}
    for w in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[f"layers.*.{w}"] = ColwiseParallel()
    for w in ("attention.wo", "feed_forward.w2"):
        plan[f"layers.*.{w}"] = RowwiseParallel()
    return plan


def _autocast(dtype):
    return torch.autocast(DEVICE, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _train(module, batches, dtype, steps: int = 2, grad_of=None) -> tuple[list[float], dict]:
    """``steps`` SGD steps; returns the losses and the first step's gradients as full tensors: ``grad_of(name,
    grad)`` (default: a copy of ``grad``, which is the full tensor on one rank)."""
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    losses, grads = [], {}
    for i in range(steps):
        with _autocast(dtype):
            loss = module(*batches[i % len(batches)])
        loss.backward()
        if i == 0:
            grads = {n: (grad_of or _copy)(n, p.grad) for n, p in module.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _copy(name: str, grad: torch.Tensor) -> torch.Tensor:
    return grad.detach().clone()


def _batches(cfg: dict, batch: int = 2, seq: int = 64) -> list:
    return [tuple(make_tokens(batch, seq, cfg["vocab"], seed=s + k).to(DEVICE) for k in (0, 50)) for s in range(2)]


# fp32: kernels differ (fused vs decomposed norms), sums are reordered; bf16 autocast: bf16 rounding of
# the matmul inputs on both sides. A missing all-reduce or a dropped gradient is off by O(1).
TOLS = {None: 2e-4, torch.bfloat16: 3e-2}


def shard_like(ref: LlamaDecoder, built_on: str, mesh, dtype, example: tuple) -> fxshard.ShardedModule:
    """The Llama ``ref`` (SMALL, on DEVICE) built again on ``built_on`` ("cpu" or "meta") and sharded with
    ``megatron_plan()`` inside ``dtype``'s autocast (mixed precision: shard() inside the autocast the calls run
    under), holding ``ref``'s values (a meta model's are loaded after sharding)."""
    with torch.device(built_on):
        model = LlamaDecoder(**SMALL)
    if built_on != "meta":
        model.load_state_dict(ref.state_dict())
    with _autocast(dtype):
        sm = fxshard.shard(model, mesh, megatron_plan(), example_inputs=example)
    if built_on == "meta":
        sm.load_full_state_dict({k: v.cpu() for k, v in ref.state_dict().items()})
        for name in ("rope_cos", "rope_sin"):
            sm.get_buffer(name).copy_(ref.get_buffer(name))
    return sm


def relative_errors(losses: list, ref_losses: list, grads: dict, ref_grads: dict) -> tuple[float, dict]:
    """The largest loss difference relative to max(1, |loss|), and each gradient's largest difference relative
    to max(1e-3, its largest entry), against the eager run's."""
    loss_err = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses))
    return loss_err, {n: (grads[n] - g).abs().max().item() / max(1e-3, g.abs().max().item())
                      for n, g in ref_grads.items()}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("built_on", ["cpu", "meta"])
def test_llama_trains_like_eager_on_cuda(dtype, built_on):
    ref = LlamaDecoder(**SMALL).to(DEVICE)
    batches = _batches(SMALL)
    with _world("real") as mesh:
        sm = shard_like(ref, built_on, mesh, dtype, batches[0])
        assert all(p.device.type == DEVICE for p in sm.parameters())
        text = fxshard.explain(sm)
        assert "_for_cpu" not in text, "a CPU-only kernel in a CUDA program"
        losses, grads = _train(sm, batches, dtype)
        assert all(p.dtype == torch.float32 for p in sm.parameters())
        assert all(g.dtype == torch.float32 for g in grads.values())
    ref_losses, ref_grads = _train(ref, batches, dtype)
    assert set(grads) == set(ref_grads)
    loss_err, grad_err = relative_errors(losses, ref_losses, grads, ref_grads)
    assert loss_err <= TOLS[dtype], (losses, ref_losses)
    bad = {n: e for n, e in grad_err.items() if e > TOLS[dtype]}
    assert not bad, bad


def test_compiled_sharded_module_on_cuda_matches_eager():
    batches = _batches(SMALL)
    with _world("real") as mesh:
        eager = fxshard.shard(LlamaDecoder(**SMALL), mesh, megatron_plan(), example_inputs=batches[0])
        compiled = fxshard.shard(LlamaDecoder(**SMALL), mesh, megatron_plan(), example_inputs=batches[0])
        compiled.compile()
        want, want_g = _train(eager, batches, None)
        got, got_g = _train(compiled, batches, None)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (got, want)
    for n, g in want_g.items():
        assert (got_g[n] - g).abs().max().item() <= 1e-4 * max(1e-3, g.abs().max().item()), n


def test_tp8_plan_at_llama_shapes_runs_on_cuda_without_fallback():
    """Fake process group, 8 ranks: the per-rank program of a Llama with 32 heads / 8 KV heads."""
    cfg = dict(vocab=4096, dim=1024, n_heads=32, n_kv_heads=8, n_layers=2, hidden=2048, max_seq=256)
    tokens = make_tokens(2, 256, cfg["vocab"]).to(DEVICE)
    with _world("fake", 8) as mesh, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = LlamaDecoder(**cfg)  # real values: on the fake group the shards of a meta model stay on meta
        with _autocast(torch.bfloat16):
            sm = fxshard.shard(model, mesh, megatron_plan(), example_inputs=(tokens, tokens))
        text = fxshard.explain(sm)
        with _autocast(torch.bfloat16):
            loss = sm(tokens, tokens)
        loss.backward()
        torch.cuda.synchronize() if DEVICE == "cuda" else None
    fallbacks = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    assert not fallbacks, fallbacks
    assert "_for_cpu" not in text and "cudnn" not in text and "efficient_attention" not in text
    wq = sm.get_parameter("layers.0.attention.wq.weight")
    assert tuple(wq.shape) == (cfg["dim"] // 8, cfg["dim"])
    assert all(p.grad is not None and p.grad.device.type == DEVICE for p in sm.parameters())


class Seed002(nn.Module):
    """Seed 002's model as its author wrote it: Linear layers each followed by ``torch.distributed.all_reduce``."""

    def __init__(self, dim: int, nlayers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(nlayers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            dist.all_reduce(x)
        return x


def _seed002_growth(mesh, nlayers: int, dim: int = 2048, batch: int = 1024) -> tuple[int, float]:
    """Peak allocated bytes above what is held before the calls, over 5 no-grad forwards of the sharded
    seed-002 model (bf16), and the max difference of its output from eager's."""
    torch.manual_seed(0)
    model = Seed002(dim, nlayers).bfloat16().to(DEVICE)  # parameters require grad, as the author's do
    x = torch.randn(batch, dim, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        want = model(x)
        sm = fxshard.shard(copy.deepcopy(model), mesh, {}, example_inputs=(x,))
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
        for _ in range(5):
            out = sm(x)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        growth = (torch.cuda.max_memory_allocated() - held) if DEVICE == "cuda" else 0
    return growth, (out.float() - want.float()).abs().max().item()


def test_seed002_on_cuda_peak_does_not_grow_with_depth():
    with _world("real") as mesh, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the user all_reduce's replicated-input warning
        shallow, err2 = _seed002_growth(mesh, 2)
        deep, err8 = _seed002_growth(mesh, 8)
    act = 1024 * 2048 * 2  # one bf16 activation
    print(f"seed 002 peak growth over 5 calls: 2 layers {shallow / act:.2f}, 8 layers {deep / act:.2f} activations")
    assert err2 == 0 and err8 == 0  # one rank: the all_reduce is the identity, the program is eager's ops
    if DEVICE == "cuda":
        assert deep <= shallow + act, (shallow, deep)
        assert shallow <= 4 * act, shallow
