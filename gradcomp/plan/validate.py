"""Validation: the model's step time and idle share against a time study's measurements.

Reads the ``results.json`` that ``gradcomp train`` (the time study) writes
and, for every run of mode ``sync`` or ``async``, predicts its step from the
run's own setting with :func:`gradcomp.plan.model.predict`. Keys read per run
(under ``"runs"``): ``mode``, ``compressor``, ``algorithm``, ``world_size``,
``params``, ``link`` (``name``, ``configured_bps``, ``achieved_bps``: bits per
second), ``straggler`` (``{"rank", "factor"}`` or null),
``compute_jitter_cv``, ``step_time_median_s``, ``phases_median_s``
(``compute``, ``apply`` used as inputs), ``idle_share``,
``bytes_per_worker_step`` and, for async, ``staleness_mean``; the top level
may hold ``"profile"`` (a profile object as ``gradcomp plan calibrate``
writes it, or the path of one).

What is an input and what a prediction: the measured compute and apply
times are inputs (the model predicts communication and waiting, not the
speed of the model's arithmetic); the compute time is taken as the mean over
workers, so with a straggler of factor ``f`` the others' compute is
``compute * N / (N - 1 + f)``. The link's bandwidth is its achieved rate
(else the configured one, else the profile's measured loopback ``beta``);
alpha and the kernel rates come from the profile. Predicted bytes are sent
bytes for sync and sent + received (push + pull) for async, as the study counts them.
A threshold compressor keeps a data-dependent number of elements: its density
is an input too, read back from the run's bytes (sync allgather: ``N - 1``
payloads of ``96 + 8 k`` bytes plus 8-byte sizes per step).

The summary is the median absolute percentage error of the step time over
the runs, and the median absolute error of the idle share in points.
"""

from __future__ import annotations

import json
import os
import statistics

from gradcomp.plan.model import CODECS, MODES, Codec, Setting, allreduce_bytes, predict
from gradcomp.plan.profile import Profile

__all__ = ["load_results", "validate_runs", "REQUIRED_KEYS"]

#: keys a run must have to be validated
REQUIRED_KEYS = ("mode", "compressor", "algorithm", "world_size", "params", "link", "straggler",
                 "compute_jitter_cv", "step_time_median_s", "phases_median_s", "idle_share")


def load_results(path: str) -> dict:
    """The parsed ``results.json`` in directory ``path`` (or the file ``path`` itself).

    Raises:
        OSError: no such file. ValueError: not JSON, or no ``"runs"`` list.
    """
    file = os.path.join(path, "results.json") if os.path.isdir(path) else path
    with open(file) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{file} has no \"runs\" list: not a gradcomp train results file")
    return data


def results_profile(data: dict, base_dir: str) -> Profile | None:
    """The profile named at the results' top level, if any."""
    prof = data.get("profile")
    if prof is None:
        return None
    if isinstance(prof, str):
        return Profile.load(prof if os.path.isabs(prof) else os.path.join(base_dir, prof))
    return Profile.from_dict(prof)


def _setting(run: dict, prof: Profile) -> Setting:
    n = int(run["world_size"])
    link = run.get("link") or {}
    bps = link.get("achieved_bps") or link.get("configured_bps")
    if bps:
        beta = float(bps) / 8
    elif prof.beta_bytes_per_s is not None:
        beta = prof.beta_bytes_per_s
    else:
        raise ValueError(f"run has no link rate and the profile no measured bandwidth: {link!r}")
    strag = run.get("straggler") or None
    factor = float(strag["factor"]) if strag else 1.0
    phases = run["phases_median_s"]
    compute = float(phases["compute"])
    if factor > 1 and n > 1:
        compute = compute * n / (n - 1 + factor)
    return Setting(nodes=n, link_bytes_per_s=beta, params=int(run["params"]), compute_s=compute,
                   straggler_cv=float(run.get("compute_jitter_cv") or 0.0), straggler_factor=factor,
                   apply_s=float(phases.get("apply") or 0.0), tensors=int(run.get("param_tensors", 1)))


def _codec(run: dict) -> Codec:
    """The run's codec; threshold at the density its measured sync bytes imply."""
    c = CODECS[run["compressor"]]
    sent = run.get("bytes_per_worker_step")
    n, world = int(run["params"]), int(run["world_size"])
    if c.kind == "threshold" and run["mode"] == "sync" and sent and world > 1:
        # the kept count k whose allgather bytes match the measured ones (the
        # payload's size grows with k; its index section's coding depends on n and k)
        lo, hi = 1, n
        while lo < hi:
            k = (lo + hi) // 2
            if allreduce_bytes(c.with_density(k / n), "allgather", n, world)[0] < sent:
                lo = k + 1
            else:
                hi = k
        return c.with_density(lo / n)
    return c


def validate_runs(data: dict, prof: Profile) -> dict:
    """Predicted vs measured per run.

    Returns:
        ``{"rows": [...], "skipped": [(label, reason)], "step_mdape_pct", "idle_mdae_pts"}``;
        each row has ``label``, measured and predicted ``step_s``, ``idle_share``,
        ``exposed_comm_s``, ``bytes``, ``staleness`` and ``step_error_pct``.
    """
    rows, skipped = [], []
    for i, run in enumerate(data["runs"]):
        label = " ".join(str(run.get(k, "?")) for k in ("mode", "compressor", "algorithm"))
        link = (run.get("link") or {}).get("name", "?")
        strag = run.get("straggler")
        label += f" {link} N={run.get('world_size', '?')}" + (
            f" straggler {strag['rank']}:{strag['factor']:g}" if strag else "")
        missing = [k for k in REQUIRED_KEYS if k not in run]
        if missing:
            skipped.append((label, f"missing keys {missing}"))
            continue
        if run["mode"] not in MODES:
            skipped.append((label, f"mode {run['mode']!r} is not modelled by validate"))
            continue
        if run["compressor"] not in CODECS:
            skipped.append((label, f"unknown compressor {run['compressor']!r}"))
            continue
        algorithm = "ps" if run["mode"] == "async" else run["algorithm"]
        try:
            s = _setting(run, prof)
            p = predict(run["mode"], _codec(run), algorithm, s, prof)
        except (ValueError, KeyError, TypeError) as e:
            skipped.append((label, str(e)))
            continue
        measured = float(run["step_time_median_s"])
        bytes_pred = p.bytes_sent if run["mode"] == "sync" else p.bytes_sent + p.bytes_received
        rows.append({
            "label": label, "run": i,
            "step_s": {"measured": measured, "predicted": p.step_s},
            "step_error_pct": 100.0 * (p.step_s - measured) / measured,
            "idle_share": {"measured": float(run["idle_share"]), "predicted": p.idle_share},
            "exposed_comm_s": {"measured": run["phases_median_s"].get("exposed_comm"),
                               "predicted": p.exposed_comm_s},
            "bytes": {"measured": run.get("bytes_per_worker_step"), "predicted": bytes_pred},
            "staleness": {"measured": run.get("staleness_mean"), "predicted": p.staleness_mean},
        })
    step = [abs(r["step_error_pct"]) for r in rows]
    idle = [100 * abs(r["idle_share"]["predicted"] - r["idle_share"]["measured"]) for r in rows]
    return {"rows": rows, "skipped": skipped,
            "step_mdape_pct": statistics.median(step) if step else None,
            "idle_mdae_pts": statistics.median(idle) if idle else None}
