"""The compressed allreduce: argument checks, the agreement, then one algorithm's module.

See :func:`allreduce`; the algorithms live one per module (:mod:`gradcomp.comm.ring`,
:mod:`gradcomp.comm.two_phase`, :mod:`gradcomp.comm.pipelined`, :mod:`gradcomp.comm.allgather`,
:mod:`gradcomp.comm.hierarchical`).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp.comm import allgather as _allgather
from gradcomp.comm import auto as _auto
from gradcomp.comm import checked as _checked
from gradcomp.comm import halving_doubling as _halving_doubling
from gradcomp.comm import hierarchical as _hierarchical
from gradcomp.comm import pipelined as _pipelined
from gradcomp.comm import ring as _ring
from gradcomp.comm import sparse_reduce_scatter as _sparse_reduce_scatter
from gradcomp.comm import two_phase as _two_phase
from gradcomp.comm._args import ALGORITHM_CODES, AUTO, DEFAULT_TIMEOUT, check_args, member_group
from gradcomp.comm.agreement import call_identity
from gradcomp.comm.dense import Plan, share_owned
from gradcomp.comm.guard import exclusive
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm
from gradcomp.comm.policy import CodecPolicy
from gradcomp.comm.topology import INTER_ALGORITHMS, Topology, layout
from gradcomp.compressors import Compressor, ErrorFeedback, split

__all__ = ["allreduce"]

_REDUCE_SCATTER = {"ring": _ring.reduce_scatter, "two_phase": _two_phase.reduce_scatter}


def allreduce(
    tensor: torch.Tensor,
    compressor: Compressor | ErrorFeedback | CodecPolicy,
    *,
    op: str = "avg",
    algorithm: str | _auto.AutoAlgorithm = "ring",
    group=None,
    meter=None,
    timeout: float = DEFAULT_TIMEOUT,
    key: Hashable = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check: bool = True,
    topology: Topology | None = None,
    tag: str | int | None = None,
    server_error_feedback: bool = False,
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
      ring. Two quantizations at most; same bytes as the ring. With error
      feedback and ``server_error_feedback=True`` the owner compresses the
      sum plus a server residual of its own (DoubleSqueeze, Tang et al.
      2019; 1-bit Adam, Tang et al. 2021).
    * ``"allgather"`` (sparse compressors: TopK, Threshold): payload sizes are
      exchanged, payloads gathered over the ring unchanged, and every rank sums
      the union in float32 in rank order.
    * ``"halving_doubling"`` (dense compressors): recursive halving
      reduce-scatter, the owner's compressed chunk sum, recursive doubling
      allgather of the owners' bytes; ``2 log2 N`` messages per rank (ranks
      beyond a power of two folded in: 2 more), for small buckets; at most
      ``log2 N + 2`` quantizations of any partial sum's contribution.
    * ``"sparse_reduce_scatter"`` (exact ``TopK`` with a ``ratio``): each rank
      sends the top-k of every region to its owner, which sums, re-selects
      the top-k and shares its bytes as in the ring's allgather; what the
      re-selection drops stays in the owner's error-feedback residual.
    * ``"hierarchical"`` (dense compressors; :mod:`gradcomp.comm.hierarchical`):
      hosts of ``R`` ranks each (``topology``); an exact float32
      reduce-scatter inside each host, the compressed allreduce (the
      topology's ``inter_algorithm``, ring or two-phase) of each local rank's
      shard across hosts, an allgather of the owners' bytes inside the host,
      pipelined in segments. Only the links between hosts carry the
      compressed bucket: ``2 (H - 1) / H`` times it per host. The first call
      on a group with a topology resolves it (collective; cached); with
      ``check=True`` the ranks agree on every call (a rank that skipped it
      would exchange on the intra-host and inter-host groups, which the
      agreement's disagreement envelopes do not reach).

    * ``"auto"`` (or an :class:`gradcomp.AutoAlgorithm` for a calibrated link;
      :mod:`gradcomp.comm.auto`): per ``key``, one of the algorithms above
      that take the compressor (hierarchical where ``topology``, or the
      environment, gives more than one host of more than one rank), ordered
      by the link cost model (:mod:`gradcomp.comm.cost`), timed in turn,
      the fastest by the ranks' agreed timings kept, re-checked every
      ``interval`` calls. Every rank runs the same algorithm on every call.
      An ErrorFeedback compressor keeps one flat residual per key, under
      ``("auto", key)``, which every algorithm uses alike.

    Every rank ends bit-identical because each chunk's final value is the
    decompression of one set of bytes that every rank (its owner included)
    decodes the same way. With ``group`` of size 1 the result is a copy of
    ``tensor`` (the compressor is not called, no byte is sent, error-feedback
    state is left as it is).

    Error feedback (what a rank remembers is the error of compressing its
    *own* data alone, and with ``server_error_feedback`` two-phase's owner's
    error of compressing its chunk's sum; partial and final sums are otherwise
    compressed without it; see :mod:`gradcomp.comm.local`):

    * ``compressor`` an :class:`~gradcomp.ErrorFeedback`: residual key
      ``(key, j)`` for chunk ``j`` that this rank compresses alone (the ring:
      chunk ``rank - 1 mod N``; two-phase and the sparse reduce-scatter: every
      chunk but ``rank``; with ``server_error_feedback``, two-phase's owner
      its server residual under ``(key, rank)``, in the result's units);
      ``key`` itself for the allgather algorithm (the
      whole tensor); ``(key, ("halving_doubling", lo, hi))`` for the element
      range ``[lo, hi)`` halving-doubling compresses alone (the first half it
      sends, or a folded rank's whole tensor); the sparse reduce-scatter's
      owner keeps what its re-selection drops under ``(key, rank)``;
      ``(("hierarchical", key, k), j)`` for chunk ``j`` of this rank's shard
      of segment ``k`` on the inter-host leg (the only leg that compresses).
    * ``residual``: a flat float32 memory for the whole tensor, updated in
      place: compressed ranges keep their compression error, ranges added
      exactly are delivered with their residual, which resets to zero (the
      sparse reduce-scatter's owner then keeps what its re-selection drops
      in its region; with ``server_error_feedback``, two-phase's owner its
      server residual, times ``N`` for ``op="avg"``).

    Traffic: ``meter`` records the bytes this rank really sent and received
    per phase (``"reduce_scatter"``, ``"allgather"``, ``"agreement"``,
    ``"sizes"``, and ``"fold"`` for halving-doubling's extra ranks) and, as
    raw bytes, what a float32 ring allreduce over the same chunks would have
    moved: ``4 (2 n - len_rank - len_{rank+1})`` bytes sent per rank, i.e.
    ``2 (N - 1) / N * 4 n`` when ``N`` divides ``n``
    (:func:`gradcomp.comm.chunks.ring_raw_bytes`); halving-doubling and the
    sparse reduce-scatter count, per message, the float32 bytes of the
    elements it carries (halving-doubling: ``2 (p - 1) / p * 4 n`` for a
    rank of the power-of-two group ``p``, ``4 n`` plus ``4 n`` more per
    folded partner).

    Args:
        tensor: float32/float16/bfloat16 tensor of any shape (any number of
            elements, 0 included) on the group's device (CPU for gloo, the
            current CUDA device for NCCL). Not modified.
        compressor: a gradcomp compressor: dense (NoCompression, FP16, BF16,
            Int8Quantizer) for ``"ring"`` / ``"two_phase"`` /
            ``"halving_doubling"``, sparse (TopK, Threshold) for
            ``"allgather"``, exact ``TopK(ratio=...)`` for
            ``"sparse_reduce_scatter"``; optionally wrapped in ErrorFeedback.
            Or a :class:`~gradcomp.comm.policy.CodecPolicy` such as
            :class:`gradcomp.Adaptive`, which picks the compressor of each
            call (``algorithm`` is then the algorithm of its dense choices;
            see :meth:`gradcomp.Adaptive.allreduce`).
        op: ``"avg"`` (divide the sum by the group size) or ``"sum"``.
        algorithm: one of :data:`~gradcomp.comm.ALGORITHM_CHOICES`: ``"ring"``,
            ``"two_phase"``, ``"allgather"``, ``"hierarchical"``,
            ``"halving_doubling"``, ``"sparse_reduce_scatter"`` or
            ``"auto"``; or a :class:`gradcomp.AutoAlgorithm`.
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
            message piece of the previous call's reduce-scatter;
            docs/results/agreement.md). Like the other arguments it must be
            the same on every rank. ``False``: never (the DDP hook checks its
            first bucket, then relies on DDP's identical bucket layout on
            every rank); a disagreement then aborts the process (gloo) or
            returns different values on different ranks. (``"allgather"``
            also exchanges payload sizes, 8 bytes per peer, on every call.)
        topology: a :class:`gradcomp.Topology` for ``"hierarchical"`` or
            ``"auto"`` (None: the hosts come from the environment,
            ``GRADCOMP_HOST_ID`` or torchrun's ``GROUP_RANK`` /
            ``LOCAL_WORLD_SIZE``); must be None with the other algorithms.
        tag: what tells this call apart from other calls on ``group`` (a str
            or an int, the same on every rank); None: the calling thread's
            name. Calls with different tags (or, untagged, from differently
            named threads) never pair silently: when one rank's call meets
            another's, every rank raises ``ValueError``. Calls of several
            threads on one group run one at a time (a second thread's call
            waits for the first, :mod:`gradcomp.comm.guard`); give each
            thread its own group (``torch.distributed.new_group``) to run
            them concurrently.
        server_error_feedback: with ``algorithm="two_phase"`` and error
            feedback (an ErrorFeedback or ``residual``), the owner of each
            chunk compresses its sum with a server residual of its own
            (:func:`gradcomp.comm.dense.compress_owned`;
            docs/collectives.md#server-error-feedback); no effect without
            error feedback. Off by default: on the measured workload it lost
            accuracy (docs/results/server-error-feedback.md).

    Returns:
        ``out`` if given, else a new tensor with ``tensor``'s shape, dtype and device.

    Raises:
        TypeError: ``tensor`` is not a float32/float16/bfloat16 tensor, or
            ``compressor`` is not a gradcomp compressor; ``tag`` is not None,
            a str or an int.
        ValueError: unknown ``op`` / ``algorithm``; a sparse compressor with a
            dense algorithm or a dense one with a sparse algorithm; a
            compressor other than an exact ``TopK`` with a ratio for
            ``"sparse_reduce_scatter"``; a dense
            compressor without a fixed wire size; a bad ``residual`` or
            ``timeout``; this process is not in ``group``; the ranks of the
            group passed different numels, ops, algorithms, compressor
            settings or tags (raised on every rank, also when only one rank
            changed its call since the group's last agreement); a bad
            topology for ``"hierarchical"``
            (ranks per host that differ, a rank without a host id, ranks
            given different topologies: raised on every rank, before any
            payload moves); ``server_error_feedback`` not a bool, or True
            with another algorithm than ``"two_phase"``.
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
    v.flag("server_error_feedback", server_error_feedback)
    if server_error_feedback and algorithm != "two_phase":
        raise ValueError(f"server_error_feedback applies to algorithm='two_phase' only, got algorithm={algorithm!r}")
    chooser = algorithm if isinstance(algorithm, _auto.AutoAlgorithm) else None
    if chooser is not None:
        algorithm = AUTO
    if isinstance(compressor, CodecPolicy):  # it checks its arguments and agrees on its settings
        if algorithm == AUTO:
            raise ValueError("algorithm 'auto' picks among the algorithms of one compressor; an adaptive "
                             "policy picks the compressor: give the policy algorithm='ring' or 'two_phase'")
        if topology is not None:
            raise ValueError("topology is used by algorithm='hierarchical' only, which an adaptive policy "
                             "does not run (its dense choices take 'ring' or 'two_phase')")
        return compressor.allreduce(tensor, op=op, algorithm=algorithm, group=group, meter=meter,
                                    timeout=timeout, key=key, residual=residual, out=out, check=check, tag=tag)
    check_args(tensor, compressor, op, algorithm, timeout, residual, out, meter)
    v.flag("check", check)
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"topology must be a gradcomp.Topology or None, got {type(topology).__name__}")
    if topology is not None and algorithm not in ("hierarchical", AUTO):
        raise ValueError(f"topology is used by algorithm='hierarchical' or 'auto' only, got algorithm={algorithm!r}")
    group = member_group(group, "gradcomp.allreduce")
    x = tensor.detach()
    if dist.get_world_size(group) == 1:
        if out is None:
            return x.clone(memory_format=torch.contiguous_format)
        return out.copy_(x) if out.data_ptr() != x.data_ptr() else out
    if algorithm == AUTO:  # the chooser calls this function back with the algorithm it picks
        chooser = _auto.default_for(group) if chooser is None else chooser
        return chooser.reduce(allreduce, tensor, compressor, op=op, group=group, meter=meter, timeout=timeout,
                              key=key, residual=residual, out=out, check=check, topology=topology, tag=tag)
    with exclusive(group, timeout=timeout):
        if algorithm == "hierarchical":
            call = _hierarchical.Call(compressor, op, meter, timeout, ("numel", x.numel()) if key is None else key,
                                      residual)
            return _allreduce_hierarchical(tensor, x, call, group, topology, out, check, tag)
        return _allreduce(tensor, x, compressor, op, algorithm, group, meter, timeout, key, residual, out, check,
                          tag, server_error_feedback)


def _allreduce_hierarchical(tensor, x, call, group, topology, out, check, tag):
    """:func:`allreduce` with ``algorithm="hierarchical"`` (arguments checked)."""
    spec = Topology() if topology is None else topology
    comm = Comm(group, call.timeout, call.meter)
    n = x.numel()
    inner, _ = split(call.compressor)
    # agreed before the layout is resolved (a collective a peer that changed its call is not in,
    # which names a difference of the specs itself); the whole tensor's payload size stands for the pattern
    code = _hierarchical.AGREEMENT_CODE + INTER_ALGORITHMS.index(spec.inter_algorithm)
    sig = _checked.call_signature("gradcomp.allreduce", n, call.op, code, inner, None, 0, tag)
    if out is not None and out.dtype == torch.float32:
        work = out.detach().view(-1)
    else:
        work = torch.empty(n, dtype=torch.float32, device=x.device)

    def body() -> None:  # its payloads travel on the intra- and inter-host groups
        lay = layout(group, topology, call.timeout, x.device)  # the same ValueError on every rank if bad
        flat = x.reshape(-1) if x.dtype == torch.float32 else x.reshape(-1).to(torch.float32)
        if n:
            _hierarchical.allreduce(flat, lay, call, work)

    try:
        # on every call (see the docstring): no envelope reaches a rank on the other groups
        _checked.run(comm, sig, body, device=x.device, check=check, always=True)
    finally:
        comm.release()
    if out is None:
        return work.to(tensor.dtype).view(tensor.shape)
    if work.data_ptr() != out.data_ptr():
        out.view(-1).copy_(work)
    return out


def _allreduce(tensor, x, compressor, op, algorithm, group, meter, timeout, key, residual, out, check, tag,
               server_error_feedback=False):
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
    plan = None
    if algorithm != "allgather":
        chunks = comm.world_size
        if algorithm == "halving_doubling":  # one chunk per rank of the power-of-two group
            chunks = _halving_doubling.fold_layout(comm.world_size, comm.rank)[0]
        plan = Plan(n, chunks, local.inner)
    pipelined = algorithm == "ring" and _pipelined.applies(local, plan)
    sig = _checked.call_signature("gradcomp.allreduce", n, op, ALGORITHM_CODES[algorithm], local.inner, plan,
                                  _pipelined.segment_count(plan) if pipelined else 0, tag)

    def body() -> None:
        if algorithm == "allgather":
            _allgather.allreduce(comm, local, work, op)
        elif algorithm == "halving_doubling":
            _halving_doubling.allreduce(comm, local, plan, work, op)
        elif algorithm == "sparse_reduce_scatter":
            _sparse_reduce_scatter.allreduce(comm, local, plan, work, op)
        elif pipelined:
            _pipelined.allreduce(comm, local, plan, work, op)
        else:
            pending = _REDUCE_SCATTER[algorithm](comm, local, plan, work)
            # two-phase: the owner's compression may have a server residual (DoubleSqueeze, 1-bit Adam)
            share_owned(comm, plan, work, op, pending, owner=local if server_error_feedback else None)

    _checked.run(comm, sig, body, device=x.device, check=check)
    if out is None:
        result = work.to(tensor.dtype).view(tensor.shape)  # work itself for float32
    else:
        result = out
        if work.data_ptr() != out.data_ptr():
            out.view(-1).copy_(work)
    comm.release()  # after the last read of pooled buffers
    return result
