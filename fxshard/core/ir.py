"""The sharding IR every pass reads and writes: node meta keys, the per-node record, op classes.

A fxshard program is a ``torch.fx`` graph whose nodes carry, in ``node.meta``:

* ``"val"``: the traced fake tensor (global shape), from torch;
* ``META_KEY``: the node's :class:`~fxshard.core.spec.Spec` (a tuple of them for multi-output ops);
* ``IN_KEY``: the placements each tensor input must have (one tuple per input, on ops and the output);
* ``STRATEGY_KEY``: the :class:`~fxshard.rules.registry.Strategy` chosen per mesh axis;
* ``FALLBACK_KEY``/``WHY_KEY``: the op had no rule and runs replicated, and why;
* ``COMM_KEY``: on an inserted collective, its kind, axis, bytes and reason;
* ``INSERTED_KEY``: the node was inserted by fxshard (no traced ``"val"`` to reason about);
* ``STOP_KEY``: a stop-gradient the joint trace detaches at.

:func:`sharding` reads the first five as one typed :class:`NodeSharding` and :func:`set_sharding`
writes it. Passes import this module (and the leaf modules spec/registry/placements), never each
other. ``OP_CLASSES`` is the one table of ops the passes treat specially by kind (views, shape
arguments, squeezes, fused kernels whose output layout follows their inputs).
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from enum import Flag, auto
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from .spec import Spec
from .torch_compat import OpOverload

aten = torch.ops.aten

__all__ = [
    "META_KEY", "IN_KEY", "STRATEGY_KEY", "FALLBACK_KEY", "WHY_KEY", "COMM_KEY", "INSERTED_KEY", "STOP_KEY",
    "NodeSharding", "sharding", "set_sharding", "spec_of", "source_line",
    "OpClass", "OP_CLASSES", "is_op", "is_random", "VIEW_OPS", "SHAPE_ARGS", "SIZE_ARGS",
]

META_KEY = "fxshard_spec"
IN_KEY = "fxshard_in"
STRATEGY_KEY = "fxshard_strategy"
FALLBACK_KEY = "fxshard_fallback"
WHY_KEY = "fxshard_why"
COMM_KEY = "fxshard_comm"
INSERTED_KEY = "fxshard_inserted"
STOP_KEY = "fxshard_stop_gradient"

SpecLike = Union[Spec, tuple, None]


@dataclass(frozen=True)
class NodeSharding:
    """What propagation decided for one node.

    ``spec``: the output's Spec (a tuple for multi-output ops, None for non-tensors); ``inputs``: the
    placements each tensor input must arrive in (None: no requirement recorded); ``strategy``: the
    Strategy chosen per mesh axis (empty for placeholders, getitems and constraints); ``fallback``:
    the op had no rule and is computed replicated; ``why``: a short reason for a fallback.
    """

    spec: SpecLike
    inputs: Optional[tuple[tuple, ...]] = None
    strategy: tuple = ()
    fallback: bool = False
    why: str = ""

    @property
    def lowerings(self) -> list[Any]:
        """The rank-dependent lowerings of the chosen strategies (one per distinct lowering)."""
        out: list[Any] = []
        for st in self.strategy:
            if st.lowering is not None and st.lowering not in out:
                out.append(st.lowering)
        return out


def sharding(node: fx.Node) -> NodeSharding:
    """The node's record, read from its meta (empty fields where a pass has not written them)."""
    m = node.meta
    req = m.get(IN_KEY)
    return NodeSharding(m.get(META_KEY), tuple(tuple(r) for r in req) if req is not None else None,
                        tuple(m.get(STRATEGY_KEY) or ()), bool(m.get(FALLBACK_KEY)), m.get(WHY_KEY, ""))


def set_sharding(node: fx.Node, rec: NodeSharding) -> None:
    """Write ``rec`` into the node's meta (the inverse of :func:`sharding`)."""
    m = node.meta
    m[META_KEY] = rec.spec
    if rec.inputs is not None:
        m[IN_KEY] = [tuple(r) for r in rec.inputs]
    if rec.strategy:
        m[STRATEGY_KEY] = tuple(rec.strategy)
    if rec.fallback:
        m[FALLBACK_KEY] = True
        m[WHY_KEY] = rec.why


def spec_of(node: fx.Node) -> Optional[Spec]:
    """The node's Spec when it is a single tensor, else None."""
    s = node.meta.get(META_KEY)
    return s if isinstance(s, Spec) else None


def source_line(node: fx.Node) -> str:
    """``file:line code`` of the innermost user frame that produced ``node`` (not torch's)."""
    st = node.meta.get("stack_trace") or ""
    lines = [l.strip() for l in st.strip().splitlines()]
    best = ""
    for i, l in enumerate(lines):
        if l.startswith("File ") and f"{os.sep}torch{os.sep}" not in l:
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            parts = l.split('"')
            fname = os.path.basename(parts[1]) if len(parts) > 1 else l
            lineno = l.split("line ")[1].split(",")[0] if "line " in l else "?"
            best = f"{fname}:{lineno} {code}".strip()
    return best


class OpClass(Flag):
    """Kinds of ops the passes treat specially (an op may have several)."""

    NONE = 0
    VIEW = auto()  # the result shares its input's storage (memory liveness; the partition recomputes it)
    RESHAPE = auto()  # view(x, shape): a view of a view of x is a view of x (simplify.fold_views)
    BASE_VIEW = auto()  # propagate replicates a one-user view's base instead of the view
    SQUEEZE = auto()  # squeezes: localize keeps a rank's one-element piece of a split dim
    LAYOUT_FOLLOWS_INPUTS = auto()  # outputs take their inputs' stride order (core/layout.py)
    SHAPE_ONLY = auto()  # reads sizes only, computes nothing (overlap_report's compute count)


_V, _R, _B = OpClass.VIEW, OpClass.RESHAPE, OpClass.BASE_VIEW

OP_CLASSES: dict[Any, OpClass] = {
    aten.view.default: _V | _R | _B,
    aten._unsafe_view.default: _V | _R | _B,
    aten.permute.default: _V | _B,
    aten.reshape.default: _V,
    aten.t.default: _V,
    aten.transpose.int: _V,
    aten.expand.default: _V,
    aten.slice.Tensor: _V,
    aten.select.int: _V,
    aten.squeeze.dim: _V | OpClass.SQUEEZE,
    aten.squeeze.dims: _V | OpClass.SQUEEZE,
    aten.squeeze.default: _V | OpClass.SQUEEZE,
    aten.unsqueeze.default: _V,
    aten.alias.default: _V,
    aten.split.Tensor: _V,
    aten.split_with_sizes.default: _V,
    aten.unbind.int: _V,
    aten.as_strided.default: _V,
    torch.ops._c10d_functional.wait_tensor.default: _V,
    aten._scaled_dot_product_flash_attention_for_cpu.default: OpClass.LAYOUT_FOLLOWS_INPUTS,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: OpClass.LAYOUT_FOLLOWS_INPUTS,
    aten.sym_size.int: OpClass.SHAPE_ONLY,
    aten.sym_numel.default: OpClass.SHAPE_ONLY,
    operator.getitem: OpClass.SHAPE_ONLY,
}

# the ops whose result shares its input's storage (a derived view of OP_CLASSES)
VIEW_OPS = frozenset(op for op, c in OP_CLASSES.items() if OpClass.VIEW in c)

# op -> position of an argument holding the op's (global) output shape (localize rewrites it)
SHAPE_ARGS: dict[Any, int] = {
    aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
    aten.upsample_bilinear2d_backward.default: 2, aten._upsample_bilinear2d_aa_backward.default: 2,
}
# op -> {argument position: (tensor input, dim)}: an int argument holding the size of that input's dim
SIZE_ARGS: dict[Any, dict[int, tuple[int, int]]] = {
    aten.native_group_norm.default: {3: (0, 0)}, aten.native_group_norm_backward.default: {5: (0, 0)},
}


def is_op(target: Any, cls: OpClass) -> bool:
    """Whether ``target`` belongs to every class in ``cls``."""
    try:
        return cls in OP_CLASSES.get(target, OpClass.NONE)
    except TypeError:  # an unhashable target
        return False


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` calls an ATen op that draws from a random generator (tagged ``nondeterministic_seeded``)."""
    return isinstance(node.target, OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags
