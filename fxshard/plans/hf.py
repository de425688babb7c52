"""Hugging Face tensor-parallel plans as fxshard plans: ``from_hf(model)``.

A transformers model carries its own plan: ``config.base_model_tp_plan`` plus its head's ``_tp_plan``,
merged in ``model.tp_plan`` (and, for MoE models, ``model.ep_plan``). Keys are FQN globs whose ``*``
stands for a layer number; values are strings registered in transformers' ``ALL_PARALLEL_STYLES``
(``transformers/distributed/tensor_parallel.py`` and ``expert_parallel.py``). A key names a parameter,
or a module whose own parameters take its string unless they have their own key.

``from_hf`` turns that into an ordinary fxshard plan dict. In fxshard every value keeps its global
meaning and layouts only decide communication, so a string translates to the layout of the parameters
it shards (and, for ``nn.Linear``/``nn.Embedding`` modules, the activation layouts its style pins);
strings whose only job in transformers is to fix up sums of partial values or gradients (hooks) need
no entry, the engine derives those collectives itself:

==================================  ================================================================
HF string                           fxshard entry
==================================  ================================================================
colwise                             ``ColwiseParallel()``; a parameter: dim ``ndim-2`` split (bias: 0)
colwise_gather_output, colwise_rep  ``ColwiseParallel(output_layouts=Replicate())``; parameter as colwise
rowwise                             ``RowwiseParallel()``; a parameter: last dim split, a bias replicated
rowwise_split_input, rowwise_rep    ``RowwiseParallel(input_layouts=Replicate())``; parameter as rowwise
embedding_rowwise                   ``RowwiseParallel()`` on the embedding (vocab split)
embedding_colwise                   ``ColwiseParallel(output_layouts=Replicate())`` (embedding dim split)
packed_colwise                      dim ``ndim-2`` holds 2 packed blocks: ``P(..., Packed(axis, 2), None)``
                                    (a 1-D bias is packed likewise, so adding it stays local)
packed_rowwise                      last dim holds 2 packed blocks; a 1-D parameter is replicated
sequence_parallel                   ``SequenceParallel()`` (parameters replicated, dim 1 split around)
grouped_gemm (``experts="ep"``)     dim 0 (the experts) split: whole experts per rank
replicate, replicated_with_grad_    replicated parameters: no entry
allreduce, local_params,
mla_kv_a_proj, all_reduce,
moe_tp_experts, moe_identity_
expert, ep_dispatch_experts
==================================  ================================================================
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.nn as nn
from torch.distributed.tensor import Replicate

from ..core.errors import ShardingError
from ..core.placements import P, Packed
from .styles import ColwiseParallel, RowwiseParallel, SequenceParallel

__all__ = ["from_hf"]


def _dims(entries: dict[int, Any], ndim: int) -> Optional[P]:
    return P(*[entries.get(d) for d in range(ndim)])


ParamLayout = Callable[[str, int, str], Optional[P]]  # (attribute name, ndim, mesh axis) -> spec or None


def _colwise(pname: str, ndim: int, axis: str) -> Optional[P]:
    return _dims({max(ndim - 2, 0): axis}, ndim)


def _rowwise(pname: str, ndim: int, axis: str) -> Optional[P]:
    return None if pname == "bias" else _dims({ndim - 1: axis}, ndim)


def _packed_colwise(pname: str, ndim: int, axis: str) -> Optional[P]:
    return _dims({max(ndim - 2, 0): Packed(axis, 2)}, ndim)


def _packed_rowwise(pname: str, ndim: int, axis: str) -> Optional[P]:
    return None if ndim == 1 else _dims({ndim - 1: Packed(axis, 2)}, ndim)


def _dim(d: int) -> ParamLayout:
    return lambda pname, ndim, axis: _dims({d: axis}, ndim)


def _replicated(pname: str, ndim: int, axis: str) -> Optional[P]:
    return None


@dataclass(frozen=True)
class Translation:
    """What one HF string becomes: each parameter's spec, and the style its modules take when they are
    all ``style_on`` (else the parameters get specs and the activations are left to propagation)."""

    layout: ParamLayout
    style: Optional[Callable[[str], Any]] = None
    style_on: tuple[type, ...] = (nn.Linear, nn.Embedding)


TRANSLATIONS: dict[str, Translation] = {
    "colwise": Translation(_colwise, lambda a: ColwiseParallel(mesh_axis=a)),
    "colwise_gather_output": Translation(_colwise, lambda a: ColwiseParallel(output_layouts=Replicate(), mesh_axis=a)),
    "colwise_rep": Translation(_colwise, lambda a: ColwiseParallel(output_layouts=Replicate(), mesh_axis=a)),
    "rowwise": Translation(_rowwise, lambda a: RowwiseParallel(mesh_axis=a)),
    "rowwise_split_input": Translation(_rowwise, lambda a: RowwiseParallel(input_layouts=Replicate(), mesh_axis=a)),
    "rowwise_rep": Translation(_rowwise, lambda a: RowwiseParallel(input_layouts=Replicate(), mesh_axis=a)),
    "embedding_rowwise": Translation(_dim(0), lambda a: RowwiseParallel(mesh_axis=a)),
    "embedding_colwise": Translation(_dim(1), lambda a: ColwiseParallel(output_layouts=Replicate(), mesh_axis=a)),
    "packed_colwise": Translation(_packed_colwise),
    "packed_rowwise": Translation(_packed_rowwise),
    "sequence_parallel": Translation(_replicated, lambda a: SequenceParallel(mesh_axis=a), (nn.Module,)),
    "grouped_gemm": Translation(_dim(0)),
    **{s: Translation(_replicated) for s in (
        "replicate", "replicated_with_grad_allreduce", "local_params", "mla_kv_a_proj", "all_reduce",
        "moe_tp_experts", "moe_identity_expert", "ep_dispatch_experts")},
}


def _generic(name: str) -> str:
    """HF's key form of an FQN: numbers between dots become ``*``
    (``transformers.distributed.parallel_utils.replace_layer_number_by_wildcard``)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _hf_plan(model: nn.Module, experts: str) -> dict[str, str]:
    """The model's merged HF plan (tp, with the ep plan taking over expert modules when ``experts='ep'``)."""
    tp = getattr(model, "tp_plan", None)
    if not isinstance(tp, dict) or not tp:
        raise ShardingError(
            f"{type(model).__name__} carries no Hugging Face tensor-parallel plan (model.tp_plan is empty or "
            f"missing; it comes from config.base_model_tp_plan); write an fxshard plan by hand instead"
        )
    if experts == "tp":
        return dict(tp)
    ep = dict(getattr(model, "ep_plan", None) or {})
    if not ep:
        raise ShardingError(f"from_hf(experts='ep'): {type(model).__name__} has no expert-parallel plan "
                            f"(model.ep_plan is empty); use experts='tp'")
    is_expert = re.compile(rf"(?:{'|'.join(map(re.escape, ep))})(?:\..+)?").fullmatch
    return {**{k: v for k, v in tp.items() if not is_expert(k)}, **ep}


def from_hf(model: nn.Module, *, axis: str = "tp", experts: str = "tp") -> dict[str, Any]:
    """The fxshard plan equivalent to the tensor-parallel plan a transformers ``model`` carries.

    Requires a transformers ``PreTrainedModel`` (transformers installed: ``pip install fxshard[hf]``).
    ``axis`` names the mesh axis every split uses; ``experts="tp"`` follows ``model.tp_plan`` (each
    expert's inner dims split, as transformers' ``moe_tp_experts``), ``experts="ep"`` takes the expert
    modules from ``model.ep_plan`` (whole experts per rank, ``grouped_gemm``). Ensures: a dict of FQN
    globs -> fxshard specs/ParallelStyles (module doc has the table) covering what the HF plan shards,
    HF keys kept where a glob matches exactly what HF matches (else expanded to FQNs); keys matching
    nothing in this model are left out. Raises ShardingError listing every string it cannot translate.
    """
    if experts not in ("tp", "ep"):
        raise ShardingError(f"from_hf(experts={experts!r}): use 'tp' (split each expert) or 'ep' (split the experts)")
    hf = _hf_plan(model, experts)
    unknown = {k: v for k, v in hf.items() if v not in TRANSLATIONS}
    if unknown:
        raise ShardingError(
            f"from_hf: {type(model).__name__}'s plan uses strings fxshard cannot translate: "
            + ", ".join(f"{k!r}: {v!r}" for k, v in unknown.items())
            + f"; known strings are {sorted(TRANSLATIONS)}. Write those entries by hand (P(...) specs) and "
            f"pass the edited dict"
        )
    modules = dict(model.named_modules(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    # each parameter's string, as transformers resolves it: its own key, else its module's key
    owner: dict[str, str] = {}
    for fqn in params:
        mod, _, pname = fqn.rpartition(".")
        if _generic(fqn) in hf:
            owner[fqn] = _generic(fqn)
        elif _generic(mod) in hf:
            owner[fqn] = _generic(mod)
    plan: dict[str, Any] = {}
    for key, string in hf.items():
        tr = TRANSLATIONS[string]
        mods = [m for m in modules if m and _generic(m) == key]
        own = {f: p for f, p in params.items() if owner.get(f) == key}
        styled = tr.style is not None and mods and all(isinstance(modules[m], tr.style_on) for m in mods) and all(
            f.rpartition(".")[0] in mods for f in own) and all(
            owner.get(f"{m}.{n}") == key for m in mods for n, _ in modules[m].named_parameters(recurse=False))
        if styled:
            _put(plan, key, tr.style(axis), mods, modules)
            continue
        by_glob: dict[str, Any] = {}
        for f, p in own.items():
            spec = tr.layout(f.rpartition(".")[2], p.dim(), axis)
            if spec is not None:
                by_glob.setdefault(_generic(f), (spec, []))[1].append(f)
        for glob, (spec, fqns) in by_glob.items():
            _put(plan, glob, spec, fqns, params)
    return plan


def _put(plan: dict[str, Any], glob: str, value: Any, hits: list[str], names: dict[str, Any]) -> None:
    """``plan[glob] = value`` when fnmatch's ``glob`` matches exactly ``hits`` among ``names``, else one
    entry per hit (an fnmatch ``*`` also crosses dots, HF's only stands for a layer number)."""
    if sorted(n for n in names if fnmatch.fnmatchcase(n, glob)) == sorted(hits):
        plan[glob] = value
    else:
        plan.update({h: value for h in hits})
