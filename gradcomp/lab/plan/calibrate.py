"""Calibration: fit alpha and beta from timed point-to-point transfers, time the kernels.

Link: ranks 0 and 1 of an initialised process group play ping-pong through
gradcomp's own point-to-point layer (:meth:`gradcomp.comm.p2p.Comm.exchange`,
the path every collective takes, pieces included) with messages of several
sizes; half the median round trip of each size is a one-way time ``t(m)``.
``t(m) = alpha + m / beta`` gives the bandwidth ``beta`` (bytes per second)
from the least-squares slope and the per-message latency ``alpha`` (seconds)
from the smallest message (:func:`fit_alpha_beta`). Other ranks of the group
stay idle.

Kernels: every codec operation of :data:`gradcomp.lab.plan.profile.OPS`, timed
in this process on a float32 tensor of ``numel`` elements through the
methods the transports call (``compress(out=)``, ``decompress(out=)``,
``decompress_add_``, ``reduce_compress_``, ``gradcomp.kernels.topk`` /
``threshold`` / ``scatter_add_``, ``ErrorFeedback(Int8Quantizer())``,
``torch.optim.SGD(momentum=0.9).step``); rate = elements / median seconds.
Each op's fixed cost per call is its time on :data:`CALL_NUMEL` elements
less what the rate accounts for. The host's core count goes into the
profile's ``"host"``; its scheduling constants are not timed here but
fitted on a time study (``gradcomp plan validate --fit-seeds``).
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch

from gradcomp import catalog

__all__ = ["DEFAULT_SIZES", "CALL_NUMEL", "sizes_for", "fit_alpha_beta", "measure", "measure_link", "measure_kernels",
           "link_profile"]

#: message sizes in bytes timed by :func:`measure_link` on loopback
DEFAULT_SIZES = (8, 64 * 1024, 512 * 1024, 2 * 2**20, 8 * 2**20, 16 * 2**20)


def sizes_for(rate_bytes_per_s: float | None) -> tuple[int, ...]:
    """Message sizes for a link of this rate: six sizes from 8 bytes up to what
    the link moves in about 0.1 s (1 to 16 MiB; :data:`DEFAULT_SIZES` on loopback)."""
    if rate_bytes_per_s is None:
        return DEFAULT_SIZES
    top = int(min(16 * 2**20, max(2**20, 0.1 * rate_bytes_per_s)))
    return (8,) + tuple(int(top * f) for f in (1 / 64, 1 / 16, 1 / 4, 1 / 2, 1))


def fit_alpha_beta(sizes, seconds) -> tuple[float, float, dict]:
    """Fit ``seconds = alpha + size / beta``: ``beta`` from the slope of the
    least-squares line (which the large messages dominate), ``alpha`` the
    smallest message's time less its bytes at that rate (a latency as a
    ping-pong of tiny messages measures it).

    The line's own intercept is not the latency: on a shaped link (tbf) a
    token burst lets mid-sized messages through faster than the rate, and
    the intercept can come out negative while 8 bytes take half a millisecond.

    Args:
        sizes: message sizes in bytes (at least two distinct).
        seconds: one-way times in seconds, one per size.

    Returns:
        ``(alpha_s, beta_bytes_per_s, info)``; ``info`` holds the residuals
        of ``alpha + size / beta`` (seconds), their coefficient of
        determination ``r2``, the least-squares line's intercept and, if
        ``alpha`` came out below 1 microsecond (noise around a tiny
        latency), the clamp applied.

    Raises:
        ValueError: fewer than two distinct sizes, mismatched lengths, a
            non-finite or negative time, or a slope <= 0 (times that do not
            grow with size: no bandwidth can be fitted).
    """
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"sizes and seconds must be 1-D of equal length, got {x.shape} and {y.shape}")
    if len(set(x.tolist())) < 2:
        raise ValueError("at least two distinct message sizes are needed to fit alpha and beta")
    if not (np.isfinite(y).all() and (y >= 0).all()):
        raise ValueError("times must be finite and >= 0")
    a = np.stack([np.ones_like(x), x], axis=1)
    (intercept, inv_beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    if not inv_beta > 0:
        raise ValueError(f"times do not grow with message size (slope {inv_beta:.3g} s/byte): "
                         "no bandwidth can be fitted")
    smallest = x == x.min()
    alpha = float(np.median(y[smallest])) - float(x.min()) * inv_beta
    resid = y - (alpha + inv_beta * x)
    ss = float(((y - y.mean()) ** 2).sum())
    info = {"sizes": x.tolist(), "seconds": y.tolist(), "residuals_s": resid.tolist(),
            "r2": 1.0 - float((resid ** 2).sum()) / ss if ss > 0 else 1.0,
            "line_intercept_s": float(intercept)}
    if alpha < 1e-6:
        info["alpha_clamped_from_s"] = float(alpha)
        alpha = 1e-6
    return float(alpha), float(1.0 / inv_beta), info


def measure_link(rank: int, world_size: int, sizes=DEFAULT_SIZES, repeats: int = 5,
                 timeout: float = 300.0) -> dict | None:
    """Time ping-pong transfers between ranks 0 and 1 of the default process group.

    Call on every rank (torch.distributed initialised, e.g. under
    :func:`gradcomp.launch.launch` or ``LocalCluster.run``); ranks >= 2 return None.

    Args:
        sizes: message sizes in bytes.
        repeats: timed round trips per size (after two warm-up rounds), >= 1.
        timeout: seconds any transfer may take.

    Returns:
        On ranks 0 and 1: ``{"sizes": [...], "one_way_s": [...]}``, half the
        median round trip per size; None on other ranks.
    """
    import torch.distributed as dist

    from gradcomp.comm.p2p import Comm, Message

    if world_size < 2:
        raise ValueError(f"measuring a link needs world_size >= 2, got {world_size}")
    comm = Comm(dist.group.WORLD, timeout)
    if rank >= 2:
        return None
    peer = 1 - rank
    bufs = [(torch.zeros(m, dtype=torch.uint8), torch.empty(m, dtype=torch.uint8)) for m in sizes]
    times: list[list[float]] = [[] for _ in sizes]
    # rounds interleave the sizes (a load change on the host hits every size alike);
    # the first two rounds warm up connections and buffers and are not counted
    for rnd in range(repeats + 2):
        for i, (send, recv) in enumerate(bufs):
            t0 = time.perf_counter()
            if rank == 0:
                comm.exchange([Message(peer, send)], [], "calibrate")
                comm.exchange([], [Message(peer, recv)], "calibrate")
            else:
                comm.exchange([], [Message(peer, recv)], "calibrate")
                comm.exchange([Message(peer, send)], [], "calibrate")
            if rnd >= 2:
                times[i].append(time.perf_counter() - t0)
    out = [statistics.median(t) / 2 for t in times]
    return {"sizes": list(sizes), "one_way_s": out}


def measure(rank: int, world_size: int, sizes=DEFAULT_SIZES, repeats: int = 5, timeout: float = 300.0,
            kernel_numel: int = 2**22) -> dict | None:
    """:func:`measure_link`, then (rank 0) :func:`measure_kernels` in the same
    process, so the kernels are timed under the ranks' own thread settings and
    load (e.g. ``GRADCOMP_WORKER_THREADS`` under :func:`gradcomp.launch.launch`).

    Returns:
        On rank 0 ``{"link": measure_link's result, "kernels": measure_kernels'
        result}``; on other ranks None (they wait at a barrier meanwhile).
    """
    import torch.distributed as dist

    link = measure_link(rank, world_size, sizes, repeats, timeout)
    kern = measure_kernels(kernel_numel, repeats) if rank == 0 else None
    dist.barrier()
    return {"link": link, "kernels": kern} if rank == 0 else None


def link_profile(results: list, link: str) -> dict:
    """``{"alpha_s", "beta_bytes_per_s", "fit"}`` from :func:`measure_link`'s
    per-rank results (rank 0's; or :func:`measure`'s)."""
    r0 = results[0]["link"] if "link" in results[0] else results[0]
    alpha, beta, info = fit_alpha_beta(r0["sizes"], r0["one_way_s"])
    info["link"] = link
    return {"alpha_s": alpha, "beta_bytes_per_s": beta, "fit": info}


def _median_times(fns: dict, repeats: int, tick=None) -> dict:
    """Median seconds of each thunk of ``fns`` over ``repeats`` rounds; each round times
    every thunk once, so that a change of the host's load (other jobs) hits every op alike
    instead of the few timed while it lasts (``tick()`` once per thunk, as it is warmed)."""
    for fn in fns.values():
        if tick is not None:
            tick()
        fn()  # warm-up (allocations, first-use loading)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


#: elements of the small tensor whose timings give each op's per-call overhead
CALL_NUMEL = 256


def _codec_thunks(kind: str, comp, x: torch.Tensor, y: torch.Tensor, acc: torch.Tensor) -> dict:
    """The four timed calls of codec ``comp`` on ``x`` (``y``: decompress output, ``acc``: the
    accumulator, which keeps growing by the payload's values: harmless for a few calls)."""
    wire = torch.empty(comp.wire_nbytes(tuple(x.shape)), dtype=torch.uint8)
    wire2 = torch.empty_like(wire)
    p = comp.compress(x, out=wire)
    return {f"{kind}.compress": lambda: comp.compress(x, out=wire),
            f"{kind}.decompress": lambda: comp.decompress(p, out=y),
            f"{kind}.decompress_add": lambda: comp.decompress_add_(p, acc),
            f"{kind}.reduce_compress": lambda: comp.reduce_compress_(p, acc, out=wire2)}


def _op_seconds(numel: int, repeats: int, density: float, tick=None) -> tuple[dict, int]:
    """Median seconds of every op of :data:`gradcomp.lab.plan.profile.OPS` on ``numel``
    float32 elements, and the kept count ``k`` of the sparse ops (``tick()`` before each op)."""
    import gradcomp as gc
    from gradcomp import kernels as K

    g = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=g)
    acc = torch.zeros(numel)
    y = torch.empty(numel)
    fns = {}
    blockwise = {kind: catalog.build(name) for kind, name in (  # at the catalog's block sizes
        ("int8", "int8"), ("int4", "int4"), ("int2", "int2"), ("sign", "sign"), ("fp8e4m3", "fp8"),
        ("fp8e5m2", "fp8-e5m2"))}
    for kind, comp in (("raw", gc.NoCompression()), ("fp16", gc.FP16()), ("bf16", gc.BF16()),
                       *blockwise.items()):
        fns.update(_codec_thunks(kind, comp, x, y, acc))
    for kind, comp in blockwise.items():
        ef = gc.ErrorFeedback(comp)
        fns[f"{kind}.compress_ef"] = lambda ef=ef: ef.compress(x, key="calibrate")
    k = max(1, math.ceil(density * numel))
    fns["topk.select"] = lambda: K.topk(x, k)
    tau = float(K.topk(x, k)[1].abs().min())
    fns["threshold.select"] = lambda: K.threshold(x, tau)
    idx = torch.randperm(numel, generator=g)[:k].sort().values.to(torch.int32)
    vals = torch.randn(k, generator=g)
    fns["sparse.decompress_add"] = lambda: K.scatter_add_(acc, idx, vals)
    sparse = catalog.build("topk-int8", density=density)  # compact indices, as the transports send
    payload = sparse.compress(x)
    fns["sparse.payload_decompress_add"] = lambda: sparse.decompress_add_(payload, acc)
    res = torch.zeros(numel)
    fns["ef.update"] = lambda: res.copy_(torch.add(x, res, out=y))
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = x.clone()
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    fns["sgd.apply"] = opt.step
    return _median_times(fns, repeats, tick), k


def measure_kernels(numel: int = 2**22, repeats: int = 5, density: float = 0.01, on_progress=None) -> dict:
    """Elements per second of every op of :data:`gradcomp.lab.plan.profile.OPS` here
    (CPU, torch's threads), and each op's fixed cost per call.

    The rate is timed on ``numel`` elements; the per-call cost is the time on
    :data:`CALL_NUMEL` elements less what the rate accounts for (at least 0):
    a kernel of ``m`` elements costs ``call_s + m / rate`` (the dispatch,
    allocation and Python cost that a tensor of a few thousand elements pays
    in full, e.g. the parameter server's per-tensor codec calls).

    ``on_progress(done, total)`` is called as the ops are timed (None: not).

    Returns:
        ``{"kernels": {op: elements/s}, "call_s": {op: seconds}, "source": {...}}``.
    """
    from gradcomp import kernels as K
    from gradcomp.lab.plan.profile import OPS

    done = [0]

    def tick():
        if on_progress is not None:
            on_progress(done[0], 2 * len(OPS))
        done[0] += 1

    big, k = _op_seconds(numel, repeats, density, tick)
    small, k_small = _op_seconds(CALL_NUMEL, max(repeats, 9), density, tick)
    if on_progress is not None:
        on_progress(done[0], 2 * len(OPS))
    kernels = {op: numel / max(t, 1e-9) for op, t in big.items()}
    per_kept = ("sparse.decompress_add", "sparse.payload_decompress_add")  # rated per kept element
    for op in per_kept:
        kernels[op] = k / max(big[op], 1e-9)
    call = {}
    for op, t in small.items():
        m = k_small if op in per_kept else CALL_NUMEL
        call[op] = max(0.0, t - m / kernels[op])
    backends = {b: r for b, r in K.available_backends().items()}
    return {"kernels": kernels, "call_s": call,
            "source": {"kernels": f"measured: float32, numel {numel} (per-call cost: numel {CALL_NUMEL}), "
                                  f"density {density}, median of {repeats}, torch threads {torch.get_num_threads()}",
                       "backends": {b: ("available" if r is None else r) for b, r in backends.items()}}}
