"""Collectives the model calls itself (seed 002 as its author wrote it: ``torch.distributed.all_reduce(x)``
after every layer, parameters requiring grad as nn.Linear leaves them), as eager runs them under torchrun:
the forward runs the collective as written on every rank, with or without grad mode; only a backward through
it fails, with a ShardingError instead of eager's silently wrong gradient (c10d has no derivative)."""

from __future__ import annotations

from contextvars import ContextVar

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel
from tests import models
from tests.dist_utils import run_ranks

DIM, LAYERS = 16, 4
MEGATRON = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(LAYERS)}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _seed002_as_written(rank: int, world_size: int) -> dict:
    """Per plan and dtype: the sharded module's output against eager's on this rank (the model run unsharded,
    its all_reduce summing over the real 2 ranks) under no_grad, inference_mode, in eval mode and with grad
    on; then what a backward does."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict = {}
    for name, plan, dtype in [("empty_bf16", {}, torch.bfloat16), ("megatron_fp32", MEGATRON, torch.float32)]:
        model = models.Seed002Model(DIM, LAYERS, all_reduce=True).to(dtype)
        x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
        with torch.no_grad():
            want = model(x)
        sm = fxshard.shard(model, mesh, plan, example_inputs=(x,))
        with torch.no_grad():
            out[name] = _rel(sm(x), want)
        with torch.inference_mode():
            out[name + "_inference_mode"] = _rel(sm(x), want)
    y = sm(x)  # grad on: the forward runs as eager's does, and needs a gradient as eager's
    out["grad_on"], out["requires_grad"] = _rel(y.detach(), want), y.requires_grad
    try:
        y.sum().backward()
        out["backward"] = None
    except fxshard.ShardingError as e:
        out["backward"] = str(e)
    out["grads"] = [p.grad for p in sm.parameters()]
    sm.eval()
    with torch.no_grad():
        out["eval"] = _rel(sm(x), want)
    return out


def test_seed002_as_written_runs_forward_as_eager_and_refuses_the_backward():
    res = run_ranks(_seed002_as_written, 2)
    for r in res:
        for key in ("empty_bf16", "empty_bf16_inference_mode"):  # a missing all_reduce is off by a factor of 2
            assert r[key] <= 1e-2, (key, r)
        for key in ("megatron_fp32", "megatron_fp32_inference_mode", "grad_on", "eval"):
            assert r[key] <= 1e-5, (key, r)
        assert r["requires_grad"] is True
        msg = r["backward"]
        assert msg is not None and "all_reduce" in msg and "torch.distributed.all_reduce(x)" in msg, msg
        assert "torch.no_grad()" in msg and "RowwiseParallel" in msg, msg
        assert r["grads"] == [None] * LAYERS  # no silent gradient


def test_user_collective_fails_at_the_backward_not_at_shard(mesh2, monkeypatch):
    """shard() builds the inference program and records why there is no training program; a call with grad
    off never sees it. The error is the collective's (not a later trace failure), raised at the backward."""
    import fxshard.planner.propagate as propagate_mod

    # the fallback warning is once per op and context: start from one that has warned about nothing
    monkeypatch.setattr(propagate_mod, "_WARNED", ContextVar("fallback_warned", default=frozenset()))
    model = models.Seed002Model(8, 2, all_reduce=True)
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="all_reduce"):  # the collective runs as written, on every rank
        sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
    assert sm.sharding.training is None
    with torch.no_grad():
        sm(x)
    loss = sm(x).sum()
    with pytest.raises(fxshard.ShardingError, match=r"calls a torch.distributed collective .*all_reduce"):
        loss.backward()
    auto = fxshard.shard(models.Seed002Model(8, 2, all_reduce=True), mesh2, {}, example_inputs=(x,), auto=True)
    with pytest.raises(fxshard.ShardingError, match="torch.distributed.all_reduce"):  # auto plans the inference
        auto(x).sum().backward()
    xg = x.clone().requires_grad_()  # frozen parameters, an input's gradient: the same
    sm = fxshard.shard(model.requires_grad_(False), mesh2, {}, example_inputs=(xg,))
    loss = sm(xg).sum()
    with pytest.raises(fxshard.ShardingError, match="torch.distributed.all_reduce"):
        loss.backward()
    assert xg.grad is None
