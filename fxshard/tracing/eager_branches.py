"""Model code that branches on ``torch.compiler.is_exporting()``, traced down eager's branch.

fxshard traces a forward with ``torch.export``, but the program it builds runs in PyTorch, as eager
does. Some model code asks ``torch.compiler.is_exporting()`` to serve export targets (ONNX, ExecuTorch,
...) that lack an op, and computes the same thing another way under export. Where that other way is a
Python loop it unrolls into thousands of graph nodes (the sharding time grows with them) and it rounds
differently from eager. For the functions named in ``EAGER_BRANCHES`` fxshard's trace takes eager's branch:
while fxshard exports, ``is_exporting()`` answers False to those functions (directly, or through one
helper such as transformers' ``is_torchdynamo_exporting``) and the truth to every other caller, torch's
own export machinery included (``torch_compat.exporting_hidden_from``).

A function belongs here only when its eager branch traces (no data-dependent Python control flow, no
kernels opaque to fake tensors) and fxshard has a sharding rule for the ops that branch emits. Everything
else that reads the flag (Hugging Face's mask creation, its hub-kernel switch, Mamba's scan choice, torch)
is left alone: there the export branch is what makes the model traceable.
"""

from __future__ import annotations

import contextlib
import re
import types
from dataclasses import dataclass

from ..core.torch_compat import exporting_hidden_from

__all__ = ["EagerBranch", "EAGER_BRANCHES", "takes_eager_branch", "eager_branches"]


@dataclass(frozen=True)
class EagerBranch:
    """A function traced down its eager (not exporting) branch: its name and a regex its module's
    ``__name__`` must match in full, and why its eager branch is the one to trace."""

    function: str
    module: str
    why: str


EAGER_BRANCHES: tuple[EagerBranch, ...] = (
    EagerBranch(
        "torch_chunk_gated_delta_rule", r"transformers\.models\.\w+\.modeling_\w+",
        "Hugging Face's chunked gated delta rule (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid, ...): eager "
        "solves each chunk's unit lower-triangular system with two torch.linalg.solve_triangular calls; under "
        "export it builds the inverse by a 63-step Python loop (chunk size 64 whatever the config), ~3,000 "
        "joint-graph nodes. fxshard has a rule for aten.linalg_solve_triangular (rules/linalg.py)."),
)

_BY_NAME: dict[str, tuple[re.Pattern, ...]] = {}
for _b in EAGER_BRANCHES:
    _BY_NAME[_b.function] = _BY_NAME.get(_b.function, ()) + (re.compile(_b.module),)


def takes_eager_branch(code: types.CodeType, module: str) -> bool:
    """Whether ``code`` (a function's code object, defined in module ``module``) is one of
    ``EAGER_BRANCHES``."""
    patterns = _BY_NAME.get(code.co_name)
    return patterns is not None and any(p.fullmatch(module) for p in patterns)


def eager_branches() -> contextlib.AbstractContextManager:
    """Context manager for fxshard's export of a forward: ``EAGER_BRANCHES`` see
    ``torch.compiler.is_exporting()`` False, every other caller the real flag.

    Ensures: on exit ``torch.compiler.is_exporting`` is restored."""
    return exporting_hidden_from(takes_eager_branch)
