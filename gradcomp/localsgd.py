"""Local SGD and DiLoCo: synchronise every H steps with compressed pseudo-gradients.

Usage (every rank of the group, after ``dist.init_process_group``)::

    ls = gc.LocalSGD(model, sync_every=32, compressor=gc.Int8Quantizer(),
                     outer_optimizer="nesterov")           # DiLoCo; None: local SGD
    for x, y in loader:
        loss_fn(model(x), y).backward(); inner_opt.step(); inner_opt.zero_grad()
        ls.step()                                           # after every inner step
    ls.sync(); ls.close()                                   # final synchronisation

Every rank trains on its own for ``H`` steps; then every rank computes the
*pseudo-gradient* ``delta = anchor - params`` (how far its parameters moved
since the last synchronisation, ``anchor`` being the parameters every rank
held then), averages it over the group with :func:`gradcomp.allreduce` with
error feedback on the pseudo-gradient, and updates the anchor:

* ``outer_optimizer=None`` (local SGD, Stich 2019; Lin et al. 2020):
  ``anchor <- anchor - mean(delta)``, the average of the ranks' parameters
  (up to compression);
* ``outer_optimizer="nesterov"`` (DiLoCo, Douillard et al. 2023): the
  averaged pseudo-gradient is the gradient of an outer SGD step with Nesterov
  momentum on the anchor, with DiLoCo's defaults ``lr=0.7``, ``momentum=0.9``
  (:data:`OUTER_LR`, :data:`OUTER_MOMENTUM`); or a factory
  ``params -> torch.optim.Optimizer`` for any other outer optimizer, e.g.
  ``functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9, nesterov=True)``.

Then every rank loads the new anchor into its parameters, bit-identical on every rank (the
same decoded bytes and float32 arithmetic). The inner optimizer's state stays local, as in
DiLoCo; buffers (e.g. BatchNorm statistics) are not synchronised.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019) runs on the pseudo-gradient: a
rank keeps one flat float32 residual per fragment, the part of its pseudo-gradients that
compression has not delivered yet, and adds it to the next one (:mod:`gradcomp.comm.local`).
Over any number of synchronisations with the allgather algorithm,
``N * (anchor_0 - anchor_T) + sum_r residual_r = sum_r sum_t delta_{r,t}`` under averaging.

Streaming (Streaming DiLoCo, Douillard et al. 2025): ``fragments=F`` splits the parameters
into ``F`` fragments (contiguous runs of ``model.parameters()``, balanced by element count),
each with its own anchor, residual and outer-optimizer state. Fragment ``f`` starts its
exchange after the inner steps ``t`` with ``t mod H == ((f + 1) H / F) mod H``: one fragment
every ``H / F`` steps, each parameter once every ``H`` steps, so the peak
traffic of one exchange is ``1 / F`` of the model's. ``overlap=tau`` (``0 <=
tau < H / F``) runs the exchange on a background thread while training goes
on and applies the fragment's update after inner step ``t + tau``: the update
then has a **staleness of tau inner steps** (its pseudo-gradient measured the
parameters at step ``t``), and loading the new anchor replaces the fragment's
parameters, so the fragment's last ``tau`` local steps are dropped (the
paper's mixing factor ``alpha = 0``, torchft's default; it keeps the ranks
bit-identical). At most one exchange is in flight at a time.

Traffic: the exchanges run on a process group of gradcomp's own (never interleaved with the
user's collectives); the constructor agrees the settings and parameters on every rank, and
``meter`` gets the bytes per phase (docs/local-sgd.md).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from gradcomp import _validate as v
from gradcomp.adaptive import Adaptive
from gradcomp.comm import (DEFAULT_TIMEOUT, FLAT_DENSE_ALGORITHMS, INPUT_DTYPES, AutoAlgorithm, Topology,
                           allreduce, check_algorithm)
from gradcomp.comm.settings import agree_settings, compressor_text, setting_text
from gradcomp.comm.topology import layout
from gradcomp.compressors import Compressor, Int8Quantizer, unwrapped
from gradcomp.localsgd_fragments import Fragment, check_schedule, cpu_copy, partition
from gradcomp.meter import TrafficMeter
from gradcomp.partial_work import PartialWork, partial_work_argument
from gradcomp.powersgd import PowerSGD
from gradcomp.sync_period import WINDOW_STEPS, SyncPeriod, period_argument
from gradcomp.timeline import StepTimeline

__all__ = ["LocalSGD", "ADAPTIVE", "OUTER_LR", "OUTER_MOMENTUM", "OUTER_OPTIMIZERS", "check_schedule"]

#: DiLoCo's outer learning rate (Douillard et al. 2023, section 3)
OUTER_LR = 0.7
#: DiLoCo's outer Nesterov momentum
OUTER_MOMENTUM = 0.9
#: names ``outer_optimizer`` accepts besides None and a factory
OUTER_OPTIMIZERS = ("avg", "nesterov")
#: the :class:`~gradcomp.Adaptive` of ``compressor="auto"``: it decides every other exchange
#: (a new codec is measured once before the next decision; with an adaptive period, once its
#: first decision is taken, every ``ceil(WINDOW_STEPS / H)`` exchanges if more); the exchange
#: (``overlap=0``) hides behind none of the round's compute (``upper`` near 0): ranked by round
#: time x convergence factor, or by the exchange alone below an adaptive period's upper bound
ADAPTIVE = {"interval": 2, "probe": 1, "upper": 1e-3, "lower": 5e-4}


def _codec(compressor, algorithm) -> tuple[Compressor | Adaptive | PowerSGD, str | AutoAlgorithm]:
    """The compressor (``"auto"``: an :class:`~gradcomp.Adaptive` with :data:`ADAPTIVE`) and its algorithm."""
    compressor = Int8Quantizer() if compressor is None else compressor
    if isinstance(compressor, str) and compressor == "auto":
        compressor = Adaptive(**ADAPTIVE)
    if isinstance(compressor, Adaptive):  # the algorithm of its dense candidates
        return compressor, v.choice("algorithm", "ring" if algorithm is None else algorithm, FLAT_DENSE_ALGORITHMS)
    if isinstance(compressor, PowerSGD):  # per parameter of a fragment, two exchanges of dense factors
        return compressor, v.choice("algorithm", "ring" if algorithm is None else algorithm,
                                    ("ring", "two_phase", "halving_doubling"))
    compressor = unwrapped(compressor, "compressor", "LocalSGD keeps the pseudo-gradient residuals "
                           "(error_feedback=True)", " or 'auto'")
    if isinstance(algorithm, AutoAlgorithm):  # a configured chooser of algorithm "auto"
        check_algorithm("auto", compressor, auto=True)
        return compressor, algorithm
    algorithm = ("allgather" if compressor.sparse else "ring") if algorithm is None else algorithm
    check_algorithm(algorithm, compressor, auto=True)
    return compressor, algorithm


class LocalSGD:
    """Local SGD / DiLoCo / Streaming DiLoCo over a torch.distributed group.

    Create it on every rank of ``group`` at the same point, after the model is
    built and before training: it broadcasts the parameters from the group's
    first rank (like DistributedDataParallel) and takes them as the first
    anchor. Call :meth:`step` after every inner ``optimizer.step()``. See the
    module docstring for the algorithm, the schedule and the staleness.

    Args:
        model: the module to train; its parameters that require grad are
            synchronised (float32, float16 or bfloat16, all on one device:
            CPU for gloo, the current CUDA device for NCCL).
        sync_every: ``H``, inner steps between two synchronisations of a
            parameter (>= 1); ``"auto"`` or a :class:`~gradcomp.SyncPeriod`: chosen
            online at every synchronisation (:mod:`gradcomp.sync_period`; then
            ``fragments=1``, ``overlap=0``).
        min_sync_every, max_sync_every, period_cost, comm_share: the bounds and the
            rule of ``sync_every="auto"`` (default 1, 64, the cost rule with
            :data:`gradcomp.sync_period.PERIOD_COST`; ``comm_share``: the share rule;
            :class:`~gradcomp.SyncPeriod`).
        compressor: a gradcomp compressor (default :class:`~gradcomp.Int8Quantizer`),
            not wrapped in ErrorFeedback (residuals are kept here); ``"auto"`` or a
            :class:`~gradcomp.Adaptive`: the codec chosen online, per fragment
            (``"auto"``: with :data:`ADAPTIVE`; its state is not checkpointed); with an adaptive
            period below its upper bound, its ``objective`` is ``"exchange"`` (it then starts on
            the candidate of the fewest bytes), and its ``interval`` at least ``ceil(16 / H)``
            once the period decided (docs/local-sgd.md).
        outer_optimizer: None or ``"avg"`` (averaging: local SGD),
            ``"nesterov"`` (DiLoCo: SGD, lr :data:`OUTER_LR`, Nesterov momentum
            :data:`OUTER_MOMENTUM`), or a callable taking the list of anchor
            tensors (float32, shaped like the parameters) and returning a
            ``torch.optim.Optimizer`` over them.
        group: the process group (default: the world).
        meter: optional :class:`~gradcomp.TrafficMeter`.
        error_feedback: keep residuals of the pseudo-gradients (ignored for
            lossless compressors).
        algorithm: ``"ring"``, ``"two_phase"``, ``"hierarchical"`` or
            ``"halving_doubling"`` for dense compressors, ``"allgather"`` or
            ``"sparse_reduce_scatter"`` for sparse ones (:func:`gradcomp.allreduce`);
            ``"auto"`` or a :class:`gradcomp.AutoAlgorithm`: per fragment, the
            one measured fastest (:mod:`gradcomp.comm.auto`; residuals carry
            over every switch); None picks ``"ring"`` or ``"allgather"``.
        fragments: ``F``, fragments synced in turn; must divide ``sync_every``.
        overlap: ``tau``, inner steps between the start of a fragment's
            exchange and the application of its update (0: at once, no thread);
            ``0 <= tau < sync_every / fragments``.
        timeout: seconds one exchange may take.
        timeline: optional :class:`gradcomp.timeline.StepTimeline`: each exchange
            is recorded as a ``"collective"`` span (with the transport's
            ``"compress"``, ``"communicate"`` and ``"decompress"`` spans inside),
            on whichever thread runs it.
        topology: a :class:`gradcomp.Topology` for ``algorithm="hierarchical"``
            or ``"auto"`` (None: hosts from the environment), resolved here (collective).
        partial_work: True or a :class:`~gradcomp.partial_work.PartialWork` (kept as ``partial``,
            reset): a rank slower than the others runs fewer inner steps of a round instead of
            holding it up (the loop asks :attr:`should_compute`; ``fragments=1``, ``overlap=0``).

    Attributes:
        sync_every: the period now (inner steps; it changes at synchronisations when adaptive).
        period: the :class:`~gradcomp.SyncPeriod` choosing it, or None (fixed).
        steps: calls of :meth:`step` so far.
        syncs: fragment exchanges applied so far (:meth:`sync` included).

    Raises:
        TypeError / ValueError: a bad argument (the message names it and the
            allowed values).
        ValueError: the ranks of the group passed different schedules,
            codecs, algorithms, error feedback, outer optimizers or parameter
            layouts (on every rank, naming the first difference).
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(
        self,
        model: nn.Module,
        sync_every: int | str | SyncPeriod,
        compressor: Compressor | None = None,
        outer_optimizer: str | Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        group=None,
        meter: TrafficMeter | None = None,
        *,
        error_feedback: bool = True,
        algorithm: str | AutoAlgorithm | None = None,
        fragments: int = 1,
        overlap: int = 0,
        timeout: float = DEFAULT_TIMEOUT,
        timeline: StepTimeline | None = None,
        topology: Topology | None = None,
        min_sync_every: int | None = None,
        max_sync_every: int | None = None,
        comm_share: float | None = None,
        period_cost: float | None = None,
        partial_work: bool | PartialWork = False,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.period = period_argument(sync_every, min_sync_every, max_sync_every, comm_share,
                                      period_cost=period_cost, fragments=fragments, overlap=overlap)
        self.sync_every, self.fragments, self.overlap = check_schedule(
            sync_every if self.period is None else self.period.start, fragments, overlap)
        compressor, algorithm = _codec(compressor, algorithm)
        if self.period is not None and isinstance(compressor, Adaptive):  # from the first exchange on
            compressor.objective = "step" if self.period.start >= self.period.max_sync_every else "exchange"
            self._codec_interval = compressor.interval
        v.flag("error_feedback", error_feedback)
        #: the chooser of algorithm "auto" (its tracks keyed by fragment), else None
        self.auto = algorithm if isinstance(algorithm, AutoAlgorithm) else None
        algorithm = "auto" if self.auto is not None else algorithm
        if algorithm == "auto" and self.auto is None:
            self.auto = AutoAlgorithm()
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a gradcomp.Topology or None, got {type(topology).__name__}")
        if topology is not None and algorithm not in ("hierarchical", "auto"):
            raise ValueError(f"topology is used by algorithm='hierarchical' or 'auto' only, "
                             f"got algorithm={algorithm!r}")
        self.topology = topology
        if not (outer_optimizer is None or callable(outer_optimizer) or outer_optimizer in OUTER_OPTIMIZERS):
            raise ValueError(f"outer_optimizer must be None, one of {OUTER_OPTIMIZERS} or a callable "
                             f"params -> torch.optim.Optimizer, got {outer_optimizer!r}")
        if meter is not None and not isinstance(meter, TrafficMeter):
            raise TypeError(f"meter must be a gradcomp.TrafficMeter or None, got {type(meter).__name__}")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        self.timeout = v.timeout("timeout", timeout)
        if timeline is not None and not isinstance(timeline, StepTimeline):
            raise TypeError(f"timeline must be a gradcomp.timeline.StepTimeline or None, "
                            f"got {type(timeline).__name__}")
        self.timeline = timeline
        self.partial = partial_work_argument(partial_work, self.fragments, self.overlap)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("model has no parameter that requires grad")
        for p in params:
            if p.dtype not in INPUT_DTYPES:
                raise TypeError(f"parameters must be float32, float16 or bfloat16, got {p.dtype}")
            if p.device != params[0].device:
                raise ValueError(f"parameters must all be on one device, got {params[0].device} "
                                 f"and {p.device}")
        if self.fragments > len(params):
            raise ValueError(f"fragments must be <= the number of parameters that require grad "
                             f"({len(params)}), got {self.fragments}")
        if not dist.is_initialized():
            raise RuntimeError("LocalSGD needs torch.distributed initialised first (dist.init_process_group)")

        self.compressor = compressor
        self.algorithm = algorithm
        self.error_feedback = error_feedback and compressor.lossy
        self.meter = meter
        pg = dist.group.WORLD if group is None else group
        if dist.get_rank(pg) < 0:
            raise ValueError("this process is not a member of group")
        self._group = dist.new_group(dist.get_process_group_ranks(pg), backend=dist.get_backend(pg),
                                     timeout=datetime.timedelta(seconds=self.timeout),
                                     use_local_synchronization=True)
        # every rank must run the same schedule on the same layout: checked before anything else
        # moves (ranks that differ would pair unrelated exchanges, or wait out the timeout)
        agree_settings(self._group, "gradcomp.LocalSGD",
                       self._settings(model, params, outer_optimizer), timeout=self.timeout,
                       device=params[0].device, meter=meter)
        if algorithm == "hierarchical":  # collective: here, not on the exchange thread
            layout(self._group, topology, self.timeout, params[0].device)
        elif algorithm == "auto":  # the same: whether hierarchical is a candidate
            self.auto.prepare(self._group, topology, timeout=self.timeout, device=params[0].device)
        with torch.no_grad():
            src = dist.get_global_rank(self._group, 0)
            for p in params:
                if p.is_contiguous():
                    dist.broadcast(p.detach(), src=src, group=self._group)
                else:  # e.g. channels_last: the transport needs contiguous memory
                    buf = p.detach().contiguous()
                    dist.broadcast(buf, src=src, group=self._group)
                    p.copy_(buf)
        cuts = partition([p.numel() for p in params], self.fragments)
        self._frags = [Fragment([params[i] for i in idx], self.error_feedback, key=f, first=idx[0])
                       for f, idx in enumerate(cuts)]
        self.outer_optimizer = self._make_outer(outer_optimizer)
        self.steps = 0
        self.syncs = 0
        self._round_start = 0  # the step the period's current round started after
        self._pending: tuple[int, int, concurrent.futures.Future] | None = None  # (fragment, due, future)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        if self.period is not None:
            self.period.begin()  # the first round's compute starts now

    def _settings(self, model: nn.Module, params: list[nn.Parameter], outer) -> dict[str, object]:
        """What every rank must share: the schedule, the codec, the outer
        optimizer and each synchronised parameter's name, shape and dtype."""
        names = {id(p): n for n, p in model.named_parameters()}
        shapes = {f"parameter {i}": f"{names.get(id(p), '?')}: shape {tuple(p.shape)}, {p.dtype}"
                  for i, p in enumerate(params)}
        return {"sync_every": self.sync_every if self.period is None else repr(self.period),
                "fragments": self.fragments, "overlap": self.overlap,
                "compressor": compressor_text(self.compressor),
                "algorithm": self.algorithm if self.auto is None else self.auto,
                "error_feedback": self.error_feedback,
                "outer_optimizer": "avg" if outer is None else setting_text(outer),
                "topology": self.topology, "partial_work": self.partial and self.partial.tolerance,
                "parameters": len(params), **shapes}

    def _make_outer(self, spec) -> torch.optim.Optimizer | None:
        if spec is None or spec == "avg":
            return None
        views = [t for f in self._frags for t in f.views]
        if spec == "nesterov":
            return torch.optim.SGD(views, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        opt = spec(views)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer(params) must return a torch.optim.Optimizer, "
                            f"got {type(opt).__name__}")
        return opt

    @property
    def codec(self) -> str | None:
        """The adaptive codec's choice for the first fragment now (None: not adaptive, or before its first exchange)."""
        return self.compressor.codec(0) if isinstance(self.compressor, Adaptive) else None

    @property
    def should_compute(self) -> bool:
        """Whether this rank runs its next inner step; False under ``partial_work`` once its share
        of the round is run: call :meth:`step` without computing (a step computed anyway is not weighted)."""
        return self.partial is None or self.partial.should_compute

    @property
    def parameter_fragments(self) -> list[list[nn.Parameter]]:
        """The parameters of each fragment, in order."""
        return [list(f.params) for f in self._frags]

    @property
    def pending_fragment(self) -> int | None:
        """The fragment whose exchange is in flight (started, not applied yet), or None."""
        return None if self._pending is None else self._pending[0]

    def fragment_due(self, step: int) -> int | None:
        """The fragment whose exchange starts after inner step ``step`` (1-based), or None."""
        r = (step - self._round_start) % self.sync_every
        interval = self.sync_every // self.fragments
        return None if r % interval else (r // interval - 1) % self.fragments

    # ---- training loop -------------------------------------------------------------
    def step(self, loss=None) -> None:
        """Count one inner step; synchronise the fragment(s) due now.

        Applies the pending exchange whose ``overlap`` has run out, then starts
        the exchange due after this step (and, with ``overlap=0``, applies it).
        With an adaptive period, the ranks then agree on the next period.

        Args:
            loss: optional training loss of this inner step (a finite number >= 0 or a one-element
                tensor), for an adaptive period's loss factor (:meth:`gradcomp.SyncPeriod.report_loss`);
                ignored with a fixed period. Without losses the period follows the timings only.

        Raises:
            TimeoutError / RuntimeError / gradcomp.PayloadError: an exchange failed (see
                :func:`gradcomp.allreduce`); the group is then not safe to use again.
        """
        if loss is not None and self.period is not None:
            self.period.report_loss(loss)
        if self.partial is not None:
            self.partial.stepped(self.meter)
        self.steps += 1
        if self._pending is not None and self._pending[1] == self.steps:
            self._finish_pending()
        f = self.fragment_due(self.steps)
        if f is not None:
            self._start(f, self.overlap)
            coupled = self.period is not None and isinstance(self.compressor, Adaptive)  # fragments=1 then
            if self.period is not None and (not coupled or self.compressor.decisions):  # the codec decides first
                self.sync_every = self.period.decide(self.steps, self.steps - self._round_start, self.sync_every,
                                                     self._group, self.timeout, self._frags[0].anchor.device,
                                                     self.meter, self.codec)
                self._round_start = self.steps
            if self.partial is not None:  # this rank's share of the next round (an adaptive period fits it)
                self.sync_every, self._round_start = self.partial.new_round(
                    self.steps, self.sync_every, self._group, self.timeout, self._frags[0].anchor.device, self.meter,
                    None if self.period is None else self.period.max_sync_every), self.steps
            if coupled:  # below its bound, the codec of the lightest exchange; decisions a window apart
                self.compressor.objective = "step" if self.sync_every >= self.period.max_sync_every else "exchange"
                if self.period.decisions:  # after the first decision (which waits for the codec's)
                    self.compressor.interval = max(self._codec_interval, -(-WINDOW_STEPS // self.sync_every))
        if self.meter is not None:
            self.meter.step()
        if self.partial is not None:
            self.partial.returned()

    def sync(self) -> None:
        """Synchronise every fragment now (after applying a pending exchange),
        e.g. before evaluating or saving the final model; fragments loaded
        since the last :meth:`step` (already identical on every rank) are
        skipped. The schedule of :meth:`step` is unchanged. Every rank must
        call it at the same point."""
        self._finish_pending()
        for f, frag in enumerate(self._frags):
            if frag.loaded_at != self.steps:
                self._start(f, 0)

    def close(self) -> None:
        """Apply a pending exchange and stop the background thread (it restarts
        when needed). Call before ``dist.destroy_process_group()``."""
        self._finish_pending()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _start(self, f: int, overlap: int) -> None:
        frag = self._frags[f]
        delta = frag.pseudo_gradient()
        uneven = self.partial is not None and self.partial.weigh_(delta)  # partial work: weighed by steps
        if overlap == 0:
            # the divergence of a round that a decision reads (not of a partial round; the codec's error is none)
            measure = self.period is not None and self.period.due(self.steps) and not uneven
            held = frag.residual_copy() if measure else None
            with self.period.timed() if self.period is not None else contextlib.nullcontext():
                mean = self._exchange(frag, delta, None, self.syncs)
            if measure:  # the parameters still hold this rank's local model
                self.period.report_divergence(*frag.divergence(mean, held))
            self._apply(f, mean)
            return
        ready = None
        if delta.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gradcomp-localsgd")
        self._pending = (f, self.steps + overlap,
                         self._executor.submit(self._exchange, frag, delta, ready, self.syncs))

    def _exchange(self, frag: Fragment, delta: torch.Tensor, ready, syncs: int) -> torch.Tensor:
        """Average ``delta`` over the group in place (on the caller's or the background thread);
        ``syncs``: exchanges applied before it (PowerSGD's step)."""
        if ready is not None:  # a new thread starts on device 0
            torch.cuda.set_device(delta.device)
            ready.synchronize()
        with contextlib.ExitStack() as stack:
            if self.timeline is not None:
                stack.enter_context(self.timeline.active())
                stack.enter_context(self.timeline.span("collective"))
            if isinstance(self.compressor, PowerSGD):
                self.compressor.reduce_(delta, frag.segments(), step=syncs, residual=frag.residual,
                                        group=self._group, meter=self.meter, timeout=self.timeout,
                                        algorithm=self.algorithm, check=not frag.checked, tag="gradcomp.LocalSGD")
            else:
                auto = self.algorithm == "auto"
                allreduce(delta, self.compressor, op="avg", algorithm=self.auto if auto else self.algorithm,
                          group=self._group, key=frag.key, meter=self.meter, timeout=self.timeout,
                          residual=frag.residual, out=delta, check=not frag.checked, topology=self.topology,
                          tag="gradcomp.LocalSGD")
        frag.checked = True
        if ready is not None:
            torch.cuda.current_stream(delta.device).synchronize()
        return delta

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        f, _, fut = self._pending
        self._pending = None
        self._apply(f, fut.result())

    def _apply(self, f: int, mean_delta: torch.Tensor) -> None:
        """The outer step of fragment ``f`` with the averaged pseudo-gradient, then load it."""
        frag = self._frags[f]
        if self.outer_optimizer is None:
            frag.anchor.sub_(mean_delta)
        else:
            mine = {id(t) for t in frag.views}
            for t, g in zip(frag.views, mean_delta.split([t.numel() for t in frag.views])):
                t.grad = g.view(t.shape)
            for group in self.outer_optimizer.param_groups:  # other fragments' anchors stay put
                for t in group["params"]:
                    if id(t) not in mine:
                        t.grad = None
            self.outer_optimizer.step()
            for t in frag.views:
                t.grad = None
        frag.load()
        frag.loaded_at = self.steps
        self.syncs += 1

    # ---- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume the same trajectory (tensors on CPU): the
        schedule, the step count, each fragment's anchor and residual, the outer
        optimizer's state, the compressor's state and a pending exchange's
        averaged pseudo-gradient (waited for, not applied). The model's
        parameters and the inner optimizer are the caller's to save."""
        pending = None
        if self._pending is not None:
            f, due, fut = self._pending
            pending = {"fragment": f, "due": due, "mean_delta": fut.result().cpu().clone()}
        return {
            "sync_every": self.sync_every, "fragments": self.fragments, "overlap": self.overlap,
            "steps": self.steps, "syncs": self.syncs, "round_start": self._round_start,
            "period": None if self.period is None else self.period.state_dict(),
            "anchors": [f.anchor.cpu().clone() for f in self._frags],
            "residuals": [None if f.residual is None else f.residual.cpu().clone() for f in self._frags],
            "outer_optimizer": None if self.outer_optimizer is None else cpu_copy(self.outer_optimizer.state_dict()),
            "compressor": self.compressor.state_dict() if isinstance(self.compressor, Compressor) else {},
            "pending": pending,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore what :meth:`state_dict` returned (validated before anything
        changes); the parameters keep their values (load the model's own
        state dict for them).

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: it was saved with another schedule, fragment sizes,
                error-feedback setting or outer optimizer, or holds NaN/Inf.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping (from state_dict()), got {type(state).__name__}")
        for name in ("sync_every", "fragments", "overlap")[self.period is not None:]:
            if state.get(name) != getattr(self, name):
                raise ValueError(f"state was saved with {name}={state.get(name)!r}, this LocalSGD has "
                                 f"{name}={getattr(self, name)!r}")
        if (state.get("outer_optimizer") is None) != (self.outer_optimizer is None):
            kind = ("averaging", "an outer optimizer")
            raise ValueError(f"state was saved with {kind[state.get('outer_optimizer') is not None]}, "
                             f"this LocalSGD uses {kind[self.outer_optimizer is not None]}")
        anchors, residuals = state.get("anchors"), state.get("residuals")
        if not isinstance(anchors, list) or not isinstance(residuals, list) \
                or len(anchors) != self.fragments or len(residuals) != self.fragments:
            raise ValueError(f"state['anchors'] and state['residuals'] must be lists of {self.fragments} "
                             "entries, one per fragment")
        for i, (frag, a, r) in enumerate(zip(self._frags, anchors, residuals)):
            self._check_flat(f"state['anchors'][{i}]", a, frag.numel)
            if (r is None) != (frag.residual is None):
                raise ValueError(f"state['residuals'][{i}] is {'absent' if r is None else 'present'} but "
                                 f"this LocalSGD has error feedback {'on' if frag.residual is not None else 'off'}")
            if r is not None:
                self._check_flat(f"state['residuals'][{i}]", r, frag.numel)
        pending = state.get("pending")
        if pending is not None:
            f = v.integer("state['pending']['fragment']", pending["fragment"], 0, self.fragments - 1)
            self._check_flat("state['pending']['mean_delta']", pending["mean_delta"], self._frags[f].numel)
        steps = v.integer("state['steps']", state.get("steps"), 0)
        round_start = v.integer("state['round_start']", state.get("round_start", 0), 0, steps)
        if self.period is not None:  # the period it had reached, within this one's bounds
            if not isinstance(state.get("period"), Mapping):
                raise ValueError("state was saved with a fixed sync_every, this LocalSGD has an adaptive one")
            sync_every = v.integer("state['sync_every']", state.get("sync_every"),
                                   self.period.min_sync_every, self.period.max_sync_every)
            self.period.load_state_dict(state["period"])
            self.sync_every = sync_every
        elif state.get("period") is not None:
            raise ValueError("state was saved with an adaptive sync_every, this LocalSGD has a fixed one")
        self.close()
        if self.partial is not None:  # measured again, every rank computing until the next agreement
            self.partial.reset()
        for frag, a, r in zip(self._frags, anchors, residuals):
            frag.anchor.copy_(a)
            if r is not None:
                frag.residual.copy_(r)
            frag.checked = False
            frag.loaded_at = -1  # the parameters are the caller's: sync() exchanges every fragment
        if self.outer_optimizer is not None:
            self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        if isinstance(self.compressor, Compressor):  # an Adaptive measures again from its lightest codec
            self.compressor.load_state_dict(state.get("compressor", {}))
        self.steps, self._round_start = steps, round_start
        self.syncs = v.integer("state['syncs']", state.get("syncs", 0), 0)
        if pending is not None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(pending["mean_delta"].to(self._frags[0].anchor.device).clone())
            self._pending = (pending["fragment"], v.integer("state['pending']['due']", pending["due"], steps + 1),
                             done)

    @staticmethod
    def _check_flat(name: str, t, numel: int) -> None:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1 or t.numel() != numel:
            got = (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__)
            raise ValueError(f"{name} must be a flat float32 tensor of {numel} elements, got {got}")
        if not v.all_finite(t):
            raise ValueError(f"{name} holds NaN or Inf")

    def __repr__(self) -> str:
        outer = "avg" if self.outer_optimizer is None else type(self.outer_optimizer).__name__
        return (f"LocalSGD(sync_every={self.sync_every}, compressor={self.compressor!r}, outer={outer}, "
                f"algorithm={self.algorithm!r}, fragments={self.fragments}, overlap={self.overlap}, "
                f"steps={self.steps})")
