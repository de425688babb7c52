"""The module tree of a ShardedModule (fake process group): stand-ins of containers index and iterate like
them and hold the local parameters; hooks that could never fire raise; what ``remat`` puts in the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard import ColwiseParallel
from fxshard.errors import ShardingError
from tests import models
from tests.test_forward_parity import transformer_plan


@pytest.fixture
def sm(mesh2):
    model = models.TransformerWithLoss(vocab=64, dim=32, n_heads=4, n_layers=3, max_seq=16)
    batch = (models.make_tokens(2, 16, 64, seed=0), models.make_tokens(2, 16, 64, seed=1))
    return fxshard.shard(model, mesh2, transformer_plan(3), example_inputs=batch)


def test_layers_index_iterate_and_hold_the_local_shards(sm):
    layers = list(sm.layers)
    assert len(sm.layers) == 3 and len(layers) == 3
    assert sm.layers[0] is layers[0] and sm.layers[-1] is layers[2] and sm.layers[1:] == layers[1:]
    # the parameters the program reads are the layer's own
    assert sm.layers[1].attn.wq.weight is dict(sm.named_parameters())["layers.1.attn.wq.weight"]
    assert tuple(sm.layers[1].attn.wq.weight.shape) == (16, 32)  # colwise: half the rows on each of 2 ranks
    assert [n for n, _ in sm.layers[2].named_parameters()][:2] == ["attn_norm.weight", "attn_norm.bias"]
    with pytest.raises(ShardingError, match="has 3 modules; index 3"):
        sm.layers[3]


def test_hooks_on_a_submodule_raise_and_say_what_to_do(sm):
    for register in (sm.layers[0].register_forward_hook, sm.layers[0].attn.register_forward_pre_hook,
                     sm.layers[0].register_full_backward_hook):
        with pytest.raises(ShardingError, match="would never fire.*ShardedModule itself.*remat='layers'"):
            register(lambda *a: None)
    with pytest.raises(ShardingError, match="cannot run on its own.*remat='layers'"):
        sm.layers[0](torch.randn(2, 16, 32))
    seen = []
    sm.register_forward_hook(lambda m, args, out: seen.append(out))  # the ShardedModule's own hooks fire
    batch = (models.make_tokens(2, 16, 64, seed=0), models.make_tokens(2, 16, 64, seed=1))
    with torch.no_grad():
        loss = sm(*batch)
    assert len(seen) == 1 and seen[0] is loss


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.fc(x)))


def _ops(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_layers_recompute_layer_ops_but_never_random_draws(mesh2):
    model = nn.Sequential(*[_Block(8) for _ in range(3)])
    x = torch.randn(4, 8, requires_grad=True)
    progs = {}
    for remat in ("none", "layers"):
        progs[remat] = fxshard.shard(model, mesh2, {}, example_inputs=(x,), remat=remat)._training
    aten = torch.ops.aten
    none_bwd, layers_bwd = _ops(progs["none"].bwd.gm), _ops(progs["layers"].bwd.gm)
    assert none_bwd.count(aten.tanh.default) == 0 and layers_bwd.count(aten.tanh.default) == 3
    assert all(torch.Tag.nondeterministic_seeded not in getattr(t, "tags", ()) for t in layers_bwd)
    assert _ops(progs["layers"].fwd.gm).count(aten.native_dropout.default) == 3


class _Blocks(nn.ModuleList):
    pass


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = _Blocks([nn.Linear(8, 8) for _ in range(2)])
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 4), "b": nn.Linear(8, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.heads["a"](x) + self.heads["b"](x)


def test_container_subclasses_and_module_dicts_index_like_the_model(mesh2):
    sm = fxshard.shard(_Heads(), mesh2, {"blocks.*": ColwiseParallel()}, example_inputs=(torch.randn(4, 8),))
    assert len(sm.blocks) == 2 and sm.blocks[1] is list(sm.blocks)[1] and repr(sm.blocks).startswith("_Blocks(")
    assert tuple(sm.blocks[0].weight.shape) == (4, 8)
    assert list(sm.heads) == ["a", "b"] and "b" in sm.heads and sm.heads["b"] is dict(sm.heads.items())["b"]
    with pytest.raises(ShardingError, match="has no module 'c'"):
        sm.heads["c"]
