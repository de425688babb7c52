"""A hand-written Megatron-style tensor-parallel copy of torch's test Transformer (the baseline).

Built from a full ``common_dtensor.Transformer`` by slicing its weights by hand;
communication is explicit ``torch.distributed`` calls inside the classic
autograd pairs (Shoeybi et al., 2019):

* ``copy_to_tp``   (Megatron's *f*): identity forward, all_reduce of the gradient backward;
* ``reduce_from_tp`` (*g*): all_reduce forward, identity backward;
* ``gather_from_tp``: all_gather of the last dim forward, this rank's slice of the gradient backward.

``MegatronTransformer(full, rank, world, group=..., shard_vocab=...)`` takes the tensor-parallel
group (default: the world; a 2-D run wraps the module in DDP over the other axis). With
``shard_vocab=True`` the layout is the one of ``Transformer.parallelize(..., use_seq_parallel=False)``
(and of ``tests.test_plans.torch_transformer_plan(False)``): vocab-parallel token and
position embeddings (rows split, masked lookup, all_reduce), column-parallel
``wq/wk/wv/w1`` (heads / hidden units split), row-parallel ``wo/w2`` (all_reduce, bias added
once after it), a column-parallel output head (tied to the token embedding when the model
ties them) whose logits are all-gathered, and replicated LayerNorms. Per training step:
forward 2 all_reduces per layer + 2 (embeddings) + 1 all_gather (logits); backward 2 per
layer + 1 (the head's input). With the loss inside (``forward(tokens, targets)``) the logits are
not gathered: ``vocab_parallel_cross_entropy`` (3 all_reduces forward, none backward) runs on
the local ones. ``shard_vocab=False`` is the layers-only plan: embeddings, final norm and head whole
on every rank, 2 all_reduces per layer per direction and nothing else.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MegatronTransformer", "megatron_comm", "vocab_parallel_cross_entropy"]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate the ranks' last-dim pieces; backward keeps this rank's piece of the gradient."""

    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.rank, ctx.n = rank, x.shape[-1]
        out = torch.empty((world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out.view((world,) + tuple(x.shape)).movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of logits whose class dim is split over ``group`` (Megatron's
    ``vocab_parallel_cross_entropy``): all_reduces of the row max, the target logit and the sum of
    exponentials; the backward is local (softmax minus one-hot, from the saved local softmax)."""

    @staticmethod
    def forward(ctx, logits, target, lo, group):  # type: ignore[override]
        m = logits.max(-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - m.unsqueeze(-1)
        outside = (target < lo) | (target >= lo + logits.shape[-1])
        local_t = (target - lo).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked, group=group)
        exp = shifted.exp_()
        sum_exp = exp.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        loss = (sum_exp.log() - picked).mean()
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_t.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        return grad.mul_(g / softmax.shape[0]), None, None, None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    return _GatherFromTP.apply(x, group)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, lo: int, group=None) -> torch.Tensor:
    """Mean cross entropy of ``[N, V/world]`` local logits (this rank's classes start at ``lo``)."""
    return _VocabParallelCrossEntropy.apply(logits, target, lo, group)


def _rows(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = w.shape[0] // world
    return w.detach()[rank * n:(rank + 1) * n].clone()


def _cols(w: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = w.shape[1] // world
    return w.detach()[:, rank * n:(rank + 1) * n].clone()


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank*n, (rank+1)*n)`` of an embedding table; lookups outside them give zeros, then all_reduce."""

    def __init__(self, full: nn.Embedding, rank: int, world: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(_rows(full.weight, rank, world))
        self.lo = rank * self.weight.shape[0]
        self.hi = self.lo + self.weight.shape[0]
        self.group = group

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.lo) | (idx >= self.hi)
        local = (idx - self.lo).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


def _copy_module(m: nn.Module) -> nn.Module:
    """A replicated copy of ``m``'s parameters (layers-only plans keep embeddings/head whole)."""
    out = copy.deepcopy(m)
    for p in out.parameters():
        p.requires_grad_(True)
    return out


class MegatronBlock(nn.Module):
    def __init__(self, full: nn.Module, rank: int, world: int, group=None):
        super().__init__()
        att, ff = full.attention, full.feed_forward
        self.group = group
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
        x = copy_to_tp(x, self.group)
        q = F.linear(x, self.wq).view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        k = F.linear(x, self.wk).view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        v = F.linear(x, self.wv).view(B, T, self.n_local_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, None, 0.0, self.causal)
        y = y.transpose(1, 2).reshape(B, T, self.n_local_heads * self.head_dim)
        return reduce_from_tp(F.linear(y, self.wo), self.group)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)
        h = F.gelu(F.linear(x, self.w1, self.b1))
        return reduce_from_tp(F.linear(h, self.w2), self.group) + self.b2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class MegatronTransformer(nn.Module):
    """This rank's shard of ``common_dtensor.Transformer`` (dropout must be 0) with explicit collectives.

    ``group`` is the tensor-parallel process group (default: the world) and ``rank``/``world`` this
    rank's place in it. ``shard_vocab=False`` is the layers-only plan: embeddings, final norm and head
    stay whole on every rank (no communication outside the layers). ``forward(tokens)`` returns the
    logits (all-gathered when the vocabulary is split); ``forward(tokens, targets)`` returns the mean
    cross entropy, computed vocab-parallel on the local logits when the vocabulary is split.
    """

    def __init__(self, full: nn.Module, rank: int, world: int, *, group=None, shard_vocab: bool = True):
        super().__init__()
        if full.model_args.dropout_p != 0:
            raise ValueError("the Megatron baseline implements dropout_p=0 only")
        self.group = group
        self.shard_vocab = shard_vocab
        tied = full.output.weight is full.tok_embeddings.weight
        if shard_vocab:
            self.tok_embeddings = VocabParallelEmbedding(full.tok_embeddings, rank, world, group)
            self.pos_embeddings = VocabParallelEmbedding(full.pos_embeddings, rank, world, group)
        else:
            self.tok_embeddings = _copy_module(full.tok_embeddings)
            self.pos_embeddings = _copy_module(full.pos_embeddings)
        self.layers = nn.ModuleList(MegatronBlock(layer, rank, world, group) for layer in full.layers)
        self.norm = nn.LayerNorm(full.norm.normalized_shape)
        self.norm.load_state_dict(full.norm.state_dict())
        if tied:
            self.output_weight = self.tok_embeddings.weight  # tied: vocab rows split the same way (or whole)
        elif shard_vocab:
            self.output_weight = nn.Parameter(_rows(full.output.weight, rank, world))
        else:
            self.output_weight = nn.Parameter(full.output.weight.detach().clone())
        self.vocab_lo = rank * self.output_weight.shape[0] if shard_vocab else 0

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        _, T = tokens.shape
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(T))
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        if not self.shard_vocab:
            logits = F.linear(h, self.output_weight).float()
            return logits if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        local = F.linear(copy_to_tp(h, self.group), self.output_weight).float()
        if targets is None:
            return gather_from_tp(local, self.group)
        return vocab_parallel_cross_entropy(local.flatten(0, 1), targets.flatten(), self.vocab_lo, self.group)


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
