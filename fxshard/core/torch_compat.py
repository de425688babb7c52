"""Every private torch name fxshard uses, in one place, with a fallback where a torch version of the
supported window lacks it.

fxshard works on ATen graphs, so it needs torch internals (fake tensors, ``make_fx``, the shape
environment, decompositions, functionalization helpers, Dynamo's backend registry, ...). No other
module of the package imports ``torch._*`` (or ``torch.fx.experimental`` / ``torch.testing._internal``
/ ``torch.distributed.tensor._*`` internals): they import the names from here, so a torch upgrade is
fixed in this file.

Supported window: torch 2.11 to 2.14 (``pyproject.toml``; tested on 2.11.0, 2.13.0 and 2.14.1). Names
present in every version of the window are plain re-exports. The ones that are not, and what stands in:

=====================================  ===========================  =======================================
name here (torch's name)               missing on                   fallback (computes the same)
=====================================  ===========================  =======================================
``optimization_hint``                  2.11 (new in 2.13)           the SymInt's own hint, else its
(``torch.fx.experimental.                                           expression with backed symbols at
symbolic_shapes.optimization_hint``)                                their values and unbacked ones at
                                                                    ``fallback`` clamped to their range
``softmax_unbacked_safe_amax``         2.11 (new in 2.13)           the same function: ``amax(x, dim,
(``torch._decomp.decompositions.                                    keepdim=True)``, with one ``-inf``
_softmax_unbacked_safe_amax``)                                      appended along ``dim`` when that dim
                                                                    may be empty
``get_default_backend``                2.11 (new in 2.13)           ``"inductor"`` (the only default
(``torch._dynamo.backends.registry.                                 before ``set_default_backend``
get_default_backend``)                                              existed)
=====================================  ===========================  =======================================

Behaviour that differs inside the window, with the helper that gives every version the same result:

* ``classmethod_function``: ``torch.autograd.Function.__dict__["apply"]`` is a Python ``classmethod``
  up to 2.13 and a C ``classmethod_descriptor`` without ``__func__`` from 2.14.
* ``dynamo_safe_function_outputs``: on 2.11 TorchDynamo's ``backend="eager"`` gives zero gradients to an
  autograd.Function output that is directly a functional collective's ``wait_tensor`` (fixed by 2.13);
  under compile on torch < 2.13 the outputs go through ``detach()``.
* On 2.11 TorchDynamo cannot trace ``id()`` of a tensor made inside an autograd.Function forward: code
  that runs under ``torch.compile`` compares tensors with ``is`` instead.

Behaviour fxshard changes while it traces, in one place each:

* ``exporting_hidden_from``: while active, ``torch.compiler.is_exporting()`` (the public function, which
  reads the private ``torch.compiler._is_exporting_flag`` that ``torch.export`` sets) answers False to
  the functions a predicate names, and the real flag to every other caller (torch's own export machinery
  among them). ``fxshard/tracing/eager_branches.py`` says which functions and why.

A fallback is chosen by whether torch has the name, never by the version number (2.12 was not tried;
it gets whichever it needs); the one switch by version number is ``dynamo_safe_function_outputs``.
``tests/test_torch_compat.py`` hides each new name and checks the fallback against the real one, and
that ``import fxshard`` and a small shard still work with them hidden; ``scripts/check_torch_window.sh``
runs the core of the suite on another torch.

Dynamo, inductor and ``torch.testing._internal`` are heavy and ``import fxshard`` must not import them:
their names here are functions that import on call, or attributes resolved on first access (module
``__getattr__``): ``FakeStore``, ``op_db``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
import types
from typing import Any, Callable, Iterator

import sympy
import torch
from torch._C import _disabled_torch_function_impl as disabled_torch_function_impl  # noqa: F401
from torch._C._functorch import peek_interpreter_stack  # noqa: F401
from torch._decomp import (  # noqa: F401
    _core_aten_decompositions_post_autograd as core_aten_decompositions_post_autograd, decomposition_table)
from torch._decomp import decompositions as _decompositions
from torch._dispatch.python import enable_python_dispatcher  # noqa: F401
from torch._functorch._aot_autograd.functional_utils import (  # noqa: F401
    from_fun, has_data_mutation, has_metadata_mutation, to_fun)
from torch._guards import tracing as guards_tracing  # noqa: F401
from torch._ops import OpOverload, OpOverloadPacket  # noqa: F401
from torch._prims_common import (  # noqa: F401
    ELEMENTWISE_TYPE_PROMOTION_KIND, canonicalize_dim, elementwise_dtypes, is_non_overlapping_and_dense_or_false)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401
from torch._subclasses.functional_tensor import FunctionalTensorMode  # noqa: F401
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group  # noqa: F401
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401
from torch.fx._lazy_graph_module import (  # noqa: F401
    _get_graph_module_cls as get_graph_module_cls, _LazyGraphModule as LazyGraphModule,
    _make_graph_module as make_graph_module, _use_lazy_graph_module as use_lazy_graph_module)
from torch.fx.experimental import symbolic_shapes as _symbolic_shapes
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx  # noqa: F401
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols, guard_or_false  # noqa: F401
from torch.fx.passes.shape_prop import _extract_tensor_metadata as extract_tensor_metadata  # noqa: F401
from torch.fx.proxy import _COPY_META_FIELDS as COPY_META_FIELDS  # noqa: F401
from torch.nn import _reduction as nn_reduction  # noqa: F401
from torch.utils import _pytree as pytree  # noqa: F401

C_NN = torch._C._nn  # the C functions torch.nn.functional's losses call
from torch.nn.modules._functions import BackwardHookFunction  # noqa: F401
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

# The module every autograd.Function that a custom op's ``register_autograd`` generates lives under
# (``torch._library.autograd`` on every version of the window): such an op stays one node in an export.
CUSTOM_OP_AUTOGRAD_MODULE_PREFIX = "torch._library."
# autograd.Functions of torch that a traced forward may apply and whose backward is the derivative of their
# forward: non-reentrant checkpointing on torch 2.11 saves its inputs through _NoopSaveInputs, whose
# output is an empty dummy tensor (no gradient flows through it); 2.13 and 2.14 save them without a Function
TORCH_DERIVATIVE_BACKWARDS = frozenset({"torch.utils.checkpoint._NoopSaveInputs"})
# Dynamo's config flag that makes a captured graph take parameters as inputs (named in messages).
DYNAMO_INLINE_NN_MODULES_FLAG = "torch._dynamo.config.inline_inbuilt_nn_modules"


# ---------------------------------------------------------------------------------------------------
# optimization_hint: new in torch 2.13

def _optimization_hint_fallback(a: torch.SymInt | int, fallback: int | None = None) -> int:
    """``optimization_hint`` for torch versions without it (2.11): a concrete value of ``a`` for cost
    and layout decisions, adding no guard.

    Requires: ``a`` an int or a SymInt of a ShapeEnv. Ensures: what torch 2.13's ``optimization_hint``
    returns for hinted sizes and for expressions it does not factor further: backed symbols at their
    recorded values, unbacked ones at ``fallback`` (inductor's ``unbacked_symint_fallback`` when None)
    clamped to their value range."""
    if isinstance(a, torch.SymInt):
        node = a.node
        if node._hint is not None:
            return int(node._hint)
        env = node.shape_env
        expr = node.expr.xreplace(env.replacements)
        backed = getattr(env, "backed_var_to_val", None) or env.var_to_val
        values = {}
        for s in expr.free_symbols:
            if s in backed:
                values[s] = backed[s]
                continue
            if fallback is None:  # as 2.13: inductor's default guess for unbacked sizes
                from torch._inductor.config import unbacked_symint_fallback as fallback
            v = fallback
            vr = env.var_to_range.get(s)
            if vr is not None:
                if isinstance(vr.lower, (int, sympy.Integer)):
                    v = max(v, int(vr.lower))
                if isinstance(vr.upper, (int, sympy.Integer)):
                    v = min(v, int(vr.upper))
            values[s] = v
        return int(expr.xreplace(values))
    if type(a) is not int:
        raise TypeError(f"optimization_hint: expected an int or a SymInt, got {type(a).__name__}")
    return a


optimization_hint: Callable[..., int] = getattr(_symbolic_shapes, "optimization_hint", _optimization_hint_fallback)


# ---------------------------------------------------------------------------------------------------
# softmax_unbacked_safe_amax: new in torch 2.13

def _softmax_unbacked_safe_amax_fallback(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The row max softmax subtracts (torch 2.13's ``_softmax_unbacked_safe_amax``), for versions
    without it (2.11 inlines ``amax`` and special-cases ``numel() == 0`` in ``_softmax`` instead).

    Requires: ``x`` a tensor, ``dim`` a valid dim of it. Ensures: ``amax(x, dim, keepdim=True)`` when
    ``x``'s ``dim`` is known non-empty; otherwise the same over ``x`` with one ``-inf`` appended along
    ``dim`` (the identity of max: the result is unchanged for non-empty input and ``-inf`` for empty)."""
    if x.ndim == 0:
        return torch.amax(x, dim, keepdim=True)
    d = canonicalize_dim(x.ndim, dim)
    if guard_or_false(x.shape[d] > 0):
        return torch.amax(x, dim, keepdim=True)
    pad = list(x.shape)
    pad[d] = 1
    return torch.amax(torch.cat((x, x.new_full(pad, float("-inf"))), dim=dim), dim, keepdim=True)


softmax_unbacked_safe_amax: Callable[[torch.Tensor, int], torch.Tensor] = getattr(
    _decompositions, "_softmax_unbacked_safe_amax", _softmax_unbacked_safe_amax_fallback)


# ---------------------------------------------------------------------------------------------------
# Dynamo and inductor: imported on call (``import fxshard`` does not import Dynamo)

def get_default_backend() -> Any:
    """``torch.compile``'s default backend (Dynamo's ``get_default_backend``, new in torch 2.13).

    Ensures: the backend torch.compile uses when given none: a name or a compiler function; on
    versions without ``get_default_backend`` (2.11), ``"inductor"``, their only default."""
    from torch._dynamo.backends import registry

    get = getattr(registry, "get_default_backend", None)
    return "inductor" if get is None else get()


def list_mode_options(mode: str | None, dynamic: bool | None = None) -> dict[str, Any]:
    """Inductor's options for a ``torch.compile`` ``mode`` (``torch._inductor.list_mode_options``)."""
    from torch._inductor import list_mode_options as options

    return options(mode, dynamic)


def register_dynamo_backend(fn: Callable[..., Any], name: str) -> None:
    """Register ``fn`` as the Dynamo backend ``name`` unless a backend of that name already exists.

    Ensures: ``torch.compile(..., backend=name)`` resolves (to the first registration)."""
    from torch._dynamo.backends import registry

    if name not in registry._COMPILER_FNS:
        registry.register_backend(fn, name=name)


def classmethod_function(descriptor: Any) -> Callable[..., Any]:
    """The function ``f(cls, *args, **kwargs)`` behind a classmethod taken from a class ``__dict__``, such as
    ``torch.autograd.Function.__dict__["apply"]``: a Python ``classmethod`` up to torch 2.13, a C
    ``classmethod_descriptor`` (no ``__func__``) from 2.14.

    Ensures: calling the result with a class ``cls`` calls the classmethod bound to ``cls``."""
    func = getattr(descriptor, "__func__", None)
    if func is not None:
        return func
    return lambda cls, *args, **kwargs: descriptor.__get__(None, cls)(*args, **kwargs)


# torch 2.11's TorchDynamo (fixed by 2.13) gives zero gradients to an autograd.Function output that is
# directly the result of a functional collective's wait_tensor under backend="eager" (aot_eager and
# inductor are right); any op after the wait avoids it
_DYNAMO_ZEROES_WAITED_FUNCTION_OUTPUTS = torch.__version__ < "2.13"


def dynamo_safe_function_outputs(outs: list, diff: Any) -> list:
    """The outputs an autograd.Function's forward returns, safe from torch 2.11's TorchDynamo bug above.

    Requires: ``outs`` the forward's outputs, ``diff`` the indices of those that are differentiable.
    Ensures: ``outs`` itself except under ``torch.compile`` on torch < 2.13, where each differentiable
    tensor output is replaced by its ``detach()`` (the same storage and values; no copy)."""
    if not (_DYNAMO_ZEROES_WAITED_FUNCTION_OUTPUTS and torch.compiler.is_compiling()):
        return outs
    return [o.detach() if i in diff and isinstance(o, torch.Tensor) else o for i, o in enumerate(outs)]


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends (the autograd engine's ``queue_callback``).

    Requires: a backward pass is running (call from a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def set_rng_seed(seed: int) -> None:
    """Seed torch, Python's ``random`` and numpy (``torch.testing._internal.common_utils.set_rng_seed``)."""
    from torch.testing._internal.common_utils import set_rng_seed as seed_all

    seed_all(seed)


@contextlib.contextmanager
def exporting_hidden_from(hidden: Callable[[types.CodeType, str], bool], depth: int = 2) -> Iterator[None]:
    """While active, ``torch.compiler.is_exporting()`` returns False when one of the
    ``depth`` innermost frames of its caller (the caller itself, then the caller's caller: a helper such as
    transformers' ``is_torchdynamo_exporting`` sits between) runs code for which ``hidden(code, module name)``
    is true; otherwise it returns what torch's flag says.

    Requires: ``hidden`` cheap and side-effect free (torch's fake tensors ask on every creation).
    Ensures: on exit ``torch.compiler.is_exporting`` is the function it was on entry; nested uses restore
    in order. Every version of the window (2.11-2.14) has ``torch.compiler.is_exporting``, reading
    ``torch.compiler._is_exporting_flag``, and torch's own callers look it up as an attribute on every call.
    """
    real = torch.compiler.is_exporting

    @functools.wraps(real)
    def is_exporting() -> bool:
        if not real():
            return False
        frame = sys._getframe(1)
        for _ in range(depth):
            if frame is None:
                break
            if hidden(frame.f_code, frame.f_globals.get("__name__", "")):
                return False
            frame = frame.f_back
        return True

    torch.compiler.is_exporting = is_exporting
    try:
        yield
    finally:
        torch.compiler.is_exporting = real


def packed_spec(spec: Any) -> Any:
    """``spec`` (a DTensorSpec whose ``_StridedShard`` placements each split blocks of a packed dim on one mesh
    axis) read as exactly that, on every torch of the window: where DTensorSpec reads ``_StridedShard`` as
    an order of mesh axes by default (``use_strided_shard_as_shard_order``), a lone one cannot be such an order,
    and torch 2.11 then refuses to redistribute it (``full_tensor()`` raised ValueError)."""
    if getattr(spec, "use_strided_shard_as_shard_order", None):
        return dataclasses.replace(spec, use_strided_shard_as_shard_order=False, shard_order=None)
    return spec


def is_fsdp(x: Any, module: str, cls: str) -> bool:
    """``isinstance(x, torch.distributed.fsdp._fully_shard.<module>.<cls>)`` without importing FSDP (a fifth
    of fxshard's import time): nothing can be an instance before that module is imported."""
    mod = sys.modules.get(f"torch.distributed.fsdp._fully_shard.{module}")
    return mod is not None and isinstance(x, getattr(mod, cls))


_LAZY = {
    "FakeStore": ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    "op_db": ("torch.testing._internal.common_methods_invocations", "op_db"),
}


def __getattr__(name: str) -> Any:
    """The heavy names of ``_LAZY``, imported on first access."""
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BackwardHookFunction", "canonicalize_dim", "classmethod_function", "compute_local_shape_and_global_offset",
    "core_aten_decompositions_post_autograd", "COPY_META_FIELDS", "CUSTOM_OP_AUTOGRAD_MODULE_PREFIX", "decomposition_table",
    "disabled_torch_function_impl", "DYNAMO_INLINE_NN_MODULES_FLAG", "dynamo_safe_function_outputs",
    "elementwise_dtypes", "ELEMENTWISE_TYPE_PROMOTION_KIND", "enable_python_dispatcher", "exporting_hidden_from",
    "extract_tensor_metadata", "FakeStore", "FakeTensor", "FakeTensorMode", "free_unbacked_symbols", "from_fun",
    "FunctionalTensorMode", "get_default_backend", "get_graph_module_cls", "get_proxy_mode", "get_proxy_slot",
    "guard_or_false", "guards_tracing", "has_data_mutation", "has_metadata_mutation",
    "is_non_overlapping_and_dense_or_false", "LazyGraphModule", "list_mode_options", "make_fx",
    "make_graph_module", "nn_reduction", "op_db", "OpOverload", "OpOverloadPacket", "optimization_hint",
    "peek_interpreter_stack", "queue_autograd_callback", "register_dynamo_backend", "resolve_process_group", "set_rng_seed", "ShapeEnv",
    "softmax_unbacked_safe_amax", "StridedShard", "to_fun", "TORCH_DERIVATIVE_BACKWARDS", "TorchDispatchMode",
    "use_lazy_graph_module",
]
