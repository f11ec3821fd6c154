"""gradcomp's compressed allreduce over torchft's per-step quorum of replica groups.

torchft (PyTorch's per-step fault tolerance) forms a quorum of replica groups
every step through its lighthouse, reconfigures a process group for it, drops
a failed group and heals a recovered one from a live peer. :class:`ManagedAllreduce`
runs gradcomp's compressed collectives (ring, two-phase, allgather) on the
quorum's gloo group, averages over the replica groups in the quorum, counts
bytes in a :class:`~gradcomp.TrafficMeter` and keeps error feedback correct
across a change of quorum: one flat float32 residual per tensor (independent
of the quorum's size and chunking), rolled back when a step is not committed,
never transferred to a healing replica (it starts from zero). See
docs/fault-tolerance.md.
"""

# no `from __future__ import annotations`: DDP reads comm_hook's return annotation as an object
from collections.abc import Hashable

import torch

from gradcomp import _validate as v
from gradcomp.comm import ALGORITHMS, allreduce
from gradcomp.compressors import Compressor, ErrorFeedback, split
from gradcomp.errors import PayloadError
from gradcomp.meter import TrafficMeter

__all__ = ["ManagedAllreduce", "comm_hook"]


class ManagedAllreduce:
    """Compressed, fault-tolerant allreduce over the replica groups of a torchft quorum.

    Call per step, between ``manager.start_quorum()`` and the optimizer step:
    :meth:`allreduce` for each gradient (or register :func:`comm_hook` on a
    DDP model), then :meth:`commit` (``manager.should_commit()``), stepping
    the optimizer only when it returns True.

    Error feedback: a residual is a replica group's own compression error,
    mass it still owes the others. It is one flat float32 tensor per ``key``
    (passed as ``residual=`` to :func:`gradcomp.allreduce`), so it stays valid
    when the quorum's size, and with it the ring's chunks, changes: survivors
    keep theirs. A step that is not committed (a peer died mid-step, an error
    here) puts every residual back as it was before the step: the step's
    gradient is discarded whole, as the optimizer step is. A replica that
    heals loads the healing peer's parameters and optimizer state but not its
    residuals: they are that peer's debt, which it still pays itself, so a
    copy would be applied twice. A new process starts with zero residuals;
    the killed one's residual (at most one step's compression error, scaled
    by 1 / quorum size) is lost with it.

    Args:
        manager: a ``torchft.Manager`` built with ``pg`` (``use_async_quorum=False``
            lets a healing replica take part in the step it heals in).
        pg: the ``torchft.process_group.ProcessGroupGloo`` given to ``manager``.
        compressor: a gradcomp compressor (dense for ``"ring"``/``"two_phase"``,
            sparse for ``"allgather"``); an :class:`~gradcomp.ErrorFeedback`
            is unwrapped (the residuals are kept here). A lossy one gets error feedback.
        algorithm: ``"ring"``, ``"two_phase"`` or ``"allgather"``.
        meter: a :class:`~gradcomp.TrafficMeter` (default: a new one, :attr:`meter`).
        timeout: seconds one exchange may take (> 0); a dead peer is detected by it.

    Raises:
        TypeError / ValueError: a bad argument (the message names it), e.g. a
            sparse compressor with ``"ring"``.
    """

    def __init__(self, manager, pg, compressor: Compressor | ErrorFeedback, *, algorithm: str = "ring",
                 meter: TrafficMeter | None = None, timeout: float = 30.0):
        self.manager, self.pg = manager, pg
        self.codec, ef = split(compressor)
        self.error_feedback = ef is not None or self.codec.lossy
        self.algorithm = v.choice("algorithm", algorithm, ALGORITHMS)
        if self.codec.sparse != (self.algorithm == "allgather"):
            raise ValueError(f"algorithm={algorithm!r} does not fit compressor {self.codec!r}: sparse "
                             "compressors take 'allgather', dense ones 'ring' or 'two_phase'")
        if meter is not None and not isinstance(meter, TrafficMeter):
            raise TypeError(f"meter must be a gradcomp.TrafficMeter or None, got {type(meter).__name__}")
        self.meter = meter if meter is not None else TrafficMeter()
        self.timeout = v.timeout("timeout", timeout)
        #: key -> flat float32 residual (this replica group's own compression error)
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self._before: dict[Hashable, torch.Tensor | None] = {}
        #: steps committed / rolled back by :meth:`commit`
        self.committed = self.rolled_back = 0
        self._last_quorum_size: int | None = None

    def allreduce(self, tensor: torch.Tensor, key: Hashable = None) -> torch.Tensor:
        """The mean of ``tensor`` over the replica groups in the current quorum.

        Args:
            tensor: float32/float16/bfloat16 CPU tensor, the same shape on every replica group.
            key: names the tensor's residual across steps (one key per tensor).

        Returns:
            A new tensor (``tensor``'s shape and dtype): the sum of the
            participants' compressed contributions divided by
            ``manager.num_participants()``; ``tensor`` unchanged on an error,
            which is reported to the manager (the step will not commit).
        """
        self.manager.wait_quorum()
        if self.manager.errored():
            return tensor
        n = self.manager.num_participants()
        own = self.manager.is_participating()
        residual = self._residual(key, tensor) if own and self.error_feedback else None
        x = tensor if own else torch.zeros_like(tensor)  # a non-participant adds nothing
        try:
            out = allreduce(x, self.codec, op="sum", algorithm=self.algorithm, group=self.pg.parent,
                            meter=self.meter, timeout=self.timeout, residual=residual,
                            tag="gradcomp.torchft")  # DDP's hook thread is named apart per process
        except (RuntimeError, TimeoutError, PayloadError) as e:  # a peer died or lied: torchft skips the step
            self.manager.report_error(e)
            self._restore(key)
            return tensor
        return out.div_(n)

    def commit(self) -> bool:
        """``manager.should_commit()``: on True keep this step's residuals, on
        False put them back as they were before the step. Call once per step.

        Counts in :attr:`meter`'s events: ``"step_rolled_back"`` (not committed),
        ``"quorum_change"`` (the quorum's size differs from the previous step's)
        and ``"not_participating"`` (this group healed in the step or was left
        out of it, and contributed nothing)."""
        self.manager.wait_quorum()
        self._count_quorum()  # before should_commit, which applies a healing group's new state
        ok = bool(self.manager.should_commit())
        if ok:
            self.committed += 1
        else:
            self.rolled_back += 1
            self.meter.record_event("step_rolled_back")
            for key in list(self._before):
                self._restore(key)
        self._before.clear()
        return ok

    def _count_quorum(self) -> None:
        """Meter events of this step's quorum: ``"quorum_change"`` when its size
        differs from the previous step's, ``"not_participating"`` when this
        replica group healed or was left out (it contributed nothing)."""
        n = self.manager.num_participants()
        if self._last_quorum_size is not None and n != self._last_quorum_size:
            self.meter.record_event("quorum_change")
        self._last_quorum_size = n
        if not self.manager.is_participating():
            self.meter.record_event("not_participating")

    def reset_residuals(self) -> None:
        """Forget every residual (e.g. after loading a checkpoint from elsewhere)."""
        self.residuals.clear()
        self._before.clear()

    def _residual(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(key)
        if r is None or r.numel() != tensor.numel():
            r = self.residuals[key] = torch.zeros(tensor.numel(), dtype=torch.float32)
        if key not in self._before:  # the value before this step, restored if it does not commit
            self._before[key] = r.clone()
        return r

    def _restore(self, key: Hashable) -> None:
        before = self._before.pop(key, None)
        if before is not None:
            self.residuals[key].copy_(before)


def comm_hook(state: ManagedAllreduce, bucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: each bucket averaged by ``state`` over the quorum.

    Register it on a DDP model whose own process group carries no traffic, as
    torchft's ``DistributedDataParallel`` does
    (``model.register_comm_hook(state, comm_hook)``); the bucket's index is
    its residual key. Call ``state.commit()`` before the optimizer step.

    Returns:
        A completed future holding the averaged bucket (float32 CPU tensor).
    """
    out = state.allreduce(bucket.buffer(), key=("bucket", bucket.index()))
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer().copy_(out))
    return fut
