"""The one transition planner (``fxshard/transition.py``): the bytes propagation prices are the bytes
of the collectives redistribution emits, for a table of layout changes on several meshes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.fx as fx

from fxshard.collectives import Emitter, redistribute_nodes
from fxshard.cost import price, transition_cost
from fxshard.ir import COMM_KEY
from fxshard.mesh import MeshInfo
from fxshard.placements import Part, R, S
from fxshard.spec import Spec, local_shape, split_ok
from fxshard.transition import plan_transition

PLACEMENTS = [R, S(0), S(1), Part("sum"), Part("max")]
# (axis sizes, this rank's coordinates, global shape): even and uneven sizes, 1-D and 2x2 meshes
CASES = [
    ((2,), (0,), (8, 6)),
    ((2,), (1,), (5, 7)),
    ((4,), (3,), (8, 12)),
    ((3,), (2,), (7, 5)),
    ((2, 2), (0, 1), (8, 4)),
    ((2, 2), (1, 1), (6, 10)),
    ((2, 2), (1, 0), (5, 3)),
]


def _mesh(sizes: tuple, coords: tuple) -> MeshInfo:
    names = tuple(f"a{i}" for i in range(len(sizes)))
    return MeshInfo(names, sizes, coords, tuple(f"g{i}" for i in range(len(sizes))), "cpu", 0)


def _emitted(src: tuple, dst: tuple, shape: tuple, mesh: MeshInfo, dtype: torch.dtype) -> list[tuple[str, int]]:
    """(kind, bytes) of every collective ``redistribute_nodes`` emits for the change."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(local_shape(shape, src, mesh.sizes, mesh.coords), dtype=dtype, device="meta")
    out = g.output(None)
    redistribute_nodes(Emitter(g, out, {}), x, Spec(src, shape, dtype), dst, mesh)
    return [(n.meta[COMM_KEY]["kind"], n.meta[COMM_KEY]["bytes"]) for n in g.nodes if COMM_KEY in n.meta]


def _layouts(k: int, shape: tuple, sizes: tuple) -> list[tuple]:
    return [pls for pls in itertools.product(PLACEMENTS, repeat=k) if split_ok(shape, pls, sizes, uneven=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16])
def test_priced_bytes_equal_emitted_bytes(dtype):
    checked = 0
    for sizes, coords, shape in CASES:
        mesh = _mesh(sizes, coords)
        layouts = _layouts(len(sizes), shape, sizes)
        for src, dst in itertools.product(layouts, layouts):
            steps = plan_transition(src, dst, shape, mesh, dtype)
            planned = [(st.kind, st.nbytes) for st in steps if st.is_collective]
            assert planned == _emitted(src, dst, shape, mesh, dtype), (sizes, coords, shape, src, dst)
            checked += bool(planned)
    assert checked > 300  # the table exercises gathers, reductions, reduce_scatters and all_to_alls


def test_every_collective_kind_is_in_the_table():
    kinds = set()
    for sizes, coords, shape in CASES:
        mesh = _mesh(sizes, coords)
        layouts = _layouts(len(sizes), shape, sizes)
        for src, dst in itertools.product(layouts, layouts):
            kinds |= {st.kind for st in plan_transition(src, dst, shape, mesh, torch.float32)}
    assert kinds == {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "slice", "to_partial"}


@pytest.mark.parametrize("n", [2, 4])
def test_propagation_price_is_the_price_of_the_planned_steps(n):
    """``cost.transition_cost`` (what propagation weighs per mesh axis) prices the planner's steps for
    the value: on an even split, the same number as pricing the steps planned for its real shape."""
    shape, dtype = (4 * n, 2 * n), torch.float32
    mesh = _mesh((n,), (0,))
    nbytes = shape[0] * shape[1] * dtype.itemsize
    for src, dst in itertools.product(PLACEMENTS, PLACEMENTS):
        want = price(plan_transition((src,), (dst,), shape, mesh, dtype), (n,))
        assert transition_cost(src, dst, nbytes, n) == pytest.approx(want, rel=1e-12), (src, dst)


@pytest.mark.parametrize("order", ["dp_major", "tp_major"])
def test_a_merged_dim_split_by_a_plain_and_a_strided_axis(order):
    """``[B*H]`` with ``B`` on dp and ``H`` on tp (attention's merge): plain ``S(0)`` on dp, strided
    ``S(0, B)`` on tp. Legal together, and slicing a replicated value into it gives every rank the
    ``[B/dp, H/tp]`` block of the unmerged tensor, whichever mesh axis is major (the strided step
    sees ``B/dp`` blocks in the local piece once dp has cut it)."""
    B, H, D = 4, 6, 3
    plain, strided = S(0), S(0, B)
    pls = (plain, strided) if order == "dp_major" else (strided, plain)
    sizes = (2, 3) if order == "dp_major" else (3, 2)
    assert split_ok((B * H, D), pls, sizes)
    assert not split_ok((B * H, D), (S(0, 3), strided), (2, 3))  # two strided axes on one dim
    assert not split_ok((B * H, D), (S(0), S(0, 2)), (4, 3))  # dp cuts inside the strided blocks
    x = torch.arange(B * H * D, dtype=torch.float32).view(B * H, D)
    for coords in itertools.product(*(range(n) for n in sizes)):
        mesh = _mesh(sizes, coords)
        dp, tp = coords if order == "dp_major" else coords[::-1]
        g = fx.Graph()
        inp = g.placeholder("x")
        inp.meta["val"] = torch.empty(B * H, D, device="meta")
        out = g.output(None)
        piece = redistribute_nodes(Emitter(g, out, {}), inp, Spec((R, R), (B * H, D), torch.float32), pls, mesh)
        out.args = (piece,)
        got = fx.GraphModule(torch.nn.Module(), g)(x)
        want = x.view(B, H, D)[dp * 2:(dp + 1) * 2, tp * 2:(tp + 1) * 2].reshape(-1, D)
        assert torch.equal(got, want), (order, coords)
        assert got.shape == local_shape((B * H, D), pls, sizes, coords)
