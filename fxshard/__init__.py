"""fxshard: JAX/GSPMD-style sharding for PyTorch over ATen-level torch.fx graphs."""

from torch.distributed.tensor import Partial, Replicate, Shard

from . import rules as _rules  # noqa: F401  (registers every op rule)
from .api import shard
from .compile import backend, backend_options
from .constrain import constrain
from .custom_grads import allow_autograd_function
from .errors import ShardingError
from .hf import from_hf
from .inspect import comm_stats, explain
from .jit import ShardedFunction, jit
from .loss import loss_parallel
from .memory import memory
from .mesh import init_mesh
from .optim_state import load_optim_state_dict, optim_state_dict
from .module import ShardedModule
from .placements import P, Packed
from .tiled_init import tiled_init
from .styles import (
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
