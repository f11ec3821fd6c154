"""Validation: the model's step time and idle share against a time study's measurements.

Details: docs/planning.md#what-validation-reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

from gradcomp.lab.plan.host import Host
from gradcomp.lab.plan.model import CODECS, MODES, PlanCodec, Setting, allreduce_bytes, predict, ps_bytes
from gradcomp.lab.plan.profile import Profile
from gradcomp.lab.plan.schedule import run_schedule
from gradcomp.lab.plan.tiers import hierarchical_sent

__all__ = ["load_results", "validate_runs", "compute_cv", "breakdown", "fit_host", "run_host", "summary", "REQUIRED_KEYS",
           "TERMS", "results_profile"]

#: keys a run must have to be validated
REQUIRED_KEYS = ("mode", "compressor", "algorithm", "world_size", "params", "link", "straggler",
                 "compute_jitter_cv", "step_time_median_s", "phases_median_s", "idle_share")


def load_results(path: str) -> dict:
    """The parsed ``results.json`` in directory ``path`` (or the file ``path`` itself).

    Raises:
        OSError: no such file. ValueError: not JSON, or no ``"runs"`` list.
    """
    file = os.path.join(path, "results.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        # the one line names what is missing, not Python's errno
        where = f"{path} holds no results.json" if os.path.isdir(path) else f"{path}: no such file or directory"
        raise FileNotFoundError(f"results {where} (give a `gradcomp train --out` directory)")
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


def run_host(run: dict, data: dict, prof: Profile) -> Host | None:
    """The host a run shared: the profile's constants, with the core count the
    run (or its results file) recorded under ``"host": {"cores"}`` when present."""
    recorded = run.get("host") or data.get("host") or {}
    base = prof.host
    if "cores" in recorded:
        base = Host(int(recorded["cores"]), base.slice_s if base else 0.0, base.sched_cv if base else 0.0)
    return base


def _tensors(run: dict, data: dict) -> int:
    """Parameter tensors of the run's model: ``param_tensors`` of the run or of the
    results' ``"model"``, else a weight and a bias per layer of an MLP's
    ``"model": {"layers": [...]}`` (the digits MLP), else 1."""
    model = data.get("model") or {}
    if run.get("param_tensors") or model.get("param_tensors"):
        return int(run.get("param_tensors") or model["param_tensors"])
    layers = model.get("layers")
    return 2 * (len(layers) - 1) if isinstance(layers, list) and len(layers) > 1 else 1


def compute_cv(run: dict) -> float | None:
    """The scatter of the run's compute times as a lognormal's coefficient of variation:
    ``sqrt(r^2 - 1)`` with ``r`` = mean over median of the compute phase (a lognormal's
    mean is its median times ``exp(sigma^2 / 2)``, its CV ``sqrt(exp(sigma^2) - 1)``);
    None when the run recorded no mean and median (0 when the mean is not above the median)."""
    mean = (run.get("phases_mean_s") or {}).get("compute")
    median = (run.get("phases_median_s") or {}).get("compute")
    if not mean or not median:
        return None
    r = float(mean) / float(median)
    return math.sqrt(r * r - 1.0) if r > 1.0 else 0.0


def _tiers(run: dict) -> tuple[int, float | None]:
    """``(ranks per host, intra-host bytes per second)`` of a two-tier run (its ``link``'s
    ``ranks_per_host`` and ``intra`` achieved rate; ``(1, None)`` for one rank per host)."""
    link = run.get("link") or {}
    per = int(link.get("ranks_per_host") or 1)
    intra = link.get("intra") or {}
    bps = intra.get("achieved_bps") or intra.get("configured_bps")
    return per, (float(bps) / 8 if bps else None)


def _setting(run: dict, prof: Profile, host: Host | None = None, tensors: int = 1) -> Setting:
    world = int(run["world_size"])
    # async: the world holds the parameter server too; it shares the workers' host
    n = int(run.get("workers") or world) if run["mode"] == "async" else world
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
    # async workers apply no optimizer step (the server does, priced from the profile)
    apply = None if run["mode"] == "async" else float(phases.get("apply") or 0.0)
    recorded = run.get("host") or {}
    background = float(recorded.get("background_load") or 0.0)
    # the compute's measured scatter holds the configured jitter and what the shared host adds
    scatter = compute_cv(run) if run["mode"] == "sync" else None
    cv = float(run.get("compute_jitter_cv") or 0.0) if scatter is None else scatter
    per, intra_bps = _tiers(run) if run["mode"] == "sync" else (1, None)
    return Setting(nodes=n, link_bytes_per_s=beta, params=int(run["params"]), compute_s=compute,
                   straggler_cv=cv, straggler_factor=factor,
                   apply_s=apply, tensors=tensors, host=host,
                   ranks_per_host=world, background_load=background,
                   local_ranks=per if n % per == 0 else 1, intra_bytes_per_s=intra_bps)


def _measured_bytes(run: dict, c: PlanCodec, s: Setting, algorithm: str) -> int:
    """The model's bytes for ``run`` as the study counts them (sync: sent;
    async: sent + received)."""
    if run["mode"] == "async":
        b = ps_bytes(c, s.params, s.servers, s.tensors, s.compress_pull)
        return b["sent"] + b["received"]
    if algorithm == "hierarchical":
        return hierarchical_sent(c, s.params, s.nodes // s.local_ranks, s.local_ranks)
    return allreduce_bytes(c, algorithm, s.params, s.nodes)[0]


def _codec(run: dict, s: Setting, algorithm: str, name: str | None = None) -> PlanCodec:
    """The run's codec (``name``: one stretch of an adaptive run's, whose bytes mix
    several codecs: priced as the catalog has it), with the sparse index layout and
    (threshold) the density its recorded bytes imply: the model prices the payloads the
    run really sent."""
    if name is not None:
        return CODECS[name]
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
    if c.sparse and sent:
        # payloads written before compact indices carry int32 ones: the layout
        # whose bytes are nearer the recorded ones is the one the run used
        return min((c, c.with_compact_indices(False)),
                   key=lambda cc: abs(_measured_bytes(run, cc, s, algorithm) - float(sent)))
    return c


#: the terms a step is broken down into (seconds each, per worker)
TERMS = ("compute", "wait", "codec", "comm", "apply")


def _measured_terms(run: dict) -> dict | None:
    """The run's mean phases as :data:`TERMS`: ``codec`` = compress + decompress,
    ``comm`` = communicate (blocked on transfers, the transport's own work, in
    async the server's handling), ``apply`` = apply + other."""
    ph = run.get("phases_mean_s")
    if not isinstance(ph, dict):
        return None
    g = lambda k: float(ph.get(k) or 0.0)  # noqa: E731
    return {"compute": g("compute"), "wait": g("wait"), "codec": g("compress") + g("decompress"),
            "comm": g("communicate"), "apply": g("apply") + g("other")}


def _predicted_terms(p) -> dict:
    """A prediction as :data:`TERMS`; ``comm`` is the rest of the step (transfers,
    per-message costs, scheduling delays; async: the server's work on the push)."""
    apply = p.apply_s if p.mode == "sync" else 0.0  # async: the server applies, inside the round trip
    comm = p.step_s - p.compute_s - p.wait_s - p.compress_s - apply
    return {"compute": p.compute_s, "wait": p.wait_s, "codec": p.compress_s, "comm": comm, "apply": apply}


def breakdown(out: dict) -> list[dict]:
    """Per (scenario, mode, compressor) group of :func:`validate_runs`' rows, the
    mean over its runs of the measured and predicted step and :data:`TERMS`.

    Returns:
        ``[{"group": (scenario, mode, compressor), "runs", "step_s":
        {"measured", "predicted"}, "step_error_pct" (mean), "terms":
        {"measured": {...}, "predicted": {...}}}]`` in first-seen order.
    """
    groups: dict[tuple, list[dict]] = {}
    for r in out["rows"]:
        groups.setdefault(tuple(r["group"]), []).append(r)
    result = []
    for key, rows in groups.items():
        meas = [r["terms"]["measured"] for r in rows if r["terms"]["measured"] is not None]
        mean = statistics.fmean
        result.append({
            "group": key, "runs": len(rows),
            "step_s": {k: mean(r["step_s"][k] for r in rows) for k in ("measured", "predicted")},
            "step_error_pct": mean(r["step_error_pct"] for r in rows),
            "terms": {"measured": {t: mean(m[t] for m in meas) for t in TERMS} if meas else None,
                      "predicted": {t: mean(r["terms"]["predicted"][t] for r in rows) for t in TERMS}},
        })
    return result


def summary(rows: list[dict]) -> tuple[float | None, float | None]:
    """Median absolute step-time error (percent) and idle-share error (points) of ``rows``."""
    step = [abs(r["step_error_pct"]) for r in rows]
    idle = [100 * abs(r["idle_share"]["predicted"] - r["idle_share"]["measured"]) for r in rows]
    return (statistics.median(step) if step else None), (statistics.median(idle) if idle else None)


def fit_host(data: dict, prof: Profile, seeds, cores: int | None = None,
             slices=None, cvs=None) -> tuple[Host, dict]:
    """Fit the host's scheduling constants on the runs of ``seeds`` only.

    Searches ``slice_s`` over ``slices`` (default 0 to 8 ms by 0.2 ms) and
    ``sched_cv`` over ``cvs`` (default 0 to 1.5 by 0.05), alternating one
    coordinate at a time from ``(0, 0)`` until neither moves, for the least
    median absolute step-time error (percent) plus median absolute idle-share
    error (points) over those runs. Validate on the other seeds to judge it.

    Args:
        seeds: the seeds (``run["seed"]``) of the fitting subset.
        cores: the host's cores (default: the profile's host, else the results'
            ``"host"``; one of them must say).

    Returns:
        ``(host, info)``; ``info`` has ``seeds``, ``runs`` fitted and the
        subset's ``step_mdape_pct`` and ``idle_mdae_pts``.

    Raises:
        ValueError: no run has one of ``seeds``, or the core count is unknown.
    """
    seeds = {int(x) for x in seeds}
    subset = {**data, "runs": [r for r in data["runs"] if r.get("seed") in seeds]}
    if not subset["runs"]:
        raise ValueError(f"no run has a seed in {sorted(seeds)}")
    if cores is None:
        recorded = data.get("host") or {}
        cores = recorded.get("cores") or (prof.host.cores if prof.host is not None else None)
    if not cores:
        raise ValueError("the host's core count is unknown: give a profile with a \"host\" section")
    slices = [round(i * 2e-4, 6) for i in range(41)] if slices is None else list(slices)
    cvs = [round(i * 0.05, 2) for i in range(31)] if cvs is None else list(cvs)

    def loss(sl: float, cv: float) -> float:
        trial = Profile.from_dict({**prof.to_dict(), "host": {"cores": int(cores), "slice_s": sl, "sched_cv": cv}})
        step, idle = summary(validate_runs(subset, trial)["rows"])
        return math.inf if step is None else step + idle

    sl, cv = slices[0], cvs[0]
    best = loss(sl, cv)
    for _ in range(10):
        moved = False
        for axis in ("slice", "cv"):
            cands = slices if axis == "slice" else cvs
            scores = [(loss(c, cv) if axis == "slice" else loss(sl, c), c) for c in cands]
            score, value = min(scores)
            if score < best - 1e-12:
                best, moved = score, True
                sl, cv = (value, cv) if axis == "slice" else (sl, value)
        if not moved:
            break
    host = Host(int(cores), sl, cv)
    step, idle = summary(validate_runs(subset, Profile.from_dict({**prof.to_dict(), "host": host.to_dict()}))["rows"])
    return host, {"seeds": sorted(seeds), "runs": len(subset["runs"]), "step_mdape_pct": step, "idle_mdae_pts": idle}


def _predict_run(run: dict, s: Setting, prof: Profile):
    """The prediction of one run, and what it was predicted as: ``[(steps, codec,
    algorithm)]`` (:func:`~gradcomp.lab.plan.schedule.run_schedule`; one stretch unless
    the run's codec or algorithm changed). Stretches combine per step: the step time is
    the median over the run's steps of each step's prediction (the run reports a median),
    the other fields the mean weighted by steps."""
    if run["mode"] == "async":
        steps = int(run.get("steps") or 0)
        return predict("async", _codec(run, s, "ps"), "ps", s, prof), [(steps, run["compressor"], "ps")]
    plan = run_schedule(run)
    if len(plan) == 1 and run["compressor"] != "auto":
        _, name, alg = plan[0]
        return predict("sync", _codec(run, s, alg), alg, s, prof), plan
    preds = [(k, predict("sync", _codec(run, s, alg, name), alg, s, prof)) for k, name, alg in plan]
    total = sum(k for k, _ in preds)
    per_step = sorted(t for k, p in preds for t in [p.step_s] * k)
    mean = lambda f: sum(k * f(p) for k, p in preds) / total  # noqa: E731
    first = preds[0][1]
    step = statistics.median(per_step)
    return dataclasses.replace(
        first, compressor="auto" if run["compressor"] == "auto" else first.compressor, algorithm=run["algorithm"],
        step_s=step, compute_s=mean(lambda p: p.compute_s), compress_s=mean(lambda p: p.compress_s),
        communicate_s=mean(lambda p: p.communicate_s), exposed_comm_s=mean(lambda p: p.exposed_comm_s),
        wait_s=mean(lambda p: p.wait_s), apply_s=mean(lambda p: p.apply_s), idle_share=mean(lambda p: p.idle_share),
        comm_share=mean(lambda p: p.comm_share), throughput=s.nodes / step,
        bytes_sent=round(mean(lambda p: p.bytes_sent)), bytes_received=round(mean(lambda p: p.bytes_received)),
        notes=[f"{k} steps {name} {alg}" for k, name, alg in plan]), plan


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
        if run["compressor"] not in CODECS and run["compressor"] != "auto":
            skipped.append((label, f"unknown compressor {run['compressor']!r}"))
            continue
        try:
            s = _setting(run, prof, run_host(run, data, prof), _tensors(run, data))
            p, predicted_as = _predict_run(run, s, prof)
        except (ValueError, KeyError, TypeError) as e:
            skipped.append((label, str(e)))
            continue
        if "auto" in (run["compressor"], run["algorithm"]):  # say what the row was predicted as
            label += " (predicted as " + ", ".join(f"{k} steps {c} {a}" for k, c, a in predicted_as) + ")"
        measured = float(run["step_time_median_s"])
        bytes_pred = p.bytes_sent if run["mode"] == "sync" else p.bytes_sent + p.bytes_received
        rows.append({
            "predicted_as": predicted_as,
            "label": label, "run": i,
            "step_s": {"measured": measured, "predicted": p.step_s},
            "step_error_pct": 100.0 * (p.step_s - measured) / measured,
            "idle_share": {"measured": float(run["idle_share"]), "predicted": p.idle_share},
            "exposed_comm_s": {"measured": run["phases_median_s"].get("exposed_comm"),
                               "predicted": p.exposed_comm_s},
            "bytes": {"measured": run.get("bytes_per_worker_step"), "predicted": bytes_pred},
            "staleness": {"measured": run.get("staleness_mean"), "predicted": p.staleness_mean},
            "group": (str((run.get("scenario") or {}).get("name", link)), run["mode"], run["compressor"]),
            "seed": run.get("seed"),
            "terms": {"measured": _measured_terms(run), "predicted": _predicted_terms(p)},
        })
    step, idle = summary(rows)
    by_scenario = {}
    for name in dict.fromkeys(r["group"][0] for r in rows):
        sub = [r for r in rows if r["group"][0] == name]
        st, idl = summary(sub)
        by_scenario[name] = {"runs": len(sub), "step_mdape_pct": st, "idle_mdae_pts": idl}
    return {"rows": rows, "skipped": skipped, "step_mdape_pct": step, "idle_mdae_pts": idle,
            "by_scenario": by_scenario}
