"""Check every strategy of registered rules numerically against the unsharded op, on simulated ranks.

``python -m fxshard.devtools.validate [--all-registered | OP ...] [--ranks 2,3] [-v]``

For each op: sample inputs (``op_samples.py``: ``validate_samples.SAMPLES``, torch's OpInfo samples that bind to the
overload, and calls recorded while running the OpInfos named in ``validate_samples.SOURCES``, for
backward kernels and ops reached through decompositions), one single-node fx graph per sample, and
the rule's strategies as propagation asks for them (current input placements replicated, and strided where a dim allows it), keeping those
propagation would accept (divisibility, uneven splits only for uneven-capable rules). For each
strategy and each simulated rank ``r`` of ``n``: the inputs are cut to rank ``r``'s pieces (a
``torch.chunk`` piece for ``S(d)``, the strided piece for ``S(d, outer)``, the whole tensor for
``R``, a random term for ``P(sum)``/``P(max)``/``P(min)`` that reduces to the tensor), the real
``localize`` pass rewrites the graph for rank ``r`` (local view sizes, masked lookups, global
random draws, means over split dims), and the local graph runs. The ranks' outputs are
reassembled per output placement (concatenated, equal on every rank, or reduced) and compared
with the op on the global inputs. Everything runs in one process: no process group.

Exit status 1 when any strategy computes a wrong result or cannot run (each printed with op,
sample, strategy and error), a rule raises or offers a malformed strategy, or an op has no sample.
"""

from __future__ import annotations

import argparse
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.fx as fx
from ..core.torch_compat import pytree

from ..core.context import ShardContext
from ..core.mesh import MeshInfo
from ..core.placements import Part, Pl, R, S
from ..rules.registry import OpCall, Strategy, lookup, out_shape_of, registered_ops, tensor_inputs
from ..core.ir import META_KEY
from ..core.spec import Spec, chunk
from ..core.symbolic import sym_shape
from ..core.torch_compat import FakeTensorMode
from .op_samples import op_samples, opinfos_by_name, outputs_as_list

aten = torch.ops.aten

__all__ = ["Mismatch", "Report", "check_call", "check_node", "max_error", "validate", "main"]

ATOL, RTOL = 1e-4, 1e-4
UNDEFINED_VALUES = {  # outputs whose values are unspecified: only shape and dtype are compared
    aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.empty_permuted.default,
    aten.new_empty.default,
}


# ----------------------------------------------------------------------------- comparing


def max_error(got: Any, want: Any, rtol: float = RTOL) -> float:
    """Max abs difference beyond ``rtol * |want|``: inf when shapes, dtypes, NaN or inf positions differ
    or integer/bool values differ; ``None`` counts as zeros (an unused gradient)."""
    if want is None or got is None:
        other = got if want is None else want
        return 0.0 if other is None or not other.ne(0).any() else float("inf")
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    if want.is_complex():
        got, want = torch.view_as_real(got.resolve_conj()), torch.view_as_real(want.resolve_conj())
    if not want.is_floating_point():
        return 0.0 if torch.equal(got, want) else float("inf")
    if not torch.equal(got.isnan(), want.isnan()) or not torch.equal(got.isinf(), want.isinf()):
        return float("inf")
    if not torch.equal(got[got.isinf()], want[want.isinf()]):
        return float("inf")
    fin = want.isfinite()
    excess = (got[fin] - want[fin]).abs() - rtol * want[fin].abs()
    return max(0.0, float(excess.max())) if excess.numel() else 0.0


# ----------------------------------------------------------------------------- pieces per placement


def piece(t: torch.Tensor, p: Pl, n: int, r: int, gen: torch.Generator) -> torch.Tensor:
    """Rank ``r``'s local value of ``t`` laid out as ``p`` over ``n`` ranks (Partial terms are random and
    reduce to ``t``; every rank draws the same terms from ``gen`` so the caller can reseed per rank)."""
    if p == R:
        return t
    if isinstance(p, S):  # contiguous, as collectives and local slices hand pieces to ops
        size = t.shape[p.dim]
        if p.outer == 1:
            start, length = chunk(size, n, r)
            return t.narrow(p.dim, start, length).contiguous()
        inner = size // p.outer
        start, length = chunk(inner, n, r)
        parts = t.unflatten(p.dim, (p.outer, inner)).narrow(p.dim + 1, start, length)
        return parts.flatten(p.dim, p.dim + 1).contiguous()
    assert isinstance(p, Part)
    terms = _partial_terms(t, p.op, n, gen)
    return terms[r]


def _partial_terms(t: torch.Tensor, op: str, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if t.dtype == torch.bool:
        fill = torch.zeros_like(t) if op in ("sum", "max") else torch.ones_like(t)
        owner = int(torch.randint(n, (), generator=gen))
        return [t if i == owner else fill for i in range(n)]
    if op == "sum":
        if t.is_floating_point() or t.is_complex():
            rest = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
        else:
            rest = [torch.randint(-3, 4, t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
        return rest + [t - sum(rest)] if rest else [t]
    owner = int(torch.randint(n, (), generator=gen))
    sign = -1 if op == "max" else 1
    res = []
    for i in range(n):
        if i == owner:
            res.append(t)
        elif t.is_floating_point():
            res.append(t + sign * torch.rand(t.shape, generator=gen, dtype=t.dtype))
        else:
            res.append(t + sign * torch.randint(0, 3, t.shape, generator=gen, dtype=t.dtype))
    return res


def assemble(pieces: Sequence[torch.Tensor], p: Pl) -> list[torch.Tensor]:
    """The global values the ranks' ``pieces`` stand for under output placement ``p`` (one per rank for
    ``R``, which every rank must hold whole)."""
    if p == R:
        return list(pieces)
    if isinstance(p, S):
        if p.outer == 1:
            return [torch.cat(list(pieces), p.dim)]
        parts = [x.unflatten(p.dim, (p.outer, x.shape[p.dim] // p.outer)) for x in pieces]
        return [torch.cat(parts, p.dim + 1).flatten(p.dim, p.dim + 1)]
    assert isinstance(p, Part)
    stacked = torch.stack(list(pieces))
    if stacked.dtype == torch.bool:
        return [stacked.any(0) if p.op in ("sum", "max") else stacked.all(0)]
    return [{"sum": stacked.sum, "max": stacked.amax, "min": stacked.amin}[p.op](0)]


# ----------------------------------------------------------------------------- one call, every strategy


@dataclass
class Mismatch:
    op: str
    sample: str
    strategy: str
    ranks: int
    error: str


@dataclass
class Report:
    op: str
    samples: int = 0
    checked: int = 0  # (sample, strategy, n) triples compared
    mismatches: list[Mismatch] = field(default_factory=list)
    note: str = ""


def _describe(args: Any, kwargs: Any) -> str:
    def short(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}"
        return x

    a, k = pytree.tree_map(short, (args, kwargs))
    inner = ", ".join([repr(x) for x in a] + [f"{key}={v!r}" for key, v in k.items()])
    return f"({inner})".replace("'", "")


class _Call:
    """One op applied to concrete arguments, as a single-node graph with fake-tensor metadata."""

    def __init__(self, op: Any, args: tuple, kwargs: dict):
        self.op = op
        flat, self.tree = pytree.tree_flatten((args, kwargs))
        self.flat = flat
        self.tensor_pos = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.fake = {i: mode.from_tensor(flat[i]) for i in self.tensor_pos}
        fargs, fkwargs = pytree.tree_unflatten([self.fake.get(i, x) for i, x in enumerate(flat)], self.tree)
        with mode:
            self.fake_out = op(*fargs, **fkwargs)

    def graph(self) -> tuple[fx.Graph, fx.Node, list[fx.Node]]:
        """A fresh graph ``placeholders -> op -> (getitems) -> output`` with ``meta['val']`` set."""
        g = fx.Graph()
        leaves = list(self.flat)
        phs = []
        for i in self.tensor_pos:
            ph = g.placeholder(f"x{i}")
            ph.meta["val"] = self.fake[i]
            leaves[i] = ph
            phs.append(ph)
        args, kwargs = pytree.tree_unflatten(leaves, self.tree)
        node = g.call_function(self.op, tuple(args), dict(kwargs))
        node.meta["val"] = self.fake_out
        if isinstance(self.fake_out, (tuple, list)):
            items = []
            for j, v in enumerate(self.fake_out):
                it = g.call_function(__import__("operator").getitem, (node, j))
                it.meta["val"] = v
                items.append(it)
            g.output(tuple(items))
        else:
            g.output(node)
        return g, node, phs

    def run(self, tensors: Sequence[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        leaves = list(self.flat)
        for i, t in zip(self.tensor_pos, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.tree)
        return outputs_as_list(self.op(*args, **kwargs))


def _run_graph(g: fx.Graph, inputs: Sequence[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    env: dict[fx.Node, Any] = {}
    it = iter(inputs)
    for node in g.nodes:
        if node.op == "placeholder":
            env[node] = next(it)
        elif node.op == "call_function":
            a, k = fx.node.map_arg((node.args, node.kwargs), lambda x: env[x])
            env[node] = node.target(*a, **k)
        elif node.op == "output":
            return outputs_as_list(fx.node.map_arg(node.args[0], lambda x: env[x]))
    raise AssertionError("graph without output")


def _current_placements(shapes: list[tuple], n: int) -> Iterable[list[Pl]]:
    """The input placements rules are asked with: all replicated, and each input strided on each dim
    that allows it (rules keep a strided split they are given)."""
    yield [R] * len(shapes)
    for i, shape in enumerate(shapes):
        for d, size in enumerate(shape):
            if isinstance(size, int) and size % (2 * n) == 0 and size > 2 * n:
                pls: list[Pl] = [R] * len(shapes)
                pls[i] = S(d, 2)
                yield pls


def malformed(st: Strategy, in_ndims: Sequence[int], out_ndims: Sequence[Optional[int]]) -> str:
    """Why ``st`` does not fit the op's inputs and outputs ('' when it does): a placement per tensor
    input and output, and split dims that exist."""
    outs = st.output if isinstance(st.output, tuple) else (st.output,) * len(out_ndims)
    if len(st.inputs) != len(in_ndims) or len(outs) != len(out_ndims):
        return f"{len(st.inputs)} input / {len(outs)} output placements for {len(in_ndims)} / {len(out_ndims)} tensors"
    for what, pls, ndims in (("input", st.inputs, in_ndims), ("output", outs, out_ndims)):
        for i, (p, nd) in enumerate(zip(pls, ndims)):
            if isinstance(p, S) and nd is not None and p.dim >= nd:
                return f"{what} {i} placement {p!r} names a dim of a {nd}-dim tensor"
    return ""


def strategies_for(node: fx.Node, n: int) -> list[Strategy]:
    """Every distinct strategy the node's rule offers that propagation would accept on an axis of ``n``
    (a malformed one raises: see :func:`malformed`)."""
    from ..rules.registry import allows_uneven, strategy_valid

    rule = lookup(node.target)
    ins = tensor_inputs(node)
    shapes = [sym_shape(x.meta["val"]) for x in ins]
    dtypes = [x.meta["val"].dtype for x in ins]
    out_shape = out_shape_of(node)
    specs = [Spec((R,), s, d) for s, d in zip(shapes, dtypes)]
    seen: dict[Strategy, None] = {}
    multi = isinstance(node.meta["val"], (tuple, list))
    out_ndims = [len(s) if s is not None else None for s in out_shape] if multi else [len(out_shape)]
    for pls in _current_placements(shapes, n):
        call = OpCall(node, shapes, pls, out_shape, dtypes)
        for st in rule(call, n):
            bad = malformed(st, [len(s) for s in shapes], out_ndims)
            if bad:
                raise ValueError(f"malformed strategy {_fmt(st)}: {bad}")
            if st not in seen and strategy_valid(st, [], specs, out_shape, (n,), 1, allows_uneven(node.target)):
                seen[st] = None
    return list(seen)


def _local_run(call: _Call, st: Strategy, n: int, r: int, inputs: list[torch.Tensor], seed: int
               ) -> list[Optional[torch.Tensor]]:
    """Rank ``r``'s outputs: the graph localized for ``r`` (with strategy ``st``) run on its pieces."""
    from ..passes.localize import localize
    from ..core.ir import IN_KEY, STRATEGY_KEY
    from ..rules.registry import strategy_specs

    g, node, phs = call.graph()
    for ph, p in zip(phs, st.inputs):
        v = ph.meta["val"]
        ph.meta[META_KEY] = Spec((p,), sym_shape(v), v.dtype)
    node.meta[STRATEGY_KEY] = (st,)
    node.meta[IN_KEY] = [(p,) for p in st.inputs]
    node.meta[META_KEY] = strategy_specs(node, [st], out_shape_of(node))
    for user in node.users:
        if user.op == "call_function":
            user.meta[META_KEY] = node.meta[META_KEY][user.args[1]]
    ctx = ShardContext(mesh=MeshInfo(("tp",), (n,), (r,), ("validate",), "cpu", r), label="validate")
    localize(_GraphOnly(g), ctx)
    gen = torch.Generator().manual_seed(seed)
    local = [piece(t, p, n, r, gen) for t, p in zip(inputs, st.inputs)]
    if _is_random(call.op):
        torch.manual_seed(seed)  # every rank draws what the global op draws
    return _run_graph(g, local)


class _GraphOnly:
    """What a pass needs of a GraphModule here (its graph; the local graph is interpreted, not compiled)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph

    def recompile(self) -> None:
        pass


def _is_random(op: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


def check_call(op: Any, args: tuple, kwargs: Optional[dict] = None, ranks: Sequence[int] = (2,),
               label: str = "", skip_lowered: bool = False) -> tuple[int, list[Mismatch]]:
    """Check every strategy of ``op``'s rule on ``op(*args, **kwargs)`` over ``ranks`` simulated ranks.

    Requires a registered ``op`` and concrete tensors in ``args``/``kwargs``. Returns the number of
    (strategy, rank count) pairs compared and the mismatches found.
    """
    call = _Call(op, tuple(args), dict(kwargs or {}))
    inputs = [call.flat[i] for i in call.tensor_pos]
    seed = zlib.crc32(f"{op}{label}".encode())
    if _is_random(op):
        torch.manual_seed(seed)
    want = call.run(inputs)
    label = label or _describe(args, kwargs or {})
    checked, bad = 0, []
    for n in ranks:
        _, node, _ = call.graph()
        try:
            offered = strategies_for(node, n)
        except Exception as e:  # noqa: BLE001 - a rule that raises or offers nonsense is a mismatch
            bad.append(Mismatch(str(op), label, "(rule)", n, f"{type(e).__name__}: {e}"[:300]))
            continue
        for st in offered:
            if skip_lowered and st.lowering:
                continue
            checked += 1
            try:
                per_rank = [_local_run(call, st, n, r, inputs, seed) for r in range(n)]
                err = _compare(per_rank, want, st, op)
            except Exception as e:  # noqa: BLE001 - a strategy that cannot even run is a mismatch too
                err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:200]
            if err:
                bad.append(Mismatch(str(op), label, _fmt(st), n, err))
    return checked, bad


def check_node(node: fx.Node, tensors: Sequence[torch.Tensor], ranks: Sequence[int] = (2,)
               ) -> tuple[int, list[Mismatch]]:
    """:func:`check_call` for a traced node, with ``tensors`` standing for its tensor inputs in order."""
    it = iter(tensors)
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: next(it))
    return check_call(node.target, tuple(args), dict(kwargs), ranks)


def _fmt(st: Strategy) -> str:
    ins = ", ".join(map(repr, st.inputs))
    low = f" [{st.lowering}]" if st.lowering else ""
    return f"({ins}) -> {st.output!r}{low}"


def _compare(per_rank: list[list], want: list, st: Strategy, op: Any) -> str:
    outs = st.output if isinstance(st.output, tuple) else (st.output,) * len(want)
    for j, (w, p) in enumerate(zip(want, outs)):
        if p is None or w is None:
            continue
        got = assemble([pr[j] for pr in per_rank], p)
        for r, x in enumerate(got):
            if op in UNDEFINED_VALUES:
                e = 0.0 if (x.shape, x.dtype) == (w.shape, w.dtype) else float("inf")
            else:
                e = max_error(x, w)
            if e > ATOL:
                where = f"rank {r} " if p == R else ""
                return f"output {j} ({p!r}) {where}off by {e:.3g}"
    return ""


# ----------------------------------------------------------------------------- driver


def validate(ops: Iterable[Any], ranks: Sequence[int] = (2,), per_op: int = 3) -> list[Report]:
    """One Report per op (see module doc); an op without samples is reported with a note."""
    infos = opinfos_by_name()
    reports = []
    for op in ops:
        rep = Report(str(op))
        if lookup(op) is None:
            rep.note = "no rule registered"
            reports.append(rep)
            continue
        samples = op_samples(op, per_op, infos)
        rep.samples = len(samples)
        if not samples:
            rep.note = "no sample: add one to fxshard/devtools/validate_samples.py"
        for args, kwargs in samples:
            checked, bad = check_call(op, args, kwargs, ranks)
            rep.checked += checked
            rep.mismatches.extend(bad)
        reports.append(rep)
    return reports


def _resolve(name: str) -> Any:
    """``aten.add.Tensor``, ``add.Tensor`` or ``add`` (the default overload) -> OpOverload; another namespace
    is named first (``fxshard.attention``)."""
    from ..core.errors import ShardingError

    parts = name.split(".")
    space = aten
    if parts[0] != "aten" and len(parts) > 1 and parts[0] in ("fxshard",):
        space = getattr(torch.ops, parts[0])
        parts = parts[1:]
    elif parts[0] == "aten":
        parts = parts[1:]
    base, ov = parts[0], (parts[1] if len(parts) > 1 else "default")
    try:
        return getattr(getattr(space, base), ov)
    except AttributeError:
        raise ShardingError(f"validate: {name!r} is not an ATen op overload; write e.g. aten.add.Tensor") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fxshard.devtools.validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("ops", nargs="*", help="op overloads, e.g. aten.add.Tensor (default overload if omitted)")
    ap.add_argument("--all-registered", action="store_true", help="every op that has a rule")
    ap.add_argument("--ranks", default="2,3", help="simulated mesh axis sizes, comma-separated (default 2,3)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per op")
    a = ap.parse_args(argv)
    from .. import rules  # noqa: F401  (registers every rule)

    if not a.all_registered and not a.ops:
        ap.error("name ops or pass --all-registered")
    ops = sorted(registered_ops(), key=str) if a.all_registered else [_resolve(o) for o in a.ops]
    reports = validate(ops, [int(x) for x in a.ranks.split(",")])
    bad = [m for rep in reports for m in rep.mismatches]
    for rep in reports:
        if a.verbose or rep.note:
            print(f"{rep.op:60s} samples {rep.samples}  checked {rep.checked:4d}  wrong {len(rep.mismatches)}"
                  f"{'  ' + rep.note if rep.note else ''}")
    for m in bad:
        print(f"WRONG {m.op} {m.sample} n={m.ranks}: {m.strategy}: {m.error}")
    checked = sum(r.checked for r in reports)
    print(f"{len(reports)} ops, {checked} strategy checks, {len(bad)} wrong, "
          f"{sum(1 for r in reports if r.note)} without samples")
    return 1 if bad or any(r.note for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
