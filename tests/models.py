"""Small deterministic models for fxshard tests (plain torch.nn; no fxshard import).

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

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

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


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run the body with the CPU RNG seeded to ``seed``; restore the RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# --------------------------------------------------------------------------- data


def make_tokens(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Deterministic token ids.

    Ensures: an int64 CPU tensor of shape ``(batch, seq)`` with values in
    ``[0, vocab)``, a function of the arguments only (own ``torch.Generator``;
    the global RNG is untouched).
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.long)


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


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``(B, T, V)`` logits against ``(B, T)`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


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


# ------------------------------------------------------------------------ llama


class RMSNorm(nn.Module):
    """Llama RMSNorm: ``weight * x / sqrt(mean(x^2, -1) + eps)``, normalized in fp32.

    FQN: ``weight`` (dim,), initialized to ones. Output dtype = input dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dim split in halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(max_seq: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Real-valued rotary tables ``(cos, sin)``, each fp32 ``(max_seq, head_dim)``.

    Requires an even ``head_dim``. Frequencies are duplicated across the two
    halves (rotate-half layout, as in HF Llama).
    """
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even for rotary embeddings")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class LlamaAttention(nn.Module):
    """Grouped-query causal attention with rotary embeddings; ``wq, wk, wv, wo`` without bias.

    ``wq``: dim -> n_heads*head_dim, ``wk``/``wv``: dim -> n_kv_heads*head_dim,
    ``wo``: n_heads*head_dim -> dim. k and v are repeated to ``n_heads`` with
    ``expand`` + ``reshape`` (Llama's ``repeat_kv``), each kv head serving
    ``n_heads // n_kv_heads`` consecutive query heads.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"need dim % n_heads == 0 and n_heads % n_kv_heads == 0, "
                f"got dim={dim} n_heads={n_heads} n_kv_heads={n_kv_heads}"
            )
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, n_kv, T, hd)`` -> ``(B, n_heads, T, hd)``."""
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep == 1:
            return x
        B, H, T, hd = x.shape
        return x[:, :, None, :, :].expand(B, H, n_rep, T, hd).reshape(B, H * n_rep, T, hd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``; ``w1, w3``: dim -> hidden, ``w2``: hidden -> dim; no bias."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """``h = x + attention(attention_norm(x))``; ``out = h + feed_forward(ffn_norm(h))``."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = LlamaAttention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaDecoder(nn.Module):
    """Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU, untied head), seed 003's model shape.

    FQNs: ``tok_embeddings.weight`` (vocab, dim),
    ``layers.{i}.attention_norm.weight``, ``layers.{i}.attention.{wq,wk,wv,wo}.weight``,
    ``layers.{i}.ffn_norm.weight``, ``layers.{i}.feed_forward.{w1,w2,w3}.weight``,
    ``norm.weight``, ``output.weight`` (vocab, dim). Buffers ``rope_cos`` and
    ``rope_sin`` (max_seq, head_dim) are non-persistent (not in the
    state_dict); a model built on the meta device must call
    :meth:`init_rope` after materializing.

    ``forward(tokens)`` with int64 ``(B, T)``, ``T <= max_seq`` -> logits
    ``(B, T, vocab)``; ``forward(tokens, targets)`` -> scalar mean cross entropy.
    """

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        n_layers: int = 2,
        hidden: int = 64,
        max_seq: int = 16,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.vocab, self.dim, self.max_seq = vocab, dim, max_seq
        self.head_dim = dim // n_heads
        with _seeded(seed):
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(
                LlamaBlock(dim, n_heads, n_kv_heads, hidden) for _ in range(n_layers)
            )
            self.norm = RMSNorm(dim)
            self.output = nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_tables(max_seq, self.head_dim)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_rope(self) -> None:
        """(Re)compute the rotary buffers in place on their current device (e.g. after ``to_empty``)."""
        cos, sin = rope_tables(self.max_seq, self.head_dim)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = tokens.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return _lm_loss(logits, targets)


# --------------------------------------------------------------------- seed 002


class Seed002Model(nn.Module):
    """Seed 002's stack of ``nlayers`` bias-free ``Linear(dim, dim)`` (its all_reduce calls removed).

    FQNs: ``layers.{i}.weight`` (dim, dim). Input ``(..., dim)`` -> ``(..., dim)``.
    """

    def __init__(self, dim: int = 32, nlayers: int = 8, seed: int = 0) -> None:
        super().__init__()
        with _seeded(seed):
            self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(nlayers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
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
