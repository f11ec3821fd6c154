"""DistributedDataParallel communication hook: compressed gradient allreduce.

Usage::

    state = gc.ddp.GradCompState(compressor=gc.Int8Quantizer())
    ddp_model.register_comm_hook(state, gc.ddp.compressed_allreduce_hook)

Modelled on PyTorch's ``PowerSGDState`` / ``powerSGD_hook``
(``torch.distributed.algorithms.ddp_comm_hooks``): the hook is a plain
function ``(state, bucket) -> Future``, the state holds the settings
(validated, with reasons), the step counter (advanced on the last bucket of
each step) and the error-feedback memory, and pickles without its process
groups.

How a bucket is reduced:

* before step ``start_iter`` and for buckets under ``min_compress_numel``
  elements: a plain averaged ``all_reduce`` (exact, like DDP's default);
* afterwards: :func:`gradcomp.allreduce` with the state's compressor and
  algorithm, ``op="avg"``, in place in the bucket buffer, with this rank's
  error-feedback residuals (see :mod:`gradcomp.comm.local` for where they
  apply: to the data a rank compresses alone; data a rank adds exactly takes
  its residual along and the residual resets).

The hook returns at once. Compression and the collective run on one
background thread per state (FIFO: buckets are reduced in the order DDP
hands them over, the same on every rank), which completes the returned
:class:`torch.futures.Future`; an exception there is set on the future and
so raised in the training process by ``loss.backward()`` (and every later
bucket of that state fails fast: the group may be out of step). gradcomp's
traffic runs on a process group of its own (``dist.new_group`` over the same
ranks, made by the state), so its point-to-point messages never interleave
with DDP's or the user's collectives.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019) is on by default
for lossy compressors. Residuals are kept **per parameter** (flat float32,
in the bucket's memory order for that parameter, so channels_last parameters
work), never per bucket: DDP's bucket rebuild after the first step,
``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
gradient accumulation under ``no_sync`` and several DDP models (one state
each) all keep each residual with its parameter. Memory: one float32 value
per parameter element (a parameter's residual is a view into a flat tensor
per bucket, reused as is while the bucket layout does not change). A
parameter's key is its ordinal in the order the hook first sees it (bucket
order of the first step, which depends only on the model and the DDP
settings); that key is what survives pickling, so restore a pickled state
into the same model with the same DDP settings. Buckets with a dtype other
than float32, float16 or bfloat16 raise TypeError.
"""

import datetime
import functools
import logging
import queue
import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from gradcomp import _validate as v
from gradcomp.adaptive import Adaptive
from gradcomp.comm import (DEFAULT_TIMEOUT, FLAT_DENSE_ALGORITHMS, INPUT_DTYPES, AutoAlgorithm, Topology,
                           allreduce, check_algorithm, native)
from gradcomp.comm.settings import agree_settings, compressor_text
from gradcomp.comm.topology import layout
from gradcomp.compressors import DGC, Compressor, Int8Quantizer, TopK, unwrapped
from gradcomp.meter import TrafficMeter
from gradcomp.powersgd import PowerSGD, Segment
from gradcomp.timeline import StepTimeline, span

__all__ = ["GradCompState", "compressed_allreduce_hook", "DEFAULT_MIN_COMPRESS_NUMEL"]

logger = logging.getLogger(__name__)

# the tag of the hook's collectives: its communication thread's name differs per process
_TAG = "gradcomp.ddp"
#: buckets with fewer elements go uncompressed (64 KiB of float32: below that,
#: the bytes saved are worth less than the ring's 2 (N - 1) message latencies)
DEFAULT_MIN_COMPRESS_NUMEL = 16384


class _CommThread:
    """One daemon thread running submitted jobs in FIFO order, each completing a Future."""

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], torch.Tensor], fut: torch.futures.Future) -> None:
        self._queue.put((job, fut))

    def flush(self) -> None:
        """Block until every submitted job has finished."""
        self._queue.join()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                job, fut = item
                try:
                    result = job()
                except BaseException as e:  # surfaces in the training process via the future
                    fut.set_exception(e)
                else:
                    fut.set_result(result)
            finally:
                self._queue.task_done()


def _unwrap(fut: torch.futures.Future) -> torch.Tensor:
    return fut.wait()


class GradCompState:
    """Settings and memory of :func:`compressed_allreduce_hook`.

    Create it on every rank of ``process_group`` at the same point (it makes
    a process group of its own with ``dist.new_group(ranks,
    use_local_synchronization=True)``), then register it with
    ``ddp_model.register_comm_hook(state, compressed_allreduce_hook)``. Use
    one state per DDP model. Created before ``torch.distributed`` is
    initialised (to hand to Lightning's ``DDPStrategy(ddp_comm_state=...)``),
    it makes its group at the first bucket instead, on every rank at once.

    Args:
        process_group: the group DDP reduces over (default: the world).
        compressor: a dense (``algorithm`` ``"ring"`` / ``"two_phase"`` /
            ``"halving_doubling"``) or sparse (``"allgather"``; an exact
            ``TopK(ratio=...)`` for ``"sparse_reduce_scatter"``) gradcomp
            compressor, not wrapped in
            ErrorFeedback (the state keeps the residuals itself); or
            ``"auto"`` / a :class:`gradcomp.Adaptive`: adaptive compression,
            per bucket the least compression that keeps communication hidden
            (:mod:`gradcomp.adaptive`; ``algorithm`` is then the dense
            candidates' ``"ring"`` or ``"two_phase"``; residuals carry over
            every switch); or a :class:`gradcomp.PowerSGD` (low-rank, per
            parameter of the bucket; ``algorithm`` ``"ring"``, ``"two_phase"`` or
            ``"halving_doubling"``; it compresses from the later of this state's
            ``start_iter`` and its own; residuals per parameter as for any codec).
        error_feedback: keep per-parameter residuals (ignored for lossless
            compressors such as NoCompression).
        algorithm: ``"ring"``, ``"two_phase"``, ``"allgather"``,
            ``"hierarchical"``, ``"halving_doubling"``,
            ``"sparse_reduce_scatter"`` or ``"auto"`` (see :func:`gradcomp.allreduce`; the
            sparse reduce-scatter keeps what a region owner's re-selection
            drops in that rank's per-parameter residuals; hierarchical:
            residuals only for the shard this rank sends across hosts;
            auto: per bucket index, :mod:`gradcomp.comm.auto`, the
            per-parameter residuals carry over every switch), or a
            :class:`gradcomp.AutoAlgorithm` (``"auto"`` with its settings).
        min_compress_numel: buckets with fewer elements use a plain allreduce.
        start_iter: steps before this one use a plain allreduce (DDP rebuilds
            its buckets after the first step; residuals are per parameter, so
            any value >= 0 is safe).
        meter: optional :class:`~gradcomp.TrafficMeter` (bytes per phase;
            plain allreduces are counted in phase ``"plain_allreduce"`` at the
            nominal ring volume ``2 (N - 1) / N * itemsize * n``, since gloo /
            NCCL choose their own algorithm).
        timeout: seconds any exchange may take before the step fails.
        timeline: optional :class:`gradcomp.timeline.StepTimeline`: the hook marks
            ``"handoff"`` when DDP hands over the last bucket of a step (the
            gradients are computed) and records each bucket's reduction as a
            ``"collective"`` span, with the transfers' ``"communicate"`` and
            ``"decompress"`` spans inside it (see :mod:`gradcomp.timeline`).
        dgc: Deep Gradient Compression (:class:`~gradcomp.DGC`, Lin et al.
            2018) around a ``TopK`` compressor with ``algorithm="allgather"``:
            ``True`` with DGC's defaults (momentum 0.9), or pass
            ``compressor=gc.DGC(gc.TopK(...), ...)`` for other settings. The
            state then keeps per parameter the velocity (:attr:`momenta`) and
            the accumulated velocity (:attr:`residuals`), clips each
            parameter's gradient and selects its top-k separately (the
            paper's per-layer selection; one payload per bucket), counts warm-up steps from
            ``start_iter``, and its DGC's ``world_size`` defaults to the
            group's size. The hook owns the momentum: the optimizer must be
            plain SGD (:func:`gradcomp.compressors.check_optimizer` checks
            one). Plain-allreduce buckets (small, or before ``start_iter``)
            get exact momentum SGD: ``u = m u + g`` is sent whole.
        topology: a :class:`gradcomp.Topology` for ``algorithm="hierarchical"``
            or ``"auto"`` (None: hosts from the environment); resolved with the state's
            group (collective, on every rank at once).
        server_error_feedback: ``algorithm="two_phase"``'s owners keep server
            residuals (:func:`gradcomp.allreduce`) in the residuals' memory.

    Attributes:
        iter: completed steps (advanced when the last bucket is handed over).
        residuals: parameter key -> flat float32 residual (with DGC: the
            accumulated velocity).
        momenta: parameter key -> flat float32 velocity (DGC only).
        dgc: the :class:`~gradcomp.DGC` settings, or None.

    At the first bucket every rank of the group checks that all hold the same
    compressor (settings, not its seed), DGC, ``error_feedback``,
    ``algorithm``, ``min_compress_numel`` and ``start_iter``
    (:func:`gradcomp.comm.settings.agree_settings`): they decide which buckets
    go compressed and how; otherwise every rank raises the same ``ValueError``
    (DDP's backward re-raises it as a ``RuntimeError``).

    Raises:
        TypeError / ValueError: a bad setting (the message gives the reason).
    """

    _PICKLED = ("compressor", "error_feedback", "algorithm", "min_compress_numel", "start_iter",
                "timeout", "iter", "residuals", "momenta", "dgc", "adaptive", "topology", "auto",
                "server_error_feedback")

    def __init__(
        self,
        process_group=None,
        compressor: Compressor | None = None,
        error_feedback: bool = True,
        algorithm: str | AutoAlgorithm = "ring",
        min_compress_numel: int = DEFAULT_MIN_COMPRESS_NUMEL,
        start_iter: int = 2,
        meter: TrafficMeter | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        timeline=None,
        dgc: bool = False,
        topology: Topology | None = None,
        server_error_feedback: bool = False,
    ):
        compressor = Int8Quantizer() if compressor is None else compressor
        if isinstance(compressor, str) and compressor == "auto":
            compressor = Adaptive()
        if not isinstance(dgc, bool):
            raise TypeError(f"dgc must be a bool, got {type(dgc).__name__}")
        if isinstance(compressor, DGC):
            dgc, compressor = compressor.clone(), compressor.wraps
        elif dgc:
            if not isinstance(compressor, TopK):
                raise ValueError(f"dgc=True needs a TopK compressor (e.g. gc.TopK(ratio=0.001)), got {compressor!r}")
            dgc = DGC(compressor)
        else:
            dgc = None
        if dgc is not None and not error_feedback:
            raise ValueError("DGC accumulates the unsent velocity in the residual: it needs error_feedback=True")
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {type(error_feedback).__name__}")
        #: the chooser of algorithm "auto" (its tracks keyed by bucket index), else None
        self.auto = algorithm if isinstance(algorithm, AutoAlgorithm) else None
        algorithm = "auto" if self.auto is not None else algorithm
        if isinstance(compressor, Adaptive):
            v.choice("algorithm", algorithm, FLAT_DENSE_ALGORITHMS)  # of the dense candidates
        elif isinstance(compressor, PowerSGD):
            v.choice("algorithm", algorithm, FLAT_DENSE_ALGORITHMS + ("halving_doubling",))  # its two exchanges
            if dgc is not None:
                raise ValueError("dgc applies to a TopK compressor, not to PowerSGD")
        else:
            compressor = unwrapped(compressor, "compressor", "with error_feedback=True the state keeps "
                                   "residuals per parameter", " or 'auto'")
            check_algorithm(algorithm, compressor, auto=True)
            if dgc is not None and algorithm != "allgather":
                raise ValueError(f"DGC selects per parameter over the whole bucket: it needs algorithm="
                                 f"'allgather', got {algorithm!r}")
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a gradcomp.Topology or None, got {type(topology).__name__}")
        if topology is not None and algorithm not in ("hierarchical", "auto"):
            raise ValueError(f"topology is used by algorithm='hierarchical' or 'auto' only, "
                             f"got algorithm={algorithm!r}")
        self.topology = topology
        self.server_error_feedback = v.flag("server_error_feedback", server_error_feedback)
        if server_error_feedback and (algorithm != "two_phase" or not error_feedback):
            raise ValueError(f"server_error_feedback needs algorithm='two_phase' and error_feedback=True, "
                             f"got algorithm={algorithm!r}, error_feedback={error_feedback}")
        if algorithm == "auto" and self.auto is None:
            self.auto = AutoAlgorithm()
        min_compress_numel = v.integer("min_compress_numel", min_compress_numel, 0)
        start_iter = v.integer("start_iter", start_iter, 0)
        if meter is not None and not isinstance(meter, TrafficMeter):
            raise TypeError(f"meter must be a gradcomp.TrafficMeter or None, got {type(meter).__name__}")
        timeout = v.timeout("timeout", timeout)
        if timeline is not None and not isinstance(timeline, StepTimeline):
            raise TypeError(f"timeline must be a gradcomp.timeline.StepTimeline or None, "
                            f"got {type(timeline).__name__}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, "
                            f"got {type(process_group).__name__}")
        self.process_group = process_group
        self.compressor = compressor
        self.error_feedback = error_feedback
        self.algorithm = algorithm
        self.min_compress_numel = min_compress_numel
        self.start_iter = start_iter
        self.meter = meter
        self.timeout = float(timeout)
        self.timeline = timeline
        self.iter = 0
        self.residuals: dict[int, torch.Tensor] = {}
        self.momenta: dict[int, torch.Tensor] = {}
        #: the adaptive policy (compressor "auto" or a gradcomp.Adaptive), else None
        self.adaptive = compressor if isinstance(compressor, Adaptive) else None
        #: the low-rank policy (a gradcomp.PowerSGD), else None
        self.powersgd = compressor if isinstance(compressor, PowerSGD) else None
        self._init_runtime()
        if dist.is_initialized():
            self._ensure_group()
        # else at the first bucket: a trainer that starts the process group
        # itself (Lightning's DDPStrategy(ddp_comm_state=...)) gets the state first
        if dgc is not None and dgc.world_size is None and self._group is not None:
            dgc.world_size = dist.get_world_size(self._group)
        self.dgc = dgc

    # ---- runtime (not pickled) ------------------------------------------------
    def _init_runtime(self) -> None:
        self._group = None
        self._worker: _CommThread | None = None
        self._failure: BaseException | None = None
        self._param_keys: dict[int, tuple[weakref.ref, int]] = {}
        self._shapes: dict[int, tuple[int, ...]] = {}  # parameter key -> shape (PowerSGD's matrices)
        self._next_key = 0
        self._checked = False  # the ranks' call verified (first compressed bucket)
        self._agreed = False  # the ranks' settings verified (first bucket)

    def _ensure_group(self):
        """gradcomp's own process group over the ranks of ``process_group``."""
        if self._group is None:
            pg = self.process_group if self.process_group is not None else dist.group.WORLD
            self._group = dist.new_group(
                dist.get_process_group_ranks(pg), backend=dist.get_backend(pg),
                timeout=datetime.timedelta(seconds=self.timeout), use_local_synchronization=True)
            dgc = getattr(self, "dgc", None)
            if dgc is not None and dgc.world_size is None:
                dgc.world_size = dist.get_world_size(self._group)
            if self.algorithm == "hierarchical":  # collective: here, on every rank at once
                layout(self._group, self.topology, self.timeout)
            elif self.algorithm == "auto":  # the same: whether hierarchical is a candidate
                self.auto.prepare(self._group, self.topology, timeout=self.timeout)
        return self._group

    @property
    def uses_residuals(self) -> bool:
        """Error feedback is on and the compressor is lossy."""
        return self.error_feedback and self.compressor.lossy

    def _key(self, param: torch.Tensor) -> int:
        """The parameter's stable key: its ordinal in first-seen order."""
        entry = self._param_keys.get(id(param))
        if entry is not None and entry[0]() is param:
            return entry[1]
        key = self._next_key
        self._next_key += 1
        self._param_keys[id(param)] = (weakref.ref(param), key)
        return key

    def _segments(self, bucket) -> list[tuple[int, int, int]]:
        """``(key, offset, numel)`` of each parameter's gradient in the bucket buffer."""
        out, off = [], 0
        for p in bucket.parameters():
            out.append((self._key(p), off, p.numel()))
            self._shapes[out[-1][0]] = tuple(p.shape)
            off += p.numel()
        if off != bucket.buffer().numel():
            raise RuntimeError(f"bucket {bucket.index()} holds {bucket.buffer().numel()} elements but its "
                               f"parameters add up to {off}")
        return out

    def _submit(self, job: Callable[[], torch.Tensor]) -> torch.futures.Future:
        if self._worker is None:
            self._worker = _CommThread(f"gradcomp-comm-{id(self):x}")
        fut: torch.futures.Future = torch.futures.Future()
        self._worker.submit(job, fut)
        # DDP reads the future from C++, where a Python-level set_exception looks
        # like a non-tensor value; re-raising inside then() marks the returned
        # future as failed with the original message instead
        return fut.then(_unwrap)

    def flush(self) -> None:
        """Wait until every bucket handed to the communication thread is reduced."""
        if self._worker is not None:
            self._worker.flush()

    def close(self) -> None:
        """Finish pending work and stop the communication thread (it restarts on
        the next bucket). Call before ``dist.destroy_process_group()``."""
        if self._worker is not None:
            self._worker.flush()
            self._worker.stop()
            self._worker = None

    # ---- the work done on the communication thread ------------------------------
    def _reduce(self, buf: torch.Tensor, compress: bool, segments, ready, step: int = 0,
                ticket=None, index: int = 0) -> torch.Tensor:
        if self.timeline is None:
            return self._reduce_bucket(buf, compress, segments, ready, step, ticket, index)
        with self.timeline.active(), self.timeline.span("collective"):
            return self._reduce_bucket(buf, compress, segments, ready, step, ticket, index)

    def _reduce_bucket(self, buf: torch.Tensor, compress: bool, segments, ready, step: int = 0,
                       ticket=None, index: int = 0) -> torch.Tensor:
        if self._failure is not None:
            raise RuntimeError("gradcomp: an earlier bucket of this GradCompState failed; the process "
                               f"group may be out of step: {self._failure!r}") from self._failure
        try:
            if buf.is_cuda:  # a new thread starts on device 0; NCCL needs the bucket's device
                torch.cuda.set_device(buf.device)
                ready.synchronize()  # the gradients are written
            if not self._agreed:  # which buckets go compressed, and how, must be the same everywhere
                agree_settings(self._group, "gradcomp.ddp.GradCompState", self._settings(), timeout=self.timeout,
                               device=buf.device, meter=self.meter)
                if self.adaptive is not None:
                    self.adaptive.agree(self._group, timeout=self.timeout, device=buf.device, meter=self.meter)
                self._agreed = True
            if compress:
                self._reduce_compressed(buf, segments, step, ticket, index)
            else:
                self._reduce_plain(buf, segments)
            if buf.is_cuda:
                torch.cuda.current_stream(buf.device).synchronize()
            return buf
        except BaseException as e:
            self._failure = e
            raise

    def _reduce_plain(self, buf: torch.Tensor, segments) -> None:
        group = self._group
        world = dist.get_world_size(group)
        if self.dgc is not None and segments is not None:
            self._momentum_plain(buf, segments)
            segments = None
        for key, off, n in segments or ():
            r = self.residuals.pop(key, None)  # delivered exactly: nothing left to remember
            if r is not None and r.numel() == n:
                buf[off:off + n].add_(r.to(buf.dtype))
        buf.div_(world)
        with span("communicate"):
            native.allreduce_(buf, group=group, timeout=self.timeout, meter=self.meter)

    def _momentum_plain(self, buf: torch.Tensor, segments) -> None:
        """DGC on a plain-allreduce bucket: exact momentum SGD. ``u = m u + g``
        (clipped per parameter as on the compressed path) is added to the
        accumulated velocity, which is sent whole and resets; no masking."""
        u = self._bucket_state(self.momenta, segments, buf)
        r = self._bucket_state(self.residuals, segments, buf)
        g = buf if buf.dtype == torch.float32 else buf.to(torch.float32)
        self.dgc.accumulate_(g, u, r, [(off, n) for _, off, n in segments])
        buf.copy_(r)
        r.zero_()

    def _reduce_compressed(self, buf: torch.Tensor, segments, step: int = 0, ticket=None, index: int = 0) -> None:
        if ticket is not None:  # the adaptive policy picks the codec and checks on each switch
            residual = self._bucket_state(self.residuals, segments, buf) if segments is not None else None
            self.adaptive.reduce_bucket(ticket, buf, residual, algorithm=self.algorithm, group=self._group,
                                        meter=self.meter, timeout=self.timeout, tag=_TAG)
            return
        compressor, residual = self.compressor, None
        if self.powersgd is not None:  # its own two exchanges, per parameter of the bucket
            residual = self._bucket_state(self.residuals, segments, buf) if self.uses_residuals else None
            self.powersgd.reduce_(buf, [Segment(k, off, self._shapes[k]) for k, off, _ in segments],
                                  step=step + self.start_iter, residual=residual, group=self._group,
                                  meter=self.meter, timeout=self.timeout, algorithm=self.algorithm,
                                  check=not self._checked, tag=_TAG)
            self._checked = True
            return
        if self.dgc is not None and segments is not None:
            compressor = self.dgc.bind(self._bucket_state(self.momenta, segments, buf),
                                       self._bucket_state(self.residuals, segments, buf),
                                       step, [(off, n) for _, off, n in segments])
        elif segments is not None:
            residual = self._bucket_state(self.residuals, segments, buf)
        # the first compressed bucket checks that every rank uses the same
        # settings; later buckets rely on DDP's identical bucket layout
        allreduce(buf, compressor, op="avg", algorithm=self.auto if self.algorithm == "auto" else self.algorithm,
                  group=self._group, meter=self.meter, timeout=self.timeout, residual=residual, out=buf,
                  check=not self._checked, topology=self.topology, tag=_TAG,
                  server_error_feedback=self.server_error_feedback,
                  key=("bucket", index) if self.algorithm == "auto" else None)
        self._checked = True

    def _settings(self) -> dict[str, object]:
        """What decides each bucket's messages: every rank must share it."""
        comp = self.compressor if self.adaptive is not None else (
            self.powersgd.settings() if self.powersgd is not None else compressor_text(self.compressor))
        return {"compressor": comp, "dgc": self.dgc, "error_feedback": self.error_feedback,
                "algorithm": self.algorithm if self.auto is None else self.auto,
                "min_compress_numel": self.min_compress_numel, "server_error_feedback": self.server_error_feedback,
                "start_iter": self.start_iter, "topology": self.topology}

    def _bucket_state(self, store: dict, segments, buf: torch.Tensor) -> torch.Tensor:
        """The bucket's flat float32 state from ``store`` (the residuals, or the
        DGC velocities), laid out like its buffer.

        Each parameter's state is kept as a view into the flat tensor of the
        bucket that last reduced it. While the bucket layout stays the same
        (every step after DDP's rebuild) that flat tensor is reused as is;
        after a change the parameters' states are gathered into a new one.
        """
        def view_of(flat, key, off, n):
            r = store.get(key)
            return r is not None and r._base is flat and r.storage_offset() == off and r.numel() == n

        first = store.get(segments[0][0]) if segments else None
        flat = first._base if first is not None else None
        if (flat is not None and flat.numel() == buf.numel() and flat.device == buf.device
                and all(view_of(flat, *seg) for seg in segments)):
            return flat
        flat = torch.zeros(buf.numel(), dtype=torch.float32, device=buf.device)
        for key, off, n in segments:
            r = store.get(key)
            if r is not None and r.numel() == n:
                flat[off:off + n].copy_(r)
            store[key] = flat[off:off + n]
        return flat

    # ---- pickling (like PowerSGDState: without process groups) -------------------
    def __getstate__(self) -> dict:
        """Settings, step, residuals (on CPU), the compressor with its RNG counter,
        and the meter's counters; not the process groups or the thread."""
        self.flush()
        state = {name: getattr(self, name) for name in self._PICKLED}
        state["timeline"] = None
        for name in ("residuals", "momenta"):
            state[name] = {k: r.detach().cpu().clone() for k, r in getattr(self, name).items()}
        state["meter"] = self.meter.as_dict() if self.meter is not None else None
        return state

    def __setstate__(self, state: dict) -> None:
        """Restore; ``process_group`` becomes the default group (set it before the
        first step to use another) and gradcomp's own group is made at the first
        bucket."""
        meter = state.pop("meter", None)
        self.momenta, self.dgc = {}, None  # absent from states pickled before DGC
        self.topology = None  # absent from states pickled before the hierarchical algorithm
        self.auto = None  # absent from states pickled before the automatic algorithm
        self.server_error_feedback = False  # absent from states pickled before it
        for name, value in state.items():
            setattr(self, name, value)
        self.powersgd = self.compressor if isinstance(self.compressor, PowerSGD) else None
        self.process_group = None
        self.meter = None
        if meter is not None:
            self.meter = TrafficMeter()
            self.meter.merge(meter)
        self._init_runtime()
        logger.info("GradCompState restored at step %d with %d residuals; process_group is the default "
                    "group", self.iter, len(self.residuals))

    def __repr__(self) -> str:
        return (f"GradCompState(compressor={self.compressor!r}, dgc={self.dgc!r}, algorithm={self.algorithm!r}, "
                f"error_feedback={self.error_feedback}, min_compress_numel={self.min_compress_numel}, "
                f"start_iter={self.start_iter}, iter={self.iter})")


def compressed_allreduce_hook(
    state: GradCompState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients with compression.

    Returns at once; the bucket is reduced on the state's communication thread
    (see the module docstring), in place in ``bucket.buffer()``.

    Args:
        state: the :class:`GradCompState`.
        bucket: DDP's gradient bucket; its buffer must be float32, float16 or
            bfloat16.

    Returns:
        A future completed with ``bucket.buffer()`` holding the average of
        every rank's gradients (bit-identical on every rank).

    Raises:
        TypeError: the bucket's dtype is not supported.
    """
    if not isinstance(state, GradCompState):
        raise TypeError(f"state must be a gradcomp.ddp.GradCompState (register_comm_hook(state, hook)), "
                        f"got {type(state).__name__}")
    buf = bucket.buffer()
    if buf.dtype not in INPUT_DTYPES:
        raise TypeError(f"compressed_allreduce_hook supports float32/float16/bfloat16 gradients, "
                        f"got a bucket of {buf.dtype}")
    state._ensure_group()
    compress = state.iter >= state.start_iter and buf.numel() >= state.min_compress_numel
    # keys are assigned on every bucket from the first step on, so they follow
    # the first step's bucket order whatever start_iter is
    segments = state._segments(bucket) if state.uses_residuals or state.powersgd is not None else None
    ready = None
    if buf.is_cuda:
        ready = torch.cuda.Event()
        ready.record()
    ticket = (state.adaptive.ticket(state.iter, bucket.index(), buf.numel())
              if compress and state.adaptive is not None else None)
    # the step (for DGC's warm-up) is read here: the thread may run after iter advances
    fut = state._submit(functools.partial(state._reduce, buf, compress, segments, ready,
                                          state.iter - state.start_iter, ticket, bucket.index()))
    if bucket.is_last():
        if state.timeline is not None:
            state.timeline.mark("handoff")
        state.iter += 1
        if state.meter is not None:
            state.meter.step()
    return fut
