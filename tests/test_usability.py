"""Small things users notice: shard() progress on a terminal (quiet otherwise), and every ``fxshard.*``
name the README and docs/ document exists after ``import fxshard`` (fake process group, no ranks)."""

from __future__ import annotations

import importlib
import os
import re
import sys

import torch

import fxshard
from fxshard import ColwiseParallel, RowwiseParallel
from tests import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md")] + sorted(
    os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


def _shard(mesh, **kw):
    fxshard.shard(models.ToyModel(16, 32), mesh, {"net1": ColwiseParallel(), "net2": RowwiseParallel()},
                  example_inputs=(torch.randn(4, 16),), **kw)


def test_shard_reports_progress_on_a_terminal_only(mesh2, monkeypatch, capsys):
    _shard(mesh2)
    assert capsys.readouterr().err == ""  # not a terminal (tests, logs): quiet
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    _shard(mesh2)
    err = capsys.readouterr().err
    assert re.search(r"fxshard \[ *\d+\.\ds\] tracing the forward", err), err
    _shard(mesh2, progress=False)
    assert capsys.readouterr().err == ""
    said = []
    _shard(mesh2, progress=said.append)
    assert "allocating local shards" in said and capsys.readouterr().err == ""


def test_every_name_the_docs_document_exists():
    text = "".join(open(path).read() for path in DOCS)
    names = sorted(set(re.findall(r"\bfxshard(?:\.[A-Za-z_]\w*)+", text)))
    assert "fxshard.frontends.backend.overlap" in names and "fxshard.tiled_init" in names
    missing = []
    for name in names:
        obj = fxshard
        try:
            for part in name.split(".")[1:]:
                obj = getattr(obj, part)
        except AttributeError:
            try:  # a module run as `python -m fxshard.x.y`
                importlib.import_module(name)
            except ImportError:
                missing.append(name)
    assert not missing, missing


def test_specs_survive_copy_and_pickle():
    """A plan is passed to spawned ranks (pickled) and copied with configs: ``P`` used to unpickle as one
    tuple entry and raise its own 'neither None, a mesh axis name...' ShardingError."""
    import copy
    import pickle

    from fxshard import P
    from fxshard.core.placements import Packed

    plan = {"a": P("tp", None), "b": P(("dp", "tp"), None), "c": P(Packed("tp", 2), None), "d": P()}
    for clone in (copy.deepcopy, lambda v: pickle.loads(pickle.dumps(v))):
        got = clone(plan)
        assert got == plan and all(type(v) is P for v in got.values()), got
