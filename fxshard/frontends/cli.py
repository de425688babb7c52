"""The ``fxshard`` command line: ``fxshard plan`` (plan a model on one process) and ``fxshard demo``.

``fxshard plan MODEL --mesh tp=8,dp=64 [--plan PLAN] [--auto --memory-budget 80GiB] [--batch N --seq N]`` builds
MODEL (``module:callable``, called under ``torch.device("meta")``; it returns a model,
fed token ids ``(tokens, tokens)`` of ``--batch`` x ``--seq``, or ``(model, example_inputs)``
with a tuple of positional inputs or a dict of keyword inputs, global shapes) and shards it on the fake process group
as rank 0 of the whole mesh, then prints the per-rank memory report, the
collectives per training step and, with ``--explain FILE``, the explain table.
Errors are one line with the fix; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..core.sizes import fmt_bytes
from ..runtime.description import Sharded

__all__ = ["main"]


class CliError(Exception):
    """A user error: printed as one line."""


def _load(ref: str, what: str) -> Any:
    if ":" not in ref:
        raise CliError(f"{what} {ref!r} is not of the form module:attribute (e.g. examples.llama_shapes:llama70b)")
    mod_name, attr = ref.split(":", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise CliError(f"cannot import {what} module {mod_name!r} ({e}); run from the directory that holds it "
                       f"or put it on PYTHONPATH") from e
    if not hasattr(mod, attr):
        raise CliError(f"{what} module {mod_name!r} has no attribute {attr!r}")
    return getattr(mod, attr)


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=64,tp=8"`` -> ``{"dp": 64, "tp": 8}`` (order kept: major axis first)."""
    return _per_axis(text, "--mesh", "size", "dp=64,tp=8",
                     lambda v: int(v) if v.strip().isdigit() and int(v) >= 1 else None)


def _number(v: str) -> Optional[float]:
    try:
        return float(v)
    except ValueError:
        return None


def _per_axis(text: str, flag: str, what: str, example: str, convert: Callable[[str], Any]) -> dict[str, Any]:
    """``"name=value,..."`` -> ``{name: convert(value)}`` in order; a value ``convert`` maps to None is an error."""
    axes: dict[str, Any] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        got = convert(value) if name.isidentifier() else None
        if got is None:
            raise CliError(f"{flag} {text!r}: {part!r} is not name={what}; write e.g. {flag} {example}")
        if name in axes:
            raise CliError(f"{flag} {text!r}: axis {name!r} appears twice")
        axes[name] = got
    return axes


def _why(sm: Sharded) -> dict[tuple[str, str], str]:
    """For each (program, collective kind): the consuming ops, most frequent first."""
    from collections import Counter

    from ..report.inspect import collectives

    out = {}
    for prog in sm.sharding.programs:
        per: dict[str, Counter] = {}
        for c in collectives(prog):
            per.setdefault(c["kind"], Counter())[c["op"].replace("aten.", "")] += 1
        for kind, cnt in per.items():
            out[(prog.label, kind)] = ", ".join(f"{op} x{n}" for op, n in cnt.most_common(4))
    return out


def _max_seq(model: Any) -> Optional[tuple[int, str]]:
    """The longest sequence ``model`` takes and where that is set: ``max_seq``/``max_seq_len`` (fxshard.models,
    torch's test Transformer) or a transformers config's ``max_position_embeddings``; None when it says none."""
    for attr in ("max_seq", "max_seq_len"):
        n = getattr(model, attr, None)
        if isinstance(n, int):
            return n, f"its {attr}"
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return (n, "its config.max_position_embeddings") if isinstance(n, int) else None


def _check_seq(model: Any, seq: int, ref: str) -> None:
    """Requires ``--seq`` within the model's maximum sequence length (a longer one fails deep inside the
    trace, at the rotary or position tables' broadcast)."""
    limit = _max_seq(model)
    if seq < 1 or (limit is not None and seq > limit[0]):
        most = f"at most {limit[0]} ({limit[1]})" if limit is not None else "at least 1"
        raise CliError(f"--seq {seq} does not fit MODEL {ref}: its sequence length must be {most}; pass a --seq "
                       f"within it, or build the model with a longer maximum")


def _token_inputs(model: Any, tokens: Any, train: bool) -> Any:
    """Example inputs of token ids: ``(tokens, tokens)`` (ids and targets) for a plain model; for a transformers
    model (one with a ``config``) the keyword inputs its forward names: ``input_ids``, ``labels`` when training
    (the loss inside), and ``use_cache=False`` (its key/value cache cannot be a sharded program's output)."""
    import inspect

    if getattr(model, "config", None) is None:
        return (tokens, tokens)
    params = inspect.signature(model.forward).parameters
    kwargs = {"input_ids": tokens}
    if train and "labels" in params:
        kwargs["labels"] = tokens
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return kwargs


def plan_command(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..core.placements import P
    from ..core.torch_compat import FakeStore
    from ..report.inspect import comm_stats, explain as explain_of
    from ..report.memory import memory
    from .shard import shard

    axes = parse_mesh(args.mesh)
    bandwidth = args.bandwidth and _per_axis(args.bandwidth, "--bandwidth", "bytes_per_s", "dp=25e9,tp=300e9", _number)
    latency = args.latency and _per_axis(args.latency, "--latency", "seconds", "dp=2e-5,tp=5e-6", _number)
    build = _load(args.model, "MODEL")
    plan = "hf" if args.plan == "hf" else _load(args.plan, "PLAN") if args.plan else None
    plan = plan() if callable(plan) else plan
    t0 = time.time()
    say = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)
    say(f"building {args.model} on the meta device")
    with torch.device("meta"):
        built = build()
    model, inputs = built if isinstance(built, tuple) else (built, None)
    if inputs is None:
        _check_seq(model, args.seq, args.model)
        tokens = torch.zeros(args.batch, args.seq, dtype=torch.long)
        inputs = _token_inputs(model, tokens, args.train)
        described = f"token ids {args.batch} x {args.seq} (--batch, --seq)"
    else:
        if not isinstance(inputs, (tuple, list, dict)):
            raise CliError(f"MODEL {args.model} returned (model, {type(inputs).__name__}); return (model, "
                           f"tuple of positional inputs) or (model, dict of keyword inputs)")
        described = "inputs from MODEL: " + ", ".join(
            f"{k}={list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}"
            for k, v in (inputs.items() if isinstance(inputs, dict) else enumerate(inputs)))
    kwargs = inputs if isinstance(inputs, dict) else {}
    tensor_kwargs = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    inputs = () if isinstance(inputs, dict) else tuple(inputs)
    if not args.train:
        model.requires_grad_(False)
    world = 1
    for s in axes.values():
        world *= s
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", tuple(axes.values()), mesh_dim_names=tuple(axes))
        in_specs = None
        if "dp" in axes:  # every input's dim 0 is the batch, split over dp
            in_specs = tuple(P("dp") for _ in inputs)
            in_specs = (in_specs, {k: P("dp") for k in tensor_kwargs}) if tensor_kwargs else in_specs
        sm = shard(model, mesh, plan, example_inputs=inputs, example_kwargs=kwargs, in_specs=in_specs,
                           progress=say, auto=args.auto, memory_budget=args.memory_budget,
                           bandwidth=bandwidth, latency=latency, planner=args.planner)
        say("computing the memory report")
        mem = memory(sm, args.optimizer)
        stats = comm_stats(sm)
        why = _why(sm)
        explain = explain_of(sm) if args.explain else None
    finally:
        dist.destroy_process_group()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__}, {n_params / 1e9:.3f} B parameters; mesh {axes} ({world} ranks); "
          f"{described}")
    if sm.sharding.auto is not None:
        print("\n" + "\n".join(sm.sharding.auto.lines()))
    print("\nper-rank memory (rank 0):")
    for k, v in mem.items():
        print(f"  {k:<16} {v:>16,d} bytes  ({fmt_bytes(v)})")
    print(f"\ncollectives per {'training step' if args.train else 'forward'}:")
    for prog, table in stats.items():
        for kind, row in sorted(table.items()):
            print(f"  {prog:<9} {kind:<15} count {row['count']:>5}  bytes {row['bytes']:>16,d}  ({fmt_bytes(row['bytes'])})")
            print(f"  {'':<9} {'':<15} needed by: {why.get((prog, kind), '')}")
    if explain is not None:
        with open(args.explain, "w") as f:
            f.write(explain + "\n")
        print(f"\nexplain table written to {args.explain}")
    say("done")
    return 0


def demo_command(args: argparse.Namespace) -> int:
    root = str(Path(__file__).resolve().parents[2])  # the checkout: fxshard/frontends/cli.py -> ../..
    script = os.path.join(root, "examples", "toy_tp_train.py")
    if not os.path.exists(script):
        raise CliError(f"{script} not found: `fxshard demo` runs from a source checkout of fxshard")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script]
    # the ranks import this checkout's fxshard, installed or not (the script's own folder is examples/)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=path)
    return subprocess.call(cmd, env=env)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxshard", description="Plan and inspect GSPMD-style sharding of PyTorch models.")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="shard a model on one process (fake process group) and report")
    pl.add_argument("model", help="module:callable returning the model, or (model, inputs) with inputs a tuple "
                                  "or a dict of keyword inputs (built on meta)")
    pl.add_argument("--mesh", required=True, help="mesh axes, major first, e.g. dp=64,tp=8")
    pl.add_argument("--plan", help="module:attr of a plan dict (or a callable returning one), or hf: a transformers "
                                   "model's own tensor-parallel plan (fxshard.from_hf)")
    pl.add_argument("--batch", type=int, default=8, help="global batch size of the example token ids "
                                                          "(when MODEL returns no inputs)")
    pl.add_argument("--seq", type=int, default=128, help="sequence length of the example token ids "
                                                         "(when MODEL returns no inputs)")
    pl.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                    help="plan the training step (forward + backward); --no-train plans inference only")
    pl.add_argument("--optimizer", default="adamw", help="optimizer whose state the memory report counts")
    pl.add_argument("--explain", metavar="FILE", help="write the explain table to FILE")
    pl.add_argument("--planner", choices=["global", "greedy"], default="global",
                    help="global (default): one MILP over the whole graph, never costlier than the greedy plan; "
                         "greedy: the fast one-pass sweep")
    pl.add_argument("--auto", action="store_true", help="complete the plan (or an empty one) by cost: every "
                    "parameter it leaves out is replicated or split as the solver finds cheapest within --memory-budget")
    pl.add_argument("--memory-budget", metavar="BYTES", help="per-rank memory budget for --auto, e.g. 80GiB "
                    "(parameters, gradients, AdamW state, activation peak estimate)")
    pl.add_argument("--bandwidth", metavar="AXIS=B/S,...", help="link bandwidth per mesh axis in bytes/s, e.g. "
                    "dp=25e9,tp=300e9: the planners move bytes on the fast axes (default: all axes alike)")
    pl.add_argument("--latency", metavar="AXIS=S,...", help="latency per collective per mesh axis in seconds, "
                    "e.g. dp=2e-5,tp=5e-6 (default: 64 KiB worth of each axis's bandwidth)")
    pl.set_defaults(fn=plan_command)
    de = sub.add_parser("demo", help="run the README's main job: 2-rank tensor-parallel training with parity")
    de.set_defaults(fn=demo_command)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:  # noqa: BLE001 - one readable line unless --debug
        if args.debug:
            raise
        from ..core.errors import ShardingError

        kind = "" if isinstance(e, (CliError, ShardingError)) else f"{type(e).__name__}: "
        print(f"fxshard: error: {kind}{e}", file=sys.stderr)
        if not isinstance(e, (CliError, ShardingError)):
            print("fxshard: rerun with --debug for the traceback", file=sys.stderr)
        return 2
