"""ShardedModule's state: its parameters and buffers as DTensors of the global tensors (``state_dict`` hooks,
``sharded_state_dict``, ``full_state_dict``, DCP), loading and initializing them (``load_*``, ``init_parameters``),
gradient clipping over the full gradients, and composing with FSDP2's ``fully_shard``.

``StateInterop`` is a base class of ``ShardedModule`` holding these methods (and the private accessors of the
module's ``ShardedState`` the runtime reads); the module-level helpers (``tensor_at``, ``named_tensors``,
``written_state``, ``local_slice``) work on any module or tensor."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..comm.replicas import as_words, check_replicas, communicates, from_source
from ..core.torch_compat import is_fsdp
from ..core.errors import ShardingError, name_few
from ..core.mesh import MeshInfo
from ..core.placements import Pl
from ..state.checkpoint import assemble, local_piece, open_checkpoint, storage, take
from ..state.grad_guard import record_gradients
from ..state.grad_norm import clip_grad_norm_ as _clip_grad_norm
from ..state.sharded_state import ParameterLayout, ShardedState
from ..state.tiled_init import draw_seed, fill as fill_tiles

__all__ = ["StateInterop", "tensor_at", "named_tensors", "one_value", "written_state", "local_slice"]


def tensor_at(root: nn.Module, fqn: str) -> torch.Tensor:
    """The parameter or buffer registered under ``fqn`` (dotted) in ``root``'s module tree, as registered now
    (a local shard, or FSDP2's DTensor of it)."""
    m: Any = root
    for part in fqn.split("."):
        m = getattr(m, part)
    return m


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` (non-persistent buffers too), once per tensor."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}




def one_value(p: torch.Tensor) -> bool:
    """Whether every element of this rank's piece of ``p`` is the same value (a constant fill)."""
    t = p.to_local() if isinstance(p, DTensor) else p
    with torch.no_grad():
        return t.numel() == 0 or bool((t == t.reshape(-1)[0]).all())


_SAMPLES = 16  # elements of a piece written_state compares


def written_state(p: torch.Tensor) -> Optional[tuple[int, int, list]]:
    """What tells that this rank's piece of ``p`` was written: the tensor's identity, its version counter and the
    bits of a few elements spread over it (writes through ``p.data``, HF's ``module.weight.data.normal_()``, do
    not move ``p``'s version counter); None for a tensor it cannot read (a DTensor, meta)."""
    if isinstance(p, DTensor) or p.is_meta:
        return None
    flat = p.detach().reshape(-1)
    n, k = flat.numel(), min(_SAMPLES, flat.numel())
    sample = flat[torch.tensor([i * (n - 1) // max(k - 1, 1) for i in range(k)], dtype=torch.long, device=flat.device)]
    return id(p), p._version, as_words(sample).tolist()



def local_slice(full: torch.Tensor, mesh: DeviceMesh, pls: tuple[Pl, ...]) -> torch.Tensor:
    """This rank's piece of a full tensor laid out per ``pls`` (no communication; a view unless packed)."""
    return take(full, pls, MeshInfo.of(mesh))


class StateInterop(nn.Module):
    """The state-dict, checkpoint, initialization, gradient-clipping and FSDP2 methods of ``ShardedModule`` (a
    base class of it; ``ShardedModule.__init__`` sets the attributes annotated here)."""

    fxshard_state: ShardedState  # the internal interface other modules use (``state.sharded_state``)
    _src_data_rank: Optional[int]
    _unfilled: Optional[dict[str, tuple[int, int]]]  # parameters/buffers created on meta, not written yet
    _piece_watch: Optional[dict[str, Optional[tuple[int, int, list]]]]  # split parameters checked at the first call

    # ---- the module's layout (private accessors; other modules use ``fxshard_state``) --------------------
    @property
    def _where(self) -> str:
        return self.fxshard_state.where

    @property
    def _layout(self) -> ParameterLayout:
        return self.fxshard_state.layout

    @property
    def _mesh(self) -> DeviceMesh:
        return self.fxshard_state.layout.mesh

    @property
    def _info(self) -> MeshInfo:
        return self.fxshard_state.layout.info

    @property
    def _placements(self) -> dict[str, tuple[Pl, ...]]:
        return self.fxshard_state.layout.placements

    @property
    def _global_shapes(self) -> dict[str, tuple]:
        return self.fxshard_state.layout.global_shapes

    def _how_split(self, fqn: str) -> str:
        """``ParameterLayout.how_split``."""
        return self._layout.how_split(fqn)

    def _dtensor(self, fqn: str, local: torch.Tensor) -> DTensor:
        """``ParameterLayout.dtensor``."""
        return self._layout.dtensor(fqn, local)

    def _lookup(self, fqn: str) -> torch.Tensor:
        """``tensor_at(self, fqn)``."""
        return tensor_at(self, fqn)

    def _register_state_hooks(self) -> None:
        """Ensures: ``state_dict()`` gives DTensors of the global tensors and ``load_state_dict()`` takes them
        (or full tensors), as this rank's pieces."""
        self.register_state_dict_post_hook(_state_dict_as_dtensors)
        self.register_load_state_dict_pre_hook(_state_dict_from_dtensors)

    def _mark_filled(self, names: Any) -> None:
        """Note that fxshard wrote ``names`` (fills and loads): they are no longer unfilled, nor checked by
        ``call_checks.check_pieces``."""
        if self._unfilled is not None:
            for n in names:
                self._unfilled.pop(n, None)
        if self._piece_watch is not None:
            for n in names:
                if n in self._piece_watch:  # kept (every rank checks the same names), as written now
                    self._piece_watch[n] = written_state(self._lookup(n))

    def _fsdp_scopes(self) -> list[nn.Module]:
        """Submodules ``fully_shard`` was applied to (FSDP2 per layer), in pre-order."""
        return [m for m in self.modules() if m is not self and is_fsdp(m, "_fully_shard", "FSDPModule")]

    def _reshard_fsdp(self) -> None:
        """Under FSDP2: frees the parameters FSDP2 gathered (its root keeps them gathered after a forward
        until a backward reshards them), so that ``self.parameters()`` are FSDP2's sharded parameters again:
        the ones the optimizer updates and the backward accumulates gradients into. A forward never
        backpropagated otherwise left them gathered, and then ``zero_grad()`` cleared the gathered copies'
        gradients instead of the sharded ones (the next backward accumulated onto the old gradients) and a
        forward after an optimizer step computed with the gathered copies' old values. A no-op without
        FSDP2 or when nothing is gathered."""
        for m in [self, *self._fsdp_scopes()]:
            if is_fsdp(m, "_fully_shard", "FSDPModule"):
                m.reshard()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``; under FSDP2 it first frees FSDP2's gathered parameters (see
        ``_reshard_fsdp``), so it clears the gradients of the parameters the next backward accumulates into."""
        self._reshard_fsdp()
        super().zero_grad(set_to_none)

    def _fsdp_before_program(self) -> list[nn.Module]:
        """Under FSDP2 (see ``ShardedModule.forward``): registers, once, the hooks that free what FSDP2 gathered
        around every forward of this module, and runs the pre-forward hooks of the submodules ``fully_shard``
        was applied to. Returns those submodules (empty without FSDP2)."""
        fsdp = self._fsdp_scopes()
        if (fsdp or is_fsdp(self, "_fully_shard", "FSDPModule")) and "_fsdp_hooks" not in self.__dict__:
            # the pre-hook before FSDP2's own pre-forward hook, the hook after its post-forward hook
            self.__dict__["_fsdp_hooks"] = (
                self.register_forward_pre_hook(_reshard_before_forward, prepend=True),
                self.register_forward_hook(_reshard_after_inference))
        for m in fsdp:
            for hid, hook in list(m._forward_pre_hooks.items()):
                hook(m, (), {}) if m._forward_pre_hooks_with_kwargs.get(hid) else hook(m, ())
        return fsdp

    @staticmethod
    def _fsdp_after_program(fsdp: list[nn.Module], outs: Any) -> None:
        """Runs the post-forward hooks of ``fsdp`` (from ``_fsdp_before_program``) with the program's outputs."""
        for m in fsdp:
            for hid, hook in list(m._forward_hooks.items()):
                hook(m, (), {}, outs) if m._forward_hooks_with_kwargs.get(hid) else hook(m, (), outs)

    # ---- state ---------------------------------------------------------------------------
    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """Every ``state_dict`` entry (tied names and persistent buffers) as the tensor registered now:
        a local shard, or FSDP2's DTensor of it after ``fully_shard``."""
        out = {}
        for prefix, m in self.named_modules(remove_duplicate=False):
            pre = prefix + "." if prefix else ""
            out.update({pre + n: p for n, p in m._parameters.items() if p is not None})
            out.update({pre + n: b for n, b in m._buffers.items()
                        if b is not None and n not in m._non_persistent_buffers_set})
        return out

    def apply(self, fn: Callable[[nn.Module], None]) -> "StateInterop":
        """``nn.Module.apply``. Stand-ins are instances of their original classes, so an initializer selecting
        modules by type (``if isinstance(m, nn.Linear): nn.init.normal_(m.weight)``) runs on this rank's pieces:
        on a split parameter it sees the piece's shape (its fan-in) and draws the same numbers on every rank, so
        the full tensor is not what the unsharded model's init gives. Ensures: a split parameter ``fn`` wrote in
        place with anything but one constant (``zeros_``, ``ones_``, ``constant_`` are right on pieces) is a
        ShardingError naming it and ``init_parameters``."""
        watched = [(fqn, p, p._version) for fqn, p in self.named_parameters() if self._how_split(fqn)]
        super().apply(fn)
        changed = [fqn for fqn, p, version in watched if p._version != version and not one_value(p)]
        if changed:
            raise ShardingError(
                f"{self._where}.apply(fn) wrote {name_few(changed, 3)} in place with values that are not one "
                f"constant, but each rank holds only its piece of these split parameters ({self._how_split(changed[0])}"
                f" for the first): an nn.init function run on a piece sees the piece's shape (its fan-in) and draws "
                f"the same numbers on every rank, so they now hold other values than the unsharded model's init "
                f"gives. Initialize them with sm.init_parameters(fn) (fn(name, t) sees each tensor at its global "
                f"shape), or initialize the model before shard()")
        return self

    def init_parameters(self, init: Callable[[str, torch.Tensor], Any], *, exact: bool = False,
                        seed: Optional[int] = None) -> None:
        """Fill every parameter and buffer (non-persistent buffers too) by ``init(fqn, t)``, which writes ``t``
        (global shape) in place, e.g. ``nn.init.normal_(t, std=0.02)``.

        Default (tiled): no full tensor is built. ``init`` runs on each fixed tile of the global tensor that
        this rank holds (``t`` reports the global shape, so fan-in based inits are right; random ops draw from
        a generator per ``(seed, fqn, tile)``; see ``fxshard.tiled_init``), so peak memory is the shard plus one
        tile and the values do not depend on the mesh: ``fxshard.tiled_init(model, init, seed=seed)`` gives the
        same values in the unsharded model. ``seed`` defaults to a draw from torch's generator on rank
        ``src_data_rank``. Only elementwise/random ops on ``t`` are supported; others raise a ShardingError.
        Tensors ``init`` does not write keep their values (a meta-built one stays unfilled).

        ``exact=True``: ``init`` writes the full (CPU) tensor, one tensor at a time, and this rank keeps its
        slice: any ``init`` works and a per-tensor seeded one reproduces the unsharded init bit for bit. Values
        come from rank ``src_data_rank`` (default 0), whose full tensor is broadcast (with
        ``src_data_rank=None`` each rank keeps its own, and replicated values that differ raise a ShardingError).
        A tensor ``init`` does not write in place keeps its values here too; one it writes must be written whole.
        """
        src = self._src_data_rank if communicates(self._mesh) else None
        own = named_tensors(self)
        filled = []
        with torch.no_grad():
            if not exact:
                seed = draw_seed(seed)
                if src is not None:
                    seed = int(from_source(torch.tensor([seed]), src, self._mesh, torch.device("cpu"))[0])
            for name, local in own.items():
                shape = tuple(int(s) for s in self._global_shapes[name])
                if not exact:
                    if fill_tiles(storage(local), name, shape, init, self._layout.pieces(name, local), seed):
                        filled.append(name)
                    continue
                full = torch.empty(shape, dtype=local.dtype, device="cpu")
                version = full._version
                init(name, full)
                if full._version == version:  # init left it alone: it keeps its values (or stays unfilled)
                    continue
                if src is not None:
                    full = from_source(full, src, self._mesh, local.device, writable=True)
                self._write(name, local, lambda src_box: full[src_box])
                filled.append(name)
                del full
        self._mark_filled(filled)
        if self._src_data_rank is None:
            check_replicas(own, self._placements, self._mesh,
                           "init_parameters(fn) with src_data_rank=None keeps each rank's values: pass a seed, or "
                           "seed fn per tensor with exact=True, or shard with src_data_rank=0 to take rank 0's values")

    def _write(self, fqn: str, local: torch.Tensor, read: Callable[[tuple[slice, ...]], torch.Tensor]) -> None:
        """Fill what ``local`` holds of ``fqn`` from ``read(box of the global tensor)``."""
        pieces = self._layout.pieces(fqn, local)
        if pieces:
            storage(local).copy_(assemble(pieces, read))

    def sharded_state_dict(self) -> dict[str, DTensor]:
        """``sm.state_dict()``: every entry a DTensor of the global tensor (no communication).

        This is what ``torch.distributed.checkpoint`` (DCP) saves and loads: its metadata
        records the global shapes and placements, so a checkpoint saved at one mesh loads at
        another mesh, or into the unsharded model. After FSDP2's ``fully_shard(sm, mesh=mesh["dp"])``
        the DTensors live on the ``(dp, tp)`` mesh and still describe the global tensors.
        """
        return {name: self._dtensor(name, t.detach()) for name, t in self._state_tensors().items()}

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy DTensors (e.g. filled in place by ``dcp.load``) into the local shards; a DTensor laid out
        otherwise is gathered first, and a plain tensor must be this rank's local piece."""
        own = self._state_tensors()
        missing = [k for k in own if k not in state_dict]
        if missing:
            raise ShardingError(f"load_sharded_state_dict: missing keys {missing[:5]}; pass sm.sharded_state_dict() "
                                f"after loading into it")
        with torch.no_grad():
            for name, local in own.items():
                v = state_dict[name]
                if isinstance(v, DTensor):
                    v = local_piece(v, self._dtensor(name, local.detach()), self._layout.pieces(name, local), name)
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(storage(local).shape):
                    got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                    raise ShardingError(
                        f"load_sharded_state_dict: {name} is {got} on this rank, but its local shard is "
                        f"{tuple(storage(local).shape)}; pass sm.sharded_state_dict() after loading into it "
                        f"(dcp.load), or use load_full_state_dict for full tensors"
                    )
                storage(local).copy_(v)
        self._mark_filled(own)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over this module's parameters, as on the unsharded model (a
        collective: call on all ranks). Use it instead of torch's, which sees only this rank's pieces of split
        gradients and would clip each rank by its own norm.

        Requires: gradients from a backward of this module (parameters without one are skipped).
        Ensures: returns the total norm of the full gradients (``norm_type``: p of the p-norm, ``inf`` for the
        max norm), the same on every rank, and scales every local gradient in place by
        ``min(1, max_norm / (norm + 1e-6))``; with ``error_if_nonfinite`` a non-finite norm raises RuntimeError
        first, as torch's does."""
        self._reshard_fsdp()  # the gradients are the sharded parameters' (a forward may have gathered them)
        total = _clip_grad_norm(self, max_norm, norm_type, error_if_nonfinite)
        record_gradients(self, if_recorded=True)  # scaled as eager scales them: not a change grad_guard warns about
        return total

    def full_state_dict(self, *, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors under exactly the original ``model.state_dict()`` keys (a collective: call on all ranks).

        Tensors are gathered one at a time; with ``cpu_offload`` each is moved to CPU right away,
        and with ``rank0_only`` other ranks drop it (they return ``{}``), so exporting a model to
        one file needs at most one full tensor of device memory on any rank. Works after FSDP2's
        ``fully_shard`` too (gathered over both meshes).
        """
        keep = not rank0_only or torch.distributed.get_rank() == 0
        out = {}
        for name, local in self._state_tensors().items():
            full = self._dtensor(name, local.detach()).full_tensor()
            if keep:
                out[name] = full.cpu() if cpu_offload else full
            del full
        return out

    def load_full_state_dict(self, src: Any) -> None:
        """Copy each rank's slices of a full checkpoint into the local shards.

        ``src`` is a state dict (keys as in ``model.state_dict()``), a ``.safetensors`` file, or a
        directory of HF-style sharded safetensors files; from files each rank reads only its slices. A key
        the module lacks is a ShardingError; entries the module has no place for are skipped with a warning.
        """
        reader = open_checkpoint(src)
        own = self._state_tensors()
        have = set(reader.keys())
        missing = [k for k in own if k not in have]
        if missing:
            raise ShardingError(
                f"load_full_state_dict: missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}; pass a "
                f"checkpoint of the full model (keys as in model.state_dict())"
            )
        unused = sorted(have - set(own))
        if unused:  # as HF's loader: real checkpoints carry extras (a tied head, old rotary buffers)
            warnings.warn(
                f"load_full_state_dict: {len(unused)} checkpoint entries match no parameter or persistent buffer of "
                f"{self._where} and were not loaded: {unused[:5]}{' ...' if len(unused) > 5 else ''}; check that "
                f"the checkpoint is this model's", stacklevel=2)
        with torch.no_grad():
            for name, local in own.items():
                pieces = self._layout.pieces(name, local)
                if pieces:
                    shape = tuple(int(s) for s in self._global_shapes[name])
                    storage(local).copy_(reader.read(name, pieces, shape))
        self._mark_filled(own)


def _state_dict_as_dtensors(sm: StateInterop, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """``sm.state_dict()`` post-hook: every entry of ``sm`` becomes the DTensor of its global tensor, so
    ``dcp.save(sm.state_dict())`` and torch's ``get_model_state_dict`` (full or sharded) see global shapes."""
    for fqn, t in sm._state_tensors().items():
        if prefix + fqn in state_dict:
            state_dict[prefix + fqn] = sm._dtensor(fqn, state_dict[prefix + fqn])


def _reshard_before_forward(sm: StateInterop, args: Any) -> None:
    """A forward pre-hook (under FSDP2, before FSDP2's own): ``sm._reshard_fsdp()``, so FSDP2's pre-forward
    gathers the sharded parameters' current values instead of reusing copies an earlier forward left."""
    sm._reshard_fsdp()


def _reshard_after_inference(sm: StateInterop, args: Any, outs: Any) -> None:
    """A forward hook (under FSDP2) that frees FSDP2's gathered parameters after a forward without
    gradients: no backward follows to free them, and they would hold a full copy of every parameter the
    root group owns until the next forward."""
    if not torch.is_grad_enabled():
        sm._reshard_fsdp()


def _state_dict_from_dtensors(sm: StateInterop, state_dict: dict, prefix: str, *rest: Any) -> None:
    """``sm.load_state_dict()`` pre-hook: each entry given as a DTensor (any layout) or a full tensor becomes
    this rank's piece, in the type of the registered tensor (FSDP2's DTensor after ``fully_shard``)."""
    sm._reshard_fsdp()  # under FSDP2, the registered parameters are its sharded DTensors from here on
    loaded = []
    for fqn, own in sm._state_tensors().items():
        key = prefix + fqn
        if key not in state_dict:
            continue
        state_dict[key] = sm._layout.own_piece(fqn, own, state_dict[key], key)
        loaded.append(fqn)
    sm._mark_filled(loaded)
