"""``fxshard.from_hf``: translating a transformers model's own tensor-parallel plan (no processes needed;
numbers are checked by the zoo in ``tests/test_hf_zoo.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard import ColwiseParallel, P, Packed, RowwiseParallel, ShardingError
from fxshard.plans.hf import TRANSLATIONS

pytest.importorskip("transformers")


def _tiny(arch: str) -> nn.Module:
    from tests.test_hf_zoo import build

    return build(arch)[0]


def test_llama_plan_translates_to_styles_and_the_head_gathers():
    plan = fxshard.from_hf(_tiny("llama"))
    assert set(plan) == {"lm_head", "model.embed_tokens"} | {
        f"model.layers.*.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    q = plan["model.layers.*.self_attn.q_proj"]
    assert isinstance(q, ColwiseParallel) and tuple(q.output_layouts) == (Shard(-1),) and q.mesh_axis == "tp"
    assert isinstance(plan["model.layers.*.self_attn.o_proj"], RowwiseParallel)
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)  # embedding_rowwise: vocab split
    assert tuple(plan["lm_head"].output_layouts) == (Replicate(),)  # colwise_gather_output


def test_moe_experts_are_packed_under_tp_and_whole_under_ep():
    model = _tiny("mixtral")
    tp = fxshard.from_hf(model, axis="mp")
    assert tp["model.layers.*.mlp.experts.gate_up_proj"] == P(None, Packed("mp", 2), None)
    assert tp["model.layers.*.mlp.experts.down_proj"] == P(None, None, "mp")
    assert "model.layers.*.mlp.experts" not in tp  # moe_tp_experts only fixes up sums: no entry
    assert tp["model.layers.*.self_attn.q_proj"].mesh_axis == "mp"
    ep = fxshard.from_hf(model, experts="ep")
    assert ep["model.layers.*.mlp.experts.gate_up_proj"] == P("tp", None, None)
    assert ep["model.layers.*.mlp.experts.down_proj"] == P("tp", None, None)


def test_parameter_keys_and_packed_bias():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = nn.Linear(4, 8)
            self.down = nn.Linear(4, 4)
            self.inner = nn.Module()
            self.inner.down = nn.Linear(4, 4)

    class Model(nn.Module):
        tp_plan = {"blocks.*.gate_up": "packed_colwise", "blocks.*.down": "rowwise",
                   "blocks.*.inner.down.weight": "colwise", "blocks.*.missing": "colwise", "norm": "sequence_parallel"}

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])
            self.norm = nn.LayerNorm(4)

    plan = fxshard.from_hf(Model())
    assert plan["blocks.*.gate_up.weight"] == P(Packed("tp", 2), None)
    assert plan["blocks.*.gate_up.bias"] == P(Packed("tp", 2))
    # fnmatch's "blocks.*.down" would also match blocks.0.inner.down (HF's * is one layer number): expanded
    assert "blocks.*.down" not in plan
    assert isinstance(plan["blocks.0.down"], RowwiseParallel) and isinstance(plan["blocks.1.down"], RowwiseParallel)
    assert plan["blocks.*.inner.down.weight"] == P("tp", None)
    assert "blocks.*.missing" not in plan  # matches nothing in this model
    assert isinstance(plan["norm"], fxshard.SequenceParallel) and plan["norm"].mesh_axis == "tp"


def test_unknown_strings_and_missing_plans_are_sharding_errors():
    class Model(nn.Module):
        tp_plan = {"a": "colwise", "b": "fancy_new_style", "c": "another"}

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    with pytest.raises(ShardingError, match=r"'b': 'fancy_new_style', 'c': 'another'; known strings are"):
        fxshard.from_hf(Model())
    with pytest.raises(ShardingError, match="carries no Hugging Face tensor-parallel plan"):
        fxshard.from_hf(nn.Linear(2, 2))
    with pytest.raises(ShardingError, match="experts='x'"):
        fxshard.from_hf(Model(), experts="x")


def test_every_string_the_installed_transformers_registers_is_translated():
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    assert set(ALL_PARALLEL_STYLES) <= set(TRANSLATIONS), set(ALL_PARALLEL_STYLES) - set(TRANSLATIONS)


def test_fxshard_imports_without_transformers():
    code = "import sys; sys.modules['transformers'] = None; import fxshard; print(fxshard.from_hf.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "from_hf", out.stderr[-2000:]
