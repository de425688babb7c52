"""Liveness analysis of sharded programs: the per-rank bytes a program holds at its peak, without running it.

Activation and collective-buffer peaks (what ``fxshard.memory``, the remat budget and the overlap
pass read) come from a liveness analysis of each sharded program: local shapes are found by interpreting the program on fake
tensors (no real memory, no communication), every value is live from the op
that allocates it to its last use (views share their base's storage and extend
its life), saved activations stay live to the end of the forward and from the
start of the backward, and collective outputs die after their last use — which
is what makes a deep stack of all-reduced layers use no more buffer memory
than a shallow one (seed 002).
"""

from __future__ import annotations

import bisect
import operator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.fx as fx
from ..core.torch_compat import pytree

from ..comm.collectives import all_reduce_into_input, hint
from ..core.ir import META_KEY, VIEW_OPS
from ..rules.registry import output_leaves
from ..core.spec import Spec
from ..core.symbolic import sym_dim, sym_shape
from ..core.torch_compat import FakeTensor, FakeTensorMode

aten = torch.ops.aten
_WAIT = torch.ops._c10d_functional.wait_tensor.default

__all__ = ["program_peak", "value_nbytes", "outputs_of", "local_values", "local_bytes", "output_values", "remembering_values",
           "liveness_peak", "liveness", "liveness_peak_of", "OPTIMIZER_STATES"]

# tensors of state per parameter element, in the parameter's dtype
OPTIMIZER_STATES = {None: 0, "sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2, "adagrad": 1, "rmsprop": 1}


def _local_vals(gm: fx.GraphModule, sizes, device: str, coords=None, given: Sequence[Any] = ()
                ) -> dict[fx.Node, Any]:
    """Run ``gm`` on fake local tensors on ``device``; the value every node produces. ``coords`` (this rank's
    mesh coordinates) sizes unevenly split inputs as the rank-specific program expects; ``given`` are the
    values of the first placeholders (a backward's saved values, as its forward computed them)."""
    # the mode the given values were made in (a forward's), so they need no conversion into a new one
    mode = next((t.fake_mode for t in pytree.tree_leaves(list(given)) if isinstance(t, FakeTensor)), None)
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    vals: dict[fx.Node, Any] = {}
    def make(spec: Any, v: Any) -> Any:
        if isinstance(spec, Spec):
            return torch.empty([hint(s) for s in spec.local_shape(sizes, coords)], dtype=spec.dtype, device=device)
        if isinstance(v, torch.Tensor):
            return torch.empty([hint(s) for s in sym_shape(v)], dtype=v.dtype, device=device)
        if isinstance(spec, tuple) and isinstance(v, (tuple, list)):  # a saved multi-output value
            return tuple(make(s, x) for s, x in zip(spec, v))
        if isinstance(v, torch.SymInt):  # a saved size of a dynamic dim: the same stand-in as tensor dims
            return hint(sym_dim(v))
        return v

    class Rec(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            vals[n] = out
            return out

    with mode:
        fake_in = [given[i] if i < len(given) else make(n.meta.get(META_KEY), n.meta.get("val"))
                   for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")]
        Rec(gm).run(*fake_in)
    return vals


# per-program fake values, kept only inside ``remembering_values()`` (one ``shard()``'s finishing of its
# training programs), so nothing outlives the call and no program rewritten later is read stale
_REMEMBERED: ContextVar[Optional[dict]] = ContextVar("fxshard_local_values", default=None)


@contextmanager
def remembering_values() -> Iterator[None]:
    """Within the block, :func:`local_values` interprets each program (with the same nodes, any order)
    once; the values are dropped when the block ends."""
    token = _REMEMBERED.set({})
    try:
        yield
    finally:
        _REMEMBERED.reset(token)


def local_values(gm: fx.GraphModule, mesh: Any, given: Sequence[Any] = ()) -> dict[fx.Node, Any]:
    """The fake local value every node of the per-rank program ``gm`` makes on this rank of ``mesh`` (a
    ``MeshInfo``); ``given`` as in ``_local_vals``. Inside :func:`remembering_values` a program whose
    nodes are the same (a reordering keeps every value) is interpreted once."""
    memo = _REMEMBERED.get()
    key = (frozenset(gm.graph.nodes), mesh.sizes, mesh.coords, mesh.device_type, len(given))
    hit = memo.get(id(gm)) if memo is not None else None
    if hit is not None and hit[0] is gm and hit[1] == key:
        return hit[2]
    vals = _local_vals(gm, mesh.sizes, mesh.device_type, mesh.coords, given)
    if memo is not None:
        memo[id(gm)] = (gm, key, vals)
    return vals


def local_bytes(gm: fx.GraphModule, mesh: Any, given: Sequence[Any] = ()) -> Callable[[fx.Node], int]:
    """Bytes of the value each node of ``gm`` makes on this rank (see :func:`local_values`); the
    ``nbytes`` of :func:`liveness_peak`."""
    vals = local_values(gm, mesh, given)
    return lambda n: value_nbytes(vals.get(n))


def output_values(gm: fx.GraphModule, mesh: Any) -> list[Any]:
    """The fake local values of ``gm``'s output leaves, in order (a training forward's saved values follow its
    outputs: the ``given`` of its backward)."""
    return outputs_of(gm, local_values(gm, mesh))


def outputs_of(gm: fx.GraphModule, vals: dict[fx.Node, Any]) -> list[Any]:
    """The values of ``gm``'s output leaves, read from ``vals`` (node -> value; constants as they are)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [vals[a] if isinstance(a, fx.Node) else a for a in output_leaves(out)]


def value_nbytes(v: Any) -> int:
    """Bytes of the tensors in ``v`` (a tensor, or a tuple/list of them); 0 for anything else."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(value_nbytes(x) for x in v)
    return 0


def program_peak(gm: fx.GraphModule, sizes, device: str = "cpu", inputs_live: bool = False,
                 outputs_live: bool = True, coords=None, not_counted: frozenset = frozenset(),
                 given: Sequence[Any] = ()) -> int:
    """Peak bytes of values the program allocates (plus its inputs when ``inputs_live``, except the
    placeholders at positions ``not_counted``, e.g. parameters that are counted elsewhere); ``given``:
    see ``_local_vals``."""
    vals = _local_vals(gm, sizes, device, coords, given)
    return liveness_peak(gm, lambda n: value_nbytes(vals.get(n)), inputs_live, outputs_live, not_counted)


def liveness_peak(gm: fx.GraphModule, nbytes, inputs_live: bool = False, outputs_live: bool = True,
                  not_counted: frozenset = frozenset()) -> int:
    """Peak of the bytes live at once in ``gm``, ``nbytes(node)`` the bytes each value allocates (see
    :func:`program_peak`; views share their base's storage)."""
    return liveness_peak_of(*liveness(gm, inputs_live, outputs_live, not_counted), nbytes)


def liveness_peak_of(values: list[fx.Node], frees: dict[int, list[fx.Node]], nbytes) -> float:
    """:func:`liveness_peak` of the steps :func:`liveness` found, ``nbytes(node)`` each value's bytes."""
    peak = 0
    live = 0
    for t, n in enumerate(values):
        live += nbytes(n)
        peak = max(peak, live)
        for dead in frees.get(t, ()):
            live -= nbytes(dead)
    return peak


def liveness(gm: fx.GraphModule, inputs_live: bool = False, outputs_live: bool = True,
             not_counted: frozenset = frozenset()) -> tuple[list[fx.Node], dict[int, list[fx.Node]]]:
    """The values ``gm`` allocates, in order (step ``t`` allocates ``values[t]``), and the values freed
    after each step (``frees[t]``; every value is in one, an output in the last step's). This is what
    :func:`liveness_peak` sums: at step ``t`` the live values are those allocated at or before ``t`` and
    not freed before ``t``."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    base: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        is_view = n.op == "call_function" and (n.target in VIEW_OPS or n.target is operator.getitem
                                               or n.target is all_reduce_into_input)  # reduces its input in place
        if is_view and n.args and isinstance(n.args[0], fx.Node):
            base[n] = base.get(n.args[0], n.args[0])
    owner = lambda n: base.get(n, n)
    last: dict[fx.Node, int] = {}
    for n in nodes:
        reads = n.all_input_nodes
        if n.op == "call_function" and n.target is _WAIT and isinstance(n.args[0], fx.Node):
            reads = reads + n.args[0].all_input_nodes  # a collective holds its inputs until it is waited for
        for a in reads:
            o = owner(a)
            last[o] = max(last.get(o, 0), pos[n])
    out_node = nodes[-1]
    end = len(nodes)
    if outputs_live:
        for a in out_node.all_input_nodes:
            last[owner(a)] = end
    placeholders = [n for n in nodes if n.op == "placeholder"]
    skip = {placeholders[i] for i in not_counted}
    values = [n for n in nodes if (n.op == "placeholder" and inputs_live and n not in skip)
              or (n.op == "call_function" and n not in base)]
    at = [pos[n] for n in values]
    frees: dict[int, list[fx.Node]] = {}
    for n in values:
        # freed after the last step that allocates at or before its last use (a last use that allocates
        # nothing, such as a wait or a view, frees it before the next allocation)
        t = bisect.bisect_right(at, last.get(n, pos[n])) - 1
        frees.setdefault(t, []).append(n)
    return values, frees
