"""The ``gradcomp`` command.

::

    gradcomp train [options]                 # traffic / accuracy study (see gradcomp train --help)
    gradcomp bench kernels [args...]         # kernel microbenchmarks (gradcomp.lab.bench.kernels)
    gradcomp bench allreduce [args...]       # collective benchmarks (gradcomp.lab.bench.allreduce)
    gradcomp plan [recommend|calibrate|validate] [args...]   # step-time model (gradcomp.lab.plan.cli)
    gradcomp --version

Subcommands import their modules only when they run, so ``gradcomp --help``
stays fast. ``bench`` passes every argument after its target to the
benchmark's own ``main(argv)``, ``plan`` every argument after it to
``gradcomp.lab.plan.cli.main(argv)``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from gradcomp.lab.args import OneLineParser

__all__ = ["build_parser", "main"]

BENCH_TARGETS = ("kernels", "allreduce")


def build_parser(prog: str = "gradcomp") -> argparse.ArgumentParser:
    """The ``gradcomp`` parser: ``--version`` and the ``train`` / ``bench`` / ``plan`` subcommands.

    ``train`` and ``plan`` take every argument after them to their own parser
    (imported only then: building this parser imports neither torch nor the study).
    """
    from gradcomp._version import __version__

    p = OneLineParser(
        prog=prog,
        description="Gradient compression for distributed PyTorch training: measure what "
                    "compression saves on the wire and what it costs in accuracy and time.")
    p.add_argument("--version", action="version", version=f"gradcomp {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{train,bench,plan}")
    sub.required = True
    train = sub.add_parser(
        "train", add_help=False,
        help="train on real data with each compressor and report traffic and accuracy",
        description="gradcomp train --help lists its options")
    train.add_argument("args", nargs=argparse.REMAINDER, help="arguments for gradcomp train")
    bench = sub.add_parser(
        "bench", help="microbenchmarks: kernels or allreduce",
        description="Run a benchmark; the arguments after the target go to it "
                    "(e.g. gradcomp bench kernels --size 1048576 --out bench-results).")
    bench.add_argument("target", choices=BENCH_TARGETS, help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER,
                       help="arguments for the benchmark (see gradcomp bench TARGET --help)")
    plan = sub.add_parser(
        "plan", add_help=False,
        help="step-time model: project to many nodes, recommend, calibrate, validate",
        description="gradcomp plan --help lists its options")
    plan.add_argument("args", nargs=argparse.REMAINDER, help="arguments for gradcomp plan")
    return p


def _bench(target: str, argv: list[str]) -> int:
    """Import ``gradcomp.lab.bench.<target>`` now and return its ``main(argv)``'s status."""
    module = f"gradcomp.lab.bench.{target}"
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            print(f"gradcomp bench: {module} is not available in this installation", file=sys.stderr)
            return 1
        raise
    rc = mod.main(argv)
    return int(rc or 0)


def _train(argv: list[str], prog: str) -> int:
    from gradcomp.lab.study.command import main as train_main

    return train_main(argv, prog=f"{prog} train")


def _plan(argv: list[str]) -> int:
    from gradcomp.lab.plan.cli import main as plan_main

    return plan_main(argv)


def main(argv: list[str] | None = None, prog: str = "gradcomp") -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # everything after train / plan, options first included, is the study's / the planner's
    if argv[:1] == ["train"]:
        return _train(argv[1:], prog)
    if argv[:1] == ["plan"]:
        return _plan(argv[1:])
    args = build_parser(prog).parse_args(argv)
    if args.command == "train":
        return _train(args.args, prog)
    if args.command == "plan":
        return _plan(args.args)
    return _bench(args.target, args.args)


if __name__ == "__main__":
    sys.exit(main())
