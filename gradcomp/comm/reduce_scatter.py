"""Compressed reduce-scatter: each rank ends with the reduced chunk it owns.

The first phase of the ``two_phase`` allreduce on its own
(:func:`gradcomp.comm.two_phase.reduce_scatter`; SparCML, Renggli et al.
2019; CGX, Markov et al. 2022): every rank compresses each chunk ``j != rank``
of its data once and sends it to chunk ``j``'s owner, which sums in float32
(its own chunk exact, the others' payloads decompressed in rank order). The
owner's sum is the result: it is not compressed again, so every element of
the result carries exactly one quantization per sending rank. This is the
collective FSDP uses for gradients (:mod:`gradcomp.fsdp`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp import timeline as _timeline
from gradcomp import wire as W
from gradcomp.comm import two_phase as _two_phase
from gradcomp.comm._args import (DEFAULT_TIMEOUT, INPUT_DTYPES, NAMES, OPS, check_args,
                                 member_group)
from gradcomp.comm.agreement import agree, forget, needs_check
from gradcomp.comm.chunks import chunk_bounds
from gradcomp.comm.dense import Plan
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm
from gradcomp.compressors import Compressor, ErrorFeedback, split

__all__ = ["reduce_scatter", "agree_settings", "AGREEMENT_CODE"]

#: the ``algorithm`` code this collective agrees under (the allreduce
#: algorithms use their index in ``ALGORITHMS``, the backend's allreduce the
#: next one), so a rank calling it while another calls
#: :func:`gradcomp.allreduce` gets a ValueError, not a mismatched transfer
AGREEMENT_CODE = 64


def reduce_scatter(
    tensor: torch.Tensor,
    compressor: Compressor | ErrorFeedback,
    *,
    op: str = "avg",
    factor: float = 1.0,
    group=None,
    meter=None,
    timeout: float | None = None,
    key: Hashable = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Compressed reduce-scatter of a flat tensor; this rank gets its chunk of the sum.

    The ``n`` elements of ``tensor`` (flattened) are cut into one chunk per
    rank of ``group`` (:func:`gradcomp.comm.chunks.chunk_bounds`: the first
    ``n mod N`` chunks one element longer); rank ``r`` returns chunk ``r`` of
    the sum over all ranks, divided by ``N`` for ``op="avg"``, times ``factor``.
    Every rank quantizes each other rank's chunk of its own data once and
    sends those bytes to that chunk's owner; the owner adds them in float32 to
    its own chunk (exact) in rank order. With :class:`~gradcomp.Int8Quantizer`
    (nearest rounding) each element of the sum is off by at most
    ``sum over ranks s != r of 0.5 * A_s / 127`` (``A_s``: absmax of rank
    ``s``'s block of ``block_size`` elements holding it, blocks counted from
    the chunk's start) before the division, plus float32 rounding.

    All ranks must call it with the same number of elements, compressor
    settings, ``op`` and ``factor``, in the same order. ``check`` verifies all
    but ``factor`` as :func:`gradcomp.allreduce` does (one 40-byte message to
    each peer when the call differs from the last one the group agreed on;
    every rank raises the same ValueError on a mismatch, before anything moves).

    Error feedback, as in :func:`gradcomp.allreduce`: an
    :class:`~gradcomp.ErrorFeedback` compressor keeps residual ``(key, j)``
    for each chunk ``j != rank``; or ``residual`` (flat float32, ``n``
    elements) is updated in place: chunks ``j != rank`` keep their
    compression error, chunk ``rank`` is added exactly and reset to zero.

    Traffic: ``N - 1`` payloads sent and received per rank in meter phase
    ``"reduce_scatter"``, raw bytes ``4 * (n - len_rank)`` sent (a float32
    ring reduce-scatter over the same chunks), plus ``"agreement"``.

    Args:
        tensor: float32/float16/bfloat16 tensor of any shape on the group's
            device (CPU for gloo, the current CUDA device for NCCL). Not modified.
        compressor: a dense gradcomp compressor with a fixed wire size
            (NoCompression, FP16, BF16, Int8Quantizer), optionally in ErrorFeedback.
        op: ``"avg"`` or ``"sum"``.
        factor: finite float multiplying the result (FSDP's ``PREMUL_SUM``).
        group: a torch.distributed process group (default: the world).
        meter: optional :class:`~gradcomp.TrafficMeter`.
        timeout: seconds each exchange may take (default
            :data:`gradcomp.comm.DEFAULT_TIMEOUT`).
        key: residual key prefix for an ErrorFeedback compressor.
        residual: optional contiguous float32 tensor of ``n`` elements on
            ``tensor``'s device (not with an ErrorFeedback compressor).
        out: optional contiguous float32/float16/bfloat16 tensor of
            ``len_rank`` elements on ``tensor``'s device to write the result to.
        check: agree with the other ranks first (see above).

    Returns:
        ``out`` if given, else a new 1-D tensor of ``len_rank`` elements with
        ``tensor``'s dtype.

    Raises:
        TypeError / ValueError: bad arguments (as :func:`gradcomp.allreduce`;
            a sparse compressor; a bad ``out`` or ``factor``); the ranks passed
            different numels, ops or compressors (raised on every rank).
        TimeoutError / RuntimeError / gradcomp.PayloadError: as
            :func:`gradcomp.allreduce`.
    """

    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    check_args(tensor, compressor, op, "two_phase", timeout, residual, None, meter)
    v.flag("check", check)
    factor = v.real("factor", factor)
    if not math.isfinite(factor):
        raise ValueError(f"factor must be a finite number, got {factor}")
    group = member_group(group, "gradcomp reduce_scatter")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = tensor.numel()
    lo, hi = chunk_bounds(n, world)[rank]
    _check_out(out, hi - lo, tensor.device)
    x = tensor.detach()
    if world == 1:
        result = x.reshape(-1).to(torch.float32).mul(factor)
        return result.to(tensor.dtype) if out is None else out.copy_(result)
    comm = Comm(group, timeout, meter)
    if x.dtype == torch.float32:
        flat = x.reshape(-1)
    else:
        flat = comm.buffer(4 * n, x.device).view(torch.float32)
        flat.view(x.shape).copy_(x)
    if out is not None and out.dtype == torch.float32:
        own = out.view(-1)
    elif out is None and x.dtype == torch.float32:
        own = torch.empty(hi - lo, dtype=torch.float32, device=x.device)  # the result itself
    else:
        own = comm.buffer(4 * (hi - lo), x.device).view(torch.float32)
    local = Local(flat, compressor, key, residual)
    plan = Plan(n, world, local.inner)
    try:
        if check:
            agree_settings(comm, n, local.inner, op, x.device)  # before anything changes
        pending = _two_phase.reduce_scatter(comm, local, plan, None, own=own)
        with _timeline.span("decompress"):
            local.inner.decompress_add_(plan.received(pending), own)
    except BaseException:
        forget(group)
        raise
    if op == "avg":
        own.div_(world)
    if factor != 1.0:
        own.mul_(factor)
    if out is None:
        result = own if own.dtype == tensor.dtype else own.to(tensor.dtype)  # a fresh tensor for float32
    else:
        result = out
        if own.data_ptr() != out.data_ptr():
            out.view(-1).copy_(own)
    comm.release()  # after the last read of pooled buffers
    return result


def agree_settings(comm: Comm, numel: int, compressor: Compressor, op: str, device) -> None:
    """The agreement :func:`reduce_scatter` makes with ``check=True``, on its own.

    Every rank of ``comm``'s group sends the descriptor of a reduce-scatter
    of ``numel`` elements with ``compressor`` and ``op`` (40 bytes to each
    peer, meter phase ``"agreement"``) unless it equals the one the group last
    agreed on; a later :func:`reduce_scatter` with the same settings then skips it.

    Raises:
        ValueError: the ranks passed different numels, ops or compressor
            settings (raised on every rank).
        TimeoutError / RuntimeError: as :func:`gradcomp.comm.agreement.agree`.
    """

    inner, _ = split(compressor)
    wire = sum(inner.wire_nbytes((hi - lo,), torch.float32) for lo, hi in chunk_bounds(numel, comm.world_size))
    descriptor = {"numel": numel, "op": OPS.index(op), "algorithm": AGREEMENT_CODE,
                  "codec": W.codec(inner.codec).id, "wire_nbytes": wire}
    if needs_check(comm.group, descriptor):
        names = dict(NAMES, algorithm={**NAMES["algorithm"], AGREEMENT_CODE: "reduce_scatter"})
        agree(comm, descriptor, names, device=device)


def _check_out(out, numel: int, device) -> None:
    if out is None:
        return

    if (not isinstance(out, torch.Tensor) or out.dtype not in INPUT_DTYPES or out.numel() != numel
            or out.device != torch.device(device) or not out.is_contiguous()):
        got = (f"{out.dtype} with {out.numel()} elements on {out.device}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"out must be a contiguous float32/float16/bfloat16 tensor of {numel} elements "
                         f"(this rank's chunk) on {device}, got {got}")
