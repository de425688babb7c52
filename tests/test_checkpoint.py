"""Distributed checkpoints: save a sharded module and its AdamW state with torch.distributed.checkpoint
at TP=2, load at TP=4 and into the unsharded model; everything equal."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

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


class _Uneven(torch.nn.Module):
    """Sizes that do not divide by 2 (embedding rows 11, hidden 7, output 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.l1 = torch.nn.Linear(6, 7)
        self.ln = torch.nn.LayerNorm(7)
        self.l2 = torch.nn.Linear(7, 5)

    def forward(self, tok: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.l2(self.ln(torch.relu(self.l1(self.emb(tok))))), y)


_UNEVEN_PLANS = {"save": {"l1": fxshard.RowwiseParallel(), "emb.weight": fxshard.P(None, "tp")},
                 "load": {"emb": fxshard.RowwiseParallel(), "l1": fxshard.ColwiseParallel(),
                          "l2": fxshard.RowwiseParallel()}}


def _uneven_batches() -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 11, (3, 4), generator=g), torch.randn(3, 4, 5, generator=g)) for _ in range(3)]


def _uneven_run(plan: str, steps: int, lr: float = 1e-2):
    mesh = fxshard.init_mesh(tp=2)
    torch.manual_seed(0 if plan == "save" else 123)  # the loading side starts from other weights
    model = _Uneven()
    sm = fxshard.shard(copy.deepcopy(model), mesh, _UNEVEN_PLANS[plan], example_inputs=_uneven_batches()[0])
    opt, ref_opt = torch.optim.AdamW(sm.parameters(), lr=lr), torch.optim.AdamW(model.parameters(), lr=lr)
    for tok, y in _uneven_batches()[:steps]:
        for m, o in ((sm, opt), (model, ref_opt)):
            o.zero_grad()
            m(tok, y).backward()
            o.step()
    return sm, opt, model, ref_opt


def _torch_api_save(rank: int, world: int, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    sm, opt, _, _ = _uneven_run("save", 2)
    dcp.save({"model": get_model_state_dict(sm), "optim": get_optimizer_state_dict(sm, opt)}, checkpoint_id=path)


def _errors(sm, opt, ref, ref_opt) -> dict:
    """Max |sharded - eager| of each optimizer state tensor shaped like its parameter, and of the parameters."""
    names = dict(ref.named_parameters())
    osd = fxshard.optim_state_dict(sm, opt)
    err = {f"{fqn}.{k}": (v.full_tensor() - ref_opt.state[names[fqn]][k]).abs().max().item()
           for fqn, st in osd["state"].items() for k, v in st.items() if isinstance(v, DTensor)}
    full = sm.full_state_dict()
    err["params"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return err


def _torch_api_load(rank: int, world: int, path: str) -> dict:
    """At the saving plan and at another: torch's state-dict API through DCP, then a step; then, in memory,
    the saving plan's optimizer ``state_dict()`` into a fresh optimizer at the other plan; all against eager."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    out = {}
    for plan in ("load", "save"):
        _, _, ref, ref_opt = _uneven_run("save", 2)  # the eager model and AdamW the checkpoint holds
        sm, opt, _, _ = _uneven_run(plan, 0)
        state = {"model": get_model_state_dict(sm), "optim": get_optimizer_state_dict(sm, opt)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(sm, state["model"])
        set_optimizer_state_dict(sm, opt, state["optim"])
        out[f"dcp at {plan}"] = _errors(sm, opt, ref, ref_opt)
        tok, y = _uneven_batches()[2]
        for m, o in ((sm, opt), (ref, ref_opt)):
            o.zero_grad()
            m(tok, y).backward()
            o.step()
        out[f"dcp at {plan}, stepped"] = _errors(sm, opt, ref, ref_opt)
    saver, saver_opt, ref, ref_opt = _uneven_run("save", 2)
    sm, opt, _, _ = _uneven_run("load", 0)
    sm.load_state_dict(saver.state_dict())
    opt.step()  # no gradients, so no change: the first step registers the hooks
    opt.load_state_dict(saver_opt.state_dict())
    out["in memory"] = _errors(sm, opt, ref, ref_opt)
    return out


def test_torch_state_dict_api_and_optimizer_state_dict_round_trip_across_uneven_plans(tmp_path):
    """torch's get/set_optimizer_state_dict see DTensors (before: plain local pieces, which DCP took for
    replicated copies and kept rank 0's: exp_avg off by 0.07, silently)."""
    run_ranks(_torch_api_save, 2, str(tmp_path))
    for r in run_ranks(_torch_api_load, 2, str(tmp_path)):
        for what, err in r.items():
            assert max(err.values()) <= 1e-6, (what, err)
            assert len(err) == 1 + 2 * 7, (what, err)  # params + exp_avg, exp_avg_sq of 7 parameters


def _fresh_optimizer_loads(rank: int, world: int) -> dict:
    """Resuming into a new AdamW over ``sm.parameters()`` that never stepped, at another plan than the saving one,
    then two steps, against eager resumed the same way: from the saving optimizer's ``state_dict()`` (DTensors), from
    eager's (full tensors), and through torch's ``set_optimizer_state_dict`` with gradients left from a backward (it
    then loads without the step that would have registered fxshard's hooks)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    saver, saver_opt, ref, ref_opt = _uneven_run("save", 2)
    loads = {"state_dict()": lambda sm, opt: opt.load_state_dict(copy.deepcopy(saver_opt.state_dict())),
             "eager's state_dict()": lambda sm, opt: opt.load_state_dict(copy.deepcopy(ref_opt.state_dict())),
             "set_optimizer_state_dict": lambda sm, opt: set_optimizer_state_dict(
                 sm, opt, copy.deepcopy(get_optimizer_state_dict(saver, saver_opt)))}
    out = {}
    for name, load in loads.items():
        sm, _, _, _ = _uneven_run("load", 0)
        sm.load_state_dict(saver.state_dict())
        opt = torch.optim.AdamW(sm.parameters(), lr=1e-2)
        sm(*_uneven_batches()[0]).backward()  # gradients a resumed loop may leave before loading
        load(sm, opt)
        eager = copy.deepcopy(ref)
        eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
        eager_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # load_state_dict keeps the given tensors
        for tok, y in _uneven_batches()[1:]:
            for m, o in ((sm, opt), (eager, eager_opt)):
                o.zero_grad()
                m(tok, y).backward()
                o.step()
        out[name] = _errors(sm, opt, eager, eager_opt)
    return out


def test_a_fresh_optimizer_resumes_from_a_state_dict_loaded_before_its_first_step():
    """Before: the load hook was registered at an optimizer's first step, so a fresh optimizer stored the loaded
    DTensors as they were and its first step raised "aten.lerp_.Scalar got mixed torch.Tensor and DTensor" (eager's
    full tensors raised on their shape). The first step now converts them to this rank's pieces, as the hook does."""
    for r in run_ranks(_fresh_optimizer_loads, 2):
        for what, err in r.items():
            assert max(err.values()) <= 1e-6, (what, err)
            assert len(err) == 1 + 2 * 7, (what, err)  # params + exp_avg, exp_avg_sq of 7 parameters


def test_an_optimizer_given_the_modules_parameters_later_presents_their_state_as_dtensors(mesh2):
    """An optimizer checked at its first step while it held one other parameter (a count that once compared
    equal to the "hooked" mark) still gets the hooks when the module's parameters are added to it."""
    sm = fxshard.shard(torch.nn.Sequential(torch.nn.Linear(4, 6)), mesh2, {"0": fxshard.ColwiseParallel()},
                       example_inputs=(torch.randn(3, 4),))
    other = torch.nn.Parameter(torch.randn(2))
    opt = torch.optim.AdamW([other], lr=1e-2)
    other.grad = torch.ones(2)
    opt.step()
    opt.add_param_group({"params": list(sm.parameters())})
    sm(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = opt.state_dict()["state"]
    assert not isinstance(state[0]["exp_avg"], DTensor)
    assert isinstance(state[1]["exp_avg"], DTensor) and state[1]["exp_avg"].shape == (6, 4)


def test_a_deep_copy_of_the_module_is_tracked_like_the_original(mesh2):
    """``copy.deepcopy(sm)`` (a second model to train, an EMA copy) does not run ``__init__``: before, its optimizer
    saved plain local pieces (which DCP takes for replicated copies, keeping one rank's) and its gradients were
    never checked. Both now hold for the copy too."""
    import copy

    sm = fxshard.shard(torch.nn.Sequential(torch.nn.Linear(4, 6)), mesh2, {"0": fxshard.ColwiseParallel()},
                       example_inputs=(torch.randn(3, 4),))
    twin = copy.deepcopy(sm)
    opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    twin(torch.randn(3, 4)).sum().backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e9)  # this rank's norm: the step warns
    with pytest.warns(UserWarning, match=r"were changed in place after the backward"):
        opt.step()
    exp_avg = opt.state_dict()["state"][0]["exp_avg"]
    assert isinstance(exp_avg, DTensor) and exp_avg.shape == (6, 4)


def test_load_full_state_dict_names_missing_keys_and_warns_about_unused_ones(mesh2):
    """A missing key or a wrong shape raises; an entry the module has no place for (real checkpoints carry extras:
    a tied head, old rotary buffers) is skipped with a warning naming it, as HF's loader does; before, silently."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {"0": fxshard.ColwiseParallel(), "1": fxshard.RowwiseParallel()},
                       example_inputs=(torch.randn(3, 4),))
    full = {k: v + 1 for k, v in model.state_dict().items()}  # other values than the module holds
    with pytest.raises(fxshard.ShardingError, match=r"missing keys \['1.bias'\]"):
        sm.load_full_state_dict({k: v for k, v in full.items() if k != "1.bias"})
    with pytest.raises(fxshard.ShardingError, match=r"0.weight has shape \(8, 4\), expected \(6, 4\)"):
        sm.load_full_state_dict({**full, "0.weight": torch.zeros(8, 4)})
    with pytest.warns(UserWarning, match=r"1 checkpoint entries match no parameter .* \['model.extra'\]"):
        sm.load_full_state_dict({**full, "model.extra": torch.zeros(2)})
    assert torch.equal(sm.get_submodule("0").weight, full["0.weight"][:3])  # rank 0's rows, loaded
    assert torch.equal(sm.get_submodule("1").weight, full["1.weight"][:, :3])
