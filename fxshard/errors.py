"""The single exception type fxshard raises for anything the user can fix."""


class ShardingError(ValueError):
    """A plan, mesh, model or input that fxshard cannot shard correctly.

    Messages name what was given, why it fails and how to fix it, e.g.
    ``layers.0.wq.weight dim 0 (size 6) is not divisible by mesh axis 'tp' (4);
    use a mesh with tp dividing 6``.
    """
