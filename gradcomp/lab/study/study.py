"""Run a grid of training runs (mode x compressor) and collect comparable results.

Every run of a study shares one :class:`~gradcomp.lab.study.config.TrainConfig`:
same model initialisation, data split, data order, step budget and optimizer,
so the differences between runs come from the compressor (and the mode) alone.
The ``none`` baseline of each mode is always run first: traffic reductions and
accuracy gaps are measured against it.

Bytes are what the transports counted in their :class:`~gradcomp.TrafficMeter`:
``bytes_per_worker_per_step`` is the sum over the workers' counted bytes,
divided by workers and steps. In sync mode a worker counts what it sent in the
hook's collectives; in async mode what it pushed plus what it pulled (both
directions are compressed in the compressed runs).

The ``threshold-ef`` threshold, unless given, is calibrated once per study from
the gradient scale of the baseline: the magnitude that the top 1% of the
entries of worker 0's first-step gradient exceed (the model at its
initialisation, the first batch of the data order). At step 1 threshold+ef
therefore keeps as many entries as top-k 1%; later its density follows the
gradients (and the residuals error feedback accumulates).

Sync runs are deterministic (one torch thread per rank, a fixed ring order).
Async runs are not bit-reproducible: the server applies pushes in the order
they arrive, which the operating system's scheduling decides; the seed fixes
everything else.

Processes: each mode is one :func:`gradcomp.launch.launch` of local
processes (gloo, one torch thread each) that runs the mode's compressors one
after the other, every run starting afresh (model, optimizer, compressor
state, meter); only the processes and their process group are reused, which
spares the start-up cost per run. Under ``torchrun`` the current process is
one rank of the job and every run uses the job's process group. ``wall_s`` is
the training loop alone (the slowest rank's), start-up excluded.
"""

from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing as mp
import os
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import torch

from gradcomp import catalog
from gradcomp.launch import launch, start_method
from gradcomp.meter import TrafficMeter
from gradcomp.lab.study.async_ import async_world_size, train_async_rank
from gradcomp.lab.study.common import RankLog, counted_bytes
from gradcomp.lab.study.config import ALL_MODES, COMPRESSORS, TrainConfig
from gradcomp.lab.study.scenarios import Scenario
from gradcomp.lab.study.timing import server_queue, step_series, summarize_time, time_to_target
from gradcomp.lab.study.data import Digits, steps_per_epoch, worker_batches
from gradcomp.lab.study.model import num_parameters
from gradcomp.lab.study.workloads import batch_loss, build_model, load_split
from gradcomp.lab.study.ft import train_ft_rank
from gradcomp.lab.study.local import train_local_rank
from gradcomp.lab.study.sync import train_sync_rank

__all__ = ["RunResult", "StudyResult", "calibrate_threshold", "run_study", "in_torchrun",
           "fill_targets", "mode_compressors", "TARGET_FRACTION",
           "mode_rank", "summarize", "staleness_stats", "compare", "default_target", "host_record"]

#: ``on_progress(mode, compressor, step, seed)``: called in the launching process as a run advances.
ProgressFn = Callable[[str, str, int, int], None]

#: Default target accuracy: this fraction of the first mode's ``none`` baseline
#: final test accuracy (mean over seeds), the same target for every run of a study.
TARGET_FRACTION = 0.98


@dataclass
class RunResult:
    """The outcome of one run (all sizes in bytes, times in seconds, accuracies in [0, 1]).

    Attributes:
        mode, compressor, label: what ran (``label`` is the report's name).
        bytes_per_worker_per_step: counted wire bytes per worker per step.
        raw_bytes_per_worker_per_step: what the transport's meter says the same
            exchange would have moved uncompressed in float32.
        test_accuracy, test_loss: on the held-out split after the last step.
        wall_s: the slowest rank's training-loop time.
        marks: steps of the curve points; bytes_at_marks: cumulative counted
            bytes per worker at them; accuracy_at_marks: test accuracy at them.
        losses: mean training loss over workers at every step.
        meter: the workers' meters, summed.
        extra: role-specific counters (async: the server's updates, drops, staleness histogram).
        seed: the run's seed; scenario: :meth:`Scenario.as_dict` of where it ran;
        link: the link it ran on (configured and achieved rate; ``name`` ``"none"`` on loopback).
        host: the host it ran on, measured just before its launch (:func:`host_record`).
        clock_at_marks: training-clock seconds at the marks (evaluation excluded).
        time: :func:`gradcomp.lab.study.timing.summarize_time` (step time, phases, idle share).
        target_accuracy, time_to_target_s, steps_to_target: the study's target
            and when this run first reached it (None: not reached).
        reduction_x / reduction_pct / accuracy_gap_pp: against the mode's baseline
            (``baseline bytes / bytes``, ``1 - bytes / baseline bytes`` in %, and
            ``baseline accuracy - accuracy`` in percentage points).
    """

    mode: str
    compressor: str
    label: str
    workers: int
    steps: int
    bytes_per_worker_per_step: float
    raw_bytes_per_worker_per_step: float
    test_accuracy: float
    test_loss: float
    wall_s: float
    marks: list[int]
    bytes_at_marks: list[float]
    accuracy_at_marks: list[float]
    losses: list[float]
    meter: dict
    extra: dict = field(default_factory=dict)
    reduction_x: float = 1.0
    reduction_pct: float = 0.0
    accuracy_gap_pp: float = 0.0
    seed: int = 0
    scenario: dict = field(default_factory=dict)
    link: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    clock_at_marks: list[float] = field(default_factory=list)
    time: dict = field(default_factory=dict)
    target_accuracy: float | None = None
    time_to_target_s: float | None = None
    steps_to_target: int | None = None


@dataclass
class StudyResult:
    """All runs of a study plus what they shared."""

    config: TrainConfig
    runs: list[RunResult]
    num_parameters: int
    threshold: float
    train_samples: int
    test_samples: int
    wall_s: float = 0.0
    #: predictions the test accuracy counts per run: one per test sample, one per character of a
    #: sequence workload's test window (``test_samples`` x its block); None: ``test_samples``
    test_predictions: int | None = None
    seeds: list[int] = field(default_factory=list)
    scenario: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)
    target_accuracy: float | None = None
    target_fraction: float | None = None
    #: parameter tensors of the model (weights and biases counted apart), or None: not recorded
    param_tensors: int | None = None

    @property
    def predictions(self) -> int:
        """Predictions the test accuracy counts per run (its sampling error's ``n``)."""
        return self.test_predictions or self.test_samples


def in_torchrun() -> bool:
    """True when ``torchrun`` (or another launcher) set ``RANK`` and ``WORLD_SIZE``."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def calibrate_threshold(cfg: TrainConfig, data: Digits | None = None) -> float:
    """The ``threshold-ef`` threshold for ``cfg``: the (1 - 1%) quantile of
    ``|g|`` over every entry of worker 0's gradient at the first step
    (see the module docstring)."""
    if data is None:
        data = load_split(cfg)
    model = build_model(cfg, data)
    idx = next(worker_batches(len(data.y_train), cfg.workers, 0, cfg.batch_size, cfg.seed, 1))
    batch_loss(model, data.x_train[idx], data.y_train[idx]).backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).abs()
    k = max(1, math.ceil(catalog.entry("threshold-ef").density * g.numel()))
    return float(g.kthvalue(g.numel() - k + 1).values)


def _through_ps(mode: str, cfg: TrainConfig) -> bool:
    """Whether ``mode``'s runs go through the parameter server (async, or sync with backup workers)."""
    return mode == "async" or (mode == "sync" and cfg.backup_workers is not None)


def _rank_fn(mode: str, cfg: TrainConfig):
    if _through_ps(mode, cfg):
        return functools.partial(train_async_rank, ps_mode=mode)
    if mode == "auto":
        return functools.partial(train_local_rank, adaptive=True)
    return {"sync": train_sync_rank, "local": train_local_rank, "ft": train_ft_rank}[mode]


def mode_compressors(mode: str, names: list[str]) -> list[str]:
    """The rows of ``mode``: ``names`` (the ``none`` baseline first), or for the auto mode its
    one row ``auto`` (the codec is chosen online)."""
    return ["auto"] if mode == "auto" else names


def _world_size(mode: str, cfg: TrainConfig) -> int:
    return async_world_size(cfg) if _through_ps(mode, cfg) else cfg.workers


#: One run of a launch: ``(cfg, compressor name, index into the data list)``.
Job = tuple[TrainConfig, str, int]


class _Tagged:
    """Forwards a run's ``put(step)`` as ``(compressor, seed, step)`` to the study's queue."""

    def __init__(self, q, compressor: str, seed: int):
        self.q, self.compressor, self.seed = q, compressor, seed

    def put(self, step: int) -> None:
        self.q.put((self.compressor, self.seed, step))


class _Relay:
    """A queue-like ``put((compressor, seed, step))`` that calls ``fn(compressor, seed, step)`` in place."""

    def __init__(self, fn: Callable[[str, int, int], None]):
        self.fn = fn

    def put(self, item: tuple[str, int, int]) -> None:
        self.fn(*item)


def mode_rank(rank: int, world_size: int, mode: str, jobs: list[Job], datas: list[Digits],
              progress=None, link_clock=None) -> list[RankLog]:
    """Run every job of one mode, one after the other, as ``rank`` of an
    initialised process group. Each run starts afresh (model, optimizer,
    compressor state, meter, and a changing link's schedule: ``link_clock``);
    the processes and the process group are reused.

    Returns:
        This rank's :class:`RankLog` per job, in order.
    """
    fn = _rank_fn(mode, jobs[0][0])
    logs = []
    for cfg, name, d in jobs:
        logs.append(fn(rank, world_size, cfg, name, datas[d],
                       _Tagged(progress, name, cfg.seed) if progress is not None else None,
                       link_clock=link_clock))
    return logs


def _launch_local(mode: str, jobs: list[Job], datas: list[Digits],
                  on_step: Callable[[str, int, int], None] | None,
                  scenario: Scenario | None = None) -> tuple[list[list[RankLog]], dict]:
    """Launch one mode's runs on local processes (in an emulated cluster when
    the scenario has a link), relaying rank 0's progress to
    ``on_step(compressor, seed, step)``; returns the logs indexed [rank][run]
    and the link's description."""
    progress = mp.get_context(start_method()).Queue() if on_step is not None else None
    cfg = jobs[0][0]
    world = _world_size(mode, cfg)
    timeout = max(c.timeout for c, _, _ in jobs) * len(jobs)
    env = {"GRADCOMP_WORKER_THREADS": "1"}
    per = cfg.ranks_per_host if mode != "async" else 1  # the topology is of the sync and local workers
    with contextlib.ExitStack() as stack:
        if scenario is not None and scenario.link is not None:
            from gradcomp.lab.cluster import LocalCluster

            shape = dict(hosts=world // per, ranks_per_host=per) if per > 1 else dict(world_size=world)
            cluster = stack.enter_context(LocalCluster(**shape, rate=scenario.link,
                                                       rate_jitter=scenario.link_jitter,
                                                       seed=cfg.seed))
            link = cluster.describe()
            # a changing link starts its schedule again at every run's start
            remote = cluster.shaper.remote() if cluster.shaper is not None else None

            def start():
                return cluster.run(mode_rank, mode, jobs, datas, progress, remote, timeout=timeout, env=env)
        else:
            link = {"name": "none", "configured_bps": None, "achieved_bps": None,
                    "emulation": "loopback", "world_size": world, "hosts": world // per,
                    "ranks_per_host": per, "topology": f"{world // per}x{per}"}
            # hosts for the hierarchical algorithm: workers r // per share one
            hosts = [{"GRADCOMP_HOST_ID": str(r // per)} for r in range(world)]

            def start():
                return launch(mode_rank, world, (mode, jobs, datas, progress), timeout=timeout, env=env,
                              rank_env=hosts)
        return _watch(start, progress, on_step), link


def _watch(start: Callable[[], list], progress, on_step) -> list:
    """Run ``start()`` on a thread while relaying ``progress`` to ``on_step``;
    Ctrl-C / SIGTERM kill the launch's processes."""
    box: dict = {}

    def target():
        try:
            box["logs"] = start()
        except BaseException as e:  # re-raised in the calling thread
            box["error"] = e

    before = set(mp.active_children())
    thread = threading.Thread(target=target, name="gradcomp-train-launch", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            if progress is None:
                thread.join(0.2)
                continue
            try:
                on_step(*progress.get(timeout=0.1))
            except queue.Empty:
                pass
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): stop this launch's ranks too
        for p in set(mp.active_children()) - before:
            p.kill()
        thread.join(10)
        raise
    thread.join()
    if progress is not None:
        while True:
            try:
                on_step(*progress.get_nowait())
            except queue.Empty:
                break
        progress.close()
    if "error" in box:
        raise box["error"]
    return box["logs"]


def _run_distributed(mode: str, jobs: list[Job], datas: list[Digits],
                     on_step: Callable[[str, int, int], None] | None,
                     scenario: Scenario | None = None) -> tuple[list[list[RankLog]], dict]:
    """One mode's runs as this process's rank of the current process group;
    every rank gets every rank's logs, indexed [rank][run]."""
    import torch.distributed as dist

    cfg = jobs[0][0]
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = _world_size(mode, cfg)
    if world != expected:
        raise ValueError(f"{mode} mode with {cfg.workers} workers needs {expected} ranks, "
                         f"the job has {world}")
    logs = mode_rank(rank, world, mode, jobs, datas, _Relay(on_step) if on_step is not None else None)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, logs)
    link = {"name": os.environ.get("GRADCOMP_LINK", "unknown"), "configured_bps": None,
            "achieved_bps": None, "emulation": "torchrun job"}
    return everyone, link


def summarize(mode: str, compressor: str, cfg: TrainConfig, logs: list[RankLog]) -> RunResult:
    """Turn the ranks' logs of one run into a :class:`RunResult`."""
    workers = [log for log in logs if log.role == "worker"]
    if len(workers) != cfg.workers:
        raise RuntimeError(f"expected {cfg.workers} worker logs, got {len(workers)}")
    evaluator = next(log for log in logs if log.evals)
    test_loss, test_acc = next(log.final for log in logs if log.final is not None)
    n, steps = cfg.workers, cfg.steps
    # a parameter-server run counts pushes and pulls, whatever its mode; auto is local SGD
    counting = "async" if _through_ps(mode, cfg) else ("local" if mode == "auto" else mode)
    counted = sum(counted_bytes(counting, log.meter) for log in workers)
    raw = sum(counted_bytes(counting, log.meter, raw=True) for log in workers)
    total = TrafficMeter()
    for log in workers:
        total.merge(log.meter)
    for log in logs:  # the server's events (dropped and stale pushes); its bytes mirror the workers'
        if log.role != "worker":
            total.merge({"events": log.meter.get("events", {})})
    extra = {k: v for log in logs for k, v in log.extra.items() if k != "param_sha256"}
    extra.update(staleness_stats(extra))
    busy_intervals = extra.pop("busy_intervals", None)  # thousands of tuples: summarised here
    if busy_intervals:
        extra.update(server_queue({**extra, "busy_intervals": busy_intervals}, workers))
    if mode == "auto" and all(log.steps for log in workers):  # the decision timeline's idle share
        extra["steps_series"] = step_series(workers)
    digests = [log.extra.get("param_sha256") for log in workers]
    if any(digests):
        extra["param_sha256_per_worker"] = digests
    return RunResult(
        mode=mode, compressor=compressor, label=COMPRESSORS[compressor].label,
        workers=n, steps=steps,
        bytes_per_worker_per_step=counted / n / steps,
        raw_bytes_per_worker_per_step=raw / n / steps,
        test_accuracy=test_acc, test_loss=test_loss,
        wall_s=max(log.wall_s for log in logs),
        marks=list(evaluator.marks),
        bytes_at_marks=[sum(log.traffic[i] for log in workers) / n for i in range(len(evaluator.marks))],
        accuracy_at_marks=[acc for _, acc in evaluator.evals],
        losses=[sum(log.losses[s] for log in workers) / n for s in range(steps)],
        meter=total.as_dict(),
        extra=extra,
        seed=cfg.seed,
        clock_at_marks=list(evaluator.clock),
        time=summarize_time(counting, cfg, workers, {"busy_intervals": busy_intervals}),
    )


def staleness_stats(extra: dict) -> dict:
    """Mean and max staleness of the applied pushes and the share of pushes
    dropped by ``max_staleness``, from the server's counters (async runs)."""
    hist = extra.get("staleness_histogram")
    if not hist:
        return {}
    pairs = [(int(k), int(v)) for k, v in hist.items()]
    n = sum(v for _, v in pairs)
    pushes = extra.get("accepted", n) + extra.get("dropped", 0)
    return {"staleness_mean": sum(k * v for k, v in pairs) / n if n else math.nan,
            "staleness_max": max((k for k, v in pairs if v), default=0),
            "dropped_share": extra.get("dropped", 0) / pushes if pushes else 0.0}


def compare(runs: Iterable[RunResult]) -> None:
    """Fill reductions and accuracy gaps against the ``none`` run of the same
    mode, seed and scenario."""
    runs = list(runs)
    base = {(r.mode, r.seed, r.scenario.get("name")): r for r in runs if r.compressor == "none"}
    for r in runs:
        # the auto mode has no none row of its own: it is held against sync's (else local's)
        modes = ("sync", "local") if r.mode == "auto" else (r.mode,)
        b = next((base[k] for k in ((m, r.seed, r.scenario.get("name")) for m in modes) if k in base), None)
        if b is None:
            continue
        r.reduction_x = b.bytes_per_worker_per_step / r.bytes_per_worker_per_step
        r.reduction_pct = 100.0 * (1.0 - r.bytes_per_worker_per_step / b.bytes_per_worker_per_step)
        r.accuracy_gap_pp = 100.0 * (b.test_accuracy - r.test_accuracy)


def default_target(runs: list[RunResult], fraction: float = TARGET_FRACTION) -> float:
    """``fraction`` x the mean final accuracy of the first mode's ``none`` runs (a mode
    without them, the auto mode alone: of its runs)."""
    first = runs[0].mode
    accs = ([r.test_accuracy for r in runs if r.compressor == "none" and r.mode == first]
            or [r.test_accuracy for r in runs if r.mode == first])
    return fraction * sum(accs) / len(accs)


def fill_targets(runs: Iterable[RunResult], target: float) -> None:
    """Set every run's target accuracy and its time and steps to reach it."""
    for r in runs:
        r.target_accuracy = target
        hit = time_to_target(r.clock_at_marks, r.marks, r.accuracy_at_marks, target)
        r.time_to_target_s, r.steps_to_target = hit if hit is not None else (None, None)


def host_record(samples: int = 5, interval_s: float = 0.1) -> dict:
    """The host a launch is about to share: ``{"cores", "background_load"}``.

    ``background_load`` is the median over ``samples`` readings ``interval_s``
    apart of the kernel's count of runnable threads (``/proc/loadavg``'s fourth
    field) less this process's own: the other jobs' demand for the cores
    (:class:`gradcomp.lab.plan.host.Host` reads it). None where ``/proc`` has no loadavg.
    """
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                counts.append(max(0, int(f.read().split()[3].split("/")[0]) - 1))
        except (OSError, IndexError, ValueError):
            return {"cores": os.cpu_count(), "background_load": None}
        if i + 1 < samples:
            time.sleep(interval_s)
    return {"cores": os.cpu_count(), "background_load": float(statistics.median(counts))}


def run_study(cfg: TrainConfig, modes: Iterable[str], compressors: Iterable[str],
              on_progress: ProgressFn | None = None,
              on_run: Callable[[RunResult], None] | None = None,
              scenario: Scenario | None = None, seeds: int = 1,
              target_acc: float | None = None, baseline: bool = True) -> StudyResult:
    """Run every (mode, compressor, seed), the ``none`` baseline first in each mode.

    Args:
        cfg: the shared settings (``cfg.threshold=None``: calibrated per seed, see
            the module docstring). A scenario's straggler and compute jitter
            replace ``cfg``'s.
        modes: subset of ``("sync", "async", "local", "ft")``.
        compressors: names from :data:`~gradcomp.lab.study.config.COMPRESSORS`.
        on_progress: ``(mode, compressor, step, seed)`` callback.
        on_run: called with each finished run.
        scenario: where to run (default: the loopback, ``cfg``'s straggler and jitter).
        seeds: repeats with seeds ``cfg.seed, cfg.seed + 1, ...``.
        target_acc: target test accuracy in [0, 1] (default: :data:`TARGET_FRACTION`
            of the baseline's, see :func:`default_target`).
        baseline: run the ``none`` baseline (False: ``compressors`` only; the rows
            reductions and gaps then keep their defaults).

    Raises:
        ValueError: an unknown mode or compressor; a global batch larger than
            the training set; sync mode with one worker; seeds < 1.
        gradcomp.launch.WorkerError: a rank failed (its traceback is attached).
        TimeoutError: a run exceeded ``cfg.timeout``.
        gradcomp.lab.cluster.ClusterError: the scenario's link cannot be emulated here.
    """
    modes = list(dict.fromkeys(modes))
    for m in modes:
        if m not in ALL_MODES:
            raise ValueError(f"mode must be one of {ALL_MODES}, got {m!r}")
    names = list(dict.fromkeys([*(["none"] if baseline else []), *compressors]))
    if not names:
        raise ValueError("compressors must name at least one row when baseline=False")
    for c in names:
        if c not in COMPRESSORS:
            raise ValueError(f"unknown compressor {c!r}; allowed: {','.join(COMPRESSORS)}")
        if set(modes) - {"auto"} - set(COMPRESSORS[c].modes):
            raise ValueError(f"compressor {c!r} runs in mode(s) {','.join(COMPRESSORS[c].modes)} only, "
                             f"got modes {','.join(modes)}: use --mode {COMPRESSORS[c].modes[0]}")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be an int >= 1, got {seeds!r}")
    for m in modes:
        if m in ("sync", "local", "auto", "ft") and cfg.workers < 2:
            raise ValueError(f"{m} mode needs at least 2 workers (a single worker exchanges no "
                             f"gradient, so there is nothing to compress), got {cfg.workers}")
    if scenario is None:
        scenario = Scenario(name="custom" if cfg.straggler or cfg.compute_jitter else "loopback",
                            straggler=cfg.straggler, compute_jitter=cfg.compute_jitter,
                            straggler_from_s=cfg.straggler_from_s)
    cfg = replace(cfg, straggler=scenario.straggler, compute_jitter=scenario.compute_jitter,
                  straggler_from_s=scenario.straggler_from_s)
    datas, cfgs = [], []
    for i in range(seeds):
        c = replace(cfg, seed=cfg.seed + i)
        data = load_split(c)
        if steps_per_epoch(len(data.y_train), c.workers, c.batch_size) < 1:
            raise ValueError(f"a global batch of {c.workers} workers x {c.batch_size} samples exceeds "
                             f"the {len(data.y_train)} training samples")
        if c.threshold is None and "threshold-ef" in names:
            c = replace(c, threshold=calibrate_threshold(c, data))
        datas.append(data)
        cfgs.append(c)
    model = build_model(cfg, datas[0])
    params, param_tensors = num_parameters(model), len(list(model.parameters()))
    distributed = in_torchrun()
    own_group = False
    if distributed:
        import torch.distributed as dist

        from gradcomp.launch import init_from_env

        own_group = not dist.is_initialized()
        init_from_env(timeout=cfg.timeout)
    t0 = time.perf_counter()
    runs: list[RunResult] = []
    links: dict = {}
    try:
        for mode in modes:
            on_step = None
            if on_progress is not None:
                def on_step(name, seed, step, _mode=mode):
                    on_progress(_mode, name, step, seed)
            run = _run_distributed if distributed else _launch_local
            host = host_record()
            jobs = [(c, name, i) for i, c in enumerate(cfgs) for name in mode_compressors(mode, names)]
            logs, links[mode] = run(mode, jobs, datas, on_step, scenario)
            for i, (c, name, _) in enumerate(jobs):
                r = summarize(mode, name, c, [rank_logs[i] for rank_logs in logs])
                r.scenario, r.link, r.host = scenario.as_dict(), links[mode], host
                runs.append(r)
                compare(runs)
                if on_run is not None:
                    on_run(runs[-1])
    finally:
        if own_group:
            dist.destroy_process_group()
    fill_targets(runs, default_target(runs) if target_acc is None else target_acc)
    return StudyResult(config=cfg, runs=runs, num_parameters=params, param_tensors=param_tensors,
                       threshold=cfgs[0].threshold if cfgs[0].threshold is not None else float("nan"),
                       train_samples=len(datas[0].y_train), test_samples=len(datas[0].y_test),
                       test_predictions=len(datas[0].y_test) * max(1, getattr(datas[0], "block", 0)),
                       wall_s=time.perf_counter() - t0, seeds=[c.seed for c in cfgs],
                       scenario=scenario.as_dict(), links=links,
                       target_accuracy=runs[0].target_accuracy,
                       target_fraction=None if target_acc is not None else TARGET_FRACTION)
