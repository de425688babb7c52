"""Hand-made sample calls for the rule validator (``validate.py``), for ops no OpInfo sample reaches:
scalar overloads, factories, backward kernels, fused kernels. Each entry is ``op -> [make, ...]``
where ``make()`` returns ``(args, kwargs)``; sizes mix even and odd so uneven splits get checked."""

from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten

Make = Callable[[], tuple[tuple, dict]]


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rnd(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed))


def _x() -> torch.Tensor:
    return rnd(6, 5, seed=1)


def _unary() -> list[Make]:
    return [lambda: ((_x(),), {}), lambda: ((rnd(4, 6, 10, seed=2),), {})]


def _scalar(value: Any) -> list[Make]:
    return [lambda: ((_x(), value), {}), lambda: ((rnd(4, 6, 10, seed=2), value), {})]


def _grad_pair(second: Callable[[torch.Tensor], torch.Tensor], **kw: Any) -> list[Make]:
    return [lambda: ((rnd(6, 5, seed=3), second(_x())), dict(kw)),
            lambda: ((rnd(4, 6, 10, seed=4), second(rnd(4, 6, 10, seed=5))), dict(kw))]


def _sdpa(mask: bool) -> Make:
    def make() -> tuple[tuple, dict]:
        q, k, v = (rnd(2, 4, 8, 16, seed=s) for s in (6, 7, 8))
        return ((q, k, v), {"attn_mask": rnd(2, 1, 8, 8, seed=9)} if mask else {"is_causal": True})
    return make


def _sdpa_backward(mask: bool) -> Make:
    def make() -> tuple[tuple, dict]:
        (q, k, v), kw = _sdpa(mask)()
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, **kw)
        causal = kw.get("is_causal", False)
        extra = {"attn_mask": kw["attn_mask"]} if mask else {}
        return ((rnd(2, 4, 8, 16, seed=10), q, k, v, o, lse, 0.0, causal), extra)
    return make


def _attention(mask: str = "", gqa: bool = False, causal: bool = False) -> tuple[tuple, dict]:
    """``fxshard::attention``'s arguments: q ``[2, 6, 8, 4]``; k, v with 3 heads under ``gqa``; ``mask`` one of
    "" (none), "bool" ``[8, 8]``, "batch" ``[2, 1, 8, 8]`` (broadcast over heads), "heads" ``[6, 8, 8]``."""
    q = rnd(2, 6, 8, 4, seed=40)
    k, v = (rnd(2, 3 if gqa else 6, 8, 4, seed=s) for s in (41, 42))
    m = {"": None, "bool": rnd(8, 8, seed=43) > -0.5, "batch": rnd(2, 1, 8, 8, seed=44),
         "heads": rnd(6, 8, 8, seed=45)}[mask]
    return (q, k, v, m, causal, 0.3 if causal else None, gqa), {}


def _attention_backward(mask: str = "", gqa: bool = False, causal: bool = False) -> Make:
    def make() -> tuple[tuple, dict]:
        args, _ = _attention(mask, gqa, causal)
        learned = mask in ("batch", "heads")
        return ((rnd(2, 6, 8, 4, seed=46), *args, learned), {})
    return make


def _layer_norm_backward(mask: list[bool], affine: bool = True) -> Make:
    def make() -> tuple[tuple, dict]:
        x, g = rnd(4, 6, 8, seed=11), rnd(4, 6, 8, seed=12)
        w, b = (rnd(8, seed=13), rnd(8, seed=14)) if affine else (None, None)
        _, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
        return ((g, x, [8], mean, rstd, w, b, mask), {})
    return make


def _conv(dims: int, groups: int = 1, transposed: bool = False) -> tuple[tuple, dict]:
    x = rnd(4, 6, *([10] * dims), seed=15)
    w = rnd(6, 8 // groups, *([3] * dims), seed=16) if transposed else rnd(8, 6 // groups, *([3] * dims), seed=16)
    one, zero = [1] * dims, [0] * dims
    return ((x, w, rnd(8, seed=17), one, one, one, transposed, zero, groups), {})


def _conv_backward(dims: int, groups: int = 1, mask: tuple = (True, True, True)) -> Make:
    def make() -> tuple[tuple, dict]:
        (x, w, b, stride, pad, dil, tr, opad, groups_), _ = _conv(dims, groups)
        y = aten.convolution(x, w, b, stride, pad, dil, tr, opad, groups_)
        g = rnd(*y.shape, seed=18)
        return ((g, x, w, [8], stride, pad, dil, tr, opad, groups_, list(mask)), {})
    return make


def _embedding_backward(pad: int, freq: bool) -> Make:
    return lambda: ((rnd(2, 5, 8, seed=19), torch.randint(0, 15, (2, 5), generator=_g(20)), 15, pad, freq), {})


def _where() -> list[Make]:
    return [lambda: ((_x() > 0, _x(), rnd(6, 5, seed=21)), {}),
            lambda: ((rnd(4, 1, 10, seed=22) > 0, rnd(4, 6, 10, seed=23), rnd(10, seed=24)), {})]


def _complex() -> torch.Tensor:
    return torch.complex(rnd(6, 5, seed=27), rnd(6, 5, seed=28))


def _batch_norm(*training: bool) -> Make:
    """``(x, w, b, running_mean, running_var, [training,] momentum, eps)``."""
    def make() -> tuple[tuple, dict]:
        stats = (rnd(6, seed=29), rnd(6, seed=30).abs() + 0.5)
        return ((rnd(4, 6, 5, seed=31), rnd(6, seed=32), rnd(6, seed=33), *stats, *training, 0.1, 1e-5), {})
    return make


def _solve_triangular(a_batch: tuple[int, ...], b_batch: tuple[int, ...], upper: bool = False, left: bool = True,
                      unit: bool = False, n: int = 5, k: int = 3) -> Make:
    """``linalg_solve_triangular(A, B, upper=, left=, unitriangular=)``: ``A`` ``[*a_batch, n, n]`` with a
    dominant diagonal (well conditioned), ``B`` ``[*b_batch, n, k]`` (``[*b_batch, k, n]`` when not left)."""
    def make() -> tuple[tuple, dict]:
        a = rnd(*a_batch, n, n, seed=40) * 0.3 + 3 * torch.eye(n)
        b = rnd(*b_batch, *((n, k) if left else (k, n)), seed=41)
        return ((a, b), {"upper": upper, "left": left, "unitriangular": unit})
    return make


SAMPLES: dict[Any, list[Make]] = {
    aten.linalg_solve_triangular.default: [_solve_triangular((2, 3), (2, 3)), _solve_triangular((3,), (2, 3), upper=True),
                                           _solve_triangular((2, 1), (2, 3), left=False, unit=True),
                                           _solve_triangular((), (4,), k=5)],
    aten.upsample_nearest2d.vec: [lambda: ((rnd(3, 5, 4, 6, seed=3), None, [2.0, 1.5]), {}),
                                  lambda: ((rnd(5, 3, 3, 4, seed=4), [6, 5], None), {})],
    aten.upsample_bilinear2d.vec: [lambda: ((rnd(3, 5, 4, 6, seed=3), None, False, [2.0, 1.5]), {}),
                                   lambda: ((rnd(5, 3, 3, 4, seed=4), [6, 5], True, None), {})],
    aten._conj.default: [lambda: ((_complex(),), {})],
    aten._conj_physical.default: [lambda: ((_complex(),), {})],
    aten._native_batch_norm_legit_no_training.default: [_batch_norm()],
    aten._native_batch_norm_legit_functional.default: [_batch_norm(True), _batch_norm(False)],
    aten._scaled_dot_product_flash_attention_for_cpu.default: [_sdpa(False), _sdpa(True)],
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: [_sdpa_backward(False), _sdpa_backward(True)],
    torch.ops.fxshard.attention.default: [lambda: _attention(causal=True), lambda: _attention("bool"),
                                          lambda: _attention("batch", gqa=True), lambda: _attention("heads")],
    torch.ops.fxshard.attention_backward.default: [_attention_backward(causal=True), _attention_backward("bool"),
                                                   _attention_backward("batch", gqa=True),
                                                   _attention_backward("heads")],
    aten._to_copy.default: [lambda: ((_x(),), {"dtype": torch.float64}),
                            lambda: ((torch.randint(-3, 4, (6, 5), generator=_g(25)),), {"dtype": torch.float32}),
                            lambda: ((_x(),), {"dtype": torch.int64}),
                            lambda: ((_x() > 0,), {"dtype": torch.float32})],
    aten._unsafe_view.default: [lambda: ((rnd(4, 6, 10, seed=26), [24, 10]), {}),
                                lambda: ((rnd(4, 6, 10, seed=26), [4, 2, 3, 10]), {})],
    aten.alias.default: _unary(),
    aten.detach.default: _unary(),
    aten.lift_fresh_copy.default: _unary(),
    aten.add.Scalar: _scalar(2.5),
    aten.sub.Scalar: _scalar(2.5),
    aten.mul.Scalar: _scalar(2.5),
    aten.div.Scalar: _scalar(2.5),
    aten.rsub.Scalar: _scalar(2.5),
    aten.fmod.Scalar: _scalar(0.7),
    aten.remainder.Scalar: _scalar(0.7),
    aten.pow.Tensor_Scalar: _scalar(2),
    aten.eq.Scalar: _scalar(0.0),
    aten.ne.Scalar: _scalar(0.0),
    aten.lt.Scalar: _scalar(0.1),
    aten.le.Scalar: _scalar(0.1),
    aten.gt.Scalar: _scalar(0.1),
    aten.ge.Scalar: _scalar(0.1),
    aten.clamp_min.default: _scalar(-0.2),
    aten.clamp_max.default: _scalar(0.2),
    aten.clamp.default: [lambda: ((_x(), -0.3, 0.4), {}), lambda: ((rnd(4, 6, 10, seed=2), None, 0.4), {})],
    aten.pow.Scalar: [lambda: ((2.0, _x()), {})],
    aten.where.self: _where(),
    aten.arange.default: [lambda: ((10,), {"dtype": torch.float32})],
    aten.arange.start: [lambda: ((2, 11), {"dtype": torch.float32})],
    aten.arange.start_step: [lambda: ((0, 10, 3), {"dtype": torch.float32})],
    aten.full.default: [lambda: (([4, 6], 1.5), {})],
    aten.zeros.default: [lambda: (([4, 5],), {})],
    aten.ones.default: [lambda: (([4, 5],), {})],
    aten.empty.memory_format: [lambda: (([4, 5],), {})],
    aten.empty_permuted.default: [lambda: (([4, 5], [1, 0]), {})],
    aten.empty_strided.default: [lambda: (([4, 5], [5, 1]), {})],
    aten.eye.default: [lambda: ((5,), {})],
    aten.scalar_tensor.default: [lambda: ((1.5,), {})],
    aten.rand.default: [lambda: (([4, 5],), {})],
    aten.randn.default: [lambda: (([4, 5],), {})],
    aten.bernoulli.p: [lambda: ((_x(), 0.3), {}), lambda: ((rnd(4, 6, 10, seed=2), 0.7), {})],
    aten.normal_functional.default: [lambda: ((_x(), 0.5, 2.0), {})],
    aten.native_dropout.default: [lambda: ((_x(), 0.3, True), {}), lambda: ((rnd(4, 6, 10, seed=2), 0.5, True), {}),
                                  lambda: ((_x(), 0.3, False), {})],
    aten.gelu_backward.default: _grad_pair(lambda x: x) + _grad_pair(lambda x: x, approximate="tanh")[:1],
    aten.silu_backward.default: _grad_pair(lambda x: x),
    aten.sigmoid_backward.default: _grad_pair(torch.sigmoid),
    aten.tanh_backward.default: _grad_pair(torch.tanh),
    aten.threshold_backward.default: [lambda: ((rnd(6, 5, seed=3), _x(), 0.0), {})],
    aten.native_layer_norm_backward.default: [_layer_norm_backward([True, True, True]),
                                              _layer_norm_backward([True, False, False]),
                                              _layer_norm_backward([False, True, True]),
                                              _layer_norm_backward([True, False, False], affine=False)],
    aten.convolution.default: [lambda: _conv(1), lambda: _conv(2), lambda: _conv(1, groups=2),
                               lambda: _conv(1, transposed=True)],
    aten.convolution_backward.default: [_conv_backward(1), _conv_backward(2, mask=(False, True, True)),
                                        _conv_backward(1, groups=2)],
    aten.embedding_dense_backward.default: [_embedding_backward(-1, False), _embedding_backward(3, False),
                                            _embedding_backward(9, True)],
}

# op -> OpInfo names whose samples, run forward and backward, call the op (the calls are recorded)
SOURCES: dict[Any, tuple[str, ...]] = {
    aten._adaptive_avg_pool2d.default: ("nn.functional.adaptive_avg_pool2d",),
    aten._adaptive_avg_pool2d_backward.default: ("nn.functional.adaptive_avg_pool2d",),
    aten._adaptive_avg_pool3d.default: ("nn.functional.adaptive_avg_pool3d",),
    aten._adaptive_avg_pool3d_backward.default: ("nn.functional.adaptive_avg_pool3d",),
    aten.adaptive_max_pool2d.default: ("nn.functional.adaptive_max_pool2d",),
    aten.adaptive_max_pool2d_backward.default: ("nn.functional.adaptive_max_pool2d",),
    aten.adaptive_max_pool3d.default: ("nn.functional.adaptive_max_pool3d",),
    aten.adaptive_max_pool3d_backward.default: ("nn.functional.adaptive_max_pool3d",),
    aten.avg_pool2d_backward.default: ("nn.functional.avg_pool2d",),
    aten.avg_pool3d_backward.default: ("nn.functional.avg_pool3d",),
    aten.max_pool2d_with_indices.default: ("nn.functional.max_pool2d",),
    aten.max_pool2d_with_indices_backward.default: ("nn.functional.max_pool2d",),
    aten.max_pool3d_with_indices.default: ("nn.functional.max_pool3d",),
    aten.max_pool3d_with_indices_backward.default: ("nn.functional.max_pool3d",),
    aten.upsample_bilinear2d.default: ("nn.functional.interpolate.bilinear",),
    aten.upsample_bilinear2d_backward.default: ("nn.functional.interpolate.bilinear",),
    aten._upsample_bilinear2d_aa_backward.default: ("_upsample_bilinear2d_aa",),
    aten.native_group_norm_backward.default: ("nn.functional.group_norm",),
    aten._embedding_bag.default: ("nn.functional.embedding_bag",),
    aten._embedding_bag_backward.default: ("nn.functional.embedding_bag",),
    aten._embedding_bag_per_sample_weights_backward.default: ("nn.functional.embedding_bag",),
    aten._fft_r2c.default: ("fft.rfft", "fft.rfft2"),
    aten._fft_c2c.default: ("fft.fft2", "fft.ifft"),
    aten._fft_c2r.default: ("fft.irfft", "fft.irfft2"),
    aten.view_as_real.default: ("view_as_real",),
    aten.index.Tensor: ("__getitem__", "index_put"),
    aten.polygamma.default: ("polygamma.polygamma_n_1", "polygamma.polygamma_n_2"),
}
