"""Re-tracing an fx graph with ``make_fx`` over functional fake tensors: what the front end's two
``make_fx`` traces share (the forward's decomposition in ``tracing/export.py``, the joint forward +
backward in ``tracing/joint.py``).

``fake_inputs`` makes the inputs of such a trace from a graph's placeholder values: the graph's own
fake tensors when a shape is symbolic (their dims stay symbols of its ShapeEnv), else fresh fake
tensors of a new static mode whose ShapeEnv gives data-dependent sizes unbacked symbols.
``functional_make_fx`` traces on functional tensors (as AOTAutograd does), so in-place ops in the
traced code or in decompositions come out functional. ``named_placeholders`` gives the result the
source graph's placeholder names.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..core.errors import ShardingError
from ..core.ir import source_line
from ..core.torch_compat import (FakeTensorMode, FunctionalTensorMode, ShapeEnv, enable_python_dispatcher,
                           free_unbacked_symbols, make_fx)
from ..core.torch_compat import make_graph_module as _make_graph_module

__all__ = ["fake_inputs", "fake_like", "functional_make_fx", "named_placeholders", "reject_effect_tokens"]


def fake_like(val: Any, mode: FakeTensorMode, contiguous: bool = False) -> Any:
    """A fake tensor of ``mode`` like ``val`` (global shape, same strides, or row-major with ``contiguous``,
    and device): nothing is allocated. A data-dependent size (an unbacked symbol of an earlier trace, e.g.
    ``masked_select``'s) becomes a fresh unbacked symbol of ``mode``. Non-tensors are returned as they are."""
    if not isinstance(val, torch.Tensor):
        return val
    if not free_unbacked_symbols(val.shape):
        with mode:
            if contiguous:
                return torch.empty(val.shape, dtype=val.dtype, device=val.device)
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    env = mode.shape_env
    with env.ignore_fresh_unbacked_symbols():  # an input's symbols: no op binds them
        shape = [env.create_unbacked_symint() if free_unbacked_symbols(s) else s for s in val.shape]
    with mode:
        return torch.empty(shape, dtype=val.dtype, device=val.device)


def fake_inputs(vals: Sequence[Any]) -> tuple[list[Any], FakeTensorMode, str]:
    """Inputs for re-tracing a graph whose placeholders hold ``vals`` (``meta["val"]``), their fake
    mode and the ``make_fx`` tracing mode: ``vals`` themselves and ``"symbolic"`` when any shape is
    symbolic (dynamic dims stay symbols of their ShapeEnv), else copies in a new static mode and
    ``"fake"``."""
    if any(isinstance(v, torch.Tensor) and any(not isinstance(s, int) for s in v.shape) for v in vals):
        mode = next(v.fake_mode for v in vals if isinstance(v, torch.Tensor))
        return list(vals), mode, "symbolic"
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    return [fake_like(v, mode) for v in vals], mode, "fake"


def functional_make_fx(fn: Callable[..., Any], args: Sequence[Any], tracing_mode: str, table: dict) -> fx.GraphModule:
    """``make_fx(fn, tracing_mode, decomposition_table=table)(*args)`` under a functional tensor mode.

    Requires: ``fn`` wraps its tensor arguments with ``to_fun`` and unwraps its results with
    ``from_fun`` (``fxshard.core.torch_compat``). Ensures: a graph without
    in-place ops on its values (mutations of inputs are not written back)."""
    with enable_python_dispatcher(), FunctionalTensorMode(_allow_token_discovery=True):
        return make_fx(fn, tracing_mode=tracing_mode, decomposition_table=table)(*args)


def named_placeholders(gm: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """``gm`` rebuilt with its first placeholders named ``names`` and plain positional inputs; other
    nodes keep their names unless one clashes (then they get a suffix)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    old = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for ph, name in zip(old, names + [n.name for n in old[len(names):]]):
        new = env[ph] = g.placeholder(name)
        new.target = new.name  # the namespace may have suffixed a clashing name
        new.meta = dict(ph.meta)
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])
    return _make_graph_module(gm, g)


def reject_effect_tokens(gm: fx.GraphModule, what: str, without: str) -> None:
    """Raise a ShardingError when the trace of ``what`` ordered an op with side effects by an effect
    token (a ``with_effects`` node fed by an extra placeholder): fxshard's programs do not thread
    tokens. ``without`` says what to compute that part without (gradients, for the training graph)."""
    near = ""  # the user's line of the closest node before it that has one (the token op has none)
    for n in gm.graph.nodes:
        near = source_line(n) or near
        if n.op == "call_function" and n.target is torch.ops.higher_order.with_effects:
            raise ShardingError(
                f"{what} calls {n.args[1]}, an op with side effects (such as the error check of a torch.linalg "
                f"solver) that torch orders through an effect token, which fxshard does not thread through its "
                f"programs [at {near or n.name}]; compute that part without {without} or outside the sharded "
                f"module") from None
