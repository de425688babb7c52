"""Collectives per training step at Llama-3 scale: fxshard's plan next to the analytic minimum.

    .venv/bin/python benchmarks/comm_at_scale.py [--models 8b 70b] [--configs tp8 dp8xtp8 ...]
                                                 [--layers 1 2] [--batch 16 --seq 1024] [--breakdown]

Model: ``tests.models.LlamaDecoder`` (RMSNorm, rotary, GQA with Llama's expand+reshape ``repeat_kv``,
SwiGLU, untied head) at Llama-3-8B width (dim 4096, 32 heads / 8 KV heads, MLP 14336, vocab 128256,
32 layers) or -70B width (dim 8192, 64 / 8 heads, MLP 28672, 80 layers), built on the meta device,
fp32, with the loss inside (``forward(tokens, targets)``: the joint forward + backward graph is what
gets sharded), batch 16 x seq 1024; ``--impl hf`` uses transformers' ``LlamaForCausalLM`` of the same
config instead. It is sharded on torch's fake process group (``tests.conftest.fake_world``: one process
acting as rank 0, collectives are shape-correct no-ops), so the plan and its collectives are exactly
what ``fxshard.shard`` produces for a real mesh of that size. Each configuration is sharded at
``--layers`` depths (default 1 and 2); the difference is the per-layer cost, which extrapolates the
totals to the full depth (32 / 80 layers).

Configurations (mesh axes major first; dp is the inter-node axis, tp the intra-node one):

* ``tp8``: Megatron tensor parallelism, ``examples/llama_shapes.PLAN`` (vocab-parallel embedding,
  column-parallel q/k/v/w1/w3 and head, row-parallel wo/w2), the loss over class-sharded logits.
* ``tp8-sp``: the same plus sequence parallelism (``tests.test_plans.llama_seed003_plan``).
* ``dp8xtp8`` / ``dp8xtp8-sp``: the batch split over ``dp`` (``in_specs=P("dp")``) and the same TP
  plan: DDP on top of TP.
* ``fsdp8xtp8``: as ``dp8xtp8`` with every parameter also split over ``dp`` on its other dim (ZeRO-3:
  ``P("tp", "dp")`` for column-parallel weights, the embedding and the head, ``P("dp", "tp")`` for
  row-parallel ones, ``P("dp")`` for norms); the styles' activation layouts are kept as
  ``PrepareModuleInputOutput`` boundaries.

Analytic minimum (the communication of hand-written Megatron-LM + DDP / FSDP). Per rank; ``b`` bytes
per element (4, fp32), ``t`` = tp size, ``d`` = dp size, ``L`` layers, ``N = B*T/d`` tokens per dp
rank, ``A = N*D*b`` one hidden activation, ``kv = n_kv_heads * head_dim``. "bytes" of a collective is
the larger of its input and output buffer on one rank (``fxshard.comm_stats``' convention: all_reduce
= its buffer, all_gather = its output, reduce_scatter = its input); "wire" bytes are what one rank
sends with ring algorithms: all_reduce ``2(n-1)/n * bytes``, all_gather / reduce_scatter / all_to_all
``(n-1)/n * bytes`` on an axis of ``n`` ranks.

* TP forward, over tp: per layer 2 all_reduces of ``A`` (attention ``wo`` and MLP ``w2`` outputs:
  Megatron's *g*), 1 all_reduce of ``A`` for the vocab-parallel embedding (masked local lookup,
  partial sums); loss parallelism: 2 all_reduces of ``N*4`` (per-token max and sum of exp of the
  class-sharded logits; the target logit is a masked local gather whose sum over tokens stays
  partial, so it rides on 1 all_reduce of the 4-byte loss; Megatron-LM spends a third per-token
  all_reduce on it). Total ``(2L+1)`` x ``A`` + ``2`` x ``4N`` + 1 x 4 B.
* TP backward, over tp: per layer 2 all_reduces of ``A`` (input gradients of the q/k/v and w1/w3
  column-parallel groups: *f*'s backward), 1 of ``A`` for the head's input gradient. The loss backward
  (softmax - one-hot from the saved per-token statistics) and the vocab-parallel embedding backward
  (each rank scatters the replicated gradient into its own rows) need nothing; weight gradients of
  tp-split weights are local, those of the replicated norms are computed redundantly.
  Total ``(2L+1)`` x ``A``.
* TP + SP (Megatron-SP): every activation all_reduce above becomes a reduce_scatter + an all_gather of
  the same ``A`` in both directions: forward ``(2L+1)`` RS (2 per layer + the embedding into sequence
  shards) and ``(2L+1)`` AG (2 per layer + the head's input); backward ``(2L+1)`` AG (2 per layer +
  the embedding's gradient) and ``(2L+1)`` RS (2 per layer + the head's input gradient), plus an
  all_reduce of ``D*b`` over tp per RMSNorm weight gradient (``2L+1`` norms: the sequence-sharded
  norms leave them partial). Counted with the gathered layer inputs saved for the weight gradients
  (Megatron-LM re-gathers them in the backward instead: ``+2L`` AG of ``A``).
* DDP over dp: one all_reduce per parameter gradient of its tp shard (unbucketed):
  per layer ``(2 D^2 + 2 D kv + 3 D F) b / t`` (q, k, v, o, w1, w3, w2; 7 all_reduces) and ``2`` x
  ``D b`` (the norms); plus the embedding ``V D b / t``, the head ``V D b / t`` and the final norm
  ``D b``. Loss: the 4-byte loss and the 4-byte count of target tokens are all-reduced over dp.
  With SP the norm weight gradients are reduced over tp and over dp.
* FSDP (ZeRO-3) over dp: the same per-parameter terms as DDP, as an all_gather of each parameter in
  the forward and a reduce_scatter of its gradient in the backward, both of the tp shard's bytes
  (gathered parameters kept for the backward; FSDP2's default ``reshard_after_forward=True`` gathers
  them again in the backward: ``+9L+3`` all_gathers of the same bytes, not counted).

``--breakdown`` matches fxshard's collectives one to one with the analytic list (same program, kind,
mesh axis and bytes) and lists every collective left over (the excess: kind, axis, bytes, the value
and its layout change, the op it serves and its source line; for backward ops, which have no source
line, the nearest forward value and module; for gradient outputs, the parameter) and every analytic
term fxshard does not emit (done another way). Writes ``benchmarks/results/comm_at_scale.json``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.nn as nn  # noqa: E402

from benchmarks._common import fmt_bytes, machine, table, write_json  # noqa: E402

MODELS = {
    "8b": dict(vocab=128256, dim=4096, n_heads=32, n_kv_heads=8, hidden=14336, full_layers=32),
    "70b": dict(vocab=128256, dim=8192, n_heads=64, n_kv_heads=8, hidden=28672, full_layers=80),
}
CONFIGS = {
    "tp8": dict(dp=1, tp=8, sp=False, fsdp=False),
    "tp8-sp": dict(dp=1, tp=8, sp=True, fsdp=False),
    "dp8xtp8": dict(dp=8, tp=8, sp=False, fsdp=False),
    "dp8xtp8-sp": dict(dp=8, tp=8, sp=True, fsdp=False),
    "fsdp8xtp8": dict(dp=8, tp=8, sp=False, fsdp=True),
}
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}
B = 4  # bytes per element: the models are fp32
TOP_EXCESS = 12


# ----------------------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Names:
    """FQN globs of the Llama roles in one implementation."""

    emb: str
    head: str
    norm: str
    layers: str
    attn: str
    mlp: str
    attn_norm: str
    ffn_norm: str
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]


DECODER = Names("tok_embeddings", "output", "norm", "layers.*", "attention", "feed_forward", "attention_norm",
                "ffn_norm", ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
                ("attention.wo", "feed_forward.w2"))
HF = Names("m.model.embed_tokens", "m.lm_head", "m.model.norm", "m.model.layers.*", "self_attn", "mlp",
           "input_layernorm", "post_attention_layernorm",
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
           ("self_attn.o_proj", "mlp.down_proj"))


def megatron_plan(n: Names) -> dict:
    """Megatron TP: vocab-parallel embedding, column-parallel head (loss parallel), Colwise/Rowwise layers."""
    from fxshard import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {n.emb: RowwiseParallel(), n.head: ColwiseParallel()}
    plan.update({f"{n.layers}.{m}": ColwiseParallel() for m in n.colwise})
    plan.update({f"{n.layers}.{m}": RowwiseParallel() for m in n.rowwise})
    return plan


def sp_plan(n: Names, kwarg_inputs: bool) -> dict:
    """Megatron TP + SP (seed 003's plan): sequence-sharded norms, rowwise outputs into sequence shards."""
    from torch.distributed.tensor import Replicate, Shard

    from fxshard import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    def gather_input() -> Any:
        if kwarg_inputs:  # transformers passes hidden_states by keyword
            return PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                      desired_input_kwarg_layouts={"hidden_states": Replicate()})
        return PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())

    plan: dict[str, Any] = {
        n.emb: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        n.norm: SequenceParallel(),
        n.head: ColwiseParallel(input_layouts=Shard(1)),
        f"{n.layers}.{n.attn_norm}": SequenceParallel(),
        f"{n.layers}.{n.ffn_norm}": SequenceParallel(),
        f"{n.layers}.{n.attn}": gather_input(),
        f"{n.layers}.{n.mlp}": gather_input(),
    }
    plan.update({f"{n.layers}.{m}": ColwiseParallel() for m in n.colwise})
    plan.update({f"{n.layers}.{m}": RowwiseParallel(output_layouts=Shard(1)) for m in n.rowwise})
    return plan


def fsdp_plan(n: Names) -> dict:
    """Megatron TP with every parameter also split over ``dp`` (ZeRO-3). The Colwise/Rowwise activation
    layouts stay as module boundaries; the weights get explicit specs naming both axes."""
    from torch.distributed.tensor import Replicate, Shard

    from fxshard import P, PrepareModuleInputOutput

    def boundary(inp: Any, out: Any) -> Any:
        return PrepareModuleInputOutput(input_layouts=inp, desired_input_layouts=inp, output_layouts=out,
                                        desired_output_layouts=out)

    plan: dict[str, Any] = {n.emb: boundary(Replicate(), Replicate()), f"{n.emb}.weight": P("tp", "dp"),
                            n.head: boundary(Replicate(), Shard(-1)), f"{n.head}.weight": P("tp", "dp"),
                            f"{n.norm}.weight": P("dp"), f"{n.layers}.{n.attn_norm}.weight": P("dp"),
                            f"{n.layers}.{n.ffn_norm}.weight": P("dp")}
    for m in n.colwise:
        plan[f"{n.layers}.{m}"] = boundary(Replicate(), Shard(-1))
        plan[f"{n.layers}.{m}.weight"] = P("tp", "dp")
    for m in n.rowwise:
        plan[f"{n.layers}.{m}"] = boundary(Shard(-1), Replicate())
        plan[f"{n.layers}.{m}.weight"] = P("dp", "tp")
    return plan


def plan_for(cfg: dict, impl: str) -> dict:
    names = HF if impl == "hf" else DECODER
    if cfg["fsdp"]:
        return fsdp_plan(names)
    return sp_plan(names, impl == "hf") if cfg["sp"] else megatron_plan(names)


# ----------------------------------------------------------------------------------------- models


def build(model: str, n_layers: int, seq: int, impl: str):
    """The model on the meta device, ``forward(tokens, targets) -> loss``."""
    import torch

    s = MODELS[model]
    with torch.device("meta"):
        if impl == "hf":
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["dim"], intermediate_size=s["hidden"],
                              num_hidden_layers=n_layers, num_attention_heads=s["n_heads"],
                              num_key_value_heads=s["n_kv_heads"], max_position_embeddings=max(seq, 2048),
                              tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
            return HFLoss(LlamaForCausalLM(cfg))
        from tests.models import LlamaDecoder

        return LlamaDecoder(vocab=s["vocab"], dim=s["dim"], n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"],
                            n_layers=n_layers, hidden=s["hidden"], max_seq=max(seq, 2048))


class HFLoss(nn.Module):
    """transformers' ``LlamaForCausalLM`` returning its loss: ``forward(input_ids, labels)``."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, input_ids, labels):
        return self.m(input_ids=input_ids, labels=labels, use_cache=False).loss


# ----------------------------------------------------------------------------------------- analytic


def wire(kind: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends for a collective of ``nbytes`` (comm_stats convention) on ``n`` ranks (ring)."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * nbytes


def analytic(model: str, cfg: dict, n_layers: int, batch: int, seq: int) -> list[dict]:
    """The collectives of Megatron TP (+SP) + DDP / FSDP per training step and rank (module doc)."""
    s = MODELS[model]
    D, F, V = s["dim"], s["hidden"], s["vocab"]
    kv = s["n_kv_heads"] * (D // s["n_heads"])
    d, t, L = cfg["dp"], cfg["tp"], n_layers
    N = batch * seq // d
    A = N * D * B
    out: list[dict] = []

    def add(phase: str, kind: str, axis: str, nbytes: int, what: str, count: int = 1) -> None:
        out.extend({"phase": phase, "kind": kind, "axis": axis, "bytes": int(nbytes), "what": what}
                   for _ in range(count))

    if cfg["sp"]:
        add("forward", "reduce_scatter", "tp", A, "row-parallel output into sequence shards (wo, w2)", 2 * L)
        add("forward", "all_gather", "tp", A, "sequence shards gathered for column-parallel input (attn, mlp)", 2 * L)
        add("forward", "reduce_scatter", "tp", A, "vocab-parallel embedding into sequence shards")
        add("forward", "all_gather", "tp", A, "head input gathered from sequence shards")
        add("backward", "all_gather", "tp", A, "gradient of row-parallel output (wo, w2)", 2 * L)
        add("backward", "reduce_scatter", "tp", A, "input gradient of column-parallel group (qkv, w1/w3)", 2 * L)
        add("backward", "reduce_scatter", "tp", A, "head input gradient")
        add("backward", "all_gather", "tp", A, "embedding output gradient gathered for the vocab-parallel backward")
        add("backward", "all_reduce", "tp", D * B, "sequence-parallel RMSNorm weight gradient", 2 * L + 1)
    else:
        add("forward", "all_reduce", "tp", A, "row-parallel output (wo, w2)", 2 * L)
        add("forward", "all_reduce", "tp", A, "vocab-parallel embedding output")
        add("backward", "all_reduce", "tp", A, "input gradient of column-parallel group (qkv, w1/w3)", 2 * L)
        add("backward", "all_reduce", "tp", A, "head input gradient")
    add("forward", "all_reduce", "tp", N * 4, "loss parallel: per-token max of the logits")
    add("forward", "all_reduce", "tp", N * 4, "loss parallel: per-token sum of exp")
    add("forward", "all_reduce", "tp", 4, "loss (sum of target log-probs, partial over vocab shards)")
    if d > 1:
        add("forward", "all_reduce", "dp", 4, "loss (partial over batch shards)")
        add("forward", "all_reduce", "dp", 4, "number of target tokens (partial over batch shards)")
        params = [(f"layer.{p}", n * B // t) for p, n in (("wq", D * D), ("wk", kv * D), ("wv", kv * D),
                                                            ("wo", D * D), ("w1", F * D), ("w3", F * D),
                                                            ("w2", D * F))]
        params += [("layer.attention_norm", D * B), ("layer.ffn_norm", D * B)]
        glob = [("embedding", V * D * B // t), ("head", V * D * B // t), ("final norm", D * B)]
        for name, nbytes in [p for p in params for _ in range(L)] + glob:
            if cfg["fsdp"]:
                add("forward", "all_gather", "dp", nbytes, f"FSDP parameter gather: {name}")
                add("backward", "reduce_scatter", "dp", nbytes, f"FSDP gradient reduce-scatter: {name}")
            else:
                add("backward", "all_reduce", "dp", nbytes, f"DDP gradient all-reduce: {name}")
    return out


# ----------------------------------------------------------------------------------------- measuring


def _near(prog_gm, node_name: str, fwd_meta: dict) -> str:
    """The closest node (inputs first, breadth first) carrying a module path and source line; for backward
    programs these are the forward values saved for it (``fwd_meta``: name -> (module, source))."""
    nodes = {n.name: n for n in prog_gm.graph.nodes}
    start = nodes.get(node_name)
    if start is None:
        return ""
    seen, queue = {start}, deque([start])
    while queue:
        n = queue.popleft()
        name = n.name[len("saved_"):] if n.op == "placeholder" and n.name.startswith("saved_") else n.name
        if name in fwd_meta and fwd_meta[name][0]:
            mod, src = fwd_meta[name]
            return f"near {name} in {mod}" + (f": {src}" if src else "")
        for m in list(n.all_input_nodes) + list(n.users):
            if m not in seen:
                seen.add(m)
                queue.append(m)
    return ""


def _module_of(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return str(list(stack.values())[-1][0])


def collect(sm) -> list[dict]:
    """Every collective of the sharded training step with where it comes from."""
    from fxshard.comm.collectives import COMM_KEY
    from fxshard.core.ir import source_line
    from fxshard.rules.registry import output_leaves

    training = sm._training
    progs = {"forward": training.fwd, "backward": training.bwd}
    fwd_meta = {n.name: (_module_of(n), source_line(n)) for n in training.fwd.gm.graph.nodes}
    # gradient outputs of the backward program -> parameter FQNs
    slots = sm._traced.slots
    out_node = next(n for n in training.bwd.gm.graph.nodes if n.op == "output")
    grad_of: dict[str, str] = {}
    for leaf, prim in zip(output_leaves(out_node), training.diff_in):
        if leaf is None:
            continue
        stack, seen = [leaf], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if COMM_KEY in n.meta:
                grad_of[n.name] = ",".join(slots[prim].names) or f"input {prim}"
            if n.meta.get("fxshard_inserted"):
                stack.extend(n.all_input_nodes)
    out = []
    for phase, prog in progs.items():
        for n in prog.gm.graph.nodes:
            if COMM_KEY not in n.meta:
                continue
            c = n.meta[COMM_KEY]
            where = c["source"] or _near(prog.gm, c["value"], fwd_meta)
            out.append({"phase": phase, "kind": c["kind"], "axis": c["axis"], "bytes": int(c["bytes"]),
                        "value": c["value"], "change": f"{c['src']} -> {c['dst']}",
                        "serves": f"{c['consumer']} ({c['op'].replace('aten.', '')})",
                        "where": where, "grad_of": grad_of.get(n.name, "")})
    return out


def match(measured: list[dict], expected: list[dict]) -> tuple[list[dict], list[dict]]:
    """Pair collectives with analytic terms of the same phase, kind, axis and bytes; returns what is left
    of each (fxshard's excess, analytic terms fxshard does another way)."""
    pool: dict[tuple, list[dict]] = {}
    for e in expected:
        pool.setdefault((e["phase"], e["kind"], e["axis"], e["bytes"]), []).append(e)
    excess = []
    for c in measured:
        bucket = pool.get((c["phase"], c["kind"], c["axis"], c["bytes"]))
        if bucket:
            bucket.pop()
        else:
            excess.append(c)
    return excess, [e for b in pool.values() for e in b]


def summarize(colls: list[dict], sizes: dict[str, int], bw: dict[str, float], alpha: dict[str, float]) -> dict:
    """Counts and bytes per phase and kind, plus totals: bytes, wire bytes, alpha-beta seconds."""
    res: dict[str, Any] = {"forward": {}, "backward": {}, "bytes": 0, "wire": 0.0, "seconds": 0.0, "count": 0}
    for c in colls:
        row = res[c["phase"]].setdefault(c["kind"], {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += c["bytes"]
        w = wire(c["kind"], c["bytes"], sizes[c["axis"]])
        res["bytes"] += c["bytes"]
        res["wire"] += w
        res["seconds"] += alpha[c["axis"]] + w / bw[c["axis"]]
        res["count"] += 1
    return res


class _SolveLog(logging.Handler):
    """Collects the ``fxshard.planner.solve`` records (problem size and solve time of each global plan)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.solves: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "fxshard_solve"):
            self.solves.append(record.fxshard_solve)


def shard_once(model: str, cfg: dict, n_layers: int, batch: int, seq: int, impl: str, planner: str) -> dict:
    """Shard on a fake mesh with ``planner``; the collectives, the stage times of ``fxshard.shard`` and
    (global planner) the MILP of the training program: its size and solve time."""
    import torch

    import fxshard
    from tests.conftest import fake_world

    m = build(model, n_layers, seq, impl)
    tokens = torch.zeros(batch, seq, dtype=torch.long)
    d, t = cfg["dp"], cfg["tp"]
    shape, names = ((d, t), ("dp", "tp")) if d > 1 else ((t,), ("tp",))
    marks: list[tuple[str, float]] = []
    log = _SolveLog()
    logger = logging.getLogger("fxshard.planner.solve")
    logger.addHandler(log)
    logger.setLevel(logging.INFO)
    with fake_world(d * t, shape=shape, names=names) as mesh:
        in_specs = (fxshard.P("dp"), fxshard.P("dp")) if d > 1 else None
        t0 = time.perf_counter()
        sm = fxshard.shard(m, mesh, plan_for(cfg, impl), example_inputs=(tokens, tokens), in_specs=in_specs,
                           progress=lambda msg: marks.append((msg, time.perf_counter())), planner=planner)
        t1 = time.perf_counter()
        colls = collect(sm)
        nodes = next((int(msg.split("(")[1].split()[0]) for msg, _ in marks
                      if msg.startswith("sharding the training program")), 0)
    logger.removeHandler(log)
    stages = {}
    for i, (msg, ts) in enumerate(marks):
        stages[msg.split(" (")[0]] = (marks[i + 1][1] if i + 1 < len(marks) else t1) - ts
    param_bytes = sum(p.numel() for p in m.parameters()) * B
    return {"collectives": colls, "shard_s": t1 - t0, "stages": stages, "joint_nodes": nodes,
            "param_bytes": param_bytes, "solve": log.solves[0] if log.solves else None}


# ----------------------------------------------------------------------------------------- report


def _phase_text(s: dict, phase: str) -> str:
    return ", ".join(f"{SHORT[k]} {v['count']} {fmt_bytes(v['bytes'])}" for k, v in sorted(s[phase].items())) or "-"


def _extrapolate(by_depth: dict[int, Any], key: str, depth: int) -> Optional[float]:
    """Linear in depth through the two deepest measured points."""
    ds = sorted(by_depth)
    if len(ds) < 2:
        return None
    a, b = ds[-2], ds[-1]
    per = (by_depth[b][key] - by_depth[a][key]) / (b - a)
    return by_depth[b][key] + (depth - b) * per


def _stored(res: dict) -> dict:
    """What the JSON keeps of one configuration: per depth the summaries, times and solve; the largest
    ``TOP_EXCESS`` collectives over the analytic plan (kind, axis, bytes, value, layout change, op, where)
    at the deepest depth only (``--breakdown`` prints them all)."""
    keep = ("phase", "kind", "axis", "bytes", "value", "change", "serves", "where", "grad_of")
    by_layers = {}
    for L, r in res["by_layers"].items():
        row = {k: r[k] for k in ("fxshard", "analytic", "shard_s", "joint_nodes", "solve")}
        row["n_excess"], row["n_missing"] = len(r["excess"]), len(r["missing"])
        if int(L) == res["deepest"]:
            top = sorted(r["excess"], key=lambda c: -c["bytes"])[:TOP_EXCESS]
            row["excess"] = [{k: c[k] for k in keep if c.get(k)} for c in top]
            row["missing"] = sorted({m["what"] for m in r["missing"]})
        by_layers[L] = row
    return {k: v for k, v in res.items() if k not in ("by_layers", "deepest")} | {"by_layers": by_layers}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--impl", choices=("decoder", "hf"), default="decoder",
                    help="tests.models.LlamaDecoder or transformers' LlamaForCausalLM")
    ap.add_argument("--bw-tp", type=float, default=300e9, help="bytes/s per rank on tp (intra-node)")
    ap.add_argument("--bw-dp", type=float, default=50e9, help="bytes/s per rank on dp (inter-node)")
    ap.add_argument("--alpha-tp", type=float, default=10e-6, help="latency per collective on tp, s")
    ap.add_argument("--alpha-dp", type=float, default=30e-6, help="latency per collective on dp, s")
    ap.add_argument("--planners", nargs="+", default=["greedy", "global"], choices=["greedy", "global"],
                    help="fxshard.shard(planner=...): the greedy sweep and/or the global MILP")
    ap.add_argument("--breakdown", action="store_true", help="list every collective above the analytic plan")
    ap.add_argument("--out", default="comm_at_scale.json")
    a = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    bw = {"tp": a.bw_tp, "dp": a.bw_dp}
    alpha = {"tp": a.alpha_tp, "dp": a.alpha_dp}
    t_start = time.perf_counter()
    info = machine()
    results: dict[str, Any] = {}
    rows, full_rows = [], []
    for model, cname, planner in [(m, c, p) for m in a.models for c in a.configs for p in a.planners]:
        cfg = CONFIGS[cname]
        sizes = {"dp": cfg["dp"], "tp": cfg["tp"]}
        per_depth: dict[int, dict] = {}
        for L in sorted(a.layers):
            run = shard_once(model, cfg, L, a.batch, a.seq, a.impl, planner)
            expected = analytic(model, cfg, L, a.batch, a.seq)
            mine = summarize(run["collectives"], sizes, bw, alpha)
            ref = summarize(expected, sizes, bw, alpha)
            excess, missing = match(run["collectives"], expected)
            per_depth[L] = {**run, "fxshard": mine, "analytic": ref, "excess": excess, "missing": missing}
            solve = run["solve"]
            rows.append([model, cname, planner, str(L), _phase_text(mine, "forward"), _phase_text(mine, "backward"),
                         fmt_bytes(mine["bytes"]), fmt_bytes(ref["bytes"]), f"{mine['bytes'] / ref['bytes']:.2f}",
                         f"{mine['wire'] / ref['wire']:.2f}", f"{mine['seconds'] / ref['seconds']:.2f}",
                         str(len(excess)), str(len(missing)), f"{run['shard_s']:.1f}",
                         f"{solve['seconds']:.1f}" if solve else "-"])
            milp = f" (MILP {solve['binaries']} binaries, {solve['rounds']} round(s), {solve['seconds']:.1f} s)" \
                if solve else ""
            print(f"  {model} {cname} {planner} L={L}: {mine['bytes'] / ref['bytes']:.3f}x analytic bytes, "
                  f"shard {run['shard_s']:.1f} s{milp}", flush=True)
        full = MODELS[model]["full_layers"]
        ref_full = summarize(analytic(model, cfg, full, a.batch, a.seq), sizes, bw, alpha)
        measured = {L: r["fxshard"] for L, r in per_depth.items()}
        ext = {k: _extrapolate(measured, k, full) for k in ("bytes", "wire", "seconds", "count")}
        shard_full = _extrapolate({L: {"s": r["shard_s"]} for L, r in per_depth.items()}, "s", full)
        if ext["bytes"] is not None:
            full_rows.append([model, cname, planner, str(full), f"{ext['count']:.0f}", str(ref_full["count"]),
                              fmt_bytes(ext["bytes"]), fmt_bytes(ref_full["bytes"]),
                              f"{ext['bytes'] / ref_full['bytes']:.2f}", f"{ext['wire'] / ref_full['wire']:.2f}",
                              f"{ext['seconds'] * 1e3:.1f}", f"{ref_full['seconds'] * 1e3:.1f}",
                              f"{ext['seconds'] / ref_full['seconds']:.2f}", f"{shard_full:.0f}"])
        results[f"{model}/{cname}/{planner}"] = {"config": cfg, "planner": planner,
                                                 "by_layers": {str(L): r for L, r in per_depth.items()},
                                                 "deepest": max(per_depth),
                                                 "full_layers": full, "extrapolated": ext, "analytic_full": ref_full,
                                                 "shard_s_extrapolated": shard_full}

    print(f"\ncollectives per training step and rank, fxshard vs analytic Megatron(+SP) + DDP/FSDP; "
          f"{a.impl} Llama-3 shapes, batch {a.batch} x seq {a.seq}, fp32, loss inside, fake process group")
    print(table(rows, ["model", "config", "planner", "L", "fxshard forward", "fxshard backward", "fxshard",
                       "analytic", "bytes x", "wire x", "time x", "excess", "missing", "shard s", "solve s"]))
    if full_rows:
        print(f"\nextrapolated to full depth (linear through the two deepest measured depths); time = alpha-beta "
              f"with tp {a.bw_tp / 1e9:.0f} GB/s + {a.alpha_tp * 1e6:.0f} us, dp {a.bw_dp / 1e9:.0f} GB/s + "
              f"{a.alpha_dp * 1e6:.0f} us per collective")
        print(table(full_rows, ["model", "config", "planner", "layers", "n", "n analytic", "fxshard", "analytic", "bytes x",
                                "wire x", "ms", "ms analytic", "time x", "shard s"]))
    if a.breakdown:
        for key, res in results.items():
            L = max(int(k) for k in res["by_layers"])
            r = res["by_layers"][str(L)]
            if not r["excess"] and not r["missing"]:
                continue
            print(f"\n== {key}, {L} layers: {len(r['excess'])} collectives above the analytic plan "
                  f"({fmt_bytes(sum(c['bytes'] for c in r['excess']))}), {len(r['missing'])} analytic terms "
                  f"not emitted ({fmt_bytes(sum(c['bytes'] for c in r['missing']))}) ==")
            erows = [[c["phase"], SHORT[c["kind"]], c["axis"], fmt_bytes(c["bytes"]), c["value"], c["change"],
                      c["serves"], (f"grad of {c['grad_of']}" if c["grad_of"] else c["where"])[:90]]
                     for c in r["excess"]]
            if erows:
                print(table(erows, ["phase", "kind", "axis", "bytes", "value", "change", "serves", "where"]))
            if r["missing"]:
                print("analytic terms not emitted as such:")
                groups: dict[tuple, int] = {}
                for m in r["missing"]:
                    k = (m["phase"], SHORT[m["kind"]], m["axis"], fmt_bytes(m["bytes"]), m["what"])
                    groups[k] = groups.get(k, 0) + 1
                print(table([list(k) + [str(v)] for k, v in groups.items()],
                             ["phase", "kind", "axis", "bytes", "what", "n"]))
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.1f} s")
    out = {"impl": a.impl, "batch": a.batch, "seq": a.seq, "layers": a.layers, "bandwidth": bw, "alpha": alpha,
           "models": {m: MODELS[m] for m in a.models}, "machine": info,
           "results": {k: _stored(r) for k, r in results.items()}, "wall_s": wall}
    print(f"wrote {write_json(a.out, out)}")
    return out


if __name__ == "__main__":
    main()
