"""2x2 (dp, tp) meshes on 4 real gloo ranks: tensor parallel + data parallel, and + FSDP-style
parameter sharding on dp, trained with AdamW against the unsharded model on the global batch."""

from __future__ import annotations

import contextlib
import copy

import torch

import fxshard
from fxshard.core.ir import META_KEY
from fxshard.core.spec import fmt_placements
from fxshard import P
from tests import models
from tests.dist_utils import run_ranks
from tests.test_training import _max_param_diff, train_on_local_batches

TOL = 1e-5


def transformer_specs(n_layers: int, fsdp: bool) -> dict:
    """Megatron TP on 'tp' as PartitionSpecs; with ``fsdp`` every weight is also split on 'dp'."""
    dp = "dp" if fsdp else None
    plan: dict = {"tok_emb.weight": P("tp", dp), "pos_emb.weight": P(None, dp)}
    for i in range(n_layers):
        for w in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1"):
            plan[f"layers.{i}.{w}.weight"] = P("tp", dp)
            plan[f"layers.{i}.{w}.bias"] = P("tp")
        for w in ("attn.wo", "mlp.w2"):
            plan[f"layers.{i}.{w}.weight"] = P(dp, "tp")
            plan[f"layers.{i}.{w}.bias"] = P(dp)
    return plan


def _train_2d(rank: int, world: int, fsdp: bool, planner: str = "global") -> dict:
    mesh = fxshard.init_mesh(dp=2, tp=2)
    dp_rank = mesh.get_coordinate()[0]
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16, tie=True)
    batches = [(models.make_tokens(4, 16, 64, seed=s), models.make_tokens(4, 16, 64, seed=s + 10)) for s in range(2)]
    local = lambda b: tuple(t.chunk(2)[dp_rank] for t in b)
    sm = fxshard.shard(copy.deepcopy(model), mesh, transformer_specs(2, fsdp), example_inputs=batches[0],
                       in_specs=(P("dp"), P("dp")), planner=planner)
    # SGD: AdamW would turn the key bias's exactly-zero gradient (softmax shift invariance) into sign noise
    loss_err = train_on_local_batches(model, sm, batches, local, steps=3)
    return {"loss_err": loss_err,
            "param_err": _max_param_diff(sm.full_state_dict(), model), "stats": fxshard.comm_stats(sm),
            "wq": tuple(sm.get_parameter("layers.0.attn.wq.weight").shape)}


def test_tensor_parallel_plus_data_parallel_2x2():
    for res in run_ranks(_train_2d, 4, False, timeout=300):
        assert res["loss_err"] <= TOL and res["param_err"] <= TOL, res
        assert res["wq"] == (16, 32)
        bwd = res["stats"]["backward"]
        # DDP falls out: replicated-on-dp parameters get their batch-partial gradients all-reduced, the
        # (tied) embedding's too: each dp rank accumulates its own tokens' rows, no gradient is gathered
        assert bwd["all_reduce"]["count"] > 0 and "reduce_scatter" not in bwd and "all_gather" not in bwd, bwd


def test_tensor_parallel_plus_fsdp_2x2():
    # the greedy sweep's FSDP pattern (the global planner's plan for these 2 KiB activations gathers
    # activations rather than reduce-scattering gradients: fewer collectives, the latency term wins)
    for res in run_ranks(_train_2d, 4, True, "greedy", timeout=300):
        assert res["loss_err"] <= TOL and res["param_err"] <= TOL, res
        assert res["wq"] == (16, 16)  # each rank holds 1/4 of a 2-D-split weight
        bwd = res["stats"]["backward"]
        assert bwd["reduce_scatter"]["count"] > 0  # gradients of dp-split weights arrive reduce-scattered


def _llama_2d(rank: int, world: int) -> dict:
    """Llama on dp x tp trained against the unsharded model on the global batch: seed 003's sequence-parallel
    plan, and the Megatron plan traced with math attention (``[B*H]`` merges feeding ``bmm``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.test_plans import llama_seed003_plan
    from tests.test_training import llama_megatron_plan

    mesh = fxshard.init_mesh(dp=2, tp=2)
    dp_rank = mesh.get_coordinate()[0]
    batches = [(models.make_tokens(4, 16, 64, seed=s), models.make_tokens(4, 16, 64, seed=s + 3)) for s in range(2)]
    local = lambda b: tuple(t.chunk(2)[dp_rank] for t in b)
    out = {}
    # two_axes: one dim of a parameter split on both mesh axes (mesh-major pieces)
    two_axes = {"tok_embeddings.weight": P(None, ("dp", "tp")), "output.weight": P("dp", "tp")}
    for name, plan, math in (("sp", llama_seed003_plan(), False), ("megatron_math", llama_megatron_plan(1), True),
                             ("two_axes", two_axes, False)):
        model = models.LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, hidden=64, max_seq=16)
        with sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext():
            # megatron_math: the greedy sweep's layouts, whose bmm placements the test checks (on this 4 x 16
            # token batch the global planner gathers the batch over dp instead: fewer collectives)
            sm = fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=batches[0], in_specs=(P("dp"), P("dp")),
                               planner="greedy" if math else "global")
            loss_err = train_on_local_batches(model, sm, batches, local, steps=2)
        bmm = {fmt_placements(n.meta[META_KEY].placements) for prog in sm._programs()
               for n in prog.gm.graph.nodes if n.target is torch.ops.aten.bmm.default}
        out[name] = {"loss_err": loss_err, "param_err": _max_param_diff(sm.full_state_dict(), model), "bmm": bmm}
    return out


def test_llama_with_data_parallel_2x2():
    """Seed 003's plan: batch split on dp and sequence split on tp share the flattened [batch*seq] dim of
    the MLP (a regression test for combining a strided split with another axis on one dim). Megatron with
    math attention: batch on dp and heads on tp share the [batch*heads] dim of every bmm, forward and
    backward, the heads kept split (strided) rather than gathered. Embedding columns split on dp and tp
    together (a regression test: gradients were wrong when a transition cut such a dim in tp-major order)."""
    for res in run_ranks(_llama_2d, 4, timeout=300):
        for name, r in res.items():
            assert r["loss_err"] <= TOL and r["param_err"] <= TOL, (name, r)
        assert res["megatron_math"]["bmm"] == {"[S(0), S(0,o4)]"}, res["megatron_math"]
