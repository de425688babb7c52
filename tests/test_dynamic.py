"""Dynamic shapes: one shard() serves many sizes; sizes the sharding cannot take fail at call time.

Numbers come from 2 real gloo ranks against the unsharded model; checks of inputs and
declarations use the fake process group.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

import fxshard
from fxshard import P, ShardingError
from tests import models
from tests.dist_utils import run_ranks
from tests.test_forward_parity import transformer_plan

TOL = 1e-5


class SeqSplit(torch.nn.Module):
    """A projection whose output is pinned sequence-split (as sequence parallel does) before a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fxshard.constrain(self.lin(x), P(None, "tp", None))
        return torch.tanh(h).pow(2).mean()


def _seq_split(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = SeqSplit()
    sm = fxshard.shard(copy.deepcopy(model), mesh, {}, example_inputs=(torch.randn(2, 6, 8),),
                       dynamic_shapes=({1: 2 * Dim("half", min=1, max=32)},))
    opt_ref, opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(sm.parameters(), lr=0.5)
    worst = 0.0
    for seq in (4, 10, 6):
        x = torch.randn(2, seq, 8, generator=torch.Generator().manual_seed(seq))
        for m, o in ((model, opt_ref), (sm, opt)):
            o.zero_grad()
            loss = m(x)
            loss.backward()
            o.step()
        worst = max(worst, abs(model(x).item() - sm(x).item()))
    err = ""
    try:
        sm(torch.randn(2, 7, 8))
    except ShardingError as e:
        err = str(e)
    w = sm.full_state_dict()["lin.weight"]
    disagree = {}
    # each rank's size is valid alone; together they are no global input (a replicated dim of other
    # lengths; a split dim of 5 rows given as 3 + 2, which the greedy plan computed a wrong mean for)
    batch_split = fxshard.shard(copy.deepcopy(model), mesh, {}, example_inputs=(torch.randn(4, 6, 8),),
                                in_specs=(P("tp"),), dynamic_shapes=({0: 2 * Dim("half", min=2, max=16)},),
                                planner="greedy")
    for name, m, x in (("replicated", sm, torch.randn(2, 4 + 2 * rank, 8)),
                       ("split", batch_split, torch.randn(5, 6, 8).split([3, 2])[rank])):
        try:
            m(x)
        except ShardingError as e:
            disagree[name] = str(e)
    return {"loss_err": worst, "w_err": (w - model.lin.weight).abs().max().item(), "odd_error": err,
            "disagree": disagree}


def test_dynamic_sequence_split_trains_at_new_lengths_and_rejects_an_odd_one():
    """Also: ranks whose pieces are each valid but disagree on a dynamic size raise on every rank."""
    for r in run_ranks(_seq_split, 2):
        assert r["loss_err"] <= TOL and r["w_err"] <= TOL, r
        assert "input 0 dim 1 has global size 7, but it was declared as 2*" in r["odd_error"], r
        assert set(r["disagree"]) == {"replicated", "split"}, r
        assert all("the ranks of the mesh disagree" in e for e in r["disagree"].values()), r


def test_dynamic_dim_that_must_split_needs_a_multiple_declared(mesh2):
    with pytest.raises(ShardingError, match=r"dim 1 \(s\d+\) is dynamic: declare it as a multiple of 2 in "
                                            r"dynamic_shapes, e.g. \{1: 2 \* torch.export.Dim\('n'\)\}"):
        fxshard.shard(SeqSplit(), mesh2, {}, example_inputs=(torch.randn(2, 6, 8),),
                      dynamic_shapes=({1: Dim("seq", min=2, max=64)},))


@pytest.fixture
def dyn_batch(mesh2):
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=1, max_seq=16)
    b = Dim("batch", min=1, max=8)
    ex = (models.make_tokens(2, 8, 64), models.make_tokens(2, 8, 64, seed=1))
    return fxshard.shard(model, mesh2, transformer_plan(1), example_inputs=ex, dynamic_shapes=({0: b}, {0: b}))


@pytest.mark.parametrize("shapes, message", [
    (((4, 8), (2, 8)), r"input 1 dim 0 gives s\d+ = 2, but input 0 dim 0 gave s\d+ = 4; dims declared with the "
                       r"same Dim must agree"),
    (((4, 9), (4, 9)), r"input 0 dim 1 has local size 9, but the module was sharded for global size 8; pass that "
                       r"size, or declare the dim dynamic"),
    (((9, 8), (9, 8)), r"input 0 dim 0 has global size 9 \(s\d+ = 9\), outside the declared range"),
    (((1, 8), (1, 8)), r"global size 1 .* in \[2, 8\] \(torch.export treats sizes 0 and 1 as special, so a "
                       r"dynamic size starts at 2 even if its Dim says min=1\)"),
])
def test_inputs_violating_the_sharded_shapes_fail_at_call_time(dyn_batch, shapes, message):
    (b0, t0), (b1, t1) = shapes
    with pytest.raises(ShardingError, match=message):
        dyn_batch(models.make_tokens(b0, t0, 64), models.make_tokens(b1, t1, 64))


def test_wrong_rank_input_is_a_sharding_error(dyn_batch):
    with pytest.raises(ShardingError, match=r"input 0 has 1 dims but the module was sharded for 2"):
        dyn_batch(torch.zeros(8, dtype=torch.long), models.make_tokens(2, 8, 64))


def _batch_and_seq(rank: int, world: int) -> dict:
    from tests.test_training import _max_param_diff, _train

    mesh = fxshard.init_mesh(tp=world)
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=1, max_seq=16)
    b, s = Dim("batch", min=1, max=64), Dim("seq", min=2, max=16)
    ex = (models.make_tokens(2, 8, 64), models.make_tokens(2, 8, 64, seed=1))
    sm = fxshard.shard(copy.deepcopy(model), mesh, transformer_plan(1), example_inputs=ex,
                       dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}), planner="greedy")  # Megatron's pattern
    batches = [(models.make_tokens(bb, ss, 64, seed=bb), models.make_tokens(bb, ss, 64, seed=bb + 50))
               for bb, ss in ((2, 8), (4, 5), (3, 16))]
    ref_l, l = _train(model, sm, batches, lambda m, x: m(*x), "sgd", 3)
    return {"loss_err": max(abs(a - b) for a, b in zip(ref_l, l)),
            "param_err": _max_param_diff(sm.full_state_dict(), model), "stats": fxshard.comm_stats(sm)}


def test_dynamic_batch_and_sequence_train_with_heads_kept_split():
    for r in run_ranks(_batch_and_seq, 2):
        assert r["loss_err"] <= 1e-4 and r["param_err"] <= TOL, r
        # Megatron's attention/MLP all_reduces only: q, k, v stay head-split at every size
        assert "all_gather" not in r["stats"]["forward"], r["stats"]


def test_a_global_input_at_call_time_names_the_convention(mesh2):
    """shard() takes global example_inputs and calls take local pieces; a call with the global size (or a
    module sharded from local example_inputs, then called with them) says so."""
    sm = fxshard.shard(models.ToyModel(16, 32), mesh2, {}, example_inputs=(torch.randn(8, 16),), in_specs=(P("tp"),))
    with pytest.raises(ShardingError, match=r"input 0 dim 0 has size 8, the GLOBAL size the module was sharded for "
                                            r"\(8 split 2 ways: this rank holds 4\): a ShardedModule takes this rank's "
                                            r"local piece .* example_inputs always have global shapes"):
        sm(torch.randn(8, 16))


class Scaled(torch.nn.Module):
    """A forward with Python scalars among its arguments (torch.export bakes them into the program)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float, *, relu: bool = False) -> torch.Tensor:
        y = self.lin(x) * scale
        return y.relu() if relu else y


def test_python_scalar_arguments_are_baked_in_and_checked_at_call_time(mesh2):
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 8)
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {"lin": fxshard.ColwiseParallel()}, example_inputs=(x, 2.0),
                       example_kwargs={"relu": True}, out_specs=P(None, "tp"))
    want = model(x, 2.0, relu=True)
    got = sm(x, 2.0, relu=True)
    torch.testing.assert_close(got, want[:, :4], rtol=0, atol=1e-6)
    got.sum().backward()  # the training program feeds the same leaves
    want[:, :4].sum().backward()
    torch.testing.assert_close(sm.lin.weight.grad, model.lin.weight.grad[:4], rtol=0, atol=1e-6)
    with pytest.raises(ShardingError, match=r"positional argument 1 is 3.0, but the module was sharded with 2.0 "
                                            r"there .* shard again with this value"):
        sm(x, 3.0, relu=True)
    with pytest.raises(ShardingError, match=r"keyword argument 'relu' is False, but the module was sharded with True"):
        sm(x, 2.0, relu=False)
    with pytest.raises(ShardingError, match=r"positional argument 1 is 2, but the module was sharded with 2.0"):
        sm(x, 2, relu=True)
    with pytest.raises(ShardingError, match=r"positional argument 1 is a tensor of shape \[4, 8\] \(torch.float32\), "
                                            r"but the module was sharded with 2.0"):
        sm(x, x, relu=True)  # named by shape and dtype, not printed in full
