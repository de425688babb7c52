"""Mesh axes with links of different speeds (``shard(bandwidth=..., latency=...)``, ``cost.links``): the
planners price a collective on a slow axis higher and move their bytes on the fast one."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxshard
from fxshard import P, ShardingError
from fxshard.cost import ALPHA, INTER_NODE, INTRA_NODE, UNIFORM, Link, crosses_nodes, links, transition_cost
from fxshard.placements import R, S


def test_links_from_bandwidth_and_latency():
    assert links(("dp", "tp")) == (UNIFORM, UNIFORM)
    dp, tp = links(("dp", "tp"), {"dp": 25e9, "tp": 100e9})
    assert tp == Link(ALPHA, 1.0) and dp == Link(ALPHA * 4, 4.0)  # 4x slower: bytes and latency cost 4x
    dp, tp = links(("dp", "tp"), {"dp": INTRA_NODE / 2}, {"tp": 1e-6})  # tp: the intra-node default
    assert dp == Link(ALPHA * 2, 2.0) and tp == Link(1e-6 * INTRA_NODE, 1.0)
    assert links(("dp", "tp"), latency={"dp": 1e-5})[0] == Link(1e-5 * INTRA_NODE, 1.0)
    # by default an axis whose groups span nodes is the slow one; a user's bandwidth overrides it
    dp, tp = links(("dp", "tp"), crosses_nodes=(True, False))
    assert tp == Link(ALPHA, 1.0) and dp.weight == INTRA_NODE / INTER_NODE
    assert links(("dp", "tp"), {"dp": INTRA_NODE}, crosses_nodes=(True, False)) == (UNIFORM, UNIFORM)
    # a collective on the 4x slower axis costs 4x: all-gather of 1 MiB over 2 ranks
    slow, fast = links(("dp", "tp"), {"dp": 25e9, "tp": 100e9})
    assert transition_cost(S(0), R, 2**20, 2, slow) == pytest.approx(4 * transition_cost(S(0), R, 2**20, 2, fast))
    assert transition_cost(S(0), R, 2**20, 2, fast) == transition_cost(S(0), R, 2**20, 2)


@pytest.mark.parametrize("bandwidth, latency, match", [
    ({"pp": 1e9}, None, "bandwidth names mesh axis 'pp', which the mesh does not have"),
    ({"dp": 0}, None, r"bandwidth\['dp'\]=0 is not a positive number; give bytes per second"),
    ({"dp": "fast"}, None, "is not a positive number"),
    (None, {"tp": -1.0}, r"latency\['tp'\]=-1.0 is not a non-negative number; give seconds per collective"),
])
def test_bad_links_are_sharding_errors(bandwidth, latency, match):
    with pytest.raises(ShardingError, match=match):
        links(("dp", "tp"), bandwidth, latency)


def test_axes_spanning_nodes_are_found_from_torchrun_local_world_size(fake_mesh, monkeypatch):
    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))  # ranks [[0, 1], [2, 3]]
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert crosses_nodes(mesh) == (False, False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # nodes {0, 1} and {2, 3}: tp inside a node, dp across
    assert crosses_nodes(mesh) == (True, False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert crosses_nodes(mesh) == (False, False)


class _MLP(torch.nn.Module):
    def __init__(self, d: int = 64, h: int = 512):
        super().__init__()
        self.up = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).sum()


def _split_axes(sm) -> set[int]:
    return {a for pls in sm._placements.values() for a, p in enumerate(pls) if p != R}


def test_the_plan_moves_its_bytes_on_the_fast_axis(fake_mesh, monkeypatch):
    """Auto-sharding a 2x2 mesh within a budget that forces a split: with ``tp`` the slow link the weights are
    split on ``dp`` only, and the other way round; equal bandwidths are the
    default plan on one node, and ``dp`` spanning nodes (torchrun's layout) makes it the slow axis by default."""
    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(16, 64)
    budget = int(sum(p.numel() for p in model.parameters()) * 16 * 0.6)

    def plan(**kw):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the activation estimate warning is not what is tested here
            return fxshard.shard(model, mesh, {}, example_inputs=(x,), in_specs=P("dp"), auto=True,
                                 memory_budget=budget, progress=False, **kw)

    slow_tp = plan(bandwidth={"dp": 1e12, "tp": 1e9})
    slow_dp = plan(bandwidth={"dp": 1e9, "tp": 1e12})
    assert _split_axes(slow_tp) == {0} and _split_axes(slow_dp) == {1}
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert plan(bandwidth={"dp": 5e10, "tp": 5e10})._placements == plan()._placements
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # dp spans nodes: the default makes it the slow axis
    assert plan()._placements == slow_dp._placements
