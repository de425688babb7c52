"""Runtime semantics that must match eager or fail loudly, never silently differ.

* modes: ``sm.train()``/``sm.eval()`` and a submodule's mode are followed (dropout, BatchNorm), in
  both directions, against the unsharded model, and BatchNorm with ``momentum=None`` (a cumulative
  average) trains as eager, batch or channels split; BatchNorm in a sharded block under a parent's
  ``torch.utils.checkpoint`` updates its statistics in the recompute too, as eager (2 gloo ranks);
* values: parameters and buffers come from ``src_data_rank`` (rank 0) like torch's ParallelStyles,
  also through ``init_parameters`` and on a 2x2 mesh, and with ``src_data_rank=None`` replicated
  values that differ raise (2 and 4 gloo ranks, unseeded models);
* unfilled: a meta-built model that was never filled raises at its first call; legitimate fills
  (in-place writes, ``.data``, DCP) do not (2 gloo ranks);
* inputs: a replicated input whose values differ between ranks raises at the first call (a per-process
  data loader under tensor parallelism), also a jitted function's argument; declared split, per-rank
  pieces run (2 gloo ranks);
* ``fxshard.jit``: global-shaped arguments raise; ``fxshard.constrain`` inside jit inserts the same
  collectives as under ``shard()`` (fake process group) with the right numbers (2 gloo ranks);
* timeouts: a rank that skips a forward or a backward makes its peer raise a ShardingError naming
  the program and the collective (2 gloo ranks, short timeout);
* call-time and spec errors name what was given and how to fix it (fake process group), and
  ``torch.autocast`` around a call of a module sharded without it, or a jitted call, raises, and so does setting a traced
  attribute (a dropout's ``p``) on the module or a submodule's stand-in, and so does a call after a parameter
  was replaced by one of another shape or parametrized on its stand-in after ``shard()`` (fake process group).
"""

from __future__ import annotations

import copy
import re
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel, ShardingError
from tests import models
from tests.dist_utils import run_ranks

TOL = 1e-5
TOY_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}


def x8(seed: int = 0) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- call-time errors (fake group)


class _Kw(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * mask + bias


def test_call_errors_name_the_argument_and_the_fix(mesh2):
    sm = fxshard.shard(models.ToyModel(16, 32), mesh2, TOY_PLAN, example_inputs=(x8(),))
    with pytest.raises(ShardingError, match=r"input 0 has dtype torch.float64, but the module was sharded for "
                                            r"torch.float32 .*cast the input \(x.to\(torch.float32\)\)"):
        sm(x8().double())
    with pytest.raises(ShardingError, match=r"input 0 is a meta tensor: it has a shape but no data.*pass real tensors"):
        sm(x8().to("meta"))
    with pytest.raises(ShardingError, match=r"ShardedModule\(ToyModel\) was called with 2 positional argument\(s\) "
                                            r"and keyword arguments \[\], but it was sharded for 1 positional"):
        sm(x8(), x8())
    with pytest.raises(ShardingError, match=r"keyword arguments \['y'\], but it was sharded for 1 positional "
                                            r"argument\(s\) and keyword arguments \[\]"):
        sm(x8(), y=x8())
    with pytest.raises(ShardingError, match=r"positional argument 0 is a float, but the example was a tensor"):
        sm(3.0)
    with pytest.raises(ShardingError, match=r"positional argument 0 is a tuple of 2 items, but the example was one "
                                            r"value"):
        sm((x8(), x8()))


def test_a_module_converted_to_another_dtype_after_shard_raises(mesh2):
    """The programs were traced for the parameters' dtypes: sm.to(bfloat16) would fail deep inside (or promote
    silently in elementwise ops); the call names the parameter and the fix, and converting back works."""
    model = models.ToyModel(16, 32).requires_grad_(False)
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {}, example_inputs=(x8(),))
    sm.to(torch.bfloat16)
    with pytest.raises(ShardingError, match=r"ShardedModule\(ToyModel\): net1.weight has dtype torch.bfloat16, but "
                                            r"the module was sharded with it in torch.float32.*convert the model before "
                                            r"shard\(\) \(model.to\(torch.bfloat16\)\), or convert this module back"):
        sm(x8())
    sm.to(torch.float32)  # the values keep bfloat16's rounding, as the unsharded model's do
    model.to(torch.bfloat16).to(torch.float32)
    torch.testing.assert_close(sm(x8()), model(x8()))  # replicated plan: the fake group's collectives are exact


def test_a_parameter_assigned_with_another_shape_raises(mesh2):
    """A split parameter replaced by a full-shaped one failed deep inside the program with an expand
    RuntimeError; the call names the parameter, both shapes and the layout, and the loading it suggests works."""
    sm = fxshard.shard(models.ToyModel(16, 32), mesh2, {"net1": ColwiseParallel(), "net2": RowwiseParallel()},
                       example_inputs=(x8(),))
    full = torch.randn(32, 16)
    sm.net1.weight = nn.Parameter(full.clone())
    with pytest.raises(ShardingError, match=r"net1.weight has shape \[32, 16\] on this rank, but the programs were "
                                            r"traced for this rank's part of it, of shape \[16, 16\] \(global \[32, 16\], "
                                            r"split S\(0\) over 'tp'\); load a full value with sm.load_state_dict"):
        sm(x8())
    sm.net1.weight = nn.Parameter(torch.empty(16, 16))
    sm.load_state_dict({"net1.weight": full}, strict=False)
    assert torch.equal(sm.net1.weight, full[:16])  # rank 0's part
    sm(x8()).sum().backward()


def test_keyword_order_does_not_matter(mesh2):
    model = _Kw().requires_grad_(False)
    x, mask, bias = x8(), (x8(1) > 0).float(), x8(2)
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {}, example_inputs=(x,), example_kwargs={"mask": mask, "bias": bias})
    # the same call with keywords in another order (replicated plan: the fake group's no-op collectives are exact)
    torch.testing.assert_close(sm(x, bias=bias, mask=mask), model(x, mask=mask, bias=bias))
    with pytest.raises(ShardingError, match=r"keyword arguments \['mask'\], but it was sharded for 1 positional "
                                            r"argument\(s\) and keyword arguments \['bias', 'mask'\]"):
        sm(x, mask=mask)


def test_out_specs_structure_error_describes_the_output(mesh2):
    with pytest.raises(ShardingError, match=r"out_specs: spec \(P\('tp'\), P\('tp'\)\) does not fit output 0 \(a tensor "
                                            r"of shape \[8, 16\]\): a tuple/list of specs describes a tuple/list"):
        fxshard.shard(models.ToyModel(16, 32), mesh2, {}, example_inputs=(x8(),), out_specs=(P("tp"), P("tp")))
    with pytest.raises(ShardingError, match=r"in_specs: 2 specs given for a tuple of 1 values"):
        fxshard.shard(models.ToyModel(16, 32), mesh2, {}, example_inputs=(x8(),), in_specs=(P("tp"), P("tp")))


def test_load_sharded_state_dict_of_the_wrong_shape(mesh2):
    sm = fxshard.shard(models.ToyModel(16, 32), mesh2, TOY_PLAN, example_inputs=(x8(),))
    full = models.ToyModel(16, 32).state_dict()
    with pytest.raises(ShardingError, match=r"load_sharded_state_dict: net1.weight is \(32, 16\) on this rank, but "
                                            r"its local shard is \(16, 16\); pass sm.sharded_state_dict\(\)"):
        sm.load_sharded_state_dict(full)


def test_bad_src_data_rank_and_timeout(mesh2):
    with pytest.raises(ShardingError, match=r"src_data_rank=2 is not a coordinate on every axis of the mesh"):
        fxshard.shard(models.ToyModel(16, 32), mesh2, TOY_PLAN, example_inputs=(x8(),), src_data_rank=2)
    with pytest.raises(ShardingError, match=r"init_mesh: timeout=-1; give seconds"):
        fxshard.init_mesh(tp=2, timeout=-1)


# ----------------------------------------------------------------------------- modes (fake group)


class ModeNet(nn.Module):
    """Dropout, BatchNorm and a ``self.training`` branch: everything that reads a module's mode."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.net1, self.bn, self.net2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 16)
        self.drop1, self.drop2 = nn.Dropout(0.5), nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop1(torch.relu(self.bn(self.net1(x))))
        return self.drop2(self.net2(h))


def _random_ops(sm) -> int:
    return sum(1 for p in sm._programs() for n in p.gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
               and torch.Tag.nondeterministic_seeded in n.target.tags)


def test_mode_changes_reshard_once_per_combination(mesh2):
    sm = fxshard.shard(ModeNet(), mesh2, {}, example_inputs=(x8(),))
    assert isinstance(sm.bn, nn.BatchNorm1d) and type(sm.bn).__name__ == "BatchNorm1d" and "BatchNorm1d" in repr(sm)
    assert _random_ops(sm) > 0
    sm.eval()
    sm(x8())
    assert _random_ops(sm) == 0 and len(sm._by_mode) == 2
    assert sm._traced.mutations == []  # eval BatchNorm leaves its running statistics alone
    sm.train()
    sm(x8())
    assert _random_ops(sm) > 0 and len(sm._by_mode) == 2  # cached: no third program
    sm.drop1.eval()
    sm(x8())
    assert len(sm._by_mode) == 3
    with pytest.raises(ShardingError, match=r"the Dropout 'drop1' inside a ShardedModule cannot run on its own"):
        sm.drop1(x8())


# ----------------------------------------------------------------------------- fxshard.jit (fake group)


def _matmul_gathered(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return fxshard.constrain(x @ w, P(None, None))


class _MatmulGathered(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul_gathered(x, self.w)


def test_constrain_inside_jit_inserts_what_shard_does(mesh2):
    x, w = x8(), torch.randn(16, 8)
    sm = fxshard.shard(_MatmulGathered(w).requires_grad_(False), mesh2, {}, example_inputs=(x,),
                       in_specs=(P("tp", None),), out_specs=P("tp", None))
    sf = fxshard.jit(_matmul_gathered, mesh2, in_specs=(P("tp", None), None), out_specs=P("tp", None),
                     example_inputs=(x, w))
    want = {"forward": {"all_gather": {"count": 1, "bytes": 8 * 8 * 4}}, "backward": {}}
    assert fxshard.comm_stats(sm) == want
    assert fxshard.comm_stats(sf) == want


def test_jit_rejects_global_shaped_arguments(mesh2):
    def scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w) * 2

    x, w = x8(), torch.randn(16, 8)
    sf = fxshard.jit(scaled, mesh2, in_specs=(P("tp", None), None), out_specs=P("tp", None))
    sf(x.chunk(2)[0], w)  # local pieces: traced for global [8, 16]
    with pytest.raises(ShardingError, match=r"argument x has shape \[8, 16\], the GLOBAL shape it was traced for "
                                            r"\(laid out S\(0\) over the mesh \{'tp': 2\}\); a jitted function takes "
                                            r"each rank's LOCAL piece, here of shape \[4, 16\]"):
        sf(x, w)
    assert len(sf._cache) == 1
    with pytest.raises(ShardingError, match=r"argument x is a meta tensor: it has a shape but no data"):
        sf(x.chunk(2)[0].to("meta"), w)
    sf.lower(torch.randn(16, 16), w)  # a genuinely new local size [8, 16], traced on purpose: then it runs
    assert sf(x, w).shape == (8, 8) and len(sf._cache) == 2


def test_a_parametrization_registered_after_shard_raises(mesh2):
    """spectral_norm/weight_norm registered on a stand-in after shard() computed from the local shard (measured
    on 2 ranks: output 0.129 off eager for spectral_norm, no error); the next call names the tensor and the fix.
    One registered on the model before shard() keeps working, and so does substituting tensors (functional_call)."""
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    plan = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
    for parametrize, name in ((spectral_norm, "net1"), (weight_norm, "net2")):
        sm = fxshard.shard(models.ToyModel(16, 32), mesh2, plan, example_inputs=(x8(),))
        parametrize(getattr(sm, name))
        split = "S(0)" if name == "net1" else "S(1)"
        with pytest.raises(ShardingError, match=rf"{name}.weight was parametrized after shard\(\) .* \({name}.weight "
                                                rf"is split {re.escape(split)} over 'tp'\).* Register the "
                                                rf"parametrization on the model before shard\(\)"):
            sm(x8())
    model = weight_norm(models.ToyModel(16, 32).net1)
    sm = fxshard.shard(nn.Sequential(model), mesh2, {"0": ColwiseParallel()}, example_inputs=(x8(),))
    sm(x8())
    functional_call(sm, {k: v.detach().clone() for k, v in sm.named_parameters()}, (x8(),))


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop, self.norm, self.scale = nn.Linear(16, 32), nn.Dropout(0.5), nn.LayerNorm(32), 2.0
        self.sizes = [16, 32]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.drop(self.lin(x))) * self.scale


def test_setting_a_traced_attribute_raises(mesh2):
    """A dropout's ``p``, a norm's ``eps`` and the model's own ``scale`` were constants to the trace: setting
    one on the ShardedModule or a stand-in raises (it would change nothing); modes, parameters and new
    names are set as on any module."""
    sm = fxshard.shard(_Scaled(), mesh2, {"lin": ColwiseParallel()}, example_inputs=(x8(),))
    with pytest.raises(ShardingError, match=r"setting 'p' on the Dropout 'drop' inside a ShardedModule would change "
                                            r"nothing.*Set 'p' on the original model and shard it again"):
        sm.drop.p = 0.0
    with pytest.raises(ShardingError, match=r"setting 'eps' on the LayerNorm 'norm'"):
        sm.norm.eps = 1e-3
    with pytest.raises(ShardingError, match=r"setting 'scale' on ShardedModule\(_Scaled\) would change nothing"):
        sm.scale = 1.0
    # reading one: an immutable value reads as traced (DDP reads an Embedding's sparse); a mutable one (an HF
    # model's config is the common case) is not carried and says why, and hasattr is False for it
    assert (sm.scale, sm.drop.p, sm.norm.eps) == (2.0, 0.5, 1e-5) and hasattr(sm, "scale")
    with pytest.raises(AttributeError, match=r"ShardedModule\(_Scaled\) does not carry the original module's "
                                             r"plain attribute 'sizes': its value is mutable.*Read it from the "
                                             r"original model"):
        sm.sizes
    assert not hasattr(sm, "sizes") and not hasattr(sm, "no_such_name")
    sm.drop.eval()
    sm.drop.note, sm.tag = "kept", "mine"  # names the model did not have
    sm.norm.weight = nn.Parameter(torch.full((32,), 2.0))  # a tensor: registered as on any module
    assert not sm.drop.training and (sm.drop.note, sm.tag) == ("kept", "mine")
    assert torch.equal(sm.norm.weight, torch.full((32,), 2.0))


def test_autocast_raises_at_call_and_jit(mesh2):
    """A module sharded without autocast holds no autocast casts: under autocast a call would not compute what
    eager does (tests/test_mixed_precision.py shards under it); fxshard.jit refuses autocast."""
    model = _Kw().requires_grad_(False)
    x, mask, bias = x8(), (x8(1) > 0).float(), x8(2)
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {}, example_inputs=(x,), example_kwargs={"mask": mask, "bias": bias})
    sf = fxshard.jit(lambda a, w: a @ w, mesh2, in_specs=(P("tp", None), None), out_specs=P("tp", None))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ShardingError, match=r"ShardedModule\(_Kw\) was called under torch.autocast\('cpu', "
                                                r"dtype=torch.bfloat16\), but its programs were traced under no "
                                                r"autocast .*call shard\(\) inside the same"):
            sm(x, mask=mask, bias=bias)
        with pytest.raises(ShardingError, match=r"was called: torch.autocast is enabled for 'cpu'"):
            sf(x.chunk(2)[0], torch.randn(16, 8))
        with torch.autocast("cpu", enabled=False):  # outside autocast: eager's float32 result
            torch.testing.assert_close(sm(x, mask=mask, bias=bias), model(x, mask=mask, bias=bias))


# ----------------------------------------------------------------------------- 2 gloo ranks: numerics


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def _modes(rank: int, world: int, mesh) -> dict:
    """ModeNet data parallel (batch split, statistics global): every mode switch against eager."""
    x = x8()
    local = x.chunk(world)[rank]
    out: dict = {}

    def step(name: str, ref: nn.Module, sm: nn.Module, seed: int) -> None:
        for m in (ref, sm):
            m.zero_grad()
        torch.manual_seed(seed)
        r = ref(x)
        r.square().sum().backward()
        torch.manual_seed(seed)
        s = sm(local)
        s.square().sum().backward()  # local loss pieces: the backward all-reduces the replicated gradients
        grads = {n: p.grad for n, p in ref.named_parameters()}
        out[name] = max([_err(s, r.chunk(world)[rank])] + [_err(p.grad, grads[n]) for n, p in sm.named_parameters()])

    ref = ModeNet()
    sm = fxshard.shard(copy.deepcopy(ref), mesh, {}, example_inputs=(x,), in_specs=(P("tp", None),),
                       out_specs=P("tp", None))
    step("train", ref, sm, 1)
    ref.eval(), sm.eval()
    step("eval", ref, sm, 2)
    ref.train(), sm.train()
    step("train_again", ref, sm, 3)
    ref.drop1.eval(), sm.drop1.eval()  # one submodule only: drop2 and BatchNorm still train
    step("drop1_eval", ref, sm, 4)
    ref.bn.eval(), sm.bn.eval()
    step("bn_eval_too", ref, sm, 5)
    full = sm.full_state_dict()
    out["state"] = max(_err(full[k].float(), v.float()) for k, v in ref.state_dict().items())

    ref = ModeNet().eval()  # sharded in eval mode, then trained
    sm = fxshard.shard(copy.deepcopy(ref), mesh, {}, example_inputs=(x,), in_specs=(P("tp", None),),
                       out_specs=P("tp", None))
    step("sharded_in_eval", ref, sm, 6)
    ref.train(), sm.train()
    step("then_train", ref, sm, 7)
    full = sm.full_state_dict()
    out["state_after_eval_then_train"] = max(_err(full[k].float(), v.float()) for k, v in ref.state_dict().items())
    return out


class CumulativeBN(nn.Module):
    """BatchNorm with ``momentum=None``: its running statistics are a cumulative average, whose factor torch
    computes as a Python number from ``num_batches_tracked`` (torch.export stopped on that before)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.net1, self.bn, self.net2 = nn.Linear(16, 32), nn.BatchNorm1d(32, momentum=None), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(torch.relu(self.bn(self.net1(x))))


def _cumulative_bn(rank: int, world: int, mesh) -> dict:
    """CumulativeBN data parallel (batch split) and tensor parallel (channels split), three training steps with
    different batches then eval, against eager: outputs, gradients, running statistics, batch count (relative errors)."""
    out: dict = {}

    def _rel(a: torch.Tensor, b: torch.Tensor) -> float:  # gradients of a squared sum reach ~100
        return _err(a, b) / max(1.0, b.abs().max().item())

    for name, plan, specs in (("data", {}, dict(in_specs=(P("tp", None),), out_specs=P("tp", None))),
                              ("tensor", TOY_PLAN, {})):
        ref = CumulativeBN()
        model = copy.deepcopy(ref)
        sm = fxshard.shard(model, mesh, plan, example_inputs=(x8(),), **specs)
        out[f"{name}_restored"] = "forward" not in model.bn.__dict__  # torch's forward again after the trace
        errs = []
        for seed in (1, 2, 3, 4):
            if seed == 4:
                ref.eval(), sm.eval()
            x = x8(seed) + 0.5 * seed  # statistics that move between batches
            for m in (ref, sm):
                m.zero_grad()
            r = ref(x)
            s = sm(x.chunk(world)[rank] if specs else x)
            r.square().sum().backward()
            s.square().sum().backward()
            full = sm.full_state_dict()
            errs.append(max(_rel(s, r.chunk(world)[rank] if specs else r),
                            *(_rel(full[k].float(), v.float()) for k, v in ref.state_dict().items())))
            errs.append(max(_rel(sm._dtensor(n, p.grad).full_tensor(), ref.get_parameter(n).grad)
                            for n, p in sm.named_parameters()))
        out[name] = max(errs)
        out[f"{name}_batches"] = int(sm.bn.num_batches_tracked)
    return out


class _BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.bn1 = nn.Linear(16, 32), nn.BatchNorm1d(32)
        self.net2, self.bn2 = nn.Linear(32, 16), nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.net2(torch.relu(self.bn1(self.net1(x)))))


class _CheckpointedParent(nn.Module):
    """An unsharded layer, then a block (sharded in the test) under torch.utils.checkpoint."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp, self.block, self.reentrant = nn.Linear(16, 16), _BNBlock(), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)


def _checkpointed(rank: int, world: int, mesh) -> dict:
    """A sharded block with BatchNorms (train mode) under a parent's checkpoint: the recompute updates the running
    statistics again in eager (non-reentrant: its early stop used to cut the sharded recompute before the update),
    so after two SGD steps the states, losses and gradients must match eager's."""
    out: dict = {}
    for reentrant in (False, True):
        torch.manual_seed(0)
        ref = _CheckpointedParent(reentrant)
        model = copy.deepcopy(ref)
        model.block = fxshard.shard(model.block, mesh, TOY_PLAN, example_inputs=(x8().requires_grad_(),))
        errs = []
        for m in (ref, model):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            for seed in (1, 2):
                opt.zero_grad()
                (m(x8(seed) + seed) ** 2).mean().backward()
                opt.step()
        full = model.block.full_state_dict()
        errs += [_err(full[k].float(), v.float()) for k, v in ref.block.state_dict().items()]
        errs += [_err(model.inp.weight, ref.inp.weight), _err(model.inp.weight.grad, ref.inp.weight.grad)]
        out[f"reentrant={reentrant}"] = max(errs)
        out[f"reentrant={reentrant}_batches"] = (int(model.block.bn1.num_batches_tracked),
                                                int(ref.block.bn1.num_batches_tracked))
    return out


def _unseeded(rank: int) -> nn.Module:
    torch.manual_seed(100 + rank)  # a different model on every rank, as an unseeded init gives
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


SEQ_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _values(rank: int, world: int, mesh) -> dict:
    x = x8()
    model = _unseeded(rank)
    out: dict = {"model": model.state_dict(), "model_out": model(x).detach()}
    sm = fxshard.shard(copy.deepcopy(model), mesh, SEQ_PLAN, example_inputs=(x,))
    out["full"], out["out"] = sm.full_state_dict(), sm(x).detach()
    try:
        fxshard.shard(copy.deepcopy(model), mesh, SEQ_PLAN, example_inputs=(x,), src_data_rank=None)
        out["kept_error"] = None
    except ShardingError as e:
        out["kept_error"] = str(e)
    same = models.ToyModel(16, 32)  # seeded: the same everywhere, so keeping local values is fine
    sm = fxshard.shard(same, mesh, TOY_PLAN, example_inputs=(x,), src_data_rank=None)
    out["kept_same_err"] = _err(sm(x), same(x))

    torch.manual_seed(200 + rank)  # an unseeded init_parameters on a meta-built model
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    sm = fxshard.shard(meta, mesh, SEQ_PLAN, example_inputs=(x,))
    sm.init_parameters(lambda name, t: t.normal_(0.0, 0.1))  # outputs ~1: TOL is absolute
    out["init_full"] = sm.full_state_dict()
    out["init_out"] = sm(x).detach()
    return out


def _unfilled(rank: int, world: int, mesh, path: str) -> dict:
    x = x8()
    ref = models.ToyModel(16, 32)
    src = fxshard.shard(copy.deepcopy(ref), mesh, TOY_PLAN, example_inputs=(x,))
    import torch.distributed.checkpoint as dcp

    dcp.save(src.sharded_state_dict(), checkpoint_id=path)
    out: dict = {}
    with torch.device("meta"):
        meta = models.ToyModel(16, 32)
    sm = fxshard.shard(meta, mesh, TOY_PLAN, example_inputs=(x,))
    errors = []
    for _ in range(2):
        try:
            sm(x)
        except ShardingError as e:
            errors.append(str(e))
        with torch.no_grad():
            if len(errors) == 1:  # fill three of four the ways users do: copy_, nn.init, a write through .data
                sm.net1.weight.copy_(src.net1.weight)
                nn.init.constant_(sm.net1.bias, 0.5)
                sm.net2.weight.data.copy_(src.net2.weight.data)
    out["errors"] = errors
    with torch.no_grad():
        sm.net2.bias.data = src.net2.bias.detach().clone()  # replaced storage: no version bump, still a fill
        ref.net1.bias.fill_(0.5)
    out["filled_err"] = _err(sm(x), ref(x))

    with torch.device("meta"):
        meta = models.ToyModel(16, 32)
    sm = fxshard.shard(meta, mesh, TOY_PLAN, example_inputs=(x,))
    dcp.load(sm.sharded_state_dict(), checkpoint_id=path)  # in place into sm's shards: no further call needed
    out["dcp_err"] = _err(sm(x), src(x))
    return out


def _jit_constrain(rank: int, world: int, mesh) -> dict:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)

    def loss_fn(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return _matmul_gathered(x, w).softmax(0).square().mean()

    def step(w: torch.Tensor, x: torch.Tensor) -> tuple:
        grad, loss = grad_and_value(loss_fn)(w, x)
        return loss, grad

    # the greedy sweep keeps x split up to the matmul, so the constraint is what gathers (the global planner
    # gathers x instead: the weight gradient then needs no all_reduce)
    sf = fxshard.jit(step, mesh, in_specs=(None, P("tp", None)), out_specs=(None, None), planner="greedy")
    loss, grad = sf(w, x.chunk(world)[rank])
    ref_loss, ref_grad = step(w, x)
    why = [(c["kind"], c["op"]) for c in fxshard.report.inspect.collectives(sf._programs()[0])]
    return {"loss_err": _err(loss, ref_loss), "grad_err": _err(grad, ref_grad), "collectives": why}


def _inputs(rank: int, world: int, mesh) -> dict:
    """Each rank passing its own batch where the input is replicated (a per-process data loader): the
    TP program mixed the batches (no model's output); declared split, the same pieces are fine."""
    model = models.ToyModel(16, 32)
    mine = x8(seed=10 + rank)
    sm = fxshard.shard(copy.deepcopy(model), mesh, TOY_PLAN, example_inputs=(x8(),))
    try:
        sm(mine)
        out: dict = {"replicated_differs": "no error"}
    except ShardingError as e:
        out = {"replicated_differs": str(e)}
    sm = fxshard.shard(copy.deepcopy(model), mesh, {}, example_inputs=(torch.cat([x8(10), x8(11)]),),
                       in_specs=(P("tp"),), out_specs=P("tp"))
    out["split_err"] = _err(sm(mine), model(mine))

    def project(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return v @ w

    sf = fxshard.jit(project, mesh, in_specs=(P(None, "tp"), None), out_specs=P(None, "tp"))
    try:
        sf(torch.ones(16, 4), mine)
        out["jit_differs"] = "no error"
    except ShardingError as e:
        out["jit_differs"] = str(e)
    return out


def _semantics(rank: int, world: int, path: str) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    return {"modes": _modes(rank, world, mesh), "values": _values(rank, world, mesh),
            "unfilled": _unfilled(rank, world, mesh, path), "jit": _jit_constrain(rank, world, mesh),
            "inputs": _inputs(rank, world, mesh), "cumulative_bn": _cumulative_bn(rank, world, mesh),
            "checkpointed": _checkpointed(rank, world, mesh)}


@pytest.fixture(scope="module")
def semantics() -> list[dict]:
    with tempfile.TemporaryDirectory() as path:
        return run_ranks(_semantics, 2, path, timeout=400)


def test_modes_follow_the_module_in_both_directions(semantics):
    for res in semantics:
        modes = res["modes"]
        for step in ("train", "eval", "train_again", "drop1_eval", "bn_eval_too", "sharded_in_eval", "then_train",
                     "state", "state_after_eval_then_train"):
            assert modes[step] <= TOL, (step, modes)


def test_batch_norm_with_cumulative_average_trains_as_eager(semantics):
    for res in semantics:
        got = res["cumulative_bn"]
        assert got["data"] <= TOL and got["tensor"] <= TOL, got
        assert got["data_batches"] == got["tensor_batches"] == 3, got  # three training calls, the eval one not
        assert got["data_restored"] and got["tensor_restored"], got


def test_batch_norm_under_a_parents_checkpoint_updates_as_eager(semantics):
    for res in semantics:
        got = res["checkpointed"]
        for reentrant in (False, True):
            assert got[f"reentrant={reentrant}"] <= TOL, got
            assert got[f"reentrant={reentrant}_batches"] == (4, 4), got  # two steps, each recomputed once


def test_values_come_from_rank_0_by_default(semantics):
    rank0 = semantics[0]["values"]
    for res in semantics:
        v = res["values"]
        # the full model is rank 0's, on every rank, and so is every output
        assert max(_err(v["full"][k], rank0["model"][k]) for k in rank0["model"]) == 0.0
        assert _err(v["out"], rank0["model_out"]) <= TOL
        # an unseeded init_parameters gives every rank rank 0's draws: full tensors agree and the model runs them
        assert max(_err(v["init_full"][k], rank0["init_full"][k]) for k in rank0["init_full"]) == 0.0
        ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        ref.load_state_dict(rank0["init_full"])
        assert _err(v["init_out"], ref(x8())) <= TOL
        assert v["kept_same_err"] <= TOL
    assert _err(semantics[1]["values"]["model"]["2.bias"], rank0["model"]["2.bias"]) > 0  # the ranks did differ


def test_src_data_rank_none_names_replicated_values_that_differ(semantics):
    for res in semantics:
        msg = res["values"]["kept_error"]
        assert msg is not None and "replicated values differ between ranks: 2.bias (rank" in msg, msg
        assert "replicated on mesh axis 'tp'" in msg and "src_data_rank=0" in msg, msg
        assert "0.weight" not in msg and "0.bias" not in msg and "2.weight" not in msg, msg  # split: may differ


def test_a_replicated_input_that_differs_between_ranks_raises(semantics):
    for res in semantics:
        msg = res["inputs"]["replicated_differs"]
        assert "replicated values differ between ranks: input 0 (rank " in msg, msg
        assert "replicated on mesh axis 'tp'" in msg and "in_specs=P('dp')" in msg, msg
        assert res["inputs"]["split_err"] <= TOL, res["inputs"]
        msg = res["inputs"]["jit_differs"]
        assert "replicated values differ between ranks: project: argument v (rank " in msg, msg


def test_unfilled_meta_parameters_raise_until_written(semantics):
    for res in semantics:
        first, second = res["unfilled"]["errors"]
        assert "before 4 of its 4 parameters/buffers were filled: net1.weight, net1.bias, net2.weight, net2.bias" \
            in first and "sm.init_parameters(fn)" in first, first
        assert "before 1 of its 4 parameters/buffers were filled: net2.bias came from a model built on the meta" \
            in second, second
        assert res["unfilled"]["filled_err"] <= TOL and res["unfilled"]["dcp_err"] <= TOL


def test_constrain_inside_jit_numerics(semantics):
    for res in semantics:
        j = res["jit"]
        assert j["loss_err"] <= TOL and j["grad_err"] <= TOL, j
        assert j["collectives"].count(("all_gather", "constraint")) == 1, j  # the constraint's gather of x @ w


# ----------------------------------------------------------------------------- 2 gloo ranks: a rank skips a call


def _skipped_calls(rank: int, world: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mesh = fxshard.init_mesh(tp=world)
    x = x8()
    tp = fxshard.shard(models.ToyModel(16, 32), mesh, TOY_PLAN, example_inputs=(x,))  # all_reduce in forward
    tp(x)  # the first call also compares the replicated input across ranks: done while both ranks call
    # data parallel on a second group (its own collective sequence): gradient all_reduces in backward
    group_b = dist.new_group(timeout=timedelta(seconds=60))
    mesh_b = DeviceMesh.from_group(group_b, "cpu", mesh_dim_names=("tp",))
    # greedy: the global planner gathers this tiny batch instead (fewer bytes), leaving the backward no collective
    dp = fxshard.shard(models.ToyModel(16, 32), mesh_b, {}, example_inputs=(x,), in_specs=(P("tp", None),),
                       planner="greedy")
    fxshard.init_mesh(tp=world, timeout=3)  # from here on a collective of the world group waits 3 s for its peers
    store = dist.distributed_c10d._get_default_store()
    out: dict = {}
    local = x.chunk(world)[rank]
    if rank == 0:
        try:
            tp(x)  # rank 1 skips this call
            out["forward"] = None
        except ShardingError as e:
            out["forward"] = str(e)
        store.set("forward_done", "1")
        y = dp(local)  # both ranks run this forward
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=3), group_b)
        try:
            y.sum().backward()  # rank 1 skips the backward
            out["backward"] = None
        except ShardingError as e:
            out["backward"] = str(e)
        store.set("backward_done", "1")
    else:
        store.wait(["forward_done"], timedelta(seconds=120))
        dp(local)
        store.wait(["backward_done"], timedelta(seconds=120))
    return out


def test_a_rank_that_skips_a_call_makes_its_peer_raise_not_hang():
    # fresh processes: rank 0's timed-out collectives leave the world group unusable for a later call
    res = run_ranks(_skipped_calls, 2, fresh=True)[0]
    fwd, bwd = res["forward"], res["backward"]
    assert fwd is not None and fwd.startswith("the forward of ShardedModule(ToyModel): the all_reduce over mesh axis "
                                              "'tp' (P(sum) -> R of "), fwd
    assert bwd is not None and bwd.startswith("the backward of ShardedModule(ToyModel): the all_reduce over mesh "
                                              "axis 'tp'"), bwd
    for msg in (fwd, bwd):
        assert "Timed out" in msg and "a rank skipped or reordered a call" in msg and "init_mesh(timeout=" in msg


class _Buffers(nn.Module):
    """Unseeded parameters and buffers of several dtypes, laid out every way a 2x2 mesh allows."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)  # weight split on tp, replicated on dp; bias replicated on both axes
        self.table = nn.Parameter(torch.randn(8, 4))  # split over both axes
        self.register_buffer("mask", torch.rand(8) > 0.5)
        self.register_buffer("count", torch.randint(0, 1000, (4,)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.mask).sum() + self.table.sum() + self.count.sum()


def _values_2x2(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(dp=2, tp=2)
    torch.manual_seed(300 + rank)
    model = _Buffers()
    sm = fxshard.shard(copy.deepcopy(model), mesh, {"lin.weight": P("tp", None), "table": P(("dp", "tp"), None)},
                       example_inputs=(x8()[:, :8],))
    return {"model": model.state_dict(), "full": sm.full_state_dict()}


def test_values_come_from_rank_0_on_a_2x2_mesh():
    res = run_ranks(_values_2x2, 4, timeout=300)
    rank0 = res[0]["model"]
    assert any(not torch.equal(r["model"]["lin.bias"], rank0["lin.bias"]) for r in res[1:])  # ranks did differ
    for r in res:
        assert set(r["full"]) == set(rank0) and all(torch.equal(r["full"][k], rank0[k]) for k in rank0), r["full"]
