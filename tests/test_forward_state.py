"""Python state the forward changes must not silently stop changing (``fxshard/tracing/forward_state.py``).

Measured before the check: a model whose forward counts its calls in a plain attribute and scales its
output by the count's parity matched eager on the first call and differed by 0.88 on the second
(``torch.export`` restores the attribute after tracing, so nothing showed); a LayerDrop drawing with
Python's ``random`` kept the traced draw for every call. Fake process group.
"""

from __future__ import annotations

import copy
import functools
import random
import re

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel, ShardingError


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(4, 8), nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.net2(self.net1(x)) * (2.0 if self.calls % 2 else 1.0)


class _Log(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.inner.seen = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner.seen.append(x.shape[0])
        return self.inner(x)


class _Cache(nn.Module):
    """Fills a Python cache on its first call; the same value on every call after."""

    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(4, 8), nn.Linear(8, 4)
        self.scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            self.scale = 0.5
        return self.net2(self.net1(x)) * self.scale


_PLAN = {"net1": ColwiseParallel(), "net2": RowwiseParallel()}


def test_a_call_counter_in_forward_is_refused(mesh2):
    model = _Counter()
    with pytest.raises(ShardingError, match=r"Python attribute 'calls' \(from 0 to 1 while fxshard traced it\)"):
        fxshard.shard(model, mesh2, _PLAN, example_inputs=(torch.randn(2, 4),))
    assert model.calls == 0


def test_a_list_a_submodule_appends_to_is_refused(mesh2):
    with pytest.raises(ShardingError, match=r"attribute 'inner.seen' \(from a list of 0 items to a list of 1 items"):
        fxshard.shard(_Log(), mesh2, {}, example_inputs=(torch.randn(2, 4),))


def test_a_cache_filled_before_shard_is_accepted(mesh2):
    x = torch.randn(2, 4)
    with pytest.raises(ShardingError, match=r"attribute 'scale' \(from None to 0.5 .*fill it before shard\(\)"):
        fxshard.shard(_Cache(), mesh2, _PLAN, example_inputs=(x,))
    model = _Cache()
    model(x)  # the cache is filled: tracing changes nothing
    ref = copy.deepcopy(model)
    sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
    assert torch.equal(sm(x), ref(x))


class _LayerDrop(nn.Module):
    """Skips each layer with probability 1/2 in training, drawing with Python's or numpy's generator."""

    def __init__(self, draw) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.draw = draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if not (self.training and self.draw() < 0.5):
                x = layer(x)
        return x


@pytest.mark.parametrize("name, draw", [("Python's random module", random.random),
                                        ("numpy.random", lambda: float(np.random.rand()))])
def test_a_host_random_draw_in_forward_is_refused(mesh2, name, draw):
    x = torch.randn(2, 4)
    with pytest.raises(ShardingError, match=rf"the forward draws from {re.escape(name)} while fxshard traces it"):
        fxshard.shard(_LayerDrop(draw), mesh2, {}, example_inputs=(x,))
    model = _LayerDrop(draw).eval()  # no draw: traced as eager runs it
    sm = fxshard.shard(copy.deepcopy(model), mesh2, {}, example_inputs=(x,))
    assert torch.equal(sm(x), model(x))


def test_forward_hooks_on_the_model_warn_that_they_run_at_trace_time(mesh2):
    """A hook that collects activations ran once, at shard(), and never again: the tensor math is traced, the
    Python side effect is not."""
    model, seen = _Cache(), []
    model(torch.randn(2, 4))
    model.net1.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    with pytest.warns(UserWarning, match=r"forward hooks on net1 run once, while _Cache is traced"):
        sm = fxshard.shard(model, mesh2, {}, example_inputs=(torch.randn(2, 4),))
    sm(torch.randn(2, 4))
    assert len(seen) == 1  # the trace's call only: why it warns


class _Memory(nn.Module):
    """A recurrent memory kept in a plain tensor attribute (``in_list``: inside a list attribute), or in a
    buffer: forward reads the previous call's value and stores the new one."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(4, 8), nn.Linear(8, 4)
        self.where = where
        if where == "buffer":
            self.register_buffer("mem", torch.zeros(2, 4))
        elif where == "list":
            self.hist = [torch.zeros(2, 4)]
        else:
            self.mem = torch.zeros(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net2(self.net1(x)) + (self.hist[0] if self.where == "list" else self.mem)
        if self.where == "list":
            self.hist[0] = y.detach()
        else:
            self.mem = y.detach()
        return y


@pytest.mark.parametrize("where, name", [("attribute", "mem"), ("list", "hist[0]")])
def test_a_tensor_attribute_forward_reads_and_replaces_is_refused(mesh2, where, name):
    """Measured before the check: the program kept the memory's value at shard() and was off by 2.1 on the
    second call. Registered as a buffer it is carried as state and matches eager call after call."""
    x = torch.randn(2, 4)
    with pytest.raises(ShardingError, match=rf"reads the tensor attribute '{re.escape(name)}' and replaces it"
                                            r".*Register it as a buffer"):
        fxshard.shard(_Memory(where), mesh2, _PLAN, example_inputs=(x,))
    model = _Memory("buffer")
    ref = copy.deepcopy(model)
    sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
    for _ in range(3):
        assert torch.equal(sm(x), ref(x))


class _Stash(nn.Module):
    """Keeps its last activation in a tensor attribute for inspection: never read by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(4, 8), nn.Linear(8, 4)
        self.last = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net1(x)
        self.last = h.detach()
        return self.net2(h)


class _Cast(nn.Module):
    """Replaces a tensor attribute by a cast of itself, as Meta's Llama reference does with freqs_cis."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(4, 4)
        self.scale = torch.full((4,), 2.0, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = self.scale.to(x.dtype)
        return self.net1(x) * self.scale


def test_a_tensor_attribute_replaced_by_a_cast_of_itself_is_accepted(mesh2):
    """The same values on every call, eager and traced: refusing it broke a common idiom."""
    x = torch.randn(2, 4)
    model = _Cast()
    ref = copy.deepcopy(model)
    sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
    for _ in range(2):
        assert torch.equal(sm(x), ref(x))


def test_a_tensor_attribute_forward_only_writes_or_a_pre_hook_recomputes_is_accepted(mesh2):
    """Written but never read (an activation stash), or recomputed from parameters before every use
    (hook-based weight_norm sets ``module.weight`` in a forward pre-hook): the program computes what eager
    computes, so neither raises."""
    import warnings

    x = torch.randn(2, 4)
    model = _Stash()
    ref = copy.deepcopy(model)
    sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
    assert torch.equal(sm(x), ref(x))
    model = _Cache()
    model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_norm's deprecation, fxshard's traced-hook warning
        model.net1 = torch.nn.utils.weight_norm(model.net1)
        sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
    with torch.no_grad():
        want = model.net2(torch.nn.functional.linear(x, model.net1.weight_v * (
            model.net1.weight_g / model.net1.weight_v.norm(dim=1, keepdim=True)), model.net1.bias)) * 0.5
    assert torch.allclose(sm(x), want, atol=1e-6)


class _SwapsParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.net2(self.net1(x))
        self.net1.weight = nn.Parameter(self.net1.weight.detach() * 0.5)
        return y


def test_a_parameter_forward_replaces_is_refused(mesh2):
    """Measured before the check: eager used the halved weight from the second call on, the program the
    original (off by 0.81 on the second call)."""
    with pytest.raises(ShardingError, match=r"forward replaces parameter 'net1.weight' by another tensor"):
        fxshard.shard(_SwapsParameter(), mesh2, _PLAN, example_inputs=(torch.randn(2, 4),))


class _WritesThroughDetach(nn.Module):
    """In-place writes to a ``detach()`` of a parameter, a buffer or an activation: eager changes the source
    (the two share storage). The trace had routed ``detach`` through a stop-gradient op that made a new
    tensor, so the write was dropped: measured, off by 0.22 (a clamped weight) and 0.77 (``nn.Embedding``
    with ``max_norm``) with no error, with any plan."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.net1, self.net2 = nn.Linear(4, 8), nn.Linear(8, 4)
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.what == "max_norm":
            x = x + self.emb(torch.tensor([1, 2]))[:, None].sum(-1, keepdim=True)
        if self.what == "weight":
            self.net1.weight.detach().clamp_(-0.1, 0.1)
        if self.what == "buffer":
            self.seen.detach().add_(x.sum())
        h = self.net1(x)
        if self.what == "activation":
            h.detach().t().mul_(2)
        return self.net2(h) + self.seen


@pytest.mark.parametrize("what, match", [
    ("weight", r"forward mutates 'net1.weight' \(PARAMETER_MUTATION\); a sharded program does not update"),
    ("max_norm", r"Embedding 'emb' has max_norm=1.0: its forward renormalizes the rows it looks up in place"),
    ("activation", r"forward writes a detached tensor in place \(aten.mul_.Tensor at test_forward_state.py:\d+ "
                   r"h.detach\(\).t\(\).mul_\(2\)\)")])
def test_a_write_through_detach_is_traced_or_refused(mesh2, what, match):
    with pytest.raises(ShardingError, match=match):
        fxshard.shard(_WritesThroughDetach(what), mesh2, _PLAN, example_inputs=(torch.randn(2, 4),))


def test_a_buffer_written_through_detach_updates_as_eager(mesh2):
    torch.manual_seed(0)
    ref = _WritesThroughDetach("buffer")
    sm = fxshard.shard(copy.deepcopy(ref), mesh2, {}, example_inputs=(torch.randn(2, 4),))
    for seed in range(3):  # the buffer is added to the output: a dropped update shows in the second call
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(sm(x), ref(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sm.seen, ref.seen)
    assert ref.seen.item() != 0


_TEMPERATURE = 2.0  # a module-level setting a forward reads
_TRACED = 0


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.net1(x)) / _TEMPERATURE


def _traced_as_is(fn):
    """A decorator as libraries write them (``functools.wraps``): the check reads the function it wraps."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


class _DecoratedTempered(_Tempered):
    @_traced_as_is
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


_NAN = float("nan")
_FUSED = None  # filled by _use_fused() on first use, as libraries cache a capability check


def _use_fused() -> bool:
    global _FUSED
    if _FUSED is None:
        _FUSED = True
    return _FUSED


class _LazyFlag(_Tempered):
    """Reads a NaN constant (never equal to itself) and a module flag a helper fills lazily while traced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nan_to_num(super().forward(x), nan=_NAN)
        return y * 2 if _use_fused() else y


class _CountsGlobally(_Tempered):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global _TRACED
        _TRACED += 1
        return self.net2(self.net1(x)) * _TRACED


def test_a_global_setting_the_forward_reads_is_checked_at_every_call(mesh2):
    """The program keeps the value a module-level number had when traced (measured before the check: 2.0 kept
    after it became 4.0, silently). A call after it changed raises naming it; back at the traced value the module
    runs again. A forward that changes a global while traced is refused at shard(), except a flag filled from None
    (a lazily computed capability check); a NaN constant is not a change."""
    global _TEMPERATURE, _TRACED
    x = torch.randn(2, 4)
    model = _Tempered()
    ref = copy.deepcopy(model)
    sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
    assert torch.equal(sm(x), ref(x))
    twin = copy.deepcopy(sm)  # checks the same live variable (the check must not copy the module's globals)
    decorated = fxshard.shard(_DecoratedTempered(), mesh2, {}, example_inputs=(x,))
    try:
        _TEMPERATURE = 4.0
        for m in (sm, twin, decorated):
            with pytest.raises(ShardingError, match=r"ShardedModule\(_(Decorated)?Tempered\): the forward reads the "
                                                    r"global '_TEMPERATURE' \(in _Tempered.forward\), which was 2.0 "
                                                    r"when it was traced and is 4.0 now.*shard the model again"):
                m(x)
    finally:
        _TEMPERATURE = 2.0
    assert torch.equal(sm(x), ref(x))
    _TRACED = 0
    with pytest.raises(ShardingError, match=r"changed the global '_TRACED' \(in _CountsGlobally.forward\) from 0 "
                                            r"to 1"):
        fxshard.shard(_CountsGlobally(), mesh2, {}, example_inputs=(x,))
    model = _LazyFlag()  # filled from None while traced: recorded with its value, not refused
    ref = copy.deepcopy(model)
    sm = fxshard.shard(model, mesh2, {}, example_inputs=(x,))
    assert _FUSED is True and torch.equal(sm(x), ref(x))
