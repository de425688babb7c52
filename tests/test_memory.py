"""Memory: the per-rank report (fake process group, any world size) checked against exact shard sizes
and a real run; meta-device models loaded from safetensors slices without full materialization."""

from __future__ import annotations

import os
import resource
import tempfile
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel
from tests import models
from tests.conftest import fake_world
from tests.dist_utils import run_ranks
from tests.test_forward_parity import transformer_plan
from tests.test_training import llama_megatron_plan

SHARDED = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "tok_embeddings", "output")


def _llama(device: str = "meta") -> torch.nn.Module:
    with torch.device(device):
        return models.LlamaDecoder(vocab=128, dim=64, n_heads=8, n_kv_heads=8, n_layers=2, hidden=128, max_seq=16)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_parameter_bytes_are_exact_shard_sizes(tp):
    model = _llama()
    want = sum(p.numel() * 4 // (tp if any(s in n for s in SHARDED) else 1) for n, p in model.named_parameters())
    with fake_world(tp):
        mesh = torch.distributed.device_mesh.DeviceMesh("cpu", list(range(tp)), mesh_dim_names=("tp",))
        tokens = torch.zeros(2, 16, dtype=torch.long)
        sm = fxshard.shard(model, mesh, llama_megatron_plan(2), example_inputs=(tokens, tokens))
        rep = fxshard.memory(sm, "adamw")
    assert rep["params"] == want
    assert rep["grads"] == want and rep["optimizer"] == 2 * want
    assert rep["forward_peak"] > 0 and rep["backward_peak"] > 0


def _seed002_peak(n_layers: int) -> int:
    model = models.Seed002Model(dim=64, nlayers=n_layers).requires_grad_(False)
    plan = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(n_layers)}
    with fake_world(2) as mesh:
        sm = fxshard.shard(model, mesh, plan, example_inputs=(torch.randn(32, 64),))
        assert fxshard.comm_stats(sm)["forward"]["all_reduce"]["count"] == n_layers // 2
        return fxshard.memory(sm)["inference_peak"]


def test_seed002_collective_buffers_do_not_grow_with_depth():
    assert _seed002_peak(8) == _seed002_peak(2) > 0


def _seed002_as_written_peak(n_layers: int, megatron: bool) -> int:
    """Seed 002 as its author wrote it: its own all_reduce after every layer, parameters requiring grad."""
    model = models.Seed002Model(dim=64, nlayers=n_layers, all_reduce=True)
    plan = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(n_layers)}
    with fake_world(2) as mesh, torch.no_grad():
        sm = fxshard.shard(model, mesh, plan if megatron else {}, example_inputs=(torch.randn(32, 64),))
        reduces = [n for n in sm.sharding.inference.gm.graph.nodes if "all_reduce" in str(n.target)]
        assert len(reduces) >= n_layers  # the model's own run as written (comm_stats counts fxshard's only)
        return fxshard.memory(sm)["inference_peak"]


@pytest.mark.parametrize("megatron", [False, True])
def test_seed002_as_written_collective_buffers_do_not_grow_with_depth(megatron):
    assert _seed002_as_written_peak(8, megatron) == _seed002_as_written_peak(2, megatron) > 0


def test_a_collective_holds_its_input_until_it_is_waited_for():
    """``x`` is read only by an out-of-place all_gather, but the collective holds it until its wait: an
    op issued in between (``y``) runs with ``x`` still allocated. Modelled as freed at the issue, the
    peak would miss ``x`` (and the overlap schedule, which puts work between issue and wait, would look
    cheaper than it is). The wait allocates nothing (it returns the gathered buffer), yet it frees ``x``:
    an op after it (``y2``) runs without ``x``."""
    import torch.fx as fx

    from fxshard.analysis.liveness import liveness_peak

    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    a = g.placeholder("a")
    x = g.call_function(torch.ops.aten.mul.Tensor, (a, 2))
    gathered = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0"))
    y = g.call_function(torch.ops.aten.mul.Tensor, (a, 3))
    w = g.call_function(c10d.wait_tensor.default, (gathered,))
    y2 = g.call_function(torch.ops.aten.mul.Tensor, (y, 4))  # after the wait: x is gone
    g.output((g.call_function(torch.ops.aten.add.Tensor, (w, y2)),))
    sizes = {x: 100, gathered: 200, y: 1000, y2: 5000}
    peak = liveness_peak(fx.GraphModule(torch.nn.Module(), g), lambda n: sizes.get(n, 0))
    assert peak == 200 + 1000 + 5000  # at y2; x (freed at the wait, which allocates nothing) is not counted
    sizes[y2] = 0
    assert liveness_peak(fx.GraphModule(torch.nn.Module(), g), lambda n: sizes.get(n, 0)) == 100 + 200 + 1000


class LiveBytes(TorchDispatchMode):
    """Tracks bytes of storages created by ops while the mode is active; ``peak`` is their maximum.
    Views of the tensors in ``held`` (parameters, inputs: allocated before the program runs) are not
    storages the program creates and are not counted."""

    def __init__(self, held: tuple = ()):
        super().__init__()
        self.held = {t.untyped_storage().data_ptr() for t in held}
        self.live: dict[int, list] = {}  # storage ptr -> [bytes, live tensor objects]
        self.cur = 0
        self.peak = 0

    def _gone(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.cur -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr in self.held:
                    continue
                if ptr not in self.live:
                    self.live[ptr] = [t.untyped_storage().nbytes(), 0]
                    self.cur += self.live[ptr][0]
                    self.peak = max(self.peak, self.cur)
                self.live[ptr][1] += 1
                weakref.finalize(t, self._gone, ptr)
        return out


def _measure(rank: int, world: int) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    model = models.Transformer(vocab=64, dim=64, n_heads=4, n_layers=2, max_seq=32).requires_grad_(False)
    tokens = models.make_tokens(4, 32, 64)
    sm = fxshard.shard(model, mesh, transformer_plan(2), example_inputs=(tokens,))
    with torch.no_grad():
        sm(tokens)  # warm up
        mode = LiveBytes(held=(*sm.parameters(), *sm.buffers(), tokens))
        with mode:
            out = sm(tokens)
        del out
    return {"estimate": fxshard.memory(sm)["inference_peak"], "measured": mode.peak}


def test_estimate_within_20_percent_of_measured_live_bytes():
    for res in run_ranks(_measure, 2):
        assert abs(res["estimate"] - res["measured"]) <= 0.2 * res["measured"], res


def _meta_load(rank: int, world: int, path: str) -> dict:
    mesh = fxshard.init_mesh(tp=world)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.device("meta"):
        model = models.ToyModel(2048, 8192)
    x = torch.randn(4, 2048)
    sm = fxshard.shard(model, mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()}, example_inputs=(x,))
    sm.load_full_state_dict(path)
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    full = models.ToyModel(2048, 8192).state_dict()  # what the checkpoint holds (seeded)
    rows = slice(rank * 4096, (rank + 1) * 4096)
    ok = (torch.equal(sm.net1.weight.detach(), full["net1.weight"][rows])
          and torch.equal(sm.net1.bias.detach(), full["net1.bias"][rows])
          and torch.equal(sm.net2.weight.detach(), full["net2.weight"][:, rows])
          and torch.equal(sm.net2.bias.detach(), full["net2.bias"]))
    return {"growth": growth, "slices_equal": ok, "full_bytes": (2 * 2048 * 8192 + 8192 + 2048) * 4}


def _write_checkpoint(tmp: str, sharded_dir: bool) -> str:
    import json

    from safetensors.torch import save_file

    sd = models.ToyModel(2048, 8192).state_dict()
    if not sharded_dir:
        path = os.path.join(tmp, "model.safetensors")
        save_file(sd, path)
        return path
    a = {k: v for k, v in sd.items() if k.startswith("net1")}
    b = {k: v for k, v in sd.items() if k.startswith("net2")}
    save_file(a, os.path.join(tmp, "a.safetensors"))
    save_file(b, os.path.join(tmp, "b.safetensors"))
    index = {"weight_map": {**{k: "a.safetensors" for k in a}, **{k: "b.safetensors" for k in b}}}
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return tmp


@pytest.mark.parametrize("sharded_dir", [False, True])
def test_meta_model_loads_only_its_slices(sharded_dir):
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_checkpoint(tmp, sharded_dir)
        # fresh processes: ru_maxrss is a per-process high-water mark, which earlier calls would have raised
        for res in run_ranks(_meta_load, 2, path, fresh=True):
            assert res["slices_equal"]
            assert res["growth"] < 0.75 * res["full_bytes"], res


def test_backward_peak_does_not_count_saved_parameters_twice(mesh2):
    from fxshard.analysis.liveness import program_peak
    from fxshard.report.memory import _saved_state

    model = models.ToyModel(16, 4096)
    sm = fxshard.shard(model, mesh2, {"net1": ColwiseParallel(), "net2": RowwiseParallel()},
                       example_inputs=(torch.randn(2, 16),))
    bwd = sm._training.bwd.gm
    placeholders = [n for n in bwd.graph.nodes if n.op == "placeholder"]
    # the backward of net2 reads its weight: that input is parameter memory, not activation memory
    assert {placeholders[i].name for i in _saved_state(sm.sharding)} == {"saved_p_net2_weight"}
    everything = program_peak(bwd, sm._info.sizes, inputs_live=True)
    assert 0 < fxshard.memory(sm)["backward_peak"] <= everything
