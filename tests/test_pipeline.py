"""The pass pipeline (``fxshard/pipeline.py``) and its verifier (``fxshard/passes/verify.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel
from fxshard.context import ShardContext
from fxshard.errors import ShardingError
from fxshard.ir import COMM_KEY
from fxshard.mesh import MeshInfo
from fxshard.passes.verify import enabled
from fxshard.pipeline import DEFAULT, EMIT, LOCALIZE, OVERLAP, PROPAGATE, REDISTRIBUTE, Pass, Pipeline
from tests import models


def test_the_suite_runs_the_verifier():
    assert enabled()


def test_pipeline_rejects_a_pass_whose_requirements_nothing_ensures():
    with pytest.raises(ShardingError, match="localize.*requires.*arrive"):
        Pipeline((PROPAGATE, LOCALIZE, EMIT))
    with pytest.raises(ShardingError, match="per-program"):
        Pipeline((PROPAGATE, REDISTRIBUTE, LOCALIZE, EMIT, OVERLAP, Pass("late", lambda gm, ctx: gm)))
    assert DEFAULT.with_pass(OVERLAP).names == ["propagate", "solve", "redistribute", "localize", "emit", "bucket",
                                                "inplace", "overlap"]


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
    """The OVERLAP pass in the pipeline gives the programs ``fxshard.compile.overlap`` gives afterwards."""
    from fxshard.compile import overlap

    model = models.ToyModel(16, 32)
    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    x = torch.randn(8, 16, requires_grad=True)  # the input gradient's all_reduce can overlap the weight grads
    piped = fxshard.shard(model, mesh2, plan, example_inputs=(x,), pipeline=DEFAULT.with_pass(OVERLAP))
    after = overlap(fxshard.shard(model, mesh2, plan, example_inputs=(x,)))
    plain = fxshard.shard(model, mesh2, plan, example_inputs=(x,))
    codes = [[p.gm.code for p in sm._programs()] for sm in (piped, after, plain)]
    assert codes[0] == codes[1]
    assert codes[0] != codes[2]  # the schedule changed something (the input gradient's all_reduce moves up)


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
