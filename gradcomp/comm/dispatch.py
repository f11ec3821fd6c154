"""The compressed allreduce: argument checks, the agreement, then one algorithm's module.

See :func:`allreduce`; the algorithms live one per module (:mod:`gradcomp.comm.ring`,
:mod:`gradcomp.comm.two_phase`, :mod:`gradcomp.comm.pipelined`, :mod:`gradcomp.comm.allgather`).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp.comm import allgather as _allgather
from gradcomp.comm import checked as _checked
from gradcomp.comm import pipelined as _pipelined
from gradcomp.comm import ring as _ring
from gradcomp.comm import two_phase as _two_phase
from gradcomp.comm._args import ALGORITHMS, DEFAULT_TIMEOUT, check_args, member_group
from gradcomp.comm.agreement import call_identity
from gradcomp.comm.dense import Plan, share_owned
from gradcomp.comm.guard import exclusive
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm
from gradcomp.comm.policy import CodecPolicy
from gradcomp.compressors import Compressor, ErrorFeedback

__all__ = ["allreduce"]

_REDUCE_SCATTER = {"ring": _ring.reduce_scatter, "two_phase": _two_phase.reduce_scatter}

def allreduce(
    tensor: torch.Tensor,
    compressor: Compressor | ErrorFeedback | CodecPolicy,
    *,
    op: str = "avg",
    algorithm: str = "ring",
    group=None,
    meter=None,
    timeout: float = DEFAULT_TIMEOUT,
    key: Hashable = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check: bool = True,
    tag: str | int | None = None,
) -> torch.Tensor:
    """Compressed allreduce: every rank returns the same (bit-identical) tensor.

    All ranks of ``group`` must call it with tensors of the same shape and
    dtype, the same compressor settings, ``op``, ``algorithm`` and ``tag``,
    in the same order (like any collective). With ``check=True`` (the
    default) a call verifies that they did (its signature: the number of
    elements, ``op``, ``algorithm``, the compressor type, every message's
    size, the tag or calling thread; :mod:`gradcomp.comm.agreement`) whenever
    it differs from the last call the group's ranks agreed on, and, if not,
    every rank raises the same ``ValueError`` before any payload moves and the
    group stays usable, also when only one rank changed its call
    (:mod:`gradcomp.comm.replay`). The input is widened to float32 (so
    payloads carry float32 tensors: :class:`~gradcomp.NoCompression` moves 4
    bytes per element whatever the input dtype), sums are accumulated in
    float32, and the result is cast back to the input's dtype.

    Algorithms (see the modules for details and sources):

    * ``"ring"`` (dense compressors): ring reduce-scatter, each hop
      decompresses, adds its local chunk in float32 and recompresses; the
      chunk's owner compresses the final sum once and those bytes are
      forwarded unchanged to every rank. Each element goes through ``N``
      quantizations.
    * ``"two_phase"`` (dense compressors): each rank compresses every chunk
      once and sends it to the chunk's owner, which sums in float32 (its own
      chunk uncompressed), compresses the sum once and shares it like the
      ring. Two quantizations at most; same bytes as the ring.
    * ``"allgather"`` (sparse compressors: TopK, Threshold): payload sizes are
      exchanged, payloads gathered over the ring unchanged, and every rank sums
      the union in float32 in rank order.

    Every rank ends bit-identical because each chunk's final value is the
    decompression of one set of bytes that every rank (its owner included)
    decodes the same way. With ``group`` of size 1 the result is a copy of
    ``tensor`` (the compressor is not called, no byte is sent, error-feedback
    state is left as it is).

    Error feedback (what a rank remembers is the error of compressing its
    *own* data alone; partial and final sums are compressed without it; see
    :mod:`gradcomp.comm.local`):

    * ``compressor`` an :class:`~gradcomp.ErrorFeedback`: residual key
      ``(key, j)`` for chunk ``j`` that this rank compresses alone (the ring:
      chunk ``rank - 1 mod N``; two-phase: every chunk but ``rank``);
      ``key`` itself for the allgather algorithm (the whole tensor).
    * ``residual``: a flat float32 memory for the whole tensor, updated in
      place: compressed ranges keep their compression error, ranges added
      exactly are delivered with their residual, which resets to zero.

    Traffic: ``meter`` records the bytes this rank really sent and received
    per phase (``"reduce_scatter"``, ``"allgather"``, ``"agreement"``,
    ``"sizes"``) and, as
    raw bytes, what a float32 ring allreduce over the same chunks would have
    moved: ``4 (2 n - len_rank - len_{rank+1})`` bytes sent per rank, i.e.
    ``2 (N - 1) / N * 4 n`` when ``N`` divides ``n``
    (:func:`gradcomp.comm.chunks.ring_raw_bytes`).

    Args:
        tensor: float32/float16/bfloat16 tensor of any shape (any number of
            elements, 0 included) on the group's device (CPU for gloo, the
            current CUDA device for NCCL). Not modified.
        compressor: a gradcomp compressor: dense (NoCompression, FP16, BF16,
            Int8Quantizer) for ``"ring"`` / ``"two_phase"``, sparse (TopK,
            Threshold) for ``"allgather"``; optionally wrapped in ErrorFeedback.
            Or a :class:`~gradcomp.comm.policy.CodecPolicy` such as
            :class:`gradcomp.Adaptive`, which picks the compressor of each
            call (``algorithm`` is then the algorithm of its dense choices;
            see :meth:`gradcomp.Adaptive.allreduce`).
        op: ``"avg"`` (divide the sum by the group size) or ``"sum"``.
        algorithm: ``"ring"``, ``"two_phase"`` or ``"allgather"``.
        group: a torch.distributed process group (default: the world).
        meter: optional :class:`~gradcomp.TrafficMeter`.
        timeout: seconds each exchange may take (> 0, finite, at most 1e9).
        key: residual key prefix for an ErrorFeedback compressor; default
            ``("numel", n)``: one ErrorFeedback reused without a key for
            tensors of different sizes keeps one residual per size, the same
            on every rank (an explicit key must name one tensor).
        residual: optional contiguous float32 tensor with ``tensor.numel()``
            elements on ``tensor``'s device (not with an ErrorFeedback compressor).
        out: optional contiguous tensor with ``tensor``'s shape, dtype and
            device to write the result to; it may be ``tensor`` itself (an
            in-place allreduce, like ``dist.all_reduce``). For float32 it is
            also the accumulation workspace, so no n-element buffer is allocated.
        check: exchange a 56-byte signature with every other rank first
            when it differs from the last one the group agreed on (see above
            and :mod:`gradcomp.comm.agreement`): one small round trip, paid
            once by a loop that reduces the same tensor every step; a loop
            alternating between different calls on one group pays it on
            every call, plus its disagreement envelopes (at most 8 bytes per
            message piece of the previous call's reduce-scatter). Like the
            other arguments it must be the same on every rank. ``False``:
            never (the DDP hook checks its first bucket, then relies on DDP's
            identical bucket layout on every rank); a disagreement then aborts
            the process (gloo) or returns different values on different
            ranks. (``"allgather"`` also exchanges payload sizes, 8 bytes per
            peer, on every call.)
        tag: what tells this call apart from other calls on ``group`` (a str
            or an int, the same on every rank); None: the calling thread's
            name. Calls with different tags (or, untagged, from differently
            named threads) never pair silently: when one rank's call meets
            another's, every rank raises ``ValueError``. Calls of several
            threads on one group run one at a time (a second thread's call
            waits for the first, :mod:`gradcomp.comm.guard`); give each
            thread its own group (``torch.distributed.new_group``) to run
            them concurrently.

    Returns:
        ``out`` if given, else a new tensor with ``tensor``'s shape, dtype and device.

    Raises:
        TypeError: ``tensor`` is not a float32/float16/bfloat16 tensor, or
            ``compressor`` is not a gradcomp compressor.
        TypeError: ``tag`` is not None, a str or an int.
        ValueError: unknown ``op`` / ``algorithm``; a sparse compressor with a
            dense algorithm or a dense one with ``"allgather"``; a dense
            compressor without a fixed wire size; a bad ``residual`` or
            ``timeout``; this process is not in ``group``; the ranks of the
            group passed different numels, ops, algorithms, compressor
            settings or tags (raised on every rank, also when only one rank
            changed its call since the group's last agreement).
        RuntimeError: another thread of this process held ``group`` for
            more than ``timeout`` seconds, or this thread is already in a
            collective on it (nothing sent); the transport failed (see below).
        TimeoutError: a transfer did not finish within ``timeout`` seconds
            (also when ranks passed different ``check`` values; after any
            error other than the agreement's ``ValueError`` the group is not
            safe to use again).
        RuntimeError: the transport failed (e.g. a peer died, or a peer that
            timed out closed its connections first).
        gradcomp.PayloadError: a peer sent malformed bytes.
    """
    call_identity(tag)  # a bad tag raises here
    if isinstance(compressor, CodecPolicy):  # it checks its arguments and agrees on its settings
        return compressor.allreduce(tensor, op=op, algorithm=algorithm, group=group, meter=meter,
                                    timeout=timeout, key=key, residual=residual, out=out, check=check, tag=tag)
    check_args(tensor, compressor, op, algorithm, timeout, residual, out, meter)
    v.flag("check", check)
    group = member_group(group, "gradcomp.allreduce")
    x = tensor.detach()
    if dist.get_world_size(group) == 1:
        if out is None:
            return x.clone(memory_format=torch.contiguous_format)
        return out.copy_(x) if out.data_ptr() != x.data_ptr() else out
    with exclusive(group, timeout=timeout):
        return _allreduce(tensor, x, compressor, op, algorithm, group, meter, timeout, key, residual, out, check,
                          tag)


def _allreduce(tensor, x, compressor, op, algorithm, group, meter, timeout, key, residual, out, check, tag):
    comm = Comm(group, timeout, meter)
    n = x.numel()
    # float32 temporaries come from the buffer pool (a fresh multi-MiB tensor
    # page-faults on first write, every call)
    if x.dtype == torch.float32:
        flat = x.reshape(-1)
    else:
        flat = comm.buffer(4 * n, x.device).view(torch.float32)
        flat.view(x.shape).copy_(x)
    if out is not None and out.dtype == torch.float32:
        work = out.detach().view(-1)
    elif out is None and x.dtype == torch.float32:
        work = torch.empty(n, dtype=torch.float32, device=x.device)  # the result itself
    else:
        work = comm.buffer(4 * n, x.device).view(torch.float32)
    # the default key (used by an ErrorFeedback only): one reused for tensors of
    # several sizes keeps a residual per size
    local = Local(flat, compressor, ("numel", n) if key is None else key, residual)
    plan = None if algorithm == "allgather" else Plan(n, comm.world_size, local.inner)
    pipelined = plan is not None and algorithm == "ring" and _pipelined.applies(local, plan)
    sig = _checked.call_signature("gradcomp.allreduce", n, op, ALGORITHMS.index(algorithm), local.inner, plan,
                         _pipelined.segment_count(plan) if pipelined else 0, tag)

    def body() -> None:
        if algorithm == "allgather":
            _allgather.allreduce(comm, local, work, op)
        elif pipelined:
            _pipelined.allreduce(comm, local, plan, work, op)
        else:
            pending = _REDUCE_SCATTER[algorithm](comm, local, plan, work)
            share_owned(comm, plan, work, op, pending)

    _checked.run(comm, sig, body, device=x.device, check=check)
    if out is None:
        result = work.to(tensor.dtype).view(tensor.shape)  # work itself for float32
    else:
        result = out
        if work.data_ptr() != out.data_ptr():
            out.view(-1).copy_(work)
    comm.release()  # after the last read of pooled buffers
    return result
