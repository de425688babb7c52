"""Conformance sweep over torch's OpInfo database: every op, sharded on 2 real ranks, against eager.

For every ``op_db`` entry with a float32 CPU form whose samples hold dense tensors, up to
``N_SAMPLES`` samples are picked, and each runs under three layouts of its tensor inputs: split on
dim 0, split on the last dim (a size of 5 is cut 3 + 2, a size of 10 5 + 5), and all replicated
(``LAYOUTS``). Each (sample, layout) is an *instance*: the op applied to its own copies of the
sample's tensors. The instances of several ops form one ``nn.Module`` (inputs: every instance's
tensors; tensors the op updates in place, such as batch-norm running statistics, are its buffers),
sharded once with ``fxshard.shard(..., in_specs=...)`` on a 2-rank gloo mesh and run on each rank's
local pieces. Forward outputs (replicated), input gradients (this rank's pieces of the
single-device gradients, for a fixed random cotangent) and updated buffers are compared with the
module run unsharded.

Per op, one class: ``pass``; ``fallback`` (correct, but an op without a rule ran replicated: which
ops is in the table); ``xfail`` (``XFAIL``: the op raises a ShardingError whose message matches);
``skip`` (``SKIP`` and the automatic reasons: no float32 form, random, no dense tensor sample);
``wrong`` and ``error`` (any exception that is not a ShardingError) fail the test, as does an
unexpected ShardingError or an ``XFAIL`` entry that now passes. The failing rows (op, sample, layout, error) are in the
assertion message and the whole table is printed, with a summary line.

Which op of a batch fails: an exception reruns each op alone (then each instance alone); a wrong
result reruns that op alone, and an op right alone but wrong in the batch is reported as corrupted
by another op (the joint graph's CSE shares a constant that op updates in place).
Fallbacks are attributed per instance by graph connectivity (``_fallbacks``). A rank that raises
alone would leave the other waiting in a collective, so the sweep's mesh lives on its own process
group with a short timeout, rebuilt after any failure; ranks agree on outcomes over the default group.

By hand: ``python -m tests.test_opinfo [OP ...]`` prints every row.
"""

from __future__ import annotations

import re
import sys
import time
import traceback
import warnings
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxshard.devtools.op_samples import pick_samples
from fxshard.devtools.validate import max_error

N_SAMPLES = 2  # of up to 3 allowed: each instance costs ~0.1 s of tracing and sharding per rank
LAYOUTS = ("S(0)", "S(-1)", "R")
ATOL = 1e-4  # on top of a relative 1e-4: a missing all-reduce or a wrong piece is off by O(1)
BATCH = 24  # ops per shard() call: tracing has a fixed cost of ~1 s per call
GROUP_TIMEOUT_S = 30  # a rank that fails alone leaves its peer in a collective for this long
MIN_OPS_WITH_GRADS = 300


def op_name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


# ----------------------------------------------------------------------------- the tables


@dataclass(frozen=True)
class XFail:
    """A known gap: why, and the ShardingError message (regex) the op must raise."""

    reason: str
    raises: str


_UNTRACEABLE = r"could not trace .*(DataDependent|GuardOnDataDependent|DynamicOutputShape|PendingUnbacked)"
_TOKEN = r"the forward calls aten._linalg_check_errors.*effect token"
_GROUPS = r"this view reshapes dim 0 \(size 25, split over a mesh axis of 2 ranks\) into \[5, 5\]"

XFAIL: dict[str, XFail] = {
    "allclose": XFail("returns a Python bool computed from the values: torch.export cannot trace it", _UNTRACEABLE),
    "equal": XFail("returns a Python bool computed from the values: torch.export cannot trace it", _UNTRACEABLE),
    "corrcoef": XFail("torch's implementation calls torch.equal (a Python bool from the values)", _UNTRACEABLE),
    "cov": XFail("torch's implementation calls torch.equal (a Python bool from the values)", _UNTRACEABLE),
    "narrow": XFail("a sample passes the start as a tensor: a data-dependent slice", _UNTRACEABLE),
    "take": XFail("index bounds are checked on the values: data-dependent", _UNTRACEABLE),
    "nn.functional.gaussian_nll_loss": XFail("checks var's values to pick a broadcast: data-dependent",
                                             _UNTRACEABLE),
    "nn.functional.ctc_loss": XFail("output size depends on the targets: data-dependent", _UNTRACEABLE),
    "linalg.lstsq": XFail("output size depends on the values (rank): data-dependent", _UNTRACEABLE),
    "linalg.lstsq.grad_oriented": XFail("output size depends on the values (rank): data-dependent", _UNTRACEABLE),
    **{n: XFail("by design: 25 elements split 13 + 12 reshaped to [5, 5] would cut a row between ranks; "
                "fxshard raises instead of silently gathering (README: head counts)", _GROUPS)
       for n in ("reshape", "reshape_as", "view", "view_as")},
    **{n: XFail("torch orders linalg error checks by an effect token, which fxshard's programs do not thread",
                _TOKEN)
       for n in ("linalg.cholesky", "linalg.ldl_factor", "linalg.lu_factor", "linalg.inv", "linalg.solve",
                 "linalg.tensorinv", "linalg.tensorsolve")},
    "linalg.eig": XFail("its backward solves a linear system whose error check torch orders by an effect token; "
                        "the training graph does not thread tokens", r"_linalg_check_errors.*effect token"),
    "tensor_split": XFail("a sample passes the split points as a tensor: data-dependent sizes", _UNTRACEABLE),
    "_native_batch_norm_legit": XFail("with training=False torch.export still reports the running statistics "
                                      "as updated in place, and inputs updated in place are rejected",
                                      r"forward mutates 'tensors_\d+' \(USER_INPUT_MUTATION\)"),
}

SKIP: dict[str, str] = {
    **{n: "CUDA-only (jiterator): no CPU kernel" for n in (
        "jiterator_unary", "jiterator_binary", "jiterator_4inputs_with_extra_args",
        "jiterator_binary_return_by_ref", "jiterator_2inputs_2outputs")},
    **{n: "in-place variant" for n in ("resize_", "resize_as_", "zero_")},
}

UNDEFINED_VALUES = {"empty_like", "new_empty", "new_empty_strided"}  # only shapes and dtypes compare


# ----------------------------------------------------------------------------- cases


def _leaves(sample: Any) -> tuple[list, Any]:
    return pytree.tree_flatten((sample.input, sample.args, sample.kwargs))


def _call(fn: Any, sample: Any, leaves: list) -> Any:
    _, spec = _leaves(sample)
    inp, args, kwargs = pytree.tree_unflatten(leaves, spec)
    return sample.output_process_fn_grad(fn(inp, *args, **kwargs))


def _out_tensors(out: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]


def _clone_leaves(leaves: list) -> list:
    return [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in leaves]


@dataclass
class Instance:
    """One (sample, layout) of one op: which leaves are inputs (split how) and which are buffers."""

    op: str
    fn: Any
    sample: Any
    index: int  # sample number
    layout: str
    tensor_pos: list[int]  # leaf positions of tensors fed as inputs
    buffer_pos: list[int]  # leaf positions of tensors the op updates in place (module buffers)
    dims: list[Optional[int]]  # split dim per input tensor (None: replicated)
    uneven: bool


@dataclass
class Case:
    op: str
    instances: list[Instance] = field(default_factory=list)
    skip: str = ""


def _split_dim(t: torch.Tensor, layout: str) -> Optional[int]:
    if layout == "R" or t.dim() == 0:
        return None
    d = 0 if layout == "S(0)" else t.dim() - 1
    return d if t.shape[d] >= 2 else None


class _SeededOps(TorchDispatchMode):
    """Records whether any dispatched op draws from a generator (OpInfo's random ops reseed inside
    their own wrapper, so running them twice with other seeds does not tell)."""

    random = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.random |= torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


def _is_random(fn: Any, sample: Any) -> bool:
    with torch.no_grad(), _SeededOps() as mode:
        _call(fn, sample, _clone_leaves(_leaves(sample)[0]))
    return mode.random


def _mutated(fn: Any, sample: Any) -> list[int]:
    """Leaf positions of the tensors the op updates in place (by value: batch norm's running statistics
    change without a version bump)."""
    leaves = _clone_leaves(_leaves(sample)[0])
    before = {i: x.detach().clone() for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
    with torch.no_grad():
        _call(fn, sample, leaves)
    return [i for i, x in before.items() if max_error(leaves[i].detach(), x) > 0]


def make_case(info: Any) -> Case:
    """The instances of one op (or why it is skipped)."""
    from torch.testing._internal.common_utils import set_rng_seed

    name = op_name(info)
    case = Case(name)
    if name in SKIP:
        case.skip = SKIP[name]
        return case
    if torch.float32 not in info.supported_dtypes("cpu"):
        case.skip = "no float32 form on CPU"
        return case
    set_rng_seed(zlib.crc32(name.encode()))  # torch, Python and numpy: samples draw from all three
    dropped: set[str] = set()

    def usable(s: Any) -> bool:
        """Whether the sample runs on copies of its tensors and draws no random numbers."""
        try:
            why = "random" if _is_random(info.op, s) else ""
        except Exception:  # noqa: BLE001 - e.g. as_strided views that need the sample's own storage
            why = "raises"
        if why:
            dropped.add(why)
        return not why

    samples = pick_samples(info.sample_inputs("cpu", torch.float32, requires_grad=info.supports_autograd,
                                             set_seed=False), N_SAMPLES,
                           accept=usable)
    if not samples:
        case.skip = ("random: its values depend on the generator (dropout parity: test_dropout.py)"
                     if "random" in dropped else "no sample with dense, non-empty tensors that runs on copies"
                     if dropped else "no sample with dense, non-empty tensors")
        return case
    for i, s in enumerate(samples):
        leaves, _ = _leaves(s)
        buffers = _mutated(info.op, s)
        pos = [j for j, x in enumerate(leaves) if isinstance(x, torch.Tensor) and j not in buffers]
        seen = set()
        for layout in LAYOUTS:
            dims = [_split_dim(leaves[j], layout) for j in pos]
            if tuple(dims) in seen:
                continue  # nothing (new) to split: the same instance as an earlier layout
            seen.add(tuple(dims))
            uneven = any(d is not None and leaves[j].shape[d] % 2 for j, d in zip(pos, dims))
            case.instances.append(Instance(name, info.op, s, i, layout, pos, buffers, dims, uneven))
    return case


# ----------------------------------------------------------------------------- the module under test


class Instances(nn.Module):
    """Every instance's op on its own tensors; inputs: the instances' input tensors, flattened."""

    def __init__(self, insts: list[Instance]):
        super().__init__()
        self.insts = insts
        for k, inst in enumerate(insts):
            leaves, _ = _leaves(inst.sample)
            for j in inst.buffer_pos:
                self.register_buffer(f"b{k}_{j}", leaves[j].detach().clone())

    def forward(self, *tensors: torch.Tensor) -> tuple:
        outs: list[torch.Tensor] = []
        it = iter(tensors)
        for k, inst in enumerate(self.insts):
            leaves = list(_leaves(inst.sample)[0])
            for j in inst.tensor_pos:
                leaves[j] = next(it)
            for j in inst.buffer_pos:
                leaves[j] = getattr(self, f"b{k}_{j}")
            outs.extend(_out_tensors(_call(inst.fn, inst.sample, leaves)))
        return tuple(outs)


def _inputs(insts: list[Instance]) -> tuple[list[torch.Tensor], list[Optional[int]], list[int]]:
    """Fresh copies of every instance's input tensors, their split dims, and the instance of each."""
    flat, dims, owner = [], [], []
    for k, inst in enumerate(insts):
        leaves, _ = _leaves(inst.sample)
        for j, d in zip(inst.tensor_pos, inst.dims):
            flat.append(leaves[j].detach().clone().requires_grad_(leaves[j].requires_grad))
            dims.append(d)
            owner.append(k)
    return flat, dims, owner


def _piece(t: Optional[torch.Tensor], d: Optional[int], rank: int, world: int) -> Optional[torch.Tensor]:
    return t if t is None or d is None else t.chunk(world, d)[rank]


def _spec(d: Optional[int]) -> Any:
    from fxshard import P

    return None if d is None else P(*([None] * d + ["tp"]))


def _run(model: nn.Module, flat: list[torch.Tensor], seed: int) -> tuple[list, list]:
    """Outputs and input gradients for the cotangent drawn from ``seed`` (one per float output)."""
    outs = list(model(*flat))
    gen = torch.Generator().manual_seed(seed)
    terms = []
    for o in outs:
        if o.is_floating_point():
            cot = torch.randn(o.shape, generator=gen, dtype=o.dtype)
            if o.requires_grad:
                terms.append((o * cot).sum())
    grads: list = [None] * len(flat)
    want = [i for i, t in enumerate(flat) if t.requires_grad]
    if terms and want:
        for i, g in zip(want, torch.autograd.grad(sum(terms), [flat[i] for i in want], allow_unused=True)):
            grads[i] = g
    return [o.detach() for o in outs], grads


def _out_owner(insts: list[Instance]) -> list[int]:
    """The instance of each output, from an eager run of each instance alone."""
    owner = []
    for k, inst in enumerate(insts):
        with torch.no_grad():
            owner += [k] * len(Instances([inst])(*_inputs([inst])[0]))
    return owner


def _fallbacks(sm: Any, insts: list[Instance], in_owner: list[int], out_owner: list[int]) -> dict[int, set[str]]:
    """Which instances each fallback node (an op without a rule) belongs to.

    Instances are disconnected in the sharded programs except through shared constants (CSE), so
    each connected component, ignoring edges out of nodes computed from constants alone, is one
    instance's: found from its placeholders (inputs, buffers), saved values (the forward's
    components) and tangents.
    """
    from fxshard.planner.propagate import FALLBACK_KEY

    res: dict[int, set[str]] = defaultdict(set)
    tr = sm._training
    programs = [tr.fwd.gm, tr.bwd.gm] if tr is not None else [sm._fwd.gm]
    slots = sm._traced.slots
    buf_owner = {}
    for k, inst in enumerate(insts):
        for j in inst.buffer_pos:
            buf_owner[f"b{k}_{j}"] = k
    all_out = [buf_owner[b] for b in sm._traced.mutations] + out_owner
    fwd_tag: dict[str, int] = {}
    for p, gm in enumerate(programs):
        parent: dict[Any, Any] = {}

        def find(x: Any) -> Any:
            while parent.setdefault(x, x) is not x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        nodes = list(gm.graph.nodes)
        const: set[Any] = set()  # computed from no input at all (CSE shares these between instances)
        for n in nodes:
            if n.op == "call_function" and all(a in const for a in n.all_input_nodes):
                const.add(n)
            for a in n.all_input_nodes if n.op != "output" else ():
                if a not in const:
                    parent[find(n)] = find(a)
        tag: dict[Any, int] = {}
        phs = [n for n in nodes if n.op == "placeholder"]
        if p == 0:
            for n, slot in zip(phs, slots):
                if slot.kind == "input":
                    tag[find(n)] = in_owner[slot.index]
                elif slot.kind == "buffer":
                    tag[find(n)] = buf_owner[slot.names[0]]
        else:
            tangents = iter(tr.diff_out)
            for n in phs:
                if n.name.startswith("saved_") and n.name[6:] in fwd_tag:
                    tag[find(n)] = fwd_tag[n.name[6:]]
                elif n.name.startswith("tangents"):
                    tag[find(n)] = all_out[next(tangents)]
        for n in nodes:
            k = tag.get(find(n))
            if p == 0 and k is not None:
                fwd_tag[n.name] = k
            if n.op == "call_function" and n.meta.get(FALLBACK_KEY):
                name = str(n.target).replace("aten.", "")
                for kk in ([k] if k is not None else range(len(insts))):
                    res[kk].add(name)
    return res


@dataclass
class Row:
    """The result of one instance (or of a whole op when it is skipped)."""

    op: str
    sample: int
    layout: str
    status: str  # pass | fallback | wrong | error | sharding_error | skip
    err: float = 0.0
    detail: str = ""
    grads: bool = False
    uneven: bool = False


def run_instances(insts: list[Instance], mesh: Any, rank: int, world: int) -> list[Row]:
    """Shard the instances as one module, run both, compare; one Row per instance."""
    import fxshard

    seed = zlib.crc32("".join(f"{i.op}{i.index}{i.layout}" for i in insts).encode())
    ref_model, model = Instances(insts), Instances(insts)
    flat, dims, in_owner = _inputs(insts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the default (global) planner: it offers rules layouts the greedy sweep never asks for (this sweep
        # found the solver taking a cat's packed split of uneven pieces, a rank-dependent piece size)
        sm = fxshard.shard(model, mesh, example_inputs=tuple(_inputs(insts)[0]), in_specs=tuple(map(_spec, dims)))
    out_owner = _out_owner(insts)
    ref_out, ref_grad = _run(ref_model, flat, seed)
    local = [x.detach().clone().requires_grad_(x.requires_grad) for x in
             (_piece(t, d, rank, world) for t, d in zip(flat, dims))]
    out, grad = _run(sm, local, seed)
    fallbacks = _fallbacks(sm, insts, in_owner, out_owner)
    rows = []
    for k, inst in enumerate(insts):
        if inst.op in UNDEFINED_VALUES:
            ferr = max([0.0 if (o.shape, o.dtype) == (r.shape, r.dtype) else float("inf")
                        for o, r, w in zip(out, ref_out, out_owner) if w == k], default=0.0)
        else:
            ferr = max([max_error(o, r) for o, r, w in zip(out, ref_out, out_owner) if w == k], default=0.0)
        gerr = max([max_error(g, _piece(r, d, rank, world))
                    for g, r, d, w in zip(grad, ref_grad, dims, in_owner) if w == k], default=0.0)
        berr = max([max_error(dict(sm.named_buffers())[f"b{k}_{j}"], getattr(ref_model, f"b{k}_{j}"))
                    for j in inst.buffer_pos], default=0.0)
        has_grads = any(r is not None for r, w in zip(ref_grad, in_owner) if w == k)
        err = max(ferr, gerr, berr)
        fb = ",".join(sorted(fallbacks.get(k, ())))
        if err > ATOL:
            status, detail = "wrong", f"fwd {ferr:.2g} grad {gerr:.2g}" + (f" buffers {berr:.2g}" if inst.buffer_pos else "")
        else:
            status, detail = ("fallback", fb) if fb else ("pass", "")
        rows.append(Row(inst.op, inst.index, inst.layout, status, err, detail, has_grads, inst.uneven))
    return rows


def _error_row(inst: Instance, e: BaseException) -> Row:
    from fxshard import ShardingError

    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, ShardingError):
        return Row(inst.op, inst.index, inst.layout, "sharding_error", float("inf"), first, uneven=inst.uneven)
    frames = traceback.extract_tb(e.__traceback__)
    where = next((f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(frames) if "fxshard" in f.filename), "")
    return Row(inst.op, inst.index, inst.layout, "error", float("inf"), f"{type(e).__name__}: {first[:200]} [{where}]",
               uneven=inst.uneven)


# ----------------------------------------------------------------------------- running on the ranks


class _Mesh:
    """The sweep's mesh on its own process group (short timeout), rebuilt after a one-sided failure."""

    def __init__(self, world: int):
        self.world = world
        self.rebuild()

    def rebuild(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        group = dist.new_group(list(range(self.world)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        self.mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))


def _all_ok(ok: bool) -> bool:
    """Whether every rank reports ``ok`` (on the default group, which failures do not wedge)."""
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return all(flags)


def _union(ops: set[str]) -> list[str]:
    """The union of every rank's ``ops``, in one order on every rank."""
    sets: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sets, ops)
    return sorted(set().union(*sets))


def _attempt(insts: list[Instance], m: _Mesh, rank: int, world: int, bisect: bool = True) -> Optional[list[Row]]:
    """Rows, or None (on every rank) when any rank raised and ``bisect`` asks the caller to narrow it
    down; otherwise every instance gets this rank's exception as its row. The group is rebuilt after a
    failure (a rank that raised alone leaves the others in a collective)."""
    try:
        rows: Optional[list[Row]] = run_instances(insts, m.mesh, rank, world)
        err: Optional[BaseException] = None
    except Exception as e:  # noqa: BLE001 - classified by the caller or below
        rows, err = None, e
    if _all_ok(rows is not None):
        return rows
    m.rebuild()
    if bisect and len(insts) > 1:
        return None
    return [_error_row(i, err) if err is not None else
            Row(i.op, i.index, i.layout, "error", float("inf"), "another rank raised") for i in insts]


def run_batch(cases: list[Case], m: _Mesh, rank: int, world: int, contaminated: list[str]) -> list[Row]:
    """All instances of ``cases`` at once. On an exception, each op alone, then (for ops not expected to
    fail) each instance alone. An op wrong in a batch of several is run again alone: if it is right
    then, another op of the batch corrupted it (``contaminated``: the joint graph's CSE shares a node
    that op then updates in place) and the alone rows count."""
    insts = [i for c in cases for i in c.instances]
    rows = _attempt(insts, m, rank, world) if len(cases) > 1 else None
    if rows is not None:
        wrong = _union({r.op for r in rows if r.status == "wrong"})  # every rank reruns the same ops
        if not wrong:
            return rows
        again = {c.op: _attempt(c.instances, m, rank, world, bisect=False) for c in cases if c.op in wrong}
        for op, alone in again.items():
            if _all_ok(all(r.status != "wrong" for r in alone)):
                contaminated.append(f"{op} (batched with {', '.join(c.op for c in cases if c.op != op)})")
        return [r for r in rows if r.op not in again] + [r for alone in again.values() for r in alone]
    rows = []
    for c in cases:
        expected = c.op in XFAIL
        got = _attempt(c.instances, m, rank, world, bisect=not expected)
        rows += got if got is not None else [r for i in c.instances for r in _attempt([i], m, rank, world)]
    return rows


def sweep_rank(rank: int, world: int, names: Optional[list[str]] = None, verbose: bool = False) -> list[Row]:
    from torch.testing._internal.common_methods_invocations import op_db

    warnings.simplefilter("ignore")  # deprecations and fallback warnings: the rows record what matters
    t0 = time.perf_counter()
    cases = [make_case(info) for info in op_db if names is None or op_name(info) in names]
    if rank == 0 and verbose:
        print(f"samples: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    rows = [Row(c.op, -1, "-", "skip", detail=c.skip) for c in cases if c.skip]
    todo = [c for c in cases if not c.skip]
    alone = [c for c in todo if c.op in XFAIL]  # expected to raise: never sink a batch
    rest = [c for c in todo if c not in alone]
    batches = [[c] for c in alone] + [rest[i:i + BATCH] for i in range(0, len(rest), BATCH)]
    m = _Mesh(world)
    contaminated: list[str] = []
    for k, b in enumerate(batches):
        if rank == 0:  # pytest shows this only when the test fails: which batch a crashed rank was in
            print(f"batch {k + 1}/{len(batches)}: {' '.join(c.op for c in b)}", file=sys.stderr, flush=True)
        t1 = time.perf_counter()
        rows += run_batch(b, m, rank, world, contaminated)
        if rank == 0 and verbose:
            print(f"  {time.perf_counter() - t1:5.1f}s", file=sys.stderr, flush=True)
    return rows + [Row(op, -1, "-", "contaminated", detail=op) for op in contaminated]


# ----------------------------------------------------------------------------- verdicts


_ORDER = {"pass": 0, "skip": 0, "contaminated": 0, "fallback": 1, "sharding_error": 2, "wrong": 3, "error": 4}


def merge(per_rank: list[list[Row]]) -> list[Row]:
    """One row per instance: the worst rank's."""
    return [max(rows, key=lambda r: (_ORDER[r.status], r.err)) for rows in zip(*per_rank)]


@dataclass
class Verdict:
    """Per-op classes, the problems that fail the test, and what the summary reports."""

    cls: dict[str, str]
    problems: list[str]
    graded: set[str]  # ops passing (or falling back correctly) with input gradients compared
    contaminated: list[str]


def verdicts(rows: list[Row]) -> Verdict:
    by_op: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        if r.status != "contaminated":
            by_op[r.op].append(r)
    cls, problems = {}, []
    for op, rs in by_op.items():
        worst = max(rs, key=lambda r: _ORDER[r.status]).status
        if worst == "skip":
            cls[op] = "skip"
        elif op in XFAIL:
            cls[op] = "xfail"
            if worst in ("pass", "fallback"):
                problems.append(f"{op}: listed in XFAIL but passes now: remove the entry")
            for r in rs:
                if r.status in ("wrong", "error") or (
                        r.status == "sharding_error" and not re.search(XFAIL[op].raises, r.detail)):
                    problems.append(f"{op} sample {r.sample} {r.layout}: {r.status} ({r.detail}), but XFAIL "
                                    f"expects a ShardingError matching {XFAIL[op].raises!r}")
        else:
            cls[op] = worst
            problems += [f"{op} sample {r.sample} {r.layout}: {r.status}: max abs error {r.err:.3g} {r.detail}"
                         for r in rs if r.status in ("wrong", "error", "sharding_error")]
    problems += [f"{op}: in XFAIL but not an op_db entry that ran" for op in XFAIL if op not in by_op]
    graded = {r.op for r in rows if r.grads and cls.get(r.op) in ("pass", "fallback")}
    return Verdict(cls, problems, graded, [r.detail for r in rows if r.status == "contaminated"])


def table(rows: list[Row]) -> str:
    lines = [f"{'op':44s} {'s':>2s} {'layout':6s} {'status':14s} {'err':>8s}  detail"]
    for r in rows:
        lines.append(f"{r.op:44s} {r.sample:2d} {r.layout:6s} {r.status:14s} {r.err:8.2g}  {r.detail}")
    return "\n".join(lines)


def summary(rows: list[Row], v: Verdict, seconds: float) -> str:
    count: dict[str, int] = defaultdict(int)
    for c in v.cls.values():
        count[c] += 1
    ran = [r for r in rows if r.status not in ("skip", "contaminated")]
    line = (f"opinfo sweep: {len(v.cls) - count['skip']} ops covered ({len(v.graded)} with gradients compared): "
            f"pass {count['pass']} / fallback {count['fallback']} / xfail {count['xfail']} / "
            f"wrong {count['wrong']} / error {count['error']} / unexpected ShardingError "
            f"{count['sharding_error']}; skipped {count['skip']}; {len(ran)} instances "
            f"({sum(r.uneven for r in ran)} with uneven splits); {seconds:.0f}s")
    if v.contaminated:
        line += ("\nwrong only when batched with another op (joint-graph CSE shares a node an op updates in "
                 "place; right alone): " + "; ".join(v.contaminated))
    return line


def test_opinfo_sweep():
    from tests.dist_utils import run_ranks

    t0 = time.perf_counter()
    rows = merge(run_ranks(sweep_rank, 2, timeout=1500))
    v = verdicts(rows)
    line = summary(rows, v, time.perf_counter() - t0)
    print(table(rows))
    print(line)
    assert not v.problems, line + "\n" + "\n".join(v.problems)
    assert len(v.graded) >= MIN_OPS_WITH_GRADS, line
    assert len(XFAIL) < 40


def main(argv: list[str]) -> None:
    from tests.dist_utils import run_ranks
    from tests.test_opinfo import sweep_rank as fn  # by reference, not as __main__

    t0 = time.perf_counter()
    rows = merge(run_ranks(fn, 2, argv or None, True, timeout=3000))
    v = verdicts(rows)
    print(table(rows))
    print("\n".join(v.problems))
    print(summary(rows, v, time.perf_counter() - t0))


if __name__ == "__main__":
    main(sys.argv[1:])
