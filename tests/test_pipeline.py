"""The pass pipeline (``fxshard/passes/pipeline.py``) and its verifier (``fxshard/passes/verify.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel
from fxshard.core.context import ShardContext
from fxshard.core.errors import ShardingError
from fxshard.core.ir import COMM_KEY
from fxshard.core.mesh import MeshInfo
from fxshard.passes.verify import enabled
from fxshard.passes.pipeline import DEFAULT, EMIT, LOCALIZE, OVERLAP, PROPAGATE, REDISTRIBUTE, Pass, Pipeline
from tests import models


def test_the_suite_runs_the_verifier():
    assert enabled()


def test_pipeline_rejects_a_pass_whose_requirements_nothing_ensures():
    with pytest.raises(ShardingError, match="localize.*requires.*arrive"):
        Pipeline((PROPAGATE, LOCALIZE, EMIT))
    with pytest.raises(ShardingError, match="per-program"):
        Pipeline((PROPAGATE, REDISTRIBUTE, LOCALIZE, EMIT, OVERLAP, Pass("late", lambda gm, ctx: gm)))
    assert DEFAULT.names == ["propagate", "solve", "redistribute", "localize", "emit", "bucket", "inplace", "overlap"]
    assert DEFAULT.with_pass(OVERLAP) is DEFAULT
    assert DEFAULT.without("overlap").names == DEFAULT.names[:-1]
    with pytest.raises(ShardingError, match="no pass 'overlapp'.*'overlap'"):
        DEFAULT.without("overlapp")


def _drop_a_wait(gm: fx.GraphModule, ctx: ShardContext) -> fx.GraphModule:
    """A broken pass: reads a collective's result without its wait_tensor."""
    for n in gm.graph.nodes:
        if COMM_KEY in n.meta:
            wait = next(iter(n.users))
            wait.replace_all_uses_with(n)
            gm.graph.erase_node(wait)
            break
    return gm


def test_verifier_names_the_pass_that_broke_a_fact(mesh2):
    model = models.ToyModel(16, 32).requires_grad_(False)
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    after = DEFAULT.names.index("redistribute") + 1
    broken = Pipeline(DEFAULT.passes[:after] + (Pass("drop_wait", _drop_a_wait, frozenset({"arrive"})),)
                      + DEFAULT.passes[after:])
    with pytest.raises(ShardingError, match="after pass 'drop_wait'.*'arrive'"):
        fxshard.shard(model, mesh2, plan, example_inputs=(torch.randn(8, 16),), pipeline=broken)
    sm = fxshard.shard(model, mesh2, plan, example_inputs=(torch.randn(8, 16),))  # the real passes keep it
    assert fxshard.comm_stats(sm)["forward"]["all_reduce"]["count"] == 1


def test_overlap_pass_schedules_as_overlap_does(mesh2):
    """The default pipeline's OVERLAP pass gives the programs ``fxshard.frontends.backend.overlap`` gives a module
    sharded without it, where that schedule keeps the peak memory (here)."""
    from fxshard.frontends.backend import overlap

    model = models.ToyModel(16, 32)
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    x = torch.randn(8, 16, requires_grad=True)  # the input gradient's all_reduce can overlap the weight grads
    unscheduled = DEFAULT.without("overlap")
    piped = fxshard.shard(model, mesh2, plan, example_inputs=(x,))
    after = overlap(fxshard.shard(model, mesh2, plan, example_inputs=(x,), pipeline=unscheduled))
    plain = fxshard.shard(model, mesh2, plan, example_inputs=(x,), pipeline=unscheduled)
    codes = [[p.gm.code for p in sm._programs()] for sm in (piped, after, plain)]
    assert codes[0] == codes[1]
    assert codes[0] != codes[2]  # the schedule changed something (the input gradient's all_reduce moves up)


class _Chain(torch.nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_overlap_pass_keeps_the_order_where_overlap_would_raise_peak_memory(mesh2):
    """Weights stored split and gathered before use (the batch is larger than the weights, so gathering
    them is cheapest): the overlap schedule would issue all six weight all_gathers at the start and hold
    every gathered weight at once. The default pipeline keeps each gather before its layer."""
    from fxshard.frontends.backend import overlap
    from fxshard.analysis.liveness import program_peak
    from fxshard.passes.overlap import PEAK_SLACK

    model = _Chain(6, 256).requires_grad_(False)
    plan = {f"layers.{i}.weight": fxshard.P("tp") for i in range(6)}
    x = torch.randn(1024, 256)
    unscheduled = DEFAULT.without("overlap")
    sms = [fxshard.shard(model, mesh2, plan, example_inputs=(x,), pipeline=p)
           for p in (DEFAULT, unscheduled, unscheduled)]
    default, plain, forced = sms[0], sms[1], overlap(sms[2])
    assert fxshard.comm_stats(default)["forward"]["all_gather"]["count"] == 6
    peak = {name: program_peak(sm._programs()[0].gm, (2,), "cpu", coords=(0,))
            for name, sm in (("default", default), ("plain", plain), ("forced", forced))}
    assert peak["forced"] > peak["plain"] * (1 + PEAK_SLACK), peak  # what the check keeps out
    assert [p.gm.code for p in default._programs()] == [p.gm.code for p in plain._programs()]
    assert peak["default"] == peak["plain"]


class _UserAllReduce(torch.nn.Module):
    """The model's own collective under no_grad (allowed: it runs as written)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            s = x * 2
            torch.distributed.all_reduce(s)
        return x + s


def test_verifier_accepts_the_models_own_collectives(mesh2):
    sm = fxshard.shard(_UserAllReduce(), mesh2, {}, example_inputs=(torch.randn(4, 4),))
    assert fxshard.comm_stats(sm)["forward"] == {}  # fxshard inserted nothing; the model's all_reduce stays


def test_verifier_treats_every_layout_on_a_one_rank_axis_as_the_same(fake_mesh):
    """On a mesh axis of one rank, S(0) and R hold the same local value; the redistribute pass (rightly)
    moves nothing between them, and the verifier used to call that a broken 'arrive' fact (a dp=1 x tp=2
    mesh with the Megatron Llama plan)."""
    from examples.llama_shapes import PLAN
    from fxshard.report.inspect import collectives

    mesh = fake_mesh(2, shape=(1, 2), names=("dp", "tp"))
    model = models.LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, hidden=64, max_seq=16)
    tokens = torch.zeros(2, 16, dtype=torch.long)
    sm = fxshard.shard(model, mesh, PLAN, example_inputs=(tokens, tokens), planner="greedy")
    assert fxshard.comm_stats(sm)["backward"]["all_reduce"]["count"] > 0  # tp's collectives are there
    axes = {c["axis"] for prog in sm._programs() for c in collectives(prog)}
    assert axes and not any("dp" in str(a) for a in axes), axes
