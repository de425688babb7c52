"""The rule validator (``python -m fxshard.devtools.validate``): every registered rule's every strategy
matches the unsharded op on simulated ranks, and the validator does catch wrong rules."""

from __future__ import annotations

import pytest
import torch

import fxshard  # noqa: F401  (registers every rule)
from fxshard.rules import registry
from fxshard.core.placements import Part, R, S
from fxshard.rules.registry import Strategy, registered_ops
from fxshard.devtools import validate
from fxshard.rules.embedding import MASKED_EMBEDDING

aten = torch.ops.aten


def test_every_registered_rule_matches_the_unsharded_op():
    reports = validate.validate(sorted(registered_ops(), key=str), ranks=(2, 3))
    no_samples = [r.op for r in reports if r.note]
    assert not no_samples, f"ops without validator samples: {no_samples}"
    bad = [f"{m.op} {m.sample} n={m.ranks}: {m.strategy}: {m.error}" for r in reports for m in r.mismatches]
    assert not bad, "\n".join(bad)
    assert sum(r.checked for r in reports) > 2000


def _swap_rule(monkeypatch, op, rule) -> None:
    monkeypatch.setitem(registry._RULES, op, rule)


def test_validator_catches_a_partial_that_is_not_linear(monkeypatch):
    """``x + y`` with only ``x`` a partial sum counts ``y`` once per rank."""
    _swap_rule(monkeypatch, aten.add.Tensor, lambda call, n: [Strategy((Part("sum"), R), Part("sum"))])
    x, y = torch.randn(6, 5), torch.randn(6, 5)
    checked, bad = validate.check_call(aten.add.Tensor, (x, y))
    assert checked == 1 and len(bad) == 1 and "P(sum)" in bad[0].error


def test_validator_catches_a_split_of_a_reduced_dim(monkeypatch):
    """amax over a split dim is a P(max), not a split."""
    _swap_rule(monkeypatch, aten.amax.default, lambda call, n: [Strategy((S(1),), S(0))])
    checked, bad = validate.check_call(aten.amax.default, (torch.randn(6, 5), [1]))
    assert checked == 1 and len(bad) == 1


def test_validator_catches_a_missing_lowering(monkeypatch):
    """A vocab-split embedding without its masked lookup reads the wrong rows."""
    _swap_rule(monkeypatch, aten.embedding.default, lambda call, n: [Strategy((S(0), R), Part("sum"))])
    w, idx = torch.randn(10, 4), torch.tensor([[0, 9, 3], [5, 4, 1]])
    checked, bad = validate.check_call(aten.embedding.default, (w, idx))
    assert checked == 1 and len(bad) == 1
    _swap_rule(monkeypatch, aten.embedding.default,
               lambda call, n: [Strategy((S(0), R), Part("sum"), lowering=MASKED_EMBEDDING)])
    assert validate.check_call(aten.embedding.default, (w, idx)) == (1, [])


def test_validator_catches_a_shape_error_on_an_uneven_piece(monkeypatch):
    """A strategy that cannot run on some rank's piece is reported, not raised."""
    _swap_rule(monkeypatch, aten.mm.default, lambda call, n: [Strategy((S(1), R), S(1))])
    checked, bad = validate.check_call(aten.mm.default, (torch.randn(4, 5), torch.randn(5, 3)))
    assert checked == 1 and "RuntimeError" in bad[0].error


def test_a_split_into_one_chunk_keeps_an_uneven_piece_whole():
    """``split(x, 5, 1)`` of a dim of 5 split 3/2 over 2 ranks is one chunk: each rank's whole piece, not
    the piece cut at 5 // 2 (which gives rank 0 two chunks)."""
    x = torch.randn(5, 5, 5)
    for op, size in ((aten.split.Tensor, 5), (aten.split.Tensor, 7), (aten.split_with_sizes.default, [5])):
        checked, bad = validate.check_call(op, (x, size, 1), ranks=(2, 3))
        assert checked > 0 and not bad, bad


@pytest.mark.parametrize("p", [R, S(0), S(1), S(1, 2), Part("sum"), Part("max"), Part("min")])
def test_pieces_reassemble(p):
    t = torch.randn(5, 8)
    for n in (2, 3):
        gen = torch.Generator().manual_seed(0)
        pieces = []
        for r in range(n):
            gen.manual_seed(7)  # every rank draws the same Partial terms
            pieces.append(validate.piece(t, p, n, r, gen))
        for whole in validate.assemble(pieces, p):
            assert validate.max_error(whole, t) <= 1e-6


def test_cli_names_ops_and_fails_on_unknown(capsys):
    assert validate.main(["aten.mm.default", "sum.dim_IntList", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 ops" in out and "0 wrong" in out
    with pytest.raises(fxshard.ShardingError, match="not an ATen op overload"):
        validate.main(["aten.no_such_op"])


def test_validator_covers_attention_and_catches_a_split_mask_gradient(monkeypatch, capsys):
    """``fxshard::attention`` and its backward have samples; a learned mask broadcast over the split heads
    has a P(sum) gradient, and claiming it split is caught."""
    from fxshard.devtools.validate_samples import SAMPLES

    assert validate.main(["fxshard.attention", "fxshard.attention_backward.default"]) == 0
    out = capsys.readouterr().out
    assert "2 ops" in out and "0 wrong" in out and "0 without samples" in out
    op = torch.ops.fxshard.attention_backward.default
    good = registry.lookup(op)
    _swap_rule(monkeypatch, op, lambda call, n: [
        Strategy(s.inputs, tuple(S(0) if p == Part() else p for p in s.output)) for s in good(call, n)])
    bad = [m for make in SAMPLES[op] for m in validate.check_call(op, *make(), ranks=(2, 3))[1]]
    assert bad and all("output 3" in m.error for m in bad), bad
