"""torch.compile: compiling a ShardedModule, the ``fxshard.backend`` compile backend, and overlap.

Numbers on 2 real gloo ranks against the unsharded model; structure (overlap, errors) on the
fake process group. Compiles are slow on CPU: few tests, several checks per child.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel
from fxshard.frontends.backend import overlap, overlap_report
from fxshard.runtime.state_interop import local_slice
from tests import models
from tests.dist_utils import run_ranks
from tests.test_forward_parity import transformer_plan

TOL = 1e-5
TOY_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}


class _BreakToy(models.ToyModel):
    """ToyModel with a graph break between its layers: dynamo captures two graphs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.net1(x))
        torch._dynamo.graph_break()
        return self.net2(h)


def _counting(inner):
    """A backend that counts its compilations and delegates to ``inner`` (a name or callable)."""
    import torch._dynamo

    def count(gm, example_inputs):
        count.calls += 1
        fn = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner
        return fn(gm, example_inputs)

    count.calls = 0
    return count


def _reset():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _grad_err(sm_grads: dict, ref: torch.nn.Module, mesh, placements: dict) -> float:
    """Max error of local gradient shards against slices of the unsharded model's gradients."""
    named = dict(ref.named_parameters())
    return max((g - local_slice(named[n].grad, mesh, placements[n])).abs().max().item() for n, g in sm_grads.items())


def _compiled_vs_eager(mesh, model, plan, batches, loss_fn, backends: dict) -> dict:
    """torch.compile(sm) per backend: per step, compiled loss/grads vs eager sharded vs unsharded;
    compilations per step (one sharded module, compiled once per backend)."""
    sm = fxshard.shard(copy.deepcopy(model), mesh, plan, example_inputs=batches[0])
    res = {"stats": fxshard.comm_stats(sm)}
    for name, backend in backends.items():
        _reset()
        be = _counting(backend)
        cm = torch.compile(sm, backend=be, fullgraph=True)
        ref = copy.deepcopy(model)
        out = res[name] = {"loss": 0.0, "grad": 0.0, "ref_loss": 0.0, "ref_grad": 0.0, "compiles": []}
        for b in batches[:2]:
            sm.zero_grad()
            ref.zero_grad()
            eager = loss_fn(sm, b)
            eager.backward()
            eager_grads = {n: p.grad.clone() for n, p in sm.named_parameters()}
            sm.zero_grad()
            compiled = loss_fn(cm, b)
            compiled.backward()
            unsharded = loss_fn(ref, b)
            unsharded.backward()
            grads = {n: p.grad for n, p in sm.named_parameters()}
            out["loss"] = max(out["loss"], (compiled - eager).abs().item())
            out["grad"] = max(out["grad"], max((grads[n] - eager_grads[n]).abs().max().item() for n in grads))
            out["ref_loss"] = max(out["ref_loss"], (compiled - unsharded).abs().item())
            out["ref_grad"] = max(out["ref_grad"], _grad_err(grads, ref, mesh, sm._placements))
            out["compiles"].append(be.calls)
        out["breaks"] = _breaks()
    return res


def _train_with_backend(mesh, model, backend_obj, batches, loss_fn, fullgraph=True) -> dict:
    """Train a copy of ``model`` compiled with ``backend_obj`` (an fxshard.backend) against the
    model itself unsharded (SGD on both); the optimizer updates the backend's local shards."""
    _reset()
    ref = copy.deepcopy(model)
    compiled_model = copy.deepcopy(model)
    cm = torch.compile(compiled_model, backend=backend_obj, fullgraph=fullgraph)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = None
    out = {"loss": 0.0, "grad": 0.0, "graphs": []}
    for b_in in batches:
        loss = loss_fn(cm, b_in)
        loss.backward()
        if opt is None:  # the backend shards lazily, at the first call
            opt = torch.optim.SGD(backend_obj.parameters(), lr=0.1)
        ref_loss = loss_fn(ref, b_in)
        ref_loss.backward()
        out["loss"] = max(out["loss"], (loss - ref_loss).abs().item())
        out["grad"] = max(out["grad"], _grad_err({n: p.grad for n, p in backend_obj.named_parameters()}, ref, mesh,
                                                 backend_obj.placements()))
        out["graphs"].append(len(backend_obj.modules))
        opt.step()
        opt.zero_grad()
        opt_ref.step()
        opt_ref.zero_grad()
    named = dict(ref.named_parameters())
    out["param"] = max((p - local_slice(named[n], mesh, backend_obj.placements()[n])).abs().max().item()
                       for n, p in backend_obj.named_parameters())
    out["full_params_untouched"] = all(p.grad is None for p in compiled_model.parameters()) and all(
        torch.equal(p, q) for p, q in zip(compiled_model.parameters(), model.parameters()))
    out["breaks"] = _breaks()
    out["stats"] = fxshard.comm_stats(backend_obj.modules[0])
    return out


def _toy_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g),) for _ in range(3)]


def _toy_loss(m, b):
    return m(*b).square().mean()


def _toy(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model, batches = models.ToyModel(16, 32), _toy_batches()
    res = _compiled_vs_eager(mesh, model, TOY_PLAN, batches, _toy_loss, {"aot_eager": "aot_eager", "eager": "eager"})
    inner = _counting("aot_eager")
    res["backend"] = _train_with_backend(mesh, model, fxshard.backend(mesh, TOY_PLAN, inner=inner), batches, _toy_loss)
    res["backend"]["inner_compiles"] = inner.calls
    res["break"] = _train_with_backend(mesh, _BreakToy(16, 32), fxshard.backend(mesh, TOY_PLAN, inner="aot_eager"),
                                       batches, _toy_loss, fullgraph=False)
    return res


def test_compile_toy_model_sharded_module_and_backend():
    for res in run_ranks(_toy, 2):
        for be in ("aot_eager", "eager"):  # torch.compile(sm)
            r = res[be]
            assert r["loss"] <= TOL and r["grad"] <= TOL and r["ref_loss"] <= TOL and r["ref_grad"] <= TOL, (be, r)
            assert r["breaks"] == 0 and r["compiles"] == [1, 1], (be, r)  # one graph, no recompile on step 2
        r = res["backend"]  # torch.compile(model, backend=fxshard.backend(mesh, plan)), trained with SGD
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["param"] <= TOL, r
        assert r["graphs"] == [1, 1, 1] and r["breaks"] == 0 and r["full_params_untouched"], r
        assert r["inner_compiles"] == 1  # the per-rank program compiled once by the inner backend
        assert r["stats"]["forward"] == {"all_reduce": {"count": 1, "bytes": 8 * 16 * 4}}, r["stats"]
        r = res["break"]  # a graph break: two graphs, each sharded; still the unsharded numbers
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["param"] <= TOL, r
        assert r["breaks"] == 1 and r["graphs"] == [2, 2, 2], r


def _transformer(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16, tie=True)
    batches = [(models.make_tokens(2, 8, 64, seed=s), models.make_tokens(2, 8, 64, seed=s + 50)) for s in range(2)]
    loss_fn = lambda m, b: m(*b)  # noqa: E731
    plan = transformer_plan(2)
    res = {"sm": _compiled_vs_eager(mesh, model, plan, batches, loss_fn, {"aot_eager": "aot_eager"})}
    b = fxshard.backend(mesh, plan, inner="aot_eager", overlap=True)
    res["backend"] = _train_with_backend(mesh, model, b, batches, loss_fn)
    res["overlapped"] = sum(bool(r["overlapped"]) for r in overlap_report(b.modules[0]))
    return res


def test_compile_transformer_sharded_module_and_backend_with_overlap():
    for res in run_ranks(_transformer, 2):
        r = res["sm"]["aot_eager"]
        assert r["loss"] <= TOL and r["grad"] <= TOL, r
        assert r["ref_loss"] <= 1e-4 and r["ref_grad"] <= TOL, r
        assert r["breaks"] == 0 and r["compiles"] == [1, 1], r
        r = res["backend"]
        assert r["loss"] <= 1e-4 and r["grad"] <= TOL and r["param"] <= TOL, r
        assert r["graphs"] == [1, 1] and r["breaks"] == 0, r
        assert r["stats"] == res["sm"]["stats"]  # the captured graph shards like the module: same collectives
        assert res["overlapped"] > 0


def _inductor(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    from torch._inductor.compile_fx import compile_fx

    return _compiled_vs_eager(mesh, models.ToyModel(16, 32), TOY_PLAN, _toy_batches(), _toy_loss,
                              {"inductor": compile_fx})["inductor"]


def test_compile_sharded_module_with_inductor():
    for r in run_ranks(_inductor, 2):
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["ref_loss"] <= TOL and r["ref_grad"] <= TOL, r
        assert r["breaks"] == 0 and r["compiles"] == [1, 1], r


def test_overlap_issues_collectives_before_independent_compute(mesh2):
    """In a 2-layer transformer's training programs, reordering puts independent compute (the weight
    gradients) between an all_reduce's issue and its wait, and keeps the collectives' order."""
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=2, max_seq=16, tie=True)
    batch = (models.make_tokens(2, 8, 64), models.make_tokens(2, 8, 64, seed=1))
    sm = fxshard.shard(model, mesh2, transformer_plan(2), example_inputs=batch)
    before = [(r["program"], r["node"]) for r in overlap_report(sm)]
    overlap(sm)
    rows = overlap_report(sm)
    assert [(r["program"], r["node"]) for r in rows] == before  # same collectives, same order
    overlapped = [r for r in rows if r["overlapped"]]
    assert overlapped, rows
    assert all(r["issue"] < r["wait"] for r in rows)
    # Megatron-style: an input-gradient all_reduce in flight while weight-gradient matmuls run
    assert any(r["program"] == "backward" and any(n.startswith("mm") for n in r["overlapped"]) for r in rows), rows
    for prog in sm._programs():  # what runs in between is independent of the collective's result
        nodes = {n.name: n for n in prog.gm.graph.nodes}
        for r in (r for r in overlapped if r["program"] == prog.label):
            after, stack = set(), [nodes[r["node"]]]
            while stack:
                for u in stack.pop().users:
                    if u not in after:
                        after.add(u)
                        stack.append(u)
            assert not any(nodes[n] in after for n in r["overlapped"]), r


def test_backend_applies_style_boundaries_like_shard(mesh2):
    """Seed 003's sequence-parallel Llama plan (SequenceParallel, PrepareModuleInput, output layouts):
    the backend finds the module boundaries in the captured graph and communicates like shard()."""
    import torch._dynamo

    from tests.test_plans import llama_seed003_plan

    torch._dynamo.reset()
    model = models.LlamaDecoder(vocab=64, dim=32, n_heads=4, n_kv_heads=2, n_layers=1, hidden=64, max_seq=16)
    batch = (models.make_tokens(2, 16, 64), models.make_tokens(2, 16, 64, seed=1))
    sm = fxshard.shard(copy.deepcopy(model), mesh2, llama_seed003_plan(), example_inputs=batch)
    b = fxshard.backend(mesh2, llama_seed003_plan(), inner=None)
    torch.compile(model, backend=b, fullgraph=True)(*batch)
    assert fxshard.comm_stats(b.modules[0]) == fxshard.comm_stats(sm)
    assert "reduce_scatter" in fxshard.comm_stats(sm)["forward"]
    assert b.unmatched_plan_entries() == []
    torch._dynamo.reset()


def _cause(e: BaseException) -> BaseException:
    while not isinstance(e, fxshard.ShardingError) and (e.__cause__ or getattr(e, "inner_exception", None)):
        e = e.__cause__ or e.inner_exception
    return e


def test_backend_by_name_and_errors(mesh2):
    import torch._dynamo

    torch._dynamo.reset()
    x = torch.randn(8, 16)
    model = models.ToyModel(16, 32)
    with fxshard.backend_options(mesh2, TOY_PLAN, inner=None) as b:  # backend="fxshard"
        out = torch.compile(model, backend="fxshard", fullgraph=True)(x)
    assert out.shape == (8, 16) and len(b.modules) == 1
    assert {n: tuple(p.shape) for n, p in b.named_parameters()} == {
        "net1.weight": (16, 16), "net1.bias": (16,), "net2.weight": (16, 16), "net2.bias": (16,)}
    assert all(p.grad is None for p in b.parameters()) and out.requires_grad
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(models.ToyModel(16, 32), backend="fxshard")(x)
    assert isinstance(_cause(info.value), fxshard.ShardingError) and "backend_options" in str(_cause(info.value))
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(models.ToyModel(16, 32), backend=fxshard.backend(mesh2, TOY_PLAN, inner=None), dynamic=True)(x)
    assert isinstance(_cause(info.value), fxshard.ShardingError) and "dynamic=False" in str(_cause(info.value))
    with pytest.raises(fxshard.ShardingError, match="no graph has been compiled"):
        list(fxshard.backend(mesh2, TOY_PLAN).parameters())
    torch._dynamo.reset()


def test_importing_fxshard_does_not_import_dynamo():
    import subprocess
    import sys

    code = "import sys, fxshard; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def _overlapped_in_code(code: str) -> list[int]:
    """Per in-place all_reduce in inductor's output ``code``: how many kernel calls run between it and
    the wait_tensor of the same buffer."""
    import re

    lines = [ln.strip() for ln in code.splitlines()]
    gaps = []
    for i, ln in enumerate(lines):
        m = re.match(r"torch\.ops\._c10d_functional\.all_reduce_\.default\((.*), 'sum'", ln)
        if m is None:
            continue
        wait = f"torch.ops._c10d_functional.wait_tensor.default({m.group(1)})"
        j = next((j for j in range(i + 1, len(lines)) if lines[j] == wait), None)
        assert j is not None, f"no {wait} after {ln}"
        gaps.append(sum(1 for k in range(i + 1, j) if lines[k].startswith(("extern_kernels.", "cpp_fused"))))
    return gaps


def test_inductor_keeps_the_overlap_schedule(mesh2):
    """``sm.compile()`` and the backend with inductor keep fxshard's schedule: weight-gradient kernels
    run between a backward all_reduce and its wait, and the compiled step computes what the eager one
    does. (At this shape inductor's default peak-memory reordering puts every wait right after its
    collective: no kernel in between.)"""
    import torch.nn.functional as F
    from torch._inductor.utils import run_and_get_code
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=1, vocab_size=1024, max_seq_len=64, dim=256, n_heads=8, dropout_p=0.0,
                                  weight_tying=False))
    plan = {"layers.*.attention.wq": ColwiseParallel(), "layers.*.attention.wk": ColwiseParallel(),
            "layers.*.attention.wv": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w1": ColwiseParallel(), "layers.*.feed_forward.w2": RowwiseParallel()}
    tokens = models.make_tokens(4, 64, 1024)
    sm = fxshard.shard(copy.deepcopy(model), mesh2, plan, example_inputs=(tokens,))

    def step(run):
        loss = F.cross_entropy(run(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        return loss

    eager_loss = step(sm)
    eager_grads = {k: p.grad.clone() for k, p in sm.named_parameters()}
    sm.zero_grad()
    _reset()
    sm.compile(mode="default")  # a mode becomes its options, merged with INDUCTOR_OPTIONS
    loss, codes = run_and_get_code(step, sm)
    assert len(codes) == 2, len(codes)  # the forward and the backward program
    gaps = [g for c in codes for g in _overlapped_in_code(c)]
    assert len(gaps) == 4 and min(gaps[2:]) >= 2, gaps  # forward: nothing to overlap; backward: weight grads
    torch.testing.assert_close(loss, eager_loss)
    for k, p in sm.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[k], msg=k)

    _reset()
    compiled = torch.compile(copy.deepcopy(model), backend=fxshard.backend(mesh2, plan))
    _, codes = run_and_get_code(step, compiled)
    gaps = [g for c in codes for g in _overlapped_in_code(c)]
    assert len(gaps) == 4 and min(gaps[2:]) >= 2, gaps


def test_sharded_module_compile_arguments(mesh2, monkeypatch):
    """``sm.compile`` hands inductor ``mode``'s options, then INDUCTOR_OPTIONS, then the caller's; the
    default backend (``None``) counts as inductor; other backends get the arguments unchanged."""
    from fxshard.frontends.backend import INDUCTOR_OPTIONS

    sm = fxshard.shard(models.ToyModel(16, 32), mesh2, TOY_PLAN, example_inputs=(torch.randn(4, 16),))
    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    sm.compile(mode="max-autotune-no-cudagraphs", options={"reorder_for_locality": False}, fullgraph=True)
    sm.compile(backend=None, options={"reorder_for_peak_memory": True})
    sm.compile(backend="aot_eager", mode="default")
    assert seen[0] == {"fullgraph": True, "options": {"max_autotune": True, "coordinate_descent_tuning": True,
                                                     "reorder_for_peak_memory": False, "reorder_for_locality": False}}
    assert seen[1] == {"backend": None, "options": {"reorder_for_peak_memory": True}}  # the caller's options win
    assert seen[2] == {"backend": "aot_eager", "mode": "default"}
    assert dict(INDUCTOR_OPTIONS) == {"reorder_for_peak_memory": False}  # nothing above changed the constant
