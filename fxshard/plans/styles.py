"""ParallelStyles: torch's (accepted unchanged) and fxshard's own (same names and arguments,
plus ``mesh_axis``), turned into parameter placements and module-boundary constraints.

A style places its module's parameters on one mesh axis (``tp`` unless
``mesh_axis`` says otherwise) and constrains the module's inputs and outputs
on that axis only; other mesh axes stay free for propagation (so a batch
split on ``dp`` passes through a tensor-parallel plan untouched).

Meaning of the layout arguments in fxshard, where every value has a global
meaning and layouts only decide communication:

* ``desired_input_layouts`` (and the defaults Colwise ``Replicate()``,
  Rowwise ``Shard(-1)`` on nn.Linear / ``Replicate()`` on nn.Embedding,
  SequenceParallel ``Shard(sequence_dim)``) pin the layout the module computes
  with; the incoming value is redistributed to it.
* ``output_layouts`` / ``desired_output_layouts`` pin the module's output.
* ``input_layouts`` describe how a DTensor program would *interpret* a local
  input; in fxshard the producer's layout comes from propagation, so they are
  validated and otherwise need no action. ``use_local_output`` likewise has no
  effect: ShardedModule always works on local tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor import parallel as tp

from ..core.errors import ShardingError

__all__ = [
    "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
    "PrepareModuleInputOutput", "AxisSpec", "Boundary", "boundary_of", "STYLE_TYPES",
    "reads_as_torch_style",
]


@dataclass(frozen=True)
class AxisSpec:
    """A constraint on one mesh axis (by index); the other axes stay free."""

    axis: int
    placement: Placement


@dataclass
class Boundary:
    """Constraints at one module's boundary: per positional input, per kwarg, per output."""

    inputs: list[Optional[AxisSpec]] = field(default_factory=list)
    kwargs: dict[str, AxisSpec] = field(default_factory=dict)
    outputs: list[Optional[AxisSpec]] = field(default_factory=list)


def _with_axis(cls: type) -> type:
    """fxshard's twin of a torch style: same arguments plus ``mesh_axis``."""

    def __init__(self, *args: Any, mesh_axis: Optional[str] = None, **kwargs: Any) -> None:
        cls.__init__(self, *args, **kwargs)
        self.mesh_axis = mesh_axis

    doc = (f"torch's ``{cls.__name__}`` with the same arguments and meaning, plus ``mesh_axis`` "
           f"(default: the axis named ``tp``, or the only axis of a 1-D mesh).")
    return type(cls.__name__, (cls,), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


ColwiseParallel = _with_axis(tp.ColwiseParallel)
RowwiseParallel = _with_axis(tp.RowwiseParallel)
SequenceParallel = _with_axis(tp.SequenceParallel)
PrepareModuleInput = _with_axis(tp.PrepareModuleInput)
PrepareModuleOutput = _with_axis(tp.PrepareModuleOutput)
PrepareModuleInputOutput = _with_axis(tp.PrepareModuleInputOutput)

STYLE_TYPES = (tp.ColwiseParallel, tp.RowwiseParallel, tp.SequenceParallel, tp.PrepareModuleInput,
               tp.PrepareModuleOutput, tp.PrepareModuleInputOutput)
_TWINS = frozenset({ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput,
                    PrepareModuleInputOutput})
_NOT_BEHAVIOUR = frozenset({"__init__", "__repr__", "__str__"})
_DESCRIPTORS = (staticmethod, classmethod, property)


def reads_as_torch_style(style: Any) -> bool:
    """True when ``style`` is translated from its arguments (``boundary_of``): one of torch's styles, fxshard's
    twin of one, or a subclass of them that defines no method but ``__init__``/``__repr__``. Any other
    ParallelStyle (another library's, or a subclass overriding ``_apply`` or a hook) is read by applying it
    (``custom_styles.read_style``)."""
    if not isinstance(style, STYLE_TYPES):
        return False
    for klass in type(style).__mro__:
        if klass in STYLE_TYPES:
            return True
        if klass not in _TWINS and any(k not in _NOT_BEHAVIOUR and (callable(v) or isinstance(v, _DESCRIPTORS))
                                       for k, v in vars(klass).items()):
            return False
    return True


def _tuple(x: Any) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _specs(layouts: Any, axis: int, key: str, what: str) -> list[Optional[AxisSpec]]:
    out: list[Optional[AxisSpec]] = []
    for p in _tuple(layouts):
        if p is not None and not isinstance(p, (Shard, Replicate)):
            raise ShardingError(
                f"plan entry {key!r}: {what} entry {p!r} is not Shard(d), Replicate() or None; "
                f"use those for module inputs and outputs"
            )
        out.append(AxisSpec(axis, p) if p is not None else None)
    return out


def boundary_of(style: Any, module: nn.Module, axis: int, key: str) -> Boundary:
    """The input/output constraints ``style`` puts on ``module`` (see module doc)."""
    if isinstance(style, tp.PrepareModuleInputOutput):
        b_in = boundary_of(style.prepare_module_input, module, axis, key)
        b_out = boundary_of(style.prepare_module_output, module, axis, key)
        return Boundary(b_in.inputs, b_in.kwargs, b_out.outputs)
    if isinstance(style, tp.PrepareModuleInput):
        _specs(style.input_layouts, axis, key, "input_layouts")
        kw = {k: AxisSpec(axis, v) for k, v in (style.desired_input_kwarg_layouts or {}).items() if v is not None}
        return Boundary(_specs(style.desired_input_layouts, axis, key, "desired_input_layouts"), kw, [])
    if isinstance(style, tp.PrepareModuleOutput):
        _specs(style.output_layouts, axis, key, "output_layouts")
        return Boundary([], {}, _specs(style.desired_output_layouts, axis, key, "desired_output_layouts"))
    if isinstance(style, tp.SequenceParallel):
        seq = _specs(style.sequence_sharding, axis, key, "sequence_dim")
        return Boundary(seq, {}, seq)
    if isinstance(style, tp.ColwiseParallel):
        _specs(style.input_layouts, axis, key, "input_layouts")
        return Boundary(_specs(style.desired_input_layouts, axis, key, "desired_input_layouts"), {},
                        _specs(style.output_layouts, axis, key, "output_layouts"))
    if isinstance(style, tp.RowwiseParallel):
        _specs(style.input_layouts, axis, key, "input_layouts")
        desired = Replicate() if isinstance(module, nn.Embedding) else Shard(-1)
        return Boundary([AxisSpec(axis, desired)], {}, _specs(style.output_layouts, axis, key, "output_layouts"))
    raise ShardingError(f"plan entry {key!r}: {type(style).__name__} is not a supported ParallelStyle")
