"""Distributed checkpoints: save a sharded module and its AdamW state with torch.distributed.checkpoint
at TP=2, load at TP=4 and into the unsharded model; everything equal."""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed.checkpoint as dcp

import fxshard
from tests import models
from tests.dist_utils import run_ranks
from tests.test_forward_parity import transformer_plan


def _make(tp: int, dp: int = 1):
    mesh = fxshard.init_mesh(dp=dp, tp=tp) if dp > 1 else fxshard.init_mesh(tp=tp)
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16, tie=False)
    batch = (models.make_tokens(2, 16, 64, seed=1), models.make_tokens(2, 16, 64, seed=2))
    sm = fxshard.shard(copy.deepcopy(model), mesh, transformer_plan(2), example_inputs=batch)
    return sm, torch.optim.AdamW(sm.parameters(), lr=1e-2), batch


def _full_optim(sm, opt) -> dict:
    osd = fxshard.optim_state_dict(sm, opt)
    return {f"{fqn}.{k}": (v.full_tensor() if hasattr(v, "full_tensor") else v.clone())
            for fqn, st in osd["state"].items() for k, v in st.items()}


def _save(rank: int, world: int, path: str) -> dict:
    sm, opt, batch = _make(world)
    for _ in range(2):
        opt.zero_grad()
        sm(*batch).backward()
        opt.step()
    dcp.save({"model": sm.sharded_state_dict(), "optim": fxshard.optim_state_dict(sm, opt)}, checkpoint_id=path)
    return {"params": sm.full_state_dict(), "optim": _full_optim(sm, opt)}


def _load(rank: int, world: int, path: str, dp: int = 1) -> dict:
    sm, opt, batch = _make(world // dp, dp)
    for g in opt.param_groups:  # create AdamW's state (the template DCP loads into) without changing weights
        g["lr"] = 0.0
    opt.zero_grad()
    sm(*batch).backward()
    opt.step()
    state = {"model": sm.sharded_state_dict(), "optim": fxshard.optim_state_dict(sm, opt)}
    dcp.load(state, checkpoint_id=path)
    sm.load_sharded_state_dict(state["model"])
    fxshard.load_optim_state_dict(sm, opt, state["optim"])
    rank0 = sm.full_state_dict(rank0_only=True, cpu_offload=True)
    return {"params": sm.full_state_dict(), "optim": _full_optim(sm, opt), "lr": opt.param_groups[0]["lr"],
            "rank0": rank0}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_save_at_tp2_load_at_tp4_2x2_and_unsharded():
    with tempfile.TemporaryDirectory() as path:
        saved = run_ranks(_save, 2, path)[0]
        loaded = run_ranks(_load, 4, path, timeout=300)
        for res in loaded:
            assert _max_diff(res["params"], saved["params"]) == 0.0
            assert _max_diff(res["optim"], saved["optim"]) == 0.0
            assert res["lr"] == 1e-2  # param groups restored too
        assert _max_diff(loaded[0]["rank0"], saved["params"]) == 0.0 and all(r["rank0"] == {} for r in loaded[1:])
        for res in run_ranks(_load, 4, path, 2, timeout=300):  # a 2x2 (dp, tp) mesh
            assert _max_diff(res["params"], saved["params"]) == 0.0
            assert _max_diff(res["optim"], saved["optim"]) == 0.0
        # into the plain unsharded model, no process group: DCP reassembles the shards
        model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16, tie=False)
        sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        dcp.load({"model": sd}, checkpoint_id=path)
        assert _max_diff(sd, saved["params"]) == 0.0


def test_a_0_dim_tensor_loads_from_a_safetensors_file(mesh2, tmp_path):
    """BatchNorm's ``num_batches_tracked`` is 0-dim: safetensors cannot slice it (``sl[:]`` raised IndexError)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {"0": fxshard.ColwiseParallel()},
                       example_inputs=(torch.randn(5, 4),))
    full = {k: torch.randn_like(v.float()).to(v.dtype) if v.dim() else torch.tensor(7) for k, v in
            model.state_dict().items()}
    save_file(full, str(tmp_path / "model.safetensors"))
    sm.load_full_state_dict(str(tmp_path / "model.safetensors"))
    got = {**dict(sm.named_parameters()), **dict(sm.named_buffers())}
    assert int(got["1.num_batches_tracked"]) == 7
    assert torch.equal(got["0.weight"].detach(), full["0.weight"].chunk(2)[0])  # rank 0's rows
    assert torch.equal(got["1.running_var"], full["1.running_var"])
