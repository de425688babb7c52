"""Looking inside a sharded module: ``explain`` (a table) and ``comm_stats`` (counts and bytes)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx

from ..core.ir import COMM_KEY, FALLBACK_KEY, INSERTED_KEY, META_KEY, STRATEGY_KEY
from ..core.placements import S
from ..runtime.description import Sharded, sharding_of
from ..runtime.programs import Program
from ..core.spec import Spec
from ..core.torch_compat import OpOverload

__all__ = ["explain", "comm_stats", "collectives", "gathered_inputs"]


def _programs(sm: Sharded, who: str) -> tuple[Program, ...]:
    return sharding_of(sm, who).programs


def collectives(program: Program) -> list[dict]:
    """Every collective of a program in execution order, with the reason it exists."""
    return [dict(n.meta[COMM_KEY], node=n.name) for n in program.gm.graph.nodes if COMM_KEY in n.meta]


def gathered_inputs(view: Any) -> list[dict]:
    """The user inputs that ``in_specs`` splits on a mesh axis but the forward program all-gathers over that
    axis before using them: every rank of that axis then computes with the whole input (e.g. a batch split on
    ``dp`` with outputs replicated on ``dp``, the default ``out_specs``: each rank computes the whole batch, so
    the split buys no data parallelism). ``view`` is a ``Sharding`` (``sm.sharding``). Each entry gives
    ``input`` (the placeholder's name), ``axis``, ``consumer`` (the op that needed it whole) and ``source``.
    Only splits of an input's first (batch) dim count: a sequence split gathered before attention is the
    sequence-parallel plan working as meant."""
    prog = view.programs[0]  # the (training) forward program
    placeholders = [n for n in prog.gm.graph.nodes if n.op == "placeholder"]
    specs = {n.name: n.meta.get(META_KEY) for n, slot in zip(placeholders, view.slots) if slot.kind == "input"}

    def batch_split(name: str, axis: str) -> bool:
        spec = specs.get(name)
        if spec is None or axis not in view.mesh.names:
            return name in specs  # no placement to read: say it rather than stay silent
        p = spec.placements[view.mesh.names.index(axis)]
        return isinstance(p, S) and p.dim == 0

    return [dict(input=c["value"], axis=c["axis"], consumer=c["consumer"], source=c["source"])
            for c in collectives(prog) if c["kind"] == "all_gather" and batch_split(c["value"], c["axis"])]


def gathered_input_note(g: dict) -> str:
    """One sentence about a ``gathered_inputs`` entry: what happens and how to split the work instead."""
    return (f"input {g['input']!r} is split on mesh axis {g['axis']!r} by in_specs, but all-gathered over "
            f"{g['axis']!r} before its first use (by {g['consumer']}{', ' + g['source'] if g['source'] else ''}): "
            f"every rank of {g['axis']!r} computes with the whole of it. Either the outputs are replicated on "
            f"{g['axis']!r} (the default out_specs) while the loss is computed outside, or the planner found gathering "
            f"this input cheaper than reducing the gradients (a batch small against the parameters). For data "
            f"parallelism put the loss inside the sharded program (fxshard.loss_parallel) or give out_specs a split on "
            f"{g['axis']!r}; planner='greedy' keeps a split batch split (docs/plans.md, Data parallelism)")


def comm_stats(sm: Sharded) -> dict[str, dict[str, dict[str, int]]]:
    """Per call: ``{"forward": {"all_reduce": {"count": n, "bytes": b}, ...}, "backward": {...}}``.

    ``bytes`` adds up, per collective, the larger of its input and output on one rank.
    """
    out: dict[str, dict[str, dict[str, int]]] = {"forward": {}, "backward": {}}
    for prog in _programs(sm, "fxshard.comm_stats"):
        table = out.setdefault(prog.label, {})
        for c in collectives(prog):
            row = table.setdefault(c["kind"], {"count": 0, "bytes": 0})
            row["count"] += 1
            row["bytes"] += int(c["bytes"])
    return out


def _fmt_shape(shape: Iterable) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _op_name(n: fx.Node) -> str:
    t = n.target
    return str(t).replace("aten.", "") if isinstance(t, OpOverload) else getattr(t, "__name__", str(t))


def explain(sm: Sharded) -> str:
    """A table a person scans: every node's op, global shape, spec and local shape, then every
    collective with its bytes and reason (consuming op and source line), then fallbacks; for a
    ShardedModule the first lines also give the per-rank memory report (``fxshard.memory``)."""
    lines: list[str] = []
    view = sharding_of(sm, "fxshard.explain")
    info = view.mesh
    lines.append("mesh: " + ", ".join(f"{n}={s}" for n, s in zip(info.names, info.sizes)) + f"  (rank {info.rank})")
    if view.is_module:  # a ShardedModule: one line of fxshard.memory
        from .memory import memory

        lines.append("memory per rank (bytes): " + ", ".join(f"{k} {v:,}" for k, v in memory(sm).items()))
    if view.auto is not None:
        lines += view.auto.lines()
    if view.is_module:
        lines += [f"note: {gathered_input_note(g)}" for g in gathered_inputs(view)]
    for prog in view.programs:
        rows = []
        for n in prog.gm.graph.nodes:
            if n.meta.get(INSERTED_KEY) or n.op == "output":
                continue
            spec = n.meta.get(META_KEY)
            specs = spec if isinstance(spec, tuple) else (spec,)
            if not any(isinstance(s, Spec) for s in specs):
                continue
            s0 = next(s for s in specs if isinstance(s, Spec))
            note = []
            if n.meta.get(FALLBACK_KEY):
                note.append("FALLBACK (no rule): computed replicated")
            lows = {st.lowering for st in n.meta.get(STRATEGY_KEY, ()) if st.lowering}
            note += sorted(lows)
            op = "input" if n.op == "placeholder" else _op_name(n)
            rows.append([n.name, op, _fmt_shape(s0.shape), ", ".join(repr(s) for s in specs if s is not None),
                         _fmt_shape(s0.local_shape(info.sizes, info.coords)), "; ".join(note)])
        lines.append("")
        lines.append(f"== {prog.label} program: {len(rows)} values ==")
        lines += _table(rows, ["node", "op", "global shape", "spec", "local shape", "note"])
        comms = collectives(prog)
        lines.append("")
        lines.append(f"-- {prog.label} collectives: {len(comms)} --")
        if comms:
            crow = [[c["node"], c["kind"], c["axis"], str(c["bytes"]), c["value"], f"{c['src']} -> {c['dst']}",
                     f"{c['consumer']} ({c['op'].replace('aten.', '')})", c["source"]] for c in comms]
            lines += _table(crow, ["collective", "kind", "axis", "bytes", "value", "change", "needed by", "source"])
            lines += [f"{c['node']} is a gradient bucket of: {', '.join(c['bucket'])}" for c in comms if "bucket" in c]
        if prog.fallbacks:
            lines.append(f"fallbacks (no sharding rule, computed replicated): {', '.join(sorted(set(prog.fallbacks)))}")
    return "\n".join(lines)
