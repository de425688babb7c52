"""Pass 6, emit: a clean per-rank GraphModule.

Requires: a localized graph. Ensures: dead nodes removed, traced layouts that
views rely on kept (``core/layout.py``), chains of views folded
(``tracing/simplify.py::fold_views``), the graph linted and recompiled;
the result runs on local tensors with plain ATen ops and functional
collectives only.
"""

from __future__ import annotations

import torch.fx as fx

from ..core.context import ShardContext
from ..core.layout import pin_layouts
from ..tracing.simplify import fold_views

__all__ = ["emit"]


def emit(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    gm.graph.eliminate_dead_code()
    fold_views(pin_layouts(gm))
    gm.graph.lint()
    gm.recompile()
    return gm
