"""The single exception type fxshard raises for anything the user can fix."""


class ShardingError(ValueError):
    """A plan, mesh, model or input that fxshard cannot shard correctly.

    Messages name what was given, why it fails and how to fix it, e.g.
    ``layers.0.wq.weight dim 0 (size 6) cannot be split over mesh axis 'tp' (4): an uneven split
    needs at least one element on each of the 4 ranks; use a mesh whose split divides 6 or leave
    dim 0 unsplit``.
    """


def name_few(names: "list[str]", limit: int, sep: str = ", ") -> str:
    """The first ``limit`` of ``names`` joined by ``sep`` for a message, then `` and N more`` if there are more.

    Requires ``limit >= 1``. Ensures every name is counted: shown or in N."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return sep.join(names[:limit]) + more
