"""Bad plans and unshardable models: one ShardingError whose message names the culprit.

Plan mistakes are checked on the fake process group (``conftest.fake_world``);
the fallback for an op without a rule is checked there for its warning and
plan, and on 2 real gloo ranks for its numbers.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import re
import warnings
from contextvars import ContextVar
from typing import Iterator

import pytest
import torch
import torch.nn as nn

import fxshard
import fxshard.frontends.shard
import fxshard.planner.propagate as propagate_mod
from fxshard import ColwiseParallel, P, RowwiseParallel, Shard, ShardingError
from fxshard.rules import registry
from fxshard.rules.registry import lookup
from tests import models
from tests.dist_utils import run_ranks

aten = torch.ops.aten
TOY_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}


def toy(hidden: int = 32) -> nn.Module:
    return models.ToyModel(16, hidden).requires_grad_(False)


def x8() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(0))


def shard_error(mesh, plan, model=None, inputs=None, **kw) -> str:
    with pytest.raises(ShardingError) as ei:
        fxshard.shard(model if model is not None else toy(), mesh, plan,
                      example_inputs=inputs if inputs is not None else (x8(),), **kw)
    return str(ei.value)


@pytest.fixture
def no_tracing(monkeypatch):
    """Plan errors must come before any tracing work: tracing fails the test."""

    def boom(*a, **k):
        raise AssertionError("traced before the plan was checked")

    monkeypatch.setattr(fxshard.frontends.shard, "trace_forward", boom)


# ----------------------------------------------------------------------------- plan entries


def test_glob_matching_nothing(mesh2, no_tracing):
    msg = shard_error(mesh2, {"net1.weight": P("tp", None), "layers.*.wq.weight": P("tp", None)})
    assert "'layers.*.wq.weight'" in msg and "matches no parameter" in msg and "'net1.weight'" in msg
    msg = shard_error(mesh2, {"mlp.*": ColwiseParallel()})
    assert "'mlp.*'" in msg and "matches no submodule" in msg


def test_module_name_given_a_spec_hints_at_weight(mesh2, no_tracing):
    msg = shard_error(mesh2, {"net1": P("tp", None)})
    assert "'net1'" in msg and "'net1.weight'" in msg


def test_unknown_mesh_axis(mesh2, no_tracing):
    msg = shard_error(mesh2, {"net1.weight": P("dp", None)})
    assert "'net1.weight'" in msg and "'dp'" in msg and "('tp',)" in msg


def test_unknown_mesh_axis_in_in_specs(mesh2):
    msg = shard_error(mesh2, TOY_PLAN, in_specs=P(None, "sp"))
    assert "in_specs" in msg and "'sp'" in msg


def test_spec_longer_than_tensor_rank(mesh2, no_tracing):
    msg = shard_error(mesh2, {"net1.bias": P("tp", None)})
    assert "'net1.bias'" in msg and "2 entries" in msg and "1 dims" in msg


@pytest.mark.parametrize("dim", [2, -3])
def test_shard_dim_out_of_range(mesh2, no_tracing, dim):
    msg = shard_error(mesh2, {"net2.weight": Shard(dim)})
    assert "'net2.weight'" in msg and f"dim {dim}" in msg and "2 dims" in msg


def test_conflicting_entries(mesh2, no_tracing):
    msg = shard_error(mesh2, {"net1.*": P("tp"), "net1.bias": P()})
    assert "'net1.*'" in msg and "'net1.bias'" in msg


def test_style_on_unsupported_module(mesh2, no_tracing):
    msg = shard_error(mesh2, {"relu": ColwiseParallel()})
    assert "'relu'" in msg and "ReLU" in msg and "ColwiseParallel" in msg


def test_plan_must_be_a_dict(mesh2, no_tracing):
    msg = shard_error(mesh2, [("net1", ColwiseParallel())])
    assert "plan must be a dict" in msg


# ----------------------------------------------------------------------------- divisibility


def test_split_leaving_a_rank_empty_names_param_dim_size_axis(fake_mesh):
    mesh = fake_mesh(4)
    # 6 over 4 ranks in torch.chunk pieces is 2, 2, 2, 0 (30 would be 8, 8, 8, 6: allowed)
    msg = shard_error(mesh, {"net1": ColwiseParallel()}, model=toy(hidden=6))
    assert re.search(r"net1\.weight dim 0 \(size 6\) cannot be split over mesh axis 'tp' \(4\): an uneven "
                     r"split needs at least one element on each of the 4 ranks", msg), msg
    msg = shard_error(mesh, {"net2": RowwiseParallel()}, model=toy(hidden=6))
    assert re.search(r"net2\.weight dim 1 \(size 6\).*'tp' \(4\)", msg), msg


def test_non_divisible_over_two_axes(fake_mesh):
    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    msg = shard_error(mesh, {"net1.bias": P(("dp", "tp"))}, model=toy(hidden=6))
    assert "net1.bias dim 0 (size 6)" in msg and "'dp' (2) x 'tp' (2)" in msg


def test_non_divisible_input(mesh2):
    msg = shard_error(mesh2, None, inputs=(torch.randn(1, 16),), in_specs=P("tp", None))
    assert "input 0" in msg and "size 1" in msg and "'tp' (2)" in msg


def test_tied_weights_placed_differently(mesh2):
    model = models.Transformer(vocab=64, dim=32, n_heads=4, n_layers=1, tie=True).requires_grad_(False)
    msg = shard_error(mesh2, {"tok_emb.weight": P("tp", None), "output.weight": P(None, "tp")}, model=model,
                      inputs=(models.make_tokens(2, 16, 64),))
    assert "tok_emb.weight" in msg and "output.weight" in msg and "tied" in msg


# ----------------------------------------------------------------------------- untraceable model


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return -x


def test_untraceable_model_names_the_user_source_line(mesh2):
    msg = shard_error(mesh2, {"lin": ColwiseParallel()}, model=_DataDependent().requires_grad_(False))
    src, first = inspect.getsourcelines(_DataDependent.forward)
    lineno = first + next(i for i, l in enumerate(src) if "if x.sum() > 0" in l)
    assert f"test_errors.py:{lineno}" in msg, msg
    assert "if x.sum() > 0" in msg
    assert "_DataDependent" in msg


# ----------------------------------------------------------------------------- fallback for an op without a rule


@contextlib.contextmanager
def _no_rule(op) -> Iterator[None]:
    """``op`` without its sharding rule for a while (the fallback is what the tests below check)."""
    rule, uneven = registry._RULES.pop(op), op in registry._UNEVEN
    registry._UNEVEN.discard(op)
    try:
        yield
    finally:
        registry._RULES[op] = rule
        if uneven:
            registry._UNEVEN.add(op)


class _FlipMiddle(nn.Module):
    """ToyModel with a flip (its rule taken away: ``_no_rule``) between the colwise and rowwise layers."""

    def __init__(self) -> None:
        super().__init__()
        self.m = models.ToyModel(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.m.relu(self.m.net1(x))
        return self.m.net2(torch.flip(h, [1]))


FLIP_PLAN = {"m.net1": ColwiseParallel(), "m.net2": RowwiseParallel()}


def test_no_rule_removes_and_restores_a_rule():
    rule = lookup(aten.flip.default)
    with _no_rule(aten.flip.default):
        assert lookup(aten.flip.default) is None
    assert lookup(aten.flip.default) is rule and rule is not None


@pytest.fixture
def flip_without_rule():
    with _no_rule(aten.flip.default):
        yield


def test_fallback_warns_and_gathers(mesh2, monkeypatch, flip_without_rule):
    # the warning is once per op (and context): start from a context that has warned about nothing
    monkeypatch.setattr(propagate_mod, "_WARNED", ContextVar("fallback_warned", default=frozenset()))
    with pytest.warns(UserWarning, match=r"no sharding rule for aten\.flip\.default"):
        sm = fxshard.shard(_FlipMiddle().requires_grad_(False), mesh2, FLIP_PLAN, example_inputs=(x8(),))
    text = fxshard.explain(sm)
    flip_row = next(l for l in text.splitlines() if "flip.default" in l)
    assert "FALLBACK" in flip_row
    assert "fallbacks (no sharding rule, computed replicated): aten.flip.default" in text
    stats = fxshard.comm_stats(sm)["forward"]
    assert {k: v["count"] for k, v in stats.items()} == {"all_gather": 1, "all_reduce": 1}
    with warnings.catch_warnings(record=True) as again:  # once per op: a second model does not warn again
        warnings.simplefilter("always")
        fxshard.shard(_FlipMiddle().requires_grad_(False), mesh2, FLIP_PLAN, example_inputs=(x8(),))
    assert not [w for w in again if "no sharding rule" in str(w.message)]


def _fallback_rank(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = _FlipMiddle().requires_grad_(False)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    ref = model(x)
    with warnings.catch_warnings(record=True) as caught, _no_rule(aten.flip.default):
        warnings.simplefilter("always")
        sm = fxshard.shard(model, mesh, FLIP_PLAN, example_inputs=(x,))
    out = sm(x)
    return {"err": (out - ref).abs().max().item(), "warnings": [str(w.message) for w in caught],
            "w1": tuple(sm.m.net1.weight.shape)}


def test_fallback_result_is_correct_on_two_ranks():
    for res in run_ranks(_fallback_rank, 2):
        assert res["err"] <= 1e-5
        assert res["w1"] == (16, 16)  # still sharded around the fallback
        assert any("no sharding rule for aten.flip.default" in w for w in res["warnings"]), res["warnings"]


def test_inspecting_something_not_sharded_is_a_sharding_error():
    """explain/comm_stats/memory name what they were given and how to get a sharded module (not a TypeError)."""
    for fn in (fxshard.explain, fxshard.comm_stats, fxshard.memory):
        with pytest.raises(fxshard.ShardingError, match=r"fxshard\.\w+ expects a module returned by fxshard\.shard.*"
                                                        r"got Linear"):
            fn(nn.Linear(2, 2))


class _FlatHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).reshape(-1, 8)


def test_a_group_cut_in_a_reshape_the_backward_makes_names_the_specs_not_a_projection(mesh2):
    """out_specs split the flattened output (18 rows = 3 x 6) over 2 ranks: the gradient's reshape back to
    [3, 6, 8] has no line in the model, so the fix to offer is the specs, not a ColwiseParallel option."""
    with pytest.raises(fxshard.ShardingError) as err:
        fxshard.shard(_FlatHead(), mesh2, {}, example_inputs=(torch.randn(3, 6, 8),), out_specs=fxshard.P("tp", None))
    msg = str(err.value)
    assert "no line of the model" in msg and "out_specs" in msg and "ColwiseParallel" not in msg, msg


class _SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(16, 8, sparse=True), nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


@pytest.mark.parametrize("style", [RowwiseParallel(), ColwiseParallel()])
def test_a_split_embedding_with_sparse_gradients_is_refused_at_shard(mesh2, style):
    """nn.Embedding(sparse=True) builds its gradient as a sparse COO tensor: split, its backward failed at the
    first call with aten::as_strided's NotImplementedError for SparseCPU. shard() now names the cause; kept
    replicated, the sparse gradient is eager's."""
    ids = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ShardingError, match=r"torch.sparse_coo tensor .* nn.Embedding\(sparse=True\).* pass sparse=False"):
        fxshard.shard(_SparseEmbedding(), mesh2, {"emb": style}, example_inputs=(ids,))
    model = _SparseEmbedding()
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {}, example_inputs=(ids,))
    sm(ids).pow(2).sum().backward()
    model(ids).pow(2).sum().backward()
    assert sm.emb.weight.grad.is_sparse
    torch.testing.assert_close(sm.emb.weight.grad.to_dense(), model.emb.weight.grad.to_dense(), rtol=0, atol=1e-6)
