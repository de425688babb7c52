"""Smoke tests for the test-support helpers: ``dist_utils.run_ranks`` and ``models``."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_utils import RankError, run_ranks
from tests.models import MODEL_CASES, LlamaDecoder, ModelCase, RMSNorm, Transformer, make_tokens

# ----------------------------------------------------------------- rank bodies
# Module level on purpose: run_ranks pickles them by reference.


def _allreduce_body(rank: int, world_size: int, base: float, *, scale: float = 1.0) -> dict:
    t = torch.full((3,), (rank + 1) * base) * scale
    dist.all_reduce(t)
    return {
        "rank": rank,
        "dist_rank": dist.get_rank(),
        "dist_world": dist.get_world_size(),
        "env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]),
        "threads": torch.get_num_threads(),
        "rand": torch.rand(2),  # same on every rank: manual_seed(0) in each child
        "sum": t,
    }


def _inner_failure(rank: int) -> None:
    raise ValueError(f"boom from rank {rank} (sentinel-7f3a)")


def _fail_on_rank1_body(rank: int, world_size: int) -> None:
    if rank == 1:
        _inner_failure(rank)
    dist.barrier()  # rank 0 blocks here until the parent kills it


def _sleep_body(rank: int, world_size: int) -> None:
    time.sleep(600)


def _zombie_children() -> list[int]:
    """PIDs of this process's children in state Z (Linux /proc)."""
    me, zombies = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if fields[0] == "Z" and int(fields[1]) == me:
            zombies.append(int(entry))
    return zombies


# ----------------------------------------------------------------- run_ranks


def test_run_ranks_returns_per_rank_values_in_order() -> None:
    out = run_ranks(_allreduce_body, 2, 2.0, scale=0.5)
    assert [o["rank"] for o in out] == [0, 1]
    assert [o["dist_rank"] for o in out] == [0, 1]
    assert all(o["dist_world"] == 2 for o in out)
    assert [o["env"] for o in out] == [("0", "2", "0"), ("1", "2", "1")]
    assert all(o["threads"] == 1 for o in out)
    # (1*2 + 2*2) * 0.5 = 3 on every rank
    for o in out:
        torch.testing.assert_close(o["sum"], torch.full((3,), 3.0))
    torch.testing.assert_close(out[0]["rand"], out[1]["rand"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="zombie check reads /proc")
def test_run_ranks_child_exception_surfaces_with_traceback_and_rank() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_fail_on_rank1_body, 2, timeout=120)
    elapsed = time.monotonic() - t0
    err = info.value
    assert err.rank == 1
    msg = str(err)
    assert "rank 1 of 2" in msg
    # full traceback: exception type, message, and both frames of the child
    for text in ("ValueError", "sentinel-7f3a", "_inner_failure", "_fail_on_rank1_body"):
        assert text in msg and text in err.child_traceback
    # rank 0 was stuck in a barrier: it must have been killed, not waited for
    assert elapsed < 60, f"took {elapsed:.1f} s; the hung rank was not killed promptly"
    assert _zombie_children() == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="zombie check reads /proc")
def test_run_ranks_timeout_kills_all_ranks(capfd: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"timed out after 6 s.*ranks without a result: \[0, 1\]") as info:
        run_ranks(_sleep_body, 2, timeout=6)
    assert info.value.rank is None
    assert time.monotonic() - t0 < 30
    assert _zombie_children() == []
    assert "Python stacks of hung rank 0" in capfd.readouterr().err


def test_run_ranks_rejects_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_sleep_body, 0)


# -------------------------------------------------------------------- models


def _scalar(out: torch.Tensor) -> torch.Tensor:
    return out if out.dim() == 0 else out.float().pow(2).mean()


# run_decompositions() deep-copies pytree specs, which trips a torch-internal
# deprecation warning (LeafSpec) on torch 2.13; not ours to fix.
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_model_forward_backward_and_export(case: ModelCase) -> None:
    model = case.make_model()
    args = case.make_inputs()

    # deterministic construction: a second build has identical weights
    other = case.make_model()
    for (name, p), (_, q) in zip(model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(p, q), f"{case.name}: {name} differs between two builds"

    out = model(*args)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    if case.returns_loss:
        assert out.dim() == 0
    _scalar(out).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{case.name}: {name} got no gradient"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"{case.name}: {name} grad is zero/non-finite"

    with torch.no_grad():
        expected = model(*args)
        ep = torch.export.export(model, args, strict=False)
        torch.testing.assert_close(ep.module()(*args), expected)
        decomposed = ep.run_decompositions()
        torch.testing.assert_close(decomposed.module()(*args), expected)


def test_transformer_tied_head_is_embedding() -> None:
    tied, untied = Transformer(), Transformer(tie=False)
    assert tied.output.weight is tied.tok_emb.weight
    assert untied.output.weight is not untied.tok_emb.weight
    n_tied = sum(1 for _ in tied.parameters())
    assert n_tied == sum(1 for _ in untied.parameters()) - 1


@pytest.mark.parametrize("make", [Transformer, LlamaDecoder], ids=["transformer", "llama"])
def test_lm_is_causal(make) -> None:
    """Changing the last token changes only the last position's logits."""
    model = make().eval()
    tokens = make_tokens(2, 16, 64, seed=3)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_rmsnorm_matches_torch() -> None:
    norm = RMSNorm(32)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
    x = torch.randn(4, 5, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(norm(x), F.rms_norm(x, (32,), norm.weight, eps=1e-6))


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: c.name)
def test_model_exports_on_meta(case: ModelCase) -> None:
    """fxshard traces with global shapes on meta: the models must allow it."""
    with torch.device("meta"):
        model = case.make_model()
    args = tuple(a.to("meta") for a in case.make_inputs())
    ep = torch.export.export(model, args, strict=False)
    (out,) = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    expected = case.make_model()(*case.make_inputs())
    assert out.meta["val"].shape == expected.shape


def test_llama_meta_build_then_init_rope() -> None:
    with torch.device("meta"):
        model = LlamaDecoder()
    model.to_empty(device="cpu")
    model.init_rope()
    ref = LlamaDecoder()
    assert "rope_cos" not in ref.state_dict()  # non-persistent
    torch.testing.assert_close(model.rope_cos, ref.rope_cos)
    torch.testing.assert_close(model.rope_sin, ref.rope_sin)
