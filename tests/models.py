"""Small deterministic models for fxshard tests (plain torch.nn; the Llama decoder and ``make_tokens``
live in ``fxshard/models.py``, which the examples use, and are re-exported here).

Every model:
  * is built from a fixed seed (``seed=0`` by default) without touching the
    caller's global RNG state, so every rank builds identical weights;
  * has sizes divisible by 2 and 4 (mesh axes of size 2 and 4 split evenly);
  * runs forward+backward on CPU in fp32 and exports with
    ``torch.export.export(model, args, strict=False)`` (checked in
    ``tests/test_support.py``).

FQNs are part of the contract: sharding plans in tests refer to them.
``MODEL_CASES`` lists one ready-made (model, inputs) case per model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxshard.models import LlamaDecoder, RMSNorm, _lm_loss, _seeded, make_tokens, rope_tables  # noqa: F401

__all__ = [
    "ToyModel",
    "Transformer",
    "TransformerWithLoss",
    "ConvBigHead",
    "ConvBigHeadWithLoss",
    "RMSNorm",
    "LlamaDecoder",
    "Seed002Model", "FusedMLP", "PackedMoE",
    "make_tokens",
    "make_images",
    "make_labels",
    "ModelCase",
    "MODEL_CASES",
]


# --------------------------------------------------------------------------- data


def make_images(batch: int, in_ch: int = 3, img: int = 8, seed: int = 0) -> torch.Tensor:
    """Deterministic images.

    Ensures: a float32 CPU tensor of shape ``(batch, in_ch, img, img)`` drawn
    from N(0, 1) with its own generator (global RNG untouched).
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, in_ch, img, img, generator=g)


def make_labels(batch: int, n_classes: int, seed: int = 0) -> torch.Tensor:
    """Deterministic class labels: int64 ``(batch,)`` in ``[0, n_classes)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_classes, (batch,), generator=g, dtype=torch.long)


# --------------------------------------------------------------------- seed 000


class ToyModel(nn.Module):
    """Seed 000's two-layer MLP: ``net2(relu(net1(x)))``.

    FQNs: ``net1.{weight,bias}`` (hidden, in_dim), ``net2.{weight,bias}``
    (in_dim, hidden). Input ``(..., in_dim)`` -> output ``(..., in_dim)``.
    Seed 000's ``dummy_param`` is omitted.
    """

    def __init__(self, in_dim: int = 16, hidden: int = 32, seed: int = 0) -> None:
        super().__init__()
        with _seeded(seed):
            self.net1 = nn.Linear(in_dim, hidden)
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(hidden, in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


# ------------------------------------------------------------------ transformer


class Attention(nn.Module):
    """Multi-head causal self-attention with separate ``wq, wk, wv, wo`` Linears (with bias).

    Heads are split with ``view(B, T, n_heads, head_dim).transpose(1, 2)``
    using the *global* head count, so a sharder must localize the view size.
    """

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim {dim} must be divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, D)
        return self.wo(y)


class MLP(nn.Module):
    """``w2(gelu(w1(x)))`` with ``w1: dim -> 4*dim`` and ``w2: 4*dim -> dim`` (with bias)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """GPT-style decoder with learned positions and (by default) a tied output head.

    FQNs: ``tok_emb.weight`` (vocab, dim), ``pos_emb.weight`` (max_seq, dim),
    ``layers.{i}.attn_norm``, ``layers.{i}.attn.{wq,wk,wv,wo}``,
    ``layers.{i}.mlp_norm``, ``layers.{i}.mlp.{w1,w2}``, ``norm``,
    ``output.weight`` (vocab, dim; no bias). With ``tie=True``
    ``output.weight`` *is* ``tok_emb.weight`` (one Parameter, two FQNs;
    ``named_parameters()`` lists it once, as ``tok_emb.weight``).

    ``forward(tokens)`` with int64 ``(B, T)``, ``T <= max_seq`` -> logits
    ``(B, T, vocab)``; ``forward(tokens, targets)`` -> scalar mean cross entropy.
    """

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        n_heads: int = 4,
        n_layers: int = 4,
        max_seq: int = 16,
        tie: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.vocab, self.dim, self.n_heads, self.max_seq = vocab, dim, n_heads, max_seq
        with _seeded(seed):
            self.tok_emb = nn.Embedding(vocab, dim)
            self.pos_emb = nn.Embedding(max_seq, dim)
            self.layers = nn.ModuleList(TransformerBlock(dim, n_heads) for _ in range(n_layers))
            self.norm = nn.LayerNorm(dim)
            self.output = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.output.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = tokens.size(1)
        pos = torch.arange(T, device=tokens.device)
        h = self.tok_emb(tokens) + self.pos_emb(pos)
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return _lm_loss(logits, targets)


class TransformerWithLoss(Transformer):
    """``Transformer`` whose ``forward(tokens, targets)`` always returns the scalar loss.

    Same constructor and FQNs as :class:`Transformer` (a subclass, not a
    wrapper, so no ``model.`` prefix).
    """

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(tokens, targets)


# --------------------------------------------------------------------- seed 004


class ConvBigHead(nn.Module):
    """Seed 004: small conv trunk + one large classifier ``linear``.

    ``conv`` Conv2d(in_ch, ch, 3, padding=1) -> ReLU -> flatten ->
    ``linear`` Linear(ch*img*img, n_classes). ``forward(x)`` with float
    ``(B, in_ch, img, img)`` -> logits ``(B, n_classes)``;
    ``forward(x, target)`` with int64 ``(B,)`` -> scalar mean cross entropy.
    """

    def __init__(
        self, in_ch: int = 3, ch: int = 8, img: int = 8, n_classes: int = 1024, seed: int = 0
    ) -> None:
        super().__init__()
        with _seeded(seed):
            self.conv = nn.Conv2d(in_ch, ch, 3, padding=1)
            self.relu = nn.ReLU()
            self.linear = nn.Linear(ch * img * img, n_classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        x = self.relu(self.conv(x))
        logits = self.linear(torch.flatten(x, 1))
        if target is None:
            return logits
        return F.cross_entropy(logits, target)


class ConvBigHeadWithLoss(ConvBigHead):
    """``ConvBigHead`` whose ``forward(x, target)`` always returns the scalar loss."""

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x, target)


# --------------------------------------------------------------------- seed 002


class Seed002Model(nn.Module):
    """Seed 002's stack of ``nlayers`` bias-free ``Linear(dim, dim)``: its all_reduce calls removed, or, with
    ``all_reduce=True``, as its author wrote it (``torch.distributed.all_reduce(x)`` after every layer).

    FQNs: ``layers.{i}.weight`` (dim, dim). Input ``(..., dim)`` -> ``(..., dim)``.
    """

    def __init__(self, dim: int = 32, nlayers: int = 8, seed: int = 0, all_reduce: bool = False) -> None:
        super().__init__()
        self.all_reduce = all_reduce
        with _seeded(seed):
            self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(nlayers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            if self.all_reduce:
                torch.distributed.all_reduce(x)
        return x


# ------------------------------------------------------------- packed (fused) weights


class FusedMLP(nn.Module):
    """A SwiGLU MLP whose gate and up projections are one packed Linear, with an MSE loss inside.

    FQNs: ``gate_up.weight`` (2*inter, dim) = ``[gate; up]``, ``gate_up.bias`` (2*inter), ``down.weight``
    (dim, inter), ``down.bias`` (dim). Inputs ``x, y`` of shape ``(..., dim)`` -> scalar loss.
    """

    def __init__(self, dim: int = 16, inter: int = 16, seed: int = 0) -> None:
        super().__init__()
        with _seeded(seed):
            self.gate_up = nn.Linear(dim, 2 * inter)
            self.down = nn.Linear(inter, dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return F.mse_loss(self.down(F.silu(gate) * up), y)


class PackedMoE(nn.Module):
    """A top-k routed mixture of experts with packed expert weights (Hugging Face's Mixtral layout), computed
    densely (every expert on every token, weighted by the routing matrix, zero off the top k), MSE loss inside.

    FQNs: ``router.weight`` (experts, dim), ``gate_up_proj`` (experts, 2*inter, dim) = per expert
    ``[gate; up]``, ``down_proj`` (experts, dim, inter). Inputs ``x, y`` of shape ``(batch, seq, dim)``.
    """

    def __init__(self, dim: int = 16, inter: int = 16, experts: int = 4, top_k: int = 2, seed: int = 0) -> None:
        super().__init__()
        self.top_k = top_k
        with _seeded(seed):
            self.router = nn.Linear(dim, experts, bias=False)
            self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, dim) * dim ** -0.5)
            self.down_proj = nn.Parameter(torch.randn(experts, dim, inter) * inter ** -0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(h), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        route = torch.zeros_like(probs).scatter(-1, experts, weights / weights.sum(dim=-1, keepdim=True))
        gate, up = torch.einsum("nd,eid->nei", h, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("nei,edi,ne->nd", F.silu(gate) * up, self.down_proj, route)
        return F.mse_loss(out.view_as(x), y)

# ------------------------------------------------------------------------ cases


@dataclass(frozen=True)
class ModelCase:
    """A named model factory with matching example inputs.

    ``make_model()`` returns a fresh model; ``make_inputs()`` a fresh tuple of
    positional inputs; ``returns_loss`` tells whether the output is a scalar loss.
    """

    name: str
    make_model: Callable[[], nn.Module]
    make_inputs: Callable[[], tuple[Any, ...]]
    returns_loss: bool = False


MODEL_CASES: list[ModelCase] = [
    ModelCase("toy", ToyModel, lambda: (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)),)),
    ModelCase("transformer", Transformer, lambda: (make_tokens(4, 16, 64, seed=0),)),
    ModelCase(
        "transformer_untied",
        lambda: Transformer(tie=False),
        lambda: (make_tokens(4, 16, 64, seed=0),),
    ),
    ModelCase(
        "transformer_loss",
        TransformerWithLoss,
        lambda: (make_tokens(4, 16, 64, seed=0), make_tokens(4, 16, 64, seed=1)),
        returns_loss=True,
    ),
    ModelCase("conv_big_head", ConvBigHead, lambda: (make_images(4, 3, 8, seed=0),)),
    ModelCase(
        "conv_big_head_loss",
        ConvBigHeadWithLoss,
        lambda: (make_images(4, 3, 8, seed=0), make_labels(4, 1024, seed=1)),
        returns_loss=True,
    ),
    ModelCase("llama", LlamaDecoder, lambda: (make_tokens(4, 16, 64, seed=0),)),
    ModelCase(
        "llama_loss",
        LlamaDecoder,
        lambda: (make_tokens(4, 16, 64, seed=0), make_tokens(4, 16, 64, seed=1)),
        returns_loss=True,
    ),
    ModelCase("seed002", Seed002Model, lambda: (torch.randn(8, 32, generator=torch.Generator().manual_seed(0)),)),
    ModelCase("fused_mlp", FusedMLP, lambda: (torch.randn(4, 16, generator=torch.Generator().manual_seed(0)),
                                             torch.randn(4, 16, generator=torch.Generator().manual_seed(1))),
              returns_loss=True),
    ModelCase("packed_moe", PackedMoE, lambda: (torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0)),
                                               torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))),
              returns_loss=True),
]
