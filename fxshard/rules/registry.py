"""The op-rule registry: one sharding rule per ATen OpOverload.

A rule describes one mesh axis of size ``n``. It receives an :class:`OpCall`
(the node, the global shapes of its tensor inputs and outputs, and the
placements those inputs currently have on this axis) and returns the
:class:`Strategy` list that computes the op correctly, each naming the
placement every tensor input must have and the placement(s) of the output.
The propagation engine picks the cheapest strategy per axis, which extends
every rule to N-D meshes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.fx as fx

from ..core.errors import ShardingError
from ..core.placements import Pl, R, S
from ..core.spec import Spec, split_ok
from ..core.symbolic import Dim, sym_shape

__all__ = ["Strategy", "OpCall", "Rule", "register", "lookup", "allows_uneven", "tensor_inputs", "registered_ops",
           "strategy_valid", "strategy_specs", "outer_of", "split_outers"]

OutPl = Union[Pl, tuple[Optional[Pl], ...], None]


@dataclass(frozen=True)
class Strategy:
    """One way to compute an op on one mesh axis.

    ``inputs[i]`` is the placement tensor input ``i`` must have; ``output`` is
    the placement of the result (a tuple for multi-output ops). ``lowering``
    is a rank-dependent local rewrite the localize pass must apply, a
    ``fxshard.comm.lowering.Lowering`` defined next to the rule (e.g. the masked
    embedding lookup of a vocab-sharded table, ``rules/embedding.py``).
    """

    inputs: tuple[Pl, ...]
    output: OutPl
    lowering: Optional[str] = None  # a fxshard.comm.lowering.Lowering (a str subclass: its name)


@dataclass
class OpCall:
    """What a rule may look at: the node, input/output shapes and current input placements."""

    node: fx.Node
    in_shapes: list[tuple[Dim, ...]]
    in_pls: list[Pl]
    out_shape: Any  # tuple[Dim, ...] or a tuple of those for multi-output ops
    in_dtypes: list[torch.dtype] = field(default_factory=list)

    @property
    def args(self) -> tuple:
        return self.node.args

    @property
    def kwargs(self) -> dict:
        return self.node.kwargs

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if len(self.node.args) > i:
            return self.node.args[i]
        return self.node.kwargs.get(name, default)


Rule = Callable[[OpCall, int], list[Strategy]]

_RULES: dict[Any, Rule] = {}
_UNEVEN: set = set()


def register(ops: Union[Any, Iterable[Any]], rule: Optional[Rule] = None, *, uneven: bool = True):
    """Register ``rule`` for each OpOverload in ``ops`` (usable as a decorator).

    By default a rule's split strategies must be correct when a split dim is cut unevenly
    (``torch.chunk`` semantics, per-rank local sizes; the validator and the OpInfo sweep cut dims
    unevenly to check). ``uneven=False`` opts out: propagation then offers the op only splits that
    divide. Raises ShardingError when an op already has a rule: one op, one rule.
    """
    ops_list = list(ops) if isinstance(ops, (list, tuple, set)) else [ops]

    def deco(fn: Rule) -> Rule:
        for op in ops_list:  # check all first: a failed registration changes nothing
            if op in _RULES:
                raise ShardingError(
                    f"{op} already has a sharding rule ({_RULES[op].__module__}.{_RULES[op].__name__}); "
                    f"an op may be registered once: extend the existing rule instead"
                )
        if len(set(ops_list)) != len(ops_list):
            raise ShardingError(f"register() got the same op twice in {ops_list}")
        for op in ops_list:
            _RULES[op] = fn
            if uneven:
                _UNEVEN.add(op)
        return fn

    return deco(rule) if rule is not None else deco


def lookup(op: Any) -> Optional[Rule]:
    """The rule for an OpOverload, or None (the caller falls back to replication)."""
    return _RULES.get(op)


def allows_uneven(op: Any) -> bool:
    """Whether ``op``'s rule was registered as correct for unevenly split dims."""
    return op in _UNEVEN


def registered_ops() -> list[Any]:
    return list(_RULES)


def is_tensor_node(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's tensor arguments in the order of ``(args, kwargs)`` (repeats kept)."""
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: out.append(a) if is_tensor_node(a) else None)
    return out


def out_shape_of(node: fx.Node) -> Any:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return sym_shape(v)
    if isinstance(v, (tuple, list)):
        return tuple(sym_shape(x) if isinstance(x, torch.Tensor) else None for x in v)
    return None


def replicate_all(call: OpCall) -> Strategy:
    """The always-correct strategy: every input and output replicated."""
    out = call.out_shape
    if isinstance(out, tuple) and out and (out[0] is None or isinstance(out[0], tuple)):
        return Strategy(tuple(R for _ in call.in_shapes), tuple(R if o is not None else None for o in out))
    return Strategy(tuple(R for _ in call.in_shapes), R)


def all_r(k: int) -> tuple[Pl, ...]:
    return tuple(R for _ in range(k))


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def norm_dims(ds: Optional[Sequence[int]], ndim: int) -> list[int]:
    if ds is None:
        return list(range(ndim))
    if isinstance(ds, int):
        ds = [ds]
    return sorted({norm_dim(d, max(ndim, 1)) for d in ds}) if ds else list(range(ndim))


def output_leaves(out_node: fx.Node) -> list[Any]:
    """The flat values an fx output node returns, None entries kept (pytree would drop them)."""
    res: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        else:
            res.append(x)

    walk(out_node.args[0])
    return res


def tensor_output_leaves(out_node: fx.Node) -> list[tuple[int, fx.Node]]:
    """The output node's tensor leaves, each with its index among all of ``output_leaves`` (the numbering of
    ``ShardContext.out_required``: a Python scalar or None among the outputs has an index but no layout)."""
    return [(j, x) for j, x in enumerate(output_leaves(out_node))
            if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)]


def outer_of(p: Pl, dim: int) -> int:
    """The strided-split factor a split of ``dim`` keeps when its input is laid out ``p``: ``p.outer``
    when ``p`` splits ``dim`` (``S(dim, outer)``, a packed dim), else 1 (a plain split). Rules offer
    ``S(dim, outer_of(p, dim))`` so a packed dim stays packed (see ``placements.py``)."""
    return p.outer if isinstance(p, S) and p.dim == dim else 1


def split_outers(pairs: Iterable[tuple[Pl, Optional[int]]]) -> list[int]:
    """The split factors one dim may be split with, ascending: 1 (a plain split) and the outer factor
    of every strided split among ``(placement, dim)`` pairs, where ``dim`` is the dim in question as
    that input numbers it (None: the input does not have it)."""
    return sorted({1} | {outer_of(p, d) for p, d in pairs if d is not None})


def _pad(pls: Sequence[Pl], k: int) -> tuple[Pl, ...]:
    return tuple(pls) + (R,) * (k - len(pls))


def strategy_valid(st: Strategy, chosen: list[Strategy], in_specs: list[Spec], out_shape: Any, sizes, k: int,
                   uneven: bool) -> bool:
    """Whether ``st``, on the axis after those ``chosen`` already has, leaves every input and output
    split legally (dims divide, or are cut unevenly where the op's rule allows ``uneven``)."""
    for i, s in enumerate(in_specs):
        pls = _pad([c.inputs[i] for c in chosen] + [st.inputs[i]], k)
        if not split_ok(s.shape, pls, sizes, uneven):
            return False
    multi = bool(out_shape) and (out_shape[0] is None or isinstance(out_shape[0], tuple))
    shapes = out_shape if multi else (out_shape,)
    outs = st.output if isinstance(st.output, tuple) else (st.output,) * len(shapes)
    for j, (o, shp) in enumerate(zip(outs, shapes)):
        if o is None or shp is None:
            continue
        prev = [(c.output[j] if isinstance(c.output, tuple) else c.output) for c in chosen]
        if not split_ok(shp, _pad(prev + [o], k), sizes, uneven):
            return False
    return True


def strategy_specs(node: fx.Node, chosen: list[Strategy], out_shape: Any):
    """The node's output Spec (a tuple of them, None for non-tensors, for multi-output ops) under the
    per-axis strategies ``chosen``."""
    val = node.meta["val"]
    if isinstance(val, torch.Tensor):
        return Spec(tuple(st.output for st in chosen), out_shape, val.dtype)
    specs = []
    for j, v in enumerate(val):
        if not isinstance(v, torch.Tensor):
            specs.append(None)
            continue
        pls = tuple((st.output[j] if isinstance(st.output, tuple) else st.output) or R for st in chosen)
        specs.append(Spec(pls, sym_shape(v), v.dtype))
    return tuple(specs)
