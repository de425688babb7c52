"""Training step time, like for like: fxshard vs hand-written Megatron TP (eager and compiled) vs DTensor.

    .venv/bin/python benchmarks/step_time.py [--quick] [--rounds 10] [--steps 3] [--only NAME] [--no-compile]

Model: torch's test Transformer (``common_dtensor.Transformer``; dim 256, 8 heads, 4 layers, vocab
1024, max_seq_len 64, dropout 0), batch 4 x 64 tokens per tensor-parallel group, fp32. One step =
forward + cross entropy + backward + AdamW step + zero_grad.

Cases (every contender of a case runs the same plan on the same weights):

* plan ``layers``: ``wq/wk/wv/w1`` column-parallel, ``wo/w2`` row-parallel; embeddings, final norm
  and head whole on every rank. Plan ``full``: also vocab-parallel token/position embeddings and a
  column-parallel head (logits gathered when the loss is outside; with the loss inside, fxshard
  derives loss parallelism and Megatron runs its vocab-parallel cross entropy on the local logits).
* ``tied``/``untied`` embedding and head; loss ``outside`` the module (it returns logits) or
  ``inside`` (``forward(tokens, targets)`` returns the loss).
* ``tp2``: 2 gloo ranks, tp=2; ``dp2xtp2``: 4 ranks, a 2x2 mesh, the batch split on dp (8 x 64
  global), against Megatron TP + ``torch.nn.parallel.DistributedDataParallel`` over dp; fxshard's
  default (global) planner makes exactly Megatron + DDP's collectives there (``tests/test_solve.py``).

Contenders: ``fxshard`` (``fxshard.shard``), ``megatron`` (``benchmarks/megatron.py``: weights
sliced by hand, explicit collectives in autograd pairs; + DDP on the 2x2 mesh), ``dtensor``
(``Transformer.parallelize(..., local_output_for_attn=True)``: DTensor's own plan, which is the
``full`` plan; in the ``full``/``outside`` cases), ``fxshard-nobucket`` on the 2x2 mesh
(``bucket_mb=None``: one gradient all-reduce per parameter; the greedy planner, for the same plan), ``fxshard-nooverlap`` in every case
(``pipeline=DEFAULT.without("overlap")``: collectives not scheduled for overlap), and in the cases marked compiled
``fxshard-compiled`` / ``megatron-compiled`` (``torch.compile`` of the same modules, inductor with
``fxshard.frontends.backend.INDUCTOR_OPTIONS``: no peak-memory reordering, which would undo fxshard's overlap schedule).

Method: each case builds its contenders from seed 0, runs 2 steps (warm-up and compilation; their
losses must agree), then ``--rounds`` rounds; a round runs every contender for ``--steps`` steps
after a barrier, in an order rotated each round; a round's value is the slower rank's mean step
time. Also printed: what one blocking gloo collective costs between 2 ranks here (all_reduce of 1
float, 16 floats, one activation; a send/recv round trip), the floor under every contender's step.
Reported per case: medians over rounds and ratios as medians of per-round ratios. Writes
``benchmarks/results/step_time.json``. ``--quick``: 3 rounds x 2 steps, no compiled contenders.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from dataclasses import asdict, dataclass

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import interleaved, machine, median, ratio_median, table, write_json  # noqa: E402

CONFIG = dict(dim=256, n_heads=8, n_layers=4, vocab_size=1024, max_seq_len=64, batch=4, seq=64)
PARITY_STEPS = 2
PARITY_TOL = 1e-3  # on losses ~7: catches a missing collective or a wrong gradient, not reduction order


@dataclass(frozen=True)
class Case:
    plan: str  # "layers" | "full"
    tied: bool
    loss: str  # "outside" | "inside"
    mesh: str = "tp2"  # "tp2" | "dp2xtp2"
    compiled: bool = False

    @property
    def name(self) -> str:
        return f"{self.mesh}/{self.plan}/{'tied' if self.tied else 'untied'}/loss-{self.loss}"

    @property
    def contenders(self) -> list[str]:
        out = ["fxshard", "megatron"]
        if self.plan == "full" and self.loss == "outside" and self.mesh == "tp2":
            out.append("dtensor")
        if self.mesh == "dp2xtp2":
            out.append("fxshard-nobucket")  # bucket_mb=None: one all-reduce per gradient, as before buckets
        if self.compiled:
            out += ["fxshard-compiled", "megatron-compiled"]
        out.append("fxshard-nooverlap")  # DEFAULT.without("overlap"): every collective right before its consumer
        return out


CASES = [
    Case("layers", False, "outside", compiled=True),
    Case("layers", True, "outside"),
    Case("layers", False, "inside"),
    Case("layers", True, "inside"),
    Case("full", False, "outside"),
    Case("full", True, "outside"),
    Case("full", False, "inside"),
    Case("full", True, "inside"),
    Case("layers", False, "outside", mesh="dp2xtp2"),
    Case("full", True, "inside", mesh="dp2xtp2"),
]
CASE_PROFILED = CASES[0]  # the case benchmarks/profile_step.py takes apart


def plan_for(kind: str) -> dict:
    """The fxshard plan of a case (``torch_transformer_plan(False)`` for ``full``, with the head's
    logits left split so a loss inside the module runs loss-parallel)."""
    from fxshard import ColwiseParallel, Replicate, RowwiseParallel

    plan: dict = {}
    for p in ("wq", "wk", "wv"):
        plan[f"layers.*.attention.{p}"] = ColwiseParallel()
    plan["layers.*.attention.wo"] = RowwiseParallel()
    plan["layers.*.feed_forward.w1"] = ColwiseParallel()
    plan["layers.*.feed_forward.w2"] = RowwiseParallel()
    if kind == "full":
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        plan["pos_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        plan["output"] = ColwiseParallel()
    return plan


def make_model(cfg: dict, tied: bool, loss_inside: bool):
    """torch's test Transformer from seed 0 (``forward(tokens, targets) -> loss`` when ``loss_inside``)."""
    import torch
    import torch.nn.functional as F
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    class TransformerWithLoss(Transformer):
        def forward(self, tokens, targets):  # type: ignore[override]
            return F.cross_entropy(super().forward(tokens).flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    args = ModelArgs(n_layers=cfg["n_layers"], vocab_size=cfg["vocab_size"], max_seq_len=cfg["max_seq_len"],
                     dim=cfg["dim"], n_heads=cfg["n_heads"], dropout_p=0.0, weight_tying=tied)
    return (TransformerWithLoss if loss_inside else Transformer)(args)


def build(name: str, case: Case, mesh, cfg: dict, example):
    """``(step, module)`` for one contender: ``step(x, y) -> loss`` (a tensor) on this rank's batch ``x, y``:
    the global-batch mean with fxshard's loss inside, this rank's batch mean otherwise."""
    import torch
    import torch.nn.functional as F
    from torch.testing._internal.distributed._tensor.common_dtensor import Transformer

    import fxshard
    from benchmarks.megatron import MegatronTransformer
    from fxshard import P

    inside = case.loss == "inside"
    two_d = case.mesh == "dp2xtp2"
    base = name.replace("-compiled", "").replace("-nobucket", "").replace("-nooverlap", "")
    model = make_model(cfg, case.tied, inside)
    if base == "fxshard":
        kw: dict = {}
        if two_d:
            kw = dict(in_specs=(P("dp"), P("dp")) if inside else (P("dp"),), out_specs=None if inside else P("dp"))
        if name.endswith("-nobucket"):  # the same plan, one all-reduce per gradient; left to the global planner,
            kw.update(bucket_mb=None, planner="greedy")  # a latency per gradient makes it gather the batch
        if name.endswith("-nooverlap"):
            from fxshard.passes.pipeline import DEFAULT
            kw["pipeline"] = DEFAULT.without("overlap")
        mod = fxshard.shard(model, mesh, plan_for(case.plan), example_inputs=example if inside else example[:1], **kw)
    elif base == "dtensor":
        mod = Transformer.parallelize(model, mesh, use_seq_parallel=False, local_output_for_attn=True)
    else:
        tp = mesh["tp"] if two_d else mesh
        mod = MegatronTransformer(model, tp.get_local_rank(), tp.size(), group=tp.get_group(),
                                  shard_vocab=case.plan == "full")
        if two_d:
            mod = torch.nn.parallel.DistributedDataParallel(mod, process_group=mesh["dp"].get_group())
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
    run = mod
    if name.endswith("-compiled"):  # both compiled contenders: inductor with the options that keep fxshard's
        from fxshard.frontends.backend import INDUCTOR_OPTIONS  # overlap schedule (no peak-memory reordering)

        run = torch.compile(mod, options=dict(INDUCTOR_OPTIONS))
    # fxshard's gradients are those of the global-batch mean loss; DDP averages the dp ranks' local
    # mean-loss gradients: the same thing when the fxshard loss outside is divided by dp
    scale = 1.0 / mesh["dp"].size() if (two_d and base == "fxshard" and not inside) else 1.0

    def step(x, y):
        if inside:
            loss = run(x, y)
            shown = loss
        else:
            shown = F.cross_entropy(run(x).flatten(0, 1), y.flatten())
            loss = shown * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return shown.detach()

    return step, mod


def _rank_main(rank: int, world: int, cfg: dict, cases: list[dict], rounds: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    import fxshard

    out = {}
    for cd in cases:
        case = Case(**cd)
        two_d = case.mesh == "dp2xtp2"
        mesh = fxshard.init_mesh(dp=2, tp=2) if two_d else fxshard.init_mesh(tp=world)
        dp, dp_rank = (2, mesh.get_coordinate()[0]) if two_d else (1, 0)
        g = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(4):
            x = torch.randint(0, cfg["vocab_size"], (cfg["batch"] * dp, cfg["seq"]), generator=g)
            y = torch.randint(0, cfg["vocab_size"], (cfg["batch"] * dp, cfg["seq"]), generator=g)
            batches.append((x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]))
        example = tuple(torch.zeros(cfg["batch"] * dp, cfg["seq"], dtype=torch.long) for _ in range(2))
        names = case.contenders
        built, build_s = {}, {}
        for n in names:
            t0 = time.perf_counter()
            built[n] = build(n, case, mesh, cfg, example)[0]
            build_s[n] = time.perf_counter() - t0
        counters = {n: 0 for n in names}

        def step(n: str):
            x, y = batches[counters[n] % len(batches)]
            counters[n] += 1
            return built[n](x, y)

        def global_loss(n: str, loss) -> float:
            """The global-batch mean loss (Megatron + DDP's inside loss is its dp rank's batch mean)."""
            if two_d and case.loss == "inside" and n.startswith("megatron"):
                loss = loss.clone()
                dist.all_reduce(loss, group=mesh["dp"].get_group())
                loss /= dp
            return loss.item()

        first_s = {}
        parity = {}
        for n in names:
            t0 = time.perf_counter()
            parity[n] = [global_loss(n, step(n)) for _ in range(PARITY_STEPS)]
            first_s[n] = time.perf_counter() - t0

        def timed(n: str):
            def run() -> float:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(n)
                return (time.perf_counter() - t0) / steps
            return run

        times = interleaved({n: timed(n) for n in names}, rounds)
        out[case.name] = {"times": times, "parity": parity, "build_s": build_s, "first_steps_s": first_s}
        del built
        gc.collect()
        torch._dynamo.reset()
    return out


def _collective_latency(rank: int, world: int, cfg: dict, reps: int = 100) -> dict:
    """Milliseconds per blocking gloo ``all_reduce`` of 1 float, 16 floats and one activation
    (batch x seq x dim floats: what tensor parallelism reduces), and per send/recv round trip between
    ranks 0 and 1. Requires ``world == 2``."""
    import torch
    import torch.distributed as dist

    def per_call(fn) -> float:
        for _ in range(5):
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e3

    out = {}
    for n in (1, 16, cfg["batch"] * cfg["seq"] * cfg["dim"]):
        x = torch.zeros(n)
        out[f"all_reduce {n} floats"] = per_call(lambda: dist.all_reduce(x))
    x = torch.zeros(1)

    def round_trip():
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)

    out["send/recv round trip"] = per_call(round_trip)
    return out


RATIOS = [("fxshard", "megatron"), ("fxshard-nooverlap", "megatron"), ("fxshard", "fxshard-nooverlap"),
          ("fxshard-nobucket", "megatron"), ("fxshard", "dtensor"), ("fxshard-compiled", "megatron-compiled"),
          ("fxshard-compiled", "megatron"), ("megatron-compiled", "megatron"), ("dtensor", "megatron")]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds x 2 steps, no compiled contenders")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per case (default 10; 3 with --quick)")
    ap.add_argument("--steps", type=int, default=None, help="steps per contender per round (default 3; 2 with --quick)")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled contenders")
    ap.add_argument("--no-json", action="store_true", help="do not write benchmarks/results/step_time.json")
    a = ap.parse_args(argv)
    rounds = a.rounds or (3 if a.quick else 10)
    steps = a.steps or (2 if a.quick else 3)
    cases = [c for c in CASES if a.only in c.name]
    if a.quick or a.no_compile:
        cases = [Case(**{**asdict(c), "compiled": False}) for c in cases]

    from benchmarks import step_time as me  # so the ranks import the function by module name
    from tests.dist_utils import run_ranks

    t0 = time.perf_counter()
    info = machine()
    res: dict = {}
    for world, mesh in ((2, "tp2"), (4, "dp2xtp2")):
        mine = [asdict(c) for c in cases if c.mesh == mesh]
        if mine:
            ranks = run_ranks(me._rank_main, world, CONFIG, mine, rounds, steps, timeout=3600)
            res.update({name: [rk[name] for rk in ranks] for name in ranks[0]})
    latency = run_ranks(me._collective_latency, 2, CONFIG, timeout=600)[0]
    wall = time.perf_counter() - t0

    print(f"torch test Transformer: dim {CONFIG['dim']}, {CONFIG['n_heads']} heads, {CONFIG['n_layers']} layers, "
          f"vocab {CONFIG['vocab_size']}, batch {CONFIG['batch']}x{CONFIG['seq']} per tp group, fp32; gloo, 1 thread "
          f"per rank; {rounds} rounds x {steps} steps per contender, interleaved; load average at start "
          f"{info['load_avg_at_start'][0]:.1f}")
    out_cases = {}
    rows = []
    failed: list[str] = []
    for case in cases:
        ranks = res[case.name]
        names = case.contenders
        per_round = {n: [max(r["times"][n][i] for r in ranks) for i in range(rounds)] for n in names}
        med = {n: median(v) for n, v in per_round.items()}
        ratios = {f"{a_}/{b_}": ratio_median(per_round[a_], per_round[b_]) for a_, b_ in RATIOS
                  if a_ in names and b_ in names}
        par = ranks[0]["parity"]
        parity_err = max(abs(u - v) for n in names for u, v in zip(par[n], par["megatron"]))
        if parity_err > PARITY_TOL:
            failed.append(f"{case.name}: the contenders' losses differ by {parity_err:.2e}: {par}")
        out_cases[case.name] = {"case": asdict(case), "contenders": names, "median_s": med, "per_round_s": per_round,
                                "ratios": ratios, "parity_max_loss_diff": parity_err, "parity_losses": par,
                                "setup_s": ranks[0]["build_s"], "first_steps_s": ranks[0]["first_steps_s"]}
        rows.append([case.name] + [f"{med[n] * 1e3:.1f}" if n in med else "-" for n, _ in _COLS]
                    + [f"{ratios[k]:.2f}" if k in ratios else "-" for k in _RATIO_COLS] + [f"{parity_err:.1e}"])
    print(table(rows, ["case"] + [h for _, h in _COLS] + _RATIO_COLS + ["loss diff"]))
    print("ms: median step time; ratios: median of per-round ratios (a/b < 1: a is faster)")
    print("gloo between 2 ranks, ms per call: " + ", ".join(f"{k} {v:.2f}" for k, v in latency.items()))
    print(f"wall time {wall:.1f} s")
    out = {"config": CONFIG, "rounds": rounds, "steps_per_round": steps, "machine": info, "cases": out_cases,
           "collective_latency_ms": latency, "wall_s": wall}
    if not a.no_json:
        print(f"wrote {write_json('step_time.json', out)}")
    if failed:
        raise SystemExit("parity failed (times are not comparable):\n" + "\n".join(failed))
    return out


_COLS = [("fxshard", "fxshard ms"), ("megatron", "megatron ms"), ("dtensor", "dtensor ms"),
         ("fxshard-compiled", "fx-comp ms"), ("megatron-compiled", "meg-comp ms")]
_RATIO_COLS = ["fxshard/megatron", "fxshard-nooverlap/megatron", "fxshard/fxshard-nooverlap", "fxshard-nobucket/megatron",
               "fxshard/dtensor", "fxshard-compiled/megatron-compiled", "fxshard-compiled/megatron"]


if __name__ == "__main__":
    main()
