"""The codec and algorithm a run of adaptive choices used at each step, read from its meter.

A time study's ``auto`` row (adaptive compression, :mod:`gradcomp.adaptive`) changes its codec
during the run, and an ``algorithm="auto"`` run its allreduce algorithm; both log every switch
in the run's meter (``run["meter"]["switches"]``). Validation (:mod:`gradcomp.lab.plan.validate`)
predicts such a run from these records: each stretch of steps with the codec and algorithm it
ran. Details: docs/planning.md#what-validation-reads.
"""

from __future__ import annotations

from gradcomp.lab.plan.model import CODECS

__all__ = ["run_schedule", "plan_name"]


def plan_name(candidate: str) -> str:
    """The planner's codec for an adaptive candidate: the policy keeps residuals for its
    lossy codecs (error feedback), so ``int8`` is priced as ``int8-ef`` and ``topk-int8``
    as ``topk-int8-ef`` where the planner has that entry; the others as named.

    Raises:
        ValueError: a candidate the planner does not price.
    """
    ef = f"{candidate}-ef"
    if ef in CODECS:
        return ef
    if candidate in CODECS:
        return candidate
    raise ValueError(f"the adaptive codec {candidate!r} is not one the planner prices ({', '.join(CODECS)})")


def _stretches(switches: list[dict], steps: int, at: str, what: str) -> list[tuple[int, str]]:
    """``[(first step, choice)]`` from switches that record their step under ``at``; the
    first choice holds from step 0 (the switch's ``from``, else, at a first decision, its ``to``)."""
    if not switches:
        return []
    if len({str(e.get("key", e.get("bucket", 0))) for e in switches}) > 1:
        raise ValueError(f"{what} switches of more than one bucket: per-bucket schedules are not modelled")
    first = switches[0].get("from") or switches[0]["to"]
    out = [(0, first)]
    for e in switches:
        step = int(e[at])
        if not 0 <= step <= steps:
            raise ValueError(f"a {what} switch at step {step} outside the run's {steps} steps")
        out.append((step, e["to"]))
    return out


def run_schedule(run: dict) -> list[tuple[int, str, str]]:
    """Stretches ``[(steps, planner codec, algorithm)]`` covering the run's steps.

    The compressor ``auto`` takes its codecs from the meter's codec switches (entries with a
    ``step``: from its ``from`` at step 0, each ``to`` from its ``step``; sparse codecs on
    ``allgather``, as the adaptive policy runs them); the algorithm ``auto`` from its
    algorithm switches (``kind == "algorithm"``, at their ``call``, one call per step: the
    first decision's choice is taken from step 0, the exploring calls before it are not
    told apart). Any other compressor or algorithm holds for the whole run.

    Raises:
        ValueError: no switch recorded where one is needed (the codec or algorithm run is
            then unknown), switches of several buckets, or a step outside the run.
    """
    steps = int(run.get("steps") or 0)
    if run["compressor"] != "auto" and run["algorithm"] != "auto":
        return [(max(steps, 1), run["compressor"], run["algorithm"])]
    if steps < 1:
        raise ValueError("the run records no step count")
    switches = (run.get("meter") or {}).get("switches") or []
    codec_sw = [e for e in switches if e.get("kind", "codec") != "algorithm" and "step" in e]
    alg_sw = [e for e in switches if e.get("kind") == "algorithm"]
    if run["compressor"] == "auto":
        codecs = _stretches(codec_sw, steps, "step", "codec")
        if not codecs:
            raise ValueError("an auto row without a recorded codec switch: the codec it ran is not recorded")
    else:
        codecs = [(0, run["compressor"])]
    if run["algorithm"] == "auto":
        algs = _stretches(alg_sw, steps, "call", "algorithm")
        if not algs:
            raise ValueError("algorithm 'auto' without a recorded algorithm switch: the algorithm it ran "
                             "is not recorded")
    else:
        algs = [(0, run["algorithm"])]
    bounds = sorted({0, steps, *(a for a, _ in codecs), *(a for a, _ in algs)})
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi == lo:
            continue
        codec = [c for a, c in codecs if a <= lo][-1]
        alg = [c for a, c in algs if a <= lo][-1]
        name = plan_name(codec) if run["compressor"] == "auto" else codec
        if run["compressor"] == "auto" and CODECS[name].sparse:
            alg = "allgather"
        if out and out[-1][1:] == (name, alg):
            out[-1] = (out[-1][0] + hi - lo, name, alg)
        else:
            out.append((hi - lo, name, alg))
    return out
