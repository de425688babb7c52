"""The passes on the fake process group: propagate, redistribute, localize, and the whole pipeline.

Everything here plans for N ranks inside one process (``conftest.fake_world``):
no real communication, so these tests check graphs, specs, local shapes and
collective counts, not numbers (``test_forward_parity.py`` does numbers).
Models are frozen (``requires_grad_(False)``) so ``shard`` builds the inference
program only.

``check_invariants`` runs the verifier (``fxshard/passes/verify.py``); every test that
produces a graph runs it, after each pass where the test drives the passes.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel, Shard
from fxshard.comm.collectives import COMM_KEY, INSERTED_KEY
from fxshard.core.context import ShardContext
from fxshard.core.mesh import MeshInfo
from fxshard.tracing.annotate import annotate
from fxshard.passes.localize import localize
from fxshard.planner.propagate import FALLBACK_KEY, IN_KEY, STRATEGY_KEY, propagate
from fxshard.passes.redistribute import redistribute
from fxshard.tracing.export import trace_forward
from fxshard.passes.verify import verify
from fxshard.passes.pipeline import DEFAULT
from fxshard.core.placements import Part, R, S
from fxshard.plans.plan import resolve_plan, to_placements
from fxshard.core.ir import META_KEY
from fxshard.core.spec import Spec
from tests import models
from tests.test_forward_parity import transformer_plan
from tests.conftest import fake_world

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
PS = Part("sum")
GOLDEN = Path(__file__).parent / "golden"
TOY_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}




def toy() -> nn.Module:
    return models.ToyModel(16, 32).requires_grad_(False)


def toy_x() -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(0))


def transformer(n_layers: int = 1, **kw: Any) -> nn.Module:
    cfg = dict(vocab=64, dim=32, n_heads=4, n_layers=n_layers, max_seq=16)
    cfg.update(kw)
    return models.Transformer(**cfg).requires_grad_(False)


# ----------------------------------------------------------------------------- verifier


def check_invariants(gm: fx.GraphModule, stage: str, ctx: ShardContext) -> None:
    """The verifier (``fxshard/passes/verify.py``) with the facts in force after pass ``stage``."""
    verify(gm, ctx, DEFAULT.facts_after(stage), stage)


def prepare(model: nn.Module, mesh, plan: Optional[dict], inputs: tuple, in_specs: Any = None,
            out_spec: Any = None) -> tuple[fx.GraphModule, ShardContext]:
    """Trace and annotate like ``fxshard.shard`` does; the caller runs the passes."""
    info = MeshInfo.of(mesh)
    pls = resolve_plan(plan, model, info)
    traced = trace_forward(model, inputs, {})
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(out.args[0])
    req = [to_placements(out_spec, info, leaf.meta["val"].dim(), "out") for leaf in leaves]  # None: replicated
    return traced.gm, annotate(traced, info, pls, inputs, {}, in_specs, req)


def run_all(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    for p in DEFAULT.passes:
        gm = p.fn(gm, ctx)
        check_invariants(gm, p.name, ctx)
    return gm


def shard_checked(model, mesh, plan, inputs, **kw) -> fxshard.ShardedModule:
    """``fxshard.shard`` with the invariants checked on every program it built."""
    sm = fxshard.shard(model, mesh, plan, example_inputs=inputs, **kw)
    ctx = ShardContext(MeshInfo.of(mesh))
    for prog in sm._programs():
        check_invariants(prog.gm, "emit", ctx)
    return sm


def spec(n: fx.Node):
    s = n.meta[META_KEY]
    return s.placements if isinstance(s, Spec) else tuple(x.placements if x is not None else None for x in s)


def ops(gm: fx.GraphModule, target: Any) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is target and not n.meta.get(INSERTED_KEY)]


def forward_comms(sm) -> dict:
    return {k: v["count"] for k, v in fxshard.comm_stats(sm)["forward"].items()}


# ----------------------------------------------------------------------------- the fixture itself


def test_fake_world_can_change_size_after_destroy():
    for n, rank in ((2, 1), (8, 5), (3, 0)):
        with fake_world(n, rank=rank) as mesh:
            assert dist.get_world_size() == n and dist.get_rank() == rank
            assert mesh.size() == n and list(mesh.get_coordinate()) == [rank]
        assert not dist.is_initialized()
    with fake_world(4, rank=3, shape=(2, 2), names=("dp", "tp")) as mesh:
        assert mesh.mesh_dim_names == ("dp", "tp") and list(mesh.get_coordinate()) == [1, 1]
    assert not dist.is_initialized()


@pytest.mark.parametrize("n", [2, 64])
def test_fixture_gives_a_fresh_world(fake_mesh, n):
    mesh = fake_mesh(n)
    assert dist.get_world_size() == n and mesh.shape == (n,)


# ----------------------------------------------------------------------------- propagate


def test_propagate_toy_model(mesh2):
    gm, ctx = prepare(toy(), mesh2, TOY_PLAN, (toy_x(),))
    propagate(gm, ctx)
    check_invariants(gm, "propagate", ctx)
    ph = {n.name: spec(n) for n in gm.graph.nodes if n.op == "placeholder"}
    assert ph == {"p_net1_weight": (S(0),), "p_net1_bias": (S(0),), "p_net2_weight": (S(1),),
                  "p_net2_bias": (R,), "x": (R,)}
    a1, a2 = ops(gm, aten.addmm.default)
    assert spec(a1) == (S(1),)
    assert spec(ops(gm, aten.relu.default)[0]) == (S(1),)
    assert spec(a2) == (PS,)  # rowwise: partial sums stay partial until something needs them
    assert a2.meta[IN_KEY] == [(PS,), (S(1),), (S(0),)]  # the bias joins the partial sum once
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.meta[IN_KEY] == [(R,)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused_sdpa", "math_sdpa"])
def test_propagate_transformer_heads_and_attention(mesh2, fused):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = contextlib.nullcontext() if fused else sdpa_kernel(SDPBackend.MATH)
    with backend:  # the math backend traces attention to bmm/softmax pieces
        gm, ctx = prepare(transformer(1), mesh2, transformer_plan(1), (models.make_tokens(2, 16, 64),))
    propagate(gm, ctx)
    check_invariants(gm, "propagate", ctx)
    by_shape: dict = {}
    for n in gm.graph.nodes:
        if isinstance(n.meta.get(META_KEY), Spec) and n.op == "call_function":
            by_shape.setdefault((n.target, tuple(n.meta[META_KEY].shape)), set()).add(spec(n))
    assert by_shape[(aten.view.default, (2, 16, 4, 8))] == {(S(2),)}  # heads split through the view
    assert by_shape[(aten.permute.default, (2, 4, 16, 8))] == {(S(1),)}  # ... and the transpose
    if fused:  # attention stays one op (fxshard::attention), heads split
        (sdpa,) = ops(gm, torch.ops.fxshard.attention.default)
        assert spec(sdpa) == (S(1),) and sdpa.meta[IN_KEY] == [(S(1),)] * 3
        assert not ops(gm, aten.bmm.default)
    else:
        assert by_shape[(aten.bmm.default, (8, 16, 16))] == {(S(0, 2),)}  # [B*H] merge with H split
        assert by_shape[(aten.amax.default, (2, 4, 16, 1))] == {(S(1),)}  # softmax stays local per head
    emb_tok, emb_pos = ops(gm, aten.embedding.default)
    assert spec(emb_tok) == (PS,)
    assert [st.lowering for st in emb_tok.meta[STRATEGY_KEY]] == ["masked_embedding"]
    assert spec(emb_pos) == (R,)
    for ln in ops(gm, aten.native_layer_norm.default):
        assert ln.meta[IN_KEY][0] == (R,)
    (logits,) = ops(gm, aten.mm.default)
    assert spec(logits) == (S(1),)  # the tied, vocab-split head
    assert not any(n.meta.get(FALLBACK_KEY) for n in gm.graph.nodes)
    assert ctx.fallbacks == []


def test_seeds_are_never_changed(mesh2):
    gm, ctx = prepare(toy(), mesh2, {"net1.weight": P(None, "tp")}, (toy_x(),), in_specs=P("tp", None))
    propagate(gm, ctx)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            assert spec(n) == ctx.seeds[n]
    assert spec(next(n for n in gm.graph.nodes if n.name == "x")) == (S(0),)


# ----------------------------------------------------------------------------- redistribute


def test_redistribute_toy_megatron_one_all_reduce(mesh2):
    sm = shard_checked(toy(), mesh2, TOY_PLAN, (toy_x(),))
    assert fxshard.comm_stats(sm)["forward"] == {"all_reduce": {"count": 1, "bytes": 8 * 16 * 4}}
    (c,) = [n for n in sm._programs()[0].gm.graph.nodes if COMM_KEY in n.meta]
    assert c.meta[COMM_KEY]["src"] == "P(sum)" and c.meta[COMM_KEY]["dst"] == "R"


@pytest.mark.parametrize("in_specs,out_specs,plan,expected", [
    (P("tp", None), P("tp", None), None, {}),  # data parallel: nothing to communicate
    (P("tp", None), None, None, {"all_gather": 1}),  # ... but a replicated result is gathered
    # Rowwise's output_layouts (default Replicate) is honoured: all_reduce, then a free local slice
    (None, P(None, "tp"), TOY_PLAN, {"all_reduce": 1}),
    # ... and asking the style for a split output turns the partial sums straight into it
    (None, P(None, "tp"), {"net1": ColwiseParallel(), "net2": RowwiseParallel(output_layouts=Shard(-1))},
     {"reduce_scatter": 1}),
    (None, None, {"net1": ColwiseParallel()}, {"all_reduce": 1}),  # net2 weight sliced locally, not x gathered
])
def test_redistribute_counts(mesh2, in_specs, out_specs, plan, expected):
    sm = shard_checked(toy(), mesh2, plan, (toy_x(),), in_specs=in_specs, out_specs=out_specs)
    assert forward_comms(sm) == expected


@pytest.mark.parametrize("plan,kind", [
    ({"net1": ColwiseParallel(), "net2": ColwiseParallel()}, "all_gather"),  # last-dim pieces gathered
    ({"net1": ColwiseParallel(), "net2": RowwiseParallel(output_layouts=Shard(-1))}, "reduce_scatter"),
])
def test_last_dim_gather_and_reduce_scatter_copy_once(mesh2, plan, kind):
    # moving the split dim to the front and back used to take two transposing copies
    sm = shard_checked(toy(), mesh2, plan, (toy_x(),), out_specs=None if kind == "all_gather" else P(None, "tp"))
    gm = sm._programs()[0].gm
    comms = forward_comms(sm)
    assert list(comms) == [kind], comms
    copies = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default and n.meta.get(INSERTED_KEY)]
    assert len(copies) == comms[kind], gm.code


def test_redistribute_transformer_two_all_reduces_per_layer(mesh2):
    n_layers = 2
    sm = shard_checked(transformer(n_layers), mesh2, transformer_plan(n_layers), (models.make_tokens(2, 16, 64),),
                       planner="greedy")  # the greedy sweep's Megatron pattern (the solver's differs at toy widths)
    # Megatron's 2 per layer, plus the vocab-split embedding's partial sum; logits gathered once for the output
    assert forward_comms(sm) == {"all_reduce": 2 * n_layers + 1, "all_gather": 1}
    reasons = [c["op"] for c in fxshard.report.inspect.collectives(sm._programs()[0])]
    # RowwiseParallel's default output_layouts=Replicate() pins each all_reduce to the module boundary
    assert reasons.count("constraint") == 2 * n_layers + 1
    assert reasons[-1] == "output"


def test_redistribute_2d_mesh(fake_mesh):
    mesh = fake_mesh(4, rank=2, shape=(2, 2), names=("dp", "tp"))
    sm = shard_checked(toy(), mesh, TOY_PLAN, (toy_x(),), in_specs=P("dp", None), out_specs=P("dp", None))
    comms = fxshard.report.inspect.collectives(sm._programs()[0])
    assert [(c["kind"], c["axis"]) for c in comms] == [("all_reduce", "tp")]
    assert comms[0]["bytes"] == 4 * 16 * 4  # the local batch half
    assert tuple(sm.net1.weight.shape) == (16, 16)


# ----------------------------------------------------------------------------- localize


def test_localize_rewrites_head_count(mesh2):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # attention as bmm pieces: a [B*H] merge to localize
        gm, ctx = prepare(transformer(1), mesh2, transformer_plan(1), (models.make_tokens(2, 16, 64),))
    gm = propagate(gm, ctx)
    gm = redistribute(gm, ctx)
    check_invariants(gm, "redistribute", ctx)
    heads = [n for n in ops(gm, aten.view.default) if len(n.args[1]) == 4 and n.args[1][2] == 4]
    assert len(heads) == 3 and all(list(n.args[1]) == [2, 16, 4, 8] for n in heads)
    merged = [n for n in ops(gm, aten.view.default) if list(n.args[1]) == [8, 16, 8]]
    assert merged
    gm = localize(gm, ctx)
    check_invariants(gm, "localize", ctx)
    assert all(list(n.args[1]) == [2, 16, 2, 8] for n in heads)  # 4 heads -> 2 per rank
    assert all(list(n.args[1]) == [4, 16, 8] for n in merged)  # B*H = 8 -> 4 (strided split)
    for n in ops(gm, aten.view.default) + ops(gm, aten.expand.default):  # every size matches the local shape
        assert list(n.args[1]) == [int(s) for s in n.meta[META_KEY].local_shape(ctx.mesh.sizes)], n.name


@pytest.mark.parametrize("rank", [0, 1])
def test_localize_masked_embedding_offset_is_per_rank(fake_mesh, rank):
    mesh = fake_mesh(2, rank=rank)
    gm, ctx = prepare(transformer(1), mesh, transformer_plan(1), (models.make_tokens(2, 16, 64),))
    gm = run_all(gm, ctx)
    emb = ops(gm, aten.embedding.default)[0]
    idx = emb.args[1]
    assert idx.target is aten.where.self and idx.meta.get(INSERTED_KEY)
    outside, given, safe = idx.args
    assert safe.target is aten.masked_fill.Scalar  # misses look up row 0 ...
    shifted = safe.args[0]
    assert shifted.target is aten.sub.Tensor and shifted.args[1] == 32 * rank  # this rank's vocab offset
    assert shifted.args[0] is given  # ... and a token outside the vocab is looked up as given (raises as eager)
    ge = {n.args[0]: n.args[1] for n in gm.graph.nodes if n.target is aten.ge.Scalar}
    assert ge[shifted] == 32 and ge[given] == 64  # local and global vocab sizes
    (user,) = emb.users
    assert user.target is aten.masked_fill.Scalar and user.args[2] == 0.0  # misses contribute zero


class _MeanOfColwise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x).mean(-1)


def test_localize_mean_over_split_dim_divides_by_ranks(fake_mesh):
    mesh = fake_mesh(4)
    sm = shard_checked(_MeanOfColwise().requires_grad_(False), mesh, {"l": ColwiseParallel()}, (toy_x(),))
    gm = sm._programs()[0].gm
    (mean,) = ops(gm, aten.mean.dim)
    (div,) = mean.users
    assert div.target is aten.div.Scalar and div.args[1] == 4 and div.meta.get(INSERTED_KEY)
    assert forward_comms(sm) == {"all_reduce": 1}


# ----------------------------------------------------------------------------- golden explain()


def assert_golden(text: str, name: str) -> None:
    """Compare ``text`` with ``tests/golden/<name>``; ``EXPECTTEST_ACCEPT=1`` rewrites the file."""
    path = GOLDEN / name
    if os.environ.get("EXPECTTEST_ACCEPT", "") not in ("", "0"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing; run with EXPECTTEST_ACCEPT=1 to create it"
    expected = path.read_text()
    if text != expected:
        diff = "\n".join(difflib.unified_diff(expected.splitlines(), text.splitlines(), "golden", "actual",
                                              lineterm=""))
        pytest.fail(f"explain() differs from {path} (EXPECTTEST_ACCEPT=1 accepts the new text):\n{diff}")


def test_golden_explain_toy_tp2(mesh2):
    sm = shard_checked(toy(), mesh2, TOY_PLAN, (toy_x(),))
    assert_golden(fxshard.explain(sm) + "\n", "explain_toy_tp2.txt")


# ----------------------------------------------------------------------------- 64 ranks in one process


def test_plan_64_ranks_in_one_process(fake_mesh):
    rank = 37
    mesh = fake_mesh(64, rank=rank)
    n_layers, dim, vocab = 2, 128, 128
    model = transformer(n_layers, vocab=vocab, dim=dim, n_heads=64)
    sm = shard_checked(model, mesh, transformer_plan(n_layers), (models.make_tokens(2, 16, vocab),), planner="greedy")
    shapes = {n: tuple(p.shape) for n, p in sm.named_parameters()}
    for i in range(n_layers):
        for w in "qkv":
            assert shapes[f"layers.{i}.attn.w{w}.weight"] == (dim // 64, dim)
            assert shapes[f"layers.{i}.attn.w{w}.bias"] == (dim // 64,)
        assert shapes[f"layers.{i}.attn.wo.weight"] == (dim, dim // 64)
        assert shapes[f"layers.{i}.mlp.w1.weight"] == (4 * dim // 64, dim)
        assert shapes[f"layers.{i}.mlp.w2.weight"] == (dim, 4 * dim // 64)
        assert shapes[f"layers.{i}.attn.wo.bias"] == (dim,)
    assert shapes["tok_emb.weight"] == (vocab // 64, dim)
    assert sm.output.weight is sm.tok_emb.weight
    assert forward_comms(sm) == {"all_reduce": 2 * n_layers + 1, "all_gather": 1}
    gm = sm._programs()[0].gm
    heads = [n for n in ops(gm, aten.view.default) if n.meta[META_KEY].shape == (2, 16, 64, 2)]
    assert len(heads) == 3 * n_layers and all(list(n.args[1]) == [2, 16, 1, 2] for n in heads)  # one head per rank
    shifted = ops(gm, aten.embedding.default)[0].args[1].args[2].args[0]  # where(outside, given, masked_fill(shifted))
    assert shifted.args[1] == rank * (vocab // 64)


def test_shard_restores_the_collector_and_returns_compiled_programs(mesh2) -> None:
    """shard() freezes the objects alive before it out of the garbage collector while it runs (speed)
    and thaws them after, leaving a caller's own freeze alone; its graph modules are lazy meanwhile,
    and the programs it returns have their code generated."""
    import gc

    from torch.fx._lazy_graph_module import _LazyGraphModule

    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    x = torch.randn(4, 8)
    before = gc.get_freeze_count()  # Python 3.12 starts with objects of its own frozen, 3.11 with none
    sm = fxshard.shard(models.ToyModel(8, 16), mesh2, plan, example_inputs=(x,))
    assert gc.get_freeze_count() <= before  # thawed (3.12's own frozen objects with the rest)
    cur = sm._current
    for prog in (cur.forward, cur.training.fwd, cur.training.bwd):
        assert not (isinstance(prog.gm, _LazyGraphModule) and prog.gm._needs_recompile()), prog.label
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        fxshard.shard(models.ToyModel(8, 16), mesh2, plan, example_inputs=(x,))
        assert gc.get_freeze_count() > frozen // 2  # still frozen (a few frozen objects may have been freed)
    finally:
        gc.unfreeze()


def test_shard_freezes_even_when_the_interpreter_started_with_frozen_objects(mesh2, monkeypatch) -> None:
    """Python 3.12 starts with a few hundred objects of its own frozen (3.11 with none): shard() took them for a
    caller's freeze and never froze, on the Python the GPU machines run. Simulated here by freezing before the
    call and recording that count as the one at import."""
    import gc

    import fxshard.frontends.shard as shard_module

    seen = []
    inner = shard_module._shard_programs_lazily
    monkeypatch.setattr(shard_module, "_shard_programs_lazily",
                        lambda *a, **kw: (seen.append(gc.get_freeze_count()), inner(*a, **kw))[1])
    model, x = models.ToyModel(8, 16), torch.randn(4, 8)
    gc.freeze()
    try:
        at_start = gc.get_freeze_count()
        monkeypatch.setattr(shard_module, "_FROZEN_AT_IMPORT", at_start)
        fxshard.shard(model, mesh2, {"net1": ColwiseParallel()}, example_inputs=(x,))
        assert seen and seen[0] > at_start  # frozen while sharding (the objects made since the freeze above)
        assert gc.get_freeze_count() == 0  # and thawed after
    finally:
        gc.unfreeze()


def test_cse_merges_equal_pure_nodes_in_place_keeping_the_first():
    from fxshard.tracing.cse import cse

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.t.default, (x,))
    b = g.call_function(aten.t.default, (x,))  # equal to a: merged into it
    c = g.call_function(aten.mul.Tensor, (a, b))
    d = g.call_function(aten.mul.Tensor, (b, a))  # equal to c once b is a
    e = g.call_function(aten.sum.dim_IntList, (c, [0]))
    f = g.call_function(aten.sum.dim_IntList, (d, [1]))  # different argument: kept
    g.output((e, f))
    a.meta["tag"] = "first"
    x_ = torch.randn(3, 5)
    want = [o.clone() for o in fx.GraphModule({}, g)(x_)]
    out = cse(fx.GraphModule({}, g))
    calls = [n for n in out.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [aten.t.default, aten.mul.Tensor, aten.sum.dim_IntList, aten.sum.dim_IntList]
    assert calls[0].meta["tag"] == "first" and calls[1].args == (calls[0], calls[0])
    for got, w in zip(out(x_), want):
        torch.testing.assert_close(got, w)

    g2 = fx.Graph()  # a graph that mutates is left alone: equal reads may see different values
    y = g2.placeholder("y")
    r1 = g2.call_function(aten.t.default, (y,))
    g2.call_function(aten.add_.Tensor, (y, y))
    r2 = g2.call_function(aten.t.default, (y,))
    g2.output((r1, r2))
    out2 = cse(fx.GraphModule({}, g2))
    assert sum(n.target is aten.t.default for n in out2.graph.nodes) == 2


class _Updates(nn.Module):
    """A buffer updated in place (twice, read between), BatchNorm's running statistics, a no_grad region."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        seen = self.steps * 2
        self.steps.mul_(3)
        with torch.no_grad():
            scale = x.abs().amax()
        return self.bn(self.lin(x)).softmax(-1) * scale + seen


@pytest.mark.parametrize("case", ["updates", "transformer", "llama_loss", "conv_big_head_loss", "packed_moe"])
def test_forward_decomposition_matches_export_run_decompositions(case):
    """trace_forward re-traces torch.export's graph with make_fx (tracing/export.py::_decomposed) instead of
    ``ExportedProgram.run_decompositions``: same ops, same placeholders, the buffers updated in place
    returned first in the same order, as ``run_decompositions`` reports them."""
    from collections import Counter

    from torch.export.graph_signature import OutputKind

    from fxshard.tracing.decompositions import FUSED_FORWARD, decomposition_table
    from fxshard.tracing.export import _decomposed
    from fxshard.tracing.stop_gradients import STOP_GRADIENT, mark_stop_gradients
    from tests.models import MODEL_CASES

    if case == "updates":
        model, args = _Updates(), (torch.randn(4, 6),)
    else:
        mc = next(c for c in MODEL_CASES if c.name == case)
        model, args = mc.make_model(), mc.make_inputs()
    ep = torch.export.export(model, args, strict=False)
    mark_stop_gradients(ep.graph_module)
    table = decomposition_table(lambda t: STOP_GRADIENT(t))
    ours, mutated = _decomposed(ep.graph_module, table)
    # export's table lists every CompositeImplicitAutograd op (its graphs keep them); make_fx needs no entry
    export_table = {**torch.export.default_decompositions(), **table}
    for op in FUSED_FORWARD:
        export_table.pop(op, None)
    theirs = ep.run_decompositions(export_table)

    def ops(g: fx.Graph) -> Counter:
        g.eliminate_dead_code()
        return Counter(str(n.target) for n in g.nodes if n.op == "call_function")

    assert ops(ours.graph) == ops(theirs.graph), (ops(ours.graph) - ops(theirs.graph), ops(theirs.graph) - ops(ours.graph))
    assert [n.name for n in ours.graph.nodes if n.op == "placeholder"] == \
        [n.name for n in theirs.graph.nodes if n.op == "placeholder"]
    names = [s.target for s in ep.graph_signature.input_specs]
    assert [names[i] for i in mutated] == [s.target for s in theirs.graph_signature.output_specs
                                          if s.kind == OutputKind.BUFFER_MUTATION]
    assert (case == "updates") == bool(mutated)
