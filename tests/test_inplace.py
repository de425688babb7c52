"""The in-place all-reduce pass (``passes/inplace.py``): which all_reduces may reduce their input in place.
Numerics of programs using it are covered by every parity test (it is in ``pipeline.DEFAULT``)."""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.comm.collectives import all_reduce_into_input
from fxshard.core.ir import COMM_KEY
from fxshard.passes.inplace import inplace_pass
from fxshard.passes.pipeline import DEFAULT

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _program(make_input) -> tuple[fx.GraphModule, fx.Node]:
    """``out = wait(all_reduce(make_input(g, a, b)))`` over placeholders ``a, b`` of shape [4, 4]."""
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    for p in (a, b):
        p.meta["val"] = torch.empty(4, 4)
    x, extra = make_input(g, a, b)
    coll = g.call_function(c10d.all_reduce.default, (x, "sum", "group"))
    coll.meta[COMM_KEY] = {"kind": "all_reduce"}
    wait = g.call_function(c10d.wait_tensor.default, (coll,))
    g.output((wait,) + tuple(extra))
    return fx.GraphModule(torch.nn.Module(), g), coll


def _op(g: fx.Graph, target, *args, val: torch.Tensor) -> fx.Node:
    n = g.call_function(target, args)
    n.meta["val"] = val
    return n


def test_only_a_dying_fresh_contiguous_buffer_is_reduced_in_place():
    cases = {
        "a matmul's result read only by the collective": (
            lambda g, a, b: (_op(g, aten.mm.default, a, b, val=torch.empty(4, 4)), ()), True),
        "a view of it that is the only way to the buffer": (
            lambda g, a, b: (_op(g, aten.view.default, _op(g, aten.mm.default, a, b, val=torch.empty(4, 4)), [16],
                                 val=torch.empty(16)), ()), True),
        "a concatenation (a gradient bucket), without meta": (
            lambda g, a, b: (g.call_function(aten.cat.default, ([a, b],)), ()), True),
        "a program input": (lambda g, a, b: (a, ()), False),
        "a value the program also returns": (
            lambda g, a, b: (lambda m: (m, (m,)))(_op(g, aten.mm.default, a, b, val=torch.empty(4, 4))), False),
        "a view of a value read elsewhere": (
            lambda g, a, b: (lambda m: (_op(g, aten.view.default, m, [16], val=torch.empty(16)), (m,)))(
                _op(g, aten.mm.default, a, b, val=torch.empty(4, 4))), False),
        "a transpose (aliases its input)": (
            lambda g, a, b: (_op(g, aten.t.default, a, val=torch.empty(4, 4)), ()), False),
        "a non-contiguous fresh value": (
            lambda g, a, b: (_op(g, aten.mm.default, a, b, val=torch.empty(4, 4).t()), ()), False),
    }
    for what, (make, in_place) in cases.items():
        gm, coll = _program(make)
        inplace_pass(gm, None)
        want = all_reduce_into_input if in_place else c10d.all_reduce.default
        assert coll.target is want, what
    assert "inplace" in DEFAULT.names


def test_all_reduce_into_input_reduces_the_buffer_itself_only_when_eager(fake_mesh):
    """Eager on a plain tensor: the result is the input buffer (no copy). Traced (make_fx), the functional
    all_reduce: the graph holds no op whose output aliases its input, so torch.compile can functionalize it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    mesh = fake_mesh(2)
    group = mesh.get_group(0).group_name
    x = torch.ones(4)
    out = c10d.wait_tensor(all_reduce_into_input(x, "sum", group))
    assert out.data_ptr() == x.data_ptr()
    # a non-contiguous input (the pass's traced strides wrong at run time) is reduced out of place: gloo's
    # all_reduce_ would reduce the slice's neighbours, or write past an expanded tensor's storage
    base = torch.arange(8.0).view(4, 2)
    for y in (base[:, 0], torch.ones(1).expand(4)):
        out = c10d.wait_tensor(all_reduce_into_input(y, "sum", group))
        assert out.data_ptr() != y.data_ptr() and out.is_contiguous() and torch.equal(out, y)
    assert torch.equal(base, torch.arange(8.0).view(4, 2))
    traced = make_fx(lambda t: c10d.wait_tensor(all_reduce_into_input(t, "sum", group)),
                     tracing_mode="fake")(torch.ones(4))
    targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    assert c10d.all_reduce.default in targets and c10d.all_reduce_.default not in targets


def _reduce_non_contiguous(rank: int, world: int) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD.group_name
    base = torch.arange(8.0).view(4, 2) * (rank + 1)
    sliced = c10d.wait_tensor(all_reduce_into_input(base[:, 0], "sum", group))
    expanded = c10d.wait_tensor(all_reduce_into_input(torch.full((1,), rank + 1.0).expand(4), "sum", group))
    return {"base": base, "sliced": sliced, "expanded": expanded}


def test_a_non_contiguous_input_is_reduced_out_of_place_on_gloo():
    """On 2 gloo ranks (rank r holds (r + 1) x its values): a column slice's sum is the sum of the columns, and
    its neighbour column is untouched; an expanded [1] -> [4] tensor sums to 3s. gloo's all_reduce_ on the
    slice would reduce the first 4 elements of its storage (rows 0-1 of both columns)."""
    from tests.dist_utils import run_ranks

    for rank, res in enumerate(run_ranks(_reduce_non_contiguous, 2)):
        want = torch.arange(8.0).view(4, 2)
        assert torch.equal(res["sliced"], want[:, 0] * 3), res["sliced"]
        assert torch.equal(res["base"], want * (rank + 1)), res["base"]
        assert torch.equal(res["expanded"], torch.full((4,), 3.0))
