"""Model code branching on ``torch.compiler.is_exporting()`` is traced down eager's branch where
``fxshard.eager_branches`` names it, and down the export branch everywhere else."""

from __future__ import annotations

import textwrap
import types

import pytest
import torch

from fxshard.eager_branches import takes_eager_branch
from fxshard.passes.trace import trace_forward
from fxshard.torch_compat import exporting_hidden_from

aten = torch.ops.aten


def _ops(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _hf_like_module() -> types.ModuleType:
    """A module named like a transformers model file: the listed function reads the flag through a helper
    (as transformers' ``is_torchdynamo_exporting``), another function reads it directly."""
    mod = types.ModuleType("transformers.models.toy.modeling_toy")
    exec(textwrap.dedent("""
        import torch

        def is_torchdynamo_exporting():
            return torch.compiler.is_exporting()

        def torch_chunk_gated_delta_rule(x):
            return x * 2.0 if is_torchdynamo_exporting() else x + 1.0

        def other(x):
            return x * 3.0 if is_torchdynamo_exporting() else x - 1.0
    """), mod.__dict__)
    return mod


class _Branches(torch.nn.Module):
    def __init__(self, mod: types.ModuleType) -> None:
        super().__init__()
        self.mod = mod

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mod.torch_chunk_gated_delta_rule(x), self.mod.other(x)


def test_only_the_listed_function_sees_eager_while_fxshard_exports():
    real = torch.compiler.is_exporting
    x = torch.randn(3, 4)
    gm = trace_forward(_Branches(_hf_like_module()), (x,), {}).gm
    assert torch.compiler.is_exporting is real  # restored
    ops = _ops(gm)
    # the listed function took eager's branch (add), the other one export's (mul by 3)
    assert ops.count(aten.add.Tensor) == 1 and aten.sub.Tensor not in ops, ops
    assert ops.count(aten.mul.Tensor) == 1, ops
    out = gm(x)
    torch.testing.assert_close(out[0], x + 1.0)
    torch.testing.assert_close(out[1], x * 3.0)


def test_takes_eager_branch_matches_function_and_module():
    code = _hf_like_module().torch_chunk_gated_delta_rule.__code__
    assert takes_eager_branch(code, "transformers.models.qwen3_5.modeling_qwen3_5")
    assert not takes_eager_branch(code, "mylib.modeling_qwen3_5")
    assert not takes_eager_branch(_hf_like_module().other.__code__, "transformers.models.qwen3_5.modeling_qwen3_5")


def test_exporting_hidden_from_keeps_torch_and_restores_on_error():
    seen = {}

    class M(torch.nn.Module):
        def forward(self, x):
            seen["hidden"] = _hidden_reader()
            seen["other"] = torch.compiler.is_exporting()
            return x + 1

    real = torch.compiler.is_exporting
    with exporting_hidden_from(lambda code, module: code.co_name == "_hidden_reader"):
        torch.export.export(M(), (torch.randn(2),), strict=False)
        assert not torch.compiler.is_exporting()  # not exporting now: False for everyone
    assert seen == {"hidden": False, "other": True}
    with pytest.raises(ValueError), exporting_hidden_from(lambda code, module: True):
        raise ValueError
    assert torch.compiler.is_exporting is real


def _hidden_reader() -> bool:
    return torch.compiler.is_exporting()


def test_qwen3_5_gated_delta_rule_traces_the_triangular_solve_not_an_unrolled_loop():
    pytest.importorskip("transformers")
    from tests.test_hf_zoo import build

    model, kwargs = build("qwen3_5_text")  # one linear-attention layer, one full-attention layer
    gm = trace_forward(model, (), kwargs).gm
    ops = _ops(gm)
    # eager's two solves per linear-attention layer; under export's branch: none and a 63-step loop
    # (1,469 nodes against 444)
    assert ops.count(aten.linalg_solve_triangular.default) == 2
    assert len(gm.graph.nodes) < 700, len(gm.graph.nodes)
