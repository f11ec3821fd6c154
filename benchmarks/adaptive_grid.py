"""``auto`` against the best fixed codec, pooled over runs of the time-study grid.

Reads the ``results.json`` of one or more ``gradcomp train --mode sync
--scenarios ... --compressors ...,auto`` runs (the grid of README "Adaptive
compression") and prints, per scenario, the mean time to target of every row
over all (run, seed) pairs, the best fixed row (the least mean, ``auto``
excluded), ``auto / best`` (ratio of the means), the paired ratio (``auto``
over the best row, per (run, seed), mean and 95% t interval), the same for
the median step time, the achieved link rates, and on how many pairs ``auto``
reached the target at the best row's step. Rows and ``auto`` of one run share
the link, the seed and the host's load of that run, so the paired ratio is
the comparison; the pooled means are what a user would see on average.

Run from the repository root::

    python benchmarks/adaptive_grid.py RUN1/results.json [RUN2/results.json ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from gradcomp.lab.study.timing import mean_ci95


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json of time-study runs with an auto row")
    args = ap.parse_args()
    runs: dict[str, dict[str, dict[tuple[str, int], dict]]] = defaultdict(lambda: defaultdict(dict))
    rates: dict[str, set[float]] = defaultdict(set)
    for path in args.results:
        with open(path) as f:
            for r in json.load(f)["runs"]:
                scenario = r["scenario"]["name"]
                runs[scenario][r["compressor"]][(path, r["seed"])] = r
                if r["link"].get("achieved_bps"):
                    rates[scenario].add(round(r["link"]["achieved_bps"] / 1e6, 1))
    for scenario, rows in runs.items():
        if "auto" not in rows:
            raise SystemExit(f"{scenario}: no auto row in the results")
        means = {c: statistics.fmean(r["time_to_target_s"] for r in v.values()) for c, v in rows.items()}
        best = min((c for c in means if c != "auto"), key=means.get)
        pairs = [k for k in rows["auto"] if k in rows[best]]
        ttt = mean_ci95([rows["auto"][k]["time_to_target_s"] / rows[best][k]["time_to_target_s"] for k in pairs])
        step = mean_ci95([rows["auto"][k]["step_time_median_s"] / rows[best][k]["step_time_median_s"] for k in pairs])
        same = sum(rows["auto"][k]["steps_to_target"] == rows[best][k]["steps_to_target"] for k in pairs)
        link = " / ".join(f"{x:g}" for x in sorted(rates[scenario])) + " Mbit/s" if rates[scenario] else "unshaped"
        print(f"{scenario} (achieved {link}; {len(pairs)} pairs)")
        print("  mean time to target (s): " + ", ".join(f"{c} {m:.2f}" for c, m in means.items()))
        print(f"  best fixed row: {best}; auto / best {means['auto'] / means[best]:.2f}; "
              f"paired {ttt[0]:.2f} ± {ttt[1]:.2f}; median step auto / best {step[0]:.2f} ± {step[1]:.2f}; "
              f"auto at the best row's step on {same}/{len(pairs)}")


if __name__ == "__main__":
    main()
