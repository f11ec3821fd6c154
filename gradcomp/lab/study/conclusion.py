"""The study's conclusion in plain words: what the runs show, with the uncertainty it rests on.

:func:`conclusion` answers the question the study exists for (did compression
cost accuracy, and what did it save?) in two to four sentences. A gap counts as
a loss only when it lies beyond its noise: with several seeds, the 95% interval
of the per-seed gaps; with one seed, the sampling error of a difference of two
accuracies measured on the test set (:func:`sampling_error_pp`), since one seed
measures no run-to-run spread. Times follow :func:`~gradcomp.lab.study.decision.contenders`.
"""

from __future__ import annotations

import math

from gradcomp.lab.study.decision import Aggregate, contenders

__all__ = ["sampling_error_pp", "gap_noise_pp", "conclusion"]


def sampling_error_pp(accuracy_pct: float, test_predictions: int) -> float:
    """Half-width in points of the 95% interval of a difference between two
    accuracies near ``accuracy_pct`` (%), each measured on ``test_predictions``
    predictions with independent errors: ``1.96 sqrt(2 p (1 - p) / n)``."""
    p = min(max(accuracy_pct / 100.0, 0.0), 1.0)
    return 100.0 * 1.96 * math.sqrt(2.0 * p * (1.0 - p) / max(1, test_predictions))


def gap_noise_pp(a: Aggregate, test_predictions: int) -> float:
    """The noise of ``a``'s accuracy gap in points: its 95% interval over seeds,
    or with one seed the test set's :func:`sampling_error_pp`."""
    if a.seeds > 1 and not math.isnan(a.gap_ci):
        return a.gap_ci
    return sampling_error_pp(a.accuracy, test_predictions)


def _mode_sentence(mode: str, rows: list[Aggregate], test_predictions: int) -> str | None:
    """What the mode's compressors saved and what they cost, against its none row."""
    compressed = [a for a in rows if a.compressor not in ("none", "native")]
    if not compressed:
        return None
    # the gap is none's accuracy minus the row's: a loss is a gap above its noise
    lost = [a for a in compressed if a.gap_pp - gap_noise_pp(a, test_predictions) > 0]
    kept = [a for a in compressed if a not in lost]
    parts = []
    if kept:
        best = max(kept, key=lambda a: a.reduction_x)
        parts.append(f"{best.label} sent {best.reduction_x:.2f}x fewer bytes per step than none, "
                     f"test accuracy {0.0 - best.gap_pp:+.2f} points, "  # 0.0 - : no "-0.00"
                     + ("no loss beyond the noise" if len(kept) == 1 else
                        f"the largest saving of the {len(kept)} compressors without a loss beyond the noise"))
    if lost:
        worst = ", ".join(f"{a.label} {-a.gap_pp:+.2f}" for a in sorted(lost, key=lambda a: -a.gap_pp))
        parts.append(f"{worst} points lost accuracy beyond the noise")
    return f"{mode}: " + "; ".join(parts) + "."


def _noise_sentence(rows: list[Aggregate], test_predictions: int) -> str:
    seeds = min(a.seeds for a in rows)
    if seeds > 1:
        return (f"Figures are means over {seeds} seeds; a gap or a time counts only beyond its 95% "
                "interval.")
    acc = sum(a.accuracy for a in rows) / len(rows)
    return (f"This rests on 1 seed, which measures no run-to-run spread: gaps within "
            f"±{sampling_error_pp(acc, test_predictions):.1f} points (the sampling error of a difference "
            f"on {test_predictions} test predictions at {acc:.0f}%) and differences in time are not resolved; "
            "--seeds 3 gives intervals.")


def _time_sentence(rows: list[Aggregate], max_gap_pp: float) -> str:
    close = contenders(rows, max_gap_pp).get(rows[0].scenario, [])
    if not close:
        return f"No configuration reached the target accuracy on every seed within {max_gap_pp:g} points of its none."
    names = ", ".join(f"{a.mode} {a.label} ({a.time_to_target_s:.2f} s)" for a in close[:4])
    if len(close) == 1:
        return f"Fastest to the target within {max_gap_pp:g} points of its none: {names}, beyond the noise."
    more = f" and {len(close) - 4} more" if len(close) > 4 else ""
    return (f"Fastest to the target: not separable: {names}{more} lie within each other's noise "
            "(decision.md says what would separate them).")


def conclusion(aggs: list[Aggregate], test_predictions: int, max_gap_pp: float) -> list[str]:
    """Two to four sentences on the first scenario's runs (``aggs`` from
    :func:`~gradcomp.lab.study.decision.aggregate`): per mode, the largest
    traffic saving without an accuracy loss beyond the noise and the
    compressors that lost accuracy; the uncertainty; the fastest to the target."""
    if not aggs:
        return []
    rows = [a for a in aggs if a.scenario == aggs[0].scenario]
    modes = [s for mode in dict.fromkeys(a.mode for a in rows)
             if (s := _mode_sentence(mode, [a for a in rows if a.mode == mode], test_predictions))]
    tail = [_noise_sentence(rows, test_predictions)]
    if any(a.time_to_target_s is not None for a in rows):
        tail.append(_time_sentence(rows, max_gap_pp))
    if len(modes) + len(tail) > 4:  # three modes or more: one sentence for all of them
        modes = [" ".join(modes)]
    return modes + tail
