"""What the dense algorithms (ring, two-phase) share: chunk plan and the allgather phase.

Both dense algorithms end the same way: each rank owns the float32 sum of its
chunk after a reduce-scatter; the owner applies the op (``avg`` divides by
``N``), compresses that sum **once**, and the owner's bytes travel unchanged
around the ring (:meth:`~gradcomp.comm.p2p.Comm.ring_allgather`), each rank
decompressing a chunk while the next one is in flight. Every rank, the owner
included, decompresses the same bytes in the same way, so every rank ends
with a bit-identical result.

With ``owner`` (two-phase, ``server_error_feedback``) the owner's compression has
error feedback of its own: the *server error* of DoubleSqueeze (Tang et al.
2019) and of DeepSpeed's compressed allreduce in 1-bit Adam (Tang et al. 2021).
The owner compresses ``sum + e`` and keeps ``e <- (sum + e) - D(C(sum + e))``,
so the owner's errors are delayed, not lost; every rank still decodes the
owner's bytes (docs/collectives.md#server-error-feedback).
"""

from __future__ import annotations

import torch

from gradcomp import timeline as _timeline
from gradcomp.comm.replay import raise_if_envelope
from gradcomp.comm.chunks import FLOAT32_BYTES, chunk_bounds
from gradcomp.comm.local import Local
from gradcomp.comm.p2p import Comm
from gradcomp.compressors import Compressor
from gradcomp.errors import PayloadError
from gradcomp.wire import Payload, decode

__all__ = ["Plan", "compress_owned", "share_owned"]


class Plan:
    """Chunks of a dense collective and the exact size of every message.

    Payloads always carry float32 tensors (the input is widened first), so the
    wire size of chunk ``j`` is ``compressor.wire_nbytes((len_j,), float32)``
    on every rank, known without asking.

    Args:
        numel: elements of the flattened input.
        world_size: ranks in the group.
        compressor: the compressor for sums (dense, or an exact top-k for the
            sparse reduce-scatter; not an ErrorFeedback:
            ErrorFeedback payloads have the wrapped compressor's size anyway).

    Attributes:
        bounds: ``[(lo, hi)]`` per chunk (see :mod:`gradcomp.comm.chunks`).
        wire_nbytes: wire size in bytes of chunk ``j``'s payload.
        raw_nbytes: ``4 * len_j``: the bytes chunk ``j`` takes in a float32 ring.
        reuse: wires are compressed into pooled buffers (:meth:`wire_buffer`;
            dense compressors only).
    """

    def __init__(self, numel: int, world_size: int, compressor: Compressor):
        self.compressor = compressor
        self.bounds = chunk_bounds(numel, world_size)
        self.wire_nbytes = [compressor.wire_nbytes((hi - lo,), torch.float32) for lo, hi in self.bounds]
        self.raw_nbytes = [FLOAT32_BYTES * (hi - lo) for lo, hi in self.bounds]
        self.reuse = compressor._takes_out() and not compressor.sparse  # sparse: no out= (sizes vary)

    def wire_buffer(self, comm: Comm, j: int, device) -> torch.Tensor | None:
        """A pooled buffer for a wire of chunk ``j`` to compress into (valid
        until ``comm.release()``), or None for a compressor subclass whose
        ``compress`` takes no ``out=`` (it then allocates its own)."""
        return comm.buffer(self.wire_nbytes[j], device) if self.reuse else None

    @staticmethod
    def received(buf: torch.Tensor) -> Payload:
        """A received wire, decoded for reduction: everything is validated
        here except the range of int8 codes and scales, which the kernel
        reading them checks block by block (one pass over memory fewer; a bad
        value still raises :class:`~gradcomp.PayloadError`, leaving the
        workspace partly written, which a failed collective leaves
        unspecified anyway)."""
        try:
            return decode(buf, check_int8=False)
        except PayloadError:
            raise_if_envelope(buf)  # a peer changed its call since the group's agreement
            raise

    def expect(self, payload: Payload, j: int) -> torch.Tensor:
        """``payload.wire`` after checking it has the size receivers expect for chunk ``j``.

        Raises:
            RuntimeError: the compressor wrote another size than its ``wire_nbytes``.
        """
        if payload.nbytes != self.wire_nbytes[j]:
            raise RuntimeError(
                f"{self.compressor!r} wrote {payload.nbytes} bytes for a chunk of "
                f"{self.bounds[j][1] - self.bounds[j][0]} elements but its wire_nbytes() says "
                f"{self.wire_nbytes[j]}: dense collectives need exact, data-independent sizes"
            )
        return payload.wire


def share_owned(comm: Comm, plan: Plan, work: torch.Tensor, op: str, pending: torch.Tensor,
                owner: Local | None = None) -> list[torch.Tensor]:
    """Finish a dense allreduce from this rank's chunk, in place.

    Args:
        comm: the group.
        plan: the chunk plan.
        work: float32 ``[numel]``; its chunk ``rank`` plus the decompressed
            ``pending`` payload is the float32 sum of that chunk over all ranks.
        op: ``"sum"`` or ``"avg"``.
        pending: the wire bytes of the last payload of chunk ``rank`` the
            reduce-scatter received and did not add.
        owner: this rank's :class:`~gradcomp.comm.local.Local` when the owner's
            compression gets error feedback (:func:`compress_owned`); None: the
            plain compressor.

    The owner adds ``pending``, divides by ``N`` for ``avg``, compresses the
    result and replaces its chunk with the decompression of those bytes (without
    ``owner``, in one call: :meth:`~gradcomp.Compressor.reduce_compress_`, one
    pass for int8); the bytes then travel the ring and every other rank
    decompresses them into its copy. On return ``work`` holds every chunk
    decompressed from its owner's bytes (bit-identical on every rank).

    Returns:
        Every chunk's owner bytes, indexed by chunk (valid until ``comm.release()``).
    """
    r = comm.rank
    lo, hi = plan.bounds[r]
    divisor = comm.world_size if op == "avg" else 1
    if owner is not None and owner.mode != "none":
        mine = plan.expect(compress_owned(comm, plan, owner, work, divisor, pending), r)
    else:
        with _timeline.span("compress"):
            mine = plan.expect(plan.compressor.reduce_compress_(
                plan.received(pending), work[lo:hi], divisor=divisor,
                out=plan.wire_buffer(comm, r, work.device), decode=True), r)

    def decompress(j: int, blob: torch.Tensor) -> None:
        if j != r:  # the owner's chunk is already decoded
            lo, hi = plan.bounds[j]
            with _timeline.span("decompress"):
                plan.compressor.decompress(plan.received(blob), out=work[lo:hi])

    return comm.ring_allgather(mine, plan.wire_nbytes, plan.raw_nbytes, phase="allgather", consume=decompress)


def compress_owned(comm: Comm, plan: Plan, owner: Local, work: torch.Tensor, divisor: int,
                   pending: torch.Tensor) -> Payload:
    """The owner's compression of its chunk's sum with a server residual (server error feedback).

    Adds ``pending`` to ``work[chunk rank]``, divides by ``divisor``, compresses
    ``s + e`` with the residual ``e`` of ``owner`` for this chunk, sets
    ``e <- (s + e) - D(C(s + e))`` and leaves the decoded bytes in
    ``work[chunk rank]``. Where ``e`` lives (:mod:`gradcomp.comm.local`):

    * an :class:`~gradcomp.ErrorFeedback`: key ``(key, rank)``, in the units of
      the result (after the division), added by the fused error-feedback kernel;
    * a flat ``residual``: its range of chunk ``rank``, which
      :meth:`~gradcomp.comm.local.Local.exact_into` adds to this rank's
      contribution (and resets) before the next call's division, so it is kept
      multiplied by ``divisor``.

    Args:
        divisor: positive integer (the group size for ``op="avg"``, else 1).

    Returns:
        The payload of chunk ``rank`` (in a pooled wire buffer when the plan reuses them).
    """
    r = comm.rank
    lo, hi = plan.bounds[r]
    acc = work[lo:hi]
    with _timeline.span("decompress"):
        plan.compressor.decompress_add_(plan.received(pending), acc)
    if divisor != 1:
        acc.div_(divisor)
    q = owner.over(work).compress(lo, hi, chunk=r, out=plan.wire_buffer(comm, r, work.device))
    if owner.mode == "flat" and divisor != 1:
        owner.residual[lo:hi].mul_(divisor)  # added to the next sum before its division by `divisor`
    with _timeline.span("decompress"):
        plan.compressor.decompress(q, out=acc)
    return q
