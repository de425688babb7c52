"""The one transition planner (``fxshard/comm/transition.py``): the bytes propagation prices are the bytes
of the collectives redistribution emits, for a table of layout changes on several meshes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.fx as fx

from fxshard.state.checkpoint import take
from fxshard.comm.collectives import Emitter, redistribute_nodes
from fxshard.planner.cost import price, transition_cost
from fxshard.core.ir import COMM_KEY
from fxshard.core.mesh import MeshInfo
from fxshard.core.placements import Part, R, S
from fxshard.core.spec import Spec, local_shape, split_ok
from fxshard.comm.transition import plan_transition
from tests.dist_utils import run_ranks

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


def _redistributed(x: torch.Tensor, src: tuple, shape: tuple, dst: tuple, mesh: MeshInfo) -> torch.Tensor:
    """Runs the nodes ``redistribute_nodes`` emits on ``x``, this rank's piece of ``shape`` laid out as ``src``."""
    g = fx.Graph()
    inp = g.placeholder("x")
    inp.meta["val"] = torch.empty(x.shape, dtype=x.dtype, device="meta")
    out = g.output(None)
    out.args = (redistribute_nodes(Emitter(g, out, {}), inp, Spec(src, shape, x.dtype), dst, mesh),)
    # contiguous, as the placeholder's meta says (a slice of the full tensor is not; torch 2.11's collectives
    # refuse such an input, later ones copy it)
    return fx.GraphModule(torch.nn.Module(), g)(x.contiguous())


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
        dp, tp = coords if order == "dp_major" else coords[::-1]
        got = _redistributed(x, (R, R), (B * H, D), pls, _mesh(sizes, coords))
        want = x.view(B, H, D)[dp * 2:(dp + 1) * 2, tp * 2:(tp + 1) * 2].reshape(-1, D)
        assert torch.equal(got, want), (order, coords)
        assert got.shape == local_shape((B * H, D), pls, sizes, coords)


# ----------------------------------------------------------------------------- every 2x2 change, run on 4 gloo ranks


def _src_piece(full: torch.Tensor, src: tuple, info: MeshInfo) -> torch.Tensor:
    """This rank's piece of ``full`` laid out as ``src``: a Partial axis holds addends (sum: coordinate 0
    keeps the value minus the others' noise) or lower bounds (max: other coordinates hold less)."""
    out = take(full, [R if isinstance(p, Part) else p for p in src], info)
    g = torch.Generator().manual_seed(7)  # the same noise on every rank, so the addends cancel
    for a, p in enumerate(src):
        if isinstance(p, Part):
            c, n = info.coords[a], info.sizes[a]
            noise = [torch.randn(out.shape, generator=g) for _ in range(n)]
            if p.op == "sum":
                out = out - sum(noise[1:]) if c == 0 else noise[c]
            elif c:
                out = out - 1 - noise[c].abs()
    return out


def _every_2x2_change(rank: int, world: int, shapes: list) -> tuple[int, list]:
    import torch.distributed as dist

    from fxshard.core.mesh import init_mesh

    mesh = init_mesh(a0=2, a1=2)
    info = MeshInfo.of(mesh)
    wrong, checked = [], 0
    for shape in shapes:
        full = torch.arange(float(shape[0] * shape[1])).view(shape)
        for src, dst in itertools.product(_layouts(2, shape, info.sizes), repeat=2):
            if len({p.op for p in src if isinstance(p, Part)}) > 1:
                continue  # a sum on one axis and a max on the other has no order-free meaning
            got = _redistributed(_src_piece(full, src, info), src, shape, dst, info)
            for a, p in enumerate(dst):  # a Partial result: its reduction over the axis must be the value
                if isinstance(p, Part):
                    got = got.clone()
                    dist.all_reduce(got, dist.ReduceOp.SUM if p.op == "sum" else dist.ReduceOp.MAX,
                                    group=mesh.get_group(a))
            want = take(full, [R if isinstance(p, Part) else p for p in dst], info)
            checked += 1
            if got.shape != want.shape or not torch.allclose(got, want, atol=1e-4):
                wrong.append((shape, src, dst))
    return checked, wrong


def test_every_2x2_layout_change_gives_each_rank_its_piece():
    """Every change between layouts of R, S(0), S(1), P(sum), P(max) per axis on a real 2x2 mesh, even and
    uneven shapes: each rank ends with exactly its piece of the value. Covers a dim split on both axes
    (mesh-major pieces: an outer axis gains or loses its split only once no inner axis splits the dim)."""
    results = run_ranks(_every_2x2_change, 4, [(8, 4), (4, 8), (6, 10), (5, 3)])
    checked, wrong = results[0][0], sorted({str(w) for _, ws in results for w in ws})
    assert checked > 2000 and not wrong, wrong


def test_ranks_of_one_group_plan_the_same_collectives():
    """Uneven pieces give ranks different local shapes; the collectives of each axis group must still match
    in kind and buffer size (a mismatch deadlocks or corrupts gloo/NCCL)."""
    for shape in [(5, 3), (7, 5), (3, 9), (6, 10)]:
        sizes = (2, 2)
        for src, dst in itertools.product(_layouts(2, shape, sizes), repeat=2):
            plans = {c: plan_transition(src, dst, shape, _mesh(sizes, c), torch.float32)
                     for c in itertools.product(range(2), repeat=2)}
            for a in range(2):
                for fixed in range(2):
                    seqs = {str([(s.kind, s.nbytes) for s in plans[c] if s.is_collective and s.axis == a])
                            for c in plans if c[1 - a] == fixed}
                    assert len(seqs) == 1, (shape, src, dst, a, seqs)


@pytest.mark.parametrize("shape", [(8, 8), (16, 4)])
def test_no_step_cuts_a_dim_an_inner_axis_splits_on_three_axes(shape):
    """Every change between layouts of R, S(0), S(1), P(sum) per axis on a 2x2x2 mesh: walking the planned
    steps, no step on an axis gathers, scatters or slices a dim while an inner axis splits that dim (that
    would mix mesh-major and inner-major pieces), and the walk ends at the target layout. (The 2x2 test
    above runs the steps on real ranks; this checks the order the planner keeps on three axes.)"""
    sizes, mesh = (2, 2, 2), _mesh((2, 2, 2), (1, 0, 1))
    moves = ("all_gather", "reduce_scatter", "all_to_all", "slice")
    layouts = [p for p in itertools.product([R, S(0), S(1), Part("sum")], repeat=3) if split_ok(shape, p, sizes)]
    for src, dst in itertools.product(layouts, repeat=2):
        cur = list(src)
        for st in plan_transition(src, dst, shape, mesh, torch.float32):
            if st.kind in moves:
                dims = {p.dim for p in (st.src, st.dst) if isinstance(p, S)}
                inner = [b for b in range(st.axis + 1, 3) if isinstance(cur[b], S) and cur[b].dim in dims]
                assert not inner, (src, dst, st, cur)
            if st.kind != "cast":
                cur[st.axis] = st.dst
        assert tuple(cur) == dst, (src, dst, cur)
