"""``fxshard.memory``: the per-rank memory of a sharded module, computed without running it.

Parameters, gradients and optimizer state come from the local shard sizes; the activation and
collective-buffer peaks of each program from the liveness analysis in ``analysis/liveness.py``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.fx as fx

from ..analysis.liveness import OPTIMIZER_STATES, local_values, outputs_of, program_peak, value_nbytes
from ..core.errors import ShardingError
from ..core.ir import VIEW_OPS
from ..runtime.description import Sharded, Sharding, sharding_of

__all__ = ["memory"]


def _saved_state(view: Sharding) -> frozenset:
    """Positions of the backward's saved inputs that are parameters/buffers themselves (already in
    ``params``/``buffers``, so not activation memory)."""
    tr = view.training
    fwd_ph = [n for n in tr.fwd.gm.graph.nodes if n.op == "placeholder"]
    state = {n for n, slot in zip(fwd_ph, view.slots) if slot.kind in ("param", "buffer")}
    out = next(n for n in tr.fwd.gm.graph.nodes if n.op == "output")
    saved = list(out.args[0])[tr.n_out:]
    return frozenset(i for i, s in enumerate(saved) if s in state)


def _saved(view: Sharding) -> tuple[int, list[Any]]:
    """Bytes of the activations the training forward saves for the backward on this rank (its inputs,
    parameters and buffers are not counted: they are held anyway), and the saved values (fake, local)."""
    tr = view.training
    gm = tr.fwd.gm
    vals = local_values(gm, view.mesh)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    saved = list(out.args[0])[tr.n_out:]
    owners = set()  # a saved view counts as the storage it views, once
    for s in saved:
        while isinstance(s, fx.Node) and s.op == "call_function" and s.target in VIEW_OPS:
            s = s.args[0]
        if isinstance(s, fx.Node) and s.op != "placeholder":
            owners.add(s)
    return sum(value_nbytes(vals.get(s)) for s in owners), outputs_of(gm, vals)[tr.n_out:]


def memory(sm: Sharded, optimizer: Optional[str] = None) -> dict[str, int]:
    """Per-rank bytes: ``params``, ``grads``, ``optimizer`` (state of the named optimizer: 'sgd',
    'sgd_momentum', 'adam', 'adamw', ...), and the activation/collective-buffer peaks of the
    ``inference`` program and, for training modules, ``saved`` (the activations the forward keeps for
    the backward: what ``shard(..., remat=...)`` trades for recomputation) and the peaks of the
    ``forward`` (with what it saves for the backward) and ``backward`` programs. Works on the fake process group for any world size."""
    if optimizer not in OPTIMIZER_STATES:
        raise ShardingError(f"memory(): unknown optimizer {optimizer!r}; use one of {sorted(k for k in OPTIMIZER_STATES if k)}")
    view = sharding_of(sm, "fxshard.memory")
    if not view.is_module:
        raise ShardingError("fxshard.memory describes a ShardedModule (parameters, gradients, optimizer state); "
                            "for a jitted function use fxshard.explain or fxshard.comm_stats")
    sizes, coords = view.mesh.sizes, view.mesh.coords
    dev = view.mesh.device_type
    params = {id(p): p for p in sm.parameters()}.values()
    pbytes = sum(p.numel() * p.element_size() for p in params)
    gbytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    report = {
        "params": pbytes,
        "buffers": sum(b.numel() * b.element_size() for b in sm.buffers()),
        "grads": gbytes if view.training is not None else 0,
        "optimizer": OPTIMIZER_STATES[optimizer] * gbytes,
        "inference_peak": program_peak(view.inference.gm, sizes, dev, coords=coords),
    }
    if view.training is not None:
        report["saved"], saved = _saved(view)
        report["forward_peak"] = program_peak(view.training.fwd.gm, sizes, dev, coords=coords)
        report["backward_peak"] = program_peak(view.training.bwd.gm, sizes, dev, inputs_live=True, coords=coords,
                                               given=saved,
                                               not_counted=_saved_state(view))
    return report
