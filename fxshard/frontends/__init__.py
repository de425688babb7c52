"""Entry points: ``shard`` (modules), ``jit`` (functions), the ``torch.compile`` backend, ``loss_parallel`` and
the ``fxshard`` command line.
"""
