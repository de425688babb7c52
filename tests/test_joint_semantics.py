"""Training (joint forward + backward graph) matches eager autograd, or says why it cannot.

One 2-rank gloo spawn trains every model below for 2 SGD steps, sharded and unsharded, and compares
the forward loss, every parameter gradient (gathered; None exactly where eager leaves it None), the
input gradients and the parameters after the steps. The cases are each a way the joint graph once
went silently wrong or crashed: in-place ops in backward formulas (max/min), a decomposition with a
different backward (index_fill), inputs named like graph nodes, stop-gradients (no_grad, detach),
a learned attention mask, in-place slice copies and circular padding, data-dependent shapes (also of
an output), a collective under no_grad, meta example inputs for a real model. Error messages are
checked on the fake process group.

A second spawn runs the no_grad family (``NO_GRAD_OPS``): each op on an activation and on a parameter
under ``torch.no_grad()``, trained with ``shard()`` and differentiated inside ``fxshard.jit``, against eager
(issue 37: a no-op ``.to`` there dropped the gradient of every later use of the tensor).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel
from tests.dist_utils import run_ranks

TOL = 1e-5


# ---- models -----------------------------------------------------------------------------------

class MaxMin(nn.Module):
    """maximum(x[5,1], y[5]), minimum(x[10,5], scalar tensor) and binary max/min, with ties."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.a = nn.Parameter(torch.randn(5, 1, generator=g))
        self.b = nn.Parameter(torch.randn(5, generator=g))
        self.c = nn.Parameter(torch.randn(10, 6, generator=g))
        self.s = nn.Parameter(torch.tensor(0.25))
        with torch.no_grad():  # ties: eager splits the gradient between the two inputs
            self.b[2] = self.a[2, 0]
            self.c[3, 1] = 0.25
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # [10, 6]
        m1 = torch.maximum(self.a, self.b)  # [5, 5]
        m2 = torch.minimum(self.c, self.s)  # [10, 6]
        m3 = torch.max(h, self.c)
        m4 = torch.min(h, m2)
        return m1.sum() * 0.5 + (m2 * 2).sum() + (m3 ** 2).sum() + (m4 * h).sum()


class IndexFill(nn.Module):
    """index_fill with repeated indices: eager counts each filled position once."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.v = nn.Parameter(torch.tensor(0.5))
        self.register_buffer("idx", torch.tensor([0, 2, 0, 5, 2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (h.index_fill(1, self.idx, self.v) ** 2).sum() + (h.index_fill(0, torch.tensor([1, 1]), 2.0) ** 2).sum()


class ClashingNames(nn.Module):
    """Forward arguments named like the graph's own nodes (and the joint graph's inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, permute, addmm, t, tangents_1, primals_1, sum_1):
        return (((self.lin(permute) * addmm + t) * tangents_1 + primals_1 * sum_1) ** 2).sum()


class StopGrad(nn.Module):
    """``a`` feeds the loss only through a stop-gradient; ``c`` only under enable_grad inside no_grad."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "no_grad":
            with torch.no_grad():
                h = self.a(x)
        elif self.how == "detach":
            h = self.a(x).detach()
        else:  # enable_grad nested in no_grad: c's branch gets gradients, a's does not
            with torch.no_grad():
                h = torch.relu(self.a(x))
                with torch.enable_grad():
                    k = self.c(x)
            h = h + k
        return (self.b(torch.tanh(h) + x) ** 2).sum()


class LearnedMask(nn.Module):
    """Attention with a mask computed from parameters (as Hugging Face's doge does): its gradient comes from
    fxshard::attention_backward."""

    def __init__(self, learned: bool = True) -> None:
        super().__init__()
        self.learned = learned
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        self.dt = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, 4, 4).transpose(1, 2) for m in (self.q, self.k, self.v))
        mask = self.dt(x).transpose(1, 2).unsqueeze(-2).expand(b, 4, t, t)
        mask = mask if self.learned else mask.detach()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return (self.o(y.transpose(1, 2).reshape(b, t, 16)) ** 2).sum()


class SliceCopies(nn.Module):
    """In-place copies into slices, as the multi-head latent attention of DeepSeek-V2/V3 in transformers
    builds its keys, and an indexed assignment ``z[:, 0] = ...``."""

    def __init__(self) -> None:
        super().__init__()
        self.nope, self.rot, self.out = nn.Linear(8, 12), nn.Linear(8, 4), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k_nope = self.nope(x)
        k_rot = self.rot(x)[:, :1].expand(-1, x.shape[1], -1)
        key = k_nope.new_empty(*k_nope.shape[:-1], 16)
        key[..., :12].copy_(k_nope)
        key[..., 12:].copy_(k_rot)
        z = self.out(key)
        z[:, 0] = z[:, -1] * 2
        return (z ** 2).sum()


class CircularPad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.conv(F.pad(x, (2, 2), mode="circular")) ** 2).sum()


class DataDependent(nn.Module):
    """Sizes the data decides: masked_select, boolean indexing (read and write), tensor split points."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.v = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor, split: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        a = (torch.masked_select(h, h > 0) ** 2).sum()
        b = h[h < 0].sum() + (h[x[:, 0] > 0] * 3).sum()
        c = (h.index_put((h < -0.3,), self.v) ** 2).sum()
        p, q = torch.tensor_split(h, split, dim=1)
        return a + b + c + (p ** 2).sum() + q.sum()


class DataDependentOutput(nn.Module):
    """An output whose size the data decides: its cotangent (the backward's input) has that size too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.masked_select(h, h > 0) * 2


class CollectiveNoGrad(nn.Module):
    """A user all_reduce on a value that needs no gradient: runs as written, like eager on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            s = self.a(x)
            torch.distributed.all_reduce(s)
        return ((self.b(x) * s) ** 2).sum()


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return ((self.lin(x) + self.emb(ids)) ** 2).sum()


class DeepseekLoss(nn.Module):
    """A 1-layer DeepSeek-V3 (transformers, tiny config, dense MLP) returning its LM loss."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        cfg = DeepseekV3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
            qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
            max_position_embeddings=32, tie_word_embeddings=False, use_cache=False)
        self.lm = DeepseekV3ForCausalLM(cfg)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels).loss


DEEPSEEK_PLAN = {
    "lm.model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "lm.model.layers.*.self_attn.kv_b_proj": ColwiseParallel(),
    "lm.model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "lm.model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "lm.model.layers.*.mlp.up_proj": ColwiseParallel(),
    "lm.model.layers.*.mlp.down_proj": RowwiseParallel(),
}


# ---- the parity harness (runs on each rank) ------------------------------------------------------

def _parity(mesh, model: nn.Module, inputs: tuple, plan: dict, *, in_specs: Any = None,
            local: Optional[Callable[[tuple], tuple]] = None, example: Optional[tuple] = None) -> dict:
    """Shard ``model``, then run 2 SGD steps on it and on an unsharded copy from the same weights; the
    largest errors (relative to the value's scale when above 1) of losses, gradients and parameters."""
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=example or inputs, in_specs=in_specs)
    local_inputs = local(inputs) if local is not None else inputs
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.05), torch.optim.SGD(sm.parameters(), lr=0.05)
    res = {"loss": 0.0, "grad": 0.0, "input_grad": 0.0, "none_mismatch": [], "ref_none": [],
           "fallbacks": sorted({str(w.message).split(";")[0] for w in caught if "no sharding rule" in str(w.message)})}
    sm_params = dict(sm.named_parameters(remove_duplicate=False))
    for _ in range(2):
        opt_ref.zero_grad()
        opt.zero_grad()
        ins_ref = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        ins = [x.detach().clone().requires_grad_(x.requires_grad) for x in local_inputs]
        loss_ref, loss = _scalar(ref(*ins_ref)), _scalar(sm(*ins))
        loss_ref.backward()
        loss.backward()
        res["loss"] = max(res["loss"], abs(loss.item() - loss_ref.item()) / max(1.0, abs(loss_ref.item())))
        for name, p in ref.named_parameters(remove_duplicate=False):
            mine = sm_params[name].grad
            if (p.grad is None) != (mine is None):
                res["none_mismatch"].append(name)
            elif p.grad is None:
                res["ref_none"].append(name)
            else:
                full = sm._dtensor(name, mine).full_tensor()
                res["grad"] = max(res["grad"], _rel(full, p.grad))
        for i, (a, b, x) in enumerate(zip(ins_ref, ins, inputs)):
            if x.requires_grad and (a.grad is None) != (b.grad is None):
                res["none_mismatch"].append(f"input {i}")
            elif x.requires_grad and a.grad is not None:
                want = local((a.grad,))[0] if local is not None else a.grad
                res["input_grad"] = max(res["input_grad"], _rel(b.grad, want))
        opt_ref.step()
        opt.step()
    full = sm.full_state_dict()
    res["param"] = max(_rel(full[k], v) for k, v in ref.state_dict().items())
    return res


def _scalar(y: torch.Tensor) -> torch.Tensor:
    """A model's output as a loss: itself when a scalar, else the sum of its squares."""
    return y if y.dim() == 0 else (y ** 2).sum()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs difference, relative to the reference's largest entry when that exceeds 1."""
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _batch_chunk(rank: int, world: int) -> Callable[[tuple], tuple]:
    return lambda xs: tuple(x.chunk(world, 0)[rank] for x in xs)


def _cases(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    out = {}
    out["maxmin_replicated"] = _parity(mesh, MaxMin(), (randn(10, 6),), {})
    out["maxmin_colwise"] = _parity(mesh, MaxMin(), (randn(10, 6, grad=True),), {"lin": ColwiseParallel()})
    out["index_fill"] = _parity(mesh, IndexFill(), (randn(3, 4),), {"lin": ColwiseParallel()})
    out["clashing_names"] = _parity(mesh, ClashingNames(), tuple(randn(2, 4, grad=True) for _ in range(6)),
                                    {"lin": ColwiseParallel()})
    for how in ("no_grad", "detach", "enable_grad"):
        out[f"stop_{how}"] = _parity(mesh, StopGrad(how), (randn(4, 8, grad=True),), {"b": ColwiseParallel()})
    out["learned_mask"] = _parity(mesh, LearnedMask(), (randn(2, 6, 16, grad=True),),
                                  {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                   "o": RowwiseParallel()})
    out["slice_copies"] = _parity(mesh, SliceCopies(), (randn(2, 5, 8, grad=True),),
                                  {"nope": ColwiseParallel(), "out": RowwiseParallel()})
    out["circular_pad"] = _parity(mesh, CircularPad(), (randn(4, 3, 8, grad=True),), {}, in_specs=P("tp"),
                                  local=_batch_chunk(rank, world))
    out["data_dependent"] = _parity(mesh, DataDependent(), (randn(5, 4), torch.tensor([2])),
                                    {"lin": ColwiseParallel()})
    out["data_dependent_output"] = _parity(mesh, DataDependentOutput(), (randn(5, 4, grad=True),),
                                           {"lin": ColwiseParallel()})
    out["collective_no_grad"] = _parity(mesh, CollectiveNoGrad(), (randn(3, 4),), {"b": ColwiseParallel()})
    ids = torch.randint(0, 16, (4,), generator=g)
    out["meta_inputs"] = _parity(mesh, Tokens(), (randn(4, 8, grad=True), ids), {"lin": ColwiseParallel()},
                                 example=(torch.empty(4, 8, device="meta", requires_grad=True),
                                          torch.empty(4, dtype=torch.long, device="meta")))
    torch.manual_seed(0)
    lm = DeepseekLoss()
    tokens = torch.randint(0, 64, (2, 8), generator=g)
    out["deepseek_mla"] = _parity(mesh, lm, (tokens, torch.roll(tokens, -1, 1)), DEEPSEEK_PLAN)
    return out


@pytest.fixture(scope="module")
def cases() -> dict:
    res = run_ranks(_cases, 2, timeout=600)
    return res[0]


def _assert_parity(r: dict, tol: float = TOL) -> None:
    assert r["loss"] <= tol and r["grad"] <= tol and r["input_grad"] <= tol and r["param"] <= tol, r
    assert r["none_mismatch"] == [], r


@pytest.mark.parametrize("case", ["maxmin_replicated", "maxmin_colwise"])
def test_maximum_minimum_gradients_match_eager(cases, case):
    _assert_parity(cases[case])


def test_index_fill_with_repeated_indices_counts_each_position_once(cases):
    _assert_parity(cases["index_fill"])


def test_inputs_named_like_graph_nodes(cases):
    _assert_parity(cases["clashing_names"])


@pytest.mark.parametrize("how", ["no_grad", "detach", "enable_grad"])
def test_stop_gradients_match_eager(cases, how):
    r = cases[f"stop_{how}"]
    _assert_parity(r)
    # a is reached only through the stop-gradient: eager leaves its gradient None, and so does fxshard
    assert {"a.weight", "a.bias"} <= set(r["ref_none"]), r
    assert ({"c.weight", "c.bias"} & set(r["ref_none"])) == (set() if how == "enable_grad" else {"c.weight", "c.bias"})


def test_learned_attention_mask_trains(cases):
    _assert_parity(cases["learned_mask"], 1e-4)


@pytest.mark.parametrize("case", ["slice_copies", "circular_pad"])
def test_in_place_slice_copies_and_circular_pad_train(cases, case):
    _assert_parity(cases[case], 1e-4)


@pytest.mark.parametrize("case", ["data_dependent", "data_dependent_output"])
def test_data_dependent_shapes_train(cases, case):
    _assert_parity(cases[case])


def test_collective_under_no_grad_runs_as_written(cases):
    _assert_parity(cases["collective_no_grad"])


def test_meta_example_inputs_for_a_real_model(cases):
    _assert_parity(cases["meta_inputs"])


def test_deepseek_v3_multi_head_latent_attention_trains(cases):
    r = cases["deepseek_mla"]
    _assert_parity(r, 1e-4)



# ---- the no_grad family: what leaves a grad-disabled region keeps its gradient as in eager ----------------

# ``t`` is an activation (``x * w``) or a parameter; each op runs on it under ``torch.no_grad()``. Eager hands
# the first group back as ``t`` itself (gradient intact; export then maps every later use of ``t`` to the
# region's output), the second as views or new tensors without a gradient; ``enable_grad`` inside re-enables it.
NO_GRAD_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "to_same_dtype": lambda t: t.to(torch.float32),
    "float": lambda t: t.float(),
    "type_as": lambda t: t.type_as(t),
    "to_same_device": lambda t: t.to("cpu"),
    "requires_grad_": lambda t: t.requires_grad_(),
    "contiguous": lambda t: t.contiguous(),
    "to_other_dtype": lambda t: t.to(torch.float64),
    "view": lambda t: t.view(-1),
    "reshape": lambda t: t.reshape(2, -1),
    "detach": lambda t: t.detach(),
    "clone": lambda t: t.clone(),
    "transpose_contiguous": lambda t: t.t().contiguous(),
    "new_requires_grad_": lambda t: (t * 2).requires_grad_(),
    "enable_grad": lambda t: _with_grad(lambda: t * 2),
}
NO_GRAD_ON_PARAMETERS = ("to_same_dtype", "float", "requires_grad_", "view", "detach", "clone")
NO_GRAD_ERRORS = ("in_place_activation", "in_place_parameter")


def _with_grad(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.enable_grad():
        return fn()


class NoGradOp(nn.Module):
    """``op`` on ``t`` under no_grad feeds an index (argmax) and a term of the loss; ``t`` is used after the
    region as well. ``in_place_*`` write ``t`` there; ``buffer_write`` copies ``t`` into a slice of a buffer there
    (eager: the buffer carries no gradient; fxshard differentiated through the copy, doubling ``w.grad``)."""

    def __init__(self, op: str, on: str = "activation") -> None:
        super().__init__()
        self.op, self.on = op, on
        g = torch.Generator().manual_seed(3)
        self.w = nn.Parameter(torch.randn(8, generator=g))
        self.p = nn.Parameter(torch.randn(4, 8, generator=g))
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.register_buffer("buf", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x * self.w if self.on == "activation" else self.p
        with torch.no_grad():
            if self.op.startswith("in_place"):
                g = t.mul_(2.0)
            elif self.op == "buffer_write":  # through a view: later reads of buf are not the region's output
                self.buf[:2].copy_(t[:2] * 2)
                g = self.buf
            else:
                g = NO_GRAD_OPS[self.op](t)
            idx = self.a(g.float().reshape(4, 8)).argmax(-1)
        return (self.b(t).sum(-1) * idx).sum() + (g.reshape(4, 8).float() * t).sum() + (self.buf * t).sum()


class NoOpConversion(nn.Module):
    """Issue 37's minimal form: a no-op ``.to`` of an activation inside no_grad picks an index."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.w = nn.Parameter(torch.randn(8, generator=g))
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.w
        with torch.no_grad():
            idx = self.a(h.to(torch.float32)).argmax(-1)
        return (self.b(h).sum(-1) * idx).sum()


def _jit_grads(mesh, model: nn.Module, x: torch.Tensor) -> Any:
    """``fxshard.jit`` of a function returning ``model``'s loss and its parameter gradients (autograd inside):
    max error of both against eager autograd (None there is zero here), or the ShardingError's message."""
    from torch.func import functional_call

    ref = copy.deepcopy(model)
    loss_ref = ref(x)
    loss_ref.backward()

    def loss_and_grads(params: dict, buffers: dict, x: torch.Tensor) -> tuple:
        with torch.enable_grad():
            params = {k: p.detach().requires_grad_() for k, p in params.items()}
            loss = functional_call(model, {**params, **buffers}, (x,))
            grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, materialize_grads=True)
        return loss.detach(), dict(zip(params, grads))

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    try:
        loss, grads = fxshard.jit(loss_and_grads, mesh)(params, buffers, x)
    except fxshard.ShardingError as e:
        return str(e)
    err = abs(loss.item() - loss_ref.item()) / max(1.0, abs(loss_ref.item()))
    for k, p in ref.named_parameters():
        err = max(err, _rel(grads[k], p.grad if p.grad is not None else torch.zeros_like(p)))
    return err


def _no_grad_cases(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, generator=g)
    plan = {"b": ColwiseParallel()}
    out: dict = {"shard": {}, "jit": {}, "errors": {}}
    models = {f"{op}/activation": NoGradOp(op) for op in NO_GRAD_OPS}
    models |= {f"{op}/parameter": NoGradOp(op, "parameter") for op in NO_GRAD_ON_PARAMETERS}
    models["buffer_write/activation"] = NoGradOp("buffer_write")
    models["minimal"] = NoOpConversion()
    for name, model in models.items():
        inputs = (x.clone().requires_grad_(name.endswith("activation")),)
        out["shard"][name] = _parity(mesh, model, inputs, {} if name == "minimal" else plan)  # the issue's: empty
        out["jit"][name] = _jit_grads(mesh, model, x)
    for name in NO_GRAD_ERRORS:
        model = NoGradOp(name, name.split("_")[-1])
        try:
            fxshard.shard(model, mesh, plan, example_inputs=(x,))
            out["errors"][name] = None
        except fxshard.ShardingError as e:
            out["errors"][name] = str(e)
        out["jit"][name] = _jit_grads(mesh, model, x)
    return out


@pytest.fixture(scope="module")
def no_grad_cases() -> dict:
    return run_ranks(_no_grad_cases, 2, timeout=900)[0]


@pytest.mark.parametrize("case", [f"{op}/activation" for op in NO_GRAD_OPS]
                         + [f"{op}/parameter" for op in NO_GRAD_ON_PARAMETERS] + ["buffer_write/activation", "minimal"])
def test_values_leaving_no_grad_keep_eagers_gradient(no_grad_cases, case):
    """Issue 37: a no-op conversion inside no_grad dropped every later gradient of the tensor it converted
    (``w.grad`` None where eager's is nonzero), sharded and on one rank; views and new tensors stay detached,
    a buffer written there carries no gradient."""
    r = no_grad_cases["shard"][case]
    _assert_parity(r)
    assert ("p" if case.endswith("parameter") else "w") not in r["ref_none"], r  # the gradient the issue lost
    jit = no_grad_cases["jit"][case]
    if case == "buffer_write/activation":  # jit shards pure functions: an argument written in place is refused
        assert isinstance(jit, str) and "buffers['buf'] in place" in jit, jit
    else:
        assert isinstance(jit, float) and jit <= TOL, jit


def test_in_place_write_under_no_grad_to_a_tensor_needing_a_gradient_is_an_error(no_grad_cases):
    """Eager's autograd does not see the write (or fails in backward where the old value was saved); shard()
    says so, naming both lines. fxshard.jit runs autograd inside the traced function, as eager does."""
    msg = no_grad_cases["errors"]["in_place_activation"]
    assert msg is not None and "in place under torch.no_grad()" in msg and "g = t.mul_(2.0)" in msg, msg
    assert "t = x * self.w" in msg and "out-of-place" in msg, msg
    msg = no_grad_cases["errors"]["in_place_parameter"]
    assert msg is not None and "parameter" in msg, msg
    assert no_grad_cases["jit"]["in_place_activation"] <= TOL  # autograd runs inside: eager's own semantics
    assert "params['p'] in place" in no_grad_cases["jit"]["in_place_parameter"]


# ---- error messages (fake process group) -------------------------------------------------------

class _NoDerivative(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.special.zeta(h.abs() + 2, torch.full_like(h, 2.0)).sum()


class _ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if (h > 0).sum() > 3:
            return h.sum()
        return (h ** 2).sum()


class _EffectToken(nn.Module):
    """eig's backward solves a system, whose error check torch orders by an effect token."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.linalg.eigvals(h[:, :3] @ h[:, :3].T).real.sum()


@pytest.mark.parametrize("model,needles", [
    (_NoDerivative, ["special_zeta", "derivative for 'zeta' is not implemented",
                     "torch.special.zeta(h.abs() + 2", "torch.no_grad()"]),
    (_ValueBranch, ["GuardOnDataDependentSymNode", "if (h > 0).sum() > 3:", "torch.where"]),
    (_EffectToken, ["_linalg_check_errors", "effect token", "torch.linalg.eigvals(h[:, :3]", "torch.no_grad()"]),
])
def test_tracing_failures_are_one_readable_error(mesh2, capfd, model, needles):
    capfd.readouterr()
    with pytest.raises(fxshard.ShardingError) as ei:
        fxshard.shard(model(), mesh2, {"lin": ColwiseParallel()}, example_inputs=(torch.randn(3, 4),))
    msg = str(ei.value)
    for n in needles:
        assert n in msg, (n, msg)
    assert ei.value.__cause__ is None and ei.value.__suppress_context__  # no torch traceback chained
    err = capfd.readouterr().err
    assert "Traceback" not in err and "GraphModule" not in err and "symbolic_shapes" not in err, err


class _InfiniteBranches(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return torch.ops.aten._safe_softmax(x, 1), torch.special.log_ndtr(y)


def test_gradients_where_a_decomposition_has_an_infinite_branch_match_eager():
    """Rows of -inf in ``_safe_softmax`` and very negative ``log_ndtr`` inputs: the decomposed forward's
    unselected branch is infinite there, and its zero gradient must not become NaN (eager's is finite)."""
    from fxshard.tracing.joint import trace_joint
    from fxshard.tracing.export import trace_forward

    x = torch.randn(2, 3, 4)
    x[0, :, 1] = x[1, 0, :] = x[1, :, 2] = float("-inf")
    y = torch.tensor([-20.0, -7.38, -5.63, -1.0, 0.5, 1.0, 3.0, 7.3])
    model = _InfiniteBranches()
    traced = trace_forward(model, (x, y), {})
    joint = trace_joint(traced, traced.gm, [True, True])
    cot = (torch.randn(2, 3, 4), torch.randn(8))
    got = joint.gm(x, y, *cot)
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    want = model(xr, yr)
    for g, w in zip(got, [*want, *torch.autograd.grad(want, [xr, yr], cot)]):
        torch.testing.assert_close(g, w.detach(), rtol=1e-5, atol=1e-5)


def test_joint_graph_is_functional(mesh2):
    """No in-place op is left for CSE and the passes to misread (what broke max/min gradients)."""
    from fxshard.tracing.joint import trace_joint
    from fxshard.tracing.export import trace_forward

    model = MaxMin()
    traced = trace_forward(model, (torch.randn(10, 6),), {})
    joint = trace_joint(traced, traced.gm, [s.kind == "param" for s in traced.slots])
    ops = [n.target for n in joint.gm.graph.nodes if n.op == "call_function"]
    assert not [op for op in ops if isinstance(op, torch._ops.OpOverload) and op._schema.is_mutable], ops
    # the where feeding both maximum gradients is one value, and neither gradient overwrites it
    assert torch.ops.aten.copy_.default not in ops


@pytest.mark.parametrize("learned", [True, False])
def test_attention_with_a_learned_mask_stays_one_node(learned):
    """fxshard::attention_backward differentiates the mask too: a learned mask keeps attention one node
    (CPU's fused kernel, whose backward has no mask gradient, was decomposed to the math form)."""
    from fxshard.ops.attention import ATTENTION, ATTENTION_BACKWARD
    from fxshard.tracing.joint import trace_joint
    from fxshard.tracing.export import trace_forward

    traced = trace_forward(LearnedMask(learned), (torch.randn(2, 6, 16),), {})
    assert ATTENTION in {n.target for n in traced.gm.graph.nodes}
    joint = trace_joint(traced, traced.gm, [s.kind == "param" for s in traced.slots])
    (bwd,) = [n for n in joint.gm.graph.nodes if n.target is ATTENTION_BACKWARD]
    assert bwd.args[-1] is learned and len(bwd.meta["val"]) == 3 + learned, bwd.args
    assert torch.ops.aten.bmm.default not in {n.target for n in joint.gm.graph.nodes}


def test_index_put_with_a_boolean_mask_splits_no_dim_the_mask_covers():
    """``h.index_put((h < c,), v)`` (a boolean-mask write) indexes as many dims as the mask has."""
    from fxshard.core.placements import R, S
    from tests.test_rules import node_of, strategies

    def put(x, m, v):
        return torch.ops.aten.index_put.default(x, [m], v, False)

    s = strategies(node_of(put, torch.randn(4, 8, 6), torch.rand(4, 8) > 0.5, torch.tensor(0.0)))
    assert {i[0] for i, _, _ in s} == {R, S(2)}, s


def test_stop_gradients_cost_nothing_in_the_per_rank_programs(mesh2):
    """The stop-gradient markers (alias nodes) of the traced forward are not emitted."""
    sm = fxshard.shard(StopGrad("no_grad"), mesh2, {"b": ColwiseParallel()}, example_inputs=(torch.randn(4, 8),))
    for gm in (sm._fwd.gm, sm._training.fwd.gm, sm._training.bwd.gm):
        assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.alias.default], gm.code
