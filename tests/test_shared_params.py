"""Tensors of a model that reach more than one ShardedModule, or a ShardedModule and code outside it
(``fxshard/runtime/sources.py``), on 2 real gloo ranks against the unsharded model:

* two modules sharing an ``nn.Embedding`` (the decoder also uses it as a tied head), each sharded, train one
  embedding as eager (replicated and split over the vocabulary);
* one model sharded three times (two Python scalar arguments, and an eval-mode module for another batch size)
  trains one set of parameters and BatchNorm statistics: losses, gradients accumulated from two modules in one
  backward, the eval module's output and the final state as eager (replicated and Megatron-split);
* a parent sharing an ``nn.Linear`` with the submodule it shards raises when the parent trains the original
  (which the ShardedModule never reads again), and stops raising when the ShardedModule is gone;
* a second shard() that would lay a shared tensor out otherwise, or after the first module converted it or
  FSDP2 replaced it, raises naming it and both layouts.
"""

from __future__ import annotations

import copy
import gc
import pickle
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel, ShardingError
from tests.dist_utils import run_ranks

TOL = 1e-5
MLP_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}


class _Enc(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb, self.fc = emb, nn.Linear(8, 8)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(self.emb(t)))


class _Dec(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb, self.fc = emb, nn.Linear(8, 8)

    def forward(self, t: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(self.emb(t)) + mem.mean(1, keepdim=True))
        return h @ self.emb.weight.t()  # tied head


class _Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.enc, self.dec = _Enc(self.emb), _Dec(self.emb)

    def forward(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.dec(t, self.enc(s))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.net1, self.net2 = nn.BatchNorm1d(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.net2(torch.relu(self.net1(self.norm(x)))) * scale


class _Block(nn.Module):
    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.proj, self.net1, self.net2 = shared, nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(torch.relu(self.net1(self.proj(x))))


class _Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.block = _Block(self.proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h + self.block(h)


def _state_err(sm, ref: nn.Module) -> float:
    want = ref.state_dict()
    got = sm.full_state_dict()
    assert set(got) == set(want), (sorted(got), sorted(want))
    return max((got[k].double() - want[k].double()).abs().max().item() for k in want)


def _seq2seq(mesh, split: bool) -> dict:
    """Encoder and decoder sharing one embedding, each sharded: 3 AdamW steps against eager."""
    torch.manual_seed(0)
    ref = _Seq2Seq()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    data = [tuple(torch.randint(0, 16, (2, n), generator=g) for n in (5, 4, 4)) for _ in range(3)]
    s, t, _ = data[0]
    plan = {"emb.weight": P("tp", None)} if split else {}
    model.enc = fxshard.shard(model.enc, mesh, plan, example_inputs=(s,))
    model.dec = fxshard.shard(model.dec, mesh, plan, example_inputs=(t, torch.randn(2, 5, 8, requires_grad=True)))
    # model.parameters() holds each tensor once (and the parent's stale original, which gets no gradient)
    opts = [torch.optim.AdamW(ref.parameters(), lr=0.05), torch.optim.AdamW(model.parameters(), lr=0.05)]
    loss_err = 0.0
    for s, t, y in data:
        losses = []
        for m, o in zip((ref, model), opts):
            o.zero_grad()
            loss = F.cross_entropy(m(s, t).flatten(0, 1), y.flatten())
            loss.backward()
            o.step()
            losses.append(loss.item())
        loss_err = max(loss_err, abs(losses[0] - losses[1]))
    return {"one_tensor": model.enc.emb.weight is model.dec.emb.weight, "loss_err": loss_err,
            "state_err": max(_state_err(model.enc, ref.enc), _state_err(model.dec, ref.dec))}


def _shard_twice(mesh, split: bool) -> dict:
    """One model sharded for scale 0.5 and 0.7 (a Python scalar argument) in training mode and for a smaller
    batch in eval mode: AdamW steps alternating the two training modules, then one step through both at once
    (their gradients accumulate into one .grad), then the eval module's output, all against eager."""
    torch.manual_seed(0)
    ref = _Net()
    model = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(2)
    xb, yb, xe = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(2, 8, generator=g)
    plan = MLP_PLAN if split else {}
    sm = {s: fxshard.shard(model, mesh, plan, example_inputs=(xb, s)) for s in (0.5, 0.7)}
    model.eval()
    sm_eval = fxshard.shard(model, mesh, plan, example_inputs=(xe, 0.5))
    shared = all(sm[0.5].get_parameter(n) is m.get_parameter(n) for n, _ in model.named_parameters()
                 for m in (sm[0.7], sm_eval)) and sm_eval.norm.running_mean is sm[0.5].norm.running_mean
    opts = [torch.optim.AdamW(ref.parameters(), lr=0.05), torch.optim.AdamW(sm[0.5].parameters(), lr=0.05)]
    loss_err = 0.0
    with warnings.catch_warnings(record=True) as seen:  # e.g. no gradient-changed-in-place warning (grad_guard)
        warnings.simplefilter("always")
        for scales in ((0.5,), (0.7,), (0.5,), (0.5, 0.7)):
            losses = []
            for modules, o in (({s: ref for s in scales}, opts[0]), (sm, opts[1])):
                o.zero_grad()
                loss = sum(F.mse_loss(modules[s](xb, s), yb) for s in scales)
                loss.backward()
                o.step()
                losses.append(loss.item())
            loss_err = max(loss_err, abs(losses[0] - losses[1]))
    ref.eval()
    with torch.no_grad():
        eval_err = (sm_eval(xe, 0.5) - ref(xe, 0.5)).abs().max().item()
    return {"shared": shared, "loss_err": loss_err, "eval_err": eval_err,
            "warned": [str(w.message) for w in seen if "fxshard" in str(w.message)],
            "state_err": max(_state_err(sm[0.7], ref), _state_err(sm_eval, ref))}


def _tied_parent(mesh) -> dict:
    """``model.block = shard(model.block)`` where the block shares ``proj`` with the parent: training the parent
    reaches the original ``proj``, which the ShardedModule never reads again."""
    torch.manual_seed(0)
    model = _Parent()
    x = torch.randn(6, 8)
    block = model.block
    model.block = fxshard.shard(block, mesh, MLP_PLAN, example_inputs=(torch.randn(6, 8, requires_grad=True),))
    try:
        model(x).square().sum().backward()
        raised = None
    except ShardingError as e:
        raised = str(e)
    model.block = block  # the ShardedModule dies: the original is the only copy again, training it is right
    gc.collect()
    model.zero_grad()
    model(x).square().sum().backward()
    return {"raised": raised, "trained_after": model.proj.weight.grad is not None}


def _layouts(mesh) -> dict:
    """A second shard() laying the model's tensors out otherwise, or after the first module's were converted."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(8, 8)
    first = fxshard.shard(model, mesh, MLP_PLAN, example_inputs=(x, 1.0))
    out = {}
    for key, plan in (("plan", {}), ("converted", MLP_PLAN)):
        if key == "converted":
            first.half()
        try:
            fxshard.shard(model, mesh, plan, example_inputs=(x, 1.0))
            out[key] = None
        except ShardingError as e:
            out[key] = str(e)
    del first
    gc.collect()
    again = fxshard.shard(model, mesh, {}, example_inputs=(x, 1.0))  # nothing holds them now: a new copy
    out["after_release"] = again.net1.weight.dtype == torch.float32
    del again
    # FSDP2 (over a dp axis of 1 rank, enough to make it replace the parameters) keeps its own copy
    from torch.distributed.fsdp import fully_shard

    mesh2d = fxshard.init_mesh(dp=1, tp=2)
    wrapped = fxshard.shard(model, mesh2d["tp"], MLP_PLAN, example_inputs=(x, 1.0))
    fully_shard(wrapped, mesh=mesh2d["dp"])
    try:
        fxshard.shard(model, mesh2d["tp"], MLP_PLAN, example_inputs=(x, 1.0))
        out["fsdp2"] = None
    except ShardingError as e:
        out["fsdp2"] = str(e)
    return out


def _stale_state_dict(mesh) -> dict:
    """model.state_dict() and model(...) of a sharded model: as before until the ShardedModule changes its
    tensors, then a ShardingError (they would use the values from before: torch.save of the state dict saved an
    untrained model), also through a parent or a submodule; right again once the values are copied back, stale
    again after the next step; a copy of the model is its own."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sm = fxshard.shard(model, mesh, MLP_PLAN, example_inputs=(x, 1.0))
    out: dict = {"untouched": all(torch.equal(v, before[k]) for k, v in model.state_dict().items())}
    opt = torch.optim.SGD(sm.parameters(), lr=0.1)
    sm(x, 1.0).square().sum().backward()
    opt.step()
    out["after_step"] = _state_dict_error(model)
    out["parent"] = _state_dict_error(nn.ModuleDict({"inner": model}))
    out["forward"] = _error(lambda: model(x, 1.0))
    out["submodule_forward"] = _error(lambda: model.net1(x))  # a parent sharing it would call it
    own = {n: p.detach().clone() for n, p in model.net1.named_parameters()}
    torch.func.functional_call(model.net1, own, (x,))  # computes with the values it is given
    out["after_functional_call"] = _state_dict_error(model)  # ... and leaves the checks on
    model.load_state_dict({k: v for k, v in sm.full_state_dict().items() if k.startswith("net1.")}, strict=False)
    out["partial_load"] = _state_dict_error(model)  # net1 is current now, the rest still stale
    copied = copy.deepcopy(model)  # carries the hooks, but its tensors are its own: current by definition
    out["copy"] = (_error(lambda: copied(x, 1.0)), _state_dict_error(copied), len(copied._forward_pre_hooks))
    again = fxshard.shard(model, mesh, MLP_PLAN, example_inputs=(x, 1.0))  # sharding again reads no stale value
    out["shard_again"] = again.net1.weight is sm.net1.weight
    del again
    model.load_state_dict(sm.full_state_dict())
    sm(x, 1.0).square().sum().backward()  # nothing reads the model between the copy and the step
    opt.step()
    out["stale_again"] = _state_dict_error(model)
    model.load_state_dict(sm.full_state_dict())
    out["copied_back"] = all(torch.equal(model.state_dict()[k], v) for k, v in sm.full_state_dict().items())
    del sm, opt
    gc.collect()
    out["released"] = _state_dict_error(model)  # no ShardedModule holds them: the model is the only copy
    out["hooks_left"] = sum(len(m._forward_pre_hooks) + len(m._state_dict_pre_hooks) + len(m._load_state_dict_post_hooks)
                            for m in model.modules())
    out["pickle_names_fxshard"] = b"fxshard" in pickle.dumps(model)
    return out


def _error(fn) -> str | None:
    try:
        fn()
        return None
    except ShardingError as e:
        return str(e)


def _state_dict_error(m: nn.Module) -> str | None:
    return _error(m.state_dict)


def _cases(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    res = {f"{name}/{'split' if split else 'replicated'}": fn(mesh, split)
           for name, fn in (("seq2seq", _seq2seq), ("twice", _shard_twice)) for split in (False, True)}
    res["parent"] = _tied_parent(mesh)
    res["layouts"] = _layouts(mesh)
    res["stale_state_dict"] = _stale_state_dict(mesh)
    return res


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return run_ranks(_cases, 2, timeout=600)


@pytest.mark.parametrize("split", ["replicated", "split"])
def test_two_sharded_modules_sharing_an_embedding_train_it_as_eager(cases, split):
    for res in cases:
        r = res[f"seq2seq/{split}"]
        assert r["one_tensor"] and r["loss_err"] <= TOL and r["state_err"] <= TOL, r


@pytest.mark.parametrize("split", ["replicated", "split"])
def test_a_model_sharded_three_times_trains_one_set_of_tensors_as_eager(cases, split):
    for res in cases:
        r = res[f"twice/{split}"]
        assert r["shared"] and r["loss_err"] <= TOL and r["eval_err"] <= TOL and r["state_err"] <= TOL, r
        assert not r["warned"], r


def test_training_the_original_of_a_sharded_parameter_raises_while_the_module_lives(cases):
    for res in cases:
        r = res["parent"]
        assert r["raised"] is not None and "'proj." in r["raised"] and "ShardedModule(_Block)" in r["raised"], r
        assert "Shard the module that owns every use" in r["raised"], r
        assert r["trained_after"], r


def test_a_shared_tensor_laid_out_otherwise_raises_naming_both_layouts(cases):
    for res in cases:
        r = res["layouts"]
        assert r["plan"] is not None and "S(0) over 'tp'" in r["plan"] and "here it would be replicated" in r["plan"], r
        assert "same placement in both plans" in r["plan"], r
        assert r["converted"] is not None and "torch.float16" in r["converted"], r
        assert r["after_release"], r
        assert r["fsdp2"] is not None and "fully_shard" in r["fsdp2"], r


def test_an_optimizer_checks_every_module_holding_its_parameters_in_the_order_they_were_made(mesh2):
    """A module's gradient check at an optimizer step is a collective, so every rank must check the same modules
    in the same order. With a tensor shared by two modules, the step checked only one holder of it, whichever a
    WeakSet (ordered by object addresses, which differ between ranks) listed last."""
    from fxshard.state.optim_state import _CHECKED

    m = _Seq2Seq()
    s = torch.randint(0, 16, (2, 5))
    enc = fxshard.shard(m.enc, mesh2, {}, example_inputs=(s,))
    dec = fxshard.shard(m.dec, mesh2, {}, example_inputs=(s, torch.randn(2, 5, 8)))
    assert enc.emb.weight is dec.emb.weight
    opt = torch.optim.SGD(enc.parameters(), lr=0.1)
    opt.step()
    assert [ref() for ref in getattr(opt, _CHECKED).modules] == [enc, dec]


def test_the_state_dict_of_a_stale_sharded_model_raises(cases):
    for res in cases:
        r = res["stale_state_dict"]
        assert r["untouched"] and r["copied_back"] and r["shard_again"] and r["released"] is None, r
        for key in ("after_step", "stale_again", "parent"):
            assert r[key] is not None and "_Net.state_dict() would return stale values" in (r[key] or ""), (key, r)
            assert "net1.weight" in r[key] and "sm.full_state_dict()" in r[key], (key, r)
        assert "norm.running_mean" in r["after_step"] or " more" in r["after_step"], r
        assert "_Net.forward would compute with stale values" in (r["forward"] or ""), r
        assert "Linear.forward would compute with stale values of weight" in (r["submodule_forward"] or ""), r
        assert "Call the ShardedModule instead" in r["forward"], r
        assert r["copy"] == (None, None, 0), r  # the copy's hooks removed themselves at its first call
        assert r["after_functional_call"] is not None and r["partial_load"] is not None, r
        assert "net2.weight" in r["partial_load"] and "net1." not in r["partial_load"], r
        assert r["hooks_left"] == 0 and not r["pickle_names_fxshard"], r  # gone with the last ShardedModule
