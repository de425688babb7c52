"""The single exception type fxshard raises for anything the user can fix, and the subclasses whose type
fxshard's own control flow branches on (never on a message's text)."""


class ShardingError(ValueError):
    """A plan, mesh, model or input that fxshard cannot shard correctly.

    Messages name what was given, why it fails and how to fix it, e.g.
    ``layers.0.wq.weight dim 0 (size 6) cannot be split over mesh axis 'tp' (4): an uneven split
    needs at least one element on each of the 4 ranks; use a mesh whose split divides 6 or leave
    dim 0 unsplit``.
    """


class NoPlanError(ShardingError):
    """The global planner's MILP found no feasible plan (e.g. none within auto-sharding's memory rows, or
    none before its time limit): callers that add rows may retry without them (``planner/auto.py``)."""


class NoLegalPlanError(ShardingError):
    """Every plan the global planner's MILP found, in its rounds of excluding them, split some tensor
    illegally across 3+ mesh axes together."""


def name_few(names: "list[str]", limit: int, sep: str = ", ") -> str:
    """The first ``limit`` of ``names`` joined by ``sep`` for a message, then `` and N more`` if there are more.

    Requires ``limit >= 1``. Ensures every name is counted: shown or in N."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return sep.join(names[:limit]) + more
