"""Sample inputs for an op, for the rule validator (``validate.py``): the hand-made calls of
``validate_samples.SAMPLES``, torch's OpInfo samples that bind to the overload, and calls recorded
while running the OpInfos named in ``validate_samples.SOURCES`` (backward kernels, ops reached
through decompositions); small, dense and distinct (``pick_samples``).
"""

from __future__ import annotations

import itertools
import warnings
import zlib
from typing import Any, Callable, Iterable, Optional

import torch
from ..core.torch_compat import pytree

from ..core.torch_compat import TorchDispatchMode

__all__ = ["MAX_NUMEL", "op_samples", "opinfos_by_name", "outputs_as_list", "pick_samples"]

MAX_NUMEL = 4096


def outputs_as_list(out: Any) -> list[Optional[torch.Tensor]]:
    """An op's result as a list with one entry per output (a tuple or list's items, else the result
    itself): the tensors, and None for anything else."""
    if isinstance(out, (tuple, list)):
        return [x if isinstance(x, torch.Tensor) else None for x in out]
    return [out if isinstance(out, torch.Tensor) else None]


def _opinfo_dtype(info: Any) -> Optional[torch.dtype]:
    for dt in (torch.float32, torch.int64, torch.bool, torch.complex64):
        if dt in info.supported_dtypes("cpu"):
            return dt
    return None


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def pick_samples(samples: Iterable[Any], n: int, key: Callable[[Any], Any] = lambda s: (s.input, s.args, s.kwargs),
                 look: int = 48, accept: Callable[[Any], bool] = lambda s: True) -> list[Any]:
    """Up to ``n`` of the first ``look`` samples: dense, non-empty, small (up to ``MAX_NUMEL`` elements
    per tensor when there are such, else up to 5x that), distinct in shapes and arguments, those whose
    first tensor has more dims first (more ways to split), and ``accept``-ed (asked only of candidates
    about to be chosen, in that order)."""
    cands = []
    for s in itertools.islice(samples, look):
        ts = _tensors(key(s))
        if ts and all(0 < t.numel() <= 5 * MAX_NUMEL and t.layout == torch.strided for t in ts):
            cands.append((max(t.numel() for t in ts) > MAX_NUMEL, s))
    if any(not big for big, _ in cands):
        cands = [c for c in cands if not c[0]]

    def rank(s: Any) -> tuple:
        first = _tensors(key(s))[0]
        return (first.dim() >= 2, first.dim() >= 1 and first.shape[-1] >= 2, first.dim() >= 1)

    chosen, seen = [], set()
    for s in sorted((s for _, s in cands), key=rank, reverse=True):
        sig = repr(pytree.tree_map(lambda x: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x,
                                   key(s)))
        if sig not in seen and accept(s):
            seen.add(sig)
            chosen.append(s)
        if len(chosen) == n:
            break
    return chosen


def opinfos_by_name() -> dict[str, list[Any]]:
    """OpInfos under their full name (``polygamma.polygamma_n_1``), their base name, their name with
    dots as underscores (``special.i1`` -> ``special_i1``) and their ATen name."""
    from ..core.torch_compat import op_db

    res: dict[str, list[Any]] = {}
    for info in op_db:
        full = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
        names = {full, info.name.split(".")[-1], info.name.replace(".", "_"), getattr(info, "aten_name", None) or ""}
        for nm in names - {""}:
            res.setdefault(nm, []).append(info)
    return res


_SAMPLES_OF: dict[tuple[int, torch.dtype], tuple] = {}


def _samples_of(info: Any, dt: torch.dtype, look: int = 48) -> tuple:
    """The first ``look`` samples of an OpInfo (seeded by its name; generating them is slow, so kept)."""
    key = (id(info), dt)
    if key not in _SAMPLES_OF:
        from ..core.torch_compat import set_rng_seed

        set_rng_seed(zlib.crc32(info.name.encode()))  # torch, Python and numpy: samples draw from all three
        _SAMPLES_OF[key] = tuple(itertools.islice(info.sample_inputs("cpu", dt, set_seed=False), look))
    return _SAMPLES_OF[key]


def _binds(op: Any, args: tuple, kwargs: dict) -> bool:
    try:
        out = op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a sample of another overload
        return False
    return all(x is None or isinstance(x, torch.Tensor) for x in outputs_as_list(out)) and bool(_tensors(out))


class _Record(TorchDispatchMode):
    """Records (copies of) the arguments of every call to ``op``, forward and backward alike."""

    def __init__(self, op: Any):
        super().__init__()
        self.op, self.calls = op, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self.op:
            self.calls.append(pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x,
                                              (tuple(args), dict(kwargs))))
        return func(*args, **kwargs)


def _recorded(op: Any, info: Any, dt: torch.dtype, look: int = 12) -> list[tuple[tuple, dict]]:
    """Calls of ``op`` made while running ``info``'s samples forward and backward."""
    grad = info.supports_autograd and dt.is_floating_point
    calls: list[tuple[tuple, dict]] = []
    for s in itertools.islice(info.sample_inputs("cpu", dt, requires_grad=grad, set_seed=False), look):
        with _Record(op) as rec:
            try:
                out = [o for o in _tensors(info.op(s.input, *s.args, **s.kwargs)) if o.requires_grad]
                ins = [t for t in _tensors((s.input, s.args, s.kwargs)) if t.requires_grad]
                if out and ins:
                    torch.autograd.grad(out, ins, [torch.ones_like(o) for o in out], allow_unused=True)
            except Exception:  # noqa: BLE001 - a sample the op rejects records nothing
                pass
        calls.extend(rec.calls)
    return calls


def op_samples(op: Any, per_op: int = 3, infos: Optional[dict[str, list[Any]]] = None) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` samples for ``op``: the hand-made ``SAMPLES``, then OpInfo samples that bind to
    this overload (the OpInfo's name is its packet name), then calls recorded while running the
    OpInfos named in ``SOURCES`` (backward kernels, ops reached through a decomposition)."""
    from . import validate_samples

    res: list[tuple[tuple, dict]] = [make() for make in validate_samples.SAMPLES.get(op, ())]
    infos = infos if infos is not None else opinfos_by_name()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in infos.get(op._schema.name.split("::")[-1], []):
            dt = _opinfo_dtype(info)
            if dt is None or len(res) >= per_op:
                continue
            bound = [((s.input, *s.args), dict(s.kwargs)) for s in _samples_of(info, dt)]
            res.extend(pick_samples([b for b in bound if _binds(op, *b)], per_op - len(res), key=lambda b: b))
        for name in validate_samples.SOURCES.get(op, ()):
            for info in infos.get(name, [])[:1]:
                if len(res) < per_op:
                    from ..core.torch_compat import set_rng_seed

                    set_rng_seed(zlib.crc32(info.name.encode()))
                    res.extend(pick_samples(_recorded(op, info, _opinfo_dtype(info)), per_op - len(res),
                                            key=lambda b: b))
    return res[: max(per_op, len(validate_samples.SAMPLES.get(op, ())))]
