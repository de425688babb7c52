"""The stand-ins of a ShardedModule: the modules standing in for the original model's (``StandIn``, the base of
``ShardedModule`` and of ``Scope``, ``ScopeList``, ``ScopeDict``), their classes made per original class (a
subclass of both, whose guard keeps the original class's code from running on a rank's pieces), and the errors
they raise for what would silently change nothing (setting a traced attribute, replacing a stand-in, calling
one, hooks that would never fire)."""

from __future__ import annotations

import types
import warnings
import weakref
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from ..core.errors import ShardingError
from ..core.torch_compat import is_fsdp

__all__ = ["StandIn", "Scope", "ScopeList", "ScopeDict", "scope_for", "keep_traced", "container",
           "register_train_overrides"]


class StandIn(nn.Module):
    """A module standing in for one of the original model's (a ShardedModule for the model, a Scope for a
    submodule). The plain attributes the original had when traced (``keep_traced``) were constants to the
    programs: setting one raises (``_refuse_traced``); reading one gives its value then if that is immutable (a
    dropout's ``p``, an embedding's ``sparse``, which DDP reads), else explains why it is not here
    (``_traced_attribute``: an HF model's ``config``). Replacing a submodule's stand-in raises
    (``_refuse_replacing``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        _refuse_traced(self, name)
        if value is None or isinstance(value, nn.Module):
            _refuse_replacing(self, name, value)
        super().__setattr__(name, value)

    def add_module(self, name: str, module: Optional[nn.Module]) -> None:
        _refuse_replacing(self, name, module)
        super().add_module(name, module)

    def train(self, mode: bool = True) -> "StandIn":
        """``nn.Module.train``; where the original's class overrides it (a backbone keeping its BatchNorms in eval,
        freezing a stage), that override instead, run on the model's meta copy (``_TRAIN_OVERRIDES``), and this
        subtree takes the modes and ``requires_grad`` flags it leaves, as eager's ``model.train()`` runs it."""
        override = _TRAIN_OVERRIDES.get(self)
        if override is None:
            return super().train(mode)
        mods, params = dict(self.named_modules()), dict(self.named_parameters())
        after = override(mode, {n: m.training for n, m in mods.items()},
                         {n: p.requires_grad for n, p in params.items()})
        if after is None:
            warnings.warn(f"fxshard: {type(self).__name__}.train overrides nn.Module.train, but fxshard kept no copy of "
                          f"the model to run it on, so only nn.Module.train ran: set the modes it would set on the "
                          f"stand-ins yourself (sm.<submodule>.eval())", stacklevel=2)
            return super().train(mode)
        modes, grads = after
        for n, flag in modes.items():
            if n in mods and mods[n].training != flag:
                mods[n].training = flag
        for n, flag in grads.items():
            if n in params and params[n].requires_grad != flag:
                params[n].requires_grad_(flag)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            values = self.__dict__.get("_traced_values", {})
            if name in values:
                return values[name]
            raise _traced_attribute(self, name) from None


# a stand-in (or ShardedModule) whose original's class overrides nn.Module.train -> that override, run on the
# model's meta copy (api._resharder): kept here, not on the stand-in, which pickles alone (a closure does not)
_TRAIN_OVERRIDES: "weakref.WeakKeyDictionary[nn.Module, Callable[..., Optional[tuple[dict, dict]]]]" = \
    weakref.WeakKeyDictionary()


def register_train_overrides(root: nn.Module, overrides: Mapping[str, Callable[..., Any]]) -> None:
    """Ensures: each stand-in of ``root`` (FQN -> the override of ``train`` its original class has, in
    ``overrides``) finds it."""
    for fqn, override in overrides.items():
        _TRAIN_OVERRIDES[root.get_submodule(fqn)] = override


class Scope(StandIn):
    """Stands in a ShardedModule for one submodule of the original model: it holds that submodule's
    local parameters and buffers and its train/eval mode (``sm.dropout.eval()`` works as on the model).

    Its class is made per original class (``_stand_in_class``): a subclass of both, named like it, so code
    that selects modules by type (``isinstance(m, nn.LayerNorm)``, ``type(m).__name__``) finds it as on the
    model. What runs is the stand-in's: nn.Module's methods (``train``, ``apply``, ``state_dict``, ...) even
    where the original class overrides them, and none of the original class's own methods and properties
    (they would compute with this rank's pieces): those raise a ShardingError (``_guard``).

    It is not called (the ShardedModule runs the whole model as one program), so hooks that would wait
    for its call raise a ShardingError at registration, except FSDP2's: ``fully_shard(sm.layers[i])``
    works (the ShardedModule drives those hooks around its program, see ``ShardedModule.forward``)."""

    def __init__(self, kind: str = "Module", fqn: str = "") -> None:
        super().__init__()
        self._kind = kind
        self._fqn = fqn

    def _get_name(self) -> str:
        return self._kind

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ShardingError(f"the {self._kind} {self._fqn!r} inside a ShardedModule cannot run on its own: fxshard "
                            f"shards the whole model as one program; call the ShardedModule (or shard this submodule "
                            f"itself). For activation checkpointing of its layers use shard(..., remat='layers')")

    def _no_hooks(self, what: str, hook: Any) -> None:
        if is_fsdp(getattr(hook, "__self__", None), "_fsdp_state", "FSDPState"):
            return
        raise ShardingError(
            f"{what} on the {self._kind} {self._fqn!r} inside a ShardedModule would never fire: fxshard runs the whole "
            f"model as one program, so its submodules are never called. Register the hook on the ShardedModule itself "
            f"(its local inputs and outputs), return the value you need from the model's forward (out_specs give its "
            f"layout), or shard that submodule on its own; for activation checkpointing use shard(..., remat='layers'), "
            f"for FSDP2 per layer fully_shard(sm.<layer>) works as is")

    def register_forward_pre_hook(self, hook: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self._no_hooks("a forward pre-hook", hook)
        return super().register_forward_pre_hook(hook, **kwargs)

    def register_forward_hook(self, hook: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self._no_hooks("a forward hook", hook)
        return super().register_forward_hook(hook, **kwargs)

    def register_full_backward_pre_hook(self, hook: Any, prepend: bool = False) -> Any:  # type: ignore[override]
        self._no_hooks("a backward pre-hook", hook)
        return super().register_full_backward_pre_hook(hook, prepend)

    def register_full_backward_hook(self, hook: Any, prepend: bool = False) -> Any:  # type: ignore[override]
        self._no_hooks("a backward hook", hook)
        return super().register_full_backward_hook(hook, prepend)

    def register_backward_hook(self, hook: Any) -> Any:  # type: ignore[override]
        self._no_hooks("a backward hook", hook)
        return super().register_backward_hook(hook)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickles (and copies) a stand-in by its stand-in kind and original class, which find its class again
        (``_stand_in_class``): the generated class itself cannot be found by name."""
        made = type(self).__dict__.get("_stand_in_of")
        if made is None:  # a plain Scope, or FSDP2's subclass of a stand-in class (FSDP2 refuses copies itself)
            return super().__reduce_ex__(protocol)
        return _remake_stand_in, made, self.__getstate__()


class ScopeList(Scope):
    """The stand-in of an ``nn.ModuleList``/``nn.Sequential``: indexed, sliced, iterated and sized like it
    (``sm.layers[0]``, ``for layer in sm.layers``, ``len(sm.layers)``)."""

    def __getitem__(self, idx: int | slice) -> Any:
        items = list(self._modules.values())
        if isinstance(idx, slice):
            return items[idx]
        if not isinstance(idx, int) or not -len(items) <= idx < len(items):
            raise ShardingError(f"{self._kind} {self._fqn!r} has {len(items)} modules; index {idx!r} is not one of them")
        return items[idx]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Any:
        return iter(list(self._modules.values()))


class ScopeDict(Scope):
    """The stand-in of an ``nn.ModuleDict``: ``sm.blocks["a"]``, ``in``, ``len``, ``keys``/``values``/``items``."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._modules:
            raise ShardingError(f"{self._kind} {self._fqn!r} has no module {key!r}; it has {list(self._modules)}")
        return self._modules[key]

    def __contains__(self, key: str) -> bool:
        return key in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Any:
        return iter(list(self._modules))

    def keys(self) -> Any:
        return list(self._modules)

    def values(self) -> Any:
        return list(self._modules.values())

    def items(self) -> Any:
        return list(self._modules.items())


def scope_for(kind: type, fqn: str, traced: Mapping[str, Any]) -> Scope:
    """The stand-in of a submodule of type ``kind`` (subclasses of the containers included) whose plain
    attributes ``traced`` (name -> value) were constants to the trace: an instance of ``kind`` (see
    ``_stand_in_class``)."""
    base = (ScopeList if issubclass(kind, (nn.ModuleList, nn.Sequential)) else
            ScopeDict if issubclass(kind, nn.ModuleDict) else Scope)
    scope = _stand_in_class(base, kind)(kind.__name__, fqn)
    keep_traced(scope, traced)
    return scope


_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
              torch.memory_format)


def keep_traced(m: nn.Module, traced: Mapping[str, Any]) -> None:
    """Records on the stand-in ``m`` the plain attributes (name -> value) its original had when traced: their
    names (``_traced_attrs``: setting one raises) and the values of the immutable ones (``_traced_values``:
    numbers, strings, None, dtypes, devices and tuples of them, read as on the original)."""
    m._traced_attrs = frozenset(traced)
    m._traced_values = {name: value for name, value in traced.items() if _immutable(value)}


def _immutable(value: Any) -> bool:
    """Whether ``value`` is one of ``_IMMUTABLE``'s types, or a tuple or frozenset of such values."""
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE)


# ---- stand-in classes ----------------------------------------------------------------------------------------
# A stand-in for a module of class C has a generated class also named C, with bases (stand-in kind, C's guard),
# so its MRO is: generated C, Scope (or ScopeList/ScopeDict), StandIn, _CGuard, C, C's bases, nn.Module, (C's
# mixins), object:
# the stand-in's own methods come first, then the guard, which overrides everything C's classes define (all
# but nn.Module and object) with nn.Module's version or a ShardingError (``_guard_entry``); the stand-in
# classes' own super() calls reach the guard too, so none of C's code runs on the stand-in.

_STAND_IN_CLASSES: dict[tuple[type, type], type] = {}
_GUARDS: dict[type, type] = {}
_INHERIT = object()  # _guard_entry: leave the original class's attribute as it is
# what Python reads off a class itself (never overridden)
_CLASS_MACHINERY = frozenset({
    "__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__slots__", "__annotations__",
    "__annotate__", "__abstractmethods__", "_abc_impl", "__orig_bases__", "__parameters__", "__static_attributes__",
    "__firstlineno__", "__type_params__", "__init_subclass__", "__class_getitem__", "__subclasshook__"})
# what every module instance, and a stand-in, holds in its __dict__: a class attribute of that name is never read
_INSTANCE_NAMES = frozenset(vars(nn.Module())) | {"_kind", "_fqn", "_traced_attrs", "_traced_values"}
_MODULE_CLASS_ATTRS = {name: value for klass in reversed(nn.Module.__mro__) for name, value in vars(klass).items()}


def _stand_in_class(kind: type, orig: type) -> type:
    """The class of the stand-ins of kind ``kind`` (Scope, ScopeList, ScopeDict) for modules of class ``orig``.

    Ensures: a subclass of ``kind`` and of ``orig``, named like ``orig`` (``__name__``, ``__qualname__``), one per
    ``(kind, orig)``; its instances behave as ``kind``'s (see the MRO above). If Python cannot make such a class
    (``orig``'s ``__init_subclass__`` or layout refuses it: a TypeError), ``kind`` itself, with a warning."""
    key = (kind, orig)
    cls = _STAND_IN_CLASSES.get(key)
    if cls is None:
        ns = {"__module__": __name__, "__qualname__": orig.__qualname__, "_stand_in_of": key,
              "__doc__": f"A {kind.__name__} standing in for a {orig.__module__}.{orig.__qualname__} (see Scope)."}
        try:
            cls = types.new_class(orig.__name__, (kind, _guard(orig)), exec_body=lambda d: d.update(ns))
        except TypeError as e:
            warnings.warn(f"the stand-ins of {orig.__qualname__} modules inside a ShardedModule are not instances of "
                          f"{orig.__qualname__} (isinstance() is False for them): Python could not subclass it ({e})",
                          stacklevel=4)
            cls = kind
        _STAND_IN_CLASSES[key] = cls
    return cls


def _remake_stand_in(kind: type, orig: type) -> Scope:
    """An empty stand-in of ``_stand_in_class(kind, orig)`` (unpickling, copying: its state is set next)."""
    cls = _stand_in_class(kind, orig)
    return cls.__new__(cls)


def _guard(orig: type) -> type:
    """The subclass of ``orig`` that overrides, for every attribute the classes of ``orig``'s MRO other than
    nn.Module and object define, what a stand-in uses instead (``_guard_entry``); one per ``orig``."""
    guard = _GUARDS.get(orig)
    if guard is None:
        ns: dict[str, Any] = {"__module__": __name__, "__qualname__": f"_{orig.__name__}Guard"}
        seen: set[str] = set()
        for klass in orig.__mro__:
            if klass is nn.Module or klass is object:
                continue
            for name, value in vars(klass).items():
                if name not in seen:
                    seen.add(name)
                    entry = _guard_entry(orig, name, value)
                    if entry is not _INHERIT:
                        ns[name] = entry
        guard = _GUARDS[orig] = types.new_class(ns["__qualname__"], (orig,), exec_body=lambda d: d.update(ns))
    return guard


def _guard_entry(orig: type, name: str, value: Any) -> Any:
    """What the guard of ``orig`` defines for ``name`` (``value`` in the first class of ``orig``'s MRO that
    defines it), or ``_INHERIT``:

    - nn.Module's (or object's) own ``name`` where it has one: ``train``, ``eval``, ``to``, ``_apply``,
      ``__setattr__``, ``_load_from_state_dict``, ``extra_repr``, ``__repr__``, ... (``_version``, the state dict
      format, stays the original class's);
    - ``orig``'s own class constants (neither callable nor descriptors, or classes: HF's ``base_model_prefix``,
      ``_no_split_modules``, ``config_class``) stay readable and cannot be set (``_ClassConstant``);
    - ``orig``'s own methods and properties (``reset_parameters``, ``_init_weights``, a parametrization's
      ``weight``) raise a ShardingError when called or read (``_blocked_method``, ``_blocked_attribute``)."""
    if name in _CLASS_MACHINERY or name in _INSTANCE_NAMES or name == "_version":
        return _INHERIT
    if name == "__new__":  # object.__new__ itself would refuse the stand-in's arguments
        return staticmethod(_plain_new)
    if name in _MODULE_CLASS_ATTRS:
        return _MODULE_CLASS_ATTRS[name]
    if name in ("__copy__", "__deepcopy__"):  # copy falls back to Scope.__reduce_ex__
        return None
    if name == "__del__":
        return _no_finalizer
    dunder = name.startswith("__") and name.endswith("__")
    if isinstance(value, type) or not (callable(value) or hasattr(type(value), "__get__")):
        return _INHERIT if dunder else _ClassConstant(name, value)
    if isinstance(value, (staticmethod, classmethod)) or (callable(value) and not hasattr(type(value), "__set__")):
        return _blocked_method(orig, name)
    return _blocked_attribute(orig, name)


def _plain_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``__new__`` of a stand-in class whose original defines its own: an empty instance, as nn.Module's."""
    return object.__new__(cls)


def _no_finalizer(self: Any) -> None:
    """A stand-in has none of the resources an original ``__del__`` releases."""


class _ClassConstant:
    """A class constant of the original class (see ``_guard_entry``): read as on the original, except where the
    original module had its own value of that name when traced (then that value, or the AttributeError of
    ``_traced_attribute``, never the class's default: see ``StandIn``); setting it raises (``_unchanged``)."""

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is not None and self.name in obj.__dict__.get("_traced_attrs", ()):
            raise AttributeError(self.name)  # the stand-in's __getattr__ answers
        return self.value

    def __set__(self, obj: Any, value: Any) -> None:
        raise _unchanged(_stand_in_name(obj), self.name)


def _blocked_method(orig: type, name: str) -> Callable[..., Any]:
    """A method that raises ``_original_code`` when called (the attribute itself exists, as on the original)."""
    def blocked(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise _original_code(self, orig, name, "cannot run")
    blocked.__name__, blocked.__qualname__ = name, f"{orig.__qualname__}.{name}"
    return blocked


def _blocked_attribute(orig: type, name: str) -> property:
    """A property that raises ``_original_code`` when read or set."""
    def read(self: Any) -> Any:
        raise _original_code(self, orig, name, "(a property) cannot be read")

    def write(self: Any, value: Any) -> None:
        raise _original_code(self, orig, name, "(a property) cannot be set")
    return property(read, write)


def _original_code(m: Any, orig: type, name: str, what: str) -> ShardingError:
    """Why ``orig``'s own ``name`` does not run on the stand-in ``m`` (see ``_guard_entry``), and what to do."""
    where = _stand_in_name(m) if isinstance(m, Scope) else f"a stand-in of {orig.__qualname__}"
    lowered = name.lower()
    if "init" in lowered or lowered.lstrip("_").startswith("reset"):
        why = ("an initializer would see this rank's local shapes (and a random one draw the same numbers on every "
               "rank)")
        fix = ("Initialize on the ShardedModule with sm.init_parameters(fn) (fn(name, t) sees each tensor at its "
               "global shape) or sm.load_full_state_dict(...), or initialize the original model before shard()")
    else:
        why = "its code would compute with those pieces or fail"
        fix = (f"Use {name} on the original model (read its attributes there; shard again to change what the "
               f"ShardedModule computes)")
    return ShardingError(
        f"{orig.__qualname__}.{name} {what} on {where}: the stand-in holds only this rank's pieces of the module's "
        f"parameters and buffers, so {why}. {fix}")


def _stand_in_name(m: nn.Module) -> str:
    """How to name the stand-in ``m`` (a ShardedModule or a Scope) in a message."""
    return f"the {m._kind} {m._fqn!r} inside a ShardedModule" if isinstance(m, Scope) else m.fxshard_state.where


def _traced_owner(m: nn.Module, name: str) -> str:
    """How to name ``m`` (a ShardedModule or a Scope) in a message if ``name`` is one of the plain attributes the
    module it stands in for had when traced; empty otherwise."""
    if name not in m.__dict__.get("_traced_attrs", ()):
        return ""
    return _stand_in_name(m)


def _refuse_traced(m: nn.Module, name: str) -> None:
    """Raises ShardingError if ``name`` is one of the plain attributes (a dropout's ``p``, a norm's ``eps``)
    the module ``m`` (a ShardedModule or a Scope) stands in for had when it was traced: the programs hold their
    values, so setting one on the stand-in would silently change nothing."""
    what = _traced_owner(m, name)
    if what:
        raise _unchanged(what, name)


def _refuse_replacing(m: nn.Module, name: str, new: Optional[nn.Module]) -> None:
    """Raises ShardingError if ``new`` would replace the stand-in ``m.<name>`` of a submodule of the original
    model (``sm.bn = SyncBatchNorm(...)``, as convert_sync_batchnorm or a LoRA/freezing utility does, finding
    the stand-in by type): the programs keep computing the original module, so the swap would change nothing."""
    old = m.__dict__.get("_modules", {}).get(name)
    if isinstance(old, Scope) and new is not old:
        raise ShardingError(
            f"replacing {_stand_in_name(old)} with {type(new).__name__ if new is not None else 'None'} would "
            f"change nothing: the programs were traced from the original model's modules and keep computing "
            f"them (with these parameters). Make the change on the original model (e.g. "
            f"nn.SyncBatchNorm.convert_sync_batchnorm(model)) and shard it again")


def _unchanged(what: str, name: str) -> ShardingError:
    """Setting ``name`` on the stand-in ``what`` (named by ``_stand_in_name``) would change nothing."""
    return ShardingError(
        f"setting {name!r} on {what} would change nothing: the programs were traced from the original module "
        f"and hold the value its {name!r} had then. Set {name!r} on the original model and shard it again "
        f"(train/eval modes are the exception: sm.train()/sm.eval() are followed)")


def _traced_attribute(m: nn.Module, name: str) -> AttributeError:
    """Why ``name`` (a plain attribute of the module ``m`` stands in for whose value is mutable, e.g. an HF
    model's ``config``) is not on the stand-in, or torch's AttributeError for anything else."""
    what = _traced_owner(m, name)
    if what:
        return AttributeError(
            f"{what} does not carry the original module's plain attribute {name!r}: its value is mutable, the "
            f"programs were traced with the value it had then, and a copy here could be changed in place to no "
            f"effect (a stand-in carries numbers, strings, None, dtypes and tuples of them). Read it from the "
            f"original model (and shard again to change it)")
    return AttributeError(f"{type(m).__name__!r} object has no attribute {name!r}")


def container(root: nn.Module, path: list[str]) -> nn.Module:
    """The module at ``path`` (attribute names) under ``root``, adding an empty ``Scope`` for each one missing."""
    m = root
    for part in path:
        if not hasattr(m, part) or not isinstance(getattr(m, part), nn.Module):
            m.add_module(part, Scope())  # a parameter's owner the model tree did not list
        m = getattr(m, part)
    return m
