"""Detect a plan, mesh or model that differs between ranks at ``shard()`` time.

Ranks that traced different programs would wait in different collectives and
hang; instead every rank exchanges a short description of what it is about to
shard and all of them raise the same readable error on any difference.
"""

from __future__ import annotations

import hashlib
import re
import types
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .failures import guard_collective
from ..core.errors import ShardingError
from ..core.ir import is_random
from ..core.torch_compat import resolve_process_group as _resolve_process_group

if TYPE_CHECKING:
    from ..core.mesh import MeshInfo

__all__ = ["fingerprint", "stable_repr", "check_same_on_all_ranks", "check_generators_agree", "agree", "on_lead"]


def fingerprint(plan: Optional[Mapping[str, Any]], model: nn.Module, example_inputs: tuple) -> dict[str, str]:
    """Named, comparable descriptions of a plan, model and inputs (``frontend.check_consistent`` adds the
    mesh and specs)."""
    fp: dict[str, str] = {}
    if isinstance(plan, Mapping):
        fp["plan entries"] = stable_repr(list(plan.keys()))
        for key, spec in plan.items():
            fp[f"plan entry {key!r}"] = stable_repr(spec)
    else:
        fp["plan"] = stable_repr(plan)  # not a dict: resolve_plan explains the error on every rank
    fp["model"] = type(model).__name__ + repr([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    fp["modules in eval mode"] = repr([n or "<root>" for n, m in model.named_modules() if not m.training])
    fp["example input shapes"] = repr([tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                                      for x in example_inputs])
    return fp


_ADDRESS = re.compile(r" (?:object )?at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")
_MAX_DEPTH = 6


def stable_repr(value: Any) -> str:
    """A description of ``value`` that is the same in every process for equal values: no memory addresses.

    Requires nothing of ``value``. Ensures: objects carrying state (``__dict__`` or ``__slots__``, e.g. a
    ParallelStyle of any class, with or without a ``__repr__``) are rendered as their class's qualified name
    and their attributes, recursively (nested ``_MAX_DEPTH`` deep, cycles cut); tensors as shape, dtype and
    device type; device meshes as their axes and sizes; functions by qualified name; anything else by its
    ``repr`` with addresses (``at 0x7f...``) removed.
    """
    return _render(value, 0, set())


def _qualname(obj: Any) -> str:
    t = obj if isinstance(obj, type) else type(obj)
    return t.__qualname__


def _state(value: Any) -> Optional[dict[str, Any]]:
    """``value``'s attributes (``__dict__`` and ``__slots__``), or None for an object without any."""
    state = dict(getattr(value, "__dict__", None) or {})
    for cls in type(value).__mro__:
        for slot in (cls.__dict__.get("__slots__", ()) if isinstance(cls.__dict__.get("__slots__", ()), (tuple, list))
                     else (cls.__dict__["__slots__"],)):
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                state[slot] = getattr(value, slot)
    return state or None


def _render(value: Any, depth: int, seen: set[int]) -> str:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if depth > _MAX_DEPTH:
        return f"<{_qualname(value)}>"
    if id(value) in seen:
        return f"<cycle: {_qualname(value)}>"
    seen = seen | {id(value)}
    if isinstance(value, torch.Tensor):
        return f"tensor({list(value.shape)}, {value.dtype}, {value.device.type})"
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) or type(value).__module__.startswith("sympy"):
        return str(value)
    if isinstance(value, nn.Module):
        return f"<module {_qualname(value)}>"
    if isinstance(value, DeviceMesh):
        return f"DeviceMesh({value.device_type}, {list(value.shape)}, {value.mesh_dim_names})"
    if isinstance(value, torch.device):  # each rank's own GPU (cuda:LOCAL_RANK) is the same plan
        return f"device({value.type})"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return f"<{type(value).__name__} {getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}>"
    if isinstance(value, types.MethodType):
        return f"<method {_render(value.__func__, depth + 1, seen)} of {_render(value.__self__, depth + 1, seen)}>"
    if isinstance(value, (tuple, list)):
        items = ", ".join(_render(v, depth + 1, seen) for v in value)
        head = "" if type(value) in (tuple, list) else type(value).__name__
        return f"{head}({items})" if isinstance(value, tuple) else f"{head}[{items}]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{_render(k, depth + 1, seen)}: {_render(v, depth + 1, seen)}" for k, v in value.items())
        return "{" + items + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(_render(v, depth + 1, seen) for v in value)) + "}"
    state = _state(value) if not isinstance(value, types.ModuleType) else None
    if state is not None:
        attrs = ", ".join(f"{k}={_render(v, depth + 1, seen)}" for k, v in sorted(state.items()))
        return f"{_qualname(value)}({attrs})"
    return _ADDRESS.sub("", repr(value))


_SAME_CALL = ("every rank must call shard() (or the jitted function) with the same plan, mesh, model, modes and "
              "input shapes")


def check_same_on_all_ranks(fp: dict[str, str], mesh: Optional["MeshInfo"] = None, advice: str = _SAME_CALL) -> None:
    """Raise ShardingError on every rank if any rank's fingerprint differs (a collective); its message names
    the first difference, then ``advice``.

    With ``mesh`` the ranks compared are the mesh's (one exchange per mesh axis, then one more per
    axis so that every mesh rank learns of any difference): ranks outside it (other pipeline stages,
    other data-parallel replicas sharding over their own sub-mesh) are neither waited for nor compared.
    Without it, every rank of the default group takes part.
    """
    if not _communicates():
        return
    groups = [None] if mesh is None else _axis_groups(mesh)
    found: list[str] = []
    for group in groups:
        everyone: list[Any] = [None] * dist.get_world_size(group)
        guard_collective(lambda: dist.all_gather_object(everyone, fp, group=group),
                         "comparing what every rank shards (the first collective of shard() or of a new jit signature)")
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(everyone)))
        found += _differences(ranks, everyone, advice)[:1]
    if mesh is not None:  # spread what any rank found, axis by axis, so every mesh rank raises
        for group in groups:
            heard: list[Any] = [None] * dist.get_world_size(group)
            guard_collective(lambda: dist.all_gather_object(heard, found[:1], group=group),
                             "telling every rank what differs between ranks")
            found = found[:1] or [f for h in heard for f in h][:1]
    if found:
        raise ShardingError(found[0])


def _differences(ranks: list[int], everyone: list[dict[str, str]], advice: str) -> list[str]:
    """Messages naming each entry that differs between the first rank and another."""
    ref = everyone[0]
    out = []
    for rank, other in zip(ranks, everyone):
        for name in sorted(set(ref) | set(other)):
            if ref.get(name) != other.get(name):
                out.append(
                    f"{name} differs between rank {ranks[0]} ({ref.get(name, 'absent')}) and rank {rank} "
                    f"({other.get(name, 'absent')}); {advice}"
                )
    return out


def check_generators_agree(mesh: "MeshInfo", where: str, graphs: Sequence[Any]) -> None:
    """If any of the sharded ``graphs`` (fx GraphModules, the same on every rank) draws random numbers
    (dropout): raise ShardingError on every rank of ``mesh`` unless every rank's default generator (and the
    device's, on an accelerator) is in the same state (a collective then; nothing otherwise). Each rank draws
    the global random tensor and keeps its piece, so generators out of step would give replicated values
    different masks on different ranks."""
    if not any(is_random(n) for gm in graphs for n in gm.graph.nodes):
        return
    states = [torch.random.get_rng_state()]
    if mesh.device_type != "cpu" and hasattr(torch, mesh.device_type):
        states.append(getattr(torch, mesh.device_type).get_rng_state())
    digest = hashlib.sha1(b"".join(s.numpy().tobytes() for s in states)).hexdigest()[:12]
    check_same_on_all_ranks(
        {"the random generator's state": f"torch.initial_seed() {torch.initial_seed()}, state {digest}"}, mesh,
        f"{where} draws random numbers (dropout) on every rank from its default generator and needs them in the "
        f"same state: seed every rank the same (torch.manual_seed(seed), not seed + rank) before it, and draw "
        f"per-rank randomness (data order, augmentation) from a torch.Generator of its own")


def agree(value: Any, mesh: "MeshInfo") -> Any:
    """``value`` as the rank at mesh coordinate 0 on every axis has it, on every rank of ``mesh``
    (broadcast along each axis in turn; unchanged on one process or the fake process group)."""
    if not _communicates():
        return value
    for group in _axis_groups(mesh):
        box = [value]
        guard_collective(lambda: dist.broadcast_object_list(box, group=group, group_src=0),
                         "agreeing on the auto plan")
        value = box[0]
    return value


def on_lead(fn: Callable[[], Any], mesh: "MeshInfo", what: str) -> Any:
    """``fn()`` computed once, by the rank at mesh coordinate 0 on every axis, and its result handed to every
    rank of ``mesh`` (``agree``), so the other ranks neither spend CPU on it nor can differ. A ShardingError
    it raises is raised on every rank, as the same class (a subclass such as NoPlanError stays one); any other
    exception is raised on the lead and named in a ShardingError on the others. On one process or the fake process group: ``fn()``."""
    if not _communicates():
        return fn()
    out: Any = None
    if all(c == 0 for c in mesh.coords):
        try:
            out = ("ok", fn())
        except ShardingError as e:  # its class too: callers branch on the kind (e.g. NoPlanError)
            out = ("error", (type(e), str(e)))
        except Exception as e:  # the other ranks wait for a result: tell them before raising
            agree(("error", (ShardingError, f"{what} failed on rank {mesh.rank}: {type(e).__name__}: {e}")), mesh)
            raise
    kind, value = agree(out, mesh)
    if kind == "error":
        cls, message = value
        raise cls(message)
    return value


def _communicates() -> bool:
    """Whether there are other ranks to exchange with (not one process, not the fake process group)."""
    return dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


def _axis_groups(mesh: "MeshInfo") -> list[Any]:
    """The process group of each mesh axis with more than one rank, in axis order."""
    return [_resolve_process_group(g) for g, size in zip(mesh.group_names, mesh.sizes) if size > 1]
