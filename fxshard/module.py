"""``ShardedModule``: the per-rank nn.Module that ``fxshard.shard`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from .errors import ShardingError
from .inputs import InputCheck
from .mesh import MeshInfo
from .passes.trace import Traced
from .placements import Pl, to_torch

__all__ = ["ShardedModule", "Program"]


@dataclass
class Program:
    """One sharded graph with what explain/comm_stats need to describe it."""

    gm: fx.GraphModule
    label: str
    fallbacks: list[str] = field(default_factory=list)


@dataclass
class Training:
    """The sharded joint graph split into the programs autograd runs."""

    fwd: Program
    bwd: Program
    n_out: int
    diff_out: list[int]
    diff_in: list[int]
    updated: list[int] = field(default_factory=list)  # primals: buffers the forward updates in place


class _RunSharded(torch.autograd.Function):
    """Runs the sharded forward program; its backward runs the sharded backward program."""

    @staticmethod
    def forward(ctx, training: Training, *primals: Any) -> Any:  # type: ignore[override]
        res = training.fwd.gm(*primals)
        outs, saved = list(res[: training.n_out]), list(res[training.n_out:])
        if training.updated:  # a buffer the backward reads is saved as its value now: the module updates it next
            bufs = [primals[i] for i in training.updated]
            saved = [x.clone() if isinstance(x, torch.Tensor) and any(x is b or x._base is b for b in bufs) else x
                     for x in saved]
        ctx.training = training
        ctx.tensor_pos = [i for i, x in enumerate(saved) if isinstance(x, torch.Tensor)]
        ctx.others = [None if isinstance(x, torch.Tensor) else x for x in saved]
        ctx.save_for_backward(*[saved[i] for i in ctx.tensor_pos])
        ctx.out_meta = [(o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None for o in outs]
        non_diff = [o for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and i not in training.diff_out]
        ctx.mark_non_differentiable(*non_diff)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs: Any) -> Any:  # type: ignore[override]
        tr: Training = ctx.training
        saved = list(ctx.others)
        for i, t in zip(ctx.tensor_pos, ctx.saved_tensors):
            saved[i] = t
        tangents = []
        for i in tr.diff_out:
            g = grad_outs[i]
            if g is None:
                shape, dtype, device = ctx.out_meta[i]
                g = torch.zeros(shape, dtype=dtype, device=device)
            tangents.append(g.contiguous())
        grads = tr.bwd.gm(*saved, *tangents)
        n_primals = len(ctx.needs_input_grad) - 1
        res: list[Any] = [None] * n_primals
        for pos, g in zip(tr.diff_in, grads):
            res[pos] = g
        return (None, *res)


def _container(root: nn.Module, path: list[str]) -> nn.Module:
    m = root
    for part in path:
        if not hasattr(m, part) or not isinstance(getattr(m, part), nn.Module):
            m.add_module(part, nn.Module())
        m = getattr(m, part)
    return m


class ShardedModule(nn.Module):
    """This rank's part of a sharded model.

    Parameters and buffers are the local shards, registered under the
    original FQNs (tied parameters are one Parameter under each name).
    ``forward`` takes this rank's local inputs (laid out per ``in_specs``) and
    returns local outputs (per ``out_specs``, replicated by default).
    """

    def __init__(self, traced: Traced, forward: Program, training: Optional[Training], mesh: DeviceMesh, info: MeshInfo,
                 placements: dict[str, tuple[Pl, ...]], global_shapes: dict[str, tuple], tensors: dict[str, torch.Tensor],
                 input_check: Optional[InputCheck] = None):
        super().__init__()
        self._input_check = input_check
        self._traced = traced
        self._fwd = forward
        self._training = training
        self._mesh = mesh
        self._info = info
        self._placements = placements
        self._global_shapes = global_shapes
        self._slots = traced.slots
        for slot in traced.slots:
            if slot.kind not in ("param", "buffer"):
                continue
            t = tensors[slot.names[0]]
            for name in slot.names:
                *path, leaf = name.split(".")
                owner = _container(self, path)
                if slot.kind == "param":
                    owner.register_parameter(leaf, t)
                else:
                    owner.register_buffer(leaf, t, persistent=slot.persistent)

    def _programs(self) -> list[Program]:
        """Training forward/backward when the module trains, else the inference forward."""
        if self._training is not None:
            return [self._training.fwd, self._training.bwd]
        return [self._fwd]

    # ---- running -------------------------------------------------------------------------
    def _feed(self, args: tuple, kwargs: dict) -> list[Any]:
        flat, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if tree != self._traced.in_tree:
            raise ShardingError(
                f"inputs have structure {tree} but the module was sharded for {self._traced.in_tree}; "
                f"call it with the same argument structure as example_inputs"
            )
        leaves = [flat[i] for i in self._traced.tensor_leaf_positions]
        if self._input_check is not None:
            self._input_check.check([leaves[s.index] for s in self._slots if s.kind == "input"])
        feed: list[Any] = []
        for slot in self._slots:
            if slot.kind in ("param", "buffer"):
                feed.append(self._lookup(slot.names[0]))
            elif slot.kind == "constant":
                feed.append(self._traced.constants[slot.names[0]])
            else:
                feed.append(leaves[slot.index])
        return feed

    def _lookup(self, fqn: str) -> torch.Tensor:
        m: Any = self
        for part in fqn.split("."):
            m = getattr(m, part)
        return m

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Local outputs for local inputs; differentiable when grad mode is on (see class doc)."""
        feed = self._feed(args, kwargs)
        tr = self._training
        if tr is not None and torch.is_grad_enabled() and any(
            isinstance(feed[i], torch.Tensor) and feed[i].requires_grad for i in tr.diff_in
        ):
            for i, (slot, x) in enumerate(zip(self._slots, feed)):
                if slot.kind == "input" and isinstance(x, torch.Tensor) and x.requires_grad and i not in tr.diff_in:
                    raise ShardingError(
                        f"input {slot.index} requires grad but the example input did not; pass an example input "
                        f"with requires_grad=True to shard() to get its gradient"
                    )
            outs = _RunSharded.apply(tr, *feed)
        else:
            outs = self._fwd.gm(*feed)
        n_mut = len(self._traced.mutations)
        if n_mut:
            with torch.no_grad():  # buffers the forward updates (e.g. BatchNorm running statistics)
                for name, new in zip(self._traced.mutations, outs[:n_mut]):
                    self._lookup(name).copy_(new)
        return pytree.tree_unflatten(list(outs[n_mut:]), self._traced.out_tree)

    # ---- state ---------------------------------------------------------------------------
    def _dtensor(self, fqn: str, local: torch.Tensor) -> DTensor:
        pls = [to_torch(p) for p in self._placements[fqn]]
        shape = torch.Size(int(s) for s in self._global_shapes[fqn])
        return DTensor.from_local(local, self._mesh, pls, shape=shape, stride=_contiguous_stride(shape))

    def init_parameters(self, init: Any) -> None:
        """Fill every parameter and buffer from ``init(fqn, full_tensor)``, which writes the full
        (global-shape, CPU) tensor in place; this rank keeps its slice.

        One tensor is materialized at a time, so peak memory is bounded by the largest single
        parameter. With a per-tensor seeded ``init`` (e.g. ``torch.manual_seed(hash_of(fqn))`` then
        ``nn.init.normal_``), every rank and the unsharded model get the same values.
        """
        from .checkpoint import rank_slices

        with torch.no_grad():
            for name, local in self.state_dict(keep_vars=True).items():
                shape = tuple(int(s) for s in self._global_shapes[name])
                full = torch.empty(shape, dtype=local.dtype, device="cpu")
                init(name, full)
                local.copy_(full[rank_slices(shape, self._placements[name], self._info)])
                del full

    def sharded_state_dict(self) -> dict[str, DTensor]:
        """The state dict with every entry a DTensor over the mesh (no communication).

        This is what ``torch.distributed.checkpoint`` (DCP) saves and loads: its metadata
        records the global shapes and placements, so a checkpoint saved at one mesh loads at
        another mesh, or into the unsharded model.
        """
        return {name: self._dtensor(name, local.detach()) for name, local in self.state_dict(keep_vars=True).items()}

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Copy DTensors (e.g. filled in place by ``dcp.load``) into the local shards."""
        own = self.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        if missing:
            raise ShardingError(f"load_sharded_state_dict: missing keys {missing[:5]}; pass sm.sharded_state_dict() "
                                f"after loading into it")
        with torch.no_grad():
            for name, local in own.items():
                v = state_dict[name]
                local.copy_(v.to_local() if isinstance(v, DTensor) else v)

    def full_state_dict(self, *, rank0_only: bool = False, cpu_offload: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors under exactly the original ``model.state_dict()`` keys (a collective: call on all ranks).

        Tensors are gathered one at a time; with ``cpu_offload`` each is moved to CPU right away,
        and with ``rank0_only`` other ranks drop it (they return ``{}``), so exporting a model to
        one file needs at most one full tensor of device memory on any rank.
        """
        keep = not rank0_only or torch.distributed.get_rank() == 0
        out = {}
        for name, local in self.state_dict(keep_vars=True).items():
            full = self._dtensor(name, local.detach()).full_tensor()
            if keep:
                out[name] = full.cpu() if cpu_offload else full
            del full
        return out

    def load_full_state_dict(self, src: Any) -> None:
        """Copy each rank's slices of a full checkpoint into the local shards.

        ``src`` is a state dict (keys as in ``model.state_dict()``), a ``.safetensors`` file, or a
        directory of HF-style sharded safetensors files; from files each rank reads only its slices.
        """
        from .checkpoint import open_checkpoint, rank_slices

        reader = open_checkpoint(src)
        own = self.state_dict(keep_vars=True)
        have = set(reader.keys())
        missing = [k for k in own if k not in have]
        if missing:
            raise ShardingError(
                f"load_full_state_dict: missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}; pass a "
                f"checkpoint of the full model (keys as in model.state_dict())"
            )
        with torch.no_grad():
            for name, local in own.items():
                shape = tuple(int(s) for s in self._global_shapes[name])
                piece = reader.read(name, rank_slices(shape, self._placements[name], self._info), shape)
                local.copy_(piece)

def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


def local_slice(full: torch.Tensor, mesh: DeviceMesh, pls: tuple[Pl, ...]) -> torch.Tensor:
    """This rank's piece of a full tensor laid out per ``pls`` (a view; no communication)."""
    from .checkpoint import rank_slices

    return full[rank_slices(tuple(full.shape), pls, MeshInfo.of(mesh))]
