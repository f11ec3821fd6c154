"""Compression kernels with one public signature per op and several backends.

Every function validates its arguments, flattens its input (non-contiguous
input is copied to a contiguous one first, so it gives the same result as its
contiguous copy), allocates the outputs not given and calls its op,
``torch.ops.gradcomp.<name>`` (:mod:`gradcomp.kernels.ops`): the kernel
registered for the tensor's device (the fastest usable backend, see
:mod:`gradcomp.kernels.registry`), or directly the kernel of the backend named
by ``backend=`` / ``GRADCOMP_BACKEND``. The functions trace under
``torch.compile`` (``fullgraph=True``) when no backend is forced. The numerics
of every op are defined by :mod:`gradcomp.kernels.reference`; all backends
match it bit for bit.
"""

from __future__ import annotations

import torch

from gradcomp import _validate as v
from gradcomp import _validate as checks  # the DGC ops' state tensor is called v
from gradcomp.kernels._args import check_out as _check_out
from gradcomp.kernels._args import flat_contiguous as _flat
from gradcomp.kernels._args import nblocks as _nblocks
from gradcomp.kernels._args import stream_args as _stream
from gradcomp.kernels.lowbit import (dequantize_fp8, dequantize_fp8_add_, dequantize_packed,
                                     dequantize_packed_add_, dequantize_sign, dequantize_sign_add_, quantize_fp8,
                                     quantize_fp8_ef, quantize_packed, quantize_packed_ef, quantize_sign,
                                     quantize_sign_ef, reduce_quantize_packed)
from gradcomp.kernels.reference import quantize_outputs
from gradcomp.kernels.registry import available_backends, backend_name, select

__all__ = [
    "available_backends",
    "quantize_int8",
    "dequantize_int8",
    "dequantize_int8_add_",
    "quantize_int8_ef",
    "reduce_quantize_int8",
    "topk",
    "approx_topk",
    "threshold",
    "scatter_add_",
    "dgc_accumulate_",
    "dgc_topk_",
    "native_cpu",
    "quantize_packed",
    "quantize_packed_ef",
    "dequantize_packed",
    "dequantize_packed_add_",
    "reduce_quantize_packed",
    "quantize_sign",
    "quantize_sign_ef",
    "dequantize_sign",
    "dequantize_sign_add_",
    "quantize_fp8",
    "quantize_fp8_ef",
    "dequantize_fp8",
    "dequantize_fp8_add_",
]


def quantize_int8(
    x: torch.Tensor,
    block_size: int = 256,
    rounding: str = "nearest",
    seed: int = 0,
    counter: int = 0,
    *,
    out_q: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Blockwise symmetric absmax int8 quantization (Dettmers et al. 2022).

    Args:
        x: float32/float16/bfloat16/float64 tensor of any shape and device, n elements.
        block_size: elements per absmax block, a power of two in [32, 65536].
        rounding: ``"nearest"`` (half to even) or ``"stochastic"`` (unbiased, QSGD).
        seed, counter: the random stream ``(seed, counter)`` for stochastic rounding.
        out_q, out_scales: optional preallocated int8 ``[n]`` / float32 ``[ceil(n/block_size)]``.
        backend: force a backend (``"reference"``, ``"cpu"``, ``"triton"``, ``"cuda"``).

    Returns:
        ``(q, scales)``: int8 codes in [-127, 127] ``[n]`` and float32 scales
        ``[ceil(n / block_size)]`` on x's device. A block with NaN/Inf has scale NaN.

    Raises:
        TypeError: x not a floating tensor. ValueError: bad block_size / rounding / outputs.
        BackendUnavailable: the forced backend cannot run here.
    """
    v.tensor("x", x)
    block_size = v.block_size(block_size)
    rounding = v.rounding(rounding)
    seed = v.integer("seed", seed)
    counter = v.integer("counter", counter)
    n = x.numel()
    out_q = _check_out("out_q", out_q, n, torch.int8, x.device)
    out_scales = _check_out("out_scales", out_scales, _nblocks(n, block_size), torch.float32, x.device)
    fn = select("quantize_int8", x.device.type, backend)
    q, s = quantize_outputs(x, block_size, out_q, out_scales)
    fn(_flat(x), block_size, *_stream(rounding, seed, counter), q, s)
    return q, s


def _check_codes(q, scales, block_size):
    v.tensor("q", q, (torch.int8,))
    v.tensor("scales", scales, (torch.float32,))
    block_size = v.block_size(block_size)
    if scales.numel() != _nblocks(q.numel(), block_size):
        raise ValueError(
            f"scales must have ceil(q.numel() / block_size) = {_nblocks(q.numel(), block_size)} "
            f"elements, got {scales.numel()}"
        )
    if scales.device != q.device:
        raise ValueError(f"q and scales must be on one device, got {q.device} and {scales.device}")
    return block_size


def dequantize_int8(
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = 256,
    out: torch.Tensor | None = None,
    *,
    check_int8: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """``code * scale`` per element.

    Args:
        q: int8 ``[n]``; scales: float32 ``[ceil(n / block_size)]``, same device.
        out: optional contiguous float tensor of n elements (float32/16/bf16/64) to write.
        check_int8: raise :class:`~gradcomp.PayloadError` if a code is -128
            or a scale is negative or infinite (outside the format; for an
            unchecked payload, see :func:`gradcomp.wire.decode`). The native
            CPU kernel checks each block as it reads it, at no extra pass over
            memory, so other blocks may already have been written when it
            raises; other backends check in one pass before writing anything.
            Without it, codes and scales are read as they are.

    Returns:
        float32 ``[n]`` (or ``out``).

    Raises:
        gradcomp.PayloadError: ``check_int8`` and a code is -128 or a scale
            negative or infinite.
    """
    block_size = _check_codes(q, scales, block_size)
    if out is not None:
        v.tensor("out", out)
        if out.numel() != q.numel() or not out.is_contiguous() or out.device != q.device:
            raise ValueError(
                f"out must be a contiguous tensor of {q.numel()} elements on {q.device}, "
                f"got {out.numel()} elements on {out.device}"
            )
    v.flag("check_int8", check_int8)
    fn = select("dequantize_int8", q.device.type, backend)
    result = out if out is not None else torch.empty(q.numel(), dtype=torch.float32, device=q.device)
    fn(_flat(q), _flat(scales), block_size, check_int8, _flat(result))
    return result


def dequantize_int8_add_(
    acc: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = 256,
    *,
    check_int8: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """``acc += code * scale`` in place. acc: contiguous float32 with ``q.numel()``
    elements; ``check_int8`` as :func:`dequantize_int8` (with the native CPU
    kernel, ``acc`` may then hold a partial sum when it raises)."""
    block_size = _check_codes(q, scales, block_size)
    flat = _check_out("acc", acc, q.numel(), torch.float32, q.device)
    v.flag("check_int8", check_int8)
    select("dequantize_int8_add_", q.device.type, backend)(flat, _flat(q), _flat(scales), block_size, check_int8)
    return acc


def quantize_int8_ef(
    x: torch.Tensor,
    residual: torch.Tensor,
    block_size: int = 256,
    rounding: str = "nearest",
    seed: int = 0,
    counter: int = 0,
    *,
    out_q: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Fused error-feedback quantization in one pass (Seide et al. 2014;
    Karimireddy et al. 2019): ``p = x + residual; (q, s) = Q(p);
    residual <- p - D(q, s)``.

    Args:
        x: floating tensor, n elements. residual: contiguous float32, n elements,
            same device; updated in place.
        Others as :func:`quantize_int8`.

    Returns:
        ``(q, scales)`` as :func:`quantize_int8`.
    """
    v.tensor("x", x)
    res = _check_out("residual", residual, x.numel(), torch.float32, x.device)
    block_size = v.block_size(block_size)
    rounding = v.rounding(rounding)
    seed = v.integer("seed", seed)
    counter = v.integer("counter", counter)
    n = x.numel()
    out_q = _check_out("out_q", out_q, n, torch.int8, x.device)
    out_scales = _check_out("out_scales", out_scales, _nblocks(n, block_size), torch.float32, x.device)
    fn = select("quantize_int8_ef", x.device.type, backend)
    q, s = quantize_outputs(x, block_size, out_q, out_scales)
    fn(_flat(x), res, block_size, *_stream(rounding, seed, counter), q, s)
    return q, s


def reduce_quantize_int8(
    acc: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = 256,
    divisor: int = 1,
    rounding: str = "nearest",
    seed: int = 0,
    counter: int = 0,
    *,
    out_q: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    decode: bool = False,
    check_int8: bool = False,
    backend: str | None = None,
):
    """One reduce step of a compressed collective (a ring hop, an owner's final
    sum): add decoded codes, divide, requantize, and optionally decode.

    Defined as the composition of the ops above, with the same results bit for bit::

        dequantize_int8_add_(acc, q, scales, block_size)
        if divisor != 1: acc.div_(divisor)
        q2, s2 = quantize_int8(acc, block_size, rounding, seed, counter)
        if decode: dequantize_int8(q2, s2, block_size, out=acc)

    The native CPU backend runs it in one pass per block (``acc`` read and
    written once); on other backends it is that composition of their ops.

    Args:
        acc: contiguous float32 tensor, n elements; on return it holds the
            reduced values (``decode=False``) or the decoded codes ``q2 * s2``
            (``decode=True``: what every receiver of the result decodes).
        q, scales: int8 ``[n]`` / float32 ``[ceil(n / block_size)]`` codes to
            add, on acc's device (their block size is ``block_size`` too).
        divisor: positive integer the sum is divided by (``1``: no division).
        rounding, seed, counter: as :func:`quantize_int8`.
        out_q, out_scales: optional preallocated outputs for ``(q2, s2)``.
        check_int8: as :func:`dequantize_int8` for ``q`` and ``scales`` (with the native CPU
            kernel, ``acc`` may then hold partly reduced values when it raises).
        backend: force a backend, as for the other ops.

    Returns:
        ``(q2, s2)`` as :func:`quantize_int8`.

    Raises:
        TypeError / ValueError: bad arguments (as the composed ops).
        gradcomp.PayloadError: ``check_int8`` and a code of ``q`` is -128 or
            a scale negative or infinite.
    """
    block_size = _check_codes(q, scales, block_size)
    flat = _check_out("acc", acc, q.numel(), torch.float32, q.device)
    divisor = v.integer("divisor", divisor, 1, 2**24)  # exact in float32
    v.flag("check_int8", check_int8)
    v.flag("decode", decode)
    rounding = v.rounding(rounding)
    seed = v.integer("seed", seed)
    counter = v.integer("counter", counter)
    n = acc.numel()
    out_q = _check_out("out_q", out_q, n, torch.int8, acc.device)
    out_scales = _check_out("out_scales", out_scales, _nblocks(n, block_size), torch.float32, acc.device)
    fn = select("reduce_quantize_int8", acc.device.type, backend)
    q2, s2 = quantize_outputs(flat, block_size, out_q, out_scales)
    fn(flat, _flat(q), _flat(scales), block_size, divisor, *_stream(rounding, seed, counter), decode, check_int8,
       q2, s2)
    return q2, s2


def _check_k(x, k):
    k = v.integer("k", k, 0)
    if k > x.numel():
        raise ValueError(f"k must be <= x.numel() = {x.numel()}, got {k}")
    return k


def topk(x: torch.Tensor, k: int, *, backend: str | None = None):
    """Exact top-k by magnitude: the k elements with the largest ``|x|`` (ties:
    lower index first; NaN counts as largest), by radix select in the native backends.

    Returns:
        ``(indices, values)``: ascending indices (int32 if n < 2**31 else int64)
        and the values there in x's dtype, on x's device.
    """
    v.tensor("x", x)
    k = _check_k(x, k)
    return select("topk", x.device.type, backend)(_flat(x), k)


def approx_topk(x: torch.Tensor, k: int, *, backend: str | None = None):
    """Approximate top-k by a sampled threshold (Deep Gradient Compression, Lin
    et al. 2018): a top set of size in ``[ceil(0.9 k), floor(1.1 k)]``.

    Returns:
        ``(indices, values)`` as :func:`topk`.
    """
    v.tensor("x", x)
    k = _check_k(x, k)
    return select("approx_topk", x.device.type, backend)(_flat(x), k)


def threshold(x: torch.Tensor, tau: float, *, backend: str | None = None):
    """Every element with ``|x| >= tau`` (and every NaN), by stream compaction.

    Args:
        tau: non-negative threshold (compared in float32, float64 for float64 x).

    Returns:
        ``(indices, values)`` as :func:`topk`; zero kept elements is valid.
    """
    v.tensor("x", x)
    tau = v.real("tau", tau)
    if not tau >= 0 or tau == float("inf"):
        raise ValueError(f"tau must be a finite number >= 0, got {tau}")
    return select("threshold", x.device.type, backend)(_flat(x), tau)


def scatter_add_(
    acc: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, backend: str | None = None
) -> torch.Tensor:
    """``acc.view(-1)[indices] += values`` in place (float32 accumulate).

    Args:
        acc: contiguous float32 tensor. indices: int32/int64 in [0, acc.numel()).
        values: floating tensor with ``indices.numel()`` elements, same device.
    """
    v.tensor("acc", acc, (torch.float32,))
    v.tensor("indices", indices, (torch.int32, torch.int64))
    v.tensor("values", values)
    if not acc.is_contiguous():
        raise ValueError("acc must be contiguous")
    if indices.numel() != values.numel():
        raise ValueError(
            f"indices and values must have the same numel, got {indices.numel()} and {values.numel()}"
        )
    if indices.device != acc.device or values.device != acc.device:
        raise ValueError("acc, indices and values must be on one device")
    select("scatter_add_", acc.device.type, backend)(_flat(acc), _flat(indices), _flat(values))
    return acc


def native_cpu(device: torch.device, backend: str | None = None):
    """The native CPU backend module (:mod:`gradcomp.kernels.cpu`) when it is
    the backend for tensors on ``device`` (given ``backend`` /
    ``GRADCOMP_BACKEND``), else None: the extras outside the ops (Elias-Fano
    index coding) use it then, and their torch version otherwise."""
    if backend_name("topk", torch.device(device).type, backend) != "cpu":
        return None
    from gradcomp.kernels import cpu

    return cpu


def _check_dgc(g, u, v_):
    for name, t in (("g", g), ("u", u), ("v", v_)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a float32 tensor, got {got}")
    return [_check_out(name, t, g.numel(), torch.float32, g.device) for name, t in (("u", u), ("v", v_))]


def dgc_accumulate_(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: float, scale: float = 1.0,
                    *, backend: str | None = None) -> None:
    """Deep Gradient Compression's momentum correction (Lin et al. 2018) in place:
    ``u = u * momentum + g * scale; v += u`` (the velocity ``u`` and the
    accumulated velocity ``v``, Algorithm 1 of the paper).

    One fused pass with the native CPU backend, bit for bit the reference
    (:func:`gradcomp.kernels.reference.dgc_accumulate_`) on every backend.

    Args:
        g: float32 tensor, n elements (the gradient, already clipped or to be
            scaled by ``scale``). u, v: contiguous float32 tensors of n
            elements on g's device, updated in place.
        momentum: the momentum factor m. scale: factor applied to g
            (clipping), ``1.0`` for none.

    Raises:
        TypeError / ValueError: wrong dtypes, sizes or devices.
    """
    uf, vf = _check_dgc(g, u, v)
    momentum, scale = checks.real("momentum", momentum), checks.real("scale", scale)
    select("dgc_accumulate_", g.device.type, backend)(_flat(g), uf, vf, momentum, scale)


def dgc_topk_(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: float, scale: float, k: int,
              *, backend: str | None = None):
    """:func:`dgc_accumulate_` followed by :func:`topk` of the updated ``v``:
    one fused pass with the native CPU backend (the top-k's compaction runs
    inside the accumulation), the two ops elsewhere; the same results.

    Returns:
        ``(indices, values)`` of the k largest ``|v|`` as :func:`topk`.
    """
    uf, vf = _check_dgc(g, u, v)
    momentum, scale = checks.real("momentum", momentum), checks.real("scale", scale)
    return select("dgc_topk_", g.device.type, backend)(_flat(g), uf, vf, momentum, scale, _check_k(v, k))


def __dir__():
    # the public API only: not the helpers and modules this package imports to implement it
    return sorted(__all__)
