"""``fxshard.jit``: whole functional training steps (forward, backward, optimizer) sharded JAX-style.

Parity tests run the step on 2 real gloo ranks and compare every step's loss and every rank's local
slice of the parameters and optimizer state with the same step run unsharded in one process; the
error tests run on the fake process group.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

import fxshard
from fxshard import P, Shard
from fxshard.tracing.captured import captured_scalars, check_captured
from fxshard.report.inspect import collectives
from fxshard.core.mesh import MeshInfo
from fxshard.runtime.state_interop import local_slice
from fxshard.plans.plan import to_placements
from tests import models
from tests.dist_utils import run_ranks

TOL = 1e-5


# ------------------------------------------------------------------------- functional steps


def toy_specs() -> dict:
    """ToyModel tensor parallel: net1 column-wise, net2 row-wise (net2.bias replicated)."""
    return {"net1.weight": P("tp", None), "net1.bias": P("tp"), "net2.weight": P(None, "tp")}


def transformer_specs(n_layers: int) -> dict:
    """tests.test_forward_parity.transformer_plan as parameter specs (vocab-sharded tied embedding/head)."""
    specs = {"tok_emb.weight": P("tp", None)}
    for i in range(n_layers):
        for w in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1"):
            specs[f"layers.{i}.{w}.weight"] = P("tp", None)
            specs[f"layers.{i}.{w}.bias"] = P("tp")
        for w in ("attn.wo", "mlp.w2"):
            specs[f"layers.{i}.{w}.weight"] = P(None, "tp")
    return specs


def mse_loss(model: torch.nn.Module) -> Callable:
    return lambda params, batch: F.mse_loss(functional_call(model, params, (batch[0],)), batch[1])


def model_loss(model: torch.nn.Module) -> Callable:
    """The model returns the loss itself; tied weights follow ``tie_weights`` (the default)."""
    return lambda params, batch: functional_call(model, params, tuple(batch))


def sgd_step(loss_fn: Callable, lr: float) -> Callable:
    def step(params: dict, batch: tuple) -> tuple:
        grads, loss = grad_and_value(loss_fn)(params, batch)
        return loss, {k: p - lr * grads[k] for k, p in params.items()}

    return step


def adamw_init(params: dict) -> dict:
    return {"m": {k: torch.zeros_like(p) for k, p in params.items()},
            "v": {k: torch.zeros_like(p) for k, p in params.items()}, "step": torch.zeros(())}


def adamw_step(loss_fn: Callable, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, wd: float = 1e-2) -> Callable:
    """torch.optim.AdamW's math, functionally: the step count is a tensor so every step reuses one program."""
    b1, b2 = betas

    def step(params: dict, state: dict, batch: tuple) -> tuple:
        grads, loss = grad_and_value(loss_fn)(params, batch)
        t = state["step"] + 1
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        m = {k: state["m"][k] * b1 + g * (1 - b1) for k, g in grads.items()}
        v = {k: state["v"][k] * b2 + g * g * (1 - b2) for k, g in grads.items()}
        new = {k: p * (1 - lr * wd) - (lr / bc1) * m[k] / (v[k].sqrt() / bc2.sqrt() + eps) for k, p in params.items()}
        return loss, new, {"m": m, "v": v, "step": t}

    return step


# ------------------------------------------------------------------------- helpers


def _local(tree: Any, specs: Any, mesh) -> Any:
    """Each rank's slice of a dict of full tensors (``specs`` keyed like it; missing keys replicated)."""
    info = MeshInfo.of(mesh)
    if isinstance(tree, dict):
        return {k: _local(v, specs.get(k) if isinstance(specs, dict) else specs, mesh) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_local(v, specs, mesh) for v in tree)
    return local_slice(tree, mesh, to_placements(specs, info, tree.dim(), "test")).clone()


def _max_err(local: Any, full: Any, specs: Any, mesh) -> float:
    ref = torch.utils._pytree.tree_leaves(_local(full, specs, mesh))
    got = torch.utils._pytree.tree_leaves(local)
    assert len(ref) == len(got)
    for r, g in zip(ref, got):
        assert r.shape == g.shape, (r.shape, g.shape)
    return max((r - g).abs().max().item() for r, g in zip(ref, got))


def _run(step_fn: Callable, sharded: Callable, state: tuple, specs: tuple, batches: list, steps: int, mesh) -> dict:
    """Run ``steps`` steps unsharded and sharded, feeding outputs back; max loss and state errors."""
    full = state
    local = tuple(_local(s, sp, mesh) for s, sp in zip(state, specs))
    loss_err, state_err = 0.0, 0.0
    for i in range(steps):
        b = batches[i % len(batches)]
        ref_loss, *full = step_fn(*full, b)
        loss, *local = sharded(*local, b)
        loss_err = max(loss_err, abs(loss.item() - ref_loss.item()))
        state_err = max(state_err, max(_max_err(l, f, sp, mesh) for l, f, sp in zip(local, full, specs)))
    return {"loss_err": loss_err, "state_err": state_err}


def _comm(sf: fxshard.ShardedFunction) -> dict:
    prog = sf._programs()[0]
    inputs = {n.name for n in prog.gm.graph.nodes if n.op == "placeholder"}
    return {"stats": fxshard.comm_stats(sf), "kinds": sorted({c["kind"] for c in collectives(prog)}),
            "inputs_moved": [c["value"] for c in collectives(prog) if c["value"] in inputs]}


# ------------------------------------------------------------------------- 2-rank parity


def _toy(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = models.ToyModel(16, 32)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(3)]
    specs, res = toy_specs(), {}

    sgd = sgd_step(mse_loss(model), lr=0.1)
    jsgd = fxshard.jit(sgd, mesh, in_specs=(specs, None), out_specs=(None, specs))
    res["sgd"] = _run(sgd, jsgd, (params,), (specs,), batches, 4, mesh) | _comm(jsgd)
    res["sgd_traces"] = len(jsgd._cache)

    adamw = adamw_step(mse_loss(model), lr=1e-2)
    state_specs = {"m": specs, "v": specs, "step": None}
    jadamw = fxshard.jit(adamw, mesh, in_specs=(specs, state_specs, None), out_specs=(None, specs, state_specs))
    res["adamw"] = _run(adamw, jadamw, (params, adamw_init(params)), (specs, state_specs), batches, 4, mesh) \
        | _comm(jadamw)
    res["adamw_traces"] = len(jadamw._cache)

    # data parallel: replicated parameters, batch split over the axis -> the gradient all-reduce falls out
    # (the greedy sweep: on this 8-row batch the global planner gathers the batch, 2 collectives for 5)
    dp_batches = [tuple(t.chunk(world)[rank] for t in b) for b in batches]
    jdp = fxshard.jit(sgd, mesh, in_specs=(None, P("tp")), out_specs=(None, None), planner="greedy")
    p_full, p_dp, dp_err = params, params, 0.0
    for b, lb in zip(batches, dp_batches):
        ref_loss, p_full = sgd(p_full, b)
        loss, p_dp = jdp(p_dp, lb)
        dp_err = max(dp_err, abs(loss.item() - ref_loss.item()), *((p_dp[k] - p_full[k]).abs().max().item()
                                                                  for k in p_full))
    res["dp"] = {"err": dp_err} | _comm(jdp)

    # the functional AdamW above is torch.optim.AdamW (so the parity test tests the optimizer people use)
    ref_model = models.ToyModel(16, 32)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    p, st = params, adamw_init(params)
    for b in batches:
        opt.zero_grad()
        F.mse_loss(ref_model(b[0]), b[1]).backward()
        opt.step()
        _, p, st = adamw(p, st, b)
    res["adamw_vs_torch_optim"] = max((p[k] - v).abs().max().item() for k, v in ref_model.named_parameters())
    return res


def test_toy_sgd_and_adamw_steps_match_unsharded():
    for res in run_ranks(_toy, 2):
        assert res["adamw_vs_torch_optim"] <= 1e-6, res
        for opt in ("sgd", "adamw"):
            r = res[opt]
            assert r["loss_err"] <= TOL and r["state_err"] <= TOL, (opt, r)
            # forward: net2's partial output reduced once before the loss; the backward and the update are local
            assert r["stats"]["forward"] == {"all_reduce": {"count": 1, "bytes": 8 * 16 * 4}}, (opt, r["stats"])
            assert r["inputs_moved"] == [], (opt, r)  # no parameter or state is gathered or reduced
            assert res[f"{opt}_traces"] == 1  # one program for all steps
        assert res["dp"]["err"] <= TOL, res["dp"]
        # data parallel: the loss and each of the 4 parameter gradients all-reduced, nothing else
        grad_bytes = (32 * 16 + 32 + 16 * 32 + 16) * 4
        assert res["dp"]["stats"]["forward"] == {"all_reduce": {"count": 5, "bytes": 4 + grad_bytes}}, res["dp"]
        assert res["dp"]["inputs_moved"] == [], res["dp"]


def _transformer(rank: int, world: int, n_layers: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=n_layers, max_seq=16, tie=True)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}  # tied: tok_emb.weight only
    batches = [(models.make_tokens(2, 16, 64, seed=s), models.make_tokens(2, 16, 64, seed=s + 100)) for s in range(2)]
    specs, res = transformer_specs(n_layers), {"n_params": len(params)}

    # the greedy sweep's Megatron + loss-parallel counts (the global planner gathers this tiny model's tied
    # 8 KiB table once instead: fewer collectives)
    sgd = sgd_step(model_loss(model), lr=0.1)
    jsgd = fxshard.jit(sgd, mesh, in_specs=(specs, None), out_specs=(None, specs), planner="greedy")
    res["sgd"] = _run(sgd, jsgd, (params,), (specs,), batches, 3, mesh) | _comm(jsgd)

    # the key bias has an exactly-zero true gradient: a larger eps keeps Adam from amplifying rounding noise
    adamw = adamw_step(model_loss(model), lr=1e-2, eps=1e-3)
    state_specs = {"m": specs, "v": specs, "step": None}
    jadamw = fxshard.jit(adamw, mesh, in_specs=(specs, state_specs, None), out_specs=(None, specs, state_specs),
                         planner="greedy")
    res["adamw"] = _run(adamw, jadamw, (params, adamw_init(params)), (specs, state_specs), batches, 3, mesh) \
        | _comm(jadamw)
    return res


def test_transformer_sgd_and_adamw_steps_match_unsharded():
    n_layers = 2
    for res in run_ranks(_transformer, 2, n_layers):
        assert res["n_params"] == 2 + 16 * n_layers + 2  # tok/pos emb, 16 per layer, final norm; the head is tied
        for opt in ("sgd", "adamw"):
            r = res[opt]
            assert r["loss_err"] <= TOL and r["state_err"] <= TOL, (opt, r)
            assert r["inputs_moved"] == [], (opt, r)
            # the greedy sweep, on ties, keeps the replicated positional table's gradient row-split (the
            # vocab-parallel rows are the embedding rule's first strategy) and gathers its 2 KiB update (and
            # AdamW's two 2 KiB states) once each
            ag = r["stats"]["forward"].get("all_gather", {"count": 0, "bytes": 0})
            assert ag["count"] <= (1 if opt == "sgd" else 3) and ag["bytes"] == 2048 * ag["count"], r
            # Megatron: 2 per layer forward and 2 backward; the vocab-sharded embedding's partial sum, the head's
            # input gradient; loss parallel: max, sum-exp and the loss forward, one sum in the softmax backward
            ar = r["stats"]["forward"]["all_reduce"]
            assert ar["count"] == 4 * n_layers + 6, r["stats"]
            assert ar["bytes"] < (4 * n_layers + 3) * 2 * 16 * 32 * 4, r["stats"]  # the statistics are tiny


# ------------------------------------------------------------------------- fake process group


def _toy_setup():
    model = models.ToyModel(16, 32)
    params = {k: v.detach() for k, v in model.named_parameters()}
    return model, params, (torch.randn(8, 16), torch.randn(8, 16))


def test_spec_errors_say_what_why_and_how(mesh2):
    model, params, batch = _toy_setup()
    step = sgd_step(mse_loss(model), lr=0.1)
    # checked at jit() time: an unknown mesh axis, something that is not a spec (names the argument path)
    with pytest.raises(fxshard.ShardingError, match=r"in_specs for params\['net1.weight'\].*'dp'.*\('tp',\)"):
        fxshard.jit(step, mesh2, in_specs=({"net1.weight": P("dp", None)}, None))
    with pytest.raises(fxshard.ShardingError, match=r"in_specs for batch\[1\]: 'tp' is not a sharding spec; use None"):
        fxshard.jit(step, mesh2, in_specs=(None, (None, "tp")))
    # spec tree not shaped like the arguments
    bad = fxshard.jit(step, mesh2, in_specs=(toy_specs(), None, None))
    with pytest.raises(fxshard.ShardingError, match=r"in_specs has 3 entries but step was called with 2"):
        bad(params, batch)
    bad = fxshard.jit(step, mesh2, in_specs=({"net3.weight": P("tp")}, None))
    with pytest.raises(fxshard.ShardingError, match=r"unknown keys \['net3.weight'\]"):
        bad(params, batch)
    # a spec that does not divide the global shape (example_inputs are global)
    with pytest.raises(fxshard.ShardingError, match=r"batch\[0\].*dim 0 \(size 7\) cannot be split over mesh axis "
                       r"'tp' \(2\): fxshard.jit .* must split evenly"):
        fxshard.jit(step, mesh2, in_specs=(None, P("tp")), example_inputs=(params, (torch.randn(7, 16),) * 2))
    # wrong arity at call time
    ok = fxshard.jit(step, mesh2, in_specs=(toy_specs(), None), out_specs=(None, toy_specs()))
    with pytest.raises(fxshard.ShardingError, match=r"called with 1 positional argument.*missing.*'batch'"):
        ok(params)
    with pytest.raises(fxshard.ShardingError, match=r"keyword arguments \['batch'\].*pass them positionally"):
        ok(params, batch=batch)
    # nothing traced yet: explain() says how to get a program
    with pytest.raises(fxshard.ShardingError, match="call it once, or pass example_inputs"):
        fxshard.explain(ok)
    # out_specs naming a dim the output does not have
    bad = fxshard.jit(step, mesh2, out_specs=(Shard(0), None))
    with pytest.raises(fxshard.ShardingError, match=r"out_specs for output\[0\].*dim 0 but the tensor has 0 dims"):
        bad(params, batch)


def test_in_place_update_is_rejected(mesh2):
    model, params, batch = _toy_setup()

    def step(params, batch):
        grads, loss = grad_and_value(mse_loss(model))(params, batch)
        for k in params:
            params[k].sub_(0.1 * grads[k])
        return loss, params

    with pytest.raises(fxshard.ShardingError,
                       match=r"updates its argument params\['net1.weight'\] in place.*compute the new value"):
        fxshard.jit(step, mesh2, in_specs=(toy_specs(), None))(params, batch)


def test_a_python_random_draw_in_the_function_is_refused(mesh2):
    """The draw happened once, at trace time, and every call kept it (a branch or a value), silently."""
    import random

    def noisy(x):
        return x * random.random()

    with pytest.raises(fxshard.ShardingError, match=r"the jitted function noisy draws from Python's random module "
                                                    r"while fxshard traces it.*Draw inside tensor ops"):
        fxshard.jit(noisy, mesh2)(torch.randn(2, 2))


def test_meta_example_inputs_trace_ahead_of_time_and_explain(mesh2):
    model, params, batch = _toy_setup()
    specs = toy_specs()
    meta = ({k: v.to("meta") for k, v in params.items()}, tuple(t.to("meta") for t in batch))
    sf = fxshard.jit(sgd_step(mse_loss(model), 0.1), mesh2, in_specs=(specs, None), out_specs=(None, specs),
                     example_inputs=meta)
    text = fxshard.explain(sf)
    assert "in_params_net1_weight" in text and "[32, 16]" in text and "[16, 16]" in text
    assert fxshard.comm_stats(sf)["forward"]["all_reduce"]["count"] == 1
    loss, new = sf(_local(params, specs, mesh2), batch)  # the traced program serves local calls
    assert len(sf._cache) == 1 and loss.shape == () and new["net1.weight"].shape == (16, 16)
    assert new["net2.weight"].shape == (16, 16) and new["net2.bias"].shape == (16,)


_LR = 0.5  # read by _scaled_step through a helper, as a module-level learning rate would be
_CALLS = 0


def _lr() -> float:
    return _LR


def _scaled_step(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return w - _lr() * g


def _counting_step(w: torch.Tensor) -> torch.Tensor:
    global _CALLS
    _CALLS += 1
    return w * _CALLS


def _schedule() -> tuple[Callable, Callable]:
    lr = 0.5

    def step(w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return w - lr * g

    def decay() -> None:
        nonlocal lr
        lr = lr / 2

    return step, decay


def test_python_scalars_read_from_globals_or_closures_are_checked_at_every_call(mesh2):
    """Measured before the check: after a module-level learning rate went from 0.5 to 0.1 the program kept 0.5
    (eager 0.4 against -0.5 per element), silently; as jax.jit does. Now the call raises and names the variable,
    the function that reads it and both values; back at the traced value it runs again. The same for a closure
    variable a schedule changes with ``nonlocal``; a function that changes a global while traced is refused."""
    global _LR, _CALLS
    _CALLS = 0
    w, g = torch.ones(4), torch.full((4,), 3.0)
    sf = fxshard.jit(_scaled_step, mesh2)
    assert torch.equal(sf(w, g), _scaled_step(w, g))
    kept = pickle.loads(pickle.dumps(captured_scalars(_scaled_step)))  # pickled by reference to the live global
    try:
        _LR = 0.1
        with pytest.raises(fxshard.ShardingError, match=r"reads the global '_LR' \(in _lr\), which was 0.5 when it "
                                                        r"was traced and is 0.1 now.*Pass the value as an argument"):
            sf(w, g)
        with pytest.raises(fxshard.ShardingError, match=r"reads the global '_LR'"):
            check_captured(kept, "the unpickled record")
    finally:
        _LR = 0.5
    assert torch.equal(sf(w, g), _scaled_step(w, g))
    step, decay = _schedule()
    sf = fxshard.jit(step, mesh2)
    assert torch.equal(sf(w, g), step(w, g))
    decay()
    with pytest.raises(fxshard.ShardingError, match=r"reads the closure variable 'lr' \(in _schedule.<locals>.step\), "
                                                    r"which was 0.5 when it was traced and is 0.25 now"):
        sf(w, g)
    with pytest.raises(fxshard.ShardingError, match=r"while traced, _counting_step changed the global '_CALLS' "
                                                    r"\(in _counting_step\) from 0 to 1.*Keep the code pure"):
        fxshard.jit(_counting_step, mesh2)(w)


class _Trainer:
    """A training step as a bound method reading its learning rate from the instance and a config object."""

    class Cfg:
        scale = None

    def __init__(self) -> None:
        self.lr = 0.5
        self.cfg = self.Cfg()
        self.cfg.scale = 2.0

    def step(self, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return w - self.lr * g * self.cfg.scale


class _ListTrainer(_Trainer):
    """``self`` used inside a comprehension: a cell on Python 3.11 (``LOAD_DEREF``), inlined on 3.12."""

    def step(self, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return sum(p - self.lr * g for p in [w * self.cfg.scale for _ in range(2)])


def test_instance_attributes_read_inside_a_comprehension_are_checked(mesh2):
    """Python 3.11 made ``self`` a cell here, and the attributes read through it were not recorded: changing
    ``trainer.lr`` or ``trainer.cfg.scale`` went unnoticed, silently."""
    trainer = _ListTrainer()
    w, g = torch.ones(4), torch.full((4,), 0.25)
    sf = fxshard.jit(trainer.step, mesh2)
    assert torch.equal(sf(w, g), trainer.step(w, g))
    for attr, obj, value in (("self.lr", trainer, 0.1), ("self.cfg.scale", trainer.cfg, 3.0)):
        name = attr.split(".")[-1]
        old = getattr(obj, name)
        setattr(obj, name, value)
        with pytest.raises(fxshard.ShardingError, match=rf"reads the attribute '{attr}'"):
            sf(w, g)
        setattr(obj, name, old)
    assert torch.equal(sf(w, g), trainer.step(w, g))


def test_a_bound_methods_instance_attributes_are_checked_at_every_call(mesh2):
    """``fxshard.jit(trainer.step)``: ``self.lr`` and ``self.cfg.scale`` were baked in like globals; an epoch
    schedule assigning ``trainer.lr`` was ignored, silently. Now each call compares them."""
    trainer = _Trainer()
    w, g = torch.ones(4), torch.full((4,), 0.25)
    sf = fxshard.jit(trainer.step, mesh2)
    assert torch.equal(sf(w, g), trainer.step(w, g))
    trainer.lr = 0.1
    with pytest.raises(fxshard.ShardingError, match=r"reads the attribute 'self.lr' \(in _Trainer.step\), which was "
                                                    r"0.5 when it was traced and is 0.1 now"):
        sf(w, g)
    trainer.lr = 0.5
    trainer.cfg.scale = 3.0
    with pytest.raises(fxshard.ShardingError, match=r"reads the attribute 'self.cfg.scale'"):
        sf(w, g)
    trainer.cfg.scale = 2.0
    assert torch.equal(sf(w, g), trainer.step(w, g))
