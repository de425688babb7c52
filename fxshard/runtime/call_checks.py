"""The checks a ShardedModule's call runs before its programs, as named functions: each raises a ShardingError
saying what was given, why it would not compute what eager computes, and how to fix it.

``ShardedModule.forward`` runs, in order: ``refuse_transforms`` (a torch.func transform around the call),
``refuse_dual_tensors`` (forward-mode AD tangents), ``refuse_parametrized_since`` (a parametrization added on a
stand-in after ``shard()``), then ``check_filled`` (meta-built tensors never written) and, once, ``check_pieces``
(split parameters written alike on every rank); its feed runs ``call_leaves`` (the call's structure, tensors and
specialized constants against the example's), ``local_error`` (a parameter/buffer whose local dtype or shape
changed) and ``refuse_untraced_input_grads`` (an input requiring a gradient no program gives)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.nn as nn
from torch.autograd import forward_ad as _forward_ad
from torch.nn.utils.parametrize import is_parametrized
from ..core.torch_compat import pytree

from ..comm.replicas import check_pieces_differ, holds_sentinel
from ..core.errors import ShardingError, name_few
from ..core.torch_compat import peek_interpreter_stack
from ..state.sharded_state import ParameterLayout
from ..tracing.export import Traced
from .sources import SHARED
from .state_interop import one_value, written_state

__all__ = ["MODULE_FIX", "refuse_transforms", "refuse_dual_tensors", "refuse_parametrized_since", "check_filled",
           "check_pieces", "call_leaves", "local_error", "refuse_untraced_input_grads"]

Lookup = Callable[[str], torch.Tensor]  # a module's tensor by FQN (``state_interop.tensor_at``)


def refuse_transforms(where: str) -> None:
    """Raise if the module ``where`` names is called under a torch.func transform (grad, vmap, ...). Outside
    TorchDynamo only: under it the stack is a traced value, never None (a transform around a compiled module is
    not seen)."""
    if not torch.compiler.is_compiling() and peek_interpreter_stack() is not None:
        raise ShardingError(
            f"{where} was called under a torch.func transform (grad, vmap, jacrev, ...): it runs its "
            f"sharded programs as one autograd step that such transforms cannot see into, so they would fail "
            f"or compute something else. Shard the whole computation with fxshard.jit (torch.func inside the "
            f"function, as for a gradient penalty), or apply the transform to the unsharded model")


def refuse_dual_tensors(where: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise if, inside a dual level (``fwAD.dual_level()``) and outside TorchDynamo, a call argument, parameter or
    buffer of ``module`` carries a forward-mode AD tangent (``torch.autograd.forward_ad.make_dual``)."""
    if torch.compiler.is_compiling() or _forward_ad._current_level < 0:
        return
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    tensors += [*module.parameters(), *module.buffers()]
    if any(_forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise ShardingError(
            f"{where} was called with a forward-mode AD tangent (torch.autograd.forward_ad.make_dual): "
            f"forward-mode AD through a ShardedModule is not supported, as each rank's program would carry "
            f"only its part of the tangent through the collectives and return a wrong one. Shard the whole "
            f"computation with fxshard.jit of a function that calls torch.func.jvp (torch.func.functional_call "
            f"of the model inside), or take the JVP of the unsharded model")


def refuse_parametrized_since(where: str, homes: Iterable[tuple[str, nn.Module, str]],
                              how_split: Callable[[str], str]) -> None:
    """Raise if a parameter or buffer, registered at ``homes`` (``(fqn, owner, attribute)``) by ``shard()``, was made
    parametrized (``torch.nn.utils.parametrize``) on its stand-in since: it is no longer registered there.
    Outside TorchDynamo only."""
    if torch.compiler.is_compiling():
        return
    for fqn, owner, leaf in homes:
        if leaf not in owner._parameters and leaf not in owner._buffers and is_parametrized(owner, leaf):
            how = how_split(fqn)
            raise ShardingError(
                f"{where}: {fqn} was parametrized after shard() (torch.nn.utils.parametrize: weight_norm, "
                f"spectral_norm, orthogonal, ...). On the ShardedModule the parametrization computes from this rank's "
                f"tensors{f' ({fqn} is split {how})' if how else ''}, so a norm or a spectral norm would be that of "
                f"a piece, not of the full tensor, and the model would compute something else than the unsharded "
                f"one. Register the parametrization on the model before shard() (a parametrized weight is sharded by "
                f"its computed value and trains as in eager)")


def check_filled(where: str, unfilled: Mapping[str, tuple[int, int]], lookup: Lookup) -> None:
    """Raise if a parameter/buffer created on meta was never written: ``unfilled`` maps its FQN to the id and
    version of the tensor ``shard()`` made for it, and ``lookup(fqn)`` is the tensor registered now."""
    empty = [n for n, (ident, version) in unfilled.items()
             if id(t := lookup(n)) == ident and t._version == version and holds_sentinel(t)]
    if empty:
        raise ShardingError(
            f"{where} was called before {len(empty)} of its {len(unfilled)} parameters/buffers "
            f"were filled: {name_few(empty, 8)} came from a model built on the meta device and were "
            f"never initialized or loaded, so they hold no values. Fill them first: sm.init_parameters(fn), "
            f"sm.load_full_state_dict(path_or_state_dict), dcp.load(sm.sharded_state_dict(), ...), or "
            f"in-place writes to sm's tensors (with torch.no_grad(): p.copy_(...), nn.init.*_(p))"
        )


def check_pieces(where: str, watch: Mapping[str, Optional[tuple[int, int, list]]], lookup: Lookup,
                 layout: ParameterLayout) -> None:
    """Raise if every rank of a mesh axis wrote a split parameter's piece in place with the same values (not one
    constant) since ``watch`` (FQN -> ``state_interop.written_state`` of its piece then) was taken, other than
    through fxshard's fills: ``nn.init.*_(p)`` on the pieces with one seed everywhere. A collective: every rank
    calls it with the same names."""
    written = {}
    for n, before in watch.items():  # the same names on every rank: what each wrote may differ
        t = lookup(n)
        now = written_state(t)
        if before is not None and now is not None and now[0] == before[0] and now != before \
                and not one_value(t):
            written[n] = t
    check_pieces_differ(
        written, {n: layout.split_axes(n) for n in watch}, layout.mesh,
        f"{where} was called after split parameters were written in place on every rank alike",
        "each rank holds only its piece of a split parameter, so the full tensor now repeats one piece instead "
        "of holding what the unsharded model's init gives (nn.init.*_(p) on sm.parameters() draws the same "
        "numbers on every rank seeded alike, and takes fan-in from the piece's shape). Initialize with "
        "sm.init_parameters(fn) (fn(name, t) sees each tensor at its global shape), load full values with "
        "sm.load_full_state_dict(...), or initialize the model before shard(); pieces meant to be equal "
        "(experts copied from one layer, kv heads repeated for the split) are written by "
        "sm.load_full_state_dict(...) or sm.init_parameters(fn, exact=True)")


def call_leaves(where: str, traced: Traced, args: tuple, kwargs: dict) -> list[Any]:
    """The tensor leaves of the call ``(args, kwargs)`` (in ``traced.tensor_leaf_positions`` order; keyword order
    does not matter). Raises if the call's structure is not the example's, a leaf the example had as a tensor is
    not one, or a non-tensor leaf differs from the constant the program was specialized to."""
    kw_want = list(traced.in_tree.child(1).context)
    if set(kwargs) == set(kw_want):
        kwargs = {k: kwargs[k] for k in kw_want}  # keyword order does not matter
    flat, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
    if tree != traced.in_tree:
        raise _call_error(where, traced, args, kwargs)
    for pos in traced.tensor_leaf_positions:
        if not isinstance(flat[pos], torch.Tensor):
            raise ShardingError(f"{where}: {_arg_name(args, kwargs, pos)} is a {type(flat[pos]).__name__}, "
                                f"but the example was a tensor; pass a tensor there")
    for pos, example in traced.constant_leaves.items():
        if not _same_constant(flat[pos], example):
            raise ShardingError(
                f"{where}: {_arg_name(args, kwargs, pos)} is {_short(flat[pos])}, but the module was sharded "
                f"with {example!r} there and the traced program computes with that value (torch.export "
                f"specializes non-tensor arguments); pass {example!r}, pass the value as a tensor, or shard "
                f"again with this value in example_inputs ({SHARED})")
    return [flat[i] for i in traced.tensor_leaf_positions]


def _call_error(where: str, traced: Traced, args: tuple, kwargs: dict) -> ShardingError:
    """Why ``(args, kwargs)`` does not have the structure the module was sharded for."""
    want_args, want_kw = traced.in_tree.children()
    n_want, kw_want = want_args.num_children, list(want_kw.context)
    if len(args) != n_want or sorted(kwargs) != sorted(kw_want):
        return ShardingError(
            f"{where} was called with {len(args)} positional argument(s) and keyword arguments "
            f"{sorted(kwargs)}, but it was sharded for {n_want} positional argument(s) and keyword arguments "
            f"{sorted(kw_want)} (example_inputs/example_kwargs); call it with the arguments forward was "
            f"sharded with (shard again with other example inputs to change them: {SHARED})"
        )
    pairs = [(f"positional argument {i}", a, want_args.child(i)) for i, a in enumerate(args)]
    pairs += [(f"keyword argument {k!r}", kwargs[k], want_kw.child(j)) for j, k in enumerate(kw_want)]
    for what, value, spec in pairs:
        got = pytree.tree_structure(value)
        if got != spec:
            return ShardingError(f"{where}: {what} is {_describe(got)}, but the example was "
                                 f"{_describe(spec)}; pass a value of the example's structure")
    return ShardingError(f"{where}: the arguments do not have the structure of the example inputs; "
                         f"call it like example_inputs/example_kwargs")


def local_error(where: str, fqn: str, t: torch.Tensor, want: tuple[torch.dtype, torch.Size],
                global_shape: Sequence[int], how: str) -> ShardingError:
    """Why the tensor ``t`` registered now as ``fqn`` cannot feed the programs, traced for ``want`` (its local
    dtype and shape then; ``global_shape`` and ``how`` it is split describe it). Requires ``(t.dtype, t.shape)``
    to differ from ``want``."""
    dtype_then, shape = want
    if t.shape != shape:
        part = (f"this rank's part of it, of shape {list(shape)} (global {list(global_shape)}, split "
                f"{how})" if how else f"shape {list(shape)} (whole on every rank)")
        return ShardingError(
            f"{where}: {fqn} has shape {list(t.shape)} on this rank, but the programs were traced for "
            f"{part}; load a full value with sm.load_state_dict({{{fqn!r}: full_tensor}}, strict=False) (it "
            f"keeps this rank's part), or assign a tensor of the local shape")
    dtype = t.dtype
    return ShardingError(
        f"{where}: {fqn} has dtype {dtype}, but the module was sharded with it in {dtype_then} and the "
        f"programs were traced for that (e.g. after sm.to({dtype}) or sm.half()); convert the model before "
        f"shard() (model.to({dtype})), or convert this module back (sm.to({dtype_then}))")


def refuse_untraced_input_grads(where: str, slots: Sequence[Any], feed: Sequence[Any], wanted: Sequence[int]) -> None:
    """Raise if grad mode is on and an input of the call (``feed[i]`` of an ``"input"`` slot) requires grad while
    its position ``i`` is not in ``wanted`` (the primals some program gives a gradient)."""
    if not torch.is_grad_enabled():
        return
    for i, (slot, x) in enumerate(zip(slots, feed)):
        if (slot.kind == "input" and isinstance(x, torch.Tensor) and x.requires_grad
                and i not in wanted):
            raise ShardingError(
                f"input {slot.index} requires grad but the example input did not, so {where} has no "
                f"program for its gradient; pass an example input with requires_grad=True to shard() to get "
                f"its gradient, or call with a tensor that does not require grad (x.detach())"
            )


def _describe(spec: Any) -> str:
    """A readable pytree structure (for call-structure errors)."""
    if spec.is_leaf():
        return "one value"
    kind = getattr(spec.type, "__name__", str(spec.type))
    if spec.type is dict:
        return f"a dict with keys {list(spec.context)}"
    if spec.type is type(None):
        return "None"
    return f"a {kind} of {spec.num_children} items"


MODULE_FIX = ("Pass the value to forward as a tensor input, keep it in a buffer, or shard the model again after "
              "changing it")


def _short(value: Any) -> str:
    """``value`` for a message: a tensor by its shape and dtype, anything else by a repr of at most 80 chars."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)} ({value.dtype})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _arg_name(args: tuple, kwargs: dict, pos: int) -> str:
    """``positional argument 0[1]`` / ``keyword argument 'mask'`` for flattened leaf ``pos`` of ``(args, kwargs)``."""
    path = pytree.tree_flatten_with_path((tuple(args), kwargs))[0][pos][0]
    head, first, rest = path[0], path[1], path[2:]
    base = f"positional argument {first.idx}" if head.idx == 0 else f"keyword argument {first.key!r}"
    return base + pytree.keystr(rest)


def _same_constant(value: Any, example: Any) -> bool:
    """Whether a non-tensor call argument equals the example the program was specialized to (``1 != True``)."""
    return type(value) is type(example) and (value == example or value is example)
