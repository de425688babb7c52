"""Ops whose torch decomposition differentiates unlike eager (or is wrong) train as eager does.

fxshard's training graph is autograd run over the traced forward. Differentiating torch's decomposition
of these ops gave NaN where eager's gradient is finite (softplus, mish, celu for large inputs; sinc at 0;
std / std_mean of a constant row; binary_cross_entropy of a saturated sigmoid), other values at kinks
(hardswish / hardsigmoid at +-3) or without eager's clamps (binary_cross_entropy, log_ndtr). torch's
decomposition of multilabel_margin_loss counted the target slots after the first -1 (loss 57.04 for
eager's 2.54), and multi_margin_loss's passed a gradient through hinge terms that are exactly 0.
``tracing/export.py::EAGER_DERIVATIVE`` keeps the first kind whole (eager's kernel, eager's derivative
formula, a sharding rule each); the margin losses get decompositions whose autodiff is eager's
(``_ABOVE_AUTOGRAD``: torch decomposes them above autograd; ``fxshard.jit`` calls them through
``margin_losses_as_eager``).

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
from fxshard.tracing.decompositions import EAGER_DERIVATIVE, decomposition_table, joint_decomposition_table
from fxshard.tracing.margin_losses import _multi_margin_loss, _multilabel_margin_loss_forward
from fxshard.rules.registry import lookup
from fxshard.devtools import validate
from tests.dist_utils import run_ranks

aten = torch.ops.aten
RTOL = 1e-4  # of the largest reference magnitude: a missing all-reduce or a NaN is far off


def _fake_quant(h: torch.Tensor) -> torch.Tensor:
    """Values on the integer grid in [-3, 3] (so exactly +-3 occur), gradient straight through."""
    return h + (h.clamp(-3, 3).round() - h).detach()


def _std_norm(h: torch.Tensor) -> torch.Tensor:
    return (h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + 1e-6)


def _std_mean_norm(h: torch.Tensor) -> torch.Tensor:
    std, mean = torch.std_mean(h, -1, keepdim=True)
    return (h - mean) / (std + 1e-6)


# name -> (f(h), scale of the input): lin1 (column-parallel) -> f -> lin2 (row-parallel)
ACTIVATIONS: dict[str, tuple[Callable, float]] = {
    "softplus": (F.softplus, 200.0),  # inputs > 88: exp overflows in the branch where() does not take
    "softplus_beta10": (lambda h: F.softplus(h, beta=10), 20.0),  # beta * x > 88
    "mish": (F.mish, 200.0),
    "celu": (lambda h: F.celu(h, alpha=0.5), 60.0),
    "sinc": (torch.sinc, 1.0),  # at exactly 0 (a zero sample, no bias)
    "hardswish": (lambda h: F.hardswish(_fake_quant(h)), 4.0),  # at exactly +-3
    "hardsigmoid": (lambda h: F.hardsigmoid(_fake_quant(h)), 4.0),
    # eager's formula in the tail (farther out, below about -100, it is ill-conditioned: an input 1 ulp off
    # changes eager's own gradient by more than RTOL, so a split matmul before it cannot match closer)
    "log_ndtr": (torch.special.log_ndtr, 10.0),
    "std": (_std_norm, 1.0),  # a constant (zero) row: std 0
    "std_mean": (_std_mean_norm, 1.0),
}
NO_BIAS = {"sinc", "std", "std_mean"}  # the zero sample must give exactly 0 before f


class _Act(nn.Module):
    def __init__(self, f: Callable, scale: float, bias: bool) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 16, bias=bias), nn.Linear(16, 4)
        self.f, self.scale = f, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.f(self.lin1(x * self.scale))).square().mean()


# name -> f(logits, y, labels, weight): on 16-class logits of a column-parallel linear (class-split when split)
LOSSES: dict[str, Callable] = {
    "bce_mean": lambda h, y, labels, w: F.binary_cross_entropy(torch.sigmoid(h), y),
    "bce_weight_sum": lambda h, y, labels, w: F.binary_cross_entropy(torch.sigmoid(h), y, weight=w, reduction="sum"),
    "bce_none": lambda h, y, labels, w: F.binary_cross_entropy(torch.sigmoid(h), y, reduction="none").sum(-1).mean(),
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
        # logits beyond +17 (sigmoid == 1.0) and below -27.6 (where eager's 1e-12 clamp acts)
        return self.f(self.lin1(x * 40), y, labels, self.w)


class _All(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ModuleDict({k: _Act(f, s, k not in NO_BIAS) for k, (f, s) in ACTIVATIONS.items()})
        self.loss = nn.ModuleDict({k: _Loss(f) for k, f in LOSSES.items()})

    def forward(self, x: torch.Tensor, y: torch.Tensor, labels: torch.Tensor) -> tuple:
        return tuple(m(x) for m in self.act.values()) + tuple(m(x, y, labels) for m in self.loss.values())


OUTPUTS = [f"act.{k}" for k in ACTIVATIONS] + [f"loss.{k}" for k in LOSSES]


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
    for k in ACTIVATIONS:
        plan[f"act.{k}.lin1.weight"] = P("tp", None)
        plan[f"act.{k}.lin2.weight"] = P(None, "tp")
        if k not in NO_BIAS:
            plan[f"act.{k}.lin1.bias"] = P("tp")
    for k in LOSSES:
        plan[f"loss.{k}.lin1.weight"], plan[f"loss.{k}.lin1.bias"] = P("tp", None), P("tp")
    return plan


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / (1 + max |want|); inf where ``got`` holds a NaN or inf (``want`` is finite)."""
    err = ((got - want).abs().max() / (1 + want.abs().max())).item()
    return err if err == err else float("inf")


def _train_all(rank: int, world: int) -> dict:
    """Per plan: per output, |sharded - eager| of the value and the largest relative gradient error of the
    parameters it reaches; the fallbacks and which kept ops the training forward holds."""
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
        kept = {str(n.target) for p in sm._programs() if p.label == "forward" for n in p.gm.graph.nodes}
        res[plan_name] = {"errs": errs, "fallbacks": sorted({f for p in sm._programs() for f in p.fallbacks}),
                          "kept": sorted(kept & {str(op) for op in EAGER_DERIVATIVE})}
    res["jit"] = _jit_margin_losses(mesh, rank, world, inputs)
    return res


# fxshard.jit traces Python functions with make_fx, where torch decomposes the margin losses above autograd
JIT_LOSSES: dict[str, Callable] = {
    "multilabel_margin": lambda h, labels: F.multilabel_margin_loss(h / 40, labels),
    "multilabel_margin_sum": lambda h, labels: nn.MultiLabelMarginLoss(reduction="sum")(h / 40, labels),
    "multi_margin": lambda h, labels: F.multi_margin_loss(_fake_quant(h / 10), labels[:, 0]),
    "multi_margin_p2": lambda h, labels: torch._C._nn.multi_margin_loss(_fake_quant(h / 10), labels[:, 0], 2, 1.0,
                                                                        None, 1),
}


def _jit_margin_losses(mesh, rank: int, world: int, inputs: tuple) -> dict:
    """Per loss: value and weight-gradient errors of ``fxshard.jit`` (weight class-split) against eager."""
    x, _, labels = inputs
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    errs = {}
    for name, f in JIT_LOSSES.items():
        def step(w: torch.Tensor, x: torch.Tensor, labels: torch.Tensor, f: Callable = f) -> tuple:
            return torch.func.grad_and_value(lambda w: f(x * 40 @ w.T, labels))(w)

        want_g, want_v = step(w, x, labels)
        jstep = fxshard.jit(step, mesh, in_specs=(P("tp", None), None, None), out_specs=(P("tp", None), None))
        got_g, got_v = jstep(w.chunk(world)[rank], x, labels)
        errs[name] = (_rel_err(got_v, want_v), _rel_err(got_g, want_g.chunk(world)[rank]))
    return errs


def test_traced_gradients_match_eager_on_two_ranks():
    """Forward values and every gradient as eager (no NaN) at the inputs that broke them, unsplit and split."""
    for res in run_ranks(_train_all, 2):
        assert res["eager_finite"]  # the comparison is against finite numbers
        for plan in ("empty", "split"):
            r = res[plan]
            bad = {k: v for k, v in r["errs"].items() if not (v[0] <= RTOL and v[1] <= RTOL)}
            assert not bad, (plan, bad)
            assert not r["fallbacks"], (plan, r["fallbacks"])
            assert r["kept"] == sorted(str(op) for op in EAGER_DERIVATIVE), (plan, r["kept"])
        bad = {k: v for k, v in res["jit"].items() if not (v[0] <= RTOL and v[1] <= RTOL)}
        assert not bad and len(res["jit"]) == len(JIT_LOSSES), bad


def test_kept_ops_stay_whole_in_both_tables_and_have_rules():
    forward, joint = decomposition_table(), joint_decomposition_table()
    for op in EAGER_DERIVATIVE:
        assert op not in forward and op not in joint, op
        assert lookup(op) is not None, op  # kept without a rule, it would run replicated


@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True], ids=["", "weight"])
def test_binary_cross_entropy_rule_matches_the_unsharded_op(reduction, weighted):
    """Every strategy of the rule on 2 and 3 simulated ranks, uneven splits included (7 and 5 rows)."""
    g = torch.Generator().manual_seed(2)
    p = torch.rand(7, 5, generator=g).clamp(1e-3, 1 - 1e-3)
    y = (torch.rand(7, 5, generator=g) > 0.5).float()
    args = (p, y, torch.rand(5, generator=g) + 0.5 if weighted else None, reduction)
    checked, bad = validate.check_call(aten.binary_cross_entropy.default, args, ranks=(2, 3))
    assert not bad, [f"{m.strategy} n={m.ranks}: {m.error}" for m in bad]
    assert checked >= 2 * 3  # all-replicated and a split of each dim, per rank count


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


def test_margin_losses_as_eager_binds_every_call_form_as_torch():
    """The mode fxshard.jit traces under: keyword calls of the torch._C._nn builtins, weight, p, legacy
    size_average, and what torch rejects (p=3, a 2-D weight) raises as in eager."""
    from fxshard.tracing.margin_losses import margin_losses_as_eager

    torch.manual_seed(0)
    x, t, w = torch.randn(4, 6), torch.tensor([1, 0, 5, 2]), torch.rand(6)
    labels = torch.full((4, 6), -1)
    labels[:, 0], labels[1, 1] = t, 3
    calls = {
        "c_keywords": lambda: torch._C._nn.multilabel_margin_loss(input=x, target=labels, reduction=1),
        "c_p2_weight": lambda: torch._C._nn.multi_margin_loss(x, t, 2, 0.5, w, 2),
        "weight_sum": lambda: F.multi_margin_loss(x, t, weight=w, reduction="sum"),
        "legacy": lambda: F.multilabel_margin_loss(x, labels, size_average=False),
        "module": lambda: nn.MultiMarginLoss(p=2, margin=0.7)(x, t),
    }
    for name, call in calls.items():
        with margin_losses_as_eager():
            got = call()
        assert torch.allclose(got, call(), atol=1e-6), name
    for call, error in ((lambda: torch._C._nn.multi_margin_loss(x, t, 3, 1.0, None, 1), RuntimeError),
                        (lambda: F.multi_margin_loss(x, t, weight=w[None]), ValueError)):
        with margin_losses_as_eager(), pytest.raises(error):
            call()
