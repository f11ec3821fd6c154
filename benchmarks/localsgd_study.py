"""Local SGD / DiLoCo against synchronous training: bytes per sample and accuracy over seeds.

For every seed it runs the study's sync ``none`` baseline (DDP, float32 ring
every step) and the local mode (``gradcomp train --mode local``) with each
outer rule and codec, all with the study's defaults (digits MLP, 4 workers x
batch 64, 350 steps, SGD lr 0.1 momentum 0.9) and the seed's data split and
order. Per configuration it prints the mean over seeds of

* ``x fewer``: sync none's bytes per sample over this run's (counted wire
  bytes sent per worker, the final synchronisation included), and
* ``gap (pp)``: sync none's test accuracy minus this run's, paired by seed,
  with a 95% Student-t interval over the seeds,

and ``met`` / ``MISSED`` against the targets (int8 >= 100x, top-k 1% + int8 +
error feedback >= 1000x, both within 0.5 points on the mean).

    python benchmarks/localsgd_study.py [--seeds 3] [--sync-every 32] [--outer avg,nesterov]
        [--compressors int8,topk-int8-ef] [--fragments F --overlap TAU] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from gradcomp.lab.study.config import TrainConfig, parse_compressors
from gradcomp.lab.study.study import run_study

#: (minimum x fewer bytes per sample than sync none, maximum mean gap in points)
TARGETS = {"int8": (100.0, 0.5), "topk-int8-ef": (1000.0, 0.5)}


def _interval(xs: list[float]) -> float:
    """Half-width of the 95% Student-t interval of the mean of ``xs``."""
    if len(xs) < 2:
        return float("nan")
    from scipy import stats

    return float(stats.t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--sync-every", type=int, default=32)
    p.add_argument("--outer", default="avg,nesterov")
    p.add_argument("--compressors", default="int8,topk-int8-ef")
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--overlap", type=int, default=0)
    p.add_argument("--steps", type=int, default=TrainConfig().steps)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    outers = [o.strip() for o in args.outer.split(",") if o.strip()]
    names = ["none", *parse_compressors(args.compressors)]
    rows: dict[tuple[str, str], dict[str, list[float]]] = {}
    for seed in range(args.seeds):
        base = run_study(TrainConfig(seed=seed, steps=args.steps), ["sync"], ["none"]).runs[0]
        base_per_sample = base.bytes_per_worker_per_step / TrainConfig().batch_size
        print(f"seed {seed}: sync none {base.bytes_per_worker_per_step:,.0f} B/worker/step, "
              f"acc {100 * base.test_accuracy:.2f}%", flush=True)
        for outer in outers:
            cfg = TrainConfig(seed=seed, steps=args.steps, sync_every=args.sync_every, outer=outer,
                              fragments=args.fragments, overlap=args.overlap)
            for r in run_study(cfg, ["local"], names).runs:
                per_sample = r.bytes_per_worker_per_step / cfg.batch_size
                row = rows.setdefault((outer, r.compressor), {"x": [], "gap": [], "acc": []})
                row["x"].append(base_per_sample / per_sample)
                row["gap"].append(100 * (base.test_accuracy - r.test_accuracy))
                row["acc"].append(100 * r.test_accuracy)
                print(f"  {outer:8} {r.label:15} {r.bytes_per_worker_per_step:9,.0f} B/worker/step "
                      f"{row['x'][-1]:8.1f}x fewer  acc {100 * r.test_accuracy:.2f}%", flush=True)
    print(f"\nmean over {args.seeds} seeds, H={args.sync_every}, F={args.fragments}, tau={args.overlap}, "
          f"{args.steps} steps, 4 workers, "
          f"against sync none (gap: 95% t-interval)")
    print(f"{'outer':8} {'compressor':15} {'x fewer':>9} {'acc %':>7} {'gap (pp)':>16}  target")
    summary = []
    for (outer, name), row in rows.items():
        x, gap = statistics.mean(row["x"]), statistics.mean(row["gap"])
        half = _interval(row["gap"])
        verdict = ""
        if name in TARGETS:
            need_x, need_gap = TARGETS[name]
            ok = x >= need_x and gap <= need_gap
            verdict = f"{'met' if ok else 'MISSED'} (>= {need_x:g}x within {need_gap} pp)"
        print(f"{outer:8} {name:15} {x:9.1f} {statistics.mean(row['acc']):7.2f} "
              f"{gap:+7.2f} +- {half:5.2f}  {verdict}")
        summary.append({"outer": outer, "compressor": name, "x_fewer_bytes_per_sample": row["x"],
                        "gap_pp": row["gap"], "test_accuracy_pct": row["acc"],
                        "mean_x": x, "mean_gap_pp": gap, "gap_interval95_pp": half})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sync_every": args.sync_every, "fragments": args.fragments, "overlap": args.overlap,
                       "seeds": args.seeds, "steps": args.steps,
                       "rows": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
