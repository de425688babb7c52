"""Dropout and RNG on sharded activations (semantics: ``fxshard/rules/random.py``).

* rules: random ops follow their input's split with the ``global_rng`` lowering, keep ``P(sum)``
  through dropout, and CSE never merges two draws;
* fake process group: the split dropout draws the *global* mask once in the forward and the
  backward only reads the saved local bool chunk; on a 2-D mesh every rank's chunk is its slice
  of the unsharded mask;
* 2 gloo ranks: shards draw different masks, replicated/Partial dropouts agree across ranks,
  training matches the unsharded model under the same seed (forward, gradients, parameters),
  reruns with the same seed are bit-identical and the ranks' generators stay in lock-step; under
  torch.compile (inductor's RNG) reruns are bit-identical and ranks agree, and with inductor's
  ``fallback_random`` the compiled model matches the unsharded eager one; generators seeded per rank raise
  where a program draws random numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel
from fxshard.tracing.export import trace_forward
from fxshard.core.placements import Part, R, S
from fxshard.rules.random import GLOBAL_RNG
from fxshard.core.ir import META_KEY
from tests.conftest import fake_world
from tests.dist_utils import run_ranks
from tests.test_rules import node_of, rnd, st_, strategies

aten = torch.ops.aten
PS = Part("sum")
TOL = 1e-5
STYLE_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}
SPEC_PLAN = {"net1.weight": P("tp", None), "net1.bias": P("tp"), "net2.weight": P(None, "tp")}  # net2 out: P(sum)
OUT_SPECS = (None, P(None, "tp"))
SPLIT_DIM = {"net1.weight": 0, "net1.bias": 0, "net2.weight": 1, "net2.bias": None}  # both plans


class DropMLP(nn.Module):
    """``d_out(net2(relu(drop(net1(d_in(x))))))``; also returns the dropped hidden activation."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.net1, self.net2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.d_in, self.drop, self.d_out = nn.Dropout(0.2), nn.Dropout(0.5), nn.Dropout(0.1)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.drop(self.net1(self.d_in(x)))
        return self.d_out(self.net2(self.relu(h))), h


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def _random_ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in n.target.tags]


# ----------------------------------------------------------------------------- rules


def test_dropout_rule_follows_splits_and_keeps_partial_sums():
    s = strategies(node_of(lambda x: aten.native_dropout(x, 0.5, True), rnd(4, 8), op=aten.native_dropout.default))
    assert st_((R,), (R, R)) in s
    assert st_((S(0),), (S(0), S(0)), GLOBAL_RNG) in s and st_((S(1),), (S(1), S(1)), GLOBAL_RNG) in s
    assert st_((PS,), (PS, R)) in s  # linear for a fixed mask: every rank draws the same global mask
    assert not any(isinstance(o[0], Part) and o[0] != PS for _, o, _ in s)  # max/min not claimed
    s = strategies(node_of(lambda x: aten.native_dropout(x, 0.5, True), rnd(8, 4), op=aten.native_dropout.default),
                   [S(0, 2)])
    assert st_((S(0, 2),), (S(0, 2), S(0, 2)), GLOBAL_RNG) in s  # a strided split is followed too


@pytest.mark.parametrize("fn", [torch.rand_like, torch.randn_like, lambda x: aten.bernoulli.p(x, 0.3),
                                lambda x: aten.uniform(x), lambda x: aten.normal_functional(x)])
def test_shape_only_random_ops_follow_the_split(fn):
    s = strategies(node_of(fn, rnd(4, 8)), [S(1)])
    assert st_((S(1),), S(1), GLOBAL_RNG) in s and st_((R,), R) in s
    assert st_((PS,), R) in s  # only the shape is read


def test_cse_never_merges_two_draws():
    class Twice(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5) - F.dropout(x, 0.5), torch.rand(4, 8) - torch.rand(4, 8), \
                torch.randn_like(x) - torch.randn_like(x)

    gm = trace_forward(Twice(), (rnd(4, 8),), {}).gm
    targets = [n.target for n in _random_ops(gm)]
    for op in (aten.native_dropout.default, aten.rand.default, aten.randn_like.default):
        assert targets.count(op) == 2, targets


# ----------------------------------------------------------------------------- fake process group


def test_split_dropout_draws_the_global_mask_once_and_saves_the_local_chunk(mesh2):
    x, _ = _data()
    sm = fxshard.shard(DropMLP(), mesh2, STYLE_PLAN, example_inputs=(x,), out_specs=OUT_SPECS)
    fwd, bwd = sm._training.fwd.gm, sm._training.bwd.gm
    draws = [n for n in _random_ops(fwd) if n.target is aten.bernoulli.p]
    assert len(draws) == 1 and list(draws[0].args[0].args[0]) == [8, 32]  # the global [batch, hidden] mask
    assert [n.args[1] for n in _random_ops(fwd) if n.target is aten.native_dropout.default] == [0.2, 0.1]
    assert _random_ops(bwd) == []  # the backward never redraws
    saved = [n for n in bwd.graph.nodes if n.op == "placeholder" and isinstance(n.meta["val"], torch.Tensor)
             and n.meta["val"].dtype == torch.bool]
    # each dropout saves only its boolean mask (the split one's local chunk of [8, 32], and the
    # replicated output dropout's [8, 16]), never the tuple with the float output
    assert [tuple(n.meta[META_KEY].local_shape((2,))) for n in saved] == [(8, 16), (8, 16)]
    assert sorted(tuple(n.meta[META_KEY].shape) for n in saved) == [(8, 16), (8, 32)]
    assert GLOBAL_RNG in fxshard.explain(sm)
    assert fxshard.comm_stats(sm)["forward"]["all_reduce"]["count"] == 1


def test_every_rank_of_a_2d_mesh_keeps_its_slice_of_the_unsharded_mask():
    class Hidden(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net1, self.drop = nn.Linear(16, 32), nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.net1(x))

    model = Hidden()
    x, _ = _data()
    torch.manual_seed(11)
    ref = model(x)
    plan = {"net1.weight": P("tp", None), "net1.bias": P("tp")}
    for rank in range(4):
        with fake_world(4, rank=rank, shape=(2, 2), names=("dp", "tp")) as mesh:
            sm = fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=(x,), in_specs=P("dp", None),
                               out_specs=P("dp", "tp"))
            dp, tp = mesh.get_coordinate()
            torch.manual_seed(11)
            with torch.no_grad():
                out = sm(x[dp * 4:(dp + 1) * 4])
            assert torch.allclose(out, ref[dp * 4:(dp + 1) * 4, tp * 16:(tp + 1) * 16], atol=TOL, rtol=0), rank


# ----------------------------------------------------------------------------- 2 gloo ranks


def _steps(mod: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> tuple[list, list, dict]:
    """``n`` SGD steps, the RNG reseeded before each: losses, (local) dropped hidden per step, first grads."""
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    losses, hs = [], []
    for i in range(n):
        torch.manual_seed(100 + i)
        opt.zero_grad()
        out, h = mod(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        if i == 0:
            grads = {k: p.grad.clone() for k, p in mod.named_parameters()}
        opt.step()
        losses.append(loss.item())
        hs.append(h.detach().clone())
    return losses, hs, grads


def _chunk(full: torch.Tensor, dim, rank: int, world: int) -> torch.Tensor:
    return full if dim is None else full.chunk(world, dim)[rank]


def _dropout_ranks(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    x, y = _data()
    res: dict = {}
    for name, plan in (("styles", STYLE_PLAN), ("specs", SPEC_PLAN)):
        model = DropMLP()
        init = copy.deepcopy(model.state_dict())
        sm = fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=(x,), out_specs=OUT_SPECS)
        ref_losses, ref_hs, ref_grads = _steps(model, x, y, 3)
        ref_next = torch.rand(4)  # where the generator stands after the unsharded run
        losses, hs, grads = _steps(sm, x, y, 3)
        next_ = torch.rand(4)
        full = sm.full_state_dict()
        sm.load_full_state_dict(init)
        losses2, hs2, _ = _steps(sm, x, y, 3)
        full2 = sm.full_state_dict()
        cols = slice(rank * 16, (rank + 1) * 16)
        res[name] = {
            "mask": hs[0] != 0,
            "h_err": max((h - r[:, cols]).abs().max().item() for h, r in zip(hs, ref_hs)),
            "loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "grad_err": max((g - _chunk(ref_grads[k], SPLIT_DIM[k], rank, world)).abs().max().item()
                            for k, g in grads.items()),
            "param_err": max((full[k] - v).abs().max().item() for k, v in model.state_dict().items()),
            "rerun_same": losses2 == losses and all(torch.equal(a, b) for a, b in zip(hs, hs2))
            and all(torch.equal(full[k], full2[k]) for k in full),
            "rng_next": next_, "rng_in_step": torch.equal(next_, ref_next),
            "placements": {n.name: n.meta[META_KEY] for n in sm._training.fwd.gm.graph.nodes
                           if n.target is aten.native_dropout.default},
        }
    return res


def test_dropout_on_sharded_activations_trains_like_unsharded_and_deterministically():
    r0, r1 = run_ranks(_dropout_ranks, 2)
    for name in ("styles", "specs"):
        a, b = r0[name], r1[name]
        assert a["mask"].shape == (8, 16) and 0.2 < a["mask"].float().mean() < 0.8
        assert not torch.equal(a["mask"], b["mask"]), "both shards drew the same dropout mask"
        for r in (a, b):
            assert r["h_err"] <= TOL and r["loss_err"] <= TOL, (name, r)
            assert r["grad_err"] <= TOL and r["param_err"] <= TOL, (name, r)
            assert r["rerun_same"] and r["rng_in_step"], (name, r)
        assert torch.equal(a["rng_next"], b["rng_next"])  # generators still agree across ranks
    # the spec plan keeps net2's Partial sum through the output dropout (no extra collective)
    assert any(repr(s[0]) == "P(sum)" for s in r0["specs"]["placements"].values()), r0["specs"]["placements"]


def _compiled_dropout_ranks(rank: int, world: int) -> dict:
    """torch.compile of the sharded DropMLP: default inductor (its own RNG) run twice from the same state
    and seeds, and with inductor's ``fallback_random`` (eager's RNG ops) against the unsharded eager model."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    mesh = fxshard.init_mesh(tp=world)
    x, y = _data()
    model = DropMLP()
    sm = fxshard.shard(copy.deepcopy(model), mesh, STYLE_PLAN, example_inputs=(x,), out_specs=OUT_SPECS)
    ref_losses, ref_hs, ref_grads = _steps(model, x, y, 2)
    torch._dynamo.reset()
    counters.clear()
    runs = [_steps(torch.compile(copy.deepcopy(sm)), x, y, 2) for _ in range(2)]
    graphs = counters["stats"]["unique_graphs"]
    with inductor_config.patch(fallback_random=True):
        torch._dynamo.reset()
        losses, hs, grads = _steps(torch.compile(copy.deepcopy(sm)), x, y, 2)
    grads = {k.removeprefix("_orig_mod."): g for k, g in grads.items()}
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    torch.distributed.all_gather(gathered, torch.tensor(runs[0][0], dtype=torch.float64))
    cols = slice(rank * 16, (rank + 1) * 16)
    return {
        "graphs": graphs,
        "rerun_same": runs[0][0] == runs[1][0] and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])),
        "ranks_agree": torch.equal(gathered[0], gathered[1]),
        "fallback_h_err": max((h - r[:, cols]).abs().max().item() for h, r in zip(hs, ref_hs)),
        "fallback_loss_err": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "fallback_grad_err": max((g - _chunk(ref_grads[k], SPLIT_DIM[k], rank, world)).abs().max().item()
                                 for k, g in grads.items()),
    }


def test_compiled_dropout_is_deterministic_agrees_across_ranks_and_is_eager_with_fallback_random():
    """Under torch.compile the masks come from inductor's RNG: reruns with the same seeds are bit-identical
    and the ranks' replicated dropouts agree (the replicated loss is equal on both ranks); with
    ``torch._inductor.config.fallback_random = True`` the compiled sharded model matches the unsharded eager
    model (masks, loss, gradients)."""
    for r in run_ranks(_compiled_dropout_ranks, 2):
        assert r["graphs"] >= 2, r  # both default-inductor runs compiled (a fallback to eager would not count)
        assert r["rerun_same"] and r["ranks_agree"], r
        assert r["fallback_h_err"] <= TOL and r["fallback_loss_err"] <= TOL and r["fallback_grad_err"] <= TOL, r


def _differently_seeded(rank: int, world: int) -> dict:
    """Generators seeded per rank (the data-parallel habit ``torch.manual_seed(seed + rank)``): sharding a model
    whose program draws random numbers raises, in train mode at shard() and from eval at the first call in
    train mode; a program that draws nothing does not care; seeding every rank the same fixes it; a jitted
    function's first call raises too."""
    mesh = fxshard.init_mesh(tp=world)
    x, _ = _data()
    model = DropMLP()
    shard = lambda m: fxshard.shard(copy.deepcopy(m), mesh, STYLE_PLAN, example_inputs=(x,), out_specs=OUT_SPECS)
    torch.manual_seed(100 + rank)
    out: dict = {}
    try:
        shard(model)
    except fxshard.ShardingError as e:
        out["shard"] = str(e)
    sm = shard(model.eval())  # eval: dropout draws nothing
    out["eval_ran"] = sm(x)[0].shape == (8, 16)
    sm.train()
    try:
        sm(x)
    except fxshard.ShardingError as e:
        out["train_call"] = str(e)
    torch.manual_seed(7)
    out["reseeded_ran"] = sm(x)[0].shape == (8, 16)

    def halved(a: torch.Tensor) -> torch.Tensor:
        return F.dropout(a, 0.5)

    sf = fxshard.jit(halved, mesh, in_specs=(P("tp", None),), out_specs=P("tp", None))
    torch.manual_seed(100 + rank)
    try:
        sf(x.chunk(world)[rank])
    except fxshard.ShardingError as e:
        out["jit_call"] = str(e)
    return out


def test_generators_seeded_per_rank_raise_where_the_program_draws_random_numbers():
    for r in run_ranks(_differently_seeded, 2):
        for key, name in (("shard", "DropMLP"), ("train_call", "DropMLP"), ("jit_call", "halved")):
            assert key in r and "the random generator's state differs between rank 0 (torch.initial_seed() 100" in r[key] \
                and "and rank 1 (torch.initial_seed() 101" in r[key] and f"{name}'s sharded program draws random" in r[key] \
                and "torch.manual_seed(seed), not seed + rank" in r[key], r
        assert r["eval_ran"] and r["reseeded_ran"], r


def _torch_transformer_with_dropout(rank: int, world: int) -> dict:
    """torch's test Transformer with dropout_p > 0 (embeddings, attention probabilities with sharded heads,
    residuals) under its own Megatron plan, trained with the RNG reseeded per step, vs unsharded."""
    from torch.distributed.tensor import Replicate
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=2, vocab_size=16, max_seq_len=16, dim=16, n_heads=4, dropout_p=0.25))
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "layers.*.attention.wq": ColwiseParallel(), "layers.*.attention.wk": ColwiseParallel(),
            "layers.*.attention.wv": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w1": ColwiseParallel(), "layers.*.feed_forward.w2": RowwiseParallel(),
            "output": ColwiseParallel(output_layouts=Replicate())}
    g = torch.Generator().manual_seed(3)
    tok, tgt = torch.randint(0, 16, (2, 16), generator=g), torch.randint(0, 16, (2, 16), generator=g)
    sm = fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=(tok,))
    losses = {}
    for name, mod in (("ref", model), ("sharded", sm)):
        opt = torch.optim.SGD(mod.parameters(), lr=0.1)
        losses[name] = []
        for i in range(2):
            torch.manual_seed(200 + i)
            opt.zero_grad()
            loss = F.cross_entropy(mod(tok).flatten(0, 1), tgt.flatten())
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    full = sm.full_state_dict()
    return {"loss_err": max(abs(a - b) for a, b in zip(losses["ref"], losses["sharded"])),
            "param_err": max((full[k] - v).abs().max().item() for k, v in model.state_dict().items()),
            "head_split_dropouts": sum(1 for n in sm._training.fwd.gm.graph.nodes
                                       if n.target is aten.bernoulli.p and len(n.args[0].args[0]) == 4),
            "rng": torch.get_rng_state()}


def test_torch_transformer_with_dropout_trains_like_unsharded():
    r0, r1 = run_ranks(_torch_transformer_with_dropout, 2)
    for r in (r0, r1):
        assert r["loss_err"] <= TOL and r["param_err"] <= TOL, r
        assert r["head_split_dropouts"] == 2  # one attention-probability dropout per layer, heads split
    assert torch.equal(r0["rng"], r1["rng"])
