"""Reference models the examples (and tests) use: a small Llama decoder, its tensor/sequence-parallel
plan, and deterministic token ids. Plain ``torch.nn`` (the plan uses torch's ParallelStyles);
importing this module shards nothing.

``LlamaDecoder`` builds its weights from a fixed seed without touching the caller's RNG, so every
rank builds the same model; its FQNs (``layers.0.attention.wq``...) are what ``llama_seed003_plan``
refers to.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

__all__ = ["LlamaDecoder", "RMSNorm", "rope_tables", "make_tokens", "llama_seed003_plan"]


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run the body with the CPU RNG seeded to ``seed``; restore the RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def make_tokens(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Deterministic token ids.

    Ensures: an int64 CPU tensor of shape ``(batch, seq)`` with values in
    ``[0, vocab)``, a function of the arguments only (own ``torch.Generator``;
    the global RNG is untouched).
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g, dtype=torch.long)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``(B, T, V)`` logits against ``(B, T)`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


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


def llama_seed003_plan() -> dict:
    """Seed 003's Llama plan: sequence-parallel norms, PrepareModuleInput on attention and
    feed-forward, rowwise outputs into sequence shards, loss parallel through a colwise head."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
