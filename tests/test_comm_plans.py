"""The collectives of the hand Megatron plan with data parallelism (dp x tp), planned on the fake process
group with Llama built on meta (math attention: ``[B*H]`` merges around ``bmm``). Numerics of the same
layouts on real ranks: ``tests/test_mesh2d.py::test_llama_with_data_parallel_2x2``."""

from __future__ import annotations

import pytest
import torch

import fxshard
from fxshard import P
from fxshard.ir import META_KEY
from fxshard.placements import S
from tests import models
from tests.test_training import llama_megatron_plan

BATCH, SEQ, DIM = 8, 128, 256


def _shard_llama(fake_mesh, vocab: int, planner: str = "greedy"):
    mesh = fake_mesh(4, shape=(2, 2), names=("dp", "tp"))
    with torch.device("meta"):
        model = models.LlamaDecoder(vocab=vocab, dim=DIM, n_heads=8, n_kv_heads=4, n_layers=1, hidden=512,
                                    max_seq=SEQ)
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return fxshard.shard(model, mesh, llama_megatron_plan(1), example_inputs=(tokens, tokens),
                         in_specs=(P("dp"), P("dp")), planner=planner)


def _collectives(sm, label: str) -> list[dict]:
    return [c for prog in sm._programs() if prog.label == label for c in fxshard.inspect.collectives(prog)]


def test_heads_stay_split_on_tp_through_the_batch_heads_merge(fake_mesh):
    """The batch on dp and the heads on tp share the merged ``[B*H]`` dim of every attention ``bmm``
    (plain split on dp, strided on tp): the forward all-reduces the two row-parallel outputs and the
    vocab-parallel embedding over tp and gathers nothing (it used to all-gather q, k and v over tp)."""
    sm = _shard_llama(fake_mesh, vocab=4096)
    fwd = _collectives(sm, "forward")
    assert not [c for c in fwd if c["kind"] != "all_reduce"], fwd
    activation = BATCH // 2 * SEQ * DIM * 4
    assert sorted(c["bytes"] for c in fwd if c["axis"] == "tp" and c["bytes"] >= activation) == [activation] * 3
    bmm = {n.meta[META_KEY].placements for prog in sm._programs() for n in prog.gm.graph.nodes
           if n.target is torch.ops.aten.bmm.default}
    assert bmm == {(S(0), S(0, BATCH))}, bmm
    bwd = _collectives(sm, "backward")
    assert not [c for c in bwd if c["kind"] == "all_gather" and c["axis"] == "tp"], bwd


@pytest.mark.parametrize("planner", ["greedy", "global"])
def test_embedding_gradient_is_all_reduced_over_dp(fake_mesh, planner):
    """With more tokens than vocabulary rows, the embedding's weight gradient is accumulated from each dp
    rank's own tokens and all-reduced with the other gradients (DDP), rather than its activation gradient
    all-gathered over dp (which grows with the batch)."""
    vocab = 256
    sm = _shard_llama(fake_mesh, vocab=vocab, planner=planner)
    bwd = _collectives(sm, "backward")
    assert not [c for c in bwd if c["kind"] == "all_gather"], bwd
    node = next(n for prog in sm._programs() for n in prog.gm.graph.nodes
                if n.target is torch.ops.aten.embedding_dense_backward.default)
    assert node.meta[META_KEY].placements[0].op == "sum", node.meta[META_KEY]  # P(sum) over dp
    dp_reduced = sum(c["bytes"] for c in bwd if c["kind"] == "all_reduce" and c["axis"] == "dp")
    assert dp_reduced >= vocab * DIM * 4 // 2  # the table's tp shard is among the reduced gradients
