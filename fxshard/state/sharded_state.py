"""What a ShardedModule gives the code that works on its parameters from outside it: ``ShardedState``.

``runtime.ShardedModule`` holds one ``ShardedState`` as ``sm.fxshard_state`` (internal: for fxshard's own
modules, not a user API). It names the module in messages (``where``), says how each parameter and buffer is
laid out over the mesh (``layout``: a ``ParameterLayout``, which presents a local tensor as the DTensor of the
global one and cuts a rank's piece out of a global value), and holds the records other modules keep per
module (``grads``: ``grad_guard``'s; ``auto``: auto-sharding's report). The modules of ``state/`` (below
``runtime/`` in the layering) see a ShardedModule only through ``HasShardedState``, and no module reads a
ShardedModule's private attributes (``tests/test_runtime_interface.py``).

Nothing here refers to the module itself (no reference cycle: a ShardedModule dies when its last reference
goes, which ``runtime.sources`` relies on).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..core.mesh import MeshInfo
from ..core.placements import Pl, R, S
from .checkpoint import Piece, global_view, held_pieces, local_piece

if TYPE_CHECKING:
    from ..planner.auto import AutoReport

__all__ = ["ParameterLayout", "GradRecord", "ShardedState", "HasShardedState"]


@dataclass(frozen=True, eq=False)
class ParameterLayout:
    """How a ShardedModule's parameters and buffers are laid out: the mesh (and its ``info``), and per FQN its
    placements (one per mesh axis) and global shape."""

    mesh: DeviceMesh
    info: MeshInfo
    placements: dict[str, tuple[Pl, ...]]
    global_shapes: dict[str, tuple]

    def how_split(self, fqn: str) -> str:
        """How parameter or buffer ``fqn`` is split over the mesh, e.g. ``"S(0) over 'tp'"``; empty if it is
        whole on every rank."""
        return ", ".join(f"{pl!r} over {axis!r}" for pl, axis in zip(self.placements[fqn], self.info.names)
                         if pl != R)

    def split_axes(self, fqn: str) -> list[int]:
        """The mesh axes of several ranks that parameter or buffer ``fqn`` is split over."""
        return [a for a, pl in enumerate(self.placements[fqn]) if isinstance(pl, S) and self.info.sizes[a] > 1]

    def dtensor(self, fqn: str, local: torch.Tensor) -> DTensor:
        """``local`` (a shard of ``fqn``, or FSDP2's DTensor of it) as a DTensor of the global tensor (no
        communication)."""
        return global_view(local, self.mesh, self.placements[fqn], self.global_shapes[fqn], fqn)

    def pieces(self, fqn: str, local: torch.Tensor) -> list[Piece]:
        """The boxes of ``fqn``'s global tensor that ``local`` (this rank's shard, or FSDP2's DTensor of it) holds."""
        return held_pieces(local, tuple(int(s) for s in self.global_shapes[fqn]), self.placements[fqn], self.info)

    def own_piece(self, fqn: str, own: torch.Tensor, value: Any, name: str) -> torch.Tensor:
        """The part of ``value`` (a DTensor of ``fqn``'s global tensor in any layout, or the full tensor) this
        rank holds, in the type of ``own`` (the registered tensor: a local shard, or FSDP2's DTensor of it);
        ``name`` names ``value`` in errors."""
        piece = local_piece(value, self.dtensor(fqn, own.detach()), self.pieces(fqn, own), name)
        if isinstance(own, DTensor):
            piece = DTensor.from_local(piece, own.device_mesh, own.placements, shape=own.shape, stride=own.stride(),
                                       run_check=False)
        return piece


@dataclass
class GradRecord:
    """``grad_guard``'s record for one ShardedModule (see ``state/grad_guard.py``)."""

    # FQN -> (a weak reference to the gradient, its version) at the end of the last backward; None: nothing to
    # compare at the next step
    grads: Optional[dict[str, tuple["weakref.ref[torch.Tensor]", int]]] = None
    queued: bool = False  # a callback is queued for the running backward
    warned: bool = False  # the in-place warning was given
    split: set[int] = field(default_factory=set)  # the mesh axes that split some parameter (fixed at shard())


@dataclass
class ShardedState:
    """What fxshard's modules use of one ShardedModule (module doc): its name in messages, the layout of its
    tensors, and the records kept per module."""

    where: str  # e.g. "ShardedModule(Llama)"
    layout: ParameterLayout
    grads: GradRecord = field(default_factory=GradRecord)
    auto: Optional["AutoReport"] = None  # what auto=True decided (and measured), for ``sm.sharding.auto``

    def copied(self) -> "ShardedState":
        """A copy for a copy of the module (``copy.copy``, ``deepcopy``, a pickle): its own records, the same
        layout (never changed after ``shard()``)."""
        g = self.grads
        return ShardedState(self.where, self.layout,
                            GradRecord(None if g.grads is None else dict(g.grads), g.queued, g.warned, set(g.split)),
                            self.auto)


class HasShardedState(Protocol):
    """A ShardedModule as the modules of ``state/`` see it: its ``ShardedState`` and its local parameters
    (nn.Module's iterators)."""

    fxshard_state: ShardedState

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...
