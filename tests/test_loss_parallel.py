"""Loss parallel without a context manager: cross entropy variants on class-sharded logits,
and gradients of inputs that require grad, on 2 real gloo ranks vs the unsharded model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard import P
from fxshard.report.inspect import collectives
from tests.dist_utils import run_ranks

TOL = 1e-5


class Head(nn.Module):
    """A class-sharded classifier head with the loss inside."""

    def __init__(self, kind: str, n_classes: int = 64):
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(16, n_classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x)
        if self.kind == "mean":
            return F.cross_entropy(logits, target)
        if self.kind == "sum":
            return F.cross_entropy(logits, target, reduction="sum")
        if self.kind == "ignore":
            return F.cross_entropy(logits, target, ignore_index=3)
        if self.kind == "smooth":
            return F.cross_entropy(logits, target, label_smoothing=0.1)
        return F.nll_loss(F.log_softmax(logits, dim=-1), target)


def _run(rank: int, world: int, kind: str) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = Head(kind)
    x = torch.randn(8, 16, requires_grad=True)
    target = torch.tensor([1, 3, 5, 3, 63, 0, 40, 3])
    ref = model(x, target)
    ref.backward()
    # the greedy sweep: loss parallel is its plan at any size; on these 2 KiB logits the global planner
    # gathers them once instead (one collective for three per-token all_reduces: latency outweighs bytes)
    sm = fxshard.shard(copy.deepcopy(model), mesh, {"proj.weight": P("tp", None), "proj.bias": P("tp")},
                       example_inputs=(x.detach().requires_grad_(), target), planner="greedy")
    xs = x.detach().clone().requires_grad_()
    out = sm(xs, target)
    out.backward()
    w = sm._dtensor("proj.weight", sm.proj.weight.grad).full_tensor()
    stats = fxshard.comm_stats(sm)
    logits_bytes = 8 * 64 * 4
    return {"loss_err": abs(out.item() - ref.item()), "x_grad_err": (xs.grad - x.grad).abs().max().item(),
            "w_grad_err": (w - model.proj.weight.grad).abs().max().item(),
            "max_collective": max(c["bytes"] for prog in sm._programs() for c in collectives(prog)),
            "stats": stats,
            "logits_bytes": logits_bytes}


@pytest.mark.parametrize("kind", ["mean", "sum", "ignore", "smooth", "log_softmax_nll"])
def test_cross_entropy_on_class_sharded_logits(kind):
    for res in run_ranks(_run, 2, kind):
        assert res["loss_err"] <= TOL and res["x_grad_err"] <= TOL and res["w_grad_err"] <= TOL, res
        # only per-token statistics travel, never the logits: the largest collective is the all-reduce of
        # the input gradient ([8, 16], as in Megatron); no gradient flows through the row max
        assert res["max_collective"] <= res["logits_bytes"] / 4, res
        assert res["stats"]["backward"]["all_reduce"]["count"] == 1, res


def _tutorial_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def _outside(rank: int, world: int) -> dict:
    from tests import models
    from tests.test_training import llama_megatron_plan

    mesh = fxshard.init_mesh(tp=world)
    model = models.LlamaDecoder(vocab=256, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, hidden=64, max_seq=16)
    tokens, targets = models.make_tokens(2, 16, 256, seed=0), models.make_tokens(2, 16, 256, seed=1)
    # the greedy sweep, as in _run: the global planner gathers these 32 KiB of logits (latency outweighs bytes)
    sm = fxshard.shard(fxshard.loss_parallel(copy.deepcopy(model), _tutorial_loss), mesh, llama_megatron_plan(2),
                       example_inputs=(tokens, targets), planner="greedy")
    ref = _tutorial_loss(model(tokens), targets)  # the tutorial's code: the loss outside the model
    ref.backward()
    loss = sm(tokens, targets)
    loss.backward()
    grads = {n: sm._dtensor(n, p.grad).full_tensor() for n, p in sm.named_parameters()}
    stats = fxshard.comm_stats(sm)
    sm.eval()  # a new mode: traced and sharded again from the wrapper's meta copy
    with torch.no_grad():
        eval_err = abs(sm(tokens, targets).item() - ref.item())
    return {"loss_err": max(abs(loss.item() - ref.item()), eval_err),
            "grad_err": max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters()),
            "keys": list(sm.state_dict()) == list(model.state_dict()),
            "full_err": max((v - model.state_dict()[k]).abs().max().item() for k, v in sm.full_state_dict().items()),
            "max_collective": max(v["bytes"] / v["count"] for p in stats.values() for v in p.values()),
            "logits_bytes": 2 * 16 * 256 * 4}


def test_loss_outside_the_model_keeps_the_models_keys():
    for res in run_ranks(_outside, 2):
        assert res["loss_err"] <= TOL and res["grad_err"] <= TOL, res
        assert res["keys"] and res["full_err"] == 0.0, res
        assert res["max_collective"] < res["logits_bytes"] / 4, res  # never the logits (per-token statistics)
