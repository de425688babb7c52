"""Ops whose torch decomposition differentiates unlike eager (or is wrong) train as eager does.

fxshard's training graph is autograd run over the traced forward. torch decomposes the margin losses
above autograd: multilabel_margin_loss's decomposition counted the target slots after the first -1 (loss
57.04 for eager's 2.54), and multi_margin_loss's passed a gradient through hinge terms that are exactly 0.
fxshard replaces them with decompositions whose autodiff is eager's (``passes/trace.py::_ABOVE_AUTOGRAD``).

One spawn of 2 gloo ranks checks every op at the inputs that broke it, with nothing split and with a
column-parallel linear feeding the op (a row-parallel one after it), against the model run unsharded.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard import P
from fxshard.passes.trace import _multi_margin_loss, _multilabel_margin_loss_forward
from tests.dist_utils import run_ranks

aten = torch.ops.aten
RTOL = 1e-4  # of the largest reference magnitude: a missing all-reduce or a NaN is far off


def _fake_quant(h: torch.Tensor) -> torch.Tensor:
    """Values on the integer grid in [-3, 3] (so exactly +-3 occur), gradient straight through."""
    return h + (h.clamp(-3, 3).round() - h).detach()


# name -> f(logits, y, labels, weight): on 16-class logits of a column-parallel linear (class-split when split)
LOSSES: dict[str, Callable] = {
    "multilabel_margin": lambda h, y, labels, w: F.multilabel_margin_loss(h / 40, labels),
    # on the integer grid, so that hinge terms are exactly 0 (margin 1)
    "multi_margin": lambda h, y, labels, w: F.multi_margin_loss(_fake_quant(h / 10), labels[:, 0], weight=w),
}


class _Loss(nn.Module):
    def __init__(self, f: Callable) -> None:
        super().__init__()
        self.lin1, self.f = nn.Linear(8, 16), f
        self.register_buffer("w", torch.linspace(0.5, 2.0, 16))

    def forward(self, x: torch.Tensor, y: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.f(self.lin1(x * 40), y, labels, self.w)


class _All(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loss = nn.ModuleDict({k: _Loss(f) for k, f in LOSSES.items()})

    def forward(self, x: torch.Tensor, y: torch.Tensor, labels: torch.Tensor) -> tuple:
        return tuple(m(x, y, labels) for m in self.loss.values())


OUTPUTS = [f"loss.{k}" for k in LOSSES]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=g)
    x[0] = 0.0
    y = (torch.rand(6, 16, generator=g) > 0.5).float()
    labels = torch.full((6, 16), -1)  # labels per sample, -1 terminated (the documented format)
    labels[:, 0] = torch.tensor([1, 3, 5, 15, 0, 9])
    labels[1:, 1] = torch.tensor([7, 7, 2, 12, 8])
    labels[5, 2:4] = torch.tensor([4, 11])
    labels[5, 5] = 6  # after the first -1: ignored
    return x, y, labels


def _split_plan() -> dict:
    plan = {}
    for k in LOSSES:
        plan[f"loss.{k}.lin1.weight"], plan[f"loss.{k}.lin1.bias"] = P("tp", None), P("tp")
    return plan


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (1 + max |want|); inf where ``got`` holds a NaN or inf (``want`` is finite)."""
    err = ((got - want).abs().max() / (1 + want.abs().max())).item()
    return err if err == err else float("inf")


def _train_all(rank: int, world: int) -> dict:
    """Per plan: per output, |sharded - eager| of the value and the largest relative gradient error of the
    parameters it reaches; the fallbacks."""
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = _All()
    inputs = _inputs()
    ref = model(*inputs)
    sum(ref).backward()
    eager_grads = {n: p.grad for n, p in model.named_parameters()}
    res: dict = {"eager_finite": all(bool(torch.isfinite(g).all()) for g in eager_grads.values())
                 and all(bool(torch.isfinite(r)) for r in ref)}
    for plan_name, plan in (("empty", {}), ("split", _split_plan())):
        sm = fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=inputs)
        out = sm(*inputs)
        sum(out).backward()
        params = dict(sm.named_parameters())
        errs = {}
        for i, name in enumerate(OUTPUTS):
            grad_err = 0.0
            for n, g in eager_grads.items():
                if n.startswith(name + "."):
                    got = sm._dtensor(n, params[n].grad).full_tensor()
                    grad_err = max(grad_err, _rel_err(got, g))
            errs[name] = (_rel_err(out[i], ref[i]), grad_err)
        res[plan_name] = {"errs": errs, "fallbacks": sorted({f for p in sm._programs() for f in p.fallbacks})}
    return res


def test_traced_gradients_match_eager_on_two_ranks():
    """Forward values and every gradient as eager at the inputs that broke them, unsplit and split."""
    for res in run_ranks(_train_all, 2):
        assert res["eager_finite"]  # the comparison is against finite numbers
        for plan in ("empty", "split"):
            r = res[plan]
            bad = {k: v for k, v in r["errs"].items() if not (v[0] <= RTOL and v[1] <= RTOL)}
            assert not bad, (plan, bad)
            assert not r["fallbacks"], (plan, r["fallbacks"])


@pytest.mark.parametrize("shape", [(6, 7), (7,)], ids=["batch", "one_sample"])
@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
def test_multilabel_margin_loss_decomposition_is_eagers(shape, reduction):
    """Value, is_target and gradient of fxshard's decomposition equal eager's kernel, with labels after the
    first -1 (ignored by eager) and hinge terms that are exactly 0 (eager passes no gradient there)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g)
    x[..., 0] = x[..., 1] + 1  # the term of label 0 against class 1 is exactly 0
    target = torch.randint(-1, shape[-1], shape, generator=g)
    target[..., 0], target[..., 1] = 0, -1
    if len(shape) == 2:
        target[1:, 1] = torch.arange(1, shape[0]) % shape[1]
        target[1:, 2] = -1
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, want_is = aten.multilabel_margin_loss_forward(a, target, reduction)
    got, got_is = _multilabel_margin_loss_forward(b, target, reduction)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6) and torch.equal(got_is, want_is)
    cot = torch.randn(want.shape, generator=g)
    (ga,), (gb,) = torch.autograd.grad(want, a, cot), torch.autograd.grad(got, b, cot)
    assert torch.allclose(ga, gb, atol=1e-6), (ga - gb).abs().max()


@pytest.mark.parametrize("shape", [(6, 5), (5,)], ids=["batch", "one_sample"])
@pytest.mark.parametrize("weighted", [False, True], ids=["", "weight"])
@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
def test_multi_margin_loss_decomposition_is_eagers(shape, weighted, reduction):
    """Value and gradient of fxshard's decomposition equal eager's kernel where hinge terms are exactly 0."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=g)
    target = torch.randint(0, shape[-1], shape[:-1], generator=g)
    xs, ts = torch.atleast_2d(x), torch.atleast_1d(target)  # views of x and target
    rows = torch.arange(xs.shape[0])
    xs[rows, (ts + 1) % shape[-1]] = xs[rows, ts] - 1  # the term 1 - x[target] + x[target + 1] is exactly 0
    weight = torch.rand(shape[-1], generator=g) + 0.5 if weighted else None
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = aten.multi_margin_loss(a, target, 1, 1, weight, reduction)
    got = _multi_margin_loss(b, target, 1, 1, weight, reduction)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    cot = torch.randn(want.shape, generator=g)
    (ga,), (gb,) = torch.autograd.grad(want, a, cot), torch.autograd.grad(got, b, cot)
    assert torch.allclose(ga, gb, atol=1e-6), (ga - gb).abs().max()
