"""A parameter-server run on a least-squares problem (``python -m gradcomp.ps``).

Under torchrun (one process per rank; ranks ``[0, --num-servers)`` serve)::

    torchrun --nproc_per_node=3 -m gradcomp.ps --mode async --compressor int8 --compress-pull

Without torchrun's environment it starts ``--world-size`` local processes
with :func:`gradcomp.launch.launch`. The problem: ``min_x ||A x - b||^2 / 2m``
with ``b = A x*`` (so the optimum ``x*`` is known), the rows of ``A`` split
over the workers. The first server prints its stats and the distance of its
shard to ``x*`` as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import torch

from gradcomp import catalog
from gradcomp.lab.args import OneLineParser
from gradcomp.lab.cluster import jitter_type, link_type
from gradcomp.ps.run import PSConfig, run

__all__ = ["PS_COMPRESSORS", "demo_compressor", "LeastSquares", "default_lr", "summary", "main"]

#: ``--compressor`` choices, names of :mod:`gradcomp.catalog`; the workers keep a residual for
#: a lossy one (``PSConfig.error_feedback``)
PS_COMPRESSORS = ("none", "fp16", "int8", "topk-int8")


def demo_compressor(name: str):
    """The compressor of ``--compressor name``: ``gradcomp.catalog.build(name)``, or None for
    ``none`` (the parameter server's default: uncompressed pushes, int8 pull deltas with
    ``--compress-pull``).

    Raises:
        ValueError: a name not in :data:`PS_COMPRESSORS`.
    """
    if name not in PS_COMPRESSORS:
        raise ValueError(f"compressor must be one of {', '.join(PS_COMPRESSORS)}, got {name!r}")
    return None if name == "none" else catalog.build(name)


class LeastSquares:
    """``A`` (rows x dim, per worker), ``x*`` and ``b = A x*``, generated from ``seed``.

    The model's parameter ``x`` is split into ``parts`` parameters ``x0, x1, ...``
    so that several servers can share it.
    """

    def __init__(self, dim: int, rows: int, workers: int, seed: int = 0, parts: int = 4):
        g = torch.Generator().manual_seed(seed)
        self.x_star = torch.randn(dim, generator=g)
        self.a = [torch.randn(rows, dim, generator=g) for _ in range(workers)]
        self.sizes = [len(c) for c in torch.arange(dim).tensor_split(parts)]

    def model(self) -> torch.nn.Module:
        m = torch.nn.Module()
        for i, n in enumerate(self.sizes):
            m.register_parameter(f"x{i}", torch.nn.Parameter(torch.zeros(n)))
        return m

    def x(self, model) -> torch.Tensor:
        return torch.cat([getattr(model, f"x{i}") for i in range(len(self.sizes))])

    def loss(self, model, step: int, worker: int) -> torch.Tensor:
        a = self.a[worker]
        r = a @ self.x(model) - a @ self.x_star
        return 0.5 * (r * r).mean()

    def distance(self, shard: dict[str, torch.Tensor]) -> float:
        """Euclidean distance of a server's shard to the matching part of ``x*``."""
        parts = self.x_star.split(self.sizes)
        return float(sum(((t - parts[int(n[1:])]) ** 2).sum() for n, t in shard.items()) ** 0.5)


def _rank_main(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    problem = LeastSquares(args.dim, args.rows, world_size - args.num_servers, args.seed)
    config = PSConfig(
        mode=args.mode, steps=args.steps, num_servers=args.num_servers,
        compressor=demo_compressor(args.compressor), compress_pull=args.compress_pull,
        optimizer=functools.partial(torch.optim.SGD, lr=args.lr, momentum=args.momentum),
        max_staleness=args.max_staleness, staleness_lr=args.staleness_lr,
        worker_timeout=args.worker_timeout, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume, encrypt=args.encrypt)
    out = run(rank, world_size, problem.model, problem.loss, config)
    if out["role"] == "server":
        return {**out["stats"], "shard_distance_to_optimum": problem.distance(out["params"])}
    return {"rank": rank, "final_loss": out["losses"][-1] if out["losses"] else None}


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            val = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if val < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {val}")
        return val
    return parse


def _positive(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        val = float("nan")
    if not 0 < val < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return val


def default_lr(dim: int, rows: int) -> float:
    """Half of ``1 / L``, ``L`` the largest curvature of the least-squares loss:
    for Gaussian ``A`` (rows x dim) the top eigenvalue of ``A^T A / rows``
    is about ``(1 + sqrt(dim / rows))^2`` (Marchenko-Pastur). A fixed 0.1
    diverges (to inf) once dim / rows > about 18."""
    return 0.5 / (1.0 + (dim / rows) ** 0.5) ** 2


def summary(out: dict, args: argparse.Namespace, link: dict) -> str:
    """A few lines: what ran, where, what it sent and how close it got."""
    traffic = out["traffic"]
    pushed = sum(w["push_bytes"] for w in out["workers"].values())
    raw = sum(w["push_raw_bytes"] for w in out["workers"].values())
    where = "loopback" if not link.get("configured_bps") else (
        f"link {link['name']} (achieved {link['achieved_bps'] / 1e6:.1f} Mbit/s)")
    lines = [f"{args.mode} parameter server, {args.num_servers} server(s), "
             f"{args.world_size - args.num_servers} workers, {args.steps} steps, {where}"
             + (", encrypted (CURVE)" if out.get("security") == "curve" else ""),
             f"updates applied {out['updates']}, accepted {out['accepted']}, dropped {out['dropped']} "
             f"(staler than --max-staleness), rejected {out['rejected']}; mean staleness "
             + (f"{sum(k * v for k, v in out['staleness_histogram'].items()) / max(1, out['accepted']):.2f}"
                if out["staleness_histogram"] else "-"),
             f"server received {traffic['bytes_received']:,} bytes, pushed gradients "
             f"{pushed:,} bytes ({raw / pushed if pushed else 1:.2f}x smaller than float32)",
             f"distance of server 0's shard to the optimum: {out['shard_distance_to_optimum']:.4g}"]
    if out.get("resumed_from") is not None:
        lines.insert(1, f"resumed from version {out['resumed_from']}")
    part = args.dim // 4
    if args.compressor != "none" and part < 4096:
        lines.append(f"(each tensor holds {part} elements: payload headers weigh on the ratio; "
                     "--dim 65536 gives ratios near the codec's)")
    return "\n".join(lines)


def _resume(text: str) -> str:
    if text != "if-exists":
        raise argparse.ArgumentTypeError(f"expected nothing or 'if-exists', got {text!r}")
    return text


def _check_readable(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every server checkpoint ``--resume`` will load, read and validated here first: a damaged
    or foreign file, or one of another number of servers, is one line (``p.error``) before any
    process starts, not a server rank's traceback."""
    from gradcomp.ps.checkpoint import checkpoint_path, load
    from gradcomp.ps.errors import CheckpointError

    for i in range(args.num_servers):
        path = checkpoint_path(args.checkpoint_dir, i)
        if not os.path.exists(path):
            continue  # --resume if-exists: that server starts afresh
        try:
            state = load(path)
        except CheckpointError as e:
            p.error(f"--resume: {e}")
        if state["num_servers"] != args.num_servers:
            p.error(f"--resume: checkpoint {path} was written by {state['num_servers']} server(s); "
                    f"resume with --num-servers {state['num_servers']}")


def _check_checkpoints(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checkpoint options before anything starts: a directory that can be written, and with
    ``--resume`` every server's checkpoint in it (``p.error``: one line, exit status 2)."""
    from gradcomp._validate import writable_dir
    from gradcomp.ps.checkpoint import checkpoint_path

    if args.checkpoint_dir is None:
        if args.resume or args.checkpoint_every:
            p.error(f"--{'resume' if args.resume else 'checkpoint-every'} needs --checkpoint-dir")
        return
    missing = [os.path.basename(checkpoint_path(args.checkpoint_dir, i)) for i in range(args.num_servers)
               if not os.path.exists(checkpoint_path(args.checkpoint_dir, i))]
    if args.resume is True and missing:
        p.error(f"--resume: no checkpoint to resume from in {args.checkpoint_dir} (missing {', '.join(missing)}); "
                "--resume if-exists starts afresh when there is none")
    if args.resume:
        _check_readable(p, args)
    try:
        writable_dir("--checkpoint-dir", args.checkpoint_dir)
    except ValueError as e:
        p.error(str(e))


def main(argv=None) -> int:
    p = OneLineParser(
        prog="python -m gradcomp.ps",
        description="A parameter-server run on a least-squares problem with a known optimum.")
    p.add_argument("--mode", choices=("sync", "async"), default="async")
    p.add_argument("--num-servers", type=_int_at_least(1), default=1)
    p.add_argument("--world-size", type=_int_at_least(2), default=3,
                   help="local processes when not started by torchrun (default 3: 1 server, 2 workers)")
    p.add_argument("--compressor", choices=PS_COMPRESSORS, default="int8")
    p.add_argument("--compress-pull", action="store_true")
    p.add_argument("--steps", type=_int_at_least(1), default=200)
    p.add_argument("--dim", type=_int_at_least(4), default=64)
    p.add_argument("--rows", type=_int_at_least(1), default=256)
    p.add_argument("--lr", type=_positive, default=None,
                   help="SGD learning rate (default 0.5 / L for this problem's curvature L)")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--max-staleness", type=_int_at_least(0), default=None)
    p.add_argument("--staleness-lr", action="store_true")
    p.add_argument("--worker-timeout", type=_positive, default=60.0)
    p.add_argument("--checkpoint-dir", default=None, help="directory of the servers' checkpoints")
    p.add_argument("--checkpoint-every", type=_int_at_least(0), default=0)
    p.add_argument("--resume", nargs="?", const=True, default=False, type=_resume, metavar="if-exists",
                   help="continue from the checkpoints in --checkpoint-dir (none there is an error); "
                        "--resume if-exists starts afresh when there is none")
    p.add_argument("--encrypt", action="store_true",
                   help="CURVE on every connection: authenticated and encrypted (default: PLAIN, "
                        "authenticated, not encrypted)")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--link", type=link_type, default="none",
                   help="none (loopback) or a rate such as 100mbit: every rank in its own network "
                        "namespace of an emulated cluster (needs root and iproute2)")
    p.add_argument("--link-jitter", type=jitter_type, default=0.0)
    p.add_argument("--json", action="store_true", help="print the server's full stats as JSON")
    args = p.parse_args(argv)
    if not 0 <= args.momentum < 1:
        p.error(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.lr is None:
        args.lr = default_lr(args.dim, args.rows)
    _check_checkpoints(p, args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from gradcomp.launch import init_from_env

        rank, world_size = init_from_env()
        args.world_size = world_size
        if world_size <= args.num_servers:
            p.error(f"the job has {world_size} ranks: --num-servers {args.num_servers} leaves no worker")
        out = _rank_main(rank, world_size, args)
        link = {"name": "torchrun job"}
    else:
        if args.world_size <= args.num_servers:
            p.error(f"--world-size {args.world_size} with --num-servers {args.num_servers} leaves no worker")
        from gradcomp.lab.cluster import launch_on, requirements_missing

        if args.link != "none" and requirements_missing() is not None:
            p.error(f"--link {args.link} needs the emulated cluster: {requirements_missing()}")
        results, link = launch_on(args.link, _rank_main, args.world_size, (args,), timeout=600,
                                  rate_jitter=args.link_jitter, seed=args.seed)
        rank, out = 0, results[0]
    if rank == 0:
        if args.json:
            print(json.dumps({**out, "link": link}, default=str, indent=1))
        else:
            print(summary(out, args, link))
        if not math.isfinite(out["shard_distance_to_optimum"]):
            print("the run diverged (non-finite parameters): lower --lr", file=sys.stderr)
            return 1
    return 0
