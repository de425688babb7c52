"""Llama-shaped models and a Megatron plan for planning with the ``fxshard plan`` command line.

    fxshard plan examples.llama_shapes:llama70b --mesh dp=64,tp=8 --plan examples.llama_shapes:PLAN

Builders are called under ``torch.device("meta")`` by the CLI: no weights are allocated.
"""

from __future__ import annotations

from fxshard import ColwiseParallel, RowwiseParallel
from fxshard.models import LlamaDecoder

# Megatron tensor parallel for every layer (globs), vocab-parallel embedding, loss-parallel head.
PLAN = {
    "tok_embeddings": RowwiseParallel(),
    "layers.*.attention.wq": ColwiseParallel(),
    "layers.*.attention.wk": ColwiseParallel(),
    "layers.*.attention.wv": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(),
    "layers.*.feed_forward.w1": ColwiseParallel(),
    "layers.*.feed_forward.w3": ColwiseParallel(),
    "layers.*.feed_forward.w2": RowwiseParallel(),
    "output": ColwiseParallel(),
}


def llama70b() -> LlamaDecoder:
    """Llama-3-70B shapes: 80 layers, hidden 8192, 64 heads, 8 KV heads, MLP 28672, vocab 128256."""
    return LlamaDecoder(vocab=128256, dim=8192, n_heads=64, n_kv_heads=8, n_layers=80, hidden=28672, max_seq=2048)


def llama8b() -> LlamaDecoder:
    """Llama-3-8B shapes: 32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256."""
    return LlamaDecoder(vocab=128256, dim=4096, n_heads=32, n_kv_heads=8, n_layers=32, hidden=14336, max_seq=2048)


def llama_tiny() -> LlamaDecoder:
    """A tiny Llama for quick runs and tests."""
    return LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=2, hidden=64, max_seq=16)


def hf_llama_tiny():
    """A tiny Hugging Face ``LlamaForCausalLM`` (needs ``pip install 'fxshard[hf]'``), for ``--plan hf``:

        fxshard plan examples.llama_shapes:hf_llama_tiny --mesh tp=2 --plan hf --seq 16
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
