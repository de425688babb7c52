"""Auto-sharding (``fxshard.shard(..., auto=True, memory_budget=...)``): completes a partial plan by cost.

Every parameter the plan does not place becomes a decision of the global planner's MILP
(``passes/solve.py``): on each mesh axis it is replicated or split on one of its dims (``S(d)``,
when the dim divides evenly). Whether a split parameter is *tensor-parallel* or *FSDP-style*
(stored split, gathered before use) is not a separate choice: it follows from what its consumers'
chosen strategies need (the split itself, or a gather priced like any other layout change), and
its gradient must arrive in the parameter's layout (a reduce-scatter instead of an all-reduce).
Parameters and buffers the plan places, and buffers, stay as given.

The memory budget is one linear row of the MILP. Per rank, for a parameter of ``n`` elements of
``b`` bytes whose layout splits it ``f`` ways: ``n*b/f`` (the parameter), plus for a trained
parameter ``n*b/f`` (its gradient) and ``2*n*4/f`` (AdamW's two fp32 states; FSDP and tensor
splits shard optimizer state like the parameter). Per-axis choices make ``1/f`` a product, so each
parameter also gets one continuous variable per N-D layout, tied to its per-axis binaries. The
constant part: the placed parameters and buffers, and the activation peak, estimated as the
largest sum of values live at once in the planned graph (forward + backward for training) with
the data-parallel layouts of the greedy plan (every free parameter replicated), parameter
gradients left out. It is made before the plan exists and is not a bound: the chosen layouts change
the activations (gathers, partial sums) and the transient full copy an FSDP-style parameter is
gathered into is not counted. ``measure`` checks the sharded result with ``fxshard.memory`` and
warns when it exceeds the budget.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import operator
import time
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.fx as fx

from .consistency import agree
from .passes.joint import joint_context, trace_joint
from .passes.propagate import propagate
from .passes.trace import Traced
from .context import ShardContext
from .errors import ShardingError
from .ir import META_KEY, VIEW_OPS
from .memory import liveness_peak
from .registry import output_leaves
from .placements import Pl, R, S
from .sizes import fmt_bytes as _fmt, parse_bytes
from .spec import Spec
from .passes.solve import UNIT, build_problem, plan_cost, solve_problem

__all__ = ["parse_budget", "AutoChoice", "AutoReport", "complete_plan", "choose_placements", "measure", "ADAMW_STATES", "STATE_BYTES"]

ADAMW_STATES = 2  # exp_avg and exp_avg_sq per trained parameter element
STATE_BYTES = 4  # each kept in fp32
# the budget makes the MILP a knapsack: proving the last percent costs minutes, and the chosen layouts are
# planned again (planner="global", the parameters fixed) when the model is sharded
GAP = 0.01
TIME_LIMIT = 60.0  # seconds; then the best plan found is taken, rank 0's on every rank
ROUNDS = 3  # MILPs, each pricing a value's other mesh axes as the previous plan laid them out (solve.py)


def parse_budget(budget: Union[int, float, str, None]) -> Optional[int]:
    """Bytes per rank from ``budget``: a number of bytes, or a string like ``"8GiB"``, ``"512 MiB"``,
    ``"1.5GB"`` (None: no budget). Anything else is a ShardingError."""
    return parse_bytes(budget, "memory_budget")


@dataclass(frozen=True)
class AutoChoice:
    """One plan entry the solver chose: the parameter, its layout (one placement per mesh axis), the
    bytes per rank it saves against replicating it (parameter, gradient, optimizer state), and the
    communication its layout adds (negative: saves) against storing it replicated with every op's
    strategy unchanged, in the solver's byte-equivalents."""

    fqn: str
    placements: tuple[Pl, ...]
    memory_saved: int
    comm_delta: float


@dataclass(frozen=True)
class AutoReport:
    """What ``auto=True`` decided: the chosen entries (replicated ones left out), the per-rank memory
    estimate and budget, the solver's communication estimate of the plan and of the data-parallel
    plan (every free parameter replicated), and the solve time."""

    chosen: tuple[AutoChoice, ...]
    replicated: tuple[str, ...]
    footprint: int
    budget: Optional[int]
    activation_peak: int
    comm: float
    comm_replicated: float
    seconds: float
    measured: Optional[int] = None  # the sharded result's footprint (fxshard.memory, AdamW), once known

    def lines(self) -> list[str]:
        budget = "no budget" if self.budget is None else f"budget {_fmt(self.budget)}"
        out = [f"auto plan: {len(self.chosen)} entries chosen by the solver, {len(self.replicated)} parameters left "
               f"replicated; memory per rank {_fmt(self.footprint)} ({budget}; activation peak estimate "
               f"{_fmt(self.activation_peak)}); comm estimate {_fmt(self.comm)} vs {_fmt(self.comm_replicated)} "
               f"with every free parameter replicated; solved in {self.seconds:.1f} s"]
        if self.measured is not None:
            out.append(f"  measured on the sharded result (fxshard.memory, AdamW, the larger program peak): "
                       f"{_fmt(self.measured)} per rank")
        for c in self.chosen:
            delta = f"adds {_fmt(c.comm_delta)}" if c.comm_delta >= 0 else f"saves {_fmt(-c.comm_delta)}"
            out.append(f"  {c.fqn}: {c.placements}  saves {_fmt(c.memory_saved)} per rank; {delta} of communication")
        return out


def _split(layout: tuple[Pl, ...], sizes: tuple[int, ...]) -> int:
    f = 1
    for p, n in zip(layout, sizes):
        if isinstance(p, S):
            f *= n
    return f


def _legal(shape: tuple[int, ...], layout: tuple[Pl, ...], sizes: tuple[int, ...]) -> bool:
    for d, size in enumerate(shape):
        f = 1
        for p, n in zip(layout, sizes):
            if isinstance(p, S) and p.dim == d:
                f *= n
        if size % f:
            return False
    return True


def state_bytes(val: torch.Tensor, layout: tuple[Pl, ...], sizes: tuple[int, ...], trained: bool) -> int:
    """Per-rank bytes of a parameter in ``layout``: itself, and when ``trained`` its gradient and AdamW's
    two fp32 states (module doc)."""
    per = val.dtype.itemsize * (2 if trained else 1) + (ADAMW_STATES * STATE_BYTES if trained else 0)
    return val.numel() * per // _split(layout, sizes)


def _activation_peak(gm: fx.GraphModule, sizes: tuple[int, ...], grad_outputs: set[int]) -> int:
    """Liveness peak of the graph's values at their propagated local sizes, the parameters' gradients
    (graph outputs ``grad_outputs``, counted with the parameters) left out."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    grads = set()
    for j, leaf in enumerate(output_leaves(out)):
        while j in grad_outputs and isinstance(leaf, fx.Node) and leaf not in grads:
            grads.add(leaf)  # the gradient and the values it views (their storage)
            if leaf.op == "call_function" and (leaf.target in VIEW_OPS or leaf.target is operator.getitem):
                leaf = leaf.args[0]

    def local(n: fx.Node) -> int:
        if n in grads:
            return 0
        spec = n.meta.get(META_KEY)
        total = 0
        for s in spec if isinstance(spec, tuple) else (spec,):
            if isinstance(s, Spec):
                numel = 1
                for d in s.shape:
                    numel *= int(d) if isinstance(d, int) else 64
                total += numel * s.dtype.itemsize // _split(s.placements, sizes)
        return total

    return liveness_peak(gm, local)


def choose_placements(gm: fx.GraphModule, ctx: ShardContext, free: dict[str, list[str]], tied: dict[int, str],
                      trained: set[str], fixed_bytes: int, budget: Optional[int], grad_outputs: set[int] = frozenset()
                      ) -> tuple[dict[str, tuple[Pl, ...]], AutoReport]:
    """Layouts for the ``free`` placeholders of a propagated graph (placeholder name -> the FQNs it
    feeds) within ``budget`` bytes per rank.

    Requires: ``gm`` propagated with every free placeholder replicated; ``tied`` maps output indices to
    the free placeholder whose layout they take (gradients); ``trained`` names the free placeholders
    that get gradients; ``fixed_bytes`` the per-rank bytes of everything placed by the user;
    ``grad_outputs`` the output indices holding parameter gradients (not activations).
    Ensures: FQN -> layout for every free parameter, the same on every rank (rank 0's), whose
    footprint fits ``budget``; a ShardingError with the smallest footprint otherwise."""
    t0 = time.perf_counter()
    sizes = tuple(ctx.mesh.sizes)
    vals = {n.name: n.meta["val"] for n in gm.graph.nodes if n.name in free}
    cands = {name: [[R] + [S(d) for d, s in enumerate(v.shape) if s % n == 0 and n > 1] for n in sizes]
             for name, v in vals.items()}
    options = {name: [lay for lay in itertools.product(*cands[name]) if _legal(tuple(v.shape), lay, sizes)]
               for name, v in vals.items()}
    cost = {name: [state_bytes(vals[name], lay, sizes, name in trained) for lay in lays]
            for name, lays in options.items()}
    act = _activation_peak(gm, sizes, set(grad_outputs))
    base = fixed_bytes + act
    smallest = base + sum(min(c) for c in cost.values())
    if budget is not None and smallest > budget:
        raise ShardingError(
            f"memory_budget={_fmt(budget)} per rank: no plan fits; the smallest footprint found is {_fmt(smallest)} "
            f"(parameters, gradients and AdamW state with every free parameter split as far as the mesh allows "
            f"{_fmt(smallest - base)}, parameters placed by the plan and buffers {_fmt(fixed_bytes)}, activation "
            f"peak estimate {_fmt(act)}); raise memory_budget, use a larger mesh, split the activations (in_specs) "
            f"or leave fewer parameters placed by hand")
    problem = build_problem(gm, ctx, free=cands, tied=tied)

    def layout(name: str, picks: dict) -> tuple[Pl, ...]:
        return tuple(problem.nodes[name].axes[a][i].outputs[0] for a, i in enumerate(picks[name]))

    def footprint(picks: dict) -> int:
        return base + sum(cost[name][options[name].index(layout(name, picks))] for name in free)

    def extend(m, x) -> None:
        mem_terms = []
        for name, lays in options.items():
            y = [m.var(0.0, True) for _ in lays]
            for a in range(len(sizes)):
                for i, c in enumerate(problem.nodes[name].axes[a]):
                    m.row([(x[name][a][i], -1.0)] + [(y[j], 1.0) for j, lay in enumerate(lays)
                                                     if lay[a] == c.outputs[0]], 0.0, 0.0)
            if budget is not None:
                mem_terms += [(y[j], cost[name][j] / budget) for j in range(len(lays))]
        if budget is not None:
            m.row(mem_terms, 0.0, (budget - base) / budget)

    picks = agree(solve_problem(problem, rounds=ROUNDS, extend=extend, gap=GAP, time_limit=TIME_LIMIT,
                                admissible=lambda p: budget is None or footprint(p) <= budget), ctx.mesh)
    chosen = {name: layout(name, picks) for name in free}
    total = plan_cost(problem, picks)
    entries, replicated = [], []
    for name, lay in chosen.items():
        if all(p == R for p in lay):
            replicated += free[name]
            continue
        flipped = dict(picks)
        flipped[name] = tuple(next(i for i, c in enumerate(axis) if c.outputs[0] == R)
                              for axis in problem.nodes[name].axes)
        saved = cost[name][options[name].index((R,) * len(sizes))] - cost[name][options[name].index(lay)]
        delta = (total - plan_cost(problem, flipped)) * UNIT
        entries += [AutoChoice(fqn, lay, saved, delta) for fqn in free[name]]
    greedy = {name: nv.greedy for name, nv in problem.nodes.items()}
    report = AutoReport(tuple(entries), tuple(replicated), footprint(picks), budget, act, total * UNIT,
                        plan_cost(problem, greedy) * UNIT, time.perf_counter() - t0)
    return {fqn: lay for name, lay in chosen.items() for fqn in free[name]}, report


def complete_plan(traced: Traced, ctx: ShardContext, param_pls: dict[str, tuple[Pl, ...]], wants_grad: list[bool],
                  budget: Optional[int]) -> tuple[dict[str, tuple[Pl, ...]], Optional[AutoReport]]:
    """``param_pls`` (the user's plan, resolved) completed with a layout for every parameter it leaves
    out, and the report (None when nothing was left out). Requires ``ctx`` annotated from
    ``param_pls`` (free parameters replicated); plans the training graph when any placeholder
    ``wants_grad``, else the forward. The traced forward is left as it was."""
    sizes = tuple(ctx.mesh.sizes)
    fwd_ph = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
    free: dict[str, list[str]] = {}
    fixed = 0
    for node, slot, w in zip(fwd_ph, traced.slots, wants_grad):
        if slot.kind not in ("param", "buffer") or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if slot.kind == "param" and not any(n in param_pls for n in slot.names):
            free[node.name] = list(slot.names)
        else:
            fixed += state_bytes(node.meta["val"], ctx.seeds[node], sizes, slot.kind == "param" and w)
    if not free:
        return param_pls, None
    trained = {node.name for node, w in zip(fwd_ph, wants_grad) if w and node.name in free}
    if any(wants_grad):
        joint = trace_joint(traced, traced.gm, wants_grad)
        gm, pctx = joint.gm, joint_context(traced, ctx, joint)
        joint_ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
        rename = {f.name: j.name for f, j in zip(fwd_ph, joint_ph)}
        tied = {len(ctx.out_required) + m: rename[fwd_ph[i].name] for m, i in enumerate(joint.diff_in)
                if fwd_ph[i].name in free}
        grad_outputs = {len(ctx.out_required) + m for m, i in enumerate(joint.diff_in) if traced.slots[i].kind == "param"}
    else:
        gm, tied, grad_outputs = copy.deepcopy(traced.gm), {}, set()
        copy_ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
        rename = {f.name: c.name for f, c in zip(fwd_ph, copy_ph)}
        pctx = ShardContext(mesh=ctx.mesh, label=ctx.label, seeds={c: ctx.seeds[f] for f, c in zip(fwd_ph, copy_ph)
                                                                  if f in ctx.seeds},
                            out_required=list(ctx.out_required), constraints=dict(ctx.constraints))
    propagate(gm, pctx)
    chosen, report = choose_placements(gm, pctx, {rename[k]: v for k, v in free.items()}, tied,
                                       {rename[k] for k in trained}, fixed, budget, grad_outputs)
    return {**param_pls, **chosen}, report


def measure(report: AutoReport, mem: dict[str, int]) -> AutoReport:
    """``report`` with the footprint ``fxshard.memory(sm, "adamw")`` gives for the result (state plus the
    largest program peak); warns when that exceeds the budget (the activation estimate was low)."""
    peak = max(v for k, v in mem.items() if k.endswith("_peak"))
    measured = mem["params"] + mem["buffers"] + mem["grads"] + mem["optimizer"] + peak
    if report.budget is not None and measured > report.budget:
        warnings.warn(f"fxshard auto: the sharded model needs {_fmt(measured)} per rank by fxshard.memory (its "
                      f"activation peak {_fmt(peak)}, estimated {_fmt(report.activation_peak)} when planning), over "
                      f"memory_budget={_fmt(report.budget)}; lower the budget by the difference to leave room, or "
                      f"split the activations (in_specs)", stacklevel=3)
    return dataclasses.replace(report, measured=measured)
