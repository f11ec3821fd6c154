"""Compressed collectives on torch.distributed process groups.

:func:`allreduce` dispatches to one of three algorithms, all built on
point-to-point ``isend`` / ``irecv`` of wire bytes (:mod:`gradcomp.comm.p2p`)
on any process group (gloo on CPU, NCCL on GPU):

* ``"ring"``: ring reduce-scatter with a decompress-add-recompress per hop
  (:mod:`gradcomp.comm.ring`), then the owner's bytes forwarded around the ring;
  pipelined in segments for large tensors when the compressor writes payloads
  in parts (:mod:`gradcomp.comm.pipelined`: int8 with nearest rounding);
* ``"two_phase"``: direct compressed reduce-scatter, one compression per chunk
  (:mod:`gradcomp.comm.two_phase`), then the same allgather;
* ``"allgather"``: for sparse compressors, every rank's payload gathered and
  the union summed (:mod:`gradcomp.comm.allgather`);
* ``"hierarchical"``: exact reduce-scatter inside each host, the compressed
  ring or two-phase allreduce of each shard across hosts, allgather inside
  the host (:mod:`gradcomp.comm.hierarchical`, hosts from
  :mod:`gradcomp.comm.topology`).

:func:`reduce_scatter` is the two-phase reduce-scatter on its own
(:mod:`gradcomp.comm.reduce_scatter`), for sharded data parallelism.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from gradcomp.comm import allgather as _allgather
from gradcomp.comm import hierarchical as _hierarchical
from gradcomp.comm import pipelined as _pipelined
from gradcomp.comm.agreement import (Disagreement, agree, forget, needs_check, pattern, remember_pattern,
                                     replay)
from gradcomp.comm import ring as _ring
from gradcomp.comm import two_phase as _two_phase
from gradcomp.comm.chunks import chunk_bounds, ring_raw_bytes
from gradcomp.comm.dense import Plan, share_owned
from gradcomp.comm.guard import exclusive
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm
from gradcomp.comm.policy import CodecPolicy
from gradcomp.comm.reduce_scatter import reduce_scatter
from gradcomp.comm.topology import INTER_ALGORITHMS, Topology, layout
from gradcomp import _validate as v
from gradcomp import wire as W
from gradcomp.compressors import Compressor, ErrorFeedback, split
from gradcomp.meter import TrafficMeter

__all__ = ["allreduce", "reduce_scatter", "ALGORITHMS", "DENSE_ALGORITHMS", "FLAT_DENSE_ALGORITHMS", "OPS",
           "INPUT_DTYPES", "DEFAULT_TIMEOUT", "CodecPolicy", "Topology", "chunk_bounds", "ring_raw_bytes"]

#: every algorithm name
ALGORITHMS = ("ring", "two_phase", "allgather", "hierarchical")
#: algorithms for dense compressors (fixed wire sizes)
DENSE_ALGORITHMS = ("ring", "two_phase", "hierarchical")
#: dense algorithms over one flat group (the adaptive policy's, the hierarchical inter-host leg's)
FLAT_DENSE_ALGORITHMS = INTER_ALGORITHMS
#: reduction ops
OPS = ("avg", "sum")
#: accepted input dtypes (everything is accumulated in float32)
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: default seconds one exchange may take before TimeoutError
DEFAULT_TIMEOUT = 300.0

#: the agreement's algorithm code of the backend's own allreduce (:mod:`gradcomp.comm.native`)
NATIVE = 3

_REDUCE_SCATTER = {"ring": _ring.reduce_scatter, "two_phase": _two_phase.reduce_scatter}
# how a disagreement names the codes of the agreement's fields
_NAMES = {"op": dict(enumerate(OPS)),
          "algorithm": {**dict(enumerate(ALGORITHMS[:3])), NATIVE: "native",
                        **{_hierarchical.AGREEMENT_CODE + i: f"hierarchical ({a} across hosts)"
                           for i, a in enumerate(INTER_ALGORITHMS)}},
          "codec": {c.id: c.name for c in W.CODECS.values()}}


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
    topology: Topology | None = None,
) -> torch.Tensor:
    """Compressed allreduce: every rank returns the same (bit-identical) tensor.

    All ranks of ``group`` must call it with tensors of the same shape and
    dtype, the same compressor settings, ``op`` and ``algorithm``, in the
    same order (like any collective). With ``check=True`` (the default) a
    call verifies that they did (the number of elements, ``op``,
    ``algorithm``, the compressor type and payload size:
    :mod:`gradcomp.comm.agreement`) whenever these differ from the last call
    the group's ranks agreed on, and, if not, every rank raises the same
    ``ValueError`` before any payload moves. The input is widened to float32 (so
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
    * ``"hierarchical"`` (dense compressors; :mod:`gradcomp.comm.hierarchical`):
      hosts of ``R`` ranks each (``topology``); an exact float32
      reduce-scatter inside each host, the compressed allreduce (the
      topology's ``inter_algorithm``, ring or two-phase) of each local rank's
      shard across hosts, an allgather inside the host. Only the slow links
      between hosts carry compressed bytes: ``2 (H - 1) / H`` times the
      compressed bucket per host. The first call on a group with a topology
      resolves it (collective; cached); with ``check=True`` the ranks agree
      on every call (a rank that skipped it would wait in the backend's
      intra-host collective, where no disagreement envelope reaches it).

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
      ``key`` itself for the allgather algorithm (the whole tensor);
      ``(("hierarchical", key), j)`` for chunk ``j`` of this rank's shard
      on the inter-host leg (the only leg that compresses).
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
        algorithm: ``"ring"``, ``"two_phase"``, ``"allgather"`` or ``"hierarchical"``.
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
        check: exchange a 40-byte descriptor with every other rank first
            when it differs from the last one the group agreed on (see above
            and :mod:`gradcomp.comm.agreement`): one small round trip, about
            1-3 ms on gloo over loopback on a busy 2-core host, paid once by a
            loop that reduces the same tensor every step (but on every call
            by one alternating between different calls on one group: give
            each its own group). Like the other
            arguments it must be the same on every rank. ``False``: never
            (the DDP hook checks its first bucket, then relies on DDP's
            identical bucket layout on every rank); a disagreement then aborts
            the process (gloo) or returns different values on different
            ranks. (``"allgather"`` also exchanges payload sizes, 8 bytes per
            peer, on every call.)
        topology: a :class:`gradcomp.Topology` for ``"hierarchical"`` (None:
            the hosts come from the environment, ``GRADCOMP_HOST_ID`` or
            torchrun's ``GROUP_RANK`` / ``LOCAL_WORLD_SIZE``); must be None
            with the other algorithms.

    Returns:
        ``out`` if given, else a new tensor with ``tensor``'s shape, dtype and device.

    Raises:
        TypeError: ``tensor`` is not a float32/float16/bfloat16 tensor, or
            ``compressor`` is not a gradcomp compressor.
        ValueError: unknown ``op`` / ``algorithm``; a sparse compressor with a
            dense algorithm or a dense one with ``"allgather"``; a dense
            compressor without a fixed wire size; a bad ``residual`` or
            ``timeout``; this process is not in ``group``; the ranks of the
            group passed different numels, ops, algorithms or compressors
            (raised on every rank); a bad topology for ``"hierarchical"``
            (ranks per host that differ, a rank without a host id, ranks
            given different topologies: raised on every rank, before any
            payload moves).
        RuntimeError: another thread of this process is in a gradcomp
            collective on ``group`` (raised at once, nothing sent: give each
            thread its own group); the transport failed (see below).
        TimeoutError: a transfer did not finish within ``timeout`` seconds
            (also when only some ranks changed their arguments since the
            group's last agreement, or passed different ``check`` values;
            after any error other than the agreement's ``ValueError`` the
            group is not safe to use again).
        RuntimeError: the transport failed (e.g. a peer died, or a peer that
            timed out closed its connections first).
        gradcomp.PayloadError: a peer sent malformed bytes.
    """
    if isinstance(compressor, CodecPolicy):
        return compressor.allreduce(tensor, op=op, algorithm=algorithm, group=group, meter=meter,
                                    timeout=timeout, key=key, residual=residual, out=out, check=check)
    _check_args(tensor, compressor, op, algorithm, timeout, residual, out, meter)
    v.flag("check", check)
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a gradcomp.Topology or None, got {type(topology).__name__}")
    if topology is not None and algorithm != "hierarchical":
        raise ValueError(f"topology is used by algorithm='hierarchical' only, got algorithm={algorithm!r}")
    group = member_group(group, "gradcomp.allreduce")
    x = tensor.detach()
    if dist.get_world_size(group) == 1:
        if out is None:
            return x.clone(memory_format=torch.contiguous_format)
        return out.copy_(x) if out.data_ptr() != x.data_ptr() else out
    with exclusive(group):
        if algorithm == "hierarchical":
            call = _hierarchical.Call(compressor, op, meter, timeout, ("numel", x.numel()) if key is None else key,
                                      residual)
            return _allreduce_hierarchical(tensor, x, call, group, topology, out, check)
        return _allreduce(tensor, x, compressor, op, algorithm, group, meter, timeout, key, residual, out, check)


def _allreduce_hierarchical(tensor, x, call, group, topology, out, check):
    """:func:`allreduce` with ``algorithm="hierarchical"`` (arguments checked)."""
    lay = layout(group, topology, call.timeout, x.device)  # the same ValueError on every rank if bad
    comm = Comm(group, call.timeout, call.meter)
    n = x.numel()
    inner, _ = split(call.compressor)
    descriptor = {"numel": n, "op": OPS.index(call.op), "algorithm": _hierarchical.agreement_code(lay),
                  "codec": W.codec(inner.codec).id, "wire_nbytes": inner.wire_nbytes((n,), torch.float32)}
    try:
        if check:  # on every call (see the docstring)
            check_call(comm, descriptor, x.device, always=True)
            remember_pattern(group, descriptor, comm.trace)  # no payload message on this group to replay
        flat = x.reshape(-1) if x.dtype == torch.float32 else x.reshape(-1).to(torch.float32)
        if out is not None and out.dtype == torch.float32:
            work = out.detach().view(-1)
        else:
            work = torch.empty(n, dtype=torch.float32, device=x.device)
        if n:
            _hierarchical.allreduce(flat, lay, call, work)
    except BaseException:
        forget(group)
        raise
    finally:
        comm.release()
    if out is None:
        return work.to(tensor.dtype).view(tensor.shape)
    if work.data_ptr() != out.data_ptr():
        out.view(-1).copy_(work)
    return out


def _allreduce(tensor, x, compressor, op, algorithm, group, meter, timeout, key, residual, out, check):
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
    descriptor = {"numel": n, "op": OPS.index(op), "algorithm": ALGORITHMS.index(algorithm),
                  "codec": W.codec(local.inner.codec).id}
    try:
        if algorithm == "allgather":
            fixed = local.inner.wire_nbytes((n,), torch.float32)  # None for data-dependent sizes
            descriptor["wire_nbytes"] = -1 if fixed is None else fixed
        else:
            plan = Plan(n, comm.world_size, local.inner)
            descriptor["wire_nbytes"] = sum(plan.wire_nbytes)
        if check:
            check_call(comm, descriptor, x.device)  # before anything changes
        try:
            if algorithm == "allgather":
                _allgather.allreduce(comm, local, work, op)
            elif algorithm == "ring" and _pipelined.applies(local, plan):
                _pipelined.allreduce(comm, local, plan, work, op)
            else:
                pending = _REDUCE_SCATTER[algorithm](comm, local, plan, work)
                share_owned(comm, plan, work, op, pending)
        except Disagreement:  # a peer changed its call: finish its pattern, then agree (raises)
            replay(comm, (pattern(group) or [])[len(comm.trace):], x.device)
            agree(comm, descriptor, _NAMES, device=x.device)
            raise RuntimeError("gradcomp collective: a peer sent a disagreement envelope but "
                               "agreed afterwards") from None
        if check:
            remember_pattern(group, descriptor, comm.trace)
    except BaseException:
        forget(group)  # this rank's next call on the group checks again
        raise
    if out is None:
        result = work.to(tensor.dtype).view(tensor.shape)  # work itself for float32
    else:
        result = out
        if work.data_ptr() != out.data_ptr():
            out.view(-1).copy_(work)
    comm.release()  # after the last read of pooled buffers
    return result


def check_call(comm: Comm, descriptor: dict[str, int], device, *, always: bool = False) -> None:
    """Agree on ``descriptor`` (:data:`gradcomp.comm.agreement.FIELDS`) over
    ``comm``'s group unless it is the one the group last agreed on (or
    ``always``); first replay the last agreed call's pattern, for ranks that
    skip the check (see :mod:`gradcomp.comm.agreement`).

    Raises:
        ValueError: the ranks' descriptors differ (on every rank).
    """
    if always or needs_check(comm.group, descriptor):
        last = pattern(comm.group)
        if last is not None:  # tell ranks that skip the check, if any (see agreement)
            replay(comm, last, device)
        agree(comm, descriptor, _NAMES, device=device)


def member_group(group, what: str):
    """``group`` (None: the world) once torch.distributed is up and this process is in it.

    Raises:
        RuntimeError: torch.distributed is not initialised (``what`` names the caller).
        ValueError: this process is not a member of ``group``.
    """
    if not dist.is_initialized():
        raise RuntimeError(f"{what} needs torch.distributed initialised "
                           "(dist.init_process_group or gradcomp.launch)")
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of group")
    return group


def _check_args(tensor, compressor, op, algorithm, timeout, residual, out, meter=None) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise TypeError(f"tensor must be a dense torch.Tensor, got {type(tensor).__name__}"
                        + ("" if not isinstance(tensor, torch.Tensor) else f" with layout {tensor.layout}"))
    if tensor.is_meta:
        raise ValueError("tensor must hold data, got a meta tensor")
    if tensor.dtype not in INPUT_DTYPES:
        raise TypeError(f"tensor must have dtype float32, float16 or bfloat16 (sums are accumulated "
                        f"in float32), got {tensor.dtype}")
    compressor, ef = split(compressor, "compressor", " or ErrorFeedback")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm in DENSE_ALGORITHMS and compressor.sparse:
        raise ValueError(f"algorithm {algorithm!r} needs a dense compressor, got sparse {compressor!r}: "
                         "use algorithm='allgather' for TopK / Threshold")
    if algorithm == "allgather" and not compressor.sparse:
        raise ValueError(f"algorithm 'allgather' is for sparse compressors (TopK, Threshold), got dense "
                         f"{compressor!r}: use algorithm='ring' or 'two_phase'")
    if algorithm in DENSE_ALGORITHMS and compressor.wire_nbytes((1,), torch.float32) is None:
        raise ValueError(f"algorithm {algorithm!r} needs a compressor with a fixed wire size "
                         f"(wire_nbytes not None), got {compressor!r}")
    v.timeout("timeout", timeout)
    if meter is not None and not isinstance(meter, TrafficMeter):
        raise TypeError(f"meter must be a gradcomp.TrafficMeter or None, got {type(meter).__name__}")
    if residual is not None:
        if ef is not None:
            raise ValueError("give either an ErrorFeedback compressor or residual=, not both")
        if (not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32
                or not residual.is_contiguous() or residual.numel() != tensor.numel()
                or residual.device != tensor.device):
            got = (f"{residual.dtype} with {residual.numel()} elements on {residual.device}"
                   if isinstance(residual, torch.Tensor) else type(residual).__name__)
            raise ValueError(f"residual must be a contiguous float32 tensor of {tensor.numel()} "
                             f"elements on {tensor.device}, got {got}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != tensor.shape
                            or out.dtype != tensor.dtype or out.device != tensor.device
                            or not out.is_contiguous()):
        got = (f"{out.dtype} of shape {tuple(out.shape)} on {out.device}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise ValueError(f"out must be a contiguous {tensor.dtype} tensor of shape {tuple(tensor.shape)} "
                         f"on {tensor.device}, got {got}")
