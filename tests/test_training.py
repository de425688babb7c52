"""Sharded training on 2 real gloo ranks vs the same model trained unsharded on one process."""

from __future__ import annotations

import copy

import torch

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel
from tests import models
from tests.dist_utils import run_ranks
from tests.test_forward_parity import transformer_plan

TOL = 1e-5


def _max_param_diff(full: dict, ref: torch.nn.Module) -> float:
    sd = ref.state_dict()
    assert set(full) == set(sd)
    return max((full[k] - sd[k]).abs().max().item() for k in sd)


def _train(model, sm, batches, loss_fn, opt_name: str, steps: int) -> tuple[list, list]:
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1), "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[opt_name]
    opt_ref, opt = make(model.parameters()), make(sm.parameters())
    ref_losses, losses = [], []
    for i in range(steps):
        inputs = batches[i % len(batches)]
        for mod, o, out in ((model, opt_ref, ref_losses), (sm, opt, losses)):
            o.zero_grad()
            loss = loss_fn(mod, inputs)
            loss.backward()
            o.step()
            out.append(loss.item())
    return ref_losses, losses


def _toy_train(rank: int, world: int, opt_name: str) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = models.ToyModel(16, 32)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(3)]
    sm = fxshard.shard(copy.deepcopy(model), mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()},
                       example_inputs=(batches[0][0],))
    loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    ref_l, l = _train(model, sm, batches, loss_fn, opt_name, 4)
    return {"loss_err": max(abs(a - b) for a, b in zip(ref_l, l)), "param_err": _max_param_diff(sm.full_state_dict(), model),
            "stats": fxshard.comm_stats(sm)}


def test_toy_model_trains_like_unsharded_sgd():
    for res in run_ranks(_toy_train, 2, "sgd"):
        assert res["loss_err"] <= TOL and res["param_err"] <= TOL
        assert res["stats"]["forward"]["all_reduce"]["count"] == 1
        assert res["stats"]["backward"] == {}  # the input needs no gradient: no "f" all-reduce


def test_toy_model_trains_like_unsharded_adamw():
    for res in run_ranks(_toy_train, 2, "adamw"):
        assert res["loss_err"] <= TOL and res["param_err"] <= TOL


def _transformer_train(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    n_layers = 2
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=n_layers, max_seq=16, tie=True)
    batches = [(models.make_tokens(2, 16, 64, seed=s), models.make_tokens(2, 16, 64, seed=s + 100)) for s in range(2)]
    sm = fxshard.shard(copy.deepcopy(model), mesh, transformer_plan(n_layers), example_inputs=batches[0])
    # SGD: the key bias has an exactly-zero true gradient, which Adam would turn into sign noise
    ref_l, l = _train(model, sm, batches, lambda m, b: m(*b), "sgd", 3)
    return {"loss_err": max(abs(a - b) for a, b in zip(ref_l, l)), "param_err": _max_param_diff(sm.full_state_dict(), model),
            "stats": fxshard.comm_stats(sm)}


def test_transformer_with_loss_inside_trains_like_unsharded():
    for res in run_ranks(_transformer_train, 2):
        assert res["loss_err"] <= 1e-4 and res["param_err"] <= TOL, res
