"""The backend's own uncompressed allreduce, with gradcomp's accounting.

An uncompressed bucket gains nothing from gradcomp's point-to-point ring: the
backend's ``dist.all_reduce`` (gloo's or NCCL's ring) moves the same float32
bytes with less overhead per message. A plain DDP bucket and the adaptive
policy's ``none`` codec both reduce this way; the meter records what a ring
allreduce of the same chunks sends and receives
(:func:`gradcomp.comm.chunks.ring_raw_bytes`), sent and raw bytes alike.
Every rank ends bit-identical: each chunk is summed once, along the ring, and
its sum forwarded to every rank.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from gradcomp.comm import checked as _checked
from gradcomp.comm._args import NATIVE, check_args, member_group
from gradcomp.comm.agreement import call_identity
from gradcomp.comm.chunks import ring_raw_bytes
from gradcomp.comm.dense import Plan
from gradcomp.comm.guard import exclusive
from gradcomp.comm.p2p import Comm
from gradcomp.compressors import NoCompression
from gradcomp.meter import TrafficMeter

__all__ = ["allreduce", "allreduce_", "allreduce_start", "reduce_", "sent_bytes"]

#: the meter's phase of these bytes
PHASE = "plain_allreduce"


def allreduce(tensor: torch.Tensor, *, op: str = "avg", group=None, meter: TrafficMeter | None = None,
              timeout: float, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
              check: bool = True, tag: str | int | None = None) -> torch.Tensor:
    """:func:`gradcomp.allreduce` of a float32 ``tensor`` with
    :class:`~gradcomp.NoCompression`, by the backend's ``dist.all_reduce``.

    The arguments are those of :func:`gradcomp.allreduce`. ``residual`` is
    delivered in full (added, then zeroed); ``"avg"`` divides before the sum,
    as DDP's own allreduce does. ``check``: the ranks agree first on the
    call (:mod:`gradcomp.comm.agreement`, algorithm ``"native"``), on every
    call: a rank that skipped the check would wait in the backend's
    collective, where no disagreement envelope can reach it. ``False``: a
    disagreement aborts the process (gloo), as ``dist.all_reduce`` does.

    Returns:
        ``out`` if given, else a new float32 tensor of ``tensor``'s shape.

    Raises:
        TypeError / ValueError: as :func:`gradcomp.allreduce` (and ``tensor``
            not float32; the ranks' calls differ);
        TimeoutError / RuntimeError: a slow or dead peer.
    """
    check_args(tensor, NoCompression(), op, "ring", timeout, residual, out, meter)
    if tensor.dtype != torch.float32:
        raise TypeError(f"tensor must be float32 for the backend's allreduce, got {tensor.dtype}")
    call_identity(tag)  # a bad tag raises here
    group = member_group(group, "gradcomp native allreduce")
    x = tensor.detach()
    n, world = x.numel(), dist.get_world_size(group)
    work = out.view(-1) if out is not None else torch.empty(n, dtype=torch.float32, device=x.device)

    def body() -> None:
        if work.data_ptr() != x.data_ptr():
            work.copy_(x.reshape(-1))
        reduce_(work, residual, op=op, group=group, timeout=timeout, meter=meter)

    with exclusive(group, timeout=timeout):
        if world > 1:
            comm = Comm(group, timeout, meter)
            # the float32 chunks' sizes stand for the message pattern (the backend's own)
            sig = _checked.call_signature("gradcomp.allreduce", n, op, NATIVE, NoCompression(),
                                 Plan(n, world, NoCompression()), 0, tag)
            # on every call: a rank that skipped it would be waiting in the backend's
            # collective, where no disagreement envelope reaches it
            _checked.run(comm, sig, body, device=x.device, check=check, always=True)
            comm.release()
        else:
            body()
    return out if out is not None else work.view(x.shape)


def reduce_(buf: torch.Tensor, residual: torch.Tensor | None, *, op: str, group, timeout: float,
            meter: TrafficMeter | None = None) -> torch.Tensor:
    """The core of :func:`allreduce`, unchecked, in place: add ``residual`` to
    ``buf`` (then zero it: delivered), divide by the group's size for
    ``"avg"``, sum with :func:`allreduce_`.

    For callers that validated the call themselves (the adaptive policy's DDP
    buckets): ``buf`` a flat contiguous float32 tensor, ``residual`` None or
    one of its size, ``op`` ``"sum"`` or ``"avg"``; every rank of ``group``
    calls it alike.

    Returns:
        ``buf``.

    Raises:
        TimeoutError / RuntimeError: a slow or dead peer (``residual`` then
            still holds what it held, added or not).
    """
    world = dist.get_world_size(group)
    if residual is not None:
        buf.add_(residual)
    if op == "avg" and world > 1:
        buf.div_(world)
    if world > 1:
        allreduce_(buf, group=group, timeout=timeout, meter=meter)
    if residual is not None:
        residual.zero_()  # delivered
    return buf


def sent_bytes(numel: int, world: int, rank: int) -> int:
    """Bytes :func:`allreduce_` counts as sent by ``rank`` for ``numel``
    float32 elements over ``world`` ranks (a ring allreduce's)."""
    if world < 2:
        return 0
    rs, ag, _, _ = ring_raw_bytes(numel, world, rank)
    return rs + ag


def allreduce_(buf: torch.Tensor, *, group, timeout: float, meter: TrafficMeter | None = None) -> torch.Tensor:
    """Sum ``buf`` over ``group`` in place with ``dist.all_reduce``.

    Args:
        buf: a contiguous tensor on the group's device (float32, float16 or
            bfloat16: summed in its own dtype, as ``dist.all_reduce`` does).
        group: a torch.distributed process group this process is in.
        timeout: seconds the transfer may take.
        meter: optional :class:`~gradcomp.TrafficMeter`: bytes in ``buf``'s
            element size, raw bytes as float32, and the seconds of the call.

    Returns:
        ``buf``.

    Raises:
        TimeoutError / RuntimeError: the backend's, on a slow or dead peer.
    """
    return allreduce_start(buf, group=group, meter=meter)(timeout)


def allreduce_start(buf: torch.Tensor, *, group, meter: TrafficMeter | None = None):
    """Start :func:`allreduce_` of ``buf`` (the same arguments) and return its wait:
    ``wait(timeout)`` blocks at most ``timeout`` seconds, records the call in ``meter`` and
    returns ``buf``. Until it returns, ``buf`` must not be touched and no other collective
    may start on ``group`` from this thread.

    Raises:
        TimeoutError / RuntimeError: (from ``wait``) the backend's, on a slow or dead peer.
    """
    began = time.perf_counter()
    work = dist.all_reduce(buf, group=group, async_op=True)

    def wait(timeout: float) -> torch.Tensor:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
        world = dist.get_world_size(group)
        if meter is not None and world > 1:
            meter.record_time(time.perf_counter() - began, phase=PHASE)
            rs, ag, rs_in, ag_in = ring_raw_bytes(buf.numel(), world, dist.get_rank(group))
            scale = buf.element_size() / 4
            meter.record_send(int((rs + ag) * scale), rs + ag, phase=PHASE)
            meter.record_recv(int((rs_in + ag_in) * scale), rs_in + ag_in, phase=PHASE)
        return buf

    return wait
