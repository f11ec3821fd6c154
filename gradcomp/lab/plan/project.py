"""Projection: the model over a grid of node counts, links and model sizes.

For every ``(params, link, nodes)`` it predicts sync training with every
compressor and algorithm, async training on the parameter server, and the
same sync step under stragglers, and reports:

* the communication share of the step (exposed communication / step) for
  uncompressed ring allreduce and for the fastest sync choice;
* the speed-up of each sync (compressor, algorithm) over sync none on the ring;
* sync vs async throughput (gradients applied per second, best of each);
* the idle share (waiting for the slowest worker / step) with compute-time CV ``cv``.

When no compute time is given it is derived from the model size:
``compute = 6 * params * samples / flops`` (forward + backward FLOPs of a
dense model per token or sample, Kaplan et al. 2020), with the ``samples``
per worker step and the sustained ``flops`` stated on the command line.
"""

from __future__ import annotations

import dataclasses

from gradcomp.lab.plan.model import CODECS, Setting, predict
from gradcomp.lab.plan.profile import Profile
from gradcomp.lab.plan.recommend import candidates

__all__ = ["derived_compute_s", "project", "plot"]


def derived_compute_s(params: int, samples: int, flops: float) -> float:
    """``6 * params * samples / flops`` seconds."""
    return 6.0 * params * samples / flops


def project(nodes, links, params, prof: Profile, *, compute_s=None, samples: int = 8192,
            flops: float = 4e14, straggler_cv: float = 0.2, servers: int | None = None,
            **setting_kw) -> list[dict]:
    """One row per ``(params, link, nodes)``.

    Args:
        nodes: node counts; links: ``[(name, bytes per second)]``; params: model sizes.
        compute_s: one worker's compute per step (None: :func:`derived_compute_s`).
        straggler_cv: CV of the compute times for the straggler columns.
        servers: parameter-server shards (default: one per 8 workers, at least 1).

    Returns:
        Rows with ``params``, ``link``, ``nodes``, ``compute_s``, ``baseline``
        (sync none ring prediction dict), ``sync`` (``{"compressor/algorithm": prediction}``),
        ``best_sync``, ``best_async`` (keys), ``async`` predictions, ``speedup``
        per sync key, ``comm_share_none``, ``comm_share_best``,
        ``async_over_sync`` (throughput ratio), ``idle_share`` (with ``cv``) and
        ``idle_step_s``.
    """
    rows = []
    for p in params:
        comp = compute_s if compute_s is not None else derived_compute_s(p, samples, flops)
        for link_name, beta in links:
            for n in nodes:
                s = Setting(nodes=n, link_bytes_per_s=beta, params=p, compute_s=comp,
                            servers=servers or max(1, n // 8), **setting_kw)
                sync, asyn = {}, {}
                for mode, name, alg in candidates():
                    pred = predict(mode, name, alg, s, prof)
                    (sync if mode == "sync" else asyn)[f"{name}/{alg}"] = pred
                base = sync["none/ring"]
                # the best choices among codecs whose accuracy gap was measured (plan.json has all)
                best_sync = min(_measured(sync), key=lambda k: sync[k].step_s)
                best_async = max(_measured(asyn), key=lambda k: asyn[k].throughput)
                strag = predict("sync", *best_sync.split("/"), dataclasses.replace(s, straggler_cv=straggler_cv), prof)
                rows.append({
                    "params": p, "link": link_name, "nodes": n, "compute_s": comp,
                    "baseline": base.as_dict(), "best_sync": best_sync, "best_async": best_async,
                    "sync": {k: v.as_dict() for k, v in sync.items()},
                    "async": {k: v.as_dict() for k, v in asyn.items()},
                    "speedup": {k: base.step_s / v.step_s for k, v in sync.items()},
                    "comm_share_none": base.comm_share, "comm_share_best": sync[best_sync].comm_share,
                    "async_over_sync": asyn[best_async].throughput / sync[best_sync].throughput,
                    "staleness_best_async": asyn[best_async].staleness_mean,
                    "idle_share": strag.idle_share, "idle_step_s": strag.step_s, "cv": straggler_cv,
                })
    return rows


def _measured(preds: dict) -> list[str]:
    """The ``"compressor/algorithm"`` keys of ``preds`` whose codec has a measured accuracy gap."""
    return [k for k in preds if CODECS[k.split("/")[0]].gap_pts is not None]


def plot(rows: list[dict], path: str) -> None:
    """Four panels over the node count (log scale), one line per (params, link):
    communication share (none on the ring, dashed: the fastest sync choice),
    speed-up of the fastest sync choice over none, async / sync throughput,
    idle share under stragglers. Writes a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["params"], r["link"]), []).append(r)
    from gradcomp.lab.units import format_count

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), constrained_layout=True)
    (a, b), (c, d) = axes
    cv = rows[0]["cv"] if rows else 0
    for (p, link), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["nodes"])
        x = [r["nodes"] for r in rs]
        lab = f"{format_count(p)} params, {link}"
        line, = a.plot(x, [100 * r["comm_share_none"] for r in rs], marker="o", label=lab)
        a.plot(x, [100 * r["comm_share_best"] for r in rs], ls="--", color=line.get_color())
        b.plot(x, [r["speedup"][r["best_sync"]] for r in rs], marker="o", color=line.get_color(), label=lab)
        c.plot(x, [r["async_over_sync"] for r in rs], marker="o", color=line.get_color(), label=lab)
        d.plot(x, [100 * r["idle_share"] for r in rs], marker="o", color=line.get_color(), label=lab)
    a.set(title="communication share of the step (solid: none/ring, dashed: fastest sync)",
          ylabel="exposed communication / step (%)")
    b.set(title="speed-up of the fastest sync compressor/algorithm over none/ring", ylabel="x")
    c.set(title="async / sync throughput (gradients applied per second, best of each)", ylabel="ratio")
    d.set(title=f"idle share waiting for the slowest worker (compute CV {cv:g})", ylabel="wait / step (%)")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes")
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    fig.suptitle("gradcomp plan: alpha-beta model of a data-parallel step")
    fig.savefig(path, dpi=110)
    plt.close(fig)
