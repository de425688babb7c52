"""Pass 6, emit: a clean per-rank GraphModule.

Requires: a localized graph. Ensures: dead nodes removed, the graph linted
and recompiled; the result runs on local tensors with plain ATen ops and
functional collectives only.
"""

from __future__ import annotations

import torch.fx as fx

from ..context import ShardContext

__all__ = ["emit"]


def emit(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
