"""Optimizer state of a ShardedModule as DTensors, for ``torch.distributed.checkpoint``.

``optim_state_dict(sm, opt)`` keys the state by parameter FQN and presents each
state tensor shaped like its parameter as a DTensor with the parameter's
placements (scalars such as Adam's ``step`` stay plain tensors), so DCP can save
it at one mesh and load it at another. ``load_optim_state_dict`` puts a loaded
one back into the optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .errors import ShardingError

__all__ = ["optim_state_dict", "load_optim_state_dict"]


def _fqn_of(sm: Any) -> dict[int, str]:
    return {id(p): n for n, p in sm.named_parameters()}


def optim_state_dict(sm: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"state": {fqn: {name: DTensor | tensor}}, "param_groups": [...]}`` (see module doc)."""
    names = _fqn_of(sm)
    state: dict[str, dict[str, Any]] = {}
    for p, st in optimizer.state.items():
        if id(p) not in names:
            raise ShardingError("optim_state_dict: the optimizer holds a parameter that is not the module's; "
                                "build it from sm.parameters()")
        fqn = names[id(p)]
        state[fqn] = {k: sm._dtensor(fqn, v.detach()) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                      for k, v in st.items()}
    groups = []
    for g in optimizer.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]})
    return {"state": state, "param_groups": groups}


def load_optim_state_dict(sm: Any, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    """Load an ``optim_state_dict`` (possibly filled by ``dcp.load`` at another mesh) into ``optimizer``."""
    params = dict(sm.named_parameters())
    by_name = {fqn: {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in st.items()}
               for fqn, st in osd["state"].items()}
    with torch.no_grad():
        for fqn, st in by_name.items():
            p = params[fqn]
            cur = optimizer.state[p]
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and k in cur and isinstance(cur[k], torch.Tensor):
                    cur[k].copy_(v)
                else:
                    cur[k] = v.clone() if isinstance(v, torch.Tensor) else v
    for g, saved in zip(optimizer.param_groups, osd["param_groups"]):
        g.update({k: v for k, v in saved.items() if k != "params"})
