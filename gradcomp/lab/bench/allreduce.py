"""Allreduce benchmark: gradcomp's compressed collectives against PyTorch's.

Usage::

    gradcomp bench allreduce [--sizes 1048576,4194304,16777216] [--worlds 2,4]
                             [--link none,1gbit,100mbit] [--link-jitter F]
                             [--topology HxR [--intra-link RATE]]
                             [--repeat 5] [--out DIR] [--quick]
    python benchmarks/allreduce.py ...

For each link (``--link``: ``none`` is gloo over this host's loopback; a rate
such as ``1gbit`` runs every rank in a :class:`gradcomp.lab.cluster.LocalCluster`
whose links are shaped to it, their achieved rate measured first), each world
size (or ``--topology HxR``: ``H`` hosts of ``R`` ranks, :mod:`.hosts`) and each
size ``n`` (float32), every rank holds ``randn(n)`` (seed = rank) and each
method averages it across ranks:

* ``torch all_reduce f32``: ``dist.all_reduce`` of the float32 tensor (the baseline);
* gradcomp :func:`gradcomp.allreduce`: ``none ring`` (float32 on the wire), ``fp16 ring``,
  ``int8 ring``, ``int8 two_phase``, ``int8 halving_doubling``, ``topk1% allgather``, ``topk1%+int8
  allgather`` (values int8), ``topk1%+int8 sparse_reduce_scatter``, ``int8 auto`` and ``topk1%+int8
  auto`` (its steady choice: :data:`AUTO_WARMUP`); ``--topology`` adds hierarchical (:mod:`.hosts`);
* PyTorch's own DDP communication hooks, called directly on a GradBucket-like
  object over the same data (the hooks only use ``buffer()``,
  ``gradients()``, ``index()`` and ``is_last()``): ``fp16_compress_hook``,
  ``quantization_pertensor_hook`` (uint8 per tensor, by all_gather; its
  algorithm re-run with its own helpers, as the hook fails on gloo, see
  :func:`_quantization_pertensor`) and
  ``powerSGD_hook`` (rank 4, error feedback and warm start on; it sees the
  data as 1024 x 1024 matrices, like the weight gradients of square linear
  layers). The data is Gaussian noise, which is not low-rank, so PowerSGD's
  error here is an upper bound on what it achieves on real gradients, whose
  spectra decay.

Every method reduces in place into a buffer reset from the data before each
call (outside the timing), as ``dist.all_reduce`` does, so no method pays for
allocating an n-element result. Each gradcomp method runs on its own process
group, so its ranks agree on its settings once, in the warm-up call (see
:mod:`gradcomp.comm.agreement`), as in a training loop. Reported per method:

* ``ms``: median over ``--repeat`` calls (after one warm-up; two for PowerSGD,
  whose first two steps are plain allreduces) of the slowest rank's wall time.
  The calls run in interleaved rounds (each round calls every method once, in
  table order), so a change in the host's load during the run affects every
  method alike and the ratios stay comparable on a shared machine;
* ``MiB/rank``: wire bytes rank 0 sent per call, in MiB: measured by gradcomp's
  :class:`~gradcomp.TrafficMeter` for gradcomp methods; for torch's
  collectives (which do not report their traffic) the nominal volume of a ring
  algorithm: ``2 (N-1)/N * payload`` for all_reduce, ``(N-1) * payload`` for
  all_gather;
* ``x f32``: the baseline's median time over the method's;
* ``ratio``: ``2 (N-1)/N * 4 n`` bytes (a float32 ring) over the bytes sent;
* ``rel_err``: ``||result - exact mean|| / ||exact mean||`` on the first timed
  call (float64 exact mean);
* ``link%`` (shaped links only): the bytes this rank sent per call over the
  time, as a share of the configured rate. For the float32 baseline this is
  its bus bandwidth (``2 (N-1)/N x 4 n`` bytes over the time, NCCL's
  ``busbw``) over the rate: how close the link is to what was configured.

Results print as a table and, with ``--out DIR``, go to
``DIR/allreduce.json`` with the machine, kernel backends, settings and every
link's configured and achieved rate, and ``DIR/allreduce.png`` (time against
size per method, one panel per link and world size).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from gradcomp.lab.args import OneLineParser
from gradcomp.lab.bench.allreduce_table import LEGEND, WIDTH, table_lines
from gradcomp.lab.bench.hosts import HIERARCHICAL_METHODS, gc0_tx_bytes, host_figures, host_table
from gradcomp.lab.cluster import jitter_type, link_type, topology_type

__all__ = ["main", "run", "method_names", "table_lines", "LEGEND", "WIDTH", "Method", "plot"]

_MATRIX = 1024  # PowerSGD sees the data as _MATRIX x _MATRIX matrices
_POWERSGD_RANK = 4
BASELINE = "torch all_reduce f32"


class _Bucket:
    """The part of ``dist.GradBucket`` that PyTorch's hooks use, over one flat buffer."""

    def __init__(self, buffer: torch.Tensor):
        self._buffer = buffer
        n, m = buffer.numel(), _MATRIX * _MATRIX
        views, off = [], 0
        while off < n:  # full matrices, then a partial matrix, then a vector tail
            take = min(m, n - off)
            rows = take // _MATRIX
            if rows:
                views.append(buffer[off:off + rows * _MATRIX].view(rows, _MATRIX))
                off += rows * _MATRIX
            else:
                views.append(buffer[off:])
                off = n
        self._views = views

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._views

    def parameters(self):
        return self._views

    def index(self):
        return 0

    def is_last(self):
        return True

    def set_buffer(self, t):
        self._buffer.copy_(t)


def _ring_nbytes(payload: int, world: int) -> int:
    return 2 * (world - 1) * payload // world


def _powersgd_payload(views) -> int:
    """float32 bytes PowerSGD allreduces per step: P and Q of every matrix, vectors raw."""
    total = 0
    for v in views:
        if v.dim() == 2 and min(v.shape) > _POWERSGD_RANK:
            total += 4 * _POWERSGD_RANK * (v.shape[0] + v.shape[1])
        else:
            total += 4 * v.numel()
    return total


@dataclass
class Method:
    """A benchmarked method: ``setup(buf, world) -> call``; ``call()`` reduces ``buf``
    in place and returns the bytes this rank sent (None: use ``nominal``)."""

    name: str
    family: str
    setup: Callable
    warmup: int = 1
    hierarchical: bool = False  # needs hosts (--topology)


def _torch_allreduce(buf, world):
    def call():
        buf.div_(world)
        dist.all_reduce(buf)
        return _ring_nbytes(4 * buf.numel(), world)
    return call


#: the ``auto`` methods' exploration rounds; their warm-up covers it for up to 4 candidates (2 calls
#: each per round) and no re-check falls in the timed calls. JSON: ``auto_choice``, ``auto_measured_ms``
AUTO_EXPLORE = 5
AUTO_WARMUP = 4 * 2 * AUTO_EXPLORE + 1


def _gradcomp(make, algorithm, inter="ring", segments=None):
    def setup(buf, world):
        import gradcomp as gc

        comp = make()
        auto = None
        if algorithm == "auto":  # no re-check within the timed calls: they time the steady choice
            auto = gc.AutoAlgorithm(explore=AUTO_EXPLORE, interval=10**9)
        meter = gc.TrafficMeter()
        # its own group, as in training (a DDP hook has its own): calls on one
        # group that alternate between settings would agree on every call
        group = dist.new_group(list(range(world)))
        kw = {}
        if algorithm == "hierarchical":
            kw["topology"] = gc.Topology(inter_algorithm=inter, segments=segments)  # hosts from the environment
        calls = [0]

        def call():
            meter.reset()
            # a checked hierarchical call agrees every time: after the warm-up, as the DDP hook, unchecked
            # (auto checks by itself whenever its choice changes)
            check = algorithm not in ("hierarchical", "auto") or calls[0] == 0
            gc.allreduce(buf, comp, algorithm=auto or algorithm, group=group, meter=meter, out=buf, check=check,
                         key="bench", **kw)
            calls[0] += 1
            return meter.bytes_sent
        call.meter = meter
        call.auto = auto
        call.bucket_wire_bytes = comp.wire_nbytes((buf.numel(),), torch.float32)
        return call
    return setup


def _hook(kind):
    def setup(buf, world):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks

        bucket = _Bucket(buf)
        n = buf.numel()
        if kind == "fp16":
            def call():
                buf.copy_(default_hooks.fp16_compress_hook(None, bucket).wait())
                return _ring_nbytes(2 * n, world)
        elif kind == "quant":
            def call():
                buf.copy_(_quantization_pertensor(quantization_hooks, buf, world))
                return (world - 1) * (n + 8)  # uint8 codes plus (scale, zero point) floats
        else:
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=_POWERSGD_RANK,
                                                start_powerSGD_iter=2, min_compression_rate=2,
                                                use_error_feedback=True, warm_start=True, random_seed=0)

            def call():
                buf.copy_(powerSGD_hook.powerSGD_hook(state, bucket).wait())
                return _ring_nbytes(_powersgd_payload(bucket.gradients()), world)
        return call
    return setup


def _quantization_pertensor(qh, tensor, world):
    """``quantization_pertensor_hook``'s algorithm with its own helpers
    (``MinMaxObserver`` scale and zero point, ``_quantize_per_tensor_backend``,
    ``_dequantize_per_tensor_backend``, two all_gathers). The hook itself cannot
    run on gloo in torch 2.13: it indexes its all_gather future's value as
    NCCL's nested ``[[t_0, .., t_N-1]]`` while gloo returns ``[t_0, .., t_N-1]``
    (IndexError: invalid index of a 0-dim tensor)."""
    observer = torch.ao.quantization.MinMaxObserver().to(tensor.device)
    observer(tensor)
    s, z = observer.calculate_qparams()
    s_and_z = torch.FloatTensor([s, z]).to(tensor.device)
    all_s_z = [torch.zeros_like(s_and_z) for _ in range(world)]
    dist.all_gather(all_s_z, s_and_z)
    rank = dist.get_rank()
    q = qh._quantize_per_tensor_backend(tensor, all_s_z[rank][0], all_s_z[rank][1])
    all_q = [torch.zeros_like(q) for _ in range(world)]
    dist.all_gather(all_q, q)
    acc = torch.zeros_like(tensor, dtype=torch.float32)
    for r, qr in enumerate(all_q):
        acc += qh._dequantize_per_tensor_backend(qr, all_s_z[r][0], all_s_z[r][1])
    return acc / world


def _methods():
    import gradcomp as gc

    return [
        Method(BASELINE, "torch", _torch_allreduce),
        Method("none ring", "gradcomp", _gradcomp(gc.NoCompression, "ring")),
        Method("fp16 ring", "gradcomp", _gradcomp(gc.FP16, "ring")),
        Method("int8 ring", "gradcomp", _gradcomp(gc.Int8Quantizer, "ring")),
        Method("int8 two_phase", "gradcomp", _gradcomp(gc.Int8Quantizer, "two_phase")),
        Method("int8 halving_doubling", "gradcomp", _gradcomp(gc.Int8Quantizer, "halving_doubling")),
        *(Method(name, "gradcomp", _gradcomp(gc.Int8Quantizer, "hierarchical", inter, segments), hierarchical=True)
          for name, inter, segments in HIERARCHICAL_METHODS),
        # each auto method right after the fixed methods of its codec: a round's slower, CPU-heavier
        # sparse methods do not run just before it
        Method("int8 auto", "gradcomp", _gradcomp(gc.Int8Quantizer, "auto"), warmup=AUTO_WARMUP),
        Method("topk1% allgather", "gradcomp", _gradcomp(lambda: gc.TopK(ratio=0.01), "allgather")),
        Method("topk1%+int8 allgather", "gradcomp",
               _gradcomp(lambda: gc.TopK(ratio=0.01, values=gc.Int8Quantizer()), "allgather")),
        Method("topk1%+int8 sparse_reduce_scatter", "gradcomp",
               _gradcomp(lambda: gc.TopK(ratio=0.01, values=gc.Int8Quantizer()), "sparse_reduce_scatter")),
        Method("topk1%+int8 auto", "gradcomp",
               _gradcomp(lambda: gc.TopK(ratio=0.01, values=gc.Int8Quantizer()), "auto"), warmup=AUTO_WARMUP),
        Method("torch fp16_compress_hook", "torch hook", _hook("fp16")),
        Method("torch quantization_pertensor_hook", "torch hook", _hook("quant")),
        Method(f"torch powerSGD_hook rank {_POWERSGD_RANK}", "torch hook", _hook("powersgd"), warmup=2),
    ]


def method_names() -> list[str]:
    """Names of every benchmarked method, in table order."""
    return [m.name for m in _methods()]


def _chosen(names, hosts: bool) -> list[Method]:
    return [m for m in _methods() if (not names or m.name in names) and (hosts or not m.hierarchical)]


def _timed_round(chosen, calls, x, buf, record) -> None:
    """One call of every method, in table order; ``record(method, seconds, bytes, link bytes, call)``."""
    for m, call in zip(chosen, calls):
        buf.copy_(x)
        tx = gc0_tx_bytes()
        dist.barrier()
        t0 = time.perf_counter()
        nbytes = call()
        dt = time.perf_counter() - t0
        if tx is not None:  # the link's bytes of the call (and of two barriers)
            dist.barrier()
            tx = gc0_tx_bytes() - tx
        record(m, dt, nbytes, tx, call)


def _bench_worker(rank, world, sizes, repeat, names, per_host=None):
    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        exact = x.double()
        dist.all_reduce(exact)
        exact /= world
        norm = float(exact.norm())
        buf = torch.empty_like(x)
        chosen = _chosen(names, per_host is not None)
        calls = []
        for m in chosen:
            call = m.setup(buf, world)
            for _ in range(m.warmup):
                buf.copy_(x)
                call()
            calls.append(call)
        times = {m.name: [] for m in chosen}
        link = {m.name: [] for m in chosen}
        share = {m.name: [] for m in chosen}
        sent, err, inter = {}, {}, {}

        def record(m, dt, nbytes, tx, call):
            times[m.name].append(dt)
            link[m.name].append(tx)
            meter = getattr(call, "meter", None)
            tiers = meter.as_dict()["tiers"] if meter is not None else {}
            if "intra_host" in tiers:
                share[m.name].append(tiers["intra_host"]["seconds"] / dt)
            if m.name not in sent:
                sent[m.name] = nbytes
                err[m.name] = float((buf.double() - exact).norm()) / norm
                inter[m.name] = tiers.get("inter_host", {}).get("bytes_sent")

        for _ in range(repeat):  # interleaved rounds: load changes hit every method alike
            _timed_round(chosen, calls, x, buf, record)
        everything = [None] * world
        dist.all_gather_object(everything, (times, link, share, inter))
        raw = _ring_nbytes(4 * n, world)
        for m, call in zip(chosen, calls):
            slowest = [max(e[0][m.name][i] for e in everything) for i in range(repeat)]
            row = {"world": world, "numel": n, "method": m.name, "family": m.family,
                   "median_ms": 1000 * statistics.median(slowest),
                   "min_ms": 1000 * min(slowest), "bytes_per_rank": sent[m.name],
                   "raw_bytes_per_rank": raw,
                   "compression_ratio": raw / sent[m.name] if sent[m.name] else None,
                   "rel_err": err[m.name]}
            if getattr(call, "auto", None) is not None:
                row["auto_choice"] = call.auto.algorithm("bench")
                last = call.auto.switches[-1] if call.auto.switches else {}
                row["auto_measured_ms"] = {a: 1000 * t for a, t in last.get("measured_s", {}).items()}
            if per_host is not None:
                row.update(host_figures(everything, m.name, world, per_host, repeat))
                row["bucket_wire_bytes"] = getattr(call, "bucket_wire_bytes", None)
            rows.append(row)
    return rows if rank == 0 else None


def run(sizes, worlds, repeat=5, names=None, timeout=3600.0, links=("none",),
        link_jitter=0.0, seed=0, on_link=None, topology=None, intra_link=None) -> list[dict]:
    """Run the benchmark; returns one row per (link, world, size, method).

    Args:
        sizes: float32 element counts. worlds: rank counts (>= 2; ignored with ``topology``).
        repeat: timed calls per method. names: method names to keep (None: all).
        timeout: seconds for each world size's run.
        links: ``"none"`` (loopback) and/or rates for :class:`gradcomp.lab.cluster.LocalCluster`.
        link_jitter, seed: the cluster's ``rate_jitter`` and ``seed``.
        on_link: called with each link's description (configured and achieved rate).
        topology: ``(hosts, ranks_per_host)``: one world of ``hosts x ranks_per_host``
            ranks, a two-tier cluster on shaped links.
        intra_link: the intra-host rate of that cluster (None: unshaped).
    """
    rows = []
    shapes = [(w, 1, False) for w in worlds] if topology is None else [(*topology, True)]
    for link in links:
        for hosts, per, tiered in shapes:
            out, info = _run_one(link, hosts, per, tiered, (list(sizes), repeat, names), timeout,
                                 link_jitter, seed, intra_link, on_link)
            for r in out:
                r["link"] = info
                r["topology"] = f"{hosts}x{per}" if tiered else None
                rate = info["configured_bps"]
                r["link_share"] = (8 * r["bytes_per_rank"] / (r["median_ms"] / 1000) / rate
                                   if rate else None)
            rows += out
    for r in rows:
        base = next((b for b in rows if b["world"] == r["world"] and b["numel"] == r["numel"]
                     and b["link"]["name"] == r["link"]["name"] and b["method"] == BASELINE), None)
        r["speedup_vs_f32"] = base["median_ms"] / r["median_ms"] if base is not None else None
    return rows


def _run_one(link, hosts, per, tiered, args, timeout, link_jitter, seed, intra_link, on_link):
    """The worker's rows and the link's description of one (link, shape)."""
    from gradcomp.launch import launch

    world = hosts * per
    args = (*args, per if tiered else None)
    if link == "none":
        env = [{"GRADCOMP_HOST_ID": str(r // per)} for r in range(world)] if tiered else None
        out = launch(_bench_worker, world, args, timeout=timeout, rank_env=env)[0]
        return out, {"name": "none", "configured_bps": None, "achieved_bps": None, "emulation": "loopback",
                     "world_size": world, "hosts": hosts, "ranks_per_host": per}
    from gradcomp.lab.cluster import LocalCluster

    shape = dict(hosts=hosts, ranks_per_host=per, intra_rate=intra_link) if tiered else dict(world_size=world)
    with LocalCluster(**shape, rate=link, rate_jitter=link_jitter, seed=seed) as c:
        info = c.describe()
        if on_link is not None:
            on_link(info)
        return c.run(_bench_worker, *args, timeout=timeout)[0], info


def plot(rows, path: str) -> str:
    """Time against size per method, one panel per (link, world); writes ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["link"]["name"], r["world"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (link, world) in zip(axes[0], panels):
        sub = [r for r in rows if r["link"]["name"] == link and r["world"] == world]
        info = sub[0]["link"]
        for name in dict.fromkeys(r["method"] for r in sub):
            pts = sorted((r["numel"], r["median_ms"]) for r in sub if r["method"] == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    lw=2.5 if name == BASELINE else 1.2, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("float32 elements per rank")
        ax.set_ylabel("median time per allreduce (ms, slowest rank)")
        if info["configured_bps"]:
            from gradcomp.lab.units import format_rate

            title = (f"link {format_rate(info['configured_bps'])} (achieved "
                     f"{format_rate(info['achieved_bps'])}), world {world}")
        else:
            title = f"loopback (unshaped), world {world}"
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle("gradcomp allreduce: time against size per method")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: the width the table fits (a terminal's default)
def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _links(text: str) -> list[str]:
    out = [link_type(t) for t in (t.strip() for t in text.split(",")) if t]
    if not out:
        raise argparse.ArgumentTypeError("expected link names, e.g. none,1gbit,100mbit")
    return list(dict.fromkeys(out))


def _int(text: str) -> int:
    base, _, exp = text.strip().partition("**")
    return int(base) ** int(exp) if exp else int(base)


def _ints(text: str) -> list[int]:
    try:
        vals = [_int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (2**20 allowed), got {text!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def main(argv=None) -> int:
    """Command line entry point (``gradcomp bench allreduce``); returns the exit status."""
    p = OneLineParser(prog="gradcomp bench allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=_ints, help="one size in float32 elements (overrides --sizes)")
    p.add_argument("--sizes", type=_ints, default=[2**20, 2**22, 2**24],
                   help="comma-separated sizes in float32 elements (default 2**20,2**22,2**24)")
    p.add_argument("--worlds", type=_ints, default=[2, 4], help="comma-separated rank counts (default 2,4)")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per method (default 5)")
    p.add_argument("--methods", default=None,
                   help="comma-separated method names to run (default: all; the float32 baseline "
                        "always runs); see the table for names")
    p.add_argument("--link", type=_links, default=["none"], metavar="LIST",
                   help="comma-separated links: none (loopback, default) or rates such as "
                        "100mbit,1gbit,10gbit (an emulated cluster, needs root and iproute2)")
    p.add_argument("--link-jitter", type=jitter_type, default=0.0, metavar="F",
                   help="redraw each shaped link's rate every second from rate x U(1-F, 1+F) (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the link jitter (default 0)")
    p.add_argument("--topology", type=topology_type, default=None, metavar="HxR",
                   help="hosts x ranks per host (e.g. 2x4): one world of H*R ranks, ranks of a host sharing "
                        "its namespace (shaped --link between hosts); adds the hierarchical methods")
    p.add_argument("--intra-link", type=link_type, default="none", metavar="RATE",
                   help="with --topology and a shaped --link: the intra-host rate (default none: unshaped)")
    p.add_argument("--out", default=None, help="directory for allreduce.json and allreduce.png")
    p.add_argument("--quick", action="store_true", help="size 2**20, world 2, 3 repeats")
    args = p.parse_args(argv)
    sizes = args.size if args.size else args.sizes
    worlds, repeat = args.worlds, args.repeat
    if args.quick:
        sizes, worlds, repeat = [2**20], [2], 3
    if repeat < 1:
        p.error("--repeat must be >= 1")
    if min(worlds) < 2:
        p.error("--worlds must be >= 2 (a world of one sends nothing)")
    if args.out:
        from gradcomp._validate import writable_dir

        try:
            writable_dir("--out", args.out)
        except ValueError as e:
            p.error(str(e).replace("--out ", "--out: ", 1))
    if any(link != "none" for link in args.link):
        from gradcomp.lab.cluster import requirements_missing

        reason = requirements_missing()
        if reason is not None:
            p.error(f"--link {','.join(args.link)} needs the emulated cluster: {reason}")
    names = [s.strip() for s in args.methods.split(",")] if args.methods else None
    if names:
        unknown = sorted(set(names) - set(method_names()))
        if unknown:
            p.error(f"unknown --methods {unknown}; choose from {method_names()}")
        names = [BASELINE] + [n for n in names if n != BASELINE]  # every ratio is against it
        if args.topology is None and any(m.hierarchical for m in _methods() if m.name in names):
            p.error("the hierarchical methods need hosts: give --topology HxR")
    if args.topology is not None:
        worlds = [args.topology[0] * args.topology[1]]
        if worlds[0] < 2:
            p.error("--topology must hold at least 2 ranks")
    if args.intra_link != "none" and (args.topology is None or args.link == ["none"]):
        p.error("--intra-link needs --topology and a shaped --link")

    import gradcomp as gc

    backends = gc.kernels.available_backends()
    config = {
        "sizes": sizes, "worlds": worlds, "repeat": repeat, "links": args.link,
        "topology": None if args.topology is None else "x".join(map(str, args.topology)),
        "intra_link": args.intra_link,
        "link_jitter": args.link_jitter, "seed": args.seed,
        "transport": "gloo (loopback for link none, veth + tbf in network namespaces otherwise)",
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "threads_per_rank": int(os.environ.get("GRADCOMP_WORKER_THREADS", "1")),
        "kernel_backends": {k: ("usable" if v is None else v) for k, v in backends.items()},
        "native_cpu_kernels": backends.get("cpu") is None,
    }
    print(textwrap.fill(f"gradcomp allreduce benchmark: worlds {worlds}, sizes {sizes}, {repeat} repeats; CPU "
                        f"kernels: {'native (gradcomp._C)' if config['native_cpu_kernels'] else 'reference (torch)'}",
                        width=WIDTH), flush=True)
    links = []

    def on_link(info):
        from gradcomp.lab.units import format_rate

        links.append(info)
        print(f"link {info['name']}, world {info['world_size']}: configured "
              f"{format_rate(info['configured_bps'])}, achieved {format_rate(info['achieved_bps'])} "
              "(calibration transfer host 0 -> 1)", flush=True)
        intra = info.get("intra") or {}
        if intra.get("achieved_bps"):
            configured = format_rate(intra["configured_bps"]) if intra["configured_bps"] else "unshaped"
            print(f"intra-host ({info['topology']}): configured {configured}, achieved "
                  f"{format_rate(intra['achieved_bps'])} (rank 0 -> 1 on host 0)", flush=True)

    config["load_average_start"] = os.getloadavg()  # 1, 5, 15 min: the machine may be shared
    rows = run(sizes, worlds, repeat, names, links=args.link, link_jitter=args.link_jitter,
               seed=args.seed, on_link=on_link, topology=args.topology,
               intra_link=None if args.intra_link == "none" else args.intra_link)
    config["link_calibrations"] = links
    config["load_average_end"] = os.getloadavg()
    print("\n".join(table_lines(rows)))
    print(textwrap.fill(LEGEND, width=WIDTH))
    if args.topology is not None:
        print(host_table(rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "allreduce.json")
        with open(path, "w") as f:
            json.dump({"config": config, "results": rows}, f, indent=1)
        print(f"wrote {path}")
        print(f"wrote {plot(rows, os.path.join(args.out, 'allreduce.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
