"""Gradients the model's own code defines must reach the sharded backward or fail loudly.

fxshard exports the forward and derives the backward itself (``fxshard/tracing/custom_grads.py``). On 2 gloo
ranks (one ``run_ranks`` call), against the unsharded model on the same process, forward values and every
full gradient:

* ``torch.utils.checkpoint`` with ``use_reentrant=True`` (what HF's ``gradient_checkpointing_enable()`` can use) around
  tensor-parallel blocks with dropout: export put everything after the first checkpoint under
  ``no_grad``, so no parameter got a gradient; ``use_reentrant=False`` alongside;
* a reentrant checkpoint on an input that needs no gradient: its block gets none, as in eager;
* a ``torch.library.custom_op`` with ``register_autograd`` (the way out the errors name) keeps its backward.

Loud failures (fake process group): an ``autograd.Function`` applied to a tensor that requires grad
(a straight-through estimator: its backward was replaced by the derivative of ``round``, zero), a
``Tensor.register_hook`` in ``forward`` (it never ran: a third of eager's gradient), a full backward hook
on a submodule. Without a gradient to compute (weights frozen), the Function shards and matches eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as checkpoint

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel, ShardingError
from tests.dist_utils import run_ranks
from tests.test_autograd_semantics import _grad_err

TOL = 1e-5


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.net2(torch.relu(self.net1(x))))


class _Checkpointed(nn.Module):
    """``inp`` -> checkpointed blocks -> ``head``; ``raw`` checkpoints the first block on the input itself."""

    def __init__(self, reentrant: bool, raw: bool = False) -> None:
        super().__init__()
        self.reentrant, self.raw = reentrant, raw
        self.inp, self.head = nn.Linear(8, 8), nn.Linear(8, 4)
        self.layers = nn.ModuleList([_Block() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.raw else self.inp(x)
        for i, layer in enumerate(self.layers):
            h = checkpoint.checkpoint(layer, h, use_reentrant=self.reentrant) if i == 0 or not self.raw else layer(h)
        return self.head(h)


_PLAN = {f"layers.{i}.{name}": style for i in range(2)
         for name, style in (("net1", ColwiseParallel()), ("net2", RowwiseParallel()))}


@torch.library.custom_op("fxshard_test::scaled_round", mutates_args=())
def _scaled_round(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)


@_scaled_round.register_fake
def _scaled_round_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_scaled_round.register_autograd(lambda ctx, grad: grad * 3)


class _RoundOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(_scaled_round(self.net1(x)))


def _cases(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    out: dict = {}
    for name, model, plan in (("reentrant", _Checkpointed(True), _PLAN),
                              ("non_reentrant", _Checkpointed(False), _PLAN),
                              ("reentrant_raw_input", _Checkpointed(True, raw=True), _PLAN),
                              ("custom_op", _RoundOp(), {"net1": ColwiseParallel(), "net2": RowwiseParallel()})):
        ref = copy.deepcopy(model)
        sm = fxshard.shard(model, mesh, plan, example_inputs=(x,))
        torch.manual_seed(1)
        got = sm(x)
        (got * torch.arange(got.numel()).view_as(got)).sum().backward()
        torch.manual_seed(1)
        want = ref(x)
        (want * torch.arange(want.numel()).view_as(want)).sum().backward()
        out[name] = {"fwd": (got - want).abs().max().item(), "grad": _grad_err(sm, ref, relative=True),
                     "no_grad": sorted(n for n, p in sm.named_parameters() if p.grad is None),
                     "eager_no_grad": sorted(n for n, p in ref.named_parameters() if p.grad is None)}
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return run_ranks(_cases, 2, timeout=600)


def test_reentrant_checkpointing_in_the_model_trains_like_eager(cases):
    for r in cases:
        for name in ("reentrant", "non_reentrant"):
            c = r[name]
            assert c["fwd"] <= TOL and c["grad"] <= TOL and c["no_grad"] == c["eager_no_grad"] == [], (name, c)


def test_a_reentrant_checkpoint_on_an_input_without_gradient_leaves_its_block_without_one(cases):
    for r in cases:
        c = r["reentrant_raw_input"]
        assert c["fwd"] <= TOL and c["grad"] <= TOL, c
        unused = ["inp.bias", "inp.weight"]  # the raw variant does not call inp
        assert c["no_grad"] == c["eager_no_grad"] == unused + [f"layers.0.{m}.{p}" for m in ("net1", "net2")
                                                               for p in ("bias", "weight")], c


def test_a_custom_op_with_its_own_backward_keeps_it(cases):
    for r in cases:
        assert r["custom_op"]["fwd"] <= TOL and r["custom_op"]["grad"] <= TOL, r["custom_op"]


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.net1(x))


class _Ste(_Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(_StraightThrough.apply(self.net1(x)))


class _Hooked(_Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net1(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 3)
        return self.net2(h)


def test_an_autograd_function_that_needs_its_backward_is_refused(mesh2):
    apply = torch.autograd.Function.__dict__["apply"]  # a classmethod, a C descriptor from torch 2.14
    with pytest.raises(ShardingError, match=r"autograd.Function .*_StraightThrough to a tensor that requires grad"):
        fxshard.shard(_Ste(), mesh2, {"net1": ColwiseParallel()}, example_inputs=(torch.randn(2, 8),))
    assert torch.autograd.Function.__dict__["apply"] is apply  # restored


def test_an_autograd_function_without_gradients_to_compute_is_traced(mesh2):
    model = _Ste().requires_grad_(False)
    x = torch.randn(2, 8)
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {}, example_inputs=(x,))
    assert torch.equal(sm(x), model(x))


def test_a_gradient_hook_in_forward_is_refused(mesh2):
    with pytest.raises(ShardingError, match=r"gradient hook .* on a tensor of shape \[2, 8\] with Tensor.register_hook"):
        fxshard.shard(_Hooked(), mesh2, {}, example_inputs=(torch.randn(2, 8),))
    t = torch.ones(2, requires_grad=True)
    t.register_hook(lambda g: g * 2)  # restored outside the trace
    (t * 1).sum().backward()
    assert torch.equal(t.grad, torch.full((2,), 2.0))


def test_a_backward_hook_on_a_submodule_is_refused(mesh2):
    for register in ("register_full_backward_hook", "register_backward_hook"):  # the second: on its grad_fn
        model = _Plain()
        getattr(model.net1, register)(lambda mod, gin, gout: None)
        with pytest.raises(ShardingError, match=r"backward hook on 'net1' \(register_full_backward_hook"):
            fxshard.shard(model, mesh2, {}, example_inputs=(torch.randn(2, 8),))


class _Square(torch.autograd.Function):
    """A hand-written backward that is exactly the derivative of the forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _Squared(_Plain):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(_Square.apply(self.net1(x)))


def test_a_function_declared_to_backpropagate_its_derivative_is_traced(mesh2):
    x = torch.randn(2, 8)
    with pytest.raises(ShardingError, match=r"declare it with fxshard.allow_autograd_function\(_Square\)"):
        fxshard.shard(_Squared(), mesh2, {}, example_inputs=(x,))
    assert fxshard.allow_autograd_function(_Square) is _Square
    model = _Squared()
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {}, example_inputs=(x,))  # replicated: no collective
    sm(x).sum().backward()
    model(x).sum().backward()
    for n, p in sm.named_parameters():
        torch.testing.assert_close(p.grad, model.get_parameter(n).grad)
    with pytest.raises(ShardingError, match=r"expects a torch.autograd.Function subclass, got <class"):
        fxshard.allow_autograd_function(nn.Linear)


def test_phimoe_multiplier_backward_is_the_derivative_of_its_forward():
    """Why PhiMoE's PhimoeMultiplier is on the built-in list: autodiff of its forward gives its backward's
    gradients on the tiny zoo model (tests/test_hf_zoo.py then trains phimoe exactly under fxshard)."""
    import transformers.models.phimoe.modeling_phimoe as phimoe

    from tests.test_hf_zoo import build

    model, kwargs = build("phimoe")
    traced = copy.deepcopy(model)
    custom, calls = phimoe.PhimoeMultiplier.apply, []

    def counted(*args):
        calls.append(1)
        return custom(*args)

    try:
        phimoe.PhimoeMultiplier.apply = staticmethod(counted)
        model(**kwargs).loss.backward()
        phimoe.PhimoeMultiplier.apply = staticmethod(lambda scores, multiplier, selected, gates, mask: multiplier * mask)
        traced(**kwargs).loss.backward()
    finally:
        phimoe.PhimoeMultiplier.apply = custom
    assert calls, "the tiny model never applied PhimoeMultiplier"
    gate = [n for n, _ in model.named_parameters() if n.endswith("router.weight") or n.endswith("gate.weight")]
    assert gate, [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        torch.testing.assert_close(traced.get_parameter(n).grad, p.grad, rtol=1e-5, atol=1e-7)
