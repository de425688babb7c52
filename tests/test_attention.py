"""Attention as one device-neutral node (``fxshard/ops/attention.py``): ``F.scaled_dot_product_attention`` is
``fxshard::attention`` (backward ``fxshard::attention_backward``) in every fxshard graph, split over batch or
heads, whatever device the model was traced on (meta included); every form matches eager on 2 gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fxshard
from fxshard import P, models
from fxshard.ops.attention import ATTENTION, ATTENTION_BACKWARD
from fxshard.core.ir import STRATEGY_KEY
from fxshard.core.placements import Part, R, S
from tests.dist_utils import run_ranks

aten = torch.ops.aten
B, T, D, E = 2, 6, 16, 4


class Attn(nn.Module):
    """q/k/v/o projections around one SDPA call of the given ``form``."""

    def __init__(self, form: str, heads: int = 4, kv_heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.form, self.h, self.hkv = form, heads, kv_heads
        self.q, self.o = nn.Linear(D, heads * E), nn.Linear(heads * E, D)
        self.k, self.v = nn.Linear(D, kv_heads * E), nn.Linear(D, kv_heads * E)
        for p in self.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        keep = torch.rand(T, T, generator=g) > 0.4
        keep |= torch.eye(T, dtype=torch.bool)  # no fully masked row
        self.register_buffer("bool_mask", keep)
        self.register_buffer("float_mask", torch.randn(1, 1, T, T, generator=g))
        if form == "learned_mask":  # broadcasts over batch and heads: its gradient is P(sum) under either split
            self.mask = nn.Parameter(torch.randn(1, 1, T, T, generator=g))
        if form == "learned_head_mask":  # one per head: split with the heads
            self.mask = nn.Parameter(torch.randn(heads, T, T, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, E).transpose(1, 2)
        k = self.k(x).view(b, t, self.hkv, E).transpose(1, 2)
        v = self.v(x).view(b, t, self.hkv, E).transpose(1, 2)
        kw: dict = {}
        if self.form == "gqa_repeat":  # as Hugging Face's repeat_kv
            k, v = (z.repeat_interleave(self.h // self.hkv, dim=1) for z in (k, v))
        elif self.form == "gqa_enable":
            kw["enable_gqa"] = True
        elif self.form == "causal":
            kw["is_causal"] = True
        elif self.form == "bool_mask":
            kw["attn_mask"] = self.bool_mask
        elif self.form == "float_mask":
            kw["attn_mask"] = self.float_mask
        elif self.form in ("learned_mask", "learned_head_mask"):
            kw["attn_mask"] = self.mask
        elif self.form == "scale":
            kw["scale"] = 0.37
            kw["is_causal"] = True
        elif self.form == "dropout":
            kw["dropout_p"] = 0.5
        y = F.scaled_dot_product_attention(q, k, v, **kw)
        return self.o(y.transpose(1, 2).reshape(b, t, self.h * E))


FORMS = ["plain", "causal", "bool_mask", "float_mask", "learned_mask", "learned_head_mask", "scale", "gqa_repeat",
         "gqa_enable"]
HEADS = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}


def _model(form: str) -> Attn:
    return Attn(form, kv_heads=2 if form.startswith("gqa") else 4)


def _attention_splits(sm: fxshard.ShardedModule) -> list[tuple[str, object]]:
    return [(str(n.target), n.meta[STRATEGY_KEY][0].output) for p in sm._programs() for n in p.gm.graph.nodes
            if n.target in (ATTENTION, ATTENTION_BACKWARD)]


def _parity(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    x = torch.randn(B * world // 2 * 2, T, D, generator=torch.Generator().manual_seed(5))
    cot = torch.randn(x.shape[0], T, D, generator=torch.Generator().manual_seed(6))
    out: dict = {}
    for form in FORMS:
        for split in ("heads", "batch"):
            ref = _model(form)
            model = copy.deepcopy(ref)
            xr = x.clone().requires_grad_()
            (ref(xr) * cot).sum().backward()
            xe = x.clone().requires_grad_()
            if split == "heads":
                sm = fxshard.shard(model, mesh, HEADS, example_inputs=(xe,))
                xl, cl, want = x.clone().requires_grad_(), cot, xr.grad
            else:
                sm = fxshard.shard(model, mesh, {}, example_inputs=(xe,), in_specs=P("tp", None, None),
                                   out_specs=P("tp", None, None))
                xl, cl = x.chunk(world, 0)[rank].clone().requires_grad_(), cot.chunk(world, 0)[rank]
                want = xr.grad.chunk(world, 0)[rank]
            y = sm(xl)
            (y * cl).sum().backward()
            full_y = ref(x) if split == "heads" else ref(x).chunk(world, 0)[rank]
            err = max((y - full_y).abs().max().item(), (xl.grad - want).abs().max().item())
            for name, p in sm.named_parameters():
                err = max(err, (sm._dtensor(name, p.grad).full_tensor() - ref.get_parameter(name).grad).abs().max().item())
            out[(form, split)] = (err, _attention_splits(sm), [p.fallbacks for p in sm._programs()])
    return out


def test_every_attention_form_matches_eager_split_over_heads_and_batch():
    res = run_ranks(_parity, 2)
    for rank_res in res:
        for (form, split), (err, splits, fallbacks) in rank_res.items():
            assert err < 1e-4, (form, split, err)
            assert not any(fallbacks), (form, split, fallbacks)
            d = 1 if split == "heads" else 0
            targets = {t for t, _ in splits}
            assert targets == {str(ATTENTION), str(ATTENTION_BACKWARD)}, (form, split, splits)
            for target, outs in splits:
                outs = outs if isinstance(outs, tuple) else (outs,)
                assert outs[0] == S(d), (form, split, target, outs)
                if form == "learned_mask" and target == str(ATTENTION_BACKWARD):
                    assert outs[3] == Part(), (form, split, outs)  # the broadcast mask's gradient sums
                if form == "learned_head_mask" and target == str(ATTENTION_BACKWARD):
                    assert outs[3] == (S(0) if split == "heads" else Part()), (form, split, outs)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_llama_attention_is_one_node_split_over_heads(mesh2, device):
    with torch.device(device):
        model = models.LlamaDecoder(n_layers=1)
    tok = models.make_tokens(2, 16, 64)
    sm = fxshard.shard(model, mesh2, models.llama_seed003_plan(), example_inputs=(tok, tok))
    rows = [line for line in fxshard.explain(sm).splitlines() if "fxshard.attention" in line]
    assert len(rows) == 2 and all("S(1)" in r for r in rows), rows  # forward and backward, heads split
    ops = [str(n.target) for p in sm._programs() for n in p.gm.graph.nodes if n.op == "call_function"]
    assert not [o for o in ops if "_for_cpu" in o or "scaled_dot_product" in o], ops
    assert not any(p.fallbacks for p in sm._programs())


def test_meta_traced_jit_and_dropout_graphs(mesh2):
    """fxshard.jit holds the same one node; attention dropout is traced as torch's math form (random ops)."""
    model = _model("causal")

    def step(params: dict, x: torch.Tensor) -> tuple:
        loss = lambda p: torch.func.functional_call(model, p, (x,)).pow(2).sum()  # noqa: E731
        return torch.func.grad_and_value(loss)(params)

    params = {k: v.detach().to("meta") for k, v in model.named_parameters()}
    f = fxshard.jit(step, mesh2, in_specs=({"q.weight": P("tp", None)}, None))
    gm = f.lower(params, torch.randn(B, T, D, device="meta"))._programs()[0].gm
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert str(ATTENTION) in targets and str(ATTENTION_BACKWARD) in targets, targets
    assert not [t for t in targets if "_for_cpu" in t or "bmm" in t], targets
    sm = fxshard.shard(_model("dropout"), mesh2, HEADS, example_inputs=(torch.randn(B, T, D),))
    ops = {n.target for p in sm._programs() for n in p.gm.graph.nodes}
    assert ATTENTION not in ops and any(isinstance(o, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded
                                        in o.tags for o in ops)


def _rng(rank: int, world: int) -> float:
    mesh = fxshard.init_mesh(tp=world)
    ref = _model("causal")
    model = copy.deepcopy(ref)
    torch.manual_seed(100 + rank)  # the ranks' generators differ: fine, nothing random is drawn
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))
    sm = fxshard.shard(model, mesh, HEADS, example_inputs=(x,))
    sm(x).pow(2).sum().backward()
    return (sm(x) - ref(x)).abs().max().item()


def test_attention_without_dropout_is_not_random():
    assert max(run_ranks(_rng, 2)) < 1e-5


def test_meta_traced_graph_is_device_neutral_and_runs_on_cpu():
    """The global graph traced on the meta device names no device's kernel and runs (here on CPU) as eager."""
    from fxshard.tracing.export import trace_forward

    ref = _model("learned_mask")
    with torch.device("meta"):
        model = _model("learned_mask")
    x = torch.randn(B, T, D)
    traced = trace_forward(model, (x.to("meta"),), {})
    targets = [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert str(ATTENTION) in targets and not [t for t in targets if "_for_cpu" in t or "scaled_dot" in t], targets
    inputs = [ref.get_parameter(s.names[0]).detach() if s.kind == "param" else
              ref.get_buffer(s.names[0]) if s.kind == "buffer" else x for s in traced.slots]
    got = traced.gm(*inputs)
    assert (got[0] - ref(x)).abs().max().item() < 1e-5


def test_the_global_planner_prices_attention_work():
    """Replicated attention (every rank computing every head) is not free to the planner."""
    from fxshard.tracing.joint import trace_joint
    from fxshard.planner.problem import _flops
    from fxshard.tracing.export import trace_forward

    traced = trace_forward(_model("gqa_enable"), (torch.randn(B, T, D),), {})
    joint = trace_joint(traced, traced.gm, [s.kind == "param" for s in traced.slots])
    work = {n.target: _flops(n) for n in joint.gm.graph.nodes if n.target in (ATTENTION, ATTENTION_BACKWARD)}
    fwd = 2.0 * B * 4 * T * T * (E + E)  # q [B, 4, T, E]; k, v [B, 2, T, E]
    assert work == {ATTENTION: fwd, ATTENTION_BACKWARD: 3.5 * fwd}, work


class _LatentQuery(torch.nn.Module):
    """A learned ``[1, H, L, E]`` query attending over each batch element's keys: q's batch dim broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.lat = torch.nn.Parameter(torch.randn(1, 2, 4, 8))
        self.kv = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.kv(x).chunk(2, -1)
        o = F.scaled_dot_product_attention(self.lat, k, v)
        return o.reshape(o.shape[0], -1).pow(2).sum(-1)


def test_a_query_broadcasting_over_the_batch_matches_eager(mesh2):
    """export's attention node is [3, 2, 4, 8] for a [1, 2, 4, 8] query; fxshard::attention returns the query's
    shape, so such a call takes the math form (before: a shape error at shard()). Replicated plan: the fake
    group's numerics are real."""
    torch.manual_seed(0)
    model, x = _LatentQuery(), torch.randn(3, 2, 4, 8)
    ref = copy.deepcopy(model)
    sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
    y, want = sm(x), ref(x)
    assert y.shape == want.shape and torch.allclose(y, want, atol=1e-5)
    y.sum().backward()
    want.sum().backward()
    for n, p in ref.named_parameters():
        assert torch.allclose(sm.get_parameter(n).grad, p.grad, rtol=1e-5, atol=1e-6), n


def test_views_export_kept_after_attention_stay_valid():
    """Export records attention's output with the layout its kernel gave then (torch 2.11's CPU kernel: ``[B, H,
    L, E]`` laid out as ``[B, L, H, E]``) and drops ``.contiguous()`` where that made it a no-op, so
    ``out.transpose(1, 2).contiguous().view(B, L, -1)`` reaches fxshard as a bare view. Routed to
    ``fxshard::attention`` (contiguous output), the program restores the recorded layout: the view runs and the
    values are eager's (without it: 'view size is not compatible with input tensor's size and stride')."""
    import torch.fx as fx

    from fxshard.ops.attention import route_exported

    b, h, t, e = 2, 4, 8, 16
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    g = fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    att = g.call_function(sdpa, (q, k, v))
    tr = g.call_function(torch.ops.aten.transpose.int, (att, 1, 2))
    g.output(g.call_function(torch.ops.aten.view.default, (tr, [b, t, h * e])))
    gm = fx.GraphModule(nn.Module(), g)
    att.meta["val"] = torch.empty(b, t, h, e).transpose(1, 2)  # the layout the traced kernel returned
    route_exported(gm)
    assert att.target is ATTENTION
    torch.manual_seed(0)
    x = [torch.randn(b, t, h, e).transpose(1, 2) for _ in range(3)]
    want = F.scaled_dot_product_attention(*x).transpose(1, 2).contiguous().view(b, t, h * e)
    torch.testing.assert_close(gm(*x), want)
    # a recorded contiguous output needs nothing: no node is added
    g2 = fx.Graph()
    q2, k2, v2 = (g2.placeholder(n) for n in "qkv")
    att2 = g2.call_function(sdpa, (q2, k2, v2))
    g2.output(att2)
    att2.meta["val"] = torch.empty(b, h, t, e)
    gm2 = fx.GraphModule(nn.Module(), g2)
    route_exported(gm2)
    assert [n.target for n in gm2.graph.nodes if n.op == "call_function"] == [ATTENTION]
