"""Where parameter values come from, and the check that replicas agree across ranks.

torch's ParallelStyles (``distribute_tensor(..., src_data_rank=0)``) give every rank the
values of one source rank, so an unseeded model is the same everywhere. ``from_source``
does that for one full tensor: every rank ends up with the full tensor of the rank at
coordinate ``src`` on every mesh axis (one broadcast per axis, one full buffer at a time),
and keeps its slice. With ``src_data_rank=None`` each rank keeps its own values, and
``check_replicas`` compares a checksum of every value that must be equal across ranks
(replicated on some mesh axis) and names the ones that differ; ``check_pieces_differ`` names
split tensors whose pieces are all equal (written on every rank alike). A shard of a meta-built
model holds no values until it is filled: it is created holding ``sentinel(dtype)``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core.errors import ShardingError, name_few
from ..core.mesh import MeshInfo
from ..core.placements import Pl, Replicated

__all__ = ["communicates", "from_source", "check_replicas", "check_pieces_differ", "checksum", "as_words", "sentinel",
           "holds_sentinel"]

_CHUNK = 1 << 20  # elements per checksum step: bounds the checksum's transient memory


def communicates(mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` spans several ranks of a real process group (the fake one moves no data)."""
    return dist.is_initialized() and dist.get_backend() != "fake" and mesh.size() > 1


def from_source(full: torch.Tensor, src: int, mesh: DeviceMesh, device: torch.device, *,
                writable: bool = False) -> torch.Tensor:
    """The source rank's ``full`` tensor on ``device`` (a collective over ``mesh``; ``full`` is written
    only if ``writable``).

    Requires every rank of ``mesh`` to call it with a tensor of the same shape and dtype, and
    ``0 <= src < size`` of every mesh axis. Ensures the result equals ``full`` of the rank whose
    coordinate is ``src`` on every axis (torch's ``src_data_rank``). Receiving ranks allocate one
    full buffer; the source sends its own tensor without a copy when it is contiguous on ``device``.
    """
    coords = mesh.get_coordinate() or ()
    buf = full.detach().to(device)
    if not writable and any(c != src for c in coords) and buf.data_ptr() == full.data_ptr():
        buf = buf.clone(memory_format=torch.contiguous_format)  # never write into the caller's tensor
    buf = buf.contiguous()
    for a in range(mesh.ndim):  # every rank starts from its own values, so any axis order works
        dist.broadcast(buf, group=mesh.get_group(a), group_src=src)
    return buf


def as_words(flat: torch.Tensor) -> torch.Tensor:
    """The bits of the 1-D tensor ``flat`` as integers: one word per element of 1, 2, 4 or 8 bytes (bool as
    uint8), bytes otherwise (e.g. complex128). Equal tensors, equal words; NaNs compare equal bit for bit."""
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size())
    return flat.view(bits) if bits is not None else flat.view(torch.uint8)


def checksum(t: torch.Tensor) -> int:
    """A position-sensitive checksum of ``t``'s bits (equal tensors, equal sums; any flipped bit changes it)."""
    words = as_words(t.detach().contiguous().reshape(-1))
    total = 0
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].long()
        pos = torch.arange(start + 1, start + 1 + w.numel(), device=w.device, dtype=torch.long)
        total = (total + int((w * (pos * 2654435761 + 97)).sum().item())) % (1 << 61)
    return total


def check_replicas(tensors: Mapping[str, torch.Tensor], placements: Mapping[str, Sequence[Pl]], mesh: DeviceMesh,
                   why: str) -> None:
    """Raise a ShardingError on every rank naming the tensors whose replicas differ between ranks.

    A tensor must hold the same local values on the ranks of every mesh axis it is replicated on (not split,
    not partial).
    One ``all_gather_object`` per mesh axis some tensor is replicated over (of one checksum per such tensor),
    then one per axis to spread what was found; no collective when no tensor is replicated over an axis of
    several ranks. ``why`` ends the message (how the values came to be local, and how to fix it).
    """
    if not communicates(mesh):
        return
    info = MeshInfo.of(mesh)
    # per mesh axis of several ranks, the tensors that must agree over it (the same on every rank: one plan)
    must = {a: [n for n in tensors if isinstance(placements[n][a], Replicated)]
            for a in range(len(info.names)) if info.sizes[a] > 1}
    if not any(must.values()):
        return
    sums = {name: checksum(tensors[name]) for name in dict.fromkeys(n for names in must.values() for n in names)}
    bad: dict[str, str] = {}
    for a, axis in enumerate(info.names):
        if not must.get(a):
            continue
        group = mesh.get_group(a)
        everyone: list[Optional[dict]] = [None] * info.sizes[a]
        dist.all_gather_object(everyone, sums, group=group)
        ranks = dist.get_process_group_ranks(group)
        for name in must[a]:  # split or partial placements may differ
            if name in bad:
                continue
            diff = [r for r, other in zip(ranks, everyone) if other is not None and other.get(name) != sums[name]]
            if diff:
                bad[name] = f"{name} (rank {info.rank} vs rank {diff[0]}, replicated on mesh axis {axis!r})"
    bad = _everyones(bad, info, mesh)
    if bad:
        names = [bad[n] for n in tensors if n in bad]
        raise ShardingError(f"replicated values differ between ranks: {name_few(names, 5, '; ')}; {why}")


def check_pieces_differ(written: Mapping[str, torch.Tensor], split: Mapping[str, Sequence[int]], mesh: DeviceMesh,
                        what: str, why: str) -> None:
    """Raise a ShardingError on every rank naming the split tensors whose pieces every rank of a mesh axis they
    are split over wrote (``written``: this rank's piece, by name) with the same values.

    Requires ``split`` (name -> the mesh axes it is split over) the same on every rank; ``written`` may differ
    (a name some rank did not write is not named). One ``all_gather_object`` of checksums per mesh axis of
    several ranks something is split over, then one per axis to share the findings; none when ``split`` is
    empty. The message is ``what``, the names, then ``why``.
    """
    if not communicates(mesh) or not split:
        return
    info = MeshInfo.of(mesh)
    sums = {name: checksum(t) for name, t in written.items()}
    bad: dict[str, str] = {}
    for a, axis in enumerate(info.names):
        names = [n for n, axes in split.items() if a in axes]
        if info.sizes[a] == 1 or not names:
            continue
        everyone: list[Optional[dict]] = [None] * info.sizes[a]
        dist.all_gather_object(everyone, {n: sums[n] for n in names if n in sums}, group=mesh.get_group(a))
        for n in names:
            if n in sums and n not in bad and all(other is not None and other.get(n) == sums[n] for other in everyone):
                bad[n] = f"{n} (split over {axis!r})"
    bad = _everyones(bad, info, mesh)
    if bad:
        names = [bad[n] for n in split if n in bad]
        verb = "holds the same piece on every rank of the mesh axis it is" if len(names) == 1 else \
            "hold the same piece on every rank of the mesh axis they are"
        raise ShardingError(f"{what}: {name_few(names, 3)} {verb} split over; {why}")


def _everyones(bad: dict[str, str], info: MeshInfo, mesh: DeviceMesh) -> dict[str, str]:
    """``bad`` merged with every other rank's (one ``all_gather_object`` per mesh axis of several ranks, in
    order: what one rank found reaches all), so every rank raises alike."""
    for a in range(len(info.names)):
        if info.sizes[a] > 1:
            found: list[Optional[dict]] = [None] * info.sizes[a]
            dist.all_gather_object(found, bad, group=mesh.get_group(a))
            for other in found:
                for name, text in (other or {}).items():
                    bad.setdefault(name, text)
    return bad


def sentinel(dtype: torch.dtype) -> Optional[Any]:
    """The value a local shard that holds no values yet is created with (None: the dtype has none to spare)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return None
    return torch.iinfo(dtype).max


def holds_sentinel(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds only its sentinel (True for dtypes without one)."""
    v = sentinel(t.dtype)
    if v is None:
        return True  # no sentinel: only a tracked write counts as a fill
    with torch.no_grad():
        return bool(torch.isnan(t).all()) if isinstance(v, float) else bool((t == v).all())
