"""fxshard.core.torch_compat: the fallbacks for private torch names missing on some torch of the supported window
compute what the real names compute, and fxshard imports, shards and trains with the new names hidden.

The in-process tests compare each fallback with torch's real function where this torch has it (2.13+) and
with the values the definition gives (every torch). The subprocess test deletes the names from torch
before ``import fxshard`` (as on torch 2.11, which lacks them; torch's own code gets back the two it uses once
fxshard has bound its fallbacks), shards a tiny transformer with its loss,
and checks its programs equal those built with the real names, and its loss and gradients equal eager's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.fx.experimental import symbolic_shapes
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, constrain_range

from fxshard.core import torch_compat as tc

ROOT = Path(__file__).resolve().parent.parent
# the names fxshard uses that some torch of the window lacks, (module, attribute)
NEW_NAMES = (("torch.fx.experimental.symbolic_shapes", "optimization_hint"),
             ("torch._decomp.decompositions", "_softmax_unbacked_safe_amax"),
             ("torch._dynamo.backends.registry", "get_default_backend"))


def _sizes() -> list:
    """Ints, backed and unbacked SymInts (one with a value range, one bounded below only) and expressions."""
    from torch._dynamo.source import ConstantSource

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(6, ConstantSource("s0"), dynamic_dim=DimDynamic.DYNAMIC), hint=6)
    u = env.create_unbacked_symint()
    constrain_range(u, min=2, max=10)
    w = env.create_unbacked_symint()
    constrain_range(w, min=0)
    return [7, s, 2 * s + 3, u, u * s + 1, w, w * s - 2, s * u * w, u + w]


def test_optimization_hint_fallback_matches_torch():
    """Backed symbols at their values, unbacked ones at the fallback clamped to their range."""
    expected = [7, 6, 15, 10, 61, 64, 382, 6 * 10 * 64, 74]
    got = [tc._optimization_hint_fallback(x, fallback=64) for x in _sizes()]
    assert got == expected
    assert tc._optimization_hint_fallback(_sizes()[5]) == 8192  # no fallback: inductor's default guess
    real = getattr(symbolic_shapes, "optimization_hint", None)
    if real is not None:  # torch 2.13+
        assert [real(x, fallback=64) for x in _sizes()] == expected
        assert real(_sizes()[5]) == 8192
        assert tc.optimization_hint is real
    else:
        assert tc.optimization_hint is tc._optimization_hint_fallback


def test_softmax_amax_fallback_matches_torch():
    """``amax(x, dim, keepdim=True)``, and ``-inf`` (not an error) over an empty dim."""
    from torch._decomp import decompositions

    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(3, 5, generator=g), 1), (torch.randn(2, 3, 4, generator=g), -2),
             (torch.randn((), generator=g), 0), (torch.randn(3, 0), 1), (torch.randn(0, 4), 0)]
    real = getattr(decompositions, "_softmax_unbacked_safe_amax", None)
    for x, dim in cases:
        got = tc._softmax_unbacked_safe_amax_fallback(x, dim)
        if x.shape and x.shape[dim] == 0:
            want = torch.full([1 if i == dim % x.ndim else n for i, n in enumerate(x.shape)], float("-inf"))
        else:
            want = torch.amax(x, dim, keepdim=True)
        assert got.shape == want.shape and torch.equal(got, want), (tuple(x.shape), dim)
        if real is not None:
            assert torch.equal(real(x, dim), got)
    assert tc.softmax_unbacked_safe_amax is (real or tc._softmax_unbacked_safe_amax_fallback)


def test_default_backend_fallback(monkeypatch):
    from torch._dynamo.backends import registry

    real = getattr(registry, "get_default_backend", None)
    assert tc.get_default_backend() == (real() if real else "inductor")
    monkeypatch.delattr(registry, "get_default_backend", raising=False)
    assert tc.get_default_backend() == "inductor"


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return 2 * x

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return 3 * g  # not the derivative: shows that this backward ran


def test_classmethod_function_calls_autograd_function_apply():
    """The function behind ``Function.apply`` (a C descriptor from torch 2.14) and behind a Python classmethod."""
    x = torch.ones(2, requires_grad=True)
    apply = tc.classmethod_function(torch.autograd.Function.__dict__["apply"])
    y = apply(_Double, x)
    y.sum().backward()
    assert torch.equal(y, 2 * torch.ones(2)) and torch.equal(x.grad, 3 * torch.ones(2))

    class Named:
        @classmethod
        def name(cls, suffix: str) -> str:
            return cls.__name__ + suffix

    assert tc.classmethod_function(Named.__dict__["name"])(_Double, "!") == "_Double!"


def test_dynamo_safe_function_outputs_is_identity_in_eager():
    outs = [torch.ones(2), None, 3]
    assert tc.dynamo_safe_function_outputs(outs, {0, 1}) is outs


def test_only_the_compat_module_imports_torch_internals():
    """No module but fxshard/core/torch_compat.py imports or names ``torch._*`` internals."""
    pattern = re.compile(r"^\s*(from|import) torch\._|torch\._(decomp|dynamo|inductor|functorch|subclasses|guards|"
                         r"prims_common|C)\b|torch\.testing\._internal|torch\.fx\.experimental|"
                         r"import _pytree|\._fully_shard\b", re.M)
    offenders = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "fxshard").rglob("*.py")
                       if p.name != "torch_compat.py" and pattern.search(p.read_text()))
    assert offenders == []


_CHILD = r"""
import copy, importlib, json, sys
import torch

hidden = {}
for module, attr in NEW_NAMES:
    mod = importlib.import_module(module)
    if sys.argv[1] == "hide" and hasattr(mod, attr):
        hidden[attr] = (mod, getattr(mod, attr))
        delattr(mod, attr)

import fxshard.core.torch_compat as tc

fallbacks = {"optimization_hint": tc.optimization_hint is tc._optimization_hint_fallback,
             "softmax_unbacked_safe_amax": tc.softmax_unbacked_safe_amax is tc._softmax_unbacked_safe_amax_fallback,
             "default_backend": tc.get_default_backend()}
calls = dict.fromkeys(["optimization_hint", "softmax_unbacked_safe_amax"], 0)

def counted(name, fn):
    def call(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return call

import torch.distributed as dist
import fxshard
from fxshard.core import layout
from fxshard.planner import problem, propagate

# the passes bound optimization_hint when fxshard was imported; the softmax decomposition binds its name on use
bound = [m.optimization_hint is tc.optimization_hint for m in (layout, propagate, problem)]
for m in (layout, propagate, problem):
    m.optimization_hint = counted("optimization_hint", m.optimization_hint)
tc.softmax_unbacked_safe_amax = counted("softmax_unbacked_safe_amax", tc.softmax_unbacked_safe_amax)
from fxshard import ColwiseParallel, RowwiseParallel
from tests import models
from tests.conftest import fake_world

# torch's own code (2.13+) uses the first two; fxshard has bound its fallbacks by now. get_default_backend
# stays hidden: fxshard looks it up on each call
for attr in ("optimization_hint", "_softmax_unbacked_safe_amax"):
    if attr in hidden:
        setattr(hidden[attr][0], attr, hidden[attr][1])
hidden = sorted(hidden)

plan = {"tok_emb": RowwiseParallel(), "layers.0.mlp.w1": ColwiseParallel(), "layers.0.mlp.w2": RowwiseParallel(),
        **{f"layers.0.attn.w{p}": ColwiseParallel() for p in "qkv"}, "layers.0.attn.wo": RowwiseParallel()}

def build():
    torch.manual_seed(0)
    return models.Transformer(vocab=64, dim=32, n_heads=4, n_layers=1, max_seq=16)

tokens, targets = models.make_tokens(2, 16, 64, seed=3), models.make_tokens(2, 16, 64, seed=4)
with fake_world(2) as mesh:  # two ranks planned in this process: the programs, no numbers
    sm = fxshard.shard(build(), mesh, plan, example_inputs=(tokens, targets))
    sm(tokens, targets).backward()
    codes = [p.gm.code for p in sm.sharding.programs]
    stats = fxshard.comm_stats(sm)
    del sm

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = build()
ref = copy.deepcopy(model)
sm = fxshard.shard(model, fxshard.init_mesh(tp=1), plan, example_inputs=(tokens, targets))
loss = sm(tokens, targets)
loss.backward()
ref_loss = ref(tokens, targets)
ref_loss.backward()
grads = dict(sm.named_parameters())
grad_err = max((grads[n].grad - p.grad).abs().max().item() for n, p in ref.named_parameters())
dist.destroy_process_group()
print(json.dumps({"hidden": hidden, "fallbacks": fallbacks, "bound": bound, "calls": calls, "codes": codes,
                  "stats": stats,
                  "loss_err": abs(loss.item() - ref_loss.item()), "grad_err": grad_err,
                  "grad_norm": sum(p.grad.norm().item() for p in ref.parameters())}))
"""


def _child(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    code = f"NEW_NAMES = {NEW_NAMES!r}\n" + _CHILD
    proc = subprocess.run([sys.executable, "-c", code, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fxshard_shards_and_trains_with_the_new_names_hidden():
    """``import fxshard`` with torch's new names deleted (torch 2.11's state) takes every fallback, uses
    them while sharding, builds the same programs as with the real names, and its loss and gradients
    are eager's."""
    hide, keep = _child("hide"), _child("keep")
    present = [attr for _, attr in NEW_NAMES if attr not in hide["hidden"]]
    assert present == [] or torch.__version__ < "2.13", present  # 2.13+ has them all: the child hid them
    assert hide["fallbacks"] == {"optimization_hint": True, "softmax_unbacked_safe_amax": True,
                                 "default_backend": "inductor"}
    if torch.__version__ >= "2.13":
        assert keep["fallbacks"]["optimization_hint"] is False
        assert keep["fallbacks"]["softmax_unbacked_safe_amax"] is False
    assert hide["bound"] == [True] * 3
    assert hide["calls"]["optimization_hint"] > 0 and hide["calls"]["softmax_unbacked_safe_amax"] > 0
    assert hide["codes"] == keep["codes"]
    assert hide["stats"] == keep["stats"] and hide["stats"]["forward"]
    for run in (hide, keep):
        assert run["grad_norm"] > 1e-2
        assert run["loss_err"] <= 1e-5 and run["grad_err"] <= 1e-5, run


def test_packed_dtensors_read_strided_shards_as_blocks(mesh2):
    """A packed dim's DTensor (one ``_StridedShard`` on one mesh axis) is built so that DTensor reads the placement
    as blocks split on that axis, not as an order of mesh axes: torch 2.11 read it as an order and refused to
    gather it (``full_tensor()`` of every MoE expert weight raised ValueError; ``scripts/check_torch_window.sh``
    with 2.11 runs the MoE zoo). On every torch of the window the spec says so."""
    from fxshard.core.placements import S
    from fxshard.state.checkpoint import to_dtensor

    dt = to_dtensor(torch.zeros(4, 3), mesh2, [S(0, outer=2)], (8, 3))
    assert getattr(dt._spec, "use_strided_shard_as_shard_order", False) is False
    assert tc.packed_spec(dt._spec) is dt._spec
