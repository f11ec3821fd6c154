"""Exceptions raised by the parameter server and its workers."""

from __future__ import annotations

__all__ = ["PSError", "ProtocolError", "PeerError", "RankConflictError", "WorkerFailedError", "PSAbortedError",
           "CheckpointError"]


class PSError(RuntimeError):
    """Base class of the parameter-server errors."""


class ProtocolError(PSError):
    """A control header broke the protocol (bad magic, unknown message kind,
    negative or oversized length). The byte stream with that peer can no longer
    be trusted, so the peer is cut off."""


class PeerError(PSError):
    """A point-to-point exchange with ``rank`` failed: the peer closed its
    connection (its process died) or did not answer within the timeout.

    Attributes:
        rank: the peer's global rank.
        reason: the transport's message.
    """

    def __init__(self, rank: int, what: str, reason: str):
        super().__init__(f"{what} rank {rank}: {reason}")
        self.rank = rank
        self.reason = reason


class RankConflictError(PeerError):
    """Two live processes claimed one worker rank and this one lost: a newer
    incarnation of the rank took it over (raised on the older process at its
    next call, or while it waits for a reply), or this process asked to join
    while a live process of the same or a newer incarnation holds the rank
    (raised by the ``Worker`` constructor).

    Attributes:
        rank: the global rank of the server that said so.
        reason: the server's words: which rank, and the other process
            (incarnation, pid, host and address).
    """


class WorkerFailedError(PSError):
    """A worker died in a run with ``on_worker_failure="fail"``.

    Attributes:
        rank: the global rank of the failed worker.
        reason: how the failure was detected.
    """

    def __init__(self, rank: int, reason: str):
        super().__init__(f"worker rank {rank} failed ({reason}) and on_worker_failure='fail'")
        self.rank = rank
        self.reason = reason


class PSAbortedError(PSError):
    """Raised on a worker when a server aborts the run because another worker
    failed (``on_worker_failure="fail"``).

    Attributes:
        server: the global rank of the aborting server.
        failed_rank: the global rank of the worker whose failure caused the abort.
    """

    def __init__(self, server: int, failed_rank: int):
        super().__init__(f"parameter server rank {server} aborted the run: worker rank "
                         f"{failed_rank} failed and on_worker_failure='fail'")
        self.server = server
        self.failed_rank = failed_rank


class CheckpointError(PSError, ValueError):
    """A server checkpoint cannot be resumed from: unreadable (truncated,
    random or foreign bytes), not a gradcomp parameter-server checkpoint, or
    one of another parameter placement. Raised before anything is changed.

    Attributes:
        path: the checkpoint file.
        reason: what is wrong with it.
    """

    def __init__(self, path: str, reason: str):
        super().__init__(f"checkpoint {path}: {reason}")
        self.path = path
        self.reason = reason
