"""In-place all-reduce: an all_reduce whose input dies at it reduces that buffer instead of a copy.

``_c10d_functional.all_reduce`` is out of place: it copies its input and reduces the copy. Where the
input is a buffer nothing else reads, that copy is pure overhead (an activation per Megatron
all-reduce, a whole gradient bucket under data parallelism); ``all_reduce_`` reduces the buffer itself.

Requires: a finished per-rank program ("clean": collectives carry ``COMM_KEY`` and are each read by a
``wait_tensor``).
Ensures: every inserted ``all_reduce`` whose input is

* produced by an op whose outputs alias none of its inputs (a fresh buffer; for ``getitem``, every
  output of the producing op is fresh), or a ``view`` of such a buffer that nothing else reads (the
  collective's input is then the only way to the buffer),
* read by nothing but this collective (not an output, not saved for the backward), and
* contiguous (``meta["val"]``; a ``cat`` always is; the out-of-place collective would have made it so),

becomes ``collectives.all_reduce_into_input`` on that input, with the same ``COMM_KEY`` and the same values; every
other node is unchanged. ``all_reduce_into_input`` calls ``all_reduce_`` when it runs eagerly on plain
tensors, and the functional ``all_reduce`` when traced (``torch.compile``, ``make_fx``): functionalization
cannot take an op whose output aliases its input, and inductor re-inplaces collectives itself.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..core.context import ShardContext
from ..comm.collectives import all_reduce_into_input
from ..core.ir import COMM_KEY
from ..core.torch_compat import OpOverload

__all__ = ["inplace_pass", "reduces_in_place"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _fresh(node: fx.Node) -> bool:
    """``node``'s value owns its storage, or is the only way to a buffer that does: made by an op none of
    whose outputs alias an input, or a view of such a value read by nothing else."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem or target in _VIEWS:
        base = node.args[0]
        return isinstance(base, fx.Node) and (target is operator.getitem or len(base.users) == 1) and _fresh(base)
    if not isinstance(target, OpOverload):
        return False
    schema = target._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


def reduces_in_place(coll: fx.Node) -> bool:
    """Whether the out-of-place all_reduce ``coll`` may reduce its input in place (see module doc)."""
    if coll.target is not c10d.all_reduce.default or COMM_KEY not in coll.meta:
        return False
    x = coll.args[0]
    if not isinstance(x, fx.Node) or len(x.users) != 1 or not _fresh(x):
        return False
    val = x.meta.get("val")
    return val.is_contiguous() if isinstance(val, torch.Tensor) else x.target is aten.cat.default


def inplace_pass(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    """The pipeline stage (``pipeline.INPLACE``): every all_reduce ``reduces_in_place`` allows becomes
    ``all_reduce_into_input``. Returns ``gm`` (changed in place)."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and reduces_in_place(n):
            n.target = all_reduce_into_input
            changed = True
    if changed:
        gm.recompile()
    return gm
