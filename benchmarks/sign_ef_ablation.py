"""Why sign + EF loses on text-gpt: the study's sync run simulated in one process, with codec variants.

Replays ``gradcomp train --mode sync --workload text-gpt`` at world W in one process: the study's
model, initialisation, data order and DDP bucket layout (read from a one-rank DDP), each worker's
error feedback (``p = g + e``, ``e <- p - D(C(p))``, Karimireddy et al. 2019), one of three
aggregations and the study's SGD. ``--agg ring`` is gradcomp's ring as the DDP hook runs it (per
chunk: the first hop compressed with the sender's residual, the later hops' partial sums and the
owner's average compressed without one; a rank's residual over a chunk it adds exactly is
delivered and reset); ``two_phase`` compresses every rank's chunks with error feedback and the
owner's average without (``--server-ef``: with the owner's residual); ``exact`` averages the
workers' decoded payloads exactly; ``none`` is float32. The codecs are gradcomp's
(:class:`gradcomp.SignQuantizer`, :class:`gradcomp.IntQuantizer`), except ``--scale tensor``,
one scale per tensor, the mean absolute value of the tensor (the paper's ``||p||_1 / d``).
Findings: docs/results/codecs.md#why-sign-ef-loses-on-text-gpt. Run from the repository root::

    python benchmarks/sign_ef_ablation.py --data-file /usr/share/vim/vim90/doc/version9.txt --agg ring

It prints one JSON line: the settings, the test loss (nats) and next-character accuracy (%).
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradcomp as gc
from gradcomp.comm.chunks import chunk_bounds
from gradcomp.lab.study.config import TrainConfig
from gradcomp.lab.study.data import worker_batches
from gradcomp.lab.study.model import evaluate
from gradcomp.lab.study.workloads import batch_loss, build_model, load_split


def bucket_layout(cfg: TrainConfig, data) -> list[list[str]]:
    """Parameter names of each DDP bucket, in the bucket's order, as a one-rank DDP builds them
    (after its rebuild at the first step)."""
    model = build_model(cfg, data)
    names = {id(p): n for n, p in model.named_parameters()}
    seen: list[list[str]] = []

    def hook(state, bucket):
        seen.append([names[id(p)] for p in bucket.parameters()])
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(None, hook)
        for _ in range(2):  # DDP rebuilds its buckets after the first step
            seen.clear()
            idx = torch.arange(cfg.batch_size)
            batch_loss(ddp, data.x_train[idx], data.y_train[idx]).backward()
    finally:
        dist.destroy_process_group()
    return list(seen)


class Codec:
    """``x -> D(C(x))`` of one chunk of a bucket, for the variant the arguments name."""

    def __init__(self, a):
        self.a = a
        self.sign = gc.SignQuantizer(block_size=a.block)
        self.exact_codec = gc.IntQuantizer(4, block_size=256) if a.exact_codec == "int4" else None

    def _sign(self, x: torch.Tensor) -> torch.Tensor:
        if self.a.scale == "tensor":
            return torch.where(x < 0, -1.0, 1.0) * x.abs().mean()
        return self.sign.decompress(self.sign.compress(x))

    def __call__(self, x: torch.Tensor, pieces) -> torch.Tensor:
        """``pieces``: ``(lo, hi, name)`` of each tensor's part of ``x``. Blocks run over the
        chunk, or restart at every tensor with ``--aligned``, ``--scale tensor`` or ``--exact-params``."""
        if not (self.a.aligned or self.a.exact_params or self.a.scale == "tensor"):
            return self._sign(x)
        out = x.clone()
        for lo, hi, name in pieces:
            if not (self.a.exact_params and re.search(self.a.exact_params, name)):
                out[lo:hi] = self._sign(x[lo:hi])
            elif self.exact_codec is not None:
                out[lo:hi] = self.exact_codec.decompress(self.exact_codec.compress(x[lo:hi]))
        return out


def aggregate(a, C, g, e, pieces, owner: int) -> torch.Tensor:
    """The average of chunk ``owner`` that every rank decodes; ``g``, ``e``: each rank's
    gradient and residual over the chunk (residuals updated in place)."""
    w = len(g)

    def with_ef(r):
        p = g[r] + e[r]
        c = C(p, pieces)
        if a.keep_zeros:  # an exactly-zero gradient sends zero; its residual waits
            c = torch.where(g[r] == 0, torch.zeros_like(c), c)
        e[r].copy_(p - c)
        return c

    if a.agg == "none":
        return sum(g) / w
    if a.agg == "exact":
        return sum(with_ef(r) for r in range(w)) / w
    if a.agg == "two_phase":
        acc = sum(with_ef(r) for r in range(w) if r != owner)
    else:  # ring: the first hop with the sender's residual, later hops without
        acc = with_ef((owner + 1) % w)
        for k in range(2, w):
            r = (owner + k) % w
            acc = C((g[r] + e[r]) + acc, pieces)  # the hop's own data plus the partial sum, as the ring adds
            e[r].zero_()
    s = ((g[owner] + e[owner]) + acc) / w
    e[owner].zero_()
    c = C(s, pieces)
    if a.server_ef:  # kept in the owner's residual, in the units before the division
        e[owner].copy_((s - c) * w)
    return c


def run(a) -> dict:
    torch.set_num_threads(a.threads)
    cfg = TrainConfig(workload="text-gpt", data_file=a.data_file, workers=a.workers, steps=a.steps,
                      batch_size=a.batch_size, lr=a.lr, momentum=a.momentum, seed=a.seed, test_fraction=0.25)
    data = load_split(cfg)
    layout = bucket_layout(cfg, data)
    model = build_model(cfg, data)
    params = dict(model.named_parameters())
    buckets = []
    for names in layout:
        ends = torch.tensor([params[n].numel() for n in names]).cumsum(0).tolist()
        spans = list(zip([0, *ends[:-1]], ends, names))
        buckets.append((names, spans, ends[-1], chunk_bounds(ends[-1], a.workers)))
    C = Codec(a)
    res = [[torch.zeros(b[2]) for b in buckets] for _ in range(a.workers)]
    mom = [[torch.zeros(b[2]) for b in buckets] for _ in range(a.workers)]
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.0 if a.local_momentum else a.momentum)
    gens = [worker_batches(len(data.y_train), a.workers, r, a.batch_size, a.seed, a.steps) for r in range(a.workers)]
    zeros: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for _ in range(a.steps):
        grads = []
        for r in range(a.workers):
            idx = next(gens[r])
            model.zero_grad(set_to_none=True)
            batch_loss(model, data.x_train[idx], data.y_train[idx]).backward()
            for n, p in params.items():
                zeros.setdefault(n, []).append(float((p.grad == 0).float().mean()))
            flat = [torch.cat([params[n].grad.reshape(-1) for n in names]) for names, *_ in buckets]
            if a.local_momentum:  # the momentum before the compression (Zheng et al. 2019)
                flat = [m.mul_(a.momentum).add_(f).clone() for m, f in zip(mom[r], flat)]
            grads.append(flat)
        for bi, (names, spans, n, bounds) in enumerate(buckets):
            avg = torch.empty(n)
            for j, (lo, hi) in enumerate(bounds):
                pieces = [(max(s, lo) - lo, min(t, hi) - lo, nm) for s, t, nm in spans if max(s, lo) < min(t, hi)]
                avg[lo:hi] = aggregate(a, C, [g[bi][lo:hi] for g in grads], [e[bi][lo:hi] for e in res], pieces, j)
            for (s, t, nm) in spans:
                params[nm].grad = avg[s:t].view_as(params[nm]).clone()
        opt.step()
    with torch.no_grad():
        loss, acc = evaluate(model, data.x_test, data.y_test)
    return dict(vars(a), test_loss=loss, accuracy=100 * acc, wall_s=time.perf_counter() - t0,
                zero_fraction={n: sum(v) / len(v) for n, v in zeros.items() if any(v)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-file", required=True, help="the text of the text-gpt workload")
    ap.add_argument("--agg", choices=("none", "exact", "two_phase", "ring"), default="ring")
    ap.add_argument("--block", type=int, default=1024, help="sign block size (elements per scale)")
    ap.add_argument("--aligned", action="store_true", help="sign blocks restart at every tensor")
    ap.add_argument("--scale", choices=("block", "tensor"), default="block")
    ap.add_argument("--keep-zeros", action="store_true", help="an exactly-zero gradient element sends zero")
    ap.add_argument("--exact-params", default="", help="regex of parameter names not sign-compressed")
    ap.add_argument("--exact-codec", choices=("float32", "int4"), default="float32",
                    help="the codec of --exact-params (int4: IntQuantizer(4), blocks of 256)")
    ap.add_argument("--server-ef", action="store_true", help="the owner's compression keeps a residual")
    ap.add_argument("--local-momentum", action="store_true", help="compress the worker's momentum")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    print(json.dumps(run(ap.parse_args())))


if __name__ == "__main__":
    main()
