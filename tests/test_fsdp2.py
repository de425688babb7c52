"""Composing with torch's FSDP2: ``fully_shard`` over the dp axis of a module fxshard sharded on tp.

4 real gloo ranks on a (dp=2, tp=2) mesh; the reference is the unsharded model trained on the
global batch (the dp ranks' local batches concatenated).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fxshard
from fxshard.module import local_slice
from tests import models
from tests.dist_utils import run_ranks
from tests.test_forward_parity import transformer_plan
from tests.test_training import train_on_local_batches

TOL = 1e-5


def _fsdp2_over_dp(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(dp=2, tp=2)
    dp_rank = mesh.get_coordinate()[0]
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16)
    batches = [(models.make_tokens(4, 16, 64, seed=s), models.make_tokens(4, 16, 64, seed=s + 10)) for s in range(2)]
    local = lambda b: tuple(t.chunk(2)[dp_rank] for t in b)
    sm = fxshard.shard(copy.deepcopy(model), mesh["tp"], transformer_plan(2), example_inputs=local(batches[0]))
    fully_shard(sm, mesh=mesh["dp"])
    dp_sharded = all(isinstance(p, DTensor) for p in sm.parameters())

    def dp_mean(loss: float) -> float:  # equal local batches: the global mean is the mean of local means
        t = torch.tensor(loss)
        torch.distributed.all_reduce(t, group=mesh["dp"].get_group())
        return t.item() / 2

    # SGD: AdamW would turn the key bias's exactly-zero gradient into sign noise
    worst = train_on_local_batches(model, sm, batches, local, steps=3, global_loss=dp_mean)
    ref = dict(model.named_parameters())
    param_err = 0.0
    for name, p in sm.named_parameters():
        tp_local = p.full_tensor()  # gathered over dp: this rank's tp shard
        want = local_slice(ref[name].detach(), mesh["tp"], sm._placements[name])
        param_err = max(param_err, (tp_local - want).abs().max().item())
    return {"loss_err": worst, "param_err": param_err, "dp_sharded": dp_sharded}


def test_fully_shard_over_dp_composes_with_fxshard_tp():
    for res in run_ranks(_fsdp2_over_dp, 4, timeout=300):
        assert res["dp_sharded"], res
        assert res["loss_err"] <= 1e-4 and res["param_err"] <= TOL, res
