"""Which optimizers compute the unsharded model's update on a rank's pieces of split parameters.

A rank holds its piece of every split parameter as a plain tensor, and the optimizer
updates that piece alone. An elementwise optimizer (each element's update reads only
that element's gradient and state: SGD, Adam, AdamW, ...) then computes exactly the
unsharded model's update. One that reads statistics over a whole parameter (a norm,
row or column means, an orthogonalization) or over all parameters computes them over
the piece and silently trains another model. ``check_optimizer`` runs at an
optimizer's first step (from ``optim_state``'s step pre-hook): a known whole-tensor
optimizer holding split parameters raises, an optimizer of a class it does not know
warns once per class.
"""

from __future__ import annotations

import warnings

import torch

from ..core.errors import ShardingError, name_few

__all__ = ["check_optimizer"]

# torch.optim classes whose update of an element reads only that element's gradient and state
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
                         "Rprop", "ASGD", "SparseAdam"})
# torch.optim classes that read statistics over whole parameters: what they compute there
WHOLE_TENSOR = {
    "Adafactor": "the RMS of each whole parameter and of its update, and row and column means of each "
                 "matrix's squared gradient",
    "LBFGS": "dot products over all its parameters' flattened gradients",
    "Muon": "an orthogonalization (Newton-Schulz) of each whole matrix gradient",
}
_WARNED: set[type] = set()


def _torch_class(cls: type) -> type | None:
    """The torch.optim class in the tables above that ``cls`` is or derives from, nearest first."""
    for base in cls.__mro__:
        if base.__module__.startswith("torch.optim") and base.__name__ in ELEMENTWISE | set(WHOLE_TENSOR):
            return base
    return None


def check_optimizer(optimizer: torch.optim.Optimizer, split: dict[str, str]) -> None:
    """Requires: ``split`` maps the FQN of every parameter ``optimizer`` holds that a ShardedModule split
    to how it is split (e.g. ``"S(0) over 'tp'"``). Ensures: returns silently for torch's elementwise
    optimizers or when nothing is split; raises ShardingError for a class that is or derives from a torch
    optimizer reading whole-tensor statistics (Adafactor, LBFGS, Muon); warns once per class for any
    other class (fxshard cannot tell what its step reads)."""
    if not split:
        return
    cls = type(optimizer)
    found = _torch_class(cls)
    base = found.__name__ if found else None
    names = name_few([f"{fqn} ({how})" for fqn, how in split.items()], 3)
    if base in WHOLE_TENSOR:
        raise ShardingError(
            f"{cls.__name__} computes {WHOLE_TENSOR[base]}, but it holds split parameters: {names}; each "
            f"rank would compute those over its piece only and update the model differently from the "
            f"unsharded one. Use an elementwise optimizer (SGD, Adam, AdamW, ...) for the split parameters, or "
            f"leave them out of the plan (replicated), or give this optimizer only replicated parameters")
    if base in ELEMENTWISE and cls is found:
        return
    if cls not in _WARNED:
        _WARNED.add(cls)
        what = f"derives from torch's {base} but may override its step" if base else "is not a torch optimizer"
        warnings.warn(
            f"fxshard: {cls.__name__} {what}, and it holds split parameters ({names}), of which each rank "
            f"holds a piece. If its step reads statistics over a whole parameter (a norm, row or column means, "
            f"an orthogonalization) or over all parameters, each rank computes them over its pieces and the "
            f"model trains differently from the unsharded one; an update that reads each element's gradient "
            f"and state alone (as SGD's and Adam's) is exact", stacklevel=3)
