"""Hierarchical compressed allreduce: exact inside a host, compressed between hosts.

Hosts hold ``R`` ranks each on a fast link and reach each other over a slow
one (the two-level schemes of Horovod's hierarchical allreduce and of
BlueConnect, Cho et al. 2019; compression on the slow tier only, as in
CGX, Markov et al. 2022). With ``H`` hosts (:mod:`gradcomp.comm.topology`):

1. intra-host reduce-scatter, exact float32 (the backend's
   ``reduce_scatter_tensor``): local rank ``l`` of each host ends with its
   host's float32 sum of shard ``l`` (``ceil(n / R)`` elements);
2. the ``R`` local ranks of every host run, in parallel, the compressed
   allreduce of their shard across hosts (``"ring"`` or ``"two_phase"``,
   :mod:`gradcomp.comm.ring` / :mod:`gradcomp.comm.two_phase`); error
   feedback applies here only, to the host sum a rank compresses alone;
3. intra-host allgather of the shards (``all_gather_into_tensor``).

Every rank ends bit-identical: each chunk of a shard is the decoding of its
owner's bytes on every host, and step 3 copies bits. Per host and call the
slow links carry ``2 (H - 1) / H`` times the compressed bucket, against
``2 (N - 1) / N`` times it per rank for a flat ring over ``N = H R`` ranks.
The meter records tier ``"inter_host"`` (step 2, exact bytes) and
``"intra_host"`` (phases ``"host_reduce_scatter"``, ``"host_allgather"``:
the nominal ring volume, ``(R - 1) x 4 ceil(n / R)`` bytes each way, since
the backend picks its own algorithm).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradcomp import timeline as _timeline
from gradcomp.comm import pipelined as _pipelined
from gradcomp.comm import ring as _ring
from gradcomp.comm import two_phase as _two_phase
from gradcomp.comm.dense import Plan, share_owned
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm
from gradcomp.comm.topology import INTER_ALGORITHMS, Layout

__all__ = ["Call", "allreduce", "agreement_code", "AGREEMENT_CODE", "PHASES", "shard_bounds"]

#: agreement ``algorithm`` code of a hierarchical call: this plus the index of
#: its inter-host algorithm in :data:`~gradcomp.comm.topology.INTER_ALGORITHMS`
AGREEMENT_CODE = 8
#: meter phases of the intra-host steps
PHASES = ("host_reduce_scatter", "host_allgather")
_REDUCE_SCATTER = {"ring": _ring.reduce_scatter, "two_phase": _two_phase.reduce_scatter}
# the backend's collectives on one flat tensor (torch 2.13 renamed them; the old names warn)
_BACKEND_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_BACKEND_ALLGATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class Call:
    """The settings of one hierarchical call (checked by :func:`gradcomp.allreduce`).

    Attributes:
        compressor: the user's compressor or ErrorFeedback (the inter-host leg's).
        op: ``"avg"`` or ``"sum"``. meter: a TrafficMeter or None.
        timeout: seconds each exchange may take. key: residual key prefix.
        residual: flat float32 memory of ``n`` elements, or None.
    """

    compressor: object
    op: str
    meter: object
    timeout: float
    key: Hashable
    residual: torch.Tensor | None


def shard_bounds(numel: int, ranks_per_host: int, local_rank: int) -> tuple[int, int, int]:
    """``(lo, hi, s)``: local rank ``local_rank``'s shard ``[lo, hi)`` of ``numel``
    elements cut into ``ranks_per_host`` shards of ``s = ceil(numel / R)`` (the
    last ones shorter or empty: the intra-host collectives pad to ``R s``)."""
    s = -(-numel // ranks_per_host)
    lo = min(numel, local_rank * s)
    return lo, min(numel, lo + s), s


def allreduce(x: torch.Tensor, lay: Layout, call: Call, work: torch.Tensor) -> torch.Tensor:
    """Hierarchical allreduce of the flat float32 ``x`` (``n`` elements) into ``work``.

    Args:
        x: float32 ``[n]``, this rank's data (read only, unless it is ``work``).
        lay: the resolved layout (:func:`gradcomp.comm.topology.layout`).
        call: the call's settings.
        work: float32 ``[n]`` to write the result to (may be ``x``).

    Returns:
        ``work``, bit-identical on every rank.

    Raises:
        TimeoutError / RuntimeError / gradcomp.PayloadError: as :func:`gradcomp.allreduce`.
    """
    n, R, H = x.numel(), lay.ranks_per_host, lay.host_count
    lo, hi, s = shard_bounds(n, R, lay.local_rank)
    comm = Comm(lay.inter if lay.inter is not None else lay.intra, call.timeout, call.meter, tier="inter_host")
    try:
        source = _intra_input(comm, x, call.residual, (lo, hi) if H > 1 else (0, 0), R * s)
        if lay.intra is None:  # one rank per host: its own data is its host's sum, reduced in place
            shard = work
            if work.data_ptr() != source.data_ptr():
                work.copy_(source[:n])
        else:
            shard = _host_reduce_scatter(comm, source, lay, call, s)
        if H > 1 and hi > lo:
            _inter_leg(comm, shard[:hi - lo], lay, call, lo, hi)
        if call.op == "avg":
            shard.div_(R * H)
        if lay.intra is not None:
            _host_allgather(comm, shard, lay, call, work, n)
    finally:
        comm.release()
    return work


def _intra_input(comm: Comm, x: torch.Tensor, residual, keep: tuple[int, int], m: int) -> torch.Tensor:
    """The float32 ``[m]`` input of the intra-host reduce-scatter: ``x`` padded
    with zeros, plus ``residual`` outside ``keep`` (delivered exactly: those
    ranges are not this rank's to compress, so their residual resets)."""
    n = x.numel()
    spill = [] if residual is None else [(a, b) for a, b in ((0, keep[0]), (keep[1], n))
                                          if b > a and bool(residual[a:b].any())]
    if m == n and not spill:
        return x
    buf = comm.buffer(4 * m, x.device).view(torch.float32)
    buf[:n].copy_(x)
    buf[n:].zero_()
    for a, b in spill:
        buf[a:b].add_(residual[a:b])
        residual[a:b].zero_()
    return buf


def _wait(work, what: str, timeout: float) -> None:
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        if "timed out" in str(e).lower():
            raise TimeoutError(f"gradcomp hierarchical {what} did not finish within {timeout} s: {e}") from e
        raise RuntimeError(f"gradcomp hierarchical {what} failed: {e}") from e


def _record(call: Call, phase: str, nbytes: int, peers: int, began: float) -> None:
    if call.meter is not None and peers:
        call.meter.record_send(nbytes, nbytes, phase=phase, messages=peers, tier="intra_host")
        call.meter.record_recv(nbytes, nbytes, phase=phase, messages=peers, tier="intra_host")
        call.meter.record_time(time.perf_counter() - began, phase=phase, tier="intra_host")


def _host_reduce_scatter(comm: Comm, source: torch.Tensor, lay: Layout, call: Call, s: int) -> torch.Tensor:
    """This host's exact float32 sum of shard ``local_rank`` (``s`` elements, a pooled buffer)."""
    R = lay.ranks_per_host
    shard = comm.buffer(4 * s, source.device).view(torch.float32)
    began = time.perf_counter()
    with _timeline.span("communicate"):
        _wait(_BACKEND_REDUCE_SCATTER(shard, source, group=lay.intra, async_op=True),
              "intra-host reduce-scatter", call.timeout)
    _record(call, PHASES[0], 4 * s * (R - 1), R - 1, began)
    return shard


def _inter_leg(comm: Comm, shard: torch.Tensor, lay: Layout, call: Call, lo: int, hi: int) -> None:
    """Compressed allreduce (sum) of ``shard`` across hosts, in place."""
    residual = None if call.residual is None else call.residual[lo:hi]
    local = Local(shard, call.compressor, ("hierarchical", call.key), residual)
    plan = Plan(hi - lo, lay.host_count, local.inner)
    if lay.inter_algorithm == "ring" and _pipelined.applies(local, plan):
        _pipelined.allreduce(comm, local, plan, shard, "sum")
    else:
        pending = _REDUCE_SCATTER[lay.inter_algorithm](comm, local, plan, shard)
        share_owned(comm, plan, shard, "sum", pending)


def _host_allgather(comm: Comm, shard: torch.Tensor, lay: Layout, call: Call, work: torch.Tensor,
                    n: int) -> None:
    """Every shard of this host into ``work`` (float32 ``[n]``)."""
    R, s = lay.ranks_per_host, shard.numel()
    target = work if R * s == n else comm.buffer(4 * R * s, work.device).view(torch.float32)
    began = time.perf_counter()
    with _timeline.span("communicate"):
        _wait(_BACKEND_ALLGATHER(target, shard, group=lay.intra, async_op=True),
              "intra-host allgather", call.timeout)
    _record(call, PHASES[1], 4 * s * (R - 1), R - 1, began)
    if target.data_ptr() != work.data_ptr():
        work.copy_(target[:n])


def agreement_code(lay: Layout) -> int:
    """The agreement's ``algorithm`` code of a call with this layout."""
    return AGREEMENT_CODE + INTER_ALGORITHMS.index(lay.inter_algorithm)
