"""``ShardedModule``: the per-rank nn.Module that ``fxshard.shard`` returns.

It builds its stand-in tree (``standins``), keeps the programs of each combination of module modes
(``programs``), and on each call runs the call's checks (``call_checks``), feeds the programs this rank's
tensors and runs them (through autograd: ``autograd_bridge``). Its state-dict, checkpoint, initialization and
FSDP2 methods are its base ``StateInterop`` (``state_interop``). Other modules use it through
``sm.fxshard_state`` (``state.sharded_state.ShardedState``), never its private attributes."""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from ..core.torch_compat import pytree

from ..comm.failures import run_program
from ..comm.replicas import communicates
from ..core.mesh import MeshInfo
from ..core.placements import Pl
from ..core.precision import AutocastState, autocast_off, check_autocast
from ..state.grad_guard import forward_started, track_gradients
from ..state.optim_state import track_optimizers
from ..state.sharded_state import ParameterLayout, ShardedState
from ..tracing.captured import Captured, check_captured
from ..tracing.export import Traced
from .autograd_bridge import run_training, run_untrainable, write_buffers
from .call_checks import (
    MODULE_FIX, call_leaves, check_filled, check_pieces, local_error, refuse_dual_tensors, refuse_parametrized_since,
    refuse_transforms, refuse_untraced_input_grads,
)
from .description import Sharding
from .programs import Program, Programs, Training
from .standins import StandIn, container, keep_traced, register_train_overrides, scope_for
from .state_interop import StateInterop, written_state

if TYPE_CHECKING:
    from ..planner.auto import AutoReport

__all__ = ["ShardedModule"]


class ShardedModule(StateInterop, StandIn):
    """This rank's part of a sharded model.

    Parameters and buffers are the local shards, registered under the
    original FQNs (tied parameters are one Parameter under each name), and
    every submodule of the original model has a stand-in (:class:`Scope`) under
    its FQN that owns its local shards; stand-ins of containers index and
    iterate (:class:`ScopeList`, :class:`ScopeDict`), and FSDP2's
    ``fully_shard`` applies to them (see ``forward``). ``forward`` takes this rank's local inputs (laid out per
    ``in_specs``) and returns local outputs (per ``out_specs``, replicated by
    default).

    Modes follow eager: ``sm.train()``, ``sm.eval()`` and a submodule's
    ``sm.dropout.eval()`` change what the next call computes (dropout,
    BatchNorm statistics, any ``self.training`` branch). So does unfreezing a
    parameter (``sm.l1.weight.requires_grad_(True)`` after shard() trains it;
    freezing one needs no new program). The programs are traced for the modes
    and trainable parameters the model had at ``shard()``; the first call in a
    combination not seen before traces and shards the model again for it (a
    collective, so every rank must make the same change) and caches the
    programs per combination.
    """

    def __init__(self, programs: Programs, *, mesh: DeviceMesh, info: MeshInfo, placements: dict[str, tuple[Pl, ...]],
                 global_shapes: dict[str, tuple], tensors: dict[str, torch.Tensor],
                 modules: Sequence[tuple[str, type, bool, str, Mapping[str, Any]]] = (), name: str = "model",
                 reshard: Optional[Callable[[dict[str, bool], dict[str, bool]], Programs]] = None,
                 train_override: Optional[Callable[..., Optional[tuple[dict[str, bool], dict[str, bool]]]]] = None,
                 auto: Optional[AutoReport] = None, autocast: Optional[AutocastState] = None,
                 src_data_rank: Optional[int] = 0, unfilled: Sequence[str] = (), captured: Sequence[Captured] = ()):
        super().__init__()
        # first: the stand-ins' messages name the module by it (standins._stand_in_name)
        self.fxshard_state = ShardedState(f"ShardedModule({name})",
                                          ParameterLayout(mesh, info, placements, global_shapes), auto=auto)
        self._captured = tuple(captured)  # Python scalars the model's forward code read when traced
        self._autocast = autocast  # the autocast state every program was traced in (precision.py)
        # sharding again runs collectives and traces: never inside a TorchDynamo trace (a graph break there)
        self._reshard = None if reshard is None else torch.compiler.disable(reshard)
        self._src_data_rank = src_data_rank
        scopes: dict[str, nn.Module] = {"": self}
        for fqn, kind, training, first, traced in modules:  # pre-order, so parents come first
            if fqn == "":
                self.training = training
                keep_traced(self, traced)
                continue
            *path, leaf = fqn.split(".")
            if first == fqn:
                scopes[fqn] = scope_for(kind, fqn, traced)
                scopes[fqn].training = training
            else:  # the same submodule under a second name: one stand-in, one mode
                scopes[fqn] = scopes[first]
            scopes[".".join(path)].add_module(leaf, scopes[fqn])
        # eager's model.train() runs these classes' own train(): FQN -> the override run on the meta copy
        self._train_overrides = {} if train_override is None else {
            fqn: functools.partial(train_override, fqn)
            for fqn, kind, _, first, _ in modules if fqn == first and kind.train is not nn.Module.train}
        register_train_overrides(self, self._train_overrides)
        self._mode_names = [fqn for fqn, _, _, first, _ in modules if fqn == first] or [""]
        self._mode_scopes = [scopes[n] for n in self._mode_names]
        self._param_names = [slot.names[0] for slot in programs.traced.slots if slot.kind == "param"]
        self._trained = [slot.requires_grad for slot in programs.traced.slots if slot.kind == "param"]
        # the local dtype and shape the programs were traced for
        self._locals = {slot.names[0]: (tensors[slot.names[0]].dtype, tensors[slot.names[0]].shape)
                        for slot in programs.traced.slots if slot.kind in ("param", "buffer")}
        homes = []
        for slot in programs.traced.slots:
            if slot.kind not in ("param", "buffer"):
                continue
            t = tensors[slot.names[0]]
            for fqn in slot.names:
                *path, leaf = fqn.split(".")
                owner = container(self, path)
                if slot.kind == "param":
                    owner.register_parameter(leaf, t)
                else:
                    owner.register_buffer(leaf, t, persistent=slot.persistent)
                homes.append((fqn, owner, leaf))
        self._tensor_homes = tuple(homes)  # (name, module, attribute) of every parameter and buffer
        self._current = programs
        self._by_mode: dict[tuple[bool, ...], Programs] = {self._mode_key(): programs}
        self._unfilled: Optional[dict[str, tuple[int, int]]] = None
        if unfilled:
            self._unfilled = {n: (id(self._lookup(n)), self._lookup(n)._version) for n in unfilled}
        # split parameters, checked at the first call if written in place other than by fxshard's fills
        self._piece_watch: Optional[dict[str, Optional[tuple[int, int, list]]]] = None
        if communicates(self._mesh):
            self._piece_watch = {n: written_state(p) for n, p in self.named_parameters()
                                 if self._layout.split_axes(n)}
        self._register_state_hooks()
        track_optimizers(self)
        track_gradients(self)

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.deepcopy(sm)``, a pickle loaded) is tracked like the original: its optimizers present
        their state as DTensors and its gradients are checked at their steps (``__init__`` does not run)."""
        super().__setstate__(state)
        self.fxshard_state = self.fxshard_state.copied()  # its own records (a shallow copy shares the dict's values)
        register_train_overrides(self, self.__dict__.get("_train_overrides", {}))
        track_optimizers(self)
        track_gradients(self)

    # ---- the programs of the current modes ---------------------------------------------------
    @property
    def _traced(self) -> Traced:
        return self._current.traced

    @property
    def _fwd(self) -> Program:
        return self._current.forward

    @property
    def _training(self) -> Optional[Training]:
        return self._current.training

    @property
    def _slots(self) -> list:
        return self._current.traced.slots

    def _mode_key(self) -> tuple[bool, ...]:
        """Each submodule's ``training``, then per parameter whether a program must train it: it requires grad
        now or did at ``shard()`` (a parameter frozen since needs no other program: autograd drops its gradient)."""
        return (tuple(m.training for m in self._mode_scopes)
                + tuple(t or self._lookup(n).requires_grad for n, t in zip(self._param_names, self._trained)))

    def _for_mode(self) -> Programs:
        """The programs for the modules' current modes and trainable parameters, sharded on first use (see
        class doc)."""
        key = self._mode_key()
        progs = self._by_mode.get(key)
        if progs is None:
            if self._reshard is None:  # modes fixed by the caller (fxshard.backend: TorchDynamo re-captures)
                return self._current
            k = len(self._mode_names)
            with torch.enable_grad(), torch.random.fork_rng(devices=[]):  # tracing leaves the RNG as it was
                progs = self._reshard(dict(zip(self._mode_names, key[:k])), dict(zip(self._param_names, key[k:])))
            self._by_mode[key] = progs
        if progs is not self._current:  # no attribute write on the common path (torch.compile traces this)
            self._current = progs
        return progs

    @property
    def sharding(self) -> Sharding:
        """A read-only view of the plan and programs (``fxshard.runtime.description.Sharding``): what
        ``fxshard.explain``, ``comm_stats`` and ``memory`` describe."""
        cur = self._current
        return Sharding(self._info, tuple(self._programs()), cur.forward, cur.training,
                        MappingProxyType(dict(self._placements)), MappingProxyType(dict(self._global_shapes)),
                        tuple(cur.traced.slots), is_module=True, auto=self.fxshard_state.auto)

    def _programs(self) -> list[Program]:
        """Training forward/backward when the module trains, else the inference forward: those of the
        current modes when they were sharded already, else those that ran last."""
        progs = self._by_mode.get(self._mode_key(), self._current)
        if progs.training is not None:
            return [progs.training.fwd, progs.training.bwd]
        return [progs.forward]

    # ---- running -------------------------------------------------------------------------
    def _feed(self, progs: Programs, args: tuple, kwargs: dict) -> list[Any]:
        """The programs' inputs for the call ``(args, kwargs)``, in slot order: this rank's parameters and buffers,
        the constants, the call's tensors (checked: ``call_checks.call_leaves``, ``Programs.input_check``)."""
        traced = progs.traced
        leaves = call_leaves(self._where, traced, args, kwargs)
        progs.input_check.check([leaves[s.index] for s in traced.slots if s.kind == "input"], self._mesh)
        feed: list[Any] = []
        for slot in traced.slots:
            if slot.kind in ("param", "buffer"):
                fqn = slot.names[0]
                t = self._lookup(fqn)
                if (t.dtype, t.shape) != self._locals[fqn]:
                    raise local_error(self._where, fqn, t, self._locals[fqn], self._global_shapes[fqn],
                                      self._how_split(fqn))
                feed.append(t)
            elif slot.kind == "constant":
                feed.append(traced.constants[slot.names[0]])
            else:
                feed.append(leaves[slot.index])
        return feed

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Local outputs for local inputs; differentiable when grad mode is on (see class doc).

        Submodules under FSDP2 (``fully_shard(sm.layers[i])``) are never called themselves, so their FSDP2
        hooks run around the one program: every such submodule's pre-forward hook (all-gathers its
        parameters) before it, its post-forward hook (reshards them, and registers the all-gather
        before the backward on the outputs) after it, with no inputs and the program's outputs. Under
        FSDP2 each call first frees whatever an earlier forward left gathered (``_reshard_fsdp``), so a
        forward computes with the sharded parameters' current values."""
        check_autocast(f"{self._where} was called", self._mesh.device_type, self.__dict__.get("_autocast"))
        refuse_transforms(self._where)
        refuse_dual_tensors(self._where, self, args, kwargs)
        refuse_parametrized_since(self._where, self._tensor_homes, self._how_split)
        check_captured(self._captured, f"{self._where}: the forward", fix=MODULE_FIX)
        forward_started(self)
        progs = self._for_mode()
        if self._unfilled is not None:  # parameters/buffers created on meta, checked until all were written
            check_filled(self._where, self._unfilled, self._lookup)
            self._unfilled = None
        if self._piece_watch is not None and not torch.compiler.is_compiling():  # once: a collective
            watch, self._piece_watch = self._piece_watch, None
            check_pieces(self._where, watch, self._lookup, self._layout)
        fsdp = self._fsdp_before_program()
        with autocast_off(self._mesh.device_type):  # the programs hold autocast's casts (precision.py)
            outs = self._run(progs, args, kwargs)
        self._fsdp_after_program(fsdp, outs)
        return pytree.tree_unflatten(list(outs[len(progs.traced.mutations):]), progs.traced.out_tree)

    def compile(self, **kwargs: Any) -> None:
        """``nn.Module.compile`` (``torch.compile`` of this module, in place) that keeps the programs'
        overlap schedule under inductor.

        Requires ``torch.compile``'s keyword arguments; unlike ``torch.compile``, ``mode`` and ``options``
        may both be given. Ensures: when the backend is inductor (``backend`` given as ``"inductor"``, or
        left out or ``None`` with inductor as dynamo's default backend), the options inductor gets are
        those of ``mode`` (inductor's ``list_mode_options``), then ``fxshard.frontends.backend.INDUCTOR_OPTIONS``,
        then the caller's ``options`` (which win); other backends get the arguments unchanged.
        (``torch.compile(sm)`` itself cannot be intercepted: pass
        ``options=dict(fxshard.frontends.backend.INDUCTOR_OPTIONS)`` there.)"""
        from ..passes.overlap import INDUCTOR_OPTIONS

        backend = kwargs.get("backend")
        if backend is None:
            from ..core.torch_compat import get_default_backend

            backend = get_default_backend()
        if backend == "inductor":
            mode = kwargs.pop("mode", None)  # torch.compile takes a mode or options, not both
            by_mode = {}
            if mode is not None:
                from ..core.torch_compat import list_mode_options

                by_mode = list_mode_options(mode, kwargs.get("dynamic"))
            kwargs["options"] = {**by_mode, **INDUCTOR_OPTIONS, **(kwargs.get("options") or {})}
        super().compile(**kwargs)

    def _run(self, progs: Programs, args: tuple, kwargs: dict) -> tuple:
        """The program's flat outputs (buffer updates first, written back here)."""
        feed = self._feed(progs, args, kwargs)
        tr, un = progs.training, progs.untrainable
        refuse_untraced_input_grads(self._where, progs.traced.slots, feed,
                                    tr.diff_in if tr is not None else un.diff_in if un is not None else ())
        if tr is not None and torch.is_grad_enabled() and any(
            isinstance(feed[i], torch.Tensor) and feed[i].requires_grad for i in tr.diff_in
        ):
            return run_training(tr, self._where, feed)  # it writes the buffers
        mutations = progs.traced.mutations
        if un is not None and torch.is_grad_enabled() and any(
            isinstance(feed[i], torch.Tensor) and feed[i].requires_grad for i in un.diff_in
        ):
            outs = run_untrainable(un, progs.forward.gm, self._where, len(mutations), feed)
        else:
            outs = run_program(progs.forward.gm, feed, f"the forward of {self._where}")
        if mutations:
            write_buffers([self._lookup(name) for name in mutations], outs)
        return tuple(outs)
