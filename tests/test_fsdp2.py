"""Composing with torch's FSDP2 (and DDP) and its state-dict tooling.

* ``fully_shard`` over the dp axis of a module fxshard sharded on tp (the whole module as one group, and
  each layer its own group plus the root, as torchtitan does): 4 real gloo ranks on a (dp=2, tp=2)
  mesh, the reference is the unsharded model trained on the global batch (the dp ranks' local batches
  concatenated); its full state dict (``sm.full_state_dict()`` and torch's ``get_model_state_dict``) is the
  unsharded model's, and saving then loading it into a fresh composed module gives the same loss; a forward
  without gradients frees FSDP2's gathered parameters, and one with gradients never backpropagated changes
  neither the next step's loss nor its gradients (optimizer or module ``zero_grad``), nor does a second
  forward before one backward.
* the same with packed weights (gate/up blocks split on tp, ``Packed``): training, full state dicts, and a DCP
  round trip of the sharded state dict (same spawn);
* torch's DDP over the dp axis of a module fxshard sharded on tp trains like the unsharded model (same spawn);
* state dicts between fxshard and a plain FSDP2 model, both ways, through
  ``torch.distributed.checkpoint.state_dict`` (2 gloo ranks, forward and gradients against the unsharded model).
"""

from __future__ import annotations

import copy
import tempfile
import warnings

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import fxshard
from fxshard.core.placements import S
from fxshard.runtime.state_interop import local_slice
from tests import models
from tests.dist_utils import run_ranks
from tests.test_forward_parity import transformer_plan
from tests.test_training import train_on_local_batches

TOL = 1e-5
FULL = StateDictOptions(full_state_dict=True)


def _transformer(seed: int) -> models.TransformerWithLoss:
    torch.manual_seed(seed)
    return models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16)


def _state_err(got: dict, want: dict) -> float:
    """Max |difference| over ``want``'s keys; inf when keys or shapes differ."""
    if set(got) != set(want) or any(tuple(got[k].shape) != tuple(want[k].shape) for k in want):
        return float("inf")
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _fsdp2_over_dp(rank: int, world: int, path: str) -> dict:
    mesh = fxshard.init_mesh(dp=2, tp=2)
    return {"ddp": _ddp_run(mesh), "packed": _packed_run(mesh, path),
            **{per_layer: _fsdp2_run(mesh, per_layer) for per_layer in (False, True)}}


def _packed_run(mesh, path: str) -> dict:
    """fully_shard over dp of a module whose gate/up weights fxshard splits as packed blocks on tp: 2 SGD steps
    against the unsharded model, its full state dicts, and the same loss after its sharded state dict goes
    through DCP into a fresh composed module. (torch 2.11 read the composed (dp, tp) placements as a shard
    order and refused ``full_tensor()``.)"""
    import torch.distributed.checkpoint as dcp

    from tests.test_packed import CASES, PACKED_PLANS

    case, dp_rank = CASES["packed_moe"], mesh.get_coordinate()[0]
    model = case.make_model()
    x, y = case.make_inputs()
    batches = [(x, y), (x.flip(0), y.flip(0))]
    local = lambda b: tuple(t.chunk(2)[dp_rank] for t in b)  # noqa: E731

    def composed(m):
        sm = fxshard.shard(copy.deepcopy(m), mesh["tp"], PACKED_PLANS["packed_moe"], example_inputs=local(batches[0]))
        fully_shard(sm, mesh=mesh["dp"])
        return sm

    sm = composed(model)
    packed = any(isinstance(p, S) and p.outer > 1 for pls in sm.fxshard_state.layout.placements.values() for p in pls)
    worst = train_on_local_batches(model, sm, batches, local, steps=2, global_loss=lambda v: _dp_mean(mesh, v))
    want = model.state_dict()
    full_errs = [_state_err(sm.full_state_dict(), want), _state_err(get_model_state_dict(sm, options=FULL), want)]
    dcp.save(get_model_state_dict(sm), checkpoint_id=path)
    fresh = composed(case.make_model())
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state)
    with torch.no_grad():
        reload_err = abs(fresh(*local(batches[0])).item() - sm(*local(batches[0])).item())
    return {"packed": packed, "loss_err": worst, "full_errs": full_errs, "reload_err": reload_err}


def _dp_mean(mesh, loss: float) -> float:
    t = torch.tensor(loss)
    torch.distributed.all_reduce(t, group=mesh["dp"].get_group())
    return t.item() / 2


class _DpSetup:
    """The unsharded model, two global batches, this dp rank's half of a batch, and the mean over dp of a loss
    (equal local batches: the global mean is the mean of the local means)."""

    def __init__(self, mesh) -> None:
        self.mesh, dp_rank = mesh, mesh.get_coordinate()[0]
        self.model = _transformer(0)
        self.batches = [(models.make_tokens(4, 16, 64, seed=s), models.make_tokens(4, 16, 64, seed=s + 10))
                        for s in range(2)]
        self.local = lambda b: tuple(t.chunk(2)[dp_rank] for t in b)

    def dp_mean(self, loss: float) -> float:
        return _dp_mean(self.mesh, loss)

    def shard(self, m):
        return fxshard.shard(copy.deepcopy(m), self.mesh["tp"], transformer_plan(2),
                             example_inputs=self.local(self.batches[0]))

    def train(self, sm) -> float:
        """3 SGD steps of ``sm`` and the unsharded model (AdamW would turn the key bias's exactly-zero
        gradient into sign noise): max |loss difference|."""
        return train_on_local_batches(self.model, sm, self.batches, self.local, steps=3, global_loss=self.dp_mean)


def _ddp_run(mesh) -> dict:
    """torch DDP over dp around a module fxshard sharded on tp: 3 SGD steps against the unsharded model. DDP
    writes the averaged gradients after the backward's last hook: no gradient-changed-in-place warning
    (``fxshard/state/grad_guard.py`` records the gradients after DDP's writes)."""
    d = _DpSetup(mesh)
    sm = d.shard(d.model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        worst = d.train(DistributedDataParallel(sm, process_group=mesh["dp"].get_group()))
    ref = dict(d.model.named_parameters())
    param_err = max((p.detach() - local_slice(ref[n].detach(), mesh["tp"], sm._placements[n])).abs().max().item()
                    for n, p in sm.named_parameters())
    return {"loss_err": worst, "param_err": param_err,
            "warned": [str(w.message) for w in seen if "changed in place" in str(w.message)]}


def _fsdp2_run(mesh, per_layer: bool) -> dict:
    d = _DpSetup(mesh)
    model, batches, local, dp_mean = d.model, d.batches, d.local, d.dp_mean

    def composed(m):
        sm = d.shard(m)
        if per_layer:  # torchtitan's recipe: each block its own FSDP2 group, then the root
            for layer in sm.layers:
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(sm, mesh=mesh["dp"])
        return sm

    sm = composed(model)
    dp_sharded = all(isinstance(p, DTensor) for p in sm.parameters())
    groups = sum(isinstance(m, FSDPModule) for m in sm.modules())
    worst = d.train(sm)
    ref = dict(model.named_parameters())
    param_err = 0.0
    for name, p in sm.named_parameters():
        tp_local = p.full_tensor()  # gathered over dp: this rank's tp shard
        want = local_slice(ref[name].detach(), mesh["tp"], sm._placements[name])
        param_err = max(param_err, (tp_local - want).abs().max().item())

    # full state dicts are the trained unsharded model's (true shapes, not FSDP2's view of a tp shard)
    want = model.state_dict()
    torch_full = get_model_state_dict(sm, options=FULL)
    full_errs = [_state_err(sm.full_state_dict(), want), _state_err(torch_full, want)]
    # save -> load into a fresh composed module (other init) -> same loss as the trained one
    fresh = composed(_transformer(1))
    set_model_state_dict(fresh, torch_full, options=FULL)
    again = composed(_transformer(2))
    again.load_state_dict(get_model_state_dict(sm))  # sharded DTensors over (dp, tp), no gathering
    with torch.no_grad():
        b = local(batches[1])
        loss = sm(*b).item()
        reload_errs = [abs(fresh(*b).item() - loss), abs(again(*b).item() - loss)]
    freed = all(isinstance(p, DTensor) for p in sm.parameters())  # no gathered copies left after inference
    for m, b in ((model, batches[0]), (sm, local(batches[0]))):  # the gradient norm over (dp, tp) pieces
        m.zero_grad()
        m(*b).backward()
    norms = _norms(model, sm)
    return {"loss_err": worst, "param_err": param_err, "dp_sharded": dp_sharded, "full_errs": full_errs,
            "reload_errs": reload_errs, "groups": groups, "norms": norms, "freed": freed,
            "after_dangling": _after_dangling_forward(model, sm, batches[0], local, dp_mean)}


def _after_dangling_forward(model, sm, batch, local, dp_mean) -> list:
    """A forward with gradients never backpropagated leaves FSDP2's root group gathered. Then an SGD step and
    a training step, gradients cleared by the optimizer, then by ``zero_grad()`` of the module: per case the
    |loss difference| (stale gathered values would show) and both gradient norms (gradients accumulated onto
    the old ones would show); then two forwards summed and one backward. Requires gradients from a backward
    on ``model`` and ``sm``."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, sm)]
    out = []
    for clear in ("optimizer", "module"):
        sm(*local(batch))
        for o in opts:
            o.step()
        losses = []
        for m, o, b in ((model, opts[0], batch), (sm, opts[1], local(batch))):
            o.zero_grad() if clear == "optimizer" else m.zero_grad()
            loss = m(*b)
            loss.backward()
            losses.append(loss.item())
        out.append({"case": clear, "loss_err": abs(losses[0] - dp_mean(losses[1])), "norms": _norms(model, sm)})
    # two forwards, one backward: the second forward frees the gathered parameters the first one's graph
    # saved, and the backward must gather them again
    losses = []
    for m, b in ((model, batch), (sm, local(batch))):
        m.zero_grad()
        loss = m(*b) + m(*b)
        loss.backward()
        losses.append(loss.item())
    out.append({"case": "two forwards", "loss_err": abs(losses[0] - dp_mean(losses[1])), "norms": _norms(model, sm)})
    return out


def _norms(model, sm) -> list[float]:
    """The gradient norms of ``sm`` (over all its pieces) and of the unsharded ``model``."""
    return [sm.clip_grad_norm_(1e9).item(), torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()]


def test_fully_shard_over_dp_composes_with_fxshard_tp():
    """Whole-module ``fully_shard(sm)``, per-layer ``fully_shard(sm.layers[i])`` + root, and torch DDP over dp
    (as Megatron + DDP), one spawn."""
    with tempfile.TemporaryDirectory() as path:
        results = run_ranks(_fsdp2_over_dp, 4, path, timeout=600)
    for both in results:
        ddp, packed = both.pop("ddp"), both.pop("packed")
        assert packed["packed"] and packed["loss_err"] <= 1e-4 and max(packed["full_errs"]) <= TOL, packed
        assert packed["reload_err"] <= TOL, packed
        assert ddp["loss_err"] <= 1e-4 and ddp["param_err"] <= TOL and ddp["warned"] == [], ddp
        for per_layer, res in both.items():
            assert res["groups"] == (3 if per_layer else 1), res
            assert res["dp_sharded"], res
            assert res["loss_err"] <= 1e-4 and res["param_err"] <= TOL, res
            assert max(res["full_errs"]) <= TOL, res  # inf if a key or shape differed
            assert max(res["reload_errs"]) <= TOL, res
            assert abs(res["norms"][0] - res["norms"][1]) <= 1e-5 * res["norms"][1], (per_layer, res["norms"])
            assert res["freed"], res
            for case in res["after_dangling"]:
                assert case["loss_err"] <= 1e-4, (per_layer, case)
                assert abs(case["norms"][0] - case["norms"][1]) <= 1e-5 * case["norms"][1], (per_layer, case)


def _loss_and_grads(m, batch, grad_of) -> tuple[float, dict]:
    m.zero_grad()
    loss = m(*batch)
    loss.backward()
    return loss.item(), {n: grad_of(n, p) for n, p in m.named_parameters()}


def _with_plain_fsdp2(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    ref = _transformer(0)
    batch = (models.make_tokens(2, 16, 64, seed=0), models.make_tokens(2, 16, 64, seed=1))
    want_loss, want_grads = _loss_and_grads(ref, batch, lambda n, p: p.grad)

    def fxs(seed: int):
        return fxshard.shard(_transformer(seed), mesh, transformer_plan(2), example_inputs=batch)

    def fxs_check(sm) -> dict:
        loss, grads = _loss_and_grads(sm, batch, lambda n, p: sm._dtensor(n, p.grad).full_tensor())
        return {"loss": abs(loss - want_loss), "grads": _state_err(grads, want_grads)}

    def fsdp2(seed: int):
        m = _transformer(seed)
        fully_shard(m, mesh=mesh)
        return m

    out = {}
    sm = fxs(0)
    full = get_model_state_dict(sm, options=FULL)
    out["full"] = _state_err(full, ref.state_dict())
    # fxshard's full state dict -> a model under fully_shard
    plain = fsdp2(1)
    set_model_state_dict(plain, full, options=FULL)
    loss, grads = _loss_and_grads(plain, batch, lambda n, p: p.grad.full_tensor())
    out["into_fsdp2"] = {"loss": abs(loss - want_loss), "grads": _state_err(grads, want_grads)}
    # FSDP2's sharded state dict (DTensors split on dim 0 over the mesh) -> fxshard, and its full one
    sm2 = fxs(1)
    set_model_state_dict(sm2, get_model_state_dict(plain))
    out["from_fsdp2_sharded"] = fxs_check(sm2)
    sm3 = fxs(2)
    set_model_state_dict(sm3, get_model_state_dict(plain, options=FULL), options=FULL)
    out["from_fsdp2_full"] = fxs_check(sm3)
    sm4 = fxs(3)
    sm4.load_state_dict(ref.state_dict())  # a plain full state dict
    out["from_full"] = fxs_check(sm4)
    return out


def test_state_dicts_round_trip_with_plain_fsdp2():
    for res in run_ranks(_with_plain_fsdp2, 2, timeout=240):
        assert res["full"] == 0.0, res
        for case in ("into_fsdp2", "from_fsdp2_sharded", "from_fsdp2_full", "from_full"):
            assert res[case]["loss"] <= TOL and res[case]["grads"] <= TOL, (case, res)
