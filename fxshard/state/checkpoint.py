"""Which pieces of a full tensor a rank holds, and reading them from full checkpoints.

A rank's shard is one box of the global tensor, or several when a dim is packed
(a strided split ``S(d, outer=k)`` holds one chunk of each of ``k`` blocks):
``rank_pieces`` lists them, ``take`` cuts them out of a full tensor, and
``to_dtensor`` presents a shard as a DTensor whose checkpoint chunks are those
boxes.

Composition with torch's FSDP2: after ``fully_shard(sm, mesh=mesh["dp"])`` a
parameter is FSDP2's DTensor over ``dp`` whose "global" tensor is fxshard's local
shard. ``held_pieces`` and ``storage`` say which boxes of the true global tensor
such a value holds and where to write them, and ``global_view`` presents it as
one DTensor over the concatenated ``(dp, tp)`` mesh (FSDP2's split of a dim that
fxshard splits too is ``_StridedShard``, as FSDP2 itself composes with DTensor
tensor parallelism), so full tensors, DCP and torch's state-dict API see true
global shapes. Checkpoint sources: an in-memory state dict, a ``.safetensors`` file, or
a directory of HF-style sharded safetensors files with
``model.safetensors.index.json``. For files, each rank reads only its own
pieces of each tensor (safetensors slicing), so peak memory stays near the
shard size.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..core.errors import ShardingError
from ..core.mesh import MeshInfo
from ..core.placements import Pl, S, from_torch, to_torch
from ..core.spec import chunk, chunk_index, shard_factor
from ..core.torch_compat import StridedShard as _StridedShard, compute_local_shape_and_global_offset, packed_spec

if TYPE_CHECKING:  # imported where used: torch.distributed.checkpoint is not needed to shard a model
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

__all__ = ["Piece", "rank_pieces", "assemble", "take", "to_dtensor", "SliceReader", "open_checkpoint", "held_pieces",
           "storage", "global_view", "local_piece"]

Source = Union[Mapping[str, torch.Tensor], str, os.PathLike]


@dataclass(frozen=True)
class Piece:
    """One box of a rank's shard: ``src`` indexes the global tensor, ``dst`` the local shard."""

    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def _dim_runs(size: int, pls: Sequence[Pl], info: MeshInfo, d: int) -> list[tuple[int, int]]:
    """(global start, length) of each run of dim ``d`` this rank holds, in local order."""
    f = shard_factor(pls, info.sizes, d)
    idx = chunk_index(pls, info.sizes, info.coords, d)
    outer = max([p.outer for p in pls if isinstance(p, S) and p.dim == d], default=1)
    if f == 1 or outer == 1:
        return [chunk(size, f, idx)]
    block = size // outer  # a packed dim divides evenly (plan.check_divisible)
    m = block // f
    return [(b * block + idx * m, m) for b in range(outer)]


def rank_pieces(shape: Sequence[int], pls: Sequence[Pl], info: MeshInfo) -> list[Piece]:
    """The boxes of this rank's shard of a tensor of global ``shape`` laid out per ``pls``: one box
    (``torch.chunk`` pieces, so an uneven split gives the last rank the shorter piece), or one per
    combination of packed blocks. The local shard is the pieces' ``src`` boxes placed at ``dst``."""
    per_dim = []
    for d, size in enumerate(shape):
        runs, at = [], 0
        for start, length in _dim_runs(int(size), pls, info, d):
            runs.append((slice(start, start + length), slice(at, at + length)))
            at += length
        per_dim.append(runs)
    return [Piece(tuple(r[0] for r in combo), tuple(r[1] for r in combo)) for combo in itertools.product(*per_dim)]


def assemble(pieces: list[Piece], read: Callable[[tuple[slice, ...]], torch.Tensor]) -> torch.Tensor:
    parts = [read(p.src) for p in pieces]
    if len(parts) == 1:
        return parts[0]
    out = parts[0].new_empty([max(p.dst[d].stop for p in pieces) for d in range(len(pieces[0].dst))])
    for p, t in zip(pieces, parts):
        out[p.dst] = t
    return out


def take(full: torch.Tensor, pls: Sequence[Pl], info: MeshInfo) -> torch.Tensor:
    """This rank's shard of ``full`` (a view when it is one box, a new tensor when packed)."""
    return assemble(rank_pieces(tuple(full.shape), pls, info), lambda src: full[src])


class _PackedDTensor(DTensor):
    """A DTensor with a packed (``_StridedShard``) placement: its shard is several boxes of the global
    tensor, which DCP's default (one box per rank) cannot describe, so each box is one checkpoint chunk."""

    def _pieces(self) -> list[Piece]:
        pls = [from_torch(p, self.ndim) for p in self.placements]
        return rank_pieces(tuple(self.shape), pls, MeshInfo.of(self.device_mesh))

    @staticmethod
    def _chunk(p: Piece) -> ChunkStorageMetadata:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(offsets=torch.Size(s.start for s in p.src),
                                    sizes=torch.Size(s.stop - s.start for s in p.src))

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(p) for p in self._pieces()]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self._local_tensor)
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=self.size()))
                for c in self.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for p in self._pieces():
            if self._chunk(p).offsets == index.offset:
                return self._local_tensor[p.dst]
        raise ShardingError(f"{index.fqn}: no local piece starts at {tuple(index.offset or ())}")


def to_dtensor(local: torch.Tensor, mesh: DeviceMesh, pls: Sequence[Pl], shape: Sequence[int]) -> DTensor:
    """``local`` (this rank's shard laid out per ``pls``, of global ``shape``) as a DTensor over ``mesh``,
    without communication. ``full_tensor()``, ``redistribute`` and DCP save/load work on it, packed too."""
    size = torch.Size(int(s) for s in shape)
    dt = DTensor.from_local(local, mesh, [to_torch(p) for p in pls], shape=size, stride=_contiguous_stride(size))
    return _as_packed(dt, pls)


def _as_packed(dt: DTensor, pls: Sequence[Pl]) -> DTensor:
    """``dt`` as a ``_PackedDTensor`` read as packed blocks on every torch of the window (``packed_spec``) when
    one of fxshard's placements ``pls`` is packed; else ``dt`` itself."""
    if all(not isinstance(p, S) or p.outer == 1 for p in pls):
        return dt
    return _PackedDTensor(dt._local_tensor, packed_spec(dt._spec), requires_grad=dt.requires_grad)


def storage(value: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``value``'s data on this rank: FSDP2's local piece of a DTensor, else ``value``."""
    return value._local_tensor if isinstance(value, DTensor) else value


def held_pieces(value: torch.Tensor, shape: Sequence[int], pls: Sequence[Pl], info: MeshInfo) -> list[Piece]:
    """The boxes of the global tensor (``shape``, laid out per ``pls`` over fxshard's mesh) that ``value`` holds,
    with ``dst`` boxes indexing ``storage(value)``: this rank's shard (``rank_pieces``), cut down to the part FSDP2
    keeps when ``value`` is FSDP2's DTensor of that shard."""
    pieces = rank_pieces(shape, pls, info)
    if not isinstance(value, DTensor):
        return pieces
    sizes, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    out = []
    for p in pieces:
        src, dst = [], []
        for s, d, lo, n in zip(p.src, p.dst, offsets, sizes):
            a, b = max(d.start, lo), min(d.stop, lo + n)
            if a >= b:
                break
            src.append(slice(s.start + a - d.start, s.start + b - d.start))
            dst.append(slice(a - lo, b - lo))
        else:
            out.append(Piece(tuple(src), tuple(dst)))
    return out


def global_view(value: torch.Tensor, mesh: DeviceMesh, pls: Sequence[Pl], shape: Sequence[int],
                name: str = "tensor") -> DTensor:
    """``value`` as a DTensor of the global tensor, without communication (see module doc).

    ``value`` is this rank's shard laid out per ``pls`` over ``mesh`` (a plain tensor), or FSDP2's
    DTensor of that shard over another axis of the same root mesh; then the result lives on the
    concatenated mesh (FSDP2's axes first, as FSDP2 orders them) and its placements compose both.
    """
    if not isinstance(value, DTensor):
        return to_dtensor(value, mesh, pls, shape)
    outer = []
    for p in value.placements:
        if isinstance(p, Replicate):
            outer.append(p)
            continue
        if not isinstance(p, Shard) or isinstance(p, _StridedShard):
            raise ShardingError(f"{name}: its FSDP2 placement {p!r} is not Shard/Replicate; fxshard composes with "
                                f"fully_shard's default placements (Shard(dim)) only")
        d = p.dim % len(shape)
        if any(isinstance(q, S) and q.dim == d and q.outer > 1 for q in pls):
            raise ShardingError(f"{name}: FSDP2 shards dim {d}, which fxshard splits as packed blocks; give "
                                f"fully_shard a shard_placement_fn that shards another dim of this parameter")
        f = shard_factor(pls, MeshInfo.of(mesh).sizes, d)
        outer.append(_StridedShard(d, split_factor=f) if f > 1 else Shard(d))
    try:
        both = DeviceMesh._concatenate([value.device_mesh, mesh])
    except Exception as e:  # noqa: BLE001 - torch's message names the meshes
        raise ShardingError(
            f"{name}: FSDP2's mesh {value.device_mesh} and fxshard's mesh {mesh} are not distinct axes of one "
            f"DeviceMesh ({e}); shard with mesh['tp'] and fully_shard with mesh['dp'] of the same init_mesh"
        ) from e
    size = torch.Size(int(s) for s in shape)
    dt = DTensor.from_local(value._local_tensor, both, [*outer, *(to_torch(p) for p in pls)], shape=size,
                            stride=_contiguous_stride(size))
    return _as_packed(dt, pls)


def local_piece(value: Any, like: DTensor, pieces: list[Piece], name: str) -> torch.Tensor:
    """The part of the state-dict entry ``value`` this rank holds, as ``storage`` of its own ``global_view``
    ``like`` (whose boxes are ``pieces``): a DTensor laid out like ``like`` gives its local tensor without
    communication, any other DTensor is gathered first, and a plain tensor must be the full tensor."""
    if isinstance(value, DTensor):
        if value.device_mesh == like.device_mesh and value.placements == like.placements \
                and value.shape == like.shape:
            return value.to_local()
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(like.shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ShardingError(
            f"{name}: got {got}, expected a DTensor or the full tensor of shape {tuple(like.shape)}; pass "
            f"sm.state_dict() (filled by dcp.load) or a full state dict (model.state_dict() keys and shapes)"
        )
    if not pieces:  # FSDP2 gave this rank an empty piece
        return like._local_tensor.new_empty(like._local_tensor.shape)
    return assemble(pieces, lambda src: value[src])


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


class SliceReader:
    """Uniform access to tensor shapes and slices of a checkpoint source."""

    def __init__(self, src: Source):
        self._mem: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, str] = {}
        if isinstance(src, Mapping):
            self._mem = src
            return
        path = os.fspath(src)
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self._files = {k: os.path.join(path, v) for k, v in weight_map.items()}
            else:
                single = os.path.join(path, "model.safetensors")
                if not os.path.exists(single):
                    raise ShardingError(
                        f"{path} has neither model.safetensors.index.json nor model.safetensors; point "
                        f"load_full_state_dict at a safetensors file or an HF-style checkpoint directory"
                    )
                path = single
        if not self._files:
            if not os.path.exists(path):
                raise ShardingError(f"checkpoint {path} does not exist; pass an existing .safetensors file or directory")
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                self._files = {k: path for k in f.keys()}

    def keys(self) -> list[str]:
        return list(self._mem.keys()) if self._mem is not None else list(self._files)

    def read(self, name: str, pieces: list[Piece], expect_shape: Sequence[int]) -> torch.Tensor:
        """The shard of tensor ``name`` made of ``pieces`` (see ``rank_pieces``); from files, only those are read."""
        if self._mem is not None:
            full = self._mem[name]
            self._check(name, tuple(full.shape), expect_shape)
            return assemble(pieces, lambda src: full[src])
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as f:
            sl = f.get_slice(name)
            self._check(name, tuple(sl.get_shape()), expect_shape)
            return assemble(pieces, lambda src: sl[src] if src else f.get_tensor(name))  # a 0-dim slice fails

    @staticmethod
    def _check(name: str, shape: tuple, expect_shape: Sequence[int]) -> None:
        if shape != tuple(expect_shape):
            raise ShardingError(
                f"load_full_state_dict: {name} has shape {shape}, expected {tuple(expect_shape)}; "
                f"load a checkpoint of the same model config"
            )


def open_checkpoint(src: Source) -> SliceReader:
    return SliceReader(src)
