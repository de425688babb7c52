"""The global planner (``fxshard.shard(..., planner="global")``, fxshard/planner/solve.py): plans on the fake
process group, numerics on 2 gloo ranks against the unsharded model."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel, ShardingError
from fxshard.planner import formulate as formulate_module, solve as solve_module
from fxshard.planner.certificate import greedy_is_optimal
from fxshard.planner.formulate import plan_cost, solve_problem
from fxshard.planner.problem import build_problem, price
from fxshard.planner.solve import solve
from fxshard.passes.pipeline import DEFAULT, Pipeline
from fxshard.core.placements import S
from torch.distributed.tensor import Replicate, Shard
from tests import models
from tests.dist_utils import run_ranks
from tests.test_training import llama_megatron_plan


def _llama() -> torch.nn.Module:
    return models.LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, hidden=64, max_seq=16)


def _wire_bytes(sm) -> float:
    """Bytes one rank sends for every emitted collective (ring: an all_reduce sends 2(n-1)/n of its buffer,
    the others (n-1)/n): what the planners' price counts, unlike comm_stats' buffer sizes."""
    sizes = dict(zip(sm._info.names, sm._info.sizes))
    total = 0.0
    for prog in sm._programs():
        for c in fxshard.report.inspect.collectives(prog):
            n = sizes[c["axis"]]
            total += (2 if c["kind"] == "all_reduce" else 1) * (n - 1) / n * c["bytes"]
    return total


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_global_plan_moves_no_more_bytes_than_greedy(fake_mesh, mesh_shape):
    """On activations of a MiB (bandwidth, not latency, dominates the price), built on meta. The global
    plan's result is scored against the greedy one and never worse, so it sends no more bytes."""
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = fake_mesh(4 if len(mesh_shape) == 2 else 2, shape=mesh_shape, names=names)
    tokens = torch.zeros(8, 128, dtype=torch.long)
    in_specs = (P("dp"), P("dp")) if "dp" in names else None

    def model() -> torch.nn.Module:
        with torch.device("meta"):
            return models.LlamaDecoder(vocab=2048, dim=256, n_heads=8, n_kv_heads=4, n_layers=1, hidden=512,
                                       max_seq=128)

    got = {planner: fxshard.shard(model(), mesh, llama_megatron_plan(1), example_inputs=(tokens, tokens),
                                  in_specs=in_specs, planner=planner) for planner in ("greedy", "global")}
    greedy, solved = _wire_bytes(got["greedy"]), _wire_bytes(got["global"])
    assert 0 < solved <= greedy, (fxshard.comm_stats(got["global"]), fxshard.comm_stats(got["greedy"]))
    # the user's plan is data, not a variable: every parameter keeps the placement the plan gave it
    assert got["global"]._placements == got["greedy"]._placements


def test_a_bucketed_gradient_pays_a_share_of_its_last_reductions_latency():
    """[P, P] -> [R, R] all-reduces on tp, then on dp: the bucket pass packs the last (dp) one only; a
    gather is never bucketed."""
    from fxshard.planner.cost import ALPHA, Link
    from fxshard.core.placements import Part, R

    whole, bucketed = (Link(), Link()), (Link(bucket=4 * 2**20), Link(bucket=4 * 2**20))
    nbytes = 2**20
    saved = (price((Part(), Part()), (R, R), nbytes, (2, 2), whole)
             - price((Part(), Part()), (R, R), nbytes, (2, 2), bucketed))
    assert saved == pytest.approx(ALPHA * (1 - 1 / 4))  # the dp all-reduce moves the whole MiB: 1/4 of a bucket
    assert price((S(0), R), (R, R), nbytes, (2, 2), bucketed) == \
        price((S(0), R), (R, R), nbytes, (2, 2), whole)


def test_bucketed_gradients_pay_a_share_of_one_latency_so_dp_x_tp_plans_are_ddp(fake_mesh):
    """The bucket pass sends a step's gradients in a few large all-reduces; priced one latency per
    gradient, the global plan for torch's test Transformer on a dp x tp mesh (batch split on dp, Megatron
    layers) gathered the batch over dp and repeated the layers' compute on both dp ranks (1.5x the step
    time of Megatron + DDP on 4 gloo ranks). Priced as bucketed it is Megatron + DDP, the greedy plan."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=4, vocab_size=1024, max_seq_len=64, dim=256, n_heads=8, dropout_p=0.0,
                                  weight_tying=False))
    plan = {f"layers.*.attention.{p}": ColwiseParallel() for p in ("wq", "wk", "wv")}
    plan.update({"layers.*.attention.wo": RowwiseParallel(), "layers.*.feed_forward.w1": ColwiseParallel(),
                 "layers.*.feed_forward.w2": RowwiseParallel()})
    tokens = torch.zeros(8, 64, dtype=torch.long)
    stats = {planner: fxshard.comm_stats(fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=(tokens,),
                                                       in_specs=(P("dp"),), out_specs=P("dp"), planner=planner))
             for planner in ("global", "greedy")}
    assert stats["global"] == stats["greedy"], stats
    assert set(stats["global"]["forward"]) == {"all_reduce"}  # no batch gathered over dp
    tp_act = 4 * 64 * 256 * 4  # one rank's activations: the layers' 8 all-reduces over tp
    assert stats["global"]["forward"]["all_reduce"] == {"count": 8, "bytes": 8 * tp_act}


def test_global_plan_keeps_a_style_boundary(mesh2):
    """RowwiseParallel(output_layouts=Shard(-1)) pins net2's output split; a replicated result then
    needs reduce_scatter + all_gather, where one all_reduce would be cheaper: the solver must keep
    the user's layout rather than find the cheaper plan."""
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel(output_layouts=Shard(-1))}
    x = torch.randn(8, 16)
    sm = fxshard.shard(models.ToyModel(16, 32), mesh2, plan, example_inputs=(x,), planner="global")
    fwd = {k: v["count"] for k, v in fxshard.comm_stats(sm)["forward"].items()}
    assert fwd == {"reduce_scatter": 1, "all_gather": 1}
    assert sm._placements["net1.weight"] == (S(0),) and sm._placements["net2.weight"] == (S(1),)
    free = fxshard.shard(models.ToyModel(16, 32), mesh2, {"net1": ColwiseParallel(), "net2": RowwiseParallel()},
                         example_inputs=(x,), planner="global")
    assert {k: v["count"] for k, v in fxshard.comm_stats(free)["forward"].items()} == {"all_reduce": 1}


def test_unknown_planner_is_a_sharding_error(mesh2):
    with pytest.raises(ShardingError, match="planner='best' is not a planner"):
        fxshard.shard(models.ToyModel(16, 32), mesh2, {}, example_inputs=(torch.randn(8, 16),), planner="best")


class _CountAndOutput(torch.nn.Module):
    """Returns a Python int before its tensor: the global planner read the tensor's required layout
    from the int's slot and returned it column-split instead of replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> tuple:
        return 7, self.lin(x)


def _train_global(rank: int, world: int) -> dict:
    """Llama with the Megatron plan and seed 004's data-parallel trunk + class-sharded head, both planned
    by the global planner: loss and full gradients against the unsharded model."""
    mesh = fxshard.init_mesh(tp=world)
    out = {}
    model = _llama()
    batch = (models.make_tokens(2, 16, 64, seed=3), models.make_tokens(2, 16, 64, seed=53))
    sm = fxshard.shard(copy.deepcopy(model), mesh, llama_megatron_plan(2), example_inputs=batch, planner="global")
    cases = [("llama", model, sm, batch, batch)]
    head = models.ConvBigHeadWithLoss(in_ch=3, ch=8, img=4, n_classes=256)
    g = torch.Generator().manual_seed(7)
    hb = (models.make_images(8, 3, 4, seed=1), torch.randint(0, 256, (8,), generator=g))
    hsm = fxshard.shard(copy.deepcopy(head), mesh, {"linear.weight": P("tp", None), "linear.bias": P("tp")},
                        example_inputs=hb, in_specs=(P("tp"), P("tp")), planner="global")
    cases.append(("seed004", head, hsm, hb, (hb[0].chunk(world)[rank], hb[1].chunk(world)[rank])))
    torch.manual_seed(0)
    ref = _CountAndOutput()
    x = torch.randn(4, 8)
    csm = fxshard.shard(copy.deepcopy(ref), mesh, {"lin": ColwiseParallel()}, example_inputs=(x,), planner="global")
    (n, y), (_, ref_y) = csm(x), ref(x)
    y.sum().backward()
    ref_y.sum().backward()
    grad = csm._dtensor("lin.weight", csm.lin.weight.grad).full_tensor()
    out["int_first"] = {"n": n, "shape": tuple(y.shape), "out_err": (y - ref_y).abs().max().item() if y.shape ==
                        ref_y.shape else float("inf"), "grad_err": (grad - ref.lin.weight.grad).abs().max().item()}
    for name, ref, shd, full_in, local_in in cases:
        ref_loss = ref(*full_in)
        ref_loss.backward()
        loss = shd(*local_in)  # each rank holds its half of seed004's batch; the loss is the global one
        loss.backward()
        grads = {n: shd._dtensor(n, p.grad).full_tensor() for n, p in shd.named_parameters()}
        out[name] = {"loss_err": abs(loss.item() - ref_loss.item()),
                     "grad_err": max((grads[n] - ref.get_parameter(n).grad).abs().max().item() for n in grads),
                     "n_grads": len(grads), "fallbacks": shd._training.bwd.fallbacks}
    return out


def test_global_plan_trains_like_unsharded():
    for res in run_ranks(_train_global, 2, timeout=600):  # three shard() calls, each solving two programs
        r = res.pop("int_first")
        assert r["n"] == 7 and r["shape"] == (4, 16) and r["out_err"] <= 1e-6 and r["grad_err"] <= 1e-6, r
        for name, r in res.items():
            assert r["loss_err"] <= 1e-5 and r["grad_err"] <= 1e-5 and r["n_grads"] > 0, (name, r)


def test_layer_clustering_shares_the_middle_layers_at_the_unclustered_cost(fake_mesh, monkeypatch):
    """4 identical layers on tp=2: the decision nodes of layer 2 take layer 1's columns (layers 0 and 3
    border the embedding and the head, so they keep their own), each member with its representative's
    candidates; solved again without sharing, the same problem's optimum costs the same."""
    from fxshard.planner.clusters import block_instances
    mesh = fake_mesh(2)
    seen = []
    real_cluster = solve_module.cluster

    def spy(gm, problem):
        shared = real_cluster(gm, problem)  # later passes rewrite gm: read it now
        seen.append(({n.name: n.target for n in gm.graph.nodes}, block_instances(gm), problem, dict(shared)))
        return shared

    monkeypatch.setattr(solve_module, "cluster", spy)
    with torch.device("meta"):
        model = models.LlamaDecoder(vocab=2048, dim=256, n_heads=8, n_kv_heads=4, n_layers=4, hidden=512, max_seq=128)
    tokens = torch.zeros(8, 128, dtype=torch.long)
    fxshard.shard(model, mesh, llama_megatron_plan(4), example_inputs=(tokens, tokens), planner="global")
    targets, inst, problem, shared = seen[0]  # the training program
    assert shared and len(set(shared.values())) == len(shared)  # one member per representative: one-to-one
    for member, rep in shared.items():  # the representative comes first in graph order: layer 2's in the backward
        assert {inst[member], inst[rep]} == {("layers", 1), ("layers", 2)}
        assert targets[member] == targets[rep] and problem.nodes[member].axes == problem.nodes[rep].axes
    # every decision node of layers 1 and 2 is in a pair
    in_layer = lambda i: {n for n in problem.nodes if inst.get(n) == ("layers", i)}  # noqa: E731
    assert set(shared) | set(shared.values()) == in_layer(1) | in_layer(2)
    assert len(in_layer(1)) == len(in_layer(2)) == len(shared)

    clustered = solve_problem(problem)
    assert all(clustered[m] == clustered[r] for m, r in shared.items())
    problem.shared = {}
    alone = solve_problem(problem)
    assert plan_cost(problem, clustered) == pytest.approx(plan_cost(problem, alone), rel=1e-9)
    assert plan_cost(problem, clustered) < plan_cost(problem, {n: nv.greedy for n, nv in
                                                                                   problem.nodes.items()})


def _train_clustered(rank: int, world: int) -> dict:
    """A 4-layer Llama planned by the global planner with layer clustering (layers 1 and 2 share
    variables): loss and full gradients against the unsharded model, and how many nodes shared."""
    import logging

    shared = []

    class Spy(logging.Handler):
        def emit(self, record):
            if hasattr(record, "fxshard_solve"):
                shared.append(record.fxshard_solve["shared"])

    log = logging.getLogger("fxshard.planner.solve")
    spy, level = Spy(), log.level
    log.addHandler(spy)
    log.setLevel(logging.INFO)
    try:
        mesh = fxshard.init_mesh(tp=world)
        model = models.LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=4, hidden=64, max_seq=16)
        batch = (models.make_tokens(2, 16, 64, seed=3), models.make_tokens(2, 16, 64, seed=53))
        sm = fxshard.shard(copy.deepcopy(model), mesh, llama_megatron_plan(4), example_inputs=batch,
                           planner="global")
    finally:
        log.removeHandler(spy)
        log.setLevel(level)
    ref_loss = model(*batch)
    ref_loss.backward()
    loss = sm(*batch)
    loss.backward()
    grads = {n: sm._dtensor(n, p.grad).full_tensor() for n, p in sm.named_parameters()}
    return {"loss_err": abs(loss.item() - ref_loss.item()),
            "grad_err": max((grads[n] - model.get_parameter(n).grad).abs().max().item() for n in grads),
            "n_grads": len(grads), "shared": shared}


def test_clustered_global_plan_trains_like_unsharded():
    results = run_ranks(_train_clustered, 2, timeout=600)
    # rank 0 solved both programs with shared variables (the other rank receives its plans: consistency.on_lead)
    assert results[0]["shared"] and min(results[0]["shared"]) > 0, results[0]
    for r in results:
        assert r["loss_err"] <= 1e-5 and r["grad_err"] <= 1e-5 and r["n_grads"] == 4 * 9 + 3, r


def _solving_with(capture) -> Pipeline:
    """The default pipeline with ``capture(gm, ctx)`` (which must call ``solve``) as its solve pass."""
    return Pipeline(tuple(dataclasses.replace(p, fn=capture) if p.name == "solve" else p for p in DEFAULT.passes))


def _solve_problems(model, mesh, plan, **kwargs) -> tuple[object, list]:
    """Shard with the global planner, keeping every program's planning problem (the solve pass's input)."""
    seen = []

    def capture(gm, ctx):
        seen.append(build_problem(gm, ctx))
        return solve(gm, ctx)

    return fxshard.shard(model, mesh, plan, pipeline=_solving_with(capture), planner="global", **kwargs), seen


def _greedy_and_solved(problem) -> tuple[float, float]:
    greedy = plan_cost(problem, {name: nv.greedy for name, nv in problem.nodes.items()})
    return greedy, plan_cost(problem, solve_problem(problem))


def test_a_provably_optimal_greedy_plan_skips_the_milp(mesh2, monkeypatch):
    """Seed 000's Megatron MLP (built on meta, matmuls large enough that their compute outweighs a
    collective's latency): the styles pin every layout around the two matmuls, so the greedy plan is
    provably optimal (``certificate.greedy_is_optimal``) in the forward and the training program: the default
    planner returns it without building a MILP, and the solver, run anyway, finds nothing cheaper."""
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}

    def toy():
        with torch.device("meta"):
            return models.ToyModel(256, 1024), torch.empty(2048, 256)

    model, x = toy()
    greedy = fxshard.shard(model, mesh2, plan, example_inputs=(x,), planner="greedy")
    model, x = toy()
    sm, problems = _solve_problems(model, mesh2, plan, example_inputs=(x,))
    assert len(problems) == 2 and all(greedy_is_optimal(p) for p in problems)
    for p in problems:
        cost, solved = _greedy_and_solved(p)
        assert solved == pytest.approx(cost, rel=1e-9) and cost > 0
    assert fxshard.comm_stats(sm) == fxshard.comm_stats(greedy)

    def no_milp(*args, **kwargs):
        raise AssertionError("the MILP was built for a provably optimal greedy plan")

    monkeypatch.setattr(solve_module, "solve_problem", no_milp)
    model, x = toy()
    fxshard.shard(model, mesh2, plan, example_inputs=(x,))  # the default planner: global


def _fsdp_tp_plan() -> dict:
    """Megatron tp with every weight also split over dp on its other dim (ZeRO-3), the activation
    layouts kept as module boundaries (``benchmarks/comm_at_scale.py::fsdp_plan``)."""
    from fxshard import PrepareModuleInputOutput

    def boundary(inp, out):
        return PrepareModuleInputOutput(input_layouts=inp, desired_input_layouts=inp, output_layouts=out,
                                        desired_output_layouts=out)

    plan = {"tok_embeddings": boundary(Replicate(), Replicate()), "tok_embeddings.weight": P("tp", "dp"),
            "output": boundary(Replicate(), Shard(-1)), "output.weight": P("tp", "dp"), "norm.weight": P("dp"),
            "layers.*.attention_norm.weight": P("dp"), "layers.*.ffn_norm.weight": P("dp")}
    for m in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[f"layers.*.{m}"] = boundary(Replicate(), Shard(-1))
        plan[f"layers.*.{m}.weight"] = P("tp", "dp")
    for m in ("attention.wo", "feed_forward.w2"):
        plan[f"layers.*.{m}"] = boundary(Shard(-1), Replicate())
        plan[f"layers.*.{m}.weight"] = P("dp", "tp")
    return plan


def test_the_milp_runs_where_it_improves_the_greedy_plan(fake_mesh):
    """FSDP x tp: the greedy sweep splits the embedding's hidden dim over dp and runs the residual stream
    hidden-split (docs/solver_design.md), several times the bytes of the FSDP plan the solver finds.
    The certificate must not claim the greedy plan optimal there."""
    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    with torch.device("meta"):
        model = models.LlamaDecoder(vocab=2048, dim=256, n_heads=8, n_kv_heads=4, n_layers=1, hidden=512, max_seq=128)
    tokens = torch.zeros(8, 128, dtype=torch.long)
    _, problems = _solve_problems(model, mesh, _fsdp_tp_plan(), example_inputs=(tokens, tokens),
                                  in_specs=(P("dp"), P("dp")))
    training = problems[0]
    assert not greedy_is_optimal(training)
    greedy, solved = _greedy_and_solved(training)
    assert solved < greedy / 2, (solved, greedy)


class _Cat(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b, c]) * 2


def test_every_candidate_splits_legally_on_its_axis(mesh2):
    """A regression test: three [5] inputs split unevenly over 2 ranks and concatenated. The cat rule offers a
    packed split of the [15] result that does not divide (legal only for even pieces); the solver took it on a
    1-D mesh, where only pairs of axes were checked, and the ranks' pieces then differed in size (a gloo size
    mismatch in the OpInfo sweep). Every candidate the solver keeps must split legally on its own axis."""
    from fxshard.planner.problem import _legal

    seen = []

    def capture(gm, ctx):
        problem = build_problem(gm, ctx)
        nodes = {n.name: n for n in gm.graph.nodes}
        seen.extend((nodes[name], a, ch.strategy) for name, nv in problem.nodes.items()
                    for a, axis in enumerate(nv.axes) for ch in axis if ch.strategy is not None)
        return solve(gm, ctx)

    xs = tuple(torch.randn(5) for _ in range(3))
    fxshard.shard(_Cat(), mesh2, {}, example_inputs=xs, in_specs=(P("tp"),) * 3, pipeline=_solving_with(capture),
                  planner="global")
    cats = [(n, st) for n, a, st in seen if n.target is torch.ops.aten.cat.default]
    assert cats and all(_legal(n, {a: st}, (2,)) for n, a, st in seen)
    assert not any(st.output == S(0, 3) for _, st in cats), cats


def test_candidates_shared_across_identical_layers_are_what_each_node_computes(fake_mesh):
    """build_problem computes a decision node's candidates once per signature (``problem._signature``: the op,
    its arguments, shapes, dtypes and placements) and hands identical layers the same result: on a 2-layer
    Llama's training graph, on a 2x2 mesh, every node's candidates and illegal pairs are what computing them
    for that node alone gives, and most nodes share a signature with another."""
    from fxshard.plans.constrain import CONSTRAIN_OP
    from fxshard.core.ir import STRATEGY_KEY
    from fxshard.planner.problem import _candidates, _signature

    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    checked = []

    def capture(gm, ctx):
        problem = build_problem(gm, ctx)
        nodes = {n.name: n for n in gm.graph.nodes}
        for name, nv in problem.nodes.items():
            n = nodes[name]
            if n.target is not CONSTRAIN_OP and STRATEGY_KEY in n.meta and _signature(n, problem) is not None:
                axes, invalid = _candidates(n, problem)
                assert (nv.axes, nv.invalid) == (axes, invalid), name
                checked.append(_signature(n, problem))
        return gm  # the greedy plan: what is checked is the problem

    with torch.device("meta"):
        model = models.LlamaDecoder(vocab=512, dim=64, n_heads=4, n_kv_heads=2, n_layers=2, hidden=128, max_seq=16)
    tokens = torch.zeros(4, 16, dtype=torch.long)
    fxshard.shard(model, mesh, llama_megatron_plan(2), example_inputs=(tokens, tokens), in_specs=(P("dp"), P("dp")),
                  pipeline=_solving_with(capture), planner="global")
    assert len(checked) > 300 and len(set(checked)) < 0.7 * len(checked), (len(checked), len(set(checked)))


def test_patient_rounds_stop_after_two_stalls_counted_from_the_first_plan_that_fits(fake_mesh, monkeypatch):
    """``solve_problem(patient=True)`` stops after ``PATIENCE`` rounds in a row that lower the best cost by
    less than ``STALL``, counted from the first plan that fits (before it the best cost is inf). Scripted: each
    MILP returns a plan other than the last (one node's axis-0 choice alternates) and ``plan_cost`` gives the
    greedy plan 10 (it does not fit), then 5, 5 - 1e-9, 5 - 2e-9, ...: rounds 2 and 3 stall, so 3 MILPs (with
    round 1 counted as a stall against inf, 2)."""
    from fxshard.planner import milp

    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    with torch.device("meta"):
        model, x = models.ToyModel(64, 128), torch.empty(32, 64)
    _, problems = _solve_problems(model, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()},
                                  example_inputs=(x,), in_specs=(P("dp"),))
    problem = next(p for p in problems if len(p.sizes) == 2 and any(len(nv.axes[0]) > 1 for nv in p.nodes.values()))
    name = next(n for n, nv in problem.nodes.items() if len(nv.axes[0]) > 1)
    columns, real_formulate = [], formulate_module._formulate

    def formulate(*args):
        m, cols = real_formulate(*args)
        columns.append(cols)
        return m, cols

    def scripted(cost, *args, options):
        vec = [0.0] * len(cost)
        for n, per_axis in columns[-1].items():
            for a, cols in enumerate(per_axis):
                i = problem.nodes[n].greedy[a]
                if n == name and a == 0 and len(columns) % 2:
                    i = (i + 1) % len(cols)
                vec[cols[i]] = 1.0
        return milp.Result(vec, 0, True, "scripted", 0.0)

    costs = iter([10.0] + [5.0 - k * 1e-9 for k in range(10)])
    monkeypatch.setattr(formulate_module, "_formulate", formulate)
    monkeypatch.setattr(milp, "solve", scripted)
    monkeypatch.setattr(milp, "prestart", lambda: None)
    monkeypatch.setattr(formulate_module, "plan_cost", lambda problem, picks: next(costs))
    solve_problem(problem, rounds=6, patient=True, admissible=lambda picks: False)
    assert len(columns) == 3


def test_a_milp_without_a_feasible_plan_is_a_no_plan_error(mesh2):
    """A MILP of ``solve_problem`` made infeasible (one choice's column pinned to 1 and to 0): the failure is a
    ``NoPlanError``, the type auto-sharding catches (a budget no plan fits, a pair move's layout that nothing
    fits), not its message's text; still a ShardingError and a ValueError to users."""
    from fxshard.core.errors import NoPlanError

    with torch.device("meta"):
        model, x = models.ToyModel(64, 128), torch.empty(32, 64)
    _, problems = _solve_problems(model, mesh2, {}, example_inputs=(x,))
    problem = problems[0]
    name = next(iter(problem.nodes))

    def infeasible(m, cols) -> None:
        m.row([(cols[name][0][0], 1.0)], 1.0, 1.0)
        m.row([(cols[name][0][0], 1.0)], 0.0, 0.0)

    with pytest.raises(NoPlanError, match="found no plan") as raised:
        solve_problem(problem, extend=infeasible)
    assert isinstance(raised.value, ShardingError) and isinstance(raised.value, ValueError)
