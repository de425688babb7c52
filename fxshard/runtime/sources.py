"""The user's tensors that live ShardedModules' local shards come from (their *sources*), and the local shards
shared between ShardedModules.

``shard()`` gives every parameter and buffer of a model a new local tensor. One tensor of the user's model can
reach several ShardedModules: the model sharded twice (for another example input size or Python scalar
argument, or a training and an eval module), or two modules that share a submodule (an encoder and a decoder
sharing an ``nn.Embedding``) each sharded. In eager they compute with one tensor and train it once, so here a
source that already backs a live ShardedModule's local tensor gets that same tensor (:func:`shared_local`), not
a second copy of the source's values (which are stale once the first module trained): both modules accumulate
their gradients into one ``.grad`` and an optimizer updates one tensor, as eager. Buffers alike (a BatchNorm's
running statistics that one module updates, the other reads). Sharing needs one local layout: the same mesh
(the same ranks in the same positions), placements, dtype and device; a source laid out otherwise raises a
ShardingError naming both layouts.

Once sharded, the source itself is stale: code outside the ShardedModule that still uses it (a parent module
sharing an ``nn.Linear`` with the sharded block) would train a tensor the ShardedModule never reads again. A
post-accumulate-grad hook on each trained source parameter raises a ShardingError when it gets a gradient while a
ShardedModule holding its local tensor lives (:func:`remember`); the hook goes when the last such module dies.

Only weak references are kept: nothing here keeps a model or a ShardedModule alive. A ShardedModule is a holder
only if ``shard()`` made it: a copy (``copy.deepcopy(sm)``, a loaded pickle) has new tensors of its own and is
independent, and FSDP2's ``fully_shard(sm)`` (which registers its own parameters in ``sm``) makes the tensors
it replaced unsharable (:func:`shared_local` raises rather than share a tensor nothing trains). Not detected:
``fully_shard`` of one of two ShardedModules that share a tensor already (the other keeps the tensor FSDP2
replaced; torch's FSDP2 likewise needs a shared parameter in one group), and other reads of a stale source
(the tensor itself, ``model.net.weight``).

The sharded model's forward and ``state_dict()`` (or those of a module of it a parent still reaches) use the
sources' values; once a ShardedModule holding them changed its local tensors (trained, loaded, initialized),
they are stale, and a forward / state_dict pre-hook raises a ShardingError (``model(x)`` after training the
ShardedModule computed with the values from before and ``torch.save(model.state_dict())`` saved them,
silently), until the values are copied back (``model.load_state_dict(sm.full_state_dict())``: a load
post-hook marks what it wrote current). The hooks do nothing while ``shard()`` traces the model
(:func:`shard_tracing`) and go when no live ShardedModule holds a tensor of the module any more (a deep copy's
forward hook removes itself at its first call). While they are on, ``torch.jit.script`` of the model fails
(TorchScript compiles forward pre-hooks): script a copy made before ``shard()``.

Liveness must be the same on every rank (whether a source is shared decides whether ``shard()`` broadcasts it):
a ShardedModule that is garbage in a reference cycle is alive until the collector runs, which differs between
ranks, so :func:`settle` runs a collection before any source is looked up again.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..core.hooks import own_hook
from ..core.errors import ShardingError, name_few
from ..core.placements import Pl, R
from .state_interop import tensor_at


__all__ = ["Layout", "settle", "shared_local", "is_blank", "remember", "shard_tracing", "SHARED"]

# what an error message that suggests sharding the model again adds
SHARED = ("a second ShardedModule of the same model shares its parameters and buffers with the first, so both "
          "train one tensor each, as the model does")


@dataclass(frozen=True)
class Layout:
    """How a local tensor holds its source: the mesh (device type, shape, ranks in mesh order), the placements
    (one per mesh axis), the local dtype and device. Two local tensors of one source with equal layouts hold
    the same elements on every rank. ``names`` (the mesh axis names) are for messages only."""

    mesh: tuple
    placements: tuple[Pl, ...]
    dtype: torch.dtype
    device: torch.device
    names: tuple[str, ...] = field(compare=False, default=())

    @staticmethod
    def of(mesh: DeviceMesh, placements: tuple[Pl, ...], dtype: torch.dtype, device: torch.device) -> "Layout":
        names = mesh.mesh_dim_names or tuple(f"axis{i}" for i in range(mesh.ndim))
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        return Layout((mesh.device_type, tuple(mesh.shape), ranks), tuple(placements), dtype, torch.device(device),
                      tuple(names))

    def describe(self) -> str:
        """E.g. ``S(0) over 'tp' on the mesh {'tp': 2} (ranks [0, 1]), torch.float32 on cpu``."""
        _, shape, ranks = self.mesh
        split = ", ".join(f"{pl!r} over {a!r}" for pl, a in zip(self.placements, self.names) if pl != R)
        return (f"{split or 'replicated'} on the mesh {dict(zip(self.names, shape))} (ranks {list(ranks)}), "
                f"{self.dtype} on {self.device}")


@dataclass
class _Entry:
    """One source: ``holders`` are the live ShardedModules whose local tensor of it is registered under a
    name (the first holder's name and module type, ``name``, name it in messages)."""

    source: "weakref.ref[torch.Tensor]"
    layout: Layout
    shape: tuple[int, ...]  # the local tensor's shape on this rank
    name: str
    holders: list[tuple["weakref.ref[torch.nn.Module]", str]]  # (a ShardedModule, its fqn)
    hook: Any = None  # the source's post-accumulate-grad hook (None for a buffer or a frozen parameter)
    blank: Optional[tuple["weakref.ref[torch.Tensor]", int]] = None  # an unfilled local tensor and its version
    # the local tensor, its version and the source's when the entry was made (see _stale)
    made: Optional[tuple["weakref.ref[torch.Tensor]", int, int]] = None


_ENTRIES: dict[int, _Entry] = {}  # id(source) -> entry (the source's weakref tells an id reused after it died)


def settle(sources: Iterable[torch.Tensor]) -> None:
    """Ensures: if some of ``sources`` were sources of a ShardedModule, the garbage collector has run, so that
    which ShardedModules are alive is the same on every rank (module doc)."""
    if any((entry := _ENTRIES.get(id(t))) is not None and entry.source() is t for t in sources):
        gc.collect()


def _entry(source: torch.Tensor) -> Optional[_Entry]:
    """``source``'s entry if a live ShardedModule holds its local tensor (dropping a dead one)."""
    entry = _ENTRIES.get(id(source))
    if entry is None:
        return None
    entry.holders = [(ref, fqn) for ref, fqn in entry.holders if ref() is not None]
    if entry.source() is not source or not entry.holders:
        _drop(id(source), entry)
        return None
    return entry


def _drop(key: int, entry: _Entry) -> None:
    """Forget ``entry`` (keyed ``key``) and remove its source's hook, and the module hooks of modules that now
    hold no source a live ShardedModule holds."""
    if entry.hook is not None:
        entry.hook.remove()
    if _ENTRIES.get(key) is entry:
        del _ENTRIES[key]
    for ref in _WATCHERS.pop(key, ()):
        m = ref()
        watch = _WATCHED.get(m) if m is not None else None
        if watch is not None:
            watch.keys.discard(key)
            if not watch.keys:
                for handle in watch.handles:
                    handle.remove()
                del _WATCHED[m]


def shared_local(source: torch.Tensor, layout: Layout, name: str, where: str) -> Optional[torch.Tensor]:
    """The local tensor of ``source`` a live ShardedModule holds, to be registered as is in the module
    ``shard()`` builds (``where`` names it, ``name`` is the tensor's FQN in it); None if no live module holds one.

    Requires: ``layout`` is how the new module would hold ``source``. Raises a ShardingError when the module
    that holds it laid it out otherwise, or replaced it since by a tensor of another kind, dtype or shape (e.g.
    FSDP2's ``fully_shard``, ``sm.half()``): one tensor cannot be held two ways.
    """
    entry = _entry(source)
    if entry is None:
        return None
    ref, fqn = entry.holders[0]
    holder = ref()
    local = tensor_at(holder, fqn)
    first = f"{holder.fxshard_state.where} (as {fqn!r})"
    if layout != entry.layout:
        raise ShardingError(
            f"{where}: {name!r} is the same tensor as {entry.name}, which {first} holds already, laid out "
            f"{entry.layout.describe()}; here it would be {layout.describe()}. The two ShardedModules must share one "
            f"local tensor to train it once (as eager trains one tensor), and a tensor has one layout: give it the "
            f"same placement in both plans, on the same mesh, with the model in the same dtype and device. For an "
            f"independent copy instead (e.g. to compare plans), shard a copy.deepcopy of the model")
    if isinstance(local, DTensor):
        raise ShardingError(
            f"{where}: {name!r} is the same tensor as {entry.name}, whose local tensor {first} held, but FSDP2's "
            f"fully_shard replaced it there by FSDP2's own sharded parameter, which a second ShardedModule cannot "
            f"share. Shard the model once and call that module for every use (under FSDP2 a shared parameter "
            f"belongs to one group, as in torch), or shard a copy.deepcopy of the model for an independent module")
    if local.dtype != layout.dtype or local.device != layout.device or tuple(local.shape) != entry.shape:
        raise ShardingError(
            f"{where}: {name!r} is the same tensor as {entry.name}, whose local tensor {first} holds, laid out "
            f"{entry.layout.describe()} (shape {list(entry.shape)}); it was replaced or converted there since (now "
            f"a {local.dtype} tensor of shape {list(local.shape)} on {local.device}), so it no longer matches the "
            f"model's. Convert the model before shard() (model.to(...)) rather than the ShardedModule, so that "
            f"every module sharded from it holds it alike, or shard a copy.deepcopy of the model for an "
            f"independent module")
    return local


def is_blank(source: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether ``local`` (from :func:`shared_local`) is the unfilled tensor ``shard()`` made for a meta-built
    ``source`` and nothing wrote it since."""
    entry = _ENTRIES.get(id(source))
    return (entry is not None and entry.blank is not None and entry.blank[0]() is local
            and local._version == entry.blank[1])


def remember(sm: torch.nn.Module, sources: Mapping[str, tuple[torch.Tensor, Layout]], model: torch.nn.Module,
             blank: Iterable[str] = ()) -> None:
    """Requires: ``sm`` is the ShardedModule ``shard()`` built from ``model``, ``sources`` maps each of its
    parameter/buffer FQNs (one per tensor) to the model's tensor and the layout it has in ``sm``; ``blank`` are
    the FQNs whose local tensors were made unfilled. Ensures: :func:`shared_local` finds ``sm``'s local tensors
    while ``sm`` lives; meanwhile a source parameter that gets a gradient raises, and so do the forward and
    ``state_dict()`` of ``model`` and of its modules that own a stale source (module doc)."""
    blank = set(blank)
    name = type(model).__name__
    for fqn, (source, layout) in sources.items():
        key = id(source)
        entry = _entry(source)
        if entry is None:
            local = tensor_at(sm, fqn)
            entry = _Entry(weakref.ref(source), layout, tuple(local.shape), f"{fqn!r} of {name}", [])
            if fqn in blank:
                entry.blank = (weakref.ref(local), local._version)
            if not source.is_meta:
                entry.made = (weakref.ref(local), local._version, source._version)
            if isinstance(source, torch.nn.Parameter) and source.requires_grad:
                entry.hook = source.register_post_accumulate_grad_hook(_stale_source_trained)
            _ENTRIES[key] = entry
        entry.holders.append((weakref.ref(sm, lambda _, key=key: _forget(key)), fqn))
    ids = {id(source) for source, _ in sources.values()}
    for m in model.modules():  # the model, and its modules that a parent may still reach (a shared submodule)
        if m is not model and not any(id(t) in ids for t in (*m._parameters.values(), *m._buffers.values())):
            continue
        keys = {id(t) for t in (*m.parameters(), *m.buffers())} & ids
        if m not in _WATCHED:
            _WATCHED[m] = _Watch((m.register_state_dict_pre_hook(_refuse_stale_state_dict),
                                  m.register_forward_pre_hook(_refuse_stale_forward),
                                  m.register_load_state_dict_post_hook(_current_after_load)), set())
        _WATCHED[m].keys.update(keys)
        for key in keys:
            _WATCHERS.setdefault(key, []).append(weakref.ref(m))


@dataclass
class _Watch:
    """The hooks :func:`remember` put on a module, and the sources (``id``) of its tensors a live ShardedModule
    holds: the hooks go when the last of those entries is dropped."""

    handles: tuple
    keys: set[int]


_WATCHED: "weakref.WeakKeyDictionary[torch.nn.Module, _Watch]" = weakref.WeakKeyDictionary()
_WATCHERS: dict[int, list["weakref.ref[torch.nn.Module]"]] = {}  # id(source) -> the watched modules holding it
_QUIET = threading.local()  # .depth > 0 while this thread's shard() traces a model (no stale value is read)


@contextlib.contextmanager
def shard_tracing() -> Iterator[None]:
    """While active (in this thread), the hooks :func:`remember` puts on a sharded model's modules do nothing:
    ``shard()`` traces the model (again) then, which runs its forward."""
    _QUIET.depth = getattr(_QUIET, "depth", 0) + 1
    try:
        yield
    finally:
        _QUIET.depth -= 1


def _stale(entry: _Entry, source: torch.Tensor) -> bool:
    """Whether ``source`` holds other values than the ShardedModules that hold its local tensor: they wrote that
    tensor (trained, loaded or initialized it) since ``shard()`` or since the source was last written, and
    nothing wrote the source since (a source written after its local tensor was copied back: later writes of
    the local tensor make it stale again)."""
    if entry.made is None:
        return False
    local, version, source_version = entry.made
    t = local()
    if t is None:
        return False
    if source._version != source_version:
        entry.made = (local, t._version, source._version)
        return False
    return t._version != version


def _refuse_stale(module: torch.nn.Module, prefix: str, what: str, fix: str) -> None:
    """Raise a ShardingError if a tensor of ``module`` (``prefix`` before its names) is a stale source while a
    ShardedModule holding it lives: ``module`` would ``what`` (``fix``: how to get the current values)."""
    if getattr(_QUIET, "depth", 0) or module not in _WATCHED:  # a copy.deepcopy carries the hooks: its own
        return
    stale = []
    for attr, t in (*module.named_parameters(), *module.named_buffers()):
        entry = _entry(t)
        if entry is not None and _stale(entry, t):
            stale.append((prefix + attr, entry))
    if stale:
        sm, fqn = next((ref(), fqn) for ref, fqn in stale[0][1].holders if ref() is not None)
        raise ShardingError(
            f"{type(module).__name__}.{what} stale values of {name_few([n for n, _ in stale], 3)}: fxshard.shard() "
            f"made them the sources of {sm.fxshard_state.where}'s local tensors (e.g. {fqn!r}), which it has changed "
            f"since (trained, loaded or initialized), while the model's own tensors still hold the values from "
            f"before shard(). {fix}, or copy the values back first (model.load_state_dict(sm.full_state_dict()))")


def _refuse_stale_state_dict(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
    """The state_dict pre-hook of a sharded model and of its modules that own sources (module doc)."""
    _refuse_stale(module, prefix, "state_dict() would return",
                  "Take the ShardedModule's values: sm.full_state_dict() (full tensors under these keys), "
                  "sm.state_dict() (DTensors) or dcp.save(sm.sharded_state_dict(), ...)")


@own_hook
def _refuse_stale_forward(module: torch.nn.Module, args: Any) -> None:
    """The forward pre-hook of a sharded model and of its modules that own sources (module doc)."""
    if module not in _WATCHED:  # a copy.deepcopy of a watched module: its tensors are its own
        for key in [k for k, h in module._forward_pre_hooks.items() if h is _refuse_stale_forward]:
            del module._forward_pre_hooks[key]
        return
    _refuse_stale(module, "", "forward would compute with",
                  "Call the ShardedModule instead (it holds the current values; for an unsharded reference with the "
                  "values from before, use a copy.deepcopy of the model made before shard())")


def _current_after_load(module: torch.nn.Module, incompatible_keys: Any) -> None:
    """The load_state_dict post-hook of a sharded model and of its modules that own sources: values the load
    wrote into them (``model.load_state_dict(sm.full_state_dict())``) are current until the ShardedModule
    writes its local tensors again; the others keep their state."""
    if module not in _WATCHED:
        return
    for t in (*module.parameters(), *module.buffers()):
        entry = _entry(t)
        if entry is not None and entry.made is not None and (local := entry.made[0]()) is not None \
                and t._version != entry.made[2]:
            entry.made = (entry.made[0], local._version, t._version)


def _forget(key: int) -> None:
    """A holder of source ``id == key`` died: drop the entry (and the hook) if it was the last."""
    entry = _ENTRIES.get(key)
    if entry is None:
        return
    entry.holders = [(ref, fqn) for ref, fqn in entry.holders if ref() is not None]
    if not entry.holders:
        _drop(key, entry)


def _stale_source_trained(source: torch.Tensor) -> None:
    """The post-accumulate-grad hook of a source parameter: it got a gradient, so something trains it (module
    doc). Raises a ShardingError."""
    entry = _ENTRIES.get(id(source))
    if entry is None or entry.source() is not source:
        return
    holders = [(ref(), fqn) for ref, fqn in entry.holders]
    held = ", ".join(f"{sm.fxshard_state.where} (as {fqn!r})" for sm, fqn in holders if sm is not None)
    raise ShardingError(
        f"{entry.name} got a gradient, but fxshard.shard() made it the source of the local tensor of {held}, "
        f"which trains that local tensor and never reads this one again: training both would untie them "
        f"silently (eager trains one tensor). Code outside the ShardedModule still uses the original, e.g. a "
        f"parent module sharing this submodule with the sharded one (model.block = fxshard.shard(model.block, "
        f"...)). Shard the module that owns every use of it (the parent), or move the shared use inside the "
        f"sharded module; for an unsharded reference model, train a copy.deepcopy made before shard()")
