"""Python state the forward changes must not silently stop changing (``fxshard/forward_state.py``).

Measured before the check: a model whose forward counts its calls in a plain attribute and scales its
output by the count's parity matched eager on the first call and differed by 0.88 on the second
(``torch.export`` restores the attribute after tracing, so nothing showed); a LayerDrop drawing with
Python's ``random`` kept the traced draw for every call. Fake process group.
"""

from __future__ import annotations

import copy
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
