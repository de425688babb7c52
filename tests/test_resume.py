"""Resuming training in a new process: model + optimizer + step saved through DCP or as one full file, with
fxshard's functions or torch's get_state_dict/set_state_dict, for AdamW and SGD with momentum; the resumed run's
next steps equal the uninterrupted run's (which matches the unsharded model). An empty or partial optimizer load
raises."""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fxshard
from tests import models
from tests.dist_utils import run_ranks

OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}
WAYS = ("fxshard dcp", "fxshard full", "torch dcp", "torch full")
PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(i))


def _build(opt: str):
    """A fresh model, ShardedModule and optimizer (as a new process builds them)."""
    model = models.ToyModel(16, 32)
    sm = fxshard.shard(copy.deepcopy(model), fxshard.init_mesh(tp=2), PLAN, example_inputs=(_batch(0),))
    return model, sm, OPTIMIZERS[opt](sm.parameters())


def _step(m, o, i: int) -> float:
    o.zero_grad()
    loss = m(_batch(i)).square().mean()
    loss.backward()
    o.step()
    return loss.item()


def save(sm, opt, step: int, way: str, path: str) -> None:
    """The recipe's save (every rank calls it)."""
    if way == "fxshard dcp":
        dcp.save({"model": sm.sharded_state_dict(), "optim": fxshard.optim_state_dict(sm, opt), "step": step},
                 checkpoint_id=path)
    elif way == "torch dcp":
        model_sd, optim_sd = get_state_dict(sm, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=path)
    else:  # one file of full tensors, written by rank 0
        if way == "fxshard full":
            model_sd, optim_sd = sm.full_state_dict(), fxshard.optim_state_dict(sm, opt, full=True)
        else:
            model_sd, optim_sd = get_state_dict(sm, opt, options=FULL)
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            torch.save({"model": model_sd, "optim": optim_sd, "step": step}, os.path.join(path, "full.pt"))
        dist.barrier()


def load(sm, opt, way: str, path: str) -> int:
    """The recipe's resume into a fresh ``sm`` and optimizer (every rank calls it); returns the saved step."""
    if way == "fxshard dcp":
        state = {"model": sm.sharded_state_dict(), "optim": fxshard.optim_state_dict(sm, opt), "step": -1}
        dcp.load(state, checkpoint_id=path)
        sm.load_sharded_state_dict(state["model"])
        fxshard.load_optim_state_dict(sm, opt, state["optim"])
    elif way == "torch dcp":
        model_sd, optim_sd = get_state_dict(sm, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": -1}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(sm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        state = torch.load(os.path.join(path, "full.pt"))
        if way == "fxshard full":
            sm.load_full_state_dict(state["model"])
            fxshard.load_optim_state_dict(sm, opt, state["optim"])
        else:
            set_state_dict(sm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FULL)
    return state["step"]


def _uninterrupted(rank: int, world: int, root: str) -> dict:
    """2 steps, a checkpoint in every way, 2 more steps: their losses and the parameters after them; the unsharded
    model's losses alongside."""
    out = {}
    for opt_name in OPTIMIZERS:
        eager, sm, opt = _build(opt_name)
        eager_opt = OPTIMIZERS[opt_name](eager.parameters())
        for i in range(2):
            _step(sm, opt, i), _step(eager, eager_opt, i)
        for way in WAYS:
            save(sm, opt, 2, way, os.path.join(root, opt_name, way))
        losses = [_step(sm, opt, i) for i in range(2, 4)]
        out[opt_name] = {"losses": losses, "eager": [_step(eager, eager_opt, i) for i in range(2, 4)],
                         "params": sm.full_state_dict(), "eager params": eager.state_dict()}
    return out


def _resumed(rank: int, world: int, root: str) -> dict:
    """Everything built afresh, loaded in each way, then the same 2 steps."""
    out = {}
    for opt_name in OPTIMIZERS:
        for way in WAYS:
            _, sm, opt = _build(opt_name)
            step = load(sm, opt, way, os.path.join(root, opt_name, way))
            out[opt_name, way] = {"step": step, "losses": [_step(sm, opt, i) for i in range(step, step + 2)],
                                  "params": sm.full_state_dict()}
    return out


def test_resume_in_a_new_process_continues_exactly():
    """Before: fxshard.optim_state_dict(sm, opt) of a fresh optimizer was {"state": {}}, so dcp.load restored no
    moments and load_optim_state_dict said nothing: the next AdamW step differed from the uninterrupted run by 0.017.
    Now it is the optimizer's state structure (as torch's get_optimizer_state_dict gives), and every way resumes."""
    with tempfile.TemporaryDirectory() as root:
        ref = run_ranks(_uninterrupted, 2, root)[0]
        for opt_name, r in ref.items():  # the uninterrupted sharded run is the unsharded model's
            assert max(abs(a - b) for a, b in zip(r["losses"], r["eager"])) <= 1e-6, (opt_name, r)
            assert max((r["params"][k] - v).abs().max().item() for k, v in r["eager params"].items()) <= 1e-5
        for res in run_ranks(_resumed, 2, root):
            for (opt_name, way), got in res.items():
                want = ref[opt_name]
                assert got["step"] == 2 and got["losses"] == want["losses"], (opt_name, way, got["losses"], want)
                for k, v in want["params"].items():
                    assert torch.equal(got["params"][k], v), (opt_name, way, k, (got["params"][k] - v).abs().max())


def test_an_empty_or_partial_optimizer_load_raises(mesh2):
    sm = fxshard.shard(models.ToyModel(16, 32), mesh2, PLAN, example_inputs=(_batch(0),))
    opt = torch.optim.AdamW(sm.parameters(), lr=1e-2)
    sm(_batch(0)).square().mean().backward()  # gradients a resumed loop may leave before loading
    grads = {n: (p.grad, p.grad.clone()) for n, p in sm.named_parameters()}
    before_fresh = {n: p.detach().clone() for n, p in sm.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor does the gradient check take fxshard's zeros for a change
        template = fxshard.optim_state_dict(sm, opt)  # a fresh optimizer: its state's structure, no step taken
    assert all(p.grad is grads[n][0] and torch.equal(p.grad, grads[n][1]) for n, p in sm.named_parameters())
    assert sorted(template["state"]) == sorted(n for n, _ in sm.named_parameters())
    assert all(set(st) == {"step", "exp_avg", "exp_avg_sq"} for st in template["state"].values())
    assert all(int(st["step"]) == 1 and not st["exp_avg"].to_local().any() for st in template["state"].values())
    assert not opt.state  # the optimizer is left as it was: its next real step is its first, as in eager
    fresh = torch.optim.Adam(sm.parameters(), lr=0.1)
    fxshard.optim_state_dict(sm, fresh)  # e.g. saving a step-0 checkpoint, then training on
    fresh.step()
    assert all(int(st["step"]) == 1 for st in fresh.state.values())  # was 2: Adam's bias correction of step 2
    with torch.no_grad():
        for n, p in sm.named_parameters():
            p.copy_(before_fresh[n])
    before = {n: p.detach().clone() for n, p in sm.named_parameters()}
    empty = {"state": {}, "param_groups": template["param_groups"]}
    with pytest.raises(fxshard.ShardingError, match="state given is empty"):
        fxshard.load_optim_state_dict(sm, opt, empty)
    partial = copy.deepcopy(template)
    del partial["state"]["net2.bias"]
    partial["state"]["net1.bias"].pop("exp_avg_sq")
    with pytest.raises(fxshard.ShardingError, match=r"net1.bias lacks \['exp_avg_sq'\].*net2.bias lacks"):
        fxshard.load_optim_state_dict(sm, opt, partial)
    stray = copy.deepcopy(template)
    stray["state"]["net3.weight"] = stray["state"]["net1.weight"]
    with pytest.raises(fxshard.ShardingError, match="net3.weight, which the optimizer does not hold"):
        fxshard.load_optim_state_dict(sm, opt, stray)
    sgd = torch.optim.SGD(sm.parameters(), lr=0.1, momentum=0.9)  # a checkpoint of another optimizer
    with pytest.raises(fxshard.ShardingError, match="exp_avg.*which SGD with these settings does not keep"):
        fxshard.load_optim_state_dict(sm, sgd, template)
    assert all(torch.equal(p, before[n]) for n, p in sm.named_parameters())  # initialising changed no weight
