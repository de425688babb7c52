"""``Sharding``: the read-only public view of what fxshard decided for a sharded module or function.

``sm.sharding`` (a ShardedModule) and ``sf.sharding`` (a ShardedFunction, once traced) return one;
``fxshard.explain``, ``fxshard.comm_stats``, ``fxshard.memory`` and the CLI read only this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol

from ..core.errors import ShardingError
from ..core.mesh import MeshInfo
from ..core.placements import Pl

if TYPE_CHECKING:  # sharded_module.py and jit build Sharding views of these
    from ..planner.auto import AutoReport
    from .programs import Program, Training

__all__ = ["Sharding", "Sharded", "sharding_of"]


@dataclass(frozen=True)
class Sharding:
    """What was sharded how.

    ``mesh``: the mesh as this rank sees it; ``programs``: the per-rank programs that run now
    (training forward and backward, or the inference forward), each with its graph, label and
    fallbacks; ``inference``/``training``: the programs of the current modes; ``placements`` and
    ``global_shapes``: per parameter/buffer FQN (empty for a function); ``slots``: what feeds
    each placeholder of the traced program (empty for a function); ``is_module``: a ShardedModule;
    ``auto``: what ``shard(auto=True)`` chose (``fxshard.planner.auto.AutoReport``), else None.
    """

    mesh: MeshInfo
    programs: tuple[Program, ...]
    inference: Program
    training: Optional[Training] = None
    placements: Mapping[str, tuple[Pl, ...]] = field(default_factory=lambda: MappingProxyType({}))
    global_shapes: Mapping[str, tuple] = field(default_factory=lambda: MappingProxyType({}))
    slots: tuple = ()
    is_module: bool = False
    auto: Optional[AutoReport] = None  # when shard(auto=True) chose part of the plan

    @property
    def fallbacks(self) -> list[str]:
        """Ops computed replicated for lack of a rule, over every program (sorted, once each)."""
        return sorted({f for p in self.programs for f in p.fallbacks})


class Sharded(Protocol):
    """What the reports take: a ShardedModule, or a ShardedFunction once traced (anything else raises)."""

    @property
    def sharding(self) -> Sharding: ...


def sharding_of(obj: Any, who: str) -> Sharding:
    """``obj.sharding`` for a ShardedModule/ShardedFunction; a ShardingError naming ``who`` otherwise."""
    view = getattr(obj, "sharding", None) if hasattr(type(obj), "sharding") else None
    if not isinstance(view, Sharding):
        raise ShardingError(
            f"{who} expects a module returned by fxshard.shard or a function returned by fxshard.jit, got "
            f"{type(obj).__name__}; shard it first (fxshard.shard(model, mesh, plan, example_inputs=...))"
        )
    return view
