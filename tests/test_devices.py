"""Each rank uses its own device: the CUDA code path of init_mesh, exercised with mocks on CPU."""

from __future__ import annotations

import torch
import torch.distributed as dist

import fxshard
import fxshard.core.mesh as mesh_mod
from fxshard.core.context import ShardContext
from fxshard.core.mesh import MeshInfo
from fxshard.passes.localize import runtime_device


def test_init_mesh_binds_local_rank_gpu_and_nccl(monkeypatch):
    calls = {}
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    state = {"init": False}
    monkeypatch.setattr(dist, "is_initialized", lambda: state["init"])

    def fake_init(backend, **kw):
        calls["backend"] = backend
        calls["timeout"] = kw.get("timeout")
        state["init"] = True

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(mesh_mod, "init_device_mesh",
                        lambda dev, shape, mesh_dim_names: calls.setdefault("mesh", (dev, shape, mesh_dim_names)))
    monkeypatch.setattr(mesh_mod, "set_timeout", lambda mesh, t: calls.setdefault("group_timeout", t))
    fxshard.init_mesh(dp=2, tp=2)
    assert calls["set_device"] == 3  # this rank's own GPU, never cuda:0 for everyone (seed 000)
    assert calls["backend"] == "nccl"
    assert calls["mesh"] == ("cuda", (2, 2), ("dp", "tp"))
    # a collective waits at most DEFAULT_TIMEOUT for its peers, on the world and on every mesh axis's group
    assert calls["timeout"] == calls["group_timeout"] == mesh_mod.DEFAULT_TIMEOUT


def test_runtime_device_is_the_current_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    info = MeshInfo(("tp",), (2,), (1,), ("g",), "cuda", 1)
    assert runtime_device(ShardContext(mesh=info)) == torch.device("cuda", 5)
    assert runtime_device(ShardContext(mesh=MeshInfo(("tp",), (2,), (1,), ("g",), "cpu", 1))) == torch.device("cpu")
