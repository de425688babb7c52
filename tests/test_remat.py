"""Activation checkpointing in the training partition: ``shard(..., remat="none" | "layers" | "auto")``.

One spawn of 2 gloo ranks shards a 4-layer transformer (Megatron TP) under each policy and checks,
against the unsharded model: loss and every parameter's gradient (gathered); and the bytes of the
activations the forward actually saves for the backward, measured with autograd's
``saved_tensors_hooks`` (each storage once, parameters and inputs not counted), which ``"layers"``
must cut by at least 2x and ``fxshard.memory(sm)["saved"]`` must predict exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard.errors import ShardingError
from tests import models
from tests.dist_utils import run_ranks
from tests.test_forward_parity import transformer_plan

N_LAYERS = 4


def _transformer() -> models.TransformerWithLoss:
    torch.manual_seed(0)
    return models.TransformerWithLoss(vocab=64, dim=64, n_heads=4, n_layers=N_LAYERS, max_seq=32)


def saved_activation_bytes(module: nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``module(*inputs)`` (a scalar loss), and the bytes autograd saved for its backward: every saved
    tensor's storage counted once, the module's parameters and the inputs not (they are held anyway)."""
    held = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *inputs]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in held:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module(*inputs)
    return loss, sum(seen.values())


def _policies(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    batch = (models.make_tokens(4, 32, 64, seed=0), models.make_tokens(4, 32, 64, seed=1))
    ref = _transformer()
    want_loss = ref(*batch)
    want_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    out = {}
    for remat in ("none", "layers", "auto"):
        sm = fxshard.shard(_transformer(), mesh, transformer_plan(N_LAYERS), example_inputs=batch, remat=remat)
        loss, measured = saved_activation_bytes(sm, *batch)
        loss.backward()
        grads = {n: sm._dtensor(n, p.grad).full_tensor() for n, p in sm.named_parameters()}
        out[remat] = {
            "loss_err": abs(loss.item() - want_loss.item()),
            "grad_err": max((grads[n] - want[n]).abs().max().item() for n in want),
            "keys_equal": set(grads) == set(want),
            "measured": measured,
            "predicted": fxshard.memory(sm)["saved"],
        }
    return out


def test_remat_policies_keep_gradients_and_layers_halves_saved_activations():
    for res in run_ranks(_policies, 2, timeout=300):
        for remat, r in res.items():
            assert r["keys_equal"] and r["loss_err"] <= 1e-5 and r["grad_err"] <= 1e-5, (remat, res)
            assert r["predicted"] == r["measured"], (remat, res)
        none, layers, auto = (res[k]["measured"] for k in ("none", "layers", "auto"))
        assert none >= 2 * layers, res
        assert auto < none, res


def test_unknown_remat_policy_raises(mesh2):
    x = torch.randn(4, 8)
    with pytest.raises(ShardingError, match=r"remat='full' is not a rematerialisation policy.*'layers'"):
        fxshard.shard(nn.Linear(8, 8), mesh2, {}, example_inputs=(x,), remat="full")
