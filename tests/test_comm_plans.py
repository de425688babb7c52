"""The collectives of the hand Megatron plan with data parallelism (dp x tp), planned on the fake process
group with Llama built on meta (attention one ``fxshard::attention`` node, or under the math backend
``[B*H]`` merges around ``bmm``). Numerics of the same
layouts on real ranks: ``tests/test_mesh2d.py::test_llama_with_data_parallel_2x2``."""

from __future__ import annotations

import contextlib

import pytest
import torch

import fxshard
from fxshard import P, PrepareModuleInputOutput
from fxshard.core.ir import COMM_KEY, INSERTED_KEY, META_KEY
from fxshard.core.placements import Part, S
from torch.distributed.tensor import Replicate
from tests import models
from tests.test_training import llama_megatron_plan

BATCH, SEQ, DIM = 8, 128, 256


def _shard_llama(fake_mesh, vocab: int, planner: str = "greedy", fsdp: bool = False, math: bool = False):
    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    with torch.device("meta"):
        model = models.LlamaDecoder(vocab=vocab, dim=DIM, n_heads=8, n_kv_heads=4, n_layers=1, hidden=512,
                                    max_seq=SEQ)
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long)
    plan = llama_megatron_plan(1)
    if fsdp:  # the table also split over dp on its hidden dim (ZeRO-3), as benchmarks/comm_at_scale.py does
        plan["tok_embeddings"] = PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Replicate(),
                                                          output_layouts=Replicate(), desired_output_layouts=Replicate())
        plan["tok_embeddings.weight"] = P("tp", "dp")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext():
        return fxshard.shard(model, mesh, plan, example_inputs=(tokens, tokens), in_specs=(P("dp"), P("dp")),
                             planner=planner)


def _collectives(sm, label: str) -> list[dict]:
    return [c for prog in sm._programs() if prog.label == label for c in fxshard.report.inspect.collectives(prog)]


@pytest.mark.parametrize("math", [False, True], ids=["attention_node", "math"])
@pytest.mark.parametrize("planner", ["greedy", "global"])
def test_heads_stay_split_on_tp_through_the_batch_heads_merge(fake_mesh, planner, math):
    """The batch on dp and the heads on tp: attention's node splits both (batch on dp, heads on tp); under the
    math backend they share the merged ``[B*H]`` dim of every attention ``bmm`` (plain split on dp, strided
    on tp). The forward all-reduces the two row-parallel outputs and the vocab-parallel embedding over tp
    and gathers nothing (it used to all-gather q, k and v over tp)."""
    sm = _shard_llama(fake_mesh, vocab=4096, planner=planner, math=math)
    fwd = _collectives(sm, "forward")
    assert not [c for c in fwd if c["kind"] != "all_reduce"], fwd
    activation = BATCH // 2 * SEQ * DIM * 4
    assert sorted(c["bytes"] for c in fwd if c["axis"] == "tp" and c["bytes"] >= activation) == [activation] * 3
    bmm = {n.meta[META_KEY].placements for prog in sm._programs() for n in prog.gm.graph.nodes
           if n.target is torch.ops.aten.bmm.default}
    attn = {n.meta[META_KEY].placements for prog in sm._programs() for n in prog.gm.graph.nodes
            if n.target is torch.ops.fxshard.attention.default}
    assert (bmm, attn) == (({(S(0), S(0, BATCH))}, set()) if math else (set(), {(S(0), S(1))})), (bmm, attn)
    bwd = _collectives(sm, "backward")
    assert not [c for c in bwd if c["kind"] == "all_gather" and c["axis"] == "tp"], bwd


# Tokens per step over the table rows each tp rank holds: ~1, as in benchmarks/comm_at_scale.py (16 x 1024
# tokens, 128256 / 8 rows). There gathering the activation gradient over dp sends half the bytes of
# all-reducing the table's gradient; the all-reduce is the policy nonetheless (rules/embedding.py).
VOCAB = BATCH * SEQ * 2


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
@pytest.mark.parametrize("planner", ["greedy", "global"])
def test_embedding_gradient_is_reduced_over_dp_not_gathered(fake_mesh, planner, fsdp):
    """With the batch split over dp, the embedding's weight gradient is accumulated from each dp rank's own
    tokens and all-reduced (DDP) or reduce-scattered into the dp-split table (FSDP), never computed from the
    activation gradient all-gathered over dp: the gather grows with the batch and sits on the backward's
    critical path, the table's reduction is fixed-size and overlaps the backward. Checked where the gather
    would be the byte-cheaper choice (``VOCAB``), which both planners picked before the policy."""
    sm = _shard_llama(fake_mesh, vocab=VOCAB, planner=planner, fsdp=fsdp)
    activation_grad = BATCH * SEQ * DIM * 4  # the gather's output: the whole batch's gradient of the lookup
    table_shard = VOCAB // 2 * DIM * 4  # the table's tp shard, whose gradient an all-reduce sends twice
    assert 2 * table_shard > activation_grad  # so the gather sends fewer bytes
    bwd = _collectives(sm, "backward")
    node = next(n for prog in sm._programs() for n in prog.gm.graph.nodes
                if n.target is torch.ops.aten.embedding_dense_backward.default)
    # P(sum) over dp, this tp rank's rows of the vocab-parallel table (masked local accumulation)
    assert node.meta[META_KEY].placements == (Part("sum"), S(0)), node.meta[META_KEY]
    feeding, stack = [], [node.args[0]]  # the collectives inserted on the activation gradient's way in
    while stack:
        n = stack.pop()
        if n.meta.get(INSERTED_KEY):
            feeding += [n.meta[COMM_KEY]] if COMM_KEY in n.meta else []
            stack += n.all_input_nodes
    assert not [c for c in feeding if c["kind"] == "all_gather" and c["axis"] == "dp"], feeding
    assert not [c for c in bwd if c["kind"] == "all_gather" and c["axis"] == "dp" and c["bytes"] >= activation_grad
                and c["consumer"] == node.name], bwd
    if fsdp:
        assert [c for c in bwd if c["kind"] == "reduce_scatter" and c["axis"] == "dp" and c["bytes"] == table_shard], bwd
    else:
        dp_reduced = sum(c["bytes"] for c in bwd if c["kind"] == "all_reduce" and c["axis"] == "dp")
        assert dp_reduced >= table_shard  # the table's tp shard is among the all-reduced gradients
