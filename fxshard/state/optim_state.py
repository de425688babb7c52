"""Optimizer state of a ShardedModule as DTensors, for ``torch.distributed.checkpoint``.

``optim_state_dict(sm, opt)`` keys the state by parameter FQN and presents each
state tensor shaped like its parameter as a DTensor with the parameter's
placements (scalars such as Adam's ``step`` stay plain tensors), so DCP can save
it at one mesh and load it at another. ``load_optim_state_dict`` puts a loaded
one back into the optimizer.

torch's own API works too: from its first ``step()``, an optimizer holding a
ShardedModule's parameters presents their state the same way in ``state_dict()``
(so ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives
DTensors, as for DTensor parameters) and ``load_state_dict()`` takes each such
entry as a DTensor in any layout, the full tensor, or this rank's piece.
Without this, DCP took those plain local pieces for replicated copies and kept
one rank's. A ``load_state_dict()`` before the first step (a fresh optimizer
resuming from a checkpoint) stores the entries as given; the first step converts
them to this rank's pieces the same way before the optimizer reads them.

The same step pre-hook checks what fxshard cannot check elsewhere: the optimizer's
kind (``optim_kinds``), a gradient scaler stepping it (``grad_scaling``, first,
since a rank whose scaler skipped the step does not get here) and the gradients
(``grad_guard``).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..core.errors import ShardingError, name_few
from .grad_guard import check_gradients, records_kept
from .grad_scaling import calling_scaler, check_scaler
from .optim_kinds import check_optimizer
from ..core.placements import Replicated
from .sharded_state import HasShardedState

__all__ = ["optim_state_dict", "load_optim_state_dict", "init_optim_state", "track_optimizers"]

# live ShardedModules in the order they were made (the same on every rank, unlike a WeakSet's): a module's
# gradient check is a collective, so ranks must run them in one order
_MODULES: "weakref.WeakValueDictionary[int, HasShardedState]" = weakref.WeakValueDictionary()
_MADE = itertools.count()
_STEP_HOOK: Optional[Any] = None
_CHECKED = "_fxshard_checked"  # on an optimizer: its _Held
_HOOKED = "_fxshard_state_hooks"  # on an optimizer: True once its state-dict hooks are registered


def track_optimizers(sm: HasShardedState) -> None:
    """Make every optimizer that holds ``sm``'s parameters present their state as described in the module
    doc. Ensures: a global optimizer step pre-hook (one per process) registers the state-dict hooks on such
    an optimizer at its first step (converting state loaded before it), and checks each step (module doc)."""
    global _STEP_HOOK
    _MODULES[next(_MADE)] = sm
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_pre_hook(_on_step)


def _owners() -> dict[int, tuple[HasShardedState, str]]:
    """id of each live ShardedModule's parameter -> (a module holding it, its FQN there); a tensor several modules
    share (``sources.py``) is laid out alike in each, so any of them describes it."""
    return {id(p): (sm, fqn) for sm in list(_MODULES.values()) for fqn, p in sm.named_parameters()}


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


@dataclass(frozen=True)
class _Held:
    """What an optimizer holds of ShardedModules, as of the parameters it was last checked with."""
    ids: tuple[int, ...]  # the ids of its parameters
    modules: tuple["weakref.ref[HasShardedState]", ...]  # the ShardedModules holding some of them
    split: dict[str, str]  # FQN -> how it is split, for each of them a module split
    ranks: frozenset[int]  # the ranks holding pieces of those (along the mesh axes that split them)
    device: str  # the device type of their mesh


def _on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    params = _params(optimizer)
    ids = tuple(id(p) for p in params)
    held = getattr(optimizer, _CHECKED, None)
    if held is None or held.ids != ids:  # first step, or parameters added or replaced since
        held = _holdings(optimizer, params, ids)
        setattr(optimizer, _CHECKED, held)
    # before anything that communicates: a rank whose scaler skipped this step is not here
    if held.split and (scaler := calling_scaler()) is not None:
        check_scaler(scaler, optimizer, held.split, held.ranks, held.device)
    if held.modules and not getattr(optimizer, _HOOKED, False):
        _hook_state(optimizer)
    for ref in held.modules:
        if (sm := ref()) is not None:
            check_gradients(sm)


def _holdings(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], ids: tuple[int, ...]) -> _Held:
    """Checks that ``optimizer`` suits the way its ShardedModule parameters are split (no communication), and
    says which of them it holds."""
    owners = _owners()
    owned = [owners[id(p)] for p in params if id(p) in owners]
    split = {fqn: how for sm, fqn in owned if (how := sm.fxshard_state.layout.how_split(fqn))}
    check_optimizer(optimizer, split)
    held = set(ids)  # every module holding one of them, in the order they were made (the checks communicate)
    modules = {id(sm): sm for sm in list(_MODULES.values()) if any(id(p) in held for p in sm.parameters())}
    ranks = frozenset(r for sm, fqn in owned if fqn in split
                      for a, pl in enumerate(sm.fxshard_state.layout.placements[fqn]) if not isinstance(pl, Replicated)
                      for r in dist.get_process_group_ranks(sm.fxshard_state.layout.mesh.get_group(a)))
    device = owned[0][0].fxshard_state.layout.mesh.device_type if owned else "cpu"
    return _Held(ids, tuple(weakref.ref(sm) for sm in modules.values()), split, ranks, device)


def _hook_state(optimizer: torch.optim.Optimizer) -> None:
    """Registers ``optimizer``'s state-dict hooks, and converts the state a ``load_state_dict`` before them
    stored as given (DTensors, full tensors) to this rank's pieces, as the load hook would have."""
    owners = _owners()
    loaded = {p: _pieces_of(*owners[id(p)], p, st) for p, st in optimizer.state.items() if id(p) in owners}
    optimizer.state.update(loaded)  # all or nothing: a wrong entry raised above
    optimizer.register_state_dict_post_hook(_state_as_dtensors)
    optimizer.register_load_state_dict_pre_hook(_state_from_dtensors)
    setattr(optimizer, _HOOKED, True)


def _by_key(optimizer: torch.optim.Optimizer, sd: dict) -> dict[Any, torch.Tensor]:
    """The optimizer's parameter for each key of ``sd["state"]``: the keys are listed in ``sd``'s param groups in
    the order of the optimizer's (ints from ``state_dict()``, FQNs from torch's ``set_optimizer_state_dict``)."""
    keys = [k for g in sd["param_groups"] for k in g["params"]]
    return dict(zip(keys, _params(optimizer)))


def _state_as_dtensors(optimizer: torch.optim.Optimizer, sd: dict) -> dict:
    return _convert_owned(optimizer, sd, _as_dtensors)


def _state_from_dtensors(optimizer: torch.optim.Optimizer, sd: dict) -> dict:
    return _convert_owned(optimizer, sd, _pieces_of)


def _convert_owned(optimizer: torch.optim.Optimizer, sd: dict, convert) -> dict:
    """``sd`` with ``convert(sm, fqn, param, state)`` applied to the state of each ShardedModule parameter."""
    owners, by_key = _owners(), _by_key(optimizer, sd)
    state = {}
    for key, st in sd["state"].items():
        p = by_key.get(key)
        state[key] = st if p is None or id(p) not in owners else convert(*owners[id(p)], p, st)
    return {**sd, "state": state}


def _as_dtensors(sm: HasShardedState, fqn: str, p: torch.Tensor, st: dict[str, Any]) -> dict[str, Any]:
    """``st`` (one parameter's optimizer state) with each tensor shaped like ``p`` as a DTensor of ``p``'s layout."""
    return {k: sm.fxshard_state.layout.dtensor(fqn, v.detach()) if _like_param(v, p) else v for k, v in st.items()}


def _like_param(v: Any, p: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and v.shape == p.shape


def _pieces_of(sm: HasShardedState, fqn: str, p: torch.Tensor, st: dict[str, Any]) -> dict[str, Any]:
    """``st`` (one parameter's optimizer state) with each tensor given as a DTensor of the global tensor or
    as the full tensor replaced by this rank's piece; pieces already shaped like ``p`` are kept."""
    out = {}
    for k, v in st.items():
        if isinstance(v, DTensor) or (isinstance(v, torch.Tensor) and v.dim() and not _like_param(v, p)):
            v = sm.fxshard_state.layout.own_piece(fqn, p, v, f"optimizer state {fqn}.{k}")
        out[k] = v
    return out


def _fqn_of(sm: HasShardedState) -> dict[int, str]:
    return {id(p): n for n, p in sm.named_parameters()}


def init_optim_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has no state yet (built afresh, e.g. to resume in a new process) the state its
    first step creates, without changing a parameter: what torch's ``get_optimizer_state_dict`` does
    (``_init_optim_state``), also when gradients are present (torch's skips it then).

    Requires: every rank holding pieces of the same parameters calls it (the step communicates for split
    parameters, as any step). Ensures: nothing when ``optimizer.state`` is not empty; otherwise one step with zero
    gradients and ``lr`` 0, the parameters and gradients put back bit for bit afterwards (and what the gradient
    check of the next step compares, ``grad_guard``).
    """
    if optimizer.state:
        return
    params = [p for p in _params(optimizer) if p.requires_grad]
    if not params:
        return
    grads = [p.grad for p in params]
    with torch.no_grad():
        kept = [p.detach().clone() for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        held = {id(p) for p in params}
        with records_kept(sm for sm in list(_MODULES.values()) if any(id(p) in held for p in sm.parameters())):
            optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        with torch.no_grad():
            for p, k, grad in zip(params, kept, grads):
                p.copy_(k)
                p.grad = grad


def optim_state_dict(sm: HasShardedState, optimizer: torch.optim.Optimizer, *, full: bool = False) -> dict[str, Any]:
    """``{"state": {fqn: {name: DTensor | tensor}}, "param_groups": [...]}`` (see module doc).

    Requires: ``optimizer`` holds only ``sm``'s parameters. Ensures: an optimizer without state is first given
    the state its first step creates (``init_optim_state``; a collective then), so the result is a template
    ``torch.distributed.checkpoint.load`` can fill when resuming. With ``full`` (a collective) each DTensor is
    gathered into the full tensor, e.g. to ``torch.save`` one file. The optimizer itself is left as it was: an
    optimizer without state gets none (its next real step is its first, as in eager; the template's tensors are
    the result's own)."""
    names = _fqn_of(sm)
    _check_holds(sm, optimizer, names, "optim_state_dict")
    fresh = not optimizer.state
    init_optim_state(optimizer)
    state: dict[str, dict[str, Any]] = {}
    for p, st in optimizer.state.items():
        st = _as_dtensors(sm, names[id(p)], p, st)
        state[names[id(p)]] = {k: v.full_tensor() if full and isinstance(v, DTensor) else v for k, v in st.items()}
    groups = []
    for g in optimizer.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]})
    if fresh:  # kept, the template's step count and zero moments would change the next real step's update
        optimizer.state.clear()
    return {"state": state, "param_groups": groups}


def _check_holds(sm: HasShardedState, optimizer: torch.optim.Optimizer, names: dict[int, str], what: str) -> None:
    if any(id(p) not in names for p in _params(optimizer)):
        raise ShardingError(f"{what}: the optimizer holds a parameter that is not the module's; build it from "
                            f"sm.parameters()")


def _check_loadable(optimizer: torch.optim.Optimizer, names: dict[int, str], osd: Any) -> None:
    """Raise ShardingError unless ``osd`` gives every state entry ``optimizer`` has (after ``init_optim_state``)
    and nothing it has no place for."""
    how = ("pass what fxshard.optim_state_dict(sm, opt) returned, filled by torch.distributed.checkpoint.load (or "
           "a full one saved with full=True) from an optimizer of the same class and settings over the same "
           "parameters")
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) or "param_groups" not in osd:
        raise ShardingError(f"load_optim_state_dict: expected a dict with 'state' and 'param_groups', got "
                            f"{type(osd).__name__}; {how}")
    if len(osd["param_groups"]) != len(optimizer.param_groups):
        raise ShardingError(f"load_optim_state_dict: {len(osd['param_groups'])} param groups given, the optimizer has "
                            f"{len(optimizer.param_groups)}; {how}")
    held = {names[id(p)]: p for p in _params(optimizer)}
    given = osd["state"]
    unknown = [k for k in given if k not in held]
    if unknown:
        raise ShardingError(f"load_optim_state_dict: state for {name_few(sorted(map(str, unknown)), 3)}, which the "
                            f"optimizer does not hold (not a parameter name of the module, or not given to this "
                            f"optimizer); nothing was loaded; {how}")
    problems = []
    for fqn, p in held.items():
        want, got = set(optimizer.state.get(p, {})), set(given.get(fqn, {}))
        if want - got:
            problems.append(f"{fqn} lacks {sorted(want - got)}")
        if got - want:
            problems.append(f"{fqn} has {sorted(got - want)}, which {type(optimizer).__name__} with these settings "
                            f"does not keep")
    if problems:
        empty = " (the state given is empty: a template not filled by a load?)" if not given else ""
        raise ShardingError(f"load_optim_state_dict: the state given does not match the optimizer's{empty}: "
                            f"{name_few(problems, 3, '; ')}; nothing was loaded; {how}")


def load_optim_state_dict(sm: HasShardedState, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    """Load an ``optim_state_dict`` (possibly filled by ``dcp.load`` at another mesh, or a full one) into
    ``optimizer``.

    Requires: ``optimizer`` holds only ``sm``'s parameters. Ensures: an optimizer without state is first given
    its structure (``init_optim_state``, a collective); then either every state entry the optimizer keeps is
    replaced by the given one (each tensor a DTensor in any layout, the full tensor, or this rank's piece) and
    the param groups' settings are restored, or, when ``osd`` lacks an entry, has one the optimizer has no place
    for, or is empty, a ShardingError names them and nothing is loaded."""
    names = _fqn_of(sm)
    _check_holds(sm, optimizer, names, "load_optim_state_dict")
    init_optim_state(optimizer)
    _check_loadable(optimizer, names, osd)
    params = dict(sm.named_parameters())
    by_name = {fqn: _pieces_of(sm, fqn, params[fqn], st) for fqn, st in osd["state"].items()}
    with torch.no_grad():
        for fqn, st in by_name.items():
            p = params[fqn]
            cur = optimizer.state[p]
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and k in cur and isinstance(cur[k], torch.Tensor):
                    cur[k].copy_(v)
                else:
                    cur[k] = v.clone() if isinstance(v, torch.Tensor) else v
    for g, saved in zip(optimizer.param_groups, osd["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})
