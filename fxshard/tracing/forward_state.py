"""Python state a model's forward changes: eager changes it on every call, the sharded program never.

fxshard runs the model's Python ``forward`` once, while tracing; every call of the ShardedModule runs
the traced program. A forward that changes a plain attribute of the model or of a submodule (a call
counter, a flag, a list it appends to) would do so on every eager call, and any value computed from
that state would differ from the second call on, silently. :func:`forward_state_unchanged` compares the
plain attributes before and after the traced call and raises a ShardingError naming the first that
changed.

Compared: Python scalars (numbers, strings, ``None``) by value; lists, tuples, dicts and sets by
their length and their scalar elements; other objects by identity. Attributes every ``nn.Module`` has
(hooks, ``training``, parameters, buffers, submodules) are left out.

Tensors: buffers are the model's state fxshard carries (reassigning one in forward is traced as its
update). A plain tensor attribute, or a tensor in a list, tuple or dict attribute, that forward *reads*
is traced as a constant: if forward also replaces it (``self.mem = y.detach()``, a recurrent memory),
eager reads the new tensor on the next call and the program the old one forever (measured: off by 2.1
on the second call). :meth:`ForwardState.check_constants` raises for those once the traced program's
constants are known; a tensor attribute forward only writes (an activation kept for inspection, a
weight a pre-hook recomputes from parameters) does not change what the program computes and passes, and
so does one replaced by a cast of itself (``self.freqs_cis = self.freqs_cis.to(x.device)``, as Meta's
Llama reference does: the tracer's record shows the new tensor made from the constant by casts only).
A parameter forward replaces by another object (``self.fc.weight = nn.Parameter(...)``) raises.

Host random numbers too: a forward that draws from Python's ``random`` or ``numpy.random`` (a
LayerDrop written ``if random.random() < p``) draws once, while traced, and the program keeps that one
outcome for every call (measured: every call took the traced branch while eager's varied); the check
compares those generators' states around the traced call and raises.

Forward hooks already on the model when it is traced (:func:`warn_traced_hooks`) are traced with it:
what they compute on tensors runs on every call, their Python side effects (logging, appending to a
list) once. That is legitimate often enough (a hook that rescales an output) that it warns instead.
"""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from typing import Any, Iterator

import torch

from ..core.errors import ShardingError, name_few
from ..core.hooks import is_own_hook

__all__ = ["ForwardState", "forward_state_unchanged", "host_rngs_unchanged", "warn_traced_hooks"]

_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def _fingerprint(value: Any) -> Any:
    if isinstance(value, _SCALARS):
        return ("value", value)
    if isinstance(value, torch.Tensor):
        return ("tensor",)
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        items = list(value.items()) if isinstance(value, dict) else list(value)
        return (type(value), len(items), tuple(
            (i, repr(v)) for i, v in enumerate(items) if isinstance(v, _SCALARS) or
            (isinstance(v, tuple) and all(isinstance(e, _SCALARS) for e in v))))
    return ("object", id(value))


def _snapshot(model: torch.nn.Module) -> dict[tuple[str, str], Any]:
    return {(fqn, k): _fingerprint(v) for fqn, m in model.named_modules(remove_duplicate=True)
            for k, v in vars(m).items() if k not in _MODULE_INTERNALS}


def _tensor_attrs(model: torch.nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """Plain tensor attributes of ``model`` and its submodules, and the tensors directly inside their
    list/tuple/dict attributes (key ``(fqn, "mem")``, ``(fqn, "hist[0]")``); parameters keyed
    ``(fqn, name, "param")``."""
    found: dict[tuple, torch.Tensor] = {}
    for fqn, m in model.named_modules(remove_duplicate=True):
        for k, p in m._parameters.items():
            if p is not None:
                found[(fqn, k, "param")] = p
        for k, v in vars(m).items():
            if k in _MODULE_INTERNALS:
                continue
            if isinstance(v, torch.Tensor):
                found[(fqn, k)] = v
            elif isinstance(v, (list, tuple, dict)):
                for i, e in (v.items() if isinstance(v, dict) else enumerate(v)):
                    if isinstance(e, torch.Tensor):
                        found[(fqn, f"{k}[{i!r}]")] = e
    return found


class ForwardState:
    """What one traced forward replaced: tensors it swapped for others (see module doc)."""

    def __init__(self) -> None:
        self.replaced: dict[tuple[str, str], torch.Tensor] = {}

    def record(self, before: dict[tuple, torch.Tensor], after: dict[tuple, torch.Tensor]) -> None:
        for key, old in before.items():
            new = after.get(key)
            if new is None or new is old:
                continue
            if len(key) != 3 and _cast_of_constant(new):
                continue  # self.freqs_cis = self.freqs_cis.to(x.device): the same values, eager and traced alike
            if len(key) == 3:
                raise ShardingError(
                    f"the forward replaces parameter {_where(key[:2])!r} by another tensor while fxshard traced it "
                    f"(e.g. self.weight = nn.Parameter(...)); the sharded program keeps computing with the sharded "
                    f"parameter, while eager would use the new one from the next call on. Update the parameter in "
                    f"place under torch.no_grad() outside forward (or in the optimizer step) instead")
            self.replaced[key] = old

    def check_constants(self, constants: dict[str, Any]) -> None:
        """Requires: ``constants`` are the traced program's lifted constant tensors (``ep.constants``).
        Ensures: no tensor the forward both read and replaced is among them, else a ShardingError."""
        read = {id(c) for c in constants.values()}
        for key, old in self.replaced.items():
            if id(old) in read:
                raise ShardingError(
                    f"the forward reads the tensor attribute {_where(key)!r} and replaces it with a new tensor "
                    f"while fxshard traced it; fxshard traces that tensor as a constant, so the sharded program "
                    f"would read the value it had at shard() on every call while eager reads the tensor the "
                    f"previous call stored (a recurrent memory, a running value). Register it as a buffer "
                    f"(self.register_buffer({key[1].split('[')[0]!r}, ...), then assigning or updating it in "
                    f"forward is traced as its update) or pass it in and return the new value")


_CASTS = frozenset(("to", "_to_copy", "detach", "alias", "clone", "contiguous", "lift_fresh", "lift_fresh_copy"))


def _cast_of_constant(t: torch.Tensor) -> bool:
    """Whether ``t``, made while ``torch.export`` traces, is a constant the trace lifted passed through dtype or
    device casts and copies only (read from the tracer's record of the op that made it)."""
    from ..core.torch_compat import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return False
    try:
        slot = get_proxy_slot(t, mode.tracer, None)
    except Exception:  # not a tensor the tracer made
        return False
    node = getattr(getattr(slot, "proxy", None), "node", None)
    while (node is not None and node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node)
           and getattr(getattr(node.target, "overloadpacket", None), "__name__", None) in _CASTS):
        node = node.args[0]
    return node is not None and (node.op == "get_attr" or (
        node.op == "placeholder" and node.name.startswith(("c_", "lifted_tensor"))))


def _where(key: tuple[str, str]) -> str:
    fqn, name = key
    return f"{fqn}.{name}" if fqn else name


def _show(fingerprint: Any) -> str:
    if fingerprint is None:
        return "absent"
    if fingerprint[0] == "value":
        return repr(fingerprint[1])
    if fingerprint[0] == "object":
        return "another object"
    if fingerprint[0] == "tensor":
        return "a tensor"
    return f"a {fingerprint[0].__name__} of {fingerprint[1]} items"


def _host_rngs() -> dict[str, Any]:
    states = {"Python's random module": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        states["numpy.random"] = np.random.get_state(legacy=False)
    return states


def _same(a: Any, b: Any) -> bool:
    np = sys.modules.get("numpy")
    if np is not None and isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if np is not None and isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return a == b


def _check_rngs(before: dict[str, Any], after: dict[str, Any], what: str = "the forward") -> None:
    for name, state in before.items():
        if not _same(state, after[name]):
            raise ShardingError(
                f"{what} draws from {name} while fxshard traces it; fxshard runs {what}'s Python code once "
                f"per traced signature, so the program would keep that one draw (a branch taken, a value) for "
                f"every call where eager draws anew. Draw inside tensor ops with torch's generator (torch.rand, "
                f"torch.bernoulli, dropout: fxshard traces those draws) or pass the outcome as an input")


def _check(before: dict, after: dict) -> None:
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if old != new:
            where = _where(key)
            raise ShardingError(
                f"the forward changes the model's Python attribute {where!r} (from {_show(old)} to {_show(new)} "
                f"while fxshard traced it); fxshard runs the forward's Python code once, so the sharded program "
                f"would never change it again and anything computed from it would differ from eager from the "
                f"second call on. Keep state that changes per call in a buffer (register_buffer, updated in "
                f"place) or outside the model and pass it as an input; if it is a cache the forward fills once "
                f"(the same value on every call), fill it before shard() (call the model once, or set it in "
                f"__init__)")


@contextlib.contextmanager
def forward_state_unchanged(model: torch.nn.Module) -> Iterator[ForwardState]:
    """Requires: ``model``'s forward is called (through ``model(...)``) inside the block. Ensures: each
    call leaves every plain attribute of ``model`` and its submodules comparing equal, every parameter
    the same object and the host generators where they were (module doc), else it raises a
    ShardingError naming the attribute, its values and the fix; the yielded :class:`ForwardState` holds
    the tensor attributes replaced, for :meth:`ForwardState.check_constants` after the trace. Compared
    from the model's own forward hooks, as ``torch.export`` restores the attributes after its trace."""
    before: dict = {}
    tensors: dict = {}
    rngs: dict = {}
    state = ForwardState()

    def pre(mod: torch.nn.Module, args: Any) -> None:
        before.clear()
        before.update(_snapshot(mod))
        tensors.clear()
        tensors.update(_tensor_attrs(mod))
        rngs.update(_host_rngs())

    def post(mod: torch.nn.Module, args: Any, out: Any) -> None:
        _check_rngs(rngs, _host_rngs())
        _check(before, _snapshot(mod))
        state.record(tensors, _tensor_attrs(mod))

    handles = (model.register_forward_pre_hook(pre, prepend=True), model.register_forward_hook(post))
    try:
        yield state
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def host_rngs_unchanged(what: str) -> Iterator[None]:
    """Requires: the block traces ``what`` (e.g. ``"the jitted function step"``) once. Ensures: on a normal
    exit Python's and numpy's global generators are where they were, else a ShardingError (module doc)."""
    before = _host_rngs()
    yield
    _check_rngs(before, _host_rngs(), what)


def warn_traced_hooks(model: torch.nn.Module) -> None:
    """Warn (once per model class and hook set) when ``model``, a submodule, or ``torch.nn``'s global hooks
    have forward (pre-)hooks: tracing runs them once (module doc)."""
    from torch.nn.modules import module as nn_module

    hooked = [fqn or "<root>" for fqn, m in model.named_modules()
              if m._forward_hooks or any(not is_own_hook(h) for h in m._forward_pre_hooks.values())]
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        hooked.insert(0, "all modules (torch.nn.modules.module.register_module_forward_hook)")
    if hooked:
        warnings.warn(
            f"fxshard: forward hooks on {name_few(hooked, 3)} run once, while {type(model).__name__} is "
            f"traced: what they compute on tensors is part of the program and runs on every call, but their "
            f"Python side effects (logging, collecting activations) happen only at shard(). Register hooks that "
            f"must run per call on the ShardedModule, or return the values from forward", stacklevel=3)
