"""Mixed precision: ``shard()`` under ``torch.autocast`` trains as eager autocast does.

Each sharded result is compared with the same model run unsharded on one process under the same autocast:
loss and every gradient (float32 gradients of float32 parameters) at bf16 tolerance, which a missing
all-reduce (a factor of 2 in the gradients, ~100% off) exceeds many times; then optimizer steps. Partial sums
of bf16 values are reduced in float32 (read from the programs' collectives), and a call under another
autocast state than the programs were traced for raises.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel
from fxshard.core.errors import ShardingError
from fxshard.core.ir import COMM_KEY
from fxshard.models import LlamaDecoder, llama_seed003_plan, make_tokens
from tests.dist_utils import run_ranks

BF16 = torch.bfloat16


class _MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.relu(self.up(x)))
        return torch.log_softmax(self.norm(h + x), -1).pow(2).mean()


_MLP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return ((a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max().clamp_min(1e-12)).item()


def _reduced_dtypes(sm: nn.Module) -> set[torch.dtype]:
    """The dtypes of the values every reducing collective of ``sm``'s programs reduces."""
    out = set()
    for prog in sm.sharding.programs:
        for n in prog.gm.graph.nodes:
            if COMM_KEY in n.meta and n.meta[COMM_KEY]["kind"] in ("all_reduce", "reduce_scatter"):
                x = n.args[0]
                # inserted nodes (the planner's casts, a bucket's cat and views) carry no value: the dtype is
                # the cast's, else that of what they pack
                while "val" not in x.meta and not (x.target is torch.ops.aten._to_copy.default and "dtype" in x.kwargs):
                    x = x.args[0][0] if isinstance(x.args[0], (list, tuple)) else x.args[0]
                out.add(x.meta["val"].dtype if "val" in x.meta else x.kwargs["dtype"])
    return out


def _compare(sm: nn.Module, ref: nn.Module) -> dict:
    """Gradient errors (relative) and dtypes of every parameter of ``sm`` against ``ref``'s."""
    errs, dtypes = {}, set()
    for n, p in sm.named_parameters():
        r = ref.get_parameter(n)
        full = sm._dtensor(n, p.grad).full_tensor()
        errs[n] = _rel(full, r.grad)
        dtypes |= {p.dtype, p.grad.dtype}
    return {"grads": errs, "dtypes": dtypes}


def _updates(sm: nn.Module, ref: nn.Module, before: dict) -> float:
    """The largest relative error of ``sm``'s parameter updates since ``before`` (full tensors by name)."""
    return max(_rel(sm._dtensor(n, p).full_tensor() - before[n], ref.get_parameter(n) - before[n])
               for n, p in sm.named_parameters())


def _train(sm: nn.Module, ref: nn.Module, call_sm, call_ref, steps: int) -> dict:
    """``steps`` SGD steps (momentum: float32 state) of both under autocast: per step the loss error, the
    gradient errors of the first step, the error of the total updates. (Adam's first steps move each weight
    by about lr * sign(gradient), so bf16 noise in a near-zero gradient flips whole updates: SGD's update is
    proportional to the gradient, so its parity has bf16's tolerance.)"""
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (sm, ref)]
    out: dict = {"loss": []}
    for step in range(steps):
        for m in (sm, ref):
            m.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            ls, lr = call_sm(), call_ref()
        ls.backward()
        lr.backward()
        out["loss"].append(_rel(ls, lr))
        out["loss_dtype"] = ls.dtype
        if step == 0:
            out.update(_compare(sm, ref))
        for o in opts:
            o.step()
    out["updates"] = _updates(sm, ref, before)
    out["state_dtypes"] = {v.dtype for s in opts[0].state.values() for v in s.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0}
    return out


def _autocast_parity(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    res: dict = {}
    # a tensor-parallel MLP (Colwise/Rowwise): the row-split matmul's bf16 output is a Partial sum
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=BF16):
        sm = fxshard.shard(model, mesh, _MLP_PLAN, example_inputs=(x,))
    res["mlp"] = _train(sm, ref, lambda: sm(x), lambda: ref(x), 3)
    res["mlp_reduced"] = _reduced_dtypes(sm)
    res["mlp_comm"] = fxshard.comm_stats(sm)
    # data parallel (batch split, parameters replicated): bucketed gradient all-reduces of float32 parameters
    # (a batch large enough that all-reducing the gradients is cheaper than gathering the batch)
    torch.manual_seed(0)
    model, batch = _MLP(), torch.randn(256, 16)
    ref = copy.deepcopy(model)
    local = batch.chunk(world)[rank]
    with torch.autocast("cpu", dtype=BF16):
        sm = fxshard.shard(model, mesh, {}, example_inputs=(batch,), in_specs=(P("tp", None),))
    res["dp"] = _train(sm, ref, lambda: sm(local), lambda: ref(batch), 2)
    res["dp_reduced"] = _reduced_dtypes(sm)
    res["dp_comm"] = fxshard.comm_stats(sm)
    # the same model sharded outside autocast reduces its float32 sums as before
    res["fp32_comm"] = fxshard.comm_stats(fxshard.shard(_MLP(), mesh, _MLP_PLAN, example_inputs=(x,)))

    # fxshard.models' Llama with seed 003's plan (sequence parallel, loss parallel), loss inside
    torch.manual_seed(0)
    llama = LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, hidden=64, max_seq=16)
    tokens, targets = make_tokens(2, 8, 64, seed=1), make_tokens(2, 8, 64, seed=2)
    ref = copy.deepcopy(llama)
    with torch.autocast("cpu", dtype=BF16):
        sm = fxshard.shard(llama, mesh, llama_seed003_plan(), example_inputs=(tokens, targets))
    res["llama"] = _train(sm, ref, lambda: sm(tokens, targets), lambda: ref(tokens, targets), 2)
    res["llama_reduced"] = _reduced_dtypes(sm)

    # a model built on the meta device (autocast casts nothing on meta: traced on fake CPU tensors), then a
    # mode switch, which shards a meta copy again under the same autocast
    torch.manual_seed(0)
    full = _MLP()
    with torch.device("meta"):
        meta = _MLP()
    with torch.autocast("cpu", dtype=BF16):
        sm = fxshard.shard(meta, mesh, _MLP_PLAN, example_inputs=(torch.empty(8, 16, device="meta"),))
    sm.load_full_state_dict(full.state_dict())
    res["meta_casts"] = sorted(n.args[0].name for n in sm._traced.gm.graph.nodes  # of the program's inputs
                               if n.target is torch.ops.aten._to_copy.default and n.kwargs.get("dtype") == BF16
                               and n.args[0].op == "placeholder")
    res["meta"] = _train(sm, full, lambda: sm(x), lambda: full(x), 1)
    sm.eval()
    full.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        res["meta_eval"] = _rel(sm(x), full(x))
    return res


def test_autocast_trains_as_eager_autocast() -> None:
    """Sharded under torch.autocast('cpu', bfloat16) vs the unsharded model under the same autocast: loss and
    every gradient within bf16 error, float32 parameters, gradients and optimizer state, SGD steps in parity;
    the forward's Partial sum (row-split bf16 matmul) and the gradient reductions run in float32."""
    res = run_ranks(_autocast_parity, 2, timeout=900)[0]
    for case in ("mlp", "dp", "llama", "meta"):
        r = res[case]
        assert r["loss_dtype"] == torch.float32, case  # eager's mean and cross entropy give float32
        assert max(r["loss"]) < 2e-2, (case, r["loss"])
        # bf16 rounding is ~0.4% per op; a missing reduction is off by ~100%
        assert max(r["grads"].values()) < 5e-2, (case, r["grads"])
        assert r["dtypes"] == {torch.float32}, (case, r["dtypes"])
        assert r["state_dtypes"] == {torch.float32}, (case, r["state_dtypes"])
        assert r["updates"] < 5e-2, (case, r["updates"])
    assert res["meta_eval"] < 2e-2
    # x, both weights and biases: autocast cast on the fake CPU tensors it traced
    assert res["meta_casts"] == ["p_down_bias", "p_down_weight", "p_up_bias", "p_up_weight", "x"], res["meta_casts"]
    assert res["mlp_reduced"] == res["llama_reduced"] == res["dp_reduced"] == {torch.float32}
    assert res["dp_comm"]["backward"]["all_reduce"]["bytes"] == (16 * 32 + 32 + 32 * 16 + 16 + 16 + 16) * 4
    # the rowwise output [8, 16] is all-reduced in float32: as many bytes as the float32 model's
    assert res["mlp_comm"]["forward"]["all_reduce"] == {"count": 1, "bytes": 8 * 16 * 4}
    assert res["mlp_comm"]["forward"] == res["fp32_comm"]["forward"]


def _mismatch(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model, x = _MLP(), torch.randn(8, 16)
    out: dict = {}
    with torch.autocast("cpu", dtype=BF16):
        sm = fxshard.shard(copy.deepcopy(model), mesh, _MLP_PLAN, example_inputs=(x,))
    plain = fxshard.shard(copy.deepcopy(model), mesh, _MLP_PLAN, example_inputs=(x,))
    calls = {
        "amp_without": lambda: sm(x),
        "plain_under": lambda: _under(BF16, plain, x),
        "other_dtype": lambda: _under(torch.float16, sm, x),
        "no_cache": lambda: _under(BF16, sm, x, cache_enabled=False),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except ShardingError as e:
            out[name] = str(e)
    with torch.autocast("cpu", dtype=BF16, enabled=rank == 0):  # ranks that disagree: an error, not a hang
        try:
            fxshard.shard(copy.deepcopy(model), mesh, _MLP_PLAN, example_inputs=(x,))
            out["ranks_differ"] = None
        except ShardingError as e:
            out["ranks_differ"] = str(e)
    with torch.autocast("cpu", dtype=BF16):
        out["amp_ok"] = _rel(sm(x), model(x))
    out["plain_ok"] = _rel(plain(x), model(x))
    return out


def _under(dtype: torch.dtype, sm: nn.Module, x: torch.Tensor, cache_enabled: bool = True) -> torch.Tensor:
    with torch.autocast("cpu", dtype=dtype, cache_enabled=cache_enabled):
        return sm(x)


def test_autocast_state_must_match_the_traced_one() -> None:
    """The autocast state (enabled, dtype, cache flag) is part of what a program computes: a call under
    another one than shard() saw raises, saying both and how to fix it; the matching calls run. Ranks sharding
    under different states raise at shard() (their programs would differ)."""
    outs = run_ranks(_mismatch, 2)
    out = outs[0]
    for o in outs:
        assert "autocast" in o["ranks_differ"], o["ranks_differ"]
    assert "called under no autocast (for 'cpu'), but its programs were traced under torch.autocast('cpu', " \
           "dtype=torch.bfloat16)" in out["amp_without"]
    assert "call the module inside torch.autocast('cpu', dtype=torch.bfloat16)" in out["amp_without"]
    assert "under torch.autocast('cpu', dtype=torch.bfloat16), but its programs were traced under no autocast" \
           in out["plain_under"]
    assert "call shard() inside the same torch.autocast" in out["plain_under"]
    assert "dtype=torch.float16" in out["other_dtype"]
    assert "cache_enabled=False" in out["no_cache"]
    assert out["amp_ok"] < 2e-2 and out["plain_ok"] < 1e-5


def _pure_bf16(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    torch.manual_seed(0)
    model, x = _MLP().to(BF16), torch.randn(8, 16, dtype=BF16)
    ref = copy.deepcopy(model)
    sm = fxshard.shard(model, mesh, _MLP_PLAN, example_inputs=(x,))
    ls, lr = sm(x), ref(x)
    ls.backward()
    lr.backward()
    return {"loss": _rel(ls, lr), **_compare(sm, ref), "reduced": _reduced_dtypes(sm)}


def test_pure_bf16_still_reduces_in_bf16() -> None:
    """A model converted to bfloat16 (no autocast) trains as before: bf16 parameters and gradients, sums
    reduced in bf16 (the mesh's reduce dtype is set only under autocast)."""
    out = run_ranks(_pure_bf16, 2)[0]
    assert out["loss"] < 2e-2 and max(out["grads"].values()) < 5e-2, out
    assert out["dtypes"] == {BF16} and out["reduced"] == {BF16}


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 3  # not a parameter: autocast casts it at each linear (a parameter it casts once, cached)
        return (self.lin(h) - self.lin(h).flip(0)).float().pow(2).sum()


def test_autocast_casts_stay_apart_in_the_forward(mesh2) -> None:
    """Autocast casts a value other than a parameter at each use; the traced forward keeps those casts apart:
    merged, the gradients of the uses would sum in bf16 instead of float32 (eager's gradient of x here), a
    parameter used twice is cast once, as autocast's cache does. Replicated plan: the fake group's numerics
    are real."""
    torch.manual_seed(0)
    model, x = _Twice(), torch.randn(8, 16, requires_grad=True)
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=BF16):
        sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
        xs = x.detach().clone().requires_grad_()
        sm(xs).backward()
        ref(x).backward()
    g = sm._traced.gm.graph  # the traced forward, which autograd differentiates
    sources = [n.args[0].name for n in g.nodes
               if n.target is torch.ops.aten._to_copy.default and n.kwargs.get("dtype") == BF16]
    assert sorted(sources) == ["mul", "mul", "p_lin_bias", "p_lin_weight"], sources
    assert torch.equal(xs.grad, x.grad), (xs.grad - x.grad).abs().max()
    for n, p in sm.named_parameters():
        assert torch.equal(p.grad, ref.get_parameter(n).grad), n


def test_jit_refuses_autocast(mesh2) -> None:
    """fxshard.jit traces without autocast: under it a call raises, pointing at shard() for mixed precision."""
    sf = fxshard.jit(lambda a, w: a @ w, mesh2, in_specs=(P("tp", None), None), out_specs=P("tp", None))
    with torch.autocast("cpu", dtype=BF16):
        with pytest.raises(ShardingError, match=r"was called: torch.autocast is enabled for 'cpu'.*fxshard.shard\(\) "
                                                r"called inside torch.autocast"):
            sf(torch.randn(8, 16).chunk(2)[0], torch.randn(16, 8))


def test_widened_reductions_are_priced_as_emitted() -> None:
    """The planners price a bf16 Partial sum's reduction at the float32 bytes plan_transition emits for it
    (``Link.reduce_scale``, from ``axis_link``/``solve.links_of``); gathers and max reductions keep their bytes."""
    from fxshard.planner.cost import Link, axis_link, transition_cost
    from fxshard.core.mesh import MeshInfo
    from fxshard.core.placements import Part, R, S
    from fxshard.comm.transition import plan_transition

    mesh = MeshInfo(("tp",), (2,), (0,), ("",), "cpu", 0, reduce_dtype=torch.float32)
    link = axis_link(mesh, 0, BF16)
    assert link.reduce_scale == 2.0 and axis_link(mesh, 0, torch.float32).reduce_scale == 1.0
    assert transition_cost(Part("sum"), R, 100.0, 2, link) == transition_cost(Part("sum"), R, 200.0, 2)
    assert transition_cost(Part("sum"), S(0), 100.0, 2, link) == transition_cost(Part("sum"), S(0), 200.0, 2)
    assert transition_cost(S(0), R, 100.0, 2, link) == transition_cost(S(0), R, 100.0, 2)
    assert transition_cost(Part("max"), R, 100.0, 2, link) == transition_cost(Part("max"), R, 100.0, 2)
    # what is emitted: the [8, 16] bf16 sum all-reduced as float32
    steps = plan_transition((Part("sum"),), (R,), (8, 16), mesh, BF16)
    assert [(st.kind, st.dtype) for st in steps] == [("cast", torch.float32), ("all_reduce", None),
                                                     ("cast", BF16)]
    assert steps[1].nbytes == 8 * 16 * 4


class _NoGradGate(nn.Module):
    """A gate computed under ``torch.no_grad()`` from an activation (``reads_activation``), or from a buffer only
    (as rotary tables are), or from a ``.detach()``-ed activation (``detach``)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.a, self.g = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("table", torch.linspace(0.5, 1.5, 8))
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "own_autocast":  # the model's own autocast block around a no_grad region
            with torch.autocast("cpu", dtype=BF16):
                h = self.a(x)
                with torch.no_grad():
                    w = torch.softmax(self.g(h), -1)
            return (h * w).float().pow(2).mean()
        h = self.a(x)
        if self.mode == "detach":
            w = torch.softmax(self.g(h.detach()), -1)
        else:
            with torch.no_grad():
                w = torch.softmax(self.g(h), -1) if self.mode == "reads_activation" else self.table.cos() * 2
        return (h * w).float().pow(2).mean()


def test_no_grad_regions_under_autocast_match_eager_or_raise(mesh2) -> None:
    """torch.export inlines a no_grad region nested in an autocast forward, so a gradient would flow where
    eager's stops (g.weight got a gradient, a.weight's was 20% off, silently): such a region reading a tensor
    that needs a gradient raises; one over buffers only, and .detach(), match eager. Replicated plan: the fake
    group's numerics are real."""
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=BF16):
        with pytest.raises(ShardingError, match=r"computes under torch.no_grad\(\) from a tensor that needs a "
                                                r"gradient, inside torch.autocast\('cpu'.*\.detach\(\)"):
            fxshard.shard(_NoGradGate("reads_activation"), mesh2, {}, example_inputs=(x,))
    with pytest.raises(ShardingError, match=r"computes under torch.no_grad\(\) .* inside torch.autocast\('cpu'"):
        fxshard.shard(_NoGradGate("own_autocast"), mesh2, {}, example_inputs=(x,))
    for mode in ("buffer_only", "detach"):
        torch.manual_seed(0)
        model = _NoGradGate(mode)
        ref = copy.deepcopy(model)
        with torch.autocast("cpu", dtype=BF16):
            sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
            loss, want = sm(x), ref(x)
        loss.backward()
        want.backward()
        assert _rel(loss, want) < 1e-3, mode
        for n, p in ref.named_parameters():  # bf16 level: a leaked gradient is ~20% off (or not None)
            got = sm.get_parameter(n).grad
            assert (got is None) == (p.grad is None), (mode, n)
            if p.grad is not None:
                assert _rel(got, p.grad) < 2e-2, (mode, n, _rel(got, p.grad))


class _RotaryAttention(nn.Module):
    """q and k scaled by a float32 table (they leave autocast's linears in bfloat16 and come back float32, as
    rotary-embedded ones do), v in bfloat16: attention must cast them as eager's autocast casts SDPA's inputs."""

    def __init__(self, dropout_p: float) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("rot", torch.linspace(0.5, 1.5, 16).repeat(8, 1))
        self.dropout_p = dropout_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x) * self.rot, self.k(x) * self.rot, self.v(x)
        q, k, v = (t.view(2, 8, 2, 8).transpose(1, 2) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p, is_causal=True)
        return o.float().pow(2).mean()


@pytest.mark.parametrize("form", ["fused", "math", "dropout"])
def test_attention_under_autocast_casts_its_inputs_as_eager(mesh2, form) -> None:
    """The fused node (fxshard::attention's autocast kernel), the math form (sdpa_kernel(MATH)) and attention
    dropout (the math form) all get SDPA's autocast casts: before, the math form met float32 q/k beside a
    bfloat16 v and shard() failed. Deterministic forms match eager at bf16 level; dropout shards and trains."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model, x = _RotaryAttention(0.5 if form == "dropout" else 0.0), torch.randn(2, 8, 16)
    ref = copy.deepcopy(model)
    backends = sdpa_kernel(SDPBackend.MATH) if form == "math" else contextlib.nullcontext()
    with torch.autocast("cpu", dtype=BF16), backends:
        sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
        loss = sm(x)
        loss.backward()
        if form == "dropout":
            assert torch.isfinite(loss) and all(p.grad is not None for p in sm.parameters())
            return
        want = ref(x)
        want.backward()
    assert _rel(loss, want) < 1e-2
    scale = max(p.grad.abs().max().item() for p in ref.parameters())  # k.bias's gradient is 0 up to rounding
    for n, p in ref.named_parameters():
        assert (sm.get_parameter(n).grad - p.grad).abs().max().item() < 3e-2 * scale, (form, n)
