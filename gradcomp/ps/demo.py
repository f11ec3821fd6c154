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
import os

import torch

from gradcomp.compressors import FP16, Int8Quantizer, TopK
from gradcomp.ps.run import PSConfig, run

COMPRESSORS = {
    "none": lambda: None,
    "fp16": FP16,
    "int8": Int8Quantizer,
    "topk": lambda: TopK(ratio=0.01, values=Int8Quantizer()),
}


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
        compressor=COMPRESSORS[args.compressor](), compress_pull=args.compress_pull,
        optimizer=functools.partial(torch.optim.SGD, lr=args.lr, momentum=args.momentum),
        max_staleness=args.max_staleness, staleness_lr=args.staleness_lr,
        worker_timeout=args.worker_timeout, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume)
    out = run(rank, world_size, problem.model, problem.loss, config)
    if out["role"] == "server":
        return {**out["stats"], "shard_distance_to_optimum": problem.distance(out["params"])}
    return {"rank": rank, "final_loss": out["losses"][-1] if out["losses"] else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gradcomp.ps",
        description="A parameter-server run on a least-squares problem with a known optimum.")
    p.add_argument("--mode", choices=("sync", "async"), default="async")
    p.add_argument("--num-servers", type=int, default=1)
    p.add_argument("--world-size", type=int, default=3,
                   help="local processes when not started by torchrun (default 3)")
    p.add_argument("--compressor", choices=tuple(COMPRESSORS), default="int8")
    p.add_argument("--compress-pull", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--staleness-lr", action="store_true")
    p.add_argument("--worker-timeout", type=float, default=60.0)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from gradcomp.launch import init_from_env

        rank, world_size = init_from_env()
        out = _rank_main(rank, world_size, args)
        if rank == 0:
            print(json.dumps(out, default=str, indent=1))
        return 0
    from gradcomp.launch import launch

    results = launch(_rank_main, args.world_size, args=(args,), timeout=600)
    print(json.dumps(results[0], default=str, indent=1))
    return 0

