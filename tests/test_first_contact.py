"""Issue 38, a new user's first journeys: data parallelism's gradients and the warning when a split batch is
computed whole, a Hugging Face model that returns its cache, ``fxshard plan --plan hf`` and ``--seq`` past the
model's maximum, and a short default pipeline in ``help(fxshard.shard)``."""

from __future__ import annotations

import copy
import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import fxshard
from fxshard import ColwiseParallel, P, RowwiseParallel, ShardingError
from tests.dist_utils import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _shard_quiet(*args, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = fxshard.shard(*args, progress=False, **kw)
    return sm, [str(w.message) for w in caught if "all-gathered" in str(w.message)]


def _data_parallel(rank: int, world: int) -> dict:
    """On a dp=2 mesh: the three spellings of docs/plans.md's data-parallel section, each against the unsharded
    model's gradients on the global batch."""
    mesh = fxshard.init_mesh(dp=2)
    torch.manual_seed(0)
    model = _mlp()
    out = {}
    x, y = torch.randn(512, 16), torch.randn(512, 8)  # big enough that splitting the batch is the cheap plan
    xl, yl = x.chunk(2)[rank], y.chunk(2)[rank]
    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), y).backward()
    out["ref"] = [p.grad for p in ref.parameters()]
    # the recipe: the loss inside, batch split: the global mean, DDP's gradients, no gather of the batch
    step = fxshard.loss_parallel(copy.deepcopy(model), nn.functional.mse_loss)
    sm, out["inside_warned"] = _shard_quiet(step, mesh, {}, example_inputs=(x, y), in_specs=(P("dp"), P("dp")))
    loss = sm(xl, yl)
    loss.backward()
    out["inside_loss"] = loss.detach()
    out["inside"] = [p.grad for p in sm.parameters()]
    out["inside_comm"] = fxshard.comm_stats(sm)
    # rows out, a per-rank mean outside: the backward sums the ranks' gradients (dp x DDP's)
    sm, out["split_warned"] = _shard_quiet(copy.deepcopy(model), mesh, {}, example_inputs=(x,), in_specs=P("dp"),
                                           out_specs=P("dp"))
    nn.functional.mse_loss(sm(xl), yl).backward()
    out["split"] = [p.grad for p in sm.parameters()]
    # a small batch split in, the default replicated output, the loss outside: the planner gathers the batch
    # (cheaper than reducing the gradients) and every rank computes all of it
    x, y = x[:8], y[:8]
    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), y).backward()
    out["ref_small"] = [p.grad for p in ref.parameters()]
    sm, out["gathered_warned"] = _shard_quiet(copy.deepcopy(model), mesh, {}, example_inputs=(x,), in_specs=P("dp"))
    nn.functional.mse_loss(sm(x.chunk(2)[rank]), y).backward()
    out["gathered"] = [p.grad for p in sm.parameters()]
    out["gathered_explain"] = fxshard.explain(sm)
    return out


def test_data_parallel_gradients_and_the_gathered_batch_warning():
    for res in run_ranks(_data_parallel, 2, timeout=400):
        ref = res["ref"]
        for got, want in zip(res["inside"], ref):  # DDP's gradients exactly
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert "all_gather" not in res["inside_comm"]["forward"], res["inside_comm"]
        assert res["inside_comm"]["backward"]["all_reduce"]["count"] >= 1, res["inside_comm"]
        assert res["inside_warned"] == [] and res["split_warned"] == []
        for got, want in zip(res["split"], ref):  # the sum over the 2 ranks' mean losses: twice DDP's
            torch.testing.assert_close(got, 2 * want, rtol=1e-5, atol=1e-6)
        for got, want in zip(res["gathered"], res["ref_small"]):  # correct, but each rank computed the whole batch
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert len(res["gathered_warned"]) == 1, res["gathered_warned"]
        said = res["gathered_warned"][0]
        assert "split on mesh axis 'dp' by in_specs, but all-gathered over 'dp'" in said, said
        assert "fxshard.loss_parallel" in said and "out_specs" in said, said
        assert "note: input" in res["gathered_explain"] and "all-gathered over 'dp'" in res["gathered_explain"]


def test_hf_model_returning_its_cache_says_use_cache_false(mesh2):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ShardingError, match=r"returns a DynamicCache .*config.use_cache is True.*pass use_cache=False "
                                            r"in example_kwargs and in every call, or set model.config.use_cache"):
        fxshard.shard(model, mesh2, "hf", example_kwargs={"input_ids": ids, "labels": ids}, progress=False)


def _hf_use_cache_false(rank: int, world: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = fxshard.init_mesh(tp=2)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    ids = torch.randint(0, 64, (2, 8))
    ref = copy.deepcopy(model)
    want = ref(input_ids=ids, labels=ids, use_cache=False).loss
    want.backward()
    sm = fxshard.shard(model, mesh, "hf", example_kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
                       progress=False)
    got = sm(input_ids=ids, labels=ids, use_cache=False).loss
    got.backward()
    grads = {n: p.grad for n, p in sm.named_parameters()}
    return dict(got=got.detach(), want=want.detach(), grads=grads,
                ref={n: p.grad for n, p in ref.named_parameters()}, placements=dict(sm.sharding.placements))


def test_hf_model_trains_with_use_cache_false_passed_as_a_keyword():
    pytest.importorskip("transformers")
    from fxshard.core.placements import S

    res = run_ranks(_hf_use_cache_false, 2, timeout=400)
    for rank, r in enumerate(res):
        torch.testing.assert_close(r["got"], r["want"], rtol=1e-5, atol=1e-6)
        split = 0
        for name, g in r["grads"].items():
            want = r["ref"][name]
            pl = r["placements"][name][0]
            if isinstance(pl, S):
                want, split = want.chunk(2, pl.dim)[rank], split + 1
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=name)
        assert split >= 7  # the hf plan split the attention and MLP projections


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "fxshard", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=400)


def test_cli_plan_hf_and_a_seq_past_the_model_maximum():
    r = _cli("plan", "examples.llama_shapes:llama_tiny", "--mesh", "tp=2", "--plan", "examples.llama_shapes:PLAN",
             "--seq", "64")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1:] == [
        "fxshard: error: --seq 64 does not fit MODEL examples.llama_shapes:llama_tiny: its sequence length must be "
        "at most 16 (its max_seq); pass a --seq within it, or build the model with a longer maximum"], r.stderr
    pytest.importorskip("transformers")
    r = _cli("plan", "examples.llama_shapes:hf_llama_tiny", "--mesh", "tp=2", "--plan", "hf", "--seq", "8",
             "--batch", "2", "--no-train")
    assert r.returncode == 0, r.stderr
    assert "forward   all_reduce" in r.stdout, r.stdout
    r = _cli("plan", "examples.llama_shapes:hf_llama_tiny", "--mesh", "tp=2", "--plan", "hf", "--seq", "65")
    assert r.returncode == 2 and "(its config.max_position_embeddings)" in r.stderr, r.stderr


def test_help_shows_a_short_default_pipeline():
    from fxshard.passes.pipeline import DEFAULT

    for fn in (fxshard.shard, fxshard.jit):
        sig = str(inspect.signature(fn))
        assert "pipeline: 'Pipeline' = fxshard.passes.pipeline.DEFAULT" in sig and len(sig) < 1200, sig
    assert repr(DEFAULT.without("overlap")) == \
        "Pipeline(propagate, solve, redistribute, localize, emit, bucket, inplace)"


class _SeqMix(nn.Module):
    """A running sum over the sequence (dim 1) before a linear layer: a sequence split must be gathered first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x.cumsum(1))


def test_gathered_input_warning_is_for_split_batches_not_sequence_splits(mesh2):
    """An input split on its sequence dim and gathered before a running sum is sequence parallelism working
    as meant: no warning (it said 'every rank computes with the whole of it' before)."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8)
    seq, seq_warned = _shard_quiet(_SeqMix(), mesh2, {}, example_inputs=(x,), in_specs=P(None, "tp"))
    gathered = [c for c in fxshard.report.inspect.collectives(seq.sharding.programs[0])
                if c["kind"] == "all_gather" and c["value"] == "x"]
    assert gathered, "the test needs the sequence-split input gathered"
    assert seq_warned == [], seq_warned  # sequence parallelism working as meant
    # (a gathered split batch still warns: test_data_parallel_gradients_and_the_gathered_batch_warning)
