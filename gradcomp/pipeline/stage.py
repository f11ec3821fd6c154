"""A ``torch.distributed.pipelining`` stage whose boundary traffic is compressed,
metered and timed.

:class:`GradcompStage` is a :class:`~torch.distributed.pipelining.PipelineStage`
for any of the engine's schedules (GPipe, 1F1B, interleaved 1F1B, zero bubble):
it wraps what the stage sends. Each send operation the engine builds for an
activation (forward) or an input gradient (backward) is replaced by one that
sends the tensor's compressed wire bytes (:class:`~gradcomp.pipeline.boundary.BoundaryCodec`);
each receive operation receives those bytes into a wire buffer, decoded into the
engine's own receive buffer just before the forward or backward that reads it.
Everything else (ordering, batching of send/receive pairs, deadlock avoidance)
stays the engine's. The stage also records its timeline
(:class:`~gradcomp.pipeline.bubble.StageTimeline`) and, optionally, its
activation memory (:class:`~gradcomp.pipeline.memory.ActivationMeter`).

Boundaries carry one tensor each way (a sequential model's hidden state).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from gradcomp.pipeline.boundary import BoundaryCodec, boundary_phase
from gradcomp.pipeline.memory import ActivationMeter
from gradcomp.pipeline.bubble import Span, StageTimeline

__all__ = ["GradcompStage"]


class GradcompStage(PipelineStage):
    """A pipeline stage with compressed, metered, timed boundaries.

    Args:
        submodule, stage_index, num_stages, device, input_args, output_args, group:
            as for :class:`torch.distributed.pipelining.PipelineStage` (give the
            example micro-batch ``input_args`` / ``output_args``: static shapes).
        codec: what the boundaries go through (compressor and meter).
        timeline: where spans and send marks are recorded.
        memory: optional activation meter (forwards run under its hooks).
        slowdown: optional ``() -> factor`` (>= 1) read after each forward and
            backward: the stage then sleeps ``(factor - 1) x`` that operation's
            compute inside its span (an emulated straggler or compute jitter).
    """

    def __init__(self, submodule, stage_index: int, num_stages: int, device, *,
                 codec: BoundaryCodec, timeline: StageTimeline, memory: ActivationMeter | None = None,
                 input_args=None, output_args=None, group=None, slowdown=None):
        super().__init__(submodule, stage_index, num_stages, device, input_args=input_args,
                         output_args=output_args, group=group)
        self.codec, self.timeline, self.memory = codec, timeline, memory
        self.slowdown = slowdown
        self._wires_out: dict[tuple[str, int], torch.Tensor] = {}
        self._wires_in: dict[tuple[str, int], torch.Tensor] = {}
        self._pending: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor, str]]] = {}

    # ---- compute, timed --------------------------------------------------
    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        needs = None if self.is_first else ("fwd", self.stage_index - 1, fwd_chunk_id)
        with self.timeline.span("forward", self.stage_index, fwd_chunk_id, needs) as s:
            before = self.codec.seconds
            if self.memory is not None:
                with self.memory.hooks():
                    out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            else:
                out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
            s.inner_codec = self.codec.seconds - before
            self._stretch(s)
        return out

    def _stretch(self, span: Span) -> None:
        """Sleep ``(slowdown() - 1) x`` the span's compute so far (not its decompression)."""
        if self.slowdown is None:
            return
        extra = (self.slowdown() - 1.0) * (time.perf_counter() - span.t0 - span.inner_codec)
        if extra > 0:
            time.sleep(extra)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        needs = None if self.is_last else ("bwd", self.stage_index + 1, bwd_chunk_id)
        with self.timeline.span("backward", self.stage_index, bwd_chunk_id, needs) as s:
            before = self.codec.seconds
            out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                             last_backward=last_backward)
            s.inner_codec = self.codec.seconds - before
            self._stretch(s)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        with self.timeline.span("weight", self.stage_index, bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    # ---- sends: compress what the engine would send ------------------------
    def _wrap_sends(self, ops: list[dist.P2POp], direction: str, chunk: int) -> list[dist.P2POp]:
        if not ops:
            return ops
        if len(ops) != 1:
            raise ValueError(f"stage {self.stage_index}: a boundary carries one tensor, the engine "
                             f"built {len(ops)} {direction} sends")
        op = ops[0]
        dst = self.stage_index + (1 if direction == "fwd" else -1)
        t0 = time.perf_counter()
        wire = self.codec.encode(op.tensor, boundary_phase(direction, self.stage_index, dst),
                                 key=(direction, chunk))
        self.timeline.spans.append(Span("codec", self.stage_index, chunk, t0, time.perf_counter()))
        self.timeline.mark(direction, self.stage_index, chunk)
        self._wires_out[(direction, chunk)] = wire  # alive until the send completed
        return [dist.P2POp(dist.isend, wire, op.peer, op.group, op.tag)]

    def get_fwd_send_ops(self, fwd_chunk_id):
        return self._wrap_sends(super().get_fwd_send_ops(fwd_chunk_id), "fwd", fwd_chunk_id)

    def get_bwd_send_ops(self, bwd_chunk_id):
        return self._wrap_sends(super().get_bwd_send_ops(bwd_chunk_id), "bwd", bwd_chunk_id)

    # ---- receives: bytes in, decoded before use ----------------------------
    def _wrap_recvs(self, ops: list[dist.P2POp], direction: str, chunk: int) -> list[dist.P2POp]:
        src = self.stage_index + (-1 if direction == "fwd" else 1)
        phase = boundary_phase(direction, src, self.stage_index)
        out, pending = [], []
        for op in ops:
            if self.codec.plain:
                wire = op.tensor
            else:
                wire = self._wires_in.get((direction, chunk))
                if wire is None:
                    wire = self._wires_in[(direction, chunk)] = self.codec.receive_buffer(op.tensor)
            pending.append((wire, op.tensor, phase))
            out.append(op if wire is op.tensor else dist.P2POp(dist.irecv, wire, op.peer, op.group, op.tag))
        self._pending[(direction, chunk)] = pending
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id):
        return self._wrap_recvs(super().get_fwd_recv_ops(fwd_chunk_id), "fwd", fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id):
        return self._wrap_recvs(super().get_bwd_recv_ops(bwd_chunk_id), "bwd", bwd_chunk_id)

    def _decode_pending(self, direction: str, chunk: int) -> None:
        for wire, buf, phase in self._pending.pop((direction, chunk), ()):
            self.codec.decode_into(wire, buf, phase)

    def _retrieve_recv_activations(self, fwd_chunk_id):
        self._decode_pending("fwd", fwd_chunk_id)
        return super()._retrieve_recv_activations(fwd_chunk_id)

    def _retrieve_recv_grads(self, bwd_chunk_id):
        self._decode_pending("bwd", bwd_chunk_id)
        return super()._retrieve_recv_grads(bwd_chunk_id)

