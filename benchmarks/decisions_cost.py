"""The adaptive strategy's decisions' cost: ``--mode auto`` against its final choice fixed from the start.

For every seed it runs the auto mode (local SGD with ``sync_every="auto"`` and
``compressor="auto"``), reads the period and codec in force at the end of that run (the last
entry of ``extra.decisions``), and runs next, in the same scenario, the local mode with that
period and codec fixed from the first step (the codec's error-feedback row where the study has
one: the auto mode's lossy codecs keep residuals), with partial work as the auto mode had it.
The two runs of a seed follow each other, so they share the host's load as closely as this
allows. Per seed it prints both times to the target accuracy (training clock) and their ratio
auto / fixed; over the seeds the mean ratio with its 95% Student-t interval, and ``met`` /
``MISSED`` against the target: auto within 5% of its final choice (mean ratio <= 1.05). With
``--against H:ROW`` the fixed run is that local row instead (auto against a chosen fixed row,
paired by seed; the target: within 10%, ratio <= 1.10).

Every option of ``gradcomp train`` that sets the workload, the link and the schedule passes
through (``--mode`` and ``--compressors`` excepted); ``--target-acc`` is required (the auto
mode has no baseline of its own to derive one from).

    python benchmarks/decisions_cost.py --workload mnist-cnn --link 100mbit --seeds 3 \\
        --target-acc 0.96 [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from gradcomp.lab.study import command
from gradcomp.lab.study.config import COMPRESSORS
from gradcomp.lab.study.scenarios import scenario_list
from gradcomp.lab.study.study import run_study

#: the largest mean ratio auto / fixed that meets the target
TARGET = 1.05
#: the steady scenarios' target against the best fixed row (auto within 10%)
AGAINST = 1.10


def fixed_row(codec: str) -> str:
    """The local mode's row for the auto mode's codec ``codec`` (its ``-ef`` row where one exists)."""
    return f"{codec}-ef" if f"{codec}-ef" in COMPRESSORS else codec


def _interval(xs: list[float]) -> float:
    """Half-width of the 95% Student-t interval of the mean of ``xs`` (nan below two)."""
    if len(xs) < 2:
        return float("nan")
    from scipy import stats

    return float(stats.t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5)


def _run_record(r) -> dict:
    return {"time_to_target_s": r.time_to_target_s, "steps_to_target": r.steps_to_target,
            "test_accuracy": r.test_accuracy,
            "period_moves": [{k: e.get(k) for k in ("step", "from", "to", "reason", "divergence", "loss", "loss0")}
                             for e in (r.meter or {}).get("switches", []) if e.get("kind") == "sync_every"],
            "step_time_median_s": (r.time or {}).get("step_time_median_s"),
            "phases_mean_s": (r.time or {}).get("phases_mean_s"),
            "curve": {"marks": r.marks, "clock_at_marks": r.clock_at_marks, "accuracy_at_marks": r.accuracy_at_marks},
            "background_load": r.host.get("background_load"),
            "achieved_bps": r.link.get("achieved_bps"), "phases": r.link.get("phases")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="write the per-seed records here")
    p.add_argument("--against", default=None, metavar="H:ROW",
                   help="pair auto with this fixed local row instead of its final choice (e.g. 64:none)")
    ours, rest = p.parse_known_args(argv)
    args = command.build_parser("decisions_cost").parse_args(["--mode", "local,auto", *rest])
    if args.target_acc is None:
        p.error("--target-acc is required")
    cfg = command._config(args)
    (scenario,) = scenario_list(args, cfg.workers)
    records = []
    for i in range(args.seeds):
        c = dataclasses.replace(cfg, seed=cfg.seed + i)
        auto = run_study(c, ["auto"], ["auto"], scenario=scenario, target_acc=args.target_acc).runs[0]
        final = auto.extra["decisions"][-1]
        h, row = final["sync_every"], fixed_row(final["codec"])
        if ours.against is not None:
            h, row = int(ours.against.split(":")[0]), ours.against.split(":")[1]
        # the final choice includes whether a slow worker runs partial work (on in auto unless switched off)
        partial = cfg.partial_work if ours.against is not None else cfg.partial_work is not False
        fixed = run_study(dataclasses.replace(c, sync_every=h, partial_work=partial), ["local"], [row],
                          scenario=scenario, target_acc=args.target_acc, baseline=False).runs[0]
        rec = {"seed": c.seed, "sync_every": final["sync_every"], "codec": final["codec"], "fixed_sync_every": h, "row": row,
               "moves": len(auto.extra["decisions"]) - 1, "auto": _run_record(auto), "fixed": _run_record(fixed)}
        ta, tf = auto.time_to_target_s, fixed.time_to_target_s
        rec["ratio"] = ta / tf if ta is not None and tf is not None else None
        records.append(rec)
        print(f"seed {c.seed}: final H={final['sync_every']} codec={final['codec']}; fixed H={h} row {row}; "
              f"to target auto {ta} s ({auto.steps_to_target} steps), fixed {tf} s ({fixed.steps_to_target} steps), "
              f"ratio {rec['ratio']}; accuracy auto {auto.test_accuracy}, fixed {fixed.test_accuracy}; "
              f"load {rec['auto']['background_load']} / {rec['fixed']['background_load']}", flush=True)
    ratios = [r["ratio"] for r in records if r["ratio"] is not None]
    if ratios:
        mean = statistics.fmean(ratios)
        what, target = ("final choice", TARGET) if ours.against is None else (f"row local {ours.against}", AGAINST)
        print(f"auto / fixed {what}: {mean:.3f} +- {_interval(ratios):.3f} (95%, {len(ratios)} of "
              f"{len(records)} seeds reached the target in both) -> {'met' if mean <= target else 'MISSED'} "
              f"(target <= {target})")
    else:
        print("no seed reached the target in both runs")
    if ours.json:
        with open(ours.json, "w") as f:
            json.dump({"target_accuracy": args.target_acc, "scenario": scenario.as_dict(), "records": records}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
