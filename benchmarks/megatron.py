"""A hand-written Megatron-style tensor-parallel copy of torch's test Transformer (the baseline).

Built from a full ``common_dtensor.Transformer`` by slicing its weights by hand;
communication is explicit ``torch.distributed`` calls inside the classic
autograd pairs (Shoeybi et al., 2019):

* ``copy_to_tp``   (Megatron's *f*): identity forward, all_reduce of the gradient backward;
* ``reduce_from_tp`` (*g*): all_reduce forward, identity backward;
* ``gather_from_tp``: all_gather of the last dim forward, this rank's slice of the gradient backward.

The layout is exactly the one of ``Transformer.parallelize(..., use_seq_parallel=False)``
(and of ``tests.test_plans.torch_transformer_plan(False)``): vocab-parallel token and
position embeddings (rows split, masked lookup, all_reduce), column-parallel
``wq/wk/wv/w1`` (heads / hidden units split), row-parallel ``wo/w2`` (all_reduce, bias added
once after it), a column-parallel output head (tied to the token embedding when the model
ties them) whose logits are all-gathered, and replicated LayerNorms. Per training step:
forward 2 all_reduces per layer + 2 (embeddings) + 1 all_gather (logits); backward 2 per
layer + 1 (the head's input).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MegatronTransformer", "megatron_comm"]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.contiguous()
        dist.all_reduce(g)
        return g


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        x = x.contiguous()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g


class _GatherFromTP(torch.autograd.Function):
    """Concatenate the ranks' last-dim pieces; backward keeps this rank's piece of the gradient."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        world, rank = dist.get_world_size(), dist.get_rank()
        ctx.rank, ctx.n = rank, x.shape[-1]
        out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)
        dist.all_gather_single(out, x.contiguous())
        return out.view((world,) + tuple(x.shape)).movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous()


copy_to_tp = _CopyToTP.apply
reduce_from_tp = _ReduceFromTP.apply
gather_from_tp = _GatherFromTP.apply


def _rows(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = w.shape[0] // world
    return w.detach()[rank * n:(rank + 1) * n].clone()


def _cols(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = w.shape[1] // world
    return w.detach()[:, rank * n:(rank + 1) * n].clone()


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank*n, (rank+1)*n)`` of an embedding table; lookups outside them give zeros, then all_reduce."""

    def __init__(self, full: nn.Embedding, rank: int, world: int):
        super().__init__()
        self.weight = nn.Parameter(_rows(full.weight, rank, world))
        self.lo = rank * self.weight.shape[0]
        self.hi = self.lo + self.weight.shape[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.lo) | (idx >= self.hi)
        local = (idx - self.lo).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out)


class MegatronBlock(nn.Module):
    def __init__(self, full: nn.Module, rank: int, world: int):
        super().__init__()
        att, ff = full.attention, full.feed_forward
        self.attention_norm = nn.LayerNorm(full.attention_norm.normalized_shape)
        self.attention_norm.load_state_dict(full.attention_norm.state_dict())
        self.ffn_norm = nn.LayerNorm(full.ffn_norm.normalized_shape)
        self.ffn_norm.load_state_dict(full.ffn_norm.state_dict())
        self.n_local_heads = att.n_heads // world
        self.head_dim = att.head_dim
        self.causal = att.use_attn_mask
        self.wq = nn.Parameter(_rows(att.wq.weight, rank, world))
        self.wk = nn.Parameter(_rows(att.wk.weight, rank, world))
        self.wv = nn.Parameter(_rows(att.wv.weight, rank, world))
        self.wo = nn.Parameter(_cols(att.wo.weight, rank, world))
        self.w1 = nn.Parameter(_rows(ff.w1.weight, rank, world))
        self.b1 = nn.Parameter(_rows(ff.w1.bias, rank, world))
        self.w2 = nn.Parameter(_cols(ff.w2.weight, rank, world))
        self.b2 = nn.Parameter(ff.w2.bias.detach().clone())

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        x = copy_to_tp(x)
        q = F.linear(x, self.wq).view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        k = F.linear(x, self.wk).view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        v = F.linear(x, self.wv).view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, None, 0.0, self.causal)
        y = y.transpose(1, 2).reshape(B, T, self.n_local_heads * self.head_dim)
        return reduce_from_tp(F.linear(y, self.wo))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x)
        h = F.gelu(F.linear(x, self.w1, self.b1))
        return reduce_from_tp(F.linear(h, self.w2)) + self.b2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class MegatronTransformer(nn.Module):
    """This rank's shard of ``common_dtensor.Transformer`` (dropout must be 0) with explicit collectives."""

    def __init__(self, full: nn.Module, rank: int, world: int):
        super().__init__()
        if full.model_args.dropout_p != 0:
            raise ValueError("the Megatron baseline implements dropout_p=0 only")
        self.tok_embeddings = VocabParallelEmbedding(full.tok_embeddings, rank, world)
        self.pos_embeddings = VocabParallelEmbedding(full.pos_embeddings, rank, world)
        self.layers = nn.ModuleList(MegatronBlock(layer, rank, world) for layer in full.layers)
        self.norm = nn.LayerNorm(full.norm.normalized_shape)
        self.norm.load_state_dict(full.norm.state_dict())
        if full.output.weight is full.tok_embeddings.weight:
            self.output_weight = self.tok_embeddings.weight  # tied, vocab rows split the same way
        else:
            self.output_weight = nn.Parameter(_rows(full.output.weight, rank, world))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, T = tokens.shape
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(T))
        for layer in self.layers:
            h = layer(h)
        h = copy_to_tp(self.norm(h))
        return gather_from_tp(F.linear(h, self.output_weight)).float()


def megatron_comm(batch: int, seq: int, dim: int, vocab: int, n_layers: int, world: int,
                  seq_parallel: bool = False) -> dict[str, dict[str, dict[str, int]]]:
    """Analytic per-step collectives of the Megatron layout above, in ``fxshard.comm_stats``' format
    (bytes per rank: the larger of a collective's input and output buffer, fp32).

    Without sequence parallel: forward ``2L + 2`` all_reduces (2 per layer of ``B*T*D*4`` bytes,
    the token embedding ``B*T*D*4`` and the position embedding ``T*D*4``) and one all_gather of the
    logits (``B*T*V*4``); backward ``2L + 1`` all_reduces of ``B*T*D*4`` bytes (2 per layer and
    the head's input). With sequence parallel (Megatron-SP, Korthikanti et al., 2022) every
    layer all_reduce becomes a reduce_scatter + an all_gather of the same buffer, both directions;
    the embeddings reduce-scatter into sequence shards and the head all-gathers its input
    (forward) / reduce-scatters its input gradient (backward); the logits all_gather stays.
    """
    act = batch * seq * dim * 4
    logits = batch * seq * vocab * 4
    pos = seq * dim * 4
    L = n_layers
    if not seq_parallel:
        return {
            "forward": {"all_reduce": {"count": 2 * L + 2, "bytes": 2 * L * act + act + pos},
                        "all_gather": {"count": 1, "bytes": logits}},
            "backward": {"all_reduce": {"count": 2 * L + 1, "bytes": (2 * L + 1) * act}},
        }
    return {
        "forward": {"reduce_scatter": {"count": 2 * L + 2, "bytes": 2 * L * act + act + pos},
                    "all_gather": {"count": 2 * L + 2, "bytes": (2 * L + 1) * act + logits}},
        "backward": {"reduce_scatter": {"count": 2 * L + 1, "bytes": (2 * L + 1) * act},
                     "all_gather": {"count": 2 * L + 2, "bytes": 2 * L * act + act + pos},
                     # the sequence-sharded LayerNorms' weight and bias gradients (2 per norm, 2L + 1 norms)
                     "all_reduce": {"count": 2 * (2 * L + 1), "bytes": 2 * (2 * L + 1) * dim * 4}},
    }
