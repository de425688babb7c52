"""Tracing one distinct op at a time (``fxshard/tracing/by_op.py``) gives the whole-graph traces' graphs.

For every model of ``tests.models.MODEL_CASES`` and the tricky ones of ``test_joint_semantics``
(multi-use values, tuple outputs, complex intermediates, stop-gradients, learned attention masks, slice copies, names that
clash with the joint graph's), ``trace_joint`` with and without the per-op path must give the same
placeholders, the same multiset of ops, the same source lines on the forward ops, and the same
outputs and gradients on random inputs (run as plain programs on one process; the parity tests of
the rest of the suite compare the sharded programs built from it with eager autograd). The per-op
path must actually be taken there, trace each distinct op once (a deeper model adds no trace), and
step aside for what it does not handle (here: data-dependent shapes; collectives in the model are
covered by ``test_joint_semantics``, whose cases go through ``shard()``). The same holds for the
forward's decomposition (``trace_forward``): same graph and values, exactly, as the whole re-trace,
which it leaves in-place updates and ``no_grad`` regions to.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import fxshard.tracing.joint as joint_mod
import fxshard.tracing.export as trace_mod
import fxshard.tracing.by_op as by_op_mod
from fxshard import ShardingError
from fxshard.tracing.joint import trace_joint
from fxshard.tracing.export import trace_forward
from tests import test_joint_semantics as js
from tests.models import MODEL_CASES, LlamaDecoder, make_tokens


class _Shared(nn.Module):
    """A value read by several ops (gradients summed), a tuple-output op read in part, an output
    returned twice and an input returned as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.lin(x)
        a, b = h.chunk(2, dim=-1)
        m, idx = torch.max(h, dim=-1)
        y = self.norm(h) * h + torch.tanh(h) + torch.cat([b, a], -1)
        return y, y, m, idx, x


class _ComplexRope(nn.Module):
    """Rotary embedding through complex numbers (``view_as_complex``, as Llama 4 writes it): the
    gradient flows through complex intermediates."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.freqs = nn.Parameter(torch.randn(5, 4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.view_as_complex(self.q(x).float().reshape(*x.shape[:-1], 4, 2))
        rot = torch.polar(torch.ones_like(self.freqs), self.freqs)
        return (torch.view_as_real(q * rot).flatten(-2) ** 2).sum()


class _ConjProduct(nn.Module):
    """``q * k.conj()`` of complex views: a conjugate view reaches the product and its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.view_as_complex(self.q(x).reshape(*x.shape[:-1], 4, 2))
        k = torch.view_as_complex(self.k(x).reshape(*x.shape[:-1], 4, 2))
        p = q * k.conj()
        return p.real.sum(-1) + p.imag.sum(-1)


class _OffsetStrided(nn.Module):
    """``as_strided`` with an explicit storage offset on a view that has one of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[1:].as_strided((2, 4), (8, 1), 12) * 2


class _ComplexWeight(nn.Module):
    """A complex parameter (a spectral layer's weight): fxshard does not differentiate complex inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(5, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.irfft(torch.fft.rfft(self.lin(x), dim=-1) * self.w, n=8, dim=-1)


def _extra_cases() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, grad: bool = False) -> Callable[[], torch.Tensor]:
        t = torch.randn(*shape, generator=g)
        return lambda: t.clone().requires_grad_(grad)

    x48, x8 = randn(4, 8, grad=True), randn(3, 8)
    return {
        "shared": (_Shared, lambda: (x8(),)),
        "conj_product": (_ConjProduct, lambda: (torch.randn(3, 8, generator=torch.Generator().manual_seed(4)),)),
        "offset_strided": (_OffsetStrided, lambda: (torch.randn(4, 8, generator=torch.Generator().manual_seed(5)),)),
        "complex_rope": (_ComplexRope, lambda: (torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3)),)),
        "maxmin": (js.MaxMin, lambda: (torch.randn(10, 6, generator=torch.Generator().manual_seed(1)),)),
        "index_fill": (js.IndexFill, lambda: (torch.randn(3, 4, generator=torch.Generator().manual_seed(2)),)),
        "clashing_names": (js.ClashingNames, lambda: tuple(torch.randn(2, 4) for _ in range(6))),
        **{f"stop_{how}": ((lambda how=how: js.StopGrad(how)), lambda: (x48(),))
           for how in ("no_grad", "detach", "enable_grad")},
        "learned_mask": (js.LearnedMask, lambda: (torch.randn(2, 6, 16),)),
        "fixed_mask": (lambda: js.LearnedMask(learned=False), lambda: (torch.randn(2, 6, 16),)),
        "slice_copies": (js.SliceCopies, lambda: (torch.randn(2, 5, 8),)),
        "circular_pad": (js.CircularPad, lambda: (torch.randn(4, 3, 8),)),
    }


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]] = {
    **{c.name: (c.make_model, c.make_inputs) for c in MODEL_CASES}, **_extra_cases()}


def _traced(make_model: Callable[[], nn.Module], make_inputs: Callable[[], tuple]) -> tuple[Any, list[bool]]:
    torch.manual_seed(0)
    inputs = make_inputs()
    traced = trace_forward(make_model(), inputs, {})
    leaves = [x for x in inputs if isinstance(x, torch.Tensor)]
    wants = [(s.kind == "param" and s.requires_grad) or (s.kind == "input" and leaves[s.index].requires_grad)
             for s in traced.slots]
    return traced, wants


class _Spy:
    """Counts ``joint_by_op``'s results (graph or None) and the ``make_fx`` traces it runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.results: list[bool] = []
        self.traces = 0
        by_op, make_fx = by_op_mod.joint_by_op, by_op_mod.functional_make_fx

        def spy_by_op(*a: Any, **k: Any) -> Any:
            res = by_op(*a, **k)
            self.results.append(res is not None)
            return res

        def spy_make_fx(*a: Any, **k: Any) -> Any:
            self.traces += 1
            return make_fx(*a, **k)

        monkeypatch.setattr(joint_mod, "joint_by_op", spy_by_op)
        monkeypatch.setattr(by_op_mod, "functional_make_fx", spy_make_fx)


def _real(v: Any, g: torch.Generator) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    if v.is_floating_point():
        return torch.randn(v.shape, generator=g, dtype=v.dtype)
    if v.dtype == torch.bool:
        return torch.randint(0, 2, v.shape, generator=g).bool()
    return torch.randint(0, 2, v.shape, generator=g, dtype=v.dtype)


def _ops(gm: torch.fx.GraphModule) -> collections.Counter:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


# what the per-op traces leave to the whole trace: a conjugate view (not reproduced on fake inputs), an
# as_strided whose input has a storage offset (its trace holds offsets relative to that input's)
WHOLE_JOINT = {"conj_product", "offset_strided"}


@pytest.mark.parametrize("name", list(CASES))
def test_per_op_trace_gives_the_whole_trace_graph(name, monkeypatch):
    traced, wants = _traced(*CASES[name])
    whole = trace_joint(traced, traced.gm, wants, by_op=False)
    spy = _Spy(monkeypatch)
    fast = trace_joint(traced, traced.gm, wants, by_op=True)
    assert spy.results == [name not in WHOLE_JOINT], "the per-op path stepped aside, or did not"
    assert (fast.n_primals, fast.diff_in, fast.diff_out, fast.n_out, fast.grad_out, fast.reaches) == (
        whole.n_primals, whole.diff_in, whole.diff_out, whole.n_out, whole.grad_out, whole.reaches)
    names = lambda gm: [n.name for n in gm.graph.nodes if n.op == "placeholder"]  # noqa: E731
    assert names(fast.gm) == names(whole.gm)
    assert _ops(fast.gm) == _ops(whole.gm)
    # the forward ops keep their user's lines (what errors and explain() print)
    lines = lambda gm: collections.Counter((str(n.target), n.meta.get("stack_trace"))  # noqa: E731
                                           for n in gm.graph.nodes if n.meta.get("stack_trace"))
    assert lines(fast.gm) == lines(whole.gm)
    g = torch.Generator().manual_seed(1)
    args = [_real(n.meta["val"], g) for n in whole.gm.graph.nodes if n.op == "placeholder"]
    want, got = torch.utils._pytree.tree_leaves(whole.gm(*args)), torch.utils._pytree.tree_leaves(fast.gm(*args))
    assert len(got) == len(want)
    for w, o in zip(want, got):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-6)
        else:
            assert o == w


def test_each_distinct_op_is_traced_once(monkeypatch):
    """Two more identical layers add no trace: the per-op path traces signatures, not nodes."""
    counts = []
    for layers in (2, 4):
        traced, wants = _traced(lambda: LlamaDecoder(n_layers=layers), lambda: (make_tokens(2, 8, 64, seed=0),))
        spy = _Spy(monkeypatch)
        joint = trace_joint(traced, traced.gm, wants, by_op=True)
        assert spy.results == [True]
        counts.append((spy.traces, sum(_ops(joint.gm).values())))
    (t2, n2), (t4, n4) = counts
    assert t4 == t2 and n4 > n2 * 1.5, counts


def test_data_dependent_shapes_take_the_whole_trace(monkeypatch):
    spy = _Spy(monkeypatch)
    traced, wants = _traced(js.DataDependent, lambda: (torch.randn(5, 4), torch.tensor([2])))
    joint = trace_joint(traced, traced.gm, wants)
    assert spy.results == [False] and any(n.target is torch.ops.aten.masked_select.default
                                          for n in joint.gm.graph.nodes)


def test_the_environment_can_turn_the_per_op_path_off(monkeypatch):
    traced, wants = _traced(*CASES["toy"])
    monkeypatch.setattr(by_op_mod, "MIN_REPEATS", 0.0)
    spy = _Spy(monkeypatch)
    monkeypatch.setenv("FXSHARD_TRACE_BY_OP", "0")
    trace_joint(traced, traced.gm, wants)
    monkeypatch.setenv("FXSHARD_TRACE_BY_OP", "1")
    trace_joint(traced, traced.gm, wants)
    assert spy.results == [True]  # called once: not at all while turned off


# export's graph updates a tensor in place (index_fill_, slice copies) or holds a no_grad region there
WHOLE_FORWARD = {"index_fill", "stop_no_grad", "stop_enable_grad", "slice_copies", "conj_product", "offset_strided"}


@pytest.mark.parametrize("name", list(CASES))
def test_per_op_forward_decomposition_gives_the_whole_trace_graph(name, monkeypatch):
    make_model, make_inputs = CASES[name]
    monkeypatch.setattr(by_op_mod, "MIN_REPEATS", 0.0)  # every graph, however few ops repeat
    taken: list[bool] = []
    by_op = by_op_mod.forward_by_op

    def spy(*a: Any) -> Any:
        res = by_op(*a)
        taken.append(res is not None)
        return res

    monkeypatch.setattr(trace_mod, "forward_by_op", spy)
    traced = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FXSHARD_TRACE_BY_OP", flag)
        torch.manual_seed(0)
        traced[flag] = trace_forward(make_model(), make_inputs(), {})
    assert taken == [name not in WHOLE_FORWARD]
    whole, fast = traced["0"].gm, traced["1"].gm
    assert traced["0"].mutations == traced["1"].mutations
    names = lambda gm: [n.name for n in gm.graph.nodes if n.op == "placeholder"]  # noqa: E731
    assert names(fast) == names(whole)
    where = lambda gm: collections.Counter((str(n.target), n.meta.get("stack_trace"),  # noqa: E731
                                            str(n.meta.get("nn_module_stack"))) for n in gm.graph.nodes
                                           if n.op == "call_function")
    assert where(fast) == where(whole)
    layouts = lambda gm: [(n.name, [(tuple(v.shape), v.stride()) for v in torch.utils._pytree.tree_leaves(  # noqa: E731
        n.meta.get("val")) if isinstance(v, torch.Tensor)]) for n in gm.graph.nodes]
    assert sorted(layouts(fast)) == sorted(layouts(whole))
    g = torch.Generator().manual_seed(1)
    args = [_real(n.meta["val"], g) for n in whole.graph.nodes if n.op == "placeholder"]
    want, got = torch.utils._pytree.tree_leaves(whole(*args)), torch.utils._pytree.tree_leaves(fast(*args))
    assert len(got) == len(want)
    for w, o in zip(want, got):
        assert torch.equal(o, w) if isinstance(w, torch.Tensor) else o == w


def test_graphs_with_few_repeated_ops_are_traced_whole(monkeypatch):
    """Seed 000's ToyModel (each op distinct) is cheaper traced whole; 4 Llama layers are not."""
    for make_model, inputs, want in ((lambda: CASES["toy"][0](), CASES["toy"][1](), False),
                                     (lambda: LlamaDecoder(n_layers=4), (make_tokens(2, 8, 64, seed=0),), True)):
        traced, wants = _traced(make_model, lambda: inputs)
        spy = _Spy(monkeypatch)
        forward = by_op_mod.forward_by_op(traced.gm, {})
        assert (forward is not None) == want
        trace_joint(traced, traced.gm, wants)  # by_op=None: the default, with the repetition check
        assert spy.results == [want]


def test_a_complex_parameter_gets_the_whole_trace_error(monkeypatch):
    """The whole trace refuses to differentiate a complex parameter; the per-op one must not quietly
    return no gradient for it instead."""
    traced, wants = _traced(_ComplexWeight, lambda: (torch.randn(4, 8),))
    spy = _Spy(monkeypatch)
    for by_op in (False, True):
        with pytest.raises(ShardingError, match="does not require grad"):
            trace_joint(traced, traced.gm, wants, by_op=by_op)
    assert spy.results == [False]


class _RReLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rrelu(x, training=True)


@pytest.mark.parametrize("by_op", [False, True])
def test_rrelu_backward_reads_the_noise_its_forward_drew(by_op, monkeypatch):
    """Eager: d rrelu(x) / dx is the slope drawn for each element, y / x. The functionalized trace
    handed the backward the noise buffer before the forward wrote it (uninitialised memory)."""
    monkeypatch.setattr(by_op_mod, "MIN_REPEATS", 0.0)
    traced, wants = _traced(_RReLU, lambda: (torch.randn(4, 8).requires_grad_(),))
    joint = trace_joint(traced, traced.gm, wants, by_op=by_op)
    x, t = torch.randn(4, 8, generator=torch.Generator().manual_seed(2)), torch.randn(4, 8)
    y, gx = torch.utils._pytree.tree_leaves(joint.gm(x, t))
    torch.testing.assert_close(gx, t * y / x)
    assert ((y / x)[x < 0] < 1).all() and ((y / x)[x < 0] >= 1 / 8).all()  # slopes drawn in [1/8, 1/3]
