"""Measured pipeline bubble on fixed-time stages against the closed forms, over M.

Every stage's forward and backward last ``--compute`` seconds each
(:class:`gradcomp.pipeline.synthetic.FixedTimeStage`: they sleep, so the
stages do not compete for this host's cores and ``--stages 4`` runs on 2
cores as it would on 4). For each schedule and ``M`` the engine runs
``--steps`` steps on ``--stages`` processes (gloo); the bubble is measured from
the stages' timelines (:func:`gradcomp.pipeline.analyze`; the median over the
steps after the first, so that a step the host's other load delayed does not
decide it) and printed next to the theory: ``(p-1)/(m+p-1)`` for GPipe and 1F1B,
``(p-1)/(2m+p-1)`` for interleaved 1F1B with 2 chunks per rank (whose
chunks each last ``--compute``: half a GPipe stage's layers would take half
as long, so its time per step is not comparable, only its bubble). ``model``
is the step time of the step-time model (:func:`gradcomp.lab.plan.model.pipeline_step`)
for the same stages.

    python benchmarks/pipeline_bubble.py [--stages 2] [--microbatches 1,2,4,8,16]
        [--schedules gpipe,1f1b] [--compute 0.02] [--steps 5] [--plot bubble.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from gradcomp.launch import launch
from gradcomp.pipeline import analyze
from gradcomp.pipeline.engine import check_schedule, stages_per_rank
from gradcomp.pipeline.synthetic import run_fixed_time
from gradcomp.lab.plan.model import pipeline_step
from gradcomp.lab.study.pipeline import theory_bubble


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", default="1,2,4,8,16")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--compute", type=float, default=0.02, help="seconds per forward and per backward")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--plot", default=None, help="write measured vs theory to this PNG")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    p = args.stages
    rows = []
    print(f"{'schedule':<12} {'M':>3} {'bubble':>7} {'theory':>7} {'idle':>6} {'step (s)':>9} {'model (s)':>9}")
    for schedule in args.schedules.split(","):
        for m in (int(v) for v in args.microbatches.split(",")):
            try:
                check_schedule(schedule, p, m, p * stages_per_rank(schedule))
            except ValueError as e:
                print(f"{schedule:<12} {m:>3}  skipped: {e}")
                continue
            tls = launch(run_fixed_time, p, (schedule, m, args.steps, args.compute, args.compute),
                         timeout=120 + 4 * args.steps * (m + p) * args.compute)
            per_step = [analyze(tls, steps=[i]) for i in range(1, args.steps)]
            th = theory_bubble(schedule, p, m)
            row = {"schedule": schedule, "microbatches": m, "theory": th,
                   "bubble": statistics.median(r["bubble"] for r in per_step),
                   "idle_fraction": statistics.median(r["idle_fraction"] for r in per_step),
                   "step_s": statistics.median(r["window_s"] for r in per_step),
                   "per_step": per_step}
            # the step-time model's step: p stages of m micro-batches of F + B each
            row["model_step_s"] = (pipeline_step(2 * args.compute * p * m, p, m, schedule)["step_s"]
                                   if schedule in ("gpipe", "1f1b") else None)
            rows.append(row)
            model = "-" if row["model_step_s"] is None else f"{row['model_step_s']:9.3f}"
            print(f"{schedule:<12} {m:>3} {row['bubble']:7.3f} {'-' if th is None else f'{th:7.3f}':>7} "
                  f"{row['idle_fraction']:6.3f} {row['step_s']:9.3f} {model:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stages": p, "compute_s": args.compute, "rows": rows}, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for schedule in dict.fromkeys(r["schedule"] for r in rows):
            pts = [r for r in rows if r["schedule"] == schedule]
            line, = ax.plot([r["microbatches"] for r in pts], [r["bubble"] for r in pts], "o-",
                            label=f"{schedule} measured")
            if all(r["theory"] is not None for r in pts):
                ax.plot([r["microbatches"] for r in pts], [r["theory"] for r in pts], "--",
                        color=line.get_color(), label=f"{schedule} theory")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches per step (M)")
        ax.set_ylabel("bubble fraction")
        ax.set_title(f"bubble on fixed-time stages ({args.compute * 1e3:g} ms F and B), P = {p}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
