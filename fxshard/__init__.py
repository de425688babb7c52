"""fxshard: JAX/GSPMD-style sharding for PyTorch over ATen-level torch.fx graphs."""

from torch.distributed.tensor import Partial, Replicate, Shard

from . import rules as _rules  # noqa: F401  (registers every op rule)
from .frontends.shard import shard
from .frontends.backend import backend, backend_options
from .plans.constrain import constrain
from .tracing.custom_grads import allow_autograd_function
from .core.errors import ShardingError
from .plans.hf import from_hf
from .report.inspect import comm_stats, explain
from .frontends.jit import ShardedFunction, jit
from .frontends.loss import loss_parallel
from .report.memory import memory
from .core.mesh import init_mesh
from .state.optim_state import load_optim_state_dict, optim_state_dict
from .runtime.sharded_module import ShardedModule
from .core.placements import P, Packed
from .state.tiled_init import tiled_init
from .plans.styles import (
    ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "P", "Packed", "Shard", "Replicate", "Partial", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "constrain",
    "ShardingError", "ShardedModule", "init_mesh", "shard", "jit", "ShardedFunction", "memory", "explain", "comm_stats",
    "optim_state_dict", "load_optim_state_dict",
    "backend", "backend_options", "from_hf", "tiled_init", "loss_parallel", "allow_autograd_function",
]
