"""Model code branching on ``torch.compiler.is_exporting()`` is traced down eager's branch where
``fxshard.tracing.eager_branches`` names it, and down the export branch everywhere else."""

from __future__ import annotations

import textwrap
import types

import pytest
import torch

from fxshard.tracing.eager_branches import takes_eager_branch
from fxshard.tracing.export import trace_forward
from fxshard.core.torch_compat import exporting_hidden_from

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


class _Solves(torch.nn.Module):
    """Per-head triangular systems from a parameter, solved from both sides; the output is replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 6, 6) * 0.3)  # [heads, n, n]
        self.v = torch.nn.Parameter(torch.randn(4, 6, 4))  # [heads, n, right-hand sides]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, heads, n, n]
        a = (x * self.w).tril(-1) + 3 * torch.eye(6)
        left = torch.linalg.solve_triangular(a, self.v.expand(x.shape[0], -1, -1, -1), upper=False)
        right = torch.linalg.solve_triangular(a.transpose(-1, -2), left.transpose(-1, -2), upper=True, left=False,
                                              unitriangular=True)
        return right.sum(1)


def _solve_cases(rank: int, world: int) -> dict:
    import copy

    import fxshard
    from fxshard import P
    from fxshard.core.ir import STRATEGY_KEY

    mesh = fxshard.init_mesh(tp=world)
    gen = torch.Generator().manual_seed(0)
    res = {}
    # heads split (batch dims alike on both inputs); right-hand sides split (the output's dim 1), A replicated
    for name, plan, out_spec in (("heads", {"w": P("tp", None, None), "v": P("tp", None, None)}, None),
                                 ("columns", {"v": P(None, None, "tp")}, P(None, "tp", None))):
        torch.manual_seed(0)
        ref = _Solves()
        x = torch.randn(2, 4, 6, 6, generator=gen)
        sm = fxshard.shard(copy.deepcopy(ref), mesh, plan, example_inputs=(x,), out_specs=out_spec)
        out, want = sm(x), ref(x)
        cot = torch.randn(want.shape, generator=gen)
        local_cot = cot if out_spec is None else cot.chunk(world, 1)[rank]
        (out * local_cot).sum().backward()
        (want * cot).sum().backward()
        err = (out - (want if out_spec is None else want.chunk(world, 1)[rank])).abs().max().item()
        for n, p in sm.named_parameters():
            err = max(err, (sm._dtensor(n, p.grad).full_tensor() - ref.get_parameter(n).grad).abs().max().item())
        solves = [st.inputs for prog in sm._programs() for node in prog.gm.graph.nodes
                  if node.target is aten.linalg_solve_triangular.default for st in node.meta[STRATEGY_KEY]]
        res[name] = (err, sorted({str(pl) for ins in solves for pl in ins}))
    return res


def test_triangular_solves_split_match_eager_forward_and_gradients():
    from tests.dist_utils import run_ranks

    for res in run_ranks(_solve_cases, 2):
        for name, (err, placements) in res.items():
            assert err < 1e-4, (name, err)
            assert any(p.startswith("S(") for p in placements), (name, placements)  # solved split, not gathered
