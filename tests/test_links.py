"""Mesh axes with links of different speeds (``shard(bandwidth=..., latency=...)``, ``cost.links``): the
planners price a collective on a slow axis higher and move their bytes on the fast one."""

from __future__ import annotations

import pytest
import torch

import fxshard
from fxshard import P, ShardingError
from fxshard.planner.cost import ALPHA, INTER_NODE, INTRA_NODE, UNIFORM, Link, crosses_nodes, links, transition_cost
from fxshard.core.placements import R, S


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


def test_both_planners_price_each_step_on_its_axis_link(fake_mesh, monkeypatch):
    """shard() hands the links to the planners (``MeshInfo.links``): the global planner's price of a layout
    change and the greedy sweep's per-axis price both scale with the axis's link, and torchrun's node layout
    sets the default."""
    from fxshard.planner.cost import axis_link, linked_mesh_info
    from fxshard.planner.problem import price

    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # dp spans nodes
    info = linked_mesh_info(mesh)
    assert info.links == links(("dp", "tp"), crosses_nodes=(True, False))
    gather_dp, gather_tp = ((S(0), R), (R, R)), ((R, S(0)), (R, R))
    ratio = INTRA_NODE / INTER_NODE
    assert price(*gather_dp, 2**20, (2, 2), info.links) == pytest.approx(ratio * price(*gather_dp, 2**20, (2, 2)))
    assert price(*gather_tp, 2**20, (2, 2), info.links) == price(*gather_tp, 2**20, (2, 2))
    assert transition_cost(S(0), R, 2**20, 2, axis_link(info, 0)) == pytest.approx(
        ratio * transition_cost(S(0), R, 2**20, 2, axis_link(info, 1)))
    sm = fxshard.shard(_MLP(), mesh, {}, example_inputs=(torch.randn(16, 64),), in_specs=P("dp"),
                       bandwidth={"dp": 1e9}, progress=False)
    assert sm._info.links == links(("dp", "tp"), {"dp": 1e9}, crosses_nodes=(True, False))


class _MLP(torch.nn.Module):
    def __init__(self, d: int = 64, h: int = 512):
        super().__init__()
        self.up = torch.nn.Linear(d, h)
        self.down = torch.nn.Linear(h, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).sum()
