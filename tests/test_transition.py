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
