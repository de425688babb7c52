"""Redistribution cost, for choosing among strategies: a price on the steps of the one planner.

``transition.plan_transition`` says which steps a layout change takes and the bytes of each;
``price`` turns those steps into a cost (alpha-beta model): a collective costs ``ALPHA``
(latency, in byte-equivalents) plus the bytes one rank sends, local work (slicing a replicated
tensor, zero-filling for R->Partial) a tiny epsilon, so between otherwise free strategies doing
nothing wins. Two prices are policy, not bytes: like GSPMD, propagation never invents a split
(sequence parallelism) on its own, so a reduce_scatter is priced like the all_reduce it replaces
(annotations ask for it); and an all_to_all is priced like the gather it replaces, because greedy
choices cannot see that a moved split is often gathered again by another consumer.

The global planner (``passes/solve.py``) drops the first policy (``rs_policy=False``): a reduce_scatter
costs the bytes it sends, half an all_reduce's. It sees every consumer, so a split it invents also pays
the all_gather back (reduce_scatter + all_gather: an all_reduce's bytes plus one latency, never
cheaper); with the policy it undid a user's sequence split (Megatron-SP) where gathers priced below the
all_reduce-priced reduce_scatters they replaced (tp=8 + SP at Llama-3-8B scale: 1.11x the bytes of
Megatron-SP; without it, Megatron-SP exactly).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from .mesh import MeshInfo
from .placements import Pl, S
from .transition import Step, plan_transition

__all__ = ["transition_cost", "price", "step_cost", "EPS", "ALPHA"]

EPS = 1e-6
ALPHA = 65536.0


def step_cost(st: Step, n: int, rs_policy: bool = True) -> float:
    """The price of one planned step on an axis of ``n`` ranks (see module doc); ``rs_policy=False``
    prices a reduce_scatter by the bytes it sends (the global planner)."""
    frac = (n - 1) / n
    b = float(st.nbytes)
    if st.kind == "all_gather":
        return ALPHA + b * frac
    if st.kind == "all_reduce":
        return ALPHA + 2 * b * frac
    if st.kind == "reduce_scatter":  # policy: priced as all_reduce + local slice (see module doc)
        return ALPHA + (2 if rs_policy else 1) * b * frac + EPS * (1 + b)
    if st.kind == "all_to_all":  # priced as gathering what it moves + local slice (policy)
        return ALPHA + b * n * frac + EPS * (1 + b * n)
    if st.kind in ("slice", "to_partial"):
        return EPS * (1 + b)
    return 0.0  # casts: part of the collectives they surround


def price(steps: Sequence[Step], sizes: Sequence[int], scale: float = 1.0, rs_policy: bool = True) -> float:
    """The cost of ``steps`` (bytes multiplied by ``scale``) on a mesh of axis ``sizes`` (``rs_policy``:
    :func:`step_cost`)."""
    total = 0.0
    for st in steps:
        if st.axis >= 0:
            total += step_cost(Step(st.kind, st.axis, st.src, st.dst, st.lshape, st.nbytes * scale),
                               sizes[st.axis], rs_policy)
    return total


def transition_cost(src: Pl, dst: Pl, nbytes: float, n: int, rs_policy: bool = True) -> float:
    """Cost of turning ``src`` into ``dst`` for a tensor of ``nbytes`` global bytes on an axis of ``n`` ranks.

    The planner's steps for a stand-in tensor (one byte per element, every dim of size ``n`` so each
    split is even), priced with their bytes scaled to ``nbytes`` (``rs_policy``: :func:`step_cost`).
    """
    if src == dst or n == 1:
        return 0.0
    steps, elements = _stand_in_plan(src, dst, n)
    return price(steps, (n,), nbytes / elements, rs_policy)


@functools.lru_cache(maxsize=4096)
def _stand_in_plan(src: Pl, dst: Pl, n: int) -> tuple[tuple[Step, ...], int]:
    ndim = 1 + max([p.dim for p in (src, dst) if isinstance(p, S)], default=0)
    mesh = MeshInfo(("axis",), (n,), (0,), ("",), "cpu", 0)
    return tuple(plan_transition((src,), (dst,), (n,) * ndim, mesh, torch.uint8)), n ** ndim
