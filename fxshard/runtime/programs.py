"""The programs a ShardedModule runs: ``Program`` (one sharded graph), ``Training`` (the joint graph split into
the forward and backward programs autograd runs), ``Untrainable`` (why a module has no training program) and
``Programs`` (all of them for one combination of module modes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.fx as fx

from ..core.errors import ShardingError
from ..tracing.export import Traced
from .inputs import InputCheck

__all__ = ["Program", "Training", "Untrainable", "Programs"]


@dataclass
class Program:
    """One sharded graph with what explain/comm_stats need to describe it."""

    gm: fx.GraphModule
    label: str
    fallbacks: list[str] = field(default_factory=list)


@dataclass
class Training:
    """The sharded joint graph split into the programs autograd runs."""

    fwd: Program
    bwd: Program
    n_out: int
    diff_out: list[int]
    diff_in: list[int]
    updated: list[int] = field(default_factory=list)  # primals: buffers the forward updates in place
    grad_out: Optional[list[int]] = None  # outputs that need a gradient (None: every one of diff_out)
    reaches: Optional[list[frozenset[int]]] = None  # per diff_in: the grad_out reaching it (None: all)


@dataclass
class Untrainable:
    """Why there is no training program although primals ``diff_in`` want a gradient: a gradient would reach a
    collective the model calls itself (``passes.joint.CollectiveGradient``), which eager autograd cannot
    differentiate either. As in eager, the forward still runs (the inference program); ``error`` is raised by the
    backward of a call whose outputs need a gradient (``autograd_bridge.run_untrainable``)."""

    error: ShardingError
    diff_in: list[int]


@dataclass
class Programs:
    """Everything that runs for one combination of module modes (``training`` of each submodule)."""

    traced: Traced
    forward: Program
    training: Optional[Training]
    input_check: InputCheck
    untrainable: Optional[Untrainable] = None  # set where training is None because no training program exists
