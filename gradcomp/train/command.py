"""``gradcomp train``: the traffic / accuracy study on the command line.

With no arguments it runs the default study: scikit-learn's digits, an MLP
64-384-256-10, 4 local worker processes, sync (DDP + gradcomp hook) and async
(parameter server) training with every compressor of
:data:`~gradcomp.train.config.DEFAULT_COMPRESSORS`, then prints a table and
writes ``results.json``, ``results.csv`` and ``results.png`` to ``--out``.
Under ``torchrun`` each process is one rank of the job (see :mod:`gradcomp.train`).

Exit status: 0 done; 2 a wrong option or settings that cannot work together;
1 a failed rank (its traceback is printed), a timeout or a missing dependency.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import threading
import time

from gradcomp.train.config import (ALGORITHMS, COMPRESSORS, DEFAULT_COMPRESSORS, MODES,
                                   TrainConfig, parse_compressors)

__all__ = ["add_arguments", "build_parser", "run", "main"]

DEFAULT_OUT = "./gradcomp-results"


def _positive_int(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if val < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {val}")
    return val


def _positive_float(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not val > 0 or val == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return val


def _nonnegative_float(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if val == 0:
        return 0.0  # "0", "0.0", "-0"
    return _positive_float(text)


def _seed(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32 - 1], got {text!r}") from None
    if not 0 <= val < 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32 - 1], got {val}")
    return val


def _compressor_list(text: str) -> tuple[str, ...]:
    try:
        return parse_compressors(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the study's options to ``p``."""
    d = TrainConfig()
    p.add_argument("--workers", type=_positive_int, default=None,
                   help=f"data-parallel workers (default {d.workers}; async adds a server process; "
                        "under torchrun: WORLD_SIZE for sync, WORLD_SIZE - 1 for async)")
    p.add_argument("--mode", choices=(*MODES, "both"), default="both",
                   help="sync (DDP + compressed allreduce hook), async (parameter server) "
                        "or both (default)")
    p.add_argument("--compressors", type=_compressor_list, default=DEFAULT_COMPRESSORS,
                   metavar="LIST",
                   help="comma-separated names among none,fp16,bf16,int8,int8-ef,topk-ef,"
                        "topk-int8-ef,threshold-ef,auto (default: "
                        f"{','.join(DEFAULT_COMPRESSORS)}); none always runs as the baseline; "
                        "auto (adaptive compression) runs in sync mode only")
    p.add_argument("--steps", type=_positive_int, default=d.steps,
                   help=f"optimizer steps per run (default {d.steps})")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size,
                   help=f"samples per worker per step (default {d.batch_size})")
    p.add_argument("--lr", type=_positive_float, default=d.lr,
                   help=f"SGD learning rate (default {d.lr})")
    p.add_argument("--momentum", type=float, default=d.momentum,
                   help=f"SGD momentum in [0, 1) (default {d.momentum})")
    p.add_argument("--seed", type=_seed, default=d.seed,
                   help="seed of the model, the data split and the data order (default 0)")
    p.add_argument("--algorithm", choices=ALGORITHMS, default=d.algorithm,
                   help="sync allreduce for dense codecs (default ring); sparse codecs use allgather")
    p.add_argument("--threshold", type=_nonnegative_float, default=None,
                   help="threshold of threshold-ef (default: calibrated to the top 1%% of the "
                        "first gradient's magnitudes)")
    p.add_argument("--eval-every", type=_positive_int, default=d.eval_every,
                   help=f"steps between test evaluations for the curves (default {d.eval_every})")
    p.add_argument("--timeout", type=_positive_float, default=d.timeout,
                   help=f"seconds allowed per run before its processes are stopped "
                        f"(default {d.timeout:g})")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"directory for results.json, results.csv, results.png (default {DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


DESCRIPTION = ("Train on scikit-learn's digits with every compressor, sync and async, and report "
               "wire bytes, traffic reduction and accuracy against the uncompressed baseline. "
               "With no options: the default study.")
EPILOG = ("Under torchrun (RANK and WORLD_SIZE set) each process runs as one rank of the job, "
          "one mode per job: sync with WORLD_SIZE workers, async with 1 server + WORLD_SIZE - 1 "
          "workers.")


def build_parser(prog: str = "gradcomp train") -> argparse.ArgumentParser:
    """The parser of ``gradcomp train`` / ``python -m gradcomp.train``."""
    return add_arguments(argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG))


def _workers(args: argparse.Namespace) -> int:
    """``--workers``, checked against (or, if absent, taken from) torchrun's world size.

    Raises:
        ValueError: ``--mode both`` under torchrun, or a worker count the job cannot hold.
    """
    from gradcomp.train.study import in_torchrun

    if not in_torchrun():
        return args.workers if args.workers is not None else TrainConfig().workers
    world = int(os.environ["WORLD_SIZE"])
    if args.mode == "both":
        raise ValueError("under torchrun run one mode per job: --mode sync (WORLD_SIZE workers) or "
                         "--mode async (1 server + WORLD_SIZE - 1 workers)")
    expected = world if args.mode == "sync" else world - 1
    if expected < 1:
        raise ValueError(f"async mode needs at least 2 ranks (1 server + workers), the job has {world}")
    if args.workers is not None and args.workers != expected:
        raise ValueError(f"--workers {args.workers} does not fit this torchrun job of {world} ranks: "
                         f"{args.mode} mode with {world} ranks has {expected} workers")
    return expected


def _config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(workers=_workers(args), steps=args.steps, batch_size=args.batch_size,
                       lr=args.lr, momentum=args.momentum, seed=args.seed,
                       algorithm=args.algorithm, eval_every=args.eval_every,
                       threshold=args.threshold, timeout=args.timeout)


class _Bars:
    """One rich progress bar per run."""

    def __init__(self, console, total: int):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)

        self.progress = Progress(TextColumn("{task.description:<22}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("steps"), TimeElapsedColumn(),
                                 console=console)
        self.total = total
        self.tasks: dict[tuple[str, str], int] = {}

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def __call__(self, mode: str, compressor: str, step: int) -> None:
        key = (mode, compressor)
        if key not in self.tasks:
            label = f"{mode} {COMPRESSORS[compressor].label}"
            self.tasks[key] = self.progress.add_task(label, total=self.total)
        self.progress.update(self.tasks[key], completed=step)


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
    from rich.console import Console
    from rich.markup import escape

    from gradcomp.launch import WorkerError
    from gradcomp.train import report
    from gradcomp.train.study import in_torchrun, run_study

    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def fail(message: str, status: int) -> int:
        err.print("[bold red]gradcomp train: error:[/]", escape(message))
        return status

    try:
        cfg = _config(args)
    except ValueError as e:
        return fail(str(e), 2)
    modes = MODES if args.mode == "both" else (args.mode,)
    lead = not in_torchrun() or os.environ.get("RANK") == "0"
    if lead and os.path.exists(args.out) and not os.path.isdir(args.out):
        return fail(f"--out {args.out} exists and is not a directory", 2)
    console = Console(quiet=not lead)
    if not console.is_terminal:
        console = Console(quiet=not lead, width=max(console.width, 100))
    t0 = time.perf_counter()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.no_progress or not lead:
            study = run_study(cfg, modes, args.compressors)
        else:
            with _Bars(console, cfg.steps) as bars:
                study = run_study(cfg, modes, args.compressors, on_progress=bars)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except WorkerError as e:
        print(e.traceback, file=sys.stderr)
        return fail(f"rank {e.rank} failed (its traceback is above); the study stopped", 1)
    except ValueError as e:  # settings that cannot work together (workers only raise WorkerError)
        return fail(str(e), 2)
    except (TimeoutError, ImportError, RuntimeError) as e:
        return fail(f"{type(e).__name__}: {e}", 1)
    if lead:
        try:
            paths = report.write_all(study, args.out)
        except OSError as e:
            return fail(f"cannot write the results to --out {args.out}: {e}", 1)
        console.print(report.title(study), highlight=False)
        console.print(report.table(study))
        if "threshold-ef" in {r.compressor for r in study.runs}:
            console.print(f"threshold+ef: threshold {study.threshold:.3g}", highlight=False)
        console.print(f"total wall time {time.perf_counter() - t0:.1f} s", highlight=False)
        console.print("wrote " + ", ".join(paths.values()), highlight=False)
    return 0


def main(argv: list[str] | None = None, prog: str = "gradcomp train") -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run; returns the exit status."""
    return run(build_parser(prog).parse_args(argv))
