"""The pass pipeline: the one definition of the stages every entry point runs.

A traced, annotated global program (``meta["val"]`` on every node, a ShardContext holding seed
placements, required output placements and constraints; see ``tracing/export.py``,
``tracing/annotate.py`` and ``frontend.py``) goes through the graph passes in order:

=============  ====================  ===================  ==========================================
pass           requires              ensures              file
=============  ====================  ===================  ==========================================
propagate      traced                specs                ``planner/propagate.py``
solve          specs                 specs                ``planner/solve.py`` (re-plans when ``ctx.planner == "global"``)
redistribute   specs                 arrive               ``passes/redistribute.py``
localize       arrive                local                ``passes/localize.py``
emit           local                 clean                ``passes/emit.py``
bucket         clean                 (nothing new)        ``passes/bucket.py`` (backward programs; ``ctx.bucket_mb``)
inplace        clean                 (nothing new)        ``passes/inplace.py`` (all_reduce of a dying buffer in place)
overlap        clean                 scheduled            ``passes/overlap.py`` (kept where peak memory holds)
=============  ====================  ===================  ==========================================

(facts: ``passes/verify.py``). ``DEFAULT`` is what ``fxshard.shard``, ``fxshard.jit``, the CLI and
the compile backend run (``fxshard.backend(..., overlap=False)`` and ``DEFAULT.without("overlap")`` drop
the overlap schedule). A pass marked
``per_program`` runs on each finished per-rank program (for training, after the joint graph is
split into forward and backward; one with ``program="backward"`` on the backward program only),
the others on the whole graph. With ``FXSHARD_VERIFY=1`` the
facts in force are checked after every pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch.fx as fx

from ..core.context import ShardContext
from ..core.errors import ShardingError
from .bucket import bucket_pass
from .emit import emit
from .inplace import inplace_pass
from .localize import localize
from .overlap import overlap_pass
from ..planner.propagate import propagate
from .redistribute import redistribute
from ..planner.solve import solve
from .verify import FACTS, enabled, verify

__all__ = ["Pass", "Pipeline", "DEFAULT", "PROPAGATE", "SOLVE", "REDISTRIBUTE", "LOCALIZE", "EMIT", "BUCKET",
           "INPLACE", "OVERLAP"]

PassFn = Callable[[fx.GraphModule, ShardContext], fx.GraphModule]


@dataclass(frozen=True)
class Pass:
    """One stage: ``fn(gm, ctx) -> gm`` and the facts it requires, ensures and ends (``FACTS`` names).

    ``per_program``: runs on each finished per-rank program; ``program``: only on programs of that
    kind (``"forward"``/``"backward"``; None: every one)."""

    name: str
    fn: PassFn
    requires: frozenset = frozenset()
    ensures: frozenset = frozenset()
    ends: frozenset = frozenset()
    per_program: bool = False
    program: Optional[str] = None


# the facts a program has when it enters the pipeline (the front end ensures them)
INITIAL = frozenset({"traced", "global"})

PROPAGATE = Pass("propagate", propagate, frozenset({"traced"}), frozenset({"specs"}))
SOLVE = Pass("solve", solve, frozenset({"specs"}), frozenset({"specs"}))
REDISTRIBUTE = Pass("redistribute", redistribute, frozenset({"specs"}), frozenset({"arrive"}), frozenset({"global"}))
LOCALIZE = Pass("localize", localize, frozenset({"arrive"}), frozenset({"local"}))
EMIT = Pass("emit", emit, frozenset({"local"}), frozenset({"clean"}))
BUCKET = Pass("bucket", bucket_pass, frozenset({"clean"}), per_program=True, program="backward")
INPLACE = Pass("inplace", inplace_pass, frozenset({"clean"}), per_program=True)
OVERLAP = Pass("overlap", overlap_pass, frozenset({"clean"}), frozenset({"scheduled"}), per_program=True)


@dataclass(frozen=True)
class Pipeline:
    """An ordered tuple of passes whose requirements are met by what the passes before them ensure.

    Construction raises a ShardingError otherwise. ``run`` runs the whole-graph passes, ``finish``
    the per-program ones (after ``run``, on each per-rank program made from its result).
    """

    passes: tuple[Pass, ...]

    def __post_init__(self) -> None:
        facts = set(INITIAL)
        for p in self.passes:
            unknown = (p.requires | p.ensures | p.ends) - set(FACTS)
            if unknown:
                raise ShardingError(f"pass {p.name!r} names unknown facts {sorted(unknown)}; known: {sorted(FACTS)}")
            missing = p.requires - facts
            if missing:
                raise ShardingError(f"pass {p.name!r} requires {sorted(missing)}, which no earlier pass ensures; "
                                    f"the order is {[q.name for q in self.passes]}")
            facts = (facts | p.ensures) - p.ends
        names = [p.name for p in self.passes]
        if len(set(names)) != len(names):
            raise ShardingError(f"a pipeline runs each pass once; got {names}")
        if any(a.per_program and not b.per_program for a, b in zip(self.passes, self.passes[1:])):
            raise ShardingError(f"per-program passes run after the whole-graph ones; got {names}")
        for p in self.passes:
            if p.program not in (None, "forward", "backward") or (p.program and not p.per_program):
                raise ShardingError(f"pass {p.name!r}: program={p.program!r} names the per-program pass's kind of "
                                    f"program: 'forward', 'backward' or None (every program)")

    def facts_after(self, name: str) -> set[str]:
        """The facts in force after the pass called ``name`` has run."""
        return self._facts_after(self.names.index(name))

    def _facts_after(self, i: int) -> set[str]:
        facts = set(INITIAL)
        for p in self.passes[: i + 1]:
            facts = (facts | p.ensures) - p.ends
        return facts

    def _run(self, gm: fx.GraphModule, ctx: ShardContext, per_program: bool,
             program: Optional[str] = None) -> fx.GraphModule:
        check = enabled()
        if check and not per_program:
            verify(gm, ctx, INITIAL, "the front end (trace, annotate)")
        for i, p in enumerate(self.passes):
            if p.per_program != per_program or (per_program and p.program not in (None, program)):
                continue
            gm = p.fn(gm, ctx)
            if check:
                verify(gm, ctx, self._facts_after(i), p.name)
        return gm

    def run(self, gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
        """Run the whole-graph passes on ``gm`` (in place; returns it)."""
        return self._run(gm, ctx, per_program=False)

    def finish(self, gm: fx.GraphModule, ctx: ShardContext, program: str = "forward") -> fx.GraphModule:
        """Run the per-program passes on one finished per-rank program ``gm`` of kind ``program``
        (``"forward"``: an inference program, a jitted function, a training forward; ``"backward"``)."""
        return self._run(gm, ctx, per_program=True, program=program)

    def __call__(self, gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
        """``run`` then ``finish``: for a program that is not split after sharding (inference, jit)."""
        return self.finish(self.run(gm, ctx), ctx)

    def with_pass(self, extra: Pass) -> "Pipeline":
        """This pipeline with ``extra`` appended (unchanged when it already runs a pass of that name)."""
        if any(p.name == extra.name for p in self.passes):
            return self
        return Pipeline(self.passes + (extra,))

    def without(self, name: str) -> "Pipeline":
        """This pipeline without the pass called ``name`` (e.g. ``DEFAULT.without("overlap")``: every
        collective stays where the redistribute pass put it, right before its first consumer)."""
        if name not in self.names:
            raise ShardingError(f"the pipeline has no pass {name!r}; its passes are {self.names}")
        return Pipeline(tuple(p for p in self.passes if p.name != name))

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def __repr__(self) -> str:
        """Short: the pass names (``help(fxshard.shard)`` shows the default pipeline in its signature)."""
        if self.passes == DEFAULT.passes:
            return "fxshard.passes.pipeline.DEFAULT"
        return f"Pipeline({', '.join(self.names)})"


DEFAULT = Pipeline((PROPAGATE, SOLVE, REDISTRIBUTE, LOCALIZE, EMIT, BUCKET, INPLACE, OVERLAP))
