"""``gradcomp train --mode pipeline``: pipeline-parallel training with measured bubbles.

Details: docs/pipeline.md#the-studys-pipeline-mode.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from gradcomp.lab.study.config import COMPRESSORS, TrainConfig
from gradcomp.lab.study.data import Digits, load_digits_split, worker_batches
from gradcomp.lab.study.model import DEFAULT_HIDDEN, evaluate, make_model
from gradcomp.lab.study.output import prepare_out
from gradcomp.lab.study.scenarios import scenario_list
from gradcomp.lab.study.pipeline_args import PIPELINE_SCHEDULES, add_pipeline_arguments, hidden_widths
from gradcomp.pipeline.bubble import bubble_fraction

__all__ = ["PipelineConfig", "PIPELINE_SCHEDULES", "add_pipeline_arguments", "pipeline_rank",
           "run_pipeline", "run_pipeline_study", "theory_bubble", "config_from_args"]

DEFAULT_PIPELINE_COMPRESSORS = ("none", "int8")


@dataclass(frozen=True)
class PipelineConfig:
    """Settings of a pipeline study (every run shares them).

    Attributes:
        stages: pipeline ranks P; workers: processes (a multiple of P).
        microbatches: the M values to run; schedules: schedule names;
        compressors: boundary compressors (names of the study's menu, dense only).
        steps, batch_size (samples per replica per step), lr, momentum, seed, hidden: as the study's.
        vertical_sync: PipeDream's vertical sync. timeout: seconds per launch.
        eval_every: steps between the weight snapshots evaluated for the time to target.
        straggler: ``(rank, factor)``: that rank's forwards and backwards take
            ``factor`` times as long; compute_jitter: every stage's compute
            stretched by a seeded lognormal factor of this CV (engine schedules only).
    """

    stages: int = 2
    workers: int = 2
    microbatches: tuple[int, ...] = (4,)
    schedules: tuple[str, ...] = ("gpipe",)
    compressors: tuple[str, ...] = DEFAULT_PIPELINE_COMPRESSORS
    steps: int = 350
    batch_size: int = 64
    lr: float = 0.1
    momentum: float = 0.9
    seed: int = 0
    hidden: tuple[int, ...] = DEFAULT_HIDDEN
    vertical_sync: bool = False
    timeout: float = 600.0
    eval_every: int = 10
    straggler: tuple[int, float] | None = None
    compute_jitter: float = 0.0

    @property
    def replicas(self) -> int:
        return self.workers // self.stages

    def runs(self) -> list[tuple[str, int, str]]:
        """(schedule, M, compressor) of every run, the ``none`` baseline first in each group."""
        names = list(dict.fromkeys(["none", *self.compressors]))
        out = []
        for s in self.schedules:
            for m in (self.microbatches if s != "pipedream" else (1,)):
                out += [(s, m, c) for c in names]
        return out

    def validate(self, num_layers: int, train_samples: int) -> None:
        """Raise ValueError (one line naming the option) for settings that cannot run."""
        from gradcomp.pipeline.engine import check_schedule

        if self.stages < 1:
            raise ValueError(f"--stages must be >= 1, got {self.stages}")
        if self.workers % self.stages:
            raise ValueError(f"--workers {self.workers} is not divisible by --stages {self.stages} "
                             "(each pipeline replica needs one process per stage)")
        for m in self.microbatches:
            if m < 1:
                raise ValueError(f"--microbatches must be >= 1, got {m}")
            if self.batch_size % m:
                raise ValueError(f"--batch-size {self.batch_size} is not divisible by --microbatches {m}")
        for c in self.compressors:
            if c not in COMPRESSORS:
                raise ValueError(f"unknown compressor {c!r}")
            if COMPRESSORS[c].sparse:
                raise ValueError(f"--compressors {c}: a stage boundary needs a dense compressor "
                                 "(none, fp16, bf16, int8, int8-ef)")
        if self.stages > num_layers:
            raise ValueError(f"--stages {self.stages} is larger than the model's {num_layers} layers")
        for s in self.schedules:
            if s not in PIPELINE_SCHEDULES:
                raise ValueError(f"--schedule must be among {','.join(PIPELINE_SCHEDULES)}, got {s!r}")
            if s == "pipedream":
                if self.straggler is not None or self.compute_jitter:
                    raise ValueError("--schedule pipedream takes no straggler or compute jitter "
                                     "(scenario +straggler / +jitter): run it on a plain link")
                if self.replicas != 1:
                    raise ValueError("--schedule pipedream runs one pipeline replica: --workers must "
                                     f"equal --stages ({self.stages}), got {self.workers}")
                continue
            for m in self.microbatches:
                check_schedule(s, self.stages, m, num_layers)
        if self.replicas * self.batch_size > train_samples:
            raise ValueError(f"{self.replicas} replicas x --batch-size {self.batch_size} exceeds the "
                             f"{train_samples} training samples")


def theory_bubble(schedule: str, p: int, m: int) -> float | None:
    """The textbook bubble fraction of ``schedule``
    (:func:`gradcomp.pipeline.bubble.bubble_fraction`): GPipe and 1F1B ``(p-1)/(m+p-1)``,
    interleaved with ``v = 2`` chunks ``(p-1)/(v m + p-1)``; None where the paper gives no
    closed form for unequal F/B/W (zero bubble, PipeDream's steady state is 0)."""
    if schedule in ("gpipe", "1f1b"):
        return bubble_fraction(p, m)
    if schedule == "interleaved":
        return bubble_fraction(p, m, chunks=2)
    return None


# ---- inside each rank ------------------------------------------------------------------------

def _state(parts: dict[int, nn.Module]) -> dict[int, dict[str, torch.Tensor]]:
    """A copy of the weights of this rank's stages, by stage index."""
    return {s: {k: v.detach().clone() for k, v in m.state_dict().items()} for s, m in parts.items()}


class _Clock:
    """A rank's training clock: seconds per step and, every ``eval_every`` steps
    (and the last: the final weights), the clock and a weight snapshot (its
    copy not counted)."""

    def __init__(self, cfg: PipelineConfig):
        self.cfg = cfg
        self.marks: list[int] = []
        self.clock: list[float] = []
        self.step_s: list[float] = []
        self.snapshots: list = []
        self._t0 = self._last = self._paused = 0.0

    def start(self) -> None:
        self._t0 = self._last = time.perf_counter()

    def step(self, step: int, parts: dict[int, nn.Module]) -> None:
        t = time.perf_counter()
        self.step_s.append(t - self._last)
        if step % self.cfg.eval_every == 0 or step == self.cfg.steps:
            self.marks.append(step)
            self.clock.append(t - self._t0 - self._paused)
            self.snapshots.append(_state(parts))
        self._last = time.perf_counter()
        self._paused += self._last - t

    def as_dict(self) -> dict:
        return {"marks": self.marks, "clock": self.clock, "step_s": self.step_s,
                "snapshots": self.snapshots,
                "wall_s": time.perf_counter() - self._t0 - self._paused}


def _groups(world: int, p: int):
    """(pipeline group, data-parallel group) of this rank; every rank creates all of them."""
    rank = dist.get_rank()
    pp_groups = [dist.new_group(list(range(r * p, (r + 1) * p))) for r in range(world // p)]
    dp_groups = [dist.new_group(list(range(s, world, p))) for s in range(p)] if world > p else None
    return pp_groups[rank // p], (dp_groups[rank % p] if dp_groups else None)


def _shapes(parts: list[nn.Module], rows: int, features: int) -> list[torch.Tensor]:
    """Example boundary tensors of a micro-batch of ``rows`` (requiring grad: static stage metadata)."""
    ex = [torch.zeros(rows, features)]
    for part in parts:
        ex.append(part(ex[-1].detach().requires_grad_(len(ex) > 1)).detach().requires_grad_(True))
    ex[0].requires_grad_(False)
    return ex


def _codec(compressor: str, meter):
    from gradcomp.pipeline.boundary import BoundaryCodec

    if compressor == "none":
        return BoundaryCodec(None, meter=meter)
    choice = COMPRESSORS[compressor]
    return BoundaryCodec(choice.build(), error_feedback=choice.error_feedback, meter=meter)


def _engine_run(cfg: PipelineConfig, schedule: str, m: int, compressor: str, data: Digits,
                pp_group, dp_group) -> dict:
    import gradcomp as gc
    from gradcomp.meter import TrafficMeter
    from gradcomp.pipeline.engine import build_schedule, rank_stages, stages_per_rank
    from gradcomp.pipeline.memory import ActivationMeter
    from gradcomp.pipeline.split import split_sequential
    from gradcomp.pipeline.stage import GradcompStage
    from gradcomp.pipeline.bubble import StageTimeline
    from gradcomp.lab.study.timing import ComputeDelay

    p = cfg.stages
    rank = dist.get_rank()
    pp_rank, replica = rank % p, rank // p
    model = make_model(cfg.seed, cfg.hidden, data.num_features, data.num_classes)
    n_stages = p * stages_per_rank(schedule)
    parts = split_sequential(model, n_stages)
    ex = _shapes(parts, cfg.batch_size // m, data.num_features)
    meter, dp_meter = TrafficMeter(), TrafficMeter()
    codec = _codec(compressor, meter)
    timeline = StageTimeline(pp_rank)
    ids = rank_stages(schedule, pp_rank, p)
    memories = {s: ActivationMeter(parts[s].parameters()) for s in ids}
    delay = ComputeDelay(rank, cfg.straggler, cfg.compute_jitter, cfg.seed)
    slowdown = (lambda: delay.factor(timeline.step)) if delay.active else None
    stages = [GradcompStage(parts[s], s, n_stages, torch.device("cpu"), codec=codec, timeline=timeline,
                            memory=memories[s], input_args=ex[s], output_args=ex[s + 1], group=pp_group,
                            slowdown=slowdown)
              for s in ids]
    params = [q for s in ids for q in parts[s].parameters()]
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    sched = build_schedule(schedule, stages, m, nn.functional.cross_entropy)
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
    losses, clock = [], _Clock(cfg)
    dist.barrier(group=pp_group)
    clock.start()
    batches = worker_batches(len(data.y_train), cfg.replicas, replica, cfg.batch_size, cfg.seed, cfg.steps)
    for step, idx in enumerate(batches, start=1):
        opt.zero_grad(set_to_none=True)
        kwargs = {"target": data.y_train[idx], "losses": []} if last else {}
        dist.barrier(group=pp_group)  # a common start: the step window is the schedule's alone
        with timeline.step_window():
            sched.step(data.x_train[idx], **kwargs) if first else sched.step(**kwargs)
        if last:
            losses.append(float(torch.stack(kwargs["losses"]).detach().mean()))
        if dp_group is not None:
            flat = torch.cat([q.grad.reshape(-1) for q in params])
            avg = gc.allreduce(flat, gc.NoCompression(), op="avg", group=dp_group, meter=dp_meter)
            offset = 0
            for q in params:
                q.grad.copy_(avg[offset:offset + q.numel()].view_as(q))
                offset += q.numel()
        opt.step()
        clock.step(step, {s: parts[s] for s in ids})
    return {"timeline": timeline, "meter": meter.as_dict(), "dp_meter": dp_meter.as_dict(),
            "activation_peak_bytes": {s: memories[s].peak for s in ids}, "losses": losses,
            **clock.as_dict(), "codec_s": codec.seconds}


def _pipedream_run(cfg: PipelineConfig, compressor: str, data: Digits, pp_group) -> dict:
    from gradcomp.comm.p2p import Comm
    from gradcomp.meter import TrafficMeter
    from gradcomp.pipeline.memory import ActivationMeter
    from gradcomp.pipeline.pipedream import PipeDreamStage
    from gradcomp.pipeline.split import split_sequential
    from gradcomp.pipeline.bubble import StageTimeline

    p, s = cfg.stages, dist.get_rank(pp_group)
    model = make_model(cfg.seed, cfg.hidden, data.num_features, data.num_classes)
    parts = split_sequential(model, p)
    ex = _shapes(parts, cfg.batch_size, data.num_features)
    meter = TrafficMeter()
    codec = _codec(compressor, meter)
    timeline = StageTimeline(s)
    memory = ActivationMeter(parts[s].parameters())
    opt = torch.optim.SGD(parts[s].parameters(), lr=cfg.lr, momentum=cfg.momentum)
    stage = PipeDreamStage(parts[s], s, Comm(pp_group, cfg.timeout), codec, opt,
                           act_shape=None if s == p - 1 else tuple(ex[s + 1].shape),
                           in_shape=None if s == 0 else tuple(ex[s].shape),
                           loss_fn=nn.functional.cross_entropy, vertical_sync=cfg.vertical_sync,
                           timeline=timeline, memory=memory)
    batches = list(worker_batches(len(data.y_train), 1, 0, cfg.batch_size, cfg.seed, cfg.steps))
    dist.barrier(group=pp_group)
    t0 = time.perf_counter()
    with timeline.step_window():
        stats = stage.run(cfg.steps, (data.x_train[i] for i in batches) if s == 0 else None,
                          (data.y_train[i] for i in batches) if s == p - 1 else None)
    wall = time.perf_counter() - t0
    return {"timeline": timeline, "meter": meter.as_dict(), "dp_meter": {},
            "activation_peak_bytes": {s: memory.peak}, "losses": stats.losses,
            "snapshots": [_state({s: parts[s]})], "marks": [], "clock": [], "step_s": [],
            "wall_s": wall, "codec_s": codec.seconds,
            "pipedream": {"staleness": stats.staleness, "update_rate": stats.update_rate(),
                          "first_update_s": stats.update_times[0] - t0 if stats.update_times else None,
                          "updates": len(stats.update_times),
                          "stash_peak_bytes": stats.stash_peak_bytes}}


def pipeline_rank(rank: int, world: int, cfg: PipelineConfig, data: Digits) -> list[dict]:
    """Every run of ``cfg`` as ``rank`` of an initialised group of ``cfg.workers`` ranks.

    Returns:
        Per run: this rank's timeline, boundary meter, activation peaks, losses
        and the final weights of its stages (rank 0's list also holds the test
        evaluation of the assembled model).
    """
    pp_group, dp_group = _groups(world, cfg.stages)
    out = []
    for schedule, m, compressor in cfg.runs():
        if schedule == "pipedream":
            log = _pipedream_run(cfg, compressor, data, pp_group)
        else:
            log = _engine_run(cfg, schedule, m, compressor, data, pp_group, dp_group)
        snaps = log.pop("snapshots")
        gathered: list | None = [None] * world if rank == 0 else None
        dist.gather_object(snaps if rank < cfg.stages else None, gathered, dst=0)
        if rank == 0:
            log["evals"] = _evaluate_snapshots(cfg, schedule, gathered[:cfg.stages], data)
            log["final"] = log["evals"][-1]
        out.append(log)
    return out


def _evaluate_snapshots(cfg: PipelineConfig, schedule: str, per_rank: list[list[dict]],
                        data: Digits) -> list[tuple[float, float]]:
    """(test loss, accuracy) of the assembled model at each snapshot (per rank
    of replica 0: a list of ``{stage: state_dict}``, one per mark)."""
    from gradcomp.pipeline.engine import stages_per_rank
    from gradcomp.pipeline.split import split_sequential

    model = make_model(cfg.seed, cfg.hidden, data.num_features, data.num_classes)
    v = 1 if schedule == "pipedream" else stages_per_rank(schedule)
    parts = split_sequential(model, cfg.stages * v)
    evals = []
    for i in range(len(per_rank[0])):
        for snaps in per_rank:
            for s, sd in snaps[i].items():
                parts[s].load_state_dict(sd)
        evals.append(evaluate(model, data.x_test, data.y_test))
    return evals


# ---- on the launching process ------------------------------------------------------------------

def _summarize(cfg: PipelineConfig, run: tuple[str, int, str], logs: list[dict],
               link: dict | None = None) -> dict:
    import statistics

    from gradcomp.pipeline.bubble import analyze

    schedule, m, compressor = run
    p = cfg.stages
    pipe = logs[:p]  # replica 0
    an = analyze([log["timeline"] for log in pipe],
                 skip=1 if schedule != "pipedream" and cfg.steps > 1 else 0)
    windows = max(1, cfg.steps - 1) if schedule != "pipedream" else 1
    phases: dict[str, int] = {}
    for log in pipe:
        for name, c in log["meter"]["phases"].items():
            phases[name] = phases.get(name, 0) + c["bytes_sent"]
    sent = sum(log["meter"]["bytes_sent"] for log in pipe)
    raw = sum(log["meter"]["raw_bytes_sent"] for log in pipe)
    per_stage = []
    for r, log in enumerate(pipe):
        a = an["per_rank"][r]
        entry = {k: a[k] / windows for k in ("forward", "backward", "weight", "codec", "wait", "idle")}
        entry.update(bubble=a["bubble"], idle_fraction=a["idle_fraction"],
                     activation_peak_bytes=sum(log["activation_peak_bytes"].values()))
        if "pipedream" in log:
            pd = log["pipedream"]
            st = pd["staleness"]
            entry.update(staleness_mean=sum(st) / len(st) if st else 0.0,
                         staleness_max=max(st) if st else 0, updates=pd["updates"],
                         update_rate_per_s=pd["update_rate"], first_update_s=pd["first_update_s"],
                         stash_peak_bytes=pd["stash_peak_bytes"])
        per_stage.append(entry)
    test_loss, test_acc = logs[0]["final"]
    # a step's time: the slowest rank of replica 0 in each step, median after a warm-up step
    per_step = [max(ts) for ts in zip(*(log["step_s"] for log in pipe))]
    step_s = statistics.median(per_step[1:] or per_step) if per_step else None
    if schedule == "pipedream":
        step_s = max(log["wall_s"] for log in pipe) / cfg.steps  # no flush: wall / minibatches
    return {"mode": "pipeline", "seed": cfg.seed, "schedule": schedule, "microbatches": m, "compressor": compressor,
            "label": COMPRESSORS[compressor].label, "stages": p, "replicas": cfg.replicas,
            "steps": cfg.steps,
            "bytes_per_step": sent / cfg.steps, "raw_bytes_per_step": raw / cfg.steps,
            "bytes_per_boundary": phases,
            "dp_bytes_per_step": sum(log["dp_meter"].get("bytes_sent", 0) for log in pipe) / cfg.steps,
            "test_accuracy": test_acc, "test_loss": test_loss,
            "bubble": an["bubble"], "bubble_theory": theory_bubble(schedule, p, m),
            "idle_fraction": an["idle_fraction"], "per_stage": per_stage,
            "losses": logs[p - 1]["losses"],
            "wall_s": max(log["wall_s"] for log in logs),
            "step_s": step_s, "model_step_s": _model_step(schedule, p, m, per_stage, sent / cfg.steps, link),
            "marks": logs[0]["marks"], "clock_at_marks": logs[0]["clock"],
            "accuracy_at_marks": [a for _, a in logs[0]["evals"]] if logs[0]["marks"] else [],
            "link": link or _LOOPBACK,
            "reduction_x": 1.0, "accuracy_gap_pp": 0.0}


_LOOPBACK = {"name": "none", "configured_bps": None, "achieved_bps": None, "emulation": "loopback"}


def _model_step(schedule: str, p: int, m: int, per_stage: list[dict], bytes_per_step: float,
                link: dict | None) -> float | None:
    """The step-time model's step (:func:`gradcomp.lab.plan.model.pipeline_step`) from
    this run's measured compute (forward, backward, weight and codec seconds of all
    stages) and its boundary bytes at the link's achieved rate; None on the
    loopback (no rate) and for schedules the model has no form for."""
    if schedule not in ("gpipe", "1f1b") or not link or not link.get("achieved_bps") or p < 2:
        return None
    from gradcomp.lab.plan.model import pipeline_step

    compute = sum(st[k] for st in per_stage for k in ("forward", "backward", "weight", "codec"))
    boundary_s = 8.0 * bytes_per_step / ((p - 1) * m) / link["achieved_bps"]
    return pipeline_step(compute, p, m, schedule, boundary_s)["step_s"]


def _compare(rows: list[dict]) -> None:
    def key(r):
        return r["scenario"]["name"], r["schedule"], r["microbatches"], r["seed"]

    base = {key(r): r for r in rows if r["compressor"] == "none"}
    for r in rows:
        b = base.get(key(r))
        if b is not None and r["bytes_per_step"]:
            r["reduction_x"] = b["bytes_per_step"] / r["bytes_per_step"]
            r["accuracy_gap_pp"] = 100.0 * (b["test_accuracy"] - r["test_accuracy"])


def _fill_targets(rows: list[dict], target_acc: float | None) -> float:
    """Set every run's time and steps to the target accuracy; returns the target:
    ``target_acc``, or the study's :data:`~gradcomp.lab.study.study.TARGET_FRACTION` x
    the mean final accuracy of the first (scenario, schedule, M)'s ``none`` runs."""
    from gradcomp.lab.study.study import TARGET_FRACTION
    from gradcomp.lab.study.timing import time_to_target

    if target_acc is None:
        first = rows[0]
        accs = [r["test_accuracy"] for r in rows if r["compressor"] == "none"
                and (r["scenario"]["name"], r["schedule"], r["microbatches"])
                == (first["scenario"]["name"], first["schedule"], first["microbatches"])]
        target_acc = TARGET_FRACTION * sum(accs) / len(accs)
    for r in rows:
        hit = time_to_target(r["clock_at_marks"], r["marks"], r["accuracy_at_marks"], target_acc)
        r["target_accuracy"] = target_acc
        r["time_to_target_s"], r["steps_to_target"] = hit if hit is not None else (None, None)
    return target_acc


def run_pipeline_study(cfg: PipelineConfig, seeds: int = 1, scenarios=None,
                       target_acc: float | None = None) -> dict:
    """Run every (schedule, M, compressor) of ``cfg`` with ``seeds`` seeds
    (``cfg.seed``, ``cfg.seed + 1``, ...: model, data split and order) in each
    scenario; returns the results (JSON-ready; each run carries its ``seed``,
    ``scenario`` and ``link``).

    Args:
        scenarios: :class:`~gradcomp.lab.study.scenarios.Scenario` s (default: the
            loopback). A scenario with a link runs the ranks in a
            :class:`~gradcomp.lab.cluster.LocalCluster` (one per scenario, every
            seed in it; rank r = its host r); its straggler is pipeline rank
            ``straggler[0]``, its compute jitter every stage's.
        target_acc: accuracy in (0, 1] for the time to target (default: see :func:`_fill_targets`).

    Raises:
        ValueError: settings that cannot run (see :meth:`PipelineConfig.validate`),
            a shaped link under torchrun.
        gradcomp.lab.cluster.ClusterError: the link cannot be emulated here.
        gradcomp.launch.WorkerError / TimeoutError: a rank failed or hung.
    """
    import contextlib

    from gradcomp.pipeline.split import layer_blocks
    from gradcomp.lab.study.scenarios import Scenario
    from gradcomp.lab.study.study import TARGET_FRACTION, in_torchrun

    scenarios = list(scenarios) if scenarios else [Scenario()]
    data = load_digits_split(0.25, cfg.seed)
    layers = len(layer_blocks(make_model(cfg.seed, cfg.hidden, data.num_features, data.num_classes)))
    per_scenario = [replace(cfg, straggler=sc.straggler, compute_jitter=sc.compute_jitter)
                    for sc in scenarios]
    for c in per_scenario:
        c.validate(layers, len(data.y_train))
    t0 = time.perf_counter()
    distributed, own_group = in_torchrun(), False
    if distributed and any(sc.link for sc in scenarios):
        raise ValueError("a shaped --link or --scenarios link starts its own ranks in network "
                         "namespaces: run it without torchrun")
    if distributed:
        from gradcomp.launch import init_from_env

        own_group = not dist.is_initialized()
        init_from_env(timeout=cfg.timeout)
    rows, links = [], []
    try:
        for sc, scfg in zip(scenarios, per_scenario):
            with contextlib.ExitStack() as stack:
                cluster = None
                if sc.link is not None:
                    from gradcomp.lab.cluster import LocalCluster

                    cluster = stack.enter_context(LocalCluster(cfg.workers, rate=sc.link,
                                                               rate_jitter=sc.link_jitter, seed=cfg.seed))
                link = cluster.describe() if cluster is not None else dict(_LOOPBACK)
                links.append({"scenario": sc.as_dict(), "link": link})
                for seed in range(cfg.seed, cfg.seed + seeds):
                    for r in _one_seed(replace(scfg, seed=seed), distributed, cluster, link):
                        r["scenario"] = sc.as_dict()
                        rows.append(r)
    finally:
        if own_group:
            dist.destroy_process_group()
    _compare(rows)
    target = _fill_targets(rows, target_acc)
    return {"config": asdict(cfg), "seeds": seeds, "layers": layers, "runs": rows,
            "scenarios": links, "target_accuracy": target,
            "target_fraction": None if target_acc is not None else TARGET_FRACTION,
            "wall_s": time.perf_counter() - t0}


def _one_seed(cfg: PipelineConfig, distributed: bool, cluster=None, link: dict | None = None) -> list[dict]:
    """Every run of ``cfg`` (one seed): on local processes (in ``cluster``'s
    namespaces when given), or as this rank of a torchrun job."""
    from gradcomp.launch import launch

    data = load_digits_split(0.25, cfg.seed)
    timeout = cfg.timeout * len(cfg.runs())
    env = {"GRADCOMP_WORKER_THREADS": "1"}
    if distributed:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != cfg.workers:
            raise ValueError(f"--workers {cfg.workers} does not fit this torchrun job of {world} ranks")
        mine = pipeline_rank(rank, world, cfg, data)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
    elif cluster is not None:
        everyone = cluster.run(pipeline_rank, cfg, data, timeout=timeout, env=env)
    else:
        everyone = launch(pipeline_rank, cfg.workers, (cfg, data), timeout=timeout, env=env)
    return [_summarize(cfg, run, [everyone[r][i] for r in range(cfg.workers)], link)
            for i, run in enumerate(cfg.runs())]


def _int_list(option: str, text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"{option} expects comma-separated integers, got {text!r}") from None
    if not vals:
        raise ValueError(f"{option} expects at least one integer, got {text!r}")
    return vals


def config_from_args(args: argparse.Namespace) -> PipelineConfig:
    """The :class:`PipelineConfig` of parsed ``gradcomp train`` arguments.

    Raises:
        ValueError: a malformed list or value (the message names the option).
    """
    from gradcomp.lab.study.config import DEFAULT_COMPRESSORS

    schedules = tuple(dict.fromkeys(s.strip() for s in args.schedule.split(",") if s.strip()))
    bad = [s for s in schedules if s not in PIPELINE_SCHEDULES]
    if bad or not schedules:
        raise ValueError(f"--schedule must be among {','.join(PIPELINE_SCHEDULES)}, got {args.schedule!r}")
    hidden = hidden_widths(args.hidden)
    micro = tuple(dict.fromkeys(_int_list("--microbatches", args.microbatches)))
    if args.stages < 1:
        raise ValueError(f"--stages must be >= 1, got {args.stages}")
    compressors = (DEFAULT_PIPELINE_COMPRESSORS if args.compressors is DEFAULT_COMPRESSORS
                   else tuple(args.compressors))
    workers = args.workers
    if workers is None:  # one replica, or what a torchrun job holds
        workers = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ \
            else args.stages
    d = TrainConfig()  # the study's model and data: its default steps, batch and lr
    return PipelineConfig(stages=args.stages, workers=workers, microbatches=micro,
                          schedules=schedules, compressors=compressors,
                          steps=args.steps or d.steps, batch_size=args.batch_size or d.batch_size,
                          lr=args.lr or d.lr, momentum=args.momentum,
                          seed=args.seed, hidden=hidden, vertical_sync=args.vertical_sync,
                          timeout=args.timeout, eval_every=args.eval_every)


def run_pipeline(args: argparse.Namespace) -> int:
    """``gradcomp train --mode pipeline``: run, print, write ``pipeline.json`` and
    ``pipeline-bubble.png`` to ``--out`` (default: a new timestamped directory, as
    the study's); returns the exit status (2: bad settings)."""
    from gradcomp.launch import WorkerError
    from gradcomp.lab.study import pipeline_report

    def fail(msg: str, status: int) -> int:
        print(f"gradcomp train: error: {msg}", file=sys.stderr)
        return status

    lead = os.environ.get("RANK", "0") == "0"
    try:
        cfg = config_from_args(args)
        scenarios = scenario_list(args, cfg.workers)
        if lead:
            if (args.out is not None and not getattr(args, "overwrite", False)
                    and os.path.exists(os.path.join(args.out, "pipeline.json"))):
                raise ValueError(f"--out {args.out} already holds results (pipeline.json); pass "
                                 "--overwrite to replace them, or choose another directory")
            args.out = prepare_out(args.out, getattr(args, "overwrite", False))
        result = run_pipeline_study(cfg, args.seeds, scenarios, args.target_acc)
    except ValueError as e:
        return fail(str(e), 2)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except WorkerError as e:
        print(e.traceback, file=sys.stderr)
        return fail(f"rank {e.rank} failed (its traceback is above)", 1)
    except (TimeoutError, RuntimeError, ImportError) as e:
        return fail(f"{type(e).__name__}: {e}", 1)
    if not lead:
        return 0
    pipeline_report.print_report(result)
    try:
        paths = pipeline_report.write_all(result, args.out)
    except OSError as e:
        return fail(f"cannot write the results to --out {args.out}: {e}", 1)
    print("wrote " + ", ".join(paths))
    return 0
