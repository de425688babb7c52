"""Redistribution cost on one mesh axis, for choosing among strategies (alpha-beta model).

A collective costs ``ALPHA`` (latency, in byte-equivalents) plus the bytes
one rank sends. Local work (slicing a replicated tensor, zero-filling for
R->Partial) costs a tiny epsilon, so between otherwise free strategies doing
nothing wins. A Partial sum becomes a split value by reduce_scatter when a
consumer needs the split, but the cost model prices that transition like an
all_reduce: like GSPMD, propagation never invents a split (sequence
parallelism) on its own; annotations ask for it.
"""

from __future__ import annotations

from .placements import Pl, R, S

__all__ = ["transition_cost", "EPS", "ALPHA"]

EPS = 1e-6
ALPHA = 65536.0


def transition_cost(src: Pl, dst: Pl, nbytes: float, n: int) -> float:
    """Cost of turning ``src`` into ``dst`` for a tensor of ``nbytes`` global bytes on an axis of ``n`` ranks."""
    if src == dst or n == 1:
        return 0.0
    frac = (n - 1) / n
    local = EPS * (1 + nbytes)
    if src == R:
        return local
    if isinstance(src, S):
        # S(a)->S(b) runs as one all_to_all (1/n of a gather's bytes), but it is priced like the gather:
        # greedy choices cannot see that a moved split is often gathered again by another consumer
        gather = ALPHA + nbytes * frac
        return gather if dst == R else gather + local
    reduce = ALPHA + 2 * nbytes * frac
    return reduce if dst == R else reduce + local
