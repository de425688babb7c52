"""The single exception type fxshard raises for anything the user can fix."""


class ShardingError(ValueError):
    """A plan, mesh, model or input that fxshard cannot shard correctly.

    Messages name what was given, why it fails and how to fix it, e.g.
    ``layers.0.wq.weight dim 0 (size 6) cannot be split over mesh axis 'tp' (4): an uneven split
    needs at least one element on each of the 4 ranks; use a mesh whose split divides 6 or leave
    dim 0 unsplit``.
    """
