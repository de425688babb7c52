"""Gradient bucketing (``passes/bucket.py``): bucket formation on the fake process group, numbers on a
real 2x2 mesh (4 gloo ranks, one spawn) against the unsharded model."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard import P
from fxshard.comm.collectives import COMM_KEY
from fxshard.frontends.backend import overlap_report
from fxshard.runtime.state_interop import local_slice
from fxshard.passes.bucket import bucket_gradients, plan_buckets
from fxshard.comm.collectives import all_reduce_into_input
from fxshard.passes.pipeline import BUCKET, DEFAULT, Pipeline
from tests import models
from tests.dist_utils import run_ranks
from tests.test_mesh2d import transformer_specs

c10d = torch.ops._c10d_functional


def test_plan_buckets_caps_size_groups_keys_and_orders_by_readiness():
    items = [("f32", 40), ("f64", 8), ("f32", 40), ("f32", 40), ("f64", 8), ("f32", 200), ("f32", 10)]
    # f32: 40+40 fit 100, the third 40 would pass it -> next bucket; 200 alone; 10 last
    assert plan_buckets(items, 100) == [[0, 2], [3], [1, 4], [5], [6]]
    assert plan_buckets(items, 10**9) == [[1, 4], [0, 2, 3, 5, 6]]
    assert plan_buckets(items, 0) == [[i] for i in range(7)]


class _MLP(nn.Module):
    """Four 16x16 layers (1088 bytes of fp32 gradients each); ``l1`` in float64 (2176 bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(16, 16) for _ in range(4))
        self.l1.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.l0(x))
        x = torch.tanh(self.l1(x.double())).float()
        return (self.l3(torch.tanh(self.l2(x))) ** 2).sum()


def _buckets(sm) -> list[list[str]]:
    """Per bucket collective of the backward program (in issue order), the parameters it reduces."""
    tr = sm._training
    gm = tr.bwd.gm
    out = next(n for n in gm.graph.nodes if n.op == "output")
    grads = list(out.args[0])
    params = [s.names[0] for i, s in enumerate(sm._slots) if i in tr.diff_in]

    def param_of(n: torch.fx.Node) -> str:
        while n not in grads:
            (n,) = n.users
        return params[grads.index(n)]

    res = []
    for c in gm.graph.nodes:
        if COMM_KEY in c.meta:
            (wait,) = c.users
            users = list(wait.users)
            if users[0].target is torch.ops.aten.split_with_sizes.default:
                items = sorted(users[0].users, key=lambda g: g.args[1])
                res.append([param_of(g) for g in items])
            else:
                res.append([param_of(wait)])
    return res


def test_buckets_respect_the_cap_group_dtypes_and_follow_readiness(fake_mesh):
    mesh = fake_mesh(2, names=("dp",))
    x = torch.randn(4, 16)
    # the greedy sweep's data-parallel plan: on this 4-row batch the global planner gathers the batch rather
    # than all-reducing 8 gradients (it prices each all_reduce's latency, though buckets merge them: open)
    sm = fxshard.shard(_MLP(), mesh, {}, example_inputs=(x,), in_specs=(P("dp"),), bucket_mb=2200 / 2**20,
                       planner="greedy")
    # backward computes l3's gradients first; fp32 buckets hold two layers (2176 <= 2200 bytes), the
    # float64 layer (2176 bytes) is a bucket of its own
    got = [sorted(b) for b in _buckets(sm)]
    assert got == [["l2.bias", "l2.weight", "l3.bias", "l3.weight"], ["l1.bias", "l1.weight"],
                   ["l0.bias", "l0.weight"]], got
    stats = fxshard.comm_stats(sm)["backward"]["all_reduce"]
    plain = fxshard.shard(_MLP(), mesh, {}, example_inputs=(x,), in_specs=(P("dp"),), bucket_mb=None, planner="greedy")
    assert fxshard.comm_stats(plain)["backward"]["all_reduce"] == {"count": 8, "bytes": stats["bytes"]}
    assert stats["count"] == 3
    # the packing is the pipeline's bucket stage (backward programs only): without it, one per gradient
    bare = Pipeline(tuple(p for p in DEFAULT.passes if p is not BUCKET))
    alone = fxshard.shard(_MLP(), mesh, {}, example_inputs=(x,), in_specs=(P("dp"),), bucket_mb=2200 / 2**20,
                          pipeline=bare, planner="greedy")
    assert fxshard.comm_stats(alone)["backward"]["all_reduce"] == {"count": 8, "bytes": stats["bytes"]}
    assert "bucket" in DEFAULT.names and BUCKET.program == "backward"
    # each bucket is issued before the backward has finished: compute runs between issue and wait
    rows = [r for r in overlap_report(sm) if r["program"] == "backward"]
    assert len(rows[0]["overlapped"]) > 0 and len(rows[1]["overlapped"]) > 0, rows


def test_bucket_mb_must_be_a_size(fake_mesh):
    mesh = fake_mesh(2, names=("dp",))
    with pytest.raises(fxshard.ShardingError, match="bucket_mb=-1"):
        fxshard.shard(_MLP(), mesh, {}, example_inputs=(torch.randn(4, 16),), bucket_mb=-1)


def _grads_2x2(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(dp=2, tp=2)
    dp_rank = mesh.get_coordinate()[0]
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16, tie=True)
    x, y = models.make_tokens(4, 16, 64, seed=0), models.make_tokens(4, 16, 64, seed=10)
    ref = copy.deepcopy(model)
    want = ref(x, y)
    want.backward()
    full = dict(ref.named_parameters())
    out = {}
    for fsdp in (False, True):
        # shard once without buckets, then run the same programs with the backward bucketed at each size
        sm = fxshard.shard(copy.deepcopy(model), mesh, transformer_specs(2, fsdp), example_inputs=(x, y),
                           in_specs=(P("dp"), P("dp")), bucket_mb=None, planner="greedy")  # as above: DDP's all_reduces
        plain = sm._training.bwd.gm
        for mb in (None, 25, 0.004):
            if mb is not None:
                sm._training.bwd.gm = bucket_gradients(copy.deepcopy(plain), int(mb * 2**20))
            sm.zero_grad(set_to_none=True)
            loss = sm(x.chunk(2)[dp_rank], y.chunk(2)[dp_rank])
            loss.backward()
            grad_err = max((p.grad - local_slice(full[n].grad, mesh, sm._placements[n])).abs().max().item()
                           for n, p in sm.named_parameters())
            dp_ar = [c for c in sm._training.bwd.gm.graph.nodes if COMM_KEY in c.meta
                     and c.target in (c10d.all_reduce.default, all_reduce_into_input)
                     and c.meta[COMM_KEY]["axis"] == "dp"]
            out[(fsdp, mb)] = {"loss_err": abs(loss.item() - want.item()), "grad_err": grad_err,
                               "stats": fxshard.comm_stats(sm)["backward"], "dp_all_reduces": len(dp_ar),
                               "n_grads": sum(1 for _ in sm.parameters())}
    return out


def test_bucketed_gradients_match_unsharded_on_2x2_with_fewer_all_reduces_and_the_same_bytes():
    for res in run_ranks(_grads_2x2, 4, timeout=300):
        for key, r in res.items():
            assert r["loss_err"] <= 1e-5 and r["grad_err"] <= 1e-5, (key, r)
        plain, one, small = res[(False, None)], res[(False, 25)], res[(False, 0.004)]
        # one all-reduce per dp-replicated gradient without buckets; one bucket at 25 MiB; a few at 4 KiB
        assert plain["dp_all_reduces"] == plain["n_grads"], plain
        assert one["dp_all_reduces"] == 1, one
        assert 1 < small["dp_all_reduces"] < plain["dp_all_reduces"], small
        for r in (one, small):  # the same bytes in fewer collectives
            assert {k: v["bytes"] for k, v in r["stats"].items()} == {k: v["bytes"] for k, v in plain["stats"].items()}
        for mb in (25, 0.004):
            assert ({k: v["bytes"] for k, v in res[(True, mb)]["stats"].items()}
                    == {k: v["bytes"] for k, v in res[(True, None)]["stats"].items()})
