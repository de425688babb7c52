"""Redistribution cost, for choosing among strategies: a price on the steps of the one planner.

``transition.plan_transition`` says which steps a layout change takes and the bytes of each;
``price`` turns those steps into a cost (alpha-beta model): a collective costs ``ALPHA``
(latency, in byte-equivalents) plus the bytes one rank sends, local work (slicing a replicated
tensor, zero-filling for R->Partial) a tiny epsilon, so between otherwise free strategies doing
nothing wins. Two prices are policy, not bytes: like GSPMD, propagation never invents a split
(sequence parallelism) on its own, so a reduce_scatter is priced like the all_reduce it replaces
(annotations ask for it); and an all_to_all is priced like the gather it replaces, because greedy
choices cannot see that a moved split is often gathered again by another consumer.

The global planner (``planner/solve.py``) drops the first policy (``rs_policy=False``): a reduce_scatter
costs the bytes it sends, half an all_reduce's. It sees every consumer, so a split it invents also pays
the all_gather back (reduce_scatter + all_gather: an all_reduce's bytes plus one latency, never
cheaper); with the policy it undid a user's sequence split (Megatron-SP) where gathers priced below the
all_reduce-priced reduce_scatters they replaced (tp=8 + SP at Llama-3-8B scale: 1.11x the bytes of
Megatron-SP; without it, Megatron-SP exactly).

Mesh axes may run on links of different speeds (``tp`` inside a node, ``dp`` across nodes):
``links`` turns the user's per-axis bandwidth and latency (by default: whether the axis's groups
span nodes) into a ``Link`` per axis, and a step on axis ``a`` costs ``link.alpha + bytes *
link.weight``, in byte-equivalents of the fastest link.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Mapping, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..core.errors import ShardingError
from ..core.mesh import MeshInfo
from ..core.placements import Part, Pl, S
from ..comm.transition import REDUCED_IN_WIDER, Step, plan_transition, reduce_scale

__all__ = ["transition_cost", "price", "step_cost", "links", "crosses_nodes", "linked_mesh_info", "axis_link", "INTRA_NODE", "INTER_NODE", "Link", "UNIFORM", "EPS", "ALPHA"]

EPS = 1e-6
ALPHA = 65536.0


@dataclasses.dataclass(frozen=True)
class Link:
    """An axis's link in the alpha-beta model: ``alpha`` the latency of one collective in byte-equivalents
    of the fastest link, ``weight`` the time to move one byte relative to the fastest link (>= 1);
    ``bucket``, when set, the bytes of the buckets a reduction (all_reduce, reduce_scatter) is packed into:
    it pays ``min(1, its bytes / bucket)`` of ``alpha`` (a bucketed gradient, ``planner/problem.py::links_of``);
    ``reduce_scale``: a reduction of a Partial sum moves that many times the value's bytes (a bf16 value
    reduced in float32 under autocast: ``transition.reduce_scale``, as ``plan_transition`` emits it)."""

    alpha: float = ALPHA
    weight: float = 1.0
    bucket: Optional[float] = None
    reduce_scale: float = 1.0


UNIFORM = Link()


INTRA_NODE = 300e9  # bytes/s, default for an axis whose groups stay inside a node (NVLink order)
INTER_NODE = 25e9  # bytes/s, default for an axis whose groups span nodes (one InfiniBand NIC per GPU)


def links(names: Sequence[str], bandwidth: Optional[Mapping[str, float]] = None,
          latency: Optional[Mapping[str, float]] = None, crosses_nodes: Sequence[bool] = ()) -> tuple[Link, ...]:
    """One ``Link`` per mesh axis from ``bandwidth`` (bytes/s) and ``latency`` (s per collective), keyed by
    axis name. An axis ``bandwidth`` leaves out gets ``INTER_NODE`` when ``crosses_nodes[i]`` says its
    groups span nodes, else ``INTRA_NODE``; an axis without a latency gets ``ALPHA`` bytes' worth of its own
    link. All axes alike (the default on one node): every axis ``UNIFORM`` (cost = bytes moved).

    Raises ShardingError for an unknown axis or a value that is not a positive number (zero for latency).
    """
    for what, table, low in (("bandwidth", bandwidth, "positive"), ("latency", latency, "non-negative")):
        for name, value in (table or {}).items():
            if name not in names:
                raise ShardingError(f"{what} names mesh axis {name!r}, which the mesh does not have; the mesh axes "
                                    f"are {tuple(names)}")
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
                value > 0 if low == "positive" else value >= 0)
            if not ok:
                unit = "bytes per second, e.g. 25e9" if what == "bandwidth" else "seconds per collective, e.g. 2e-5"
                raise ShardingError(f"{what}[{name!r}]={value!r} is not a {low} number; give {unit}")
    crosses = tuple(crosses_nodes) or (False,) * len(names)
    bw = {name: INTER_NODE if far else INTRA_NODE for name, far in zip(names, crosses)}
    bw.update(bandwidth or {})
    if len(set(bw.values())) <= 1 and not latency:
        return (UNIFORM,) * len(names)
    fastest = max(bw.values())
    out = []
    for name in names:
        weight = fastest / bw[name]
        lat = (latency or {}).get(name)
        out.append(Link(ALPHA * weight if lat is None else lat * fastest, weight))
    return tuple(out)


def crosses_nodes(mesh: DeviceMesh) -> tuple[bool, ...]:
    """Per mesh axis, whether one of its process groups spans nodes, ranks being on node
    ``rank // LOCAL_WORLD_SIZE`` as torchrun places them (all False without ``LOCAL_WORLD_SIZE``)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    ranks = mesh.mesh
    if local <= 0 or ranks.numel() <= local:
        return (False,) * ranks.dim()
    nodes = ranks // local
    return tuple(bool((nodes != nodes.select(a, 0).unsqueeze(a)).any()) for a in range(ranks.dim()))


def linked_mesh_info(mesh: DeviceMesh, bandwidth: Optional[Mapping[str, float]] = None,
                     latency: Optional[Mapping[str, float]] = None) -> MeshInfo:
    """``MeshInfo.of(mesh)`` with its axes' links (``links``, defaulting from ``crosses_nodes``)."""
    info = MeshInfo.of(mesh)
    return dataclasses.replace(info, links=links(info.names, bandwidth, latency, crosses_nodes(mesh)))


def axis_link(mesh: MeshInfo, a: int, dtype: Optional[torch.dtype] = None) -> Link:
    """The link of ``mesh``'s axis ``a`` (``UNIFORM`` when the mesh gives none); with ``dtype``, the one a value
    of that dtype is priced on (its reductions widened to ``mesh.reduce_dtype``: ``Link.reduce_scale``)."""
    link = mesh.links[a] if mesh.links else UNIFORM
    scale = reduce_scale(dtype, mesh.reduce_dtype) if dtype is not None else 1.0
    return link if scale == 1.0 else dataclasses.replace(link, reduce_scale=scale)


def step_cost(st: Step, n: int, link: Link = UNIFORM, rs_policy: bool = True) -> float:
    """The price of one planned step on an axis of ``n`` ranks joined by ``link`` (see module doc);
    ``rs_policy=False`` prices a reduce_scatter by the bytes it sends (the global planner)."""
    frac = (n - 1) / n * link.weight
    b = float(st.nbytes)
    if link.reduce_scale != 1.0 and isinstance(st.src, Part) and st.src.op in REDUCED_IN_WIDER:
        b *= link.reduce_scale
    reduce_alpha = link.alpha if link.bucket is None else link.alpha * min(1.0, b / link.bucket)
    if st.kind == "all_gather":
        return link.alpha + b * frac
    if st.kind == "all_reduce":
        return reduce_alpha + 2 * b * frac
    if st.kind == "reduce_scatter":  # policy: priced as all_reduce + local slice (see module doc)
        return reduce_alpha + (2 if rs_policy else 1) * b * frac + EPS * (1 + b)
    if st.kind == "all_to_all":  # priced as gathering what it moves + local slice (policy)
        return link.alpha + b * n * frac + EPS * (1 + b * n)
    if st.kind in ("slice", "to_partial"):
        return EPS * (1 + b)
    return 0.0  # casts: part of the collectives they surround


def price(steps: Sequence[Step], sizes: Sequence[int], scale: float = 1.0,
          axis_links: Optional[Sequence[Link]] = None, rs_policy: bool = True) -> float:
    """The cost of ``steps`` (bytes multiplied by ``scale``) on a mesh of axis ``sizes`` whose axes are joined
    by ``axis_links`` (default: all ``UNIFORM``); ``rs_policy``: :func:`step_cost`."""
    total = 0.0
    for st in steps:
        if st.axis >= 0:
            total += step_cost(Step(st.kind, st.axis, st.src, st.dst, st.lshape, st.nbytes * scale), sizes[st.axis],
                               axis_links[st.axis] if axis_links else UNIFORM, rs_policy)
    return total


def transition_cost(src: Pl, dst: Pl, nbytes: float, n: int, link: Link = UNIFORM,
                    rs_policy: bool = True) -> float:
    """Cost of turning ``src`` into ``dst`` for a tensor of ``nbytes`` global bytes on an axis of ``n`` ranks
    joined by ``link`` (``rs_policy``: :func:`step_cost`).

    The planner's steps for a stand-in tensor (one byte per element, every dim of size ``n`` so each
    split is even), priced with their bytes scaled to ``nbytes``.
    """
    if src == dst or n == 1:
        return 0.0
    steps, elements = _stand_in_plan(src, dst, n)
    return price(steps, (n,), nbytes / elements, (link,), rs_policy)


@functools.lru_cache(maxsize=4096)
def _stand_in_plan(src: Pl, dst: Pl, n: int) -> tuple[tuple[Step, ...], int]:
    ndim = 1 + max([p.dim for p in (src, dst) if isinstance(p, S)], default=0)
    mesh = MeshInfo(("axis",), (n,), (0,), ("",), "cpu", 0)
    return tuple(plan_transition((src,), (dst,), (n,) * ndim, mesh, torch.uint8)), n ** ndim
