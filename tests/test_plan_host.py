"""gradcomp.lab.plan on a shared host: processor sharing, scheduling delay, hand-off scatter,
per-call kernel costs, the closed queue of the parameter server, and the host fit of validate."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gradcomp.lab.cli import main
from gradcomp.lab.plan.host import Host
from gradcomp.lab.plan.model import (CODECS, Setting, allreduce_bytes, allreduce_seconds, mva_response, predict,
                                 ps_bytes)
from gradcomp.lab.plan.profile import Profile
from gradcomp.lab.plan.validate import _setting, _tensors, fit_host, validate_runs

RATES = {"compress": 1e8, "reduce_compress": 5e7, "decompress": 2e8, "decompress_add": 1e8}
PROFILE = {"version": 1, "alpha_s": 1e-4, "beta_bytes_per_s": None, "link": "none",
           "kernels": {f"{c}.{op}": r for c in ("raw", "int8") for op, r in RATES.items()}}


@pytest.fixture
def profile():
    return Profile.from_dict(PROFILE)


def _lognormal_max(n: int, mean: float, cv: float) -> float:
    """E[max of n iid lognormals of this mean and CV] = int_0^inf 1 - F(x)^n dx, by quadrature."""
    from math import erf

    sigma = math.sqrt(math.log1p(cv * cv))
    mu = math.log(mean) - sigma * sigma / 2
    x = np.linspace(1e-9, mean * 20, 400_001)
    cdf = np.array([0.5 * (1 + erf((math.log(v) - mu) / (sigma * math.sqrt(2)))) for v in x[::100]])
    cdf = np.interp(x, x[::100], cdf)
    return float(np.trapezoid(1 - cdf ** n, x))


def test_host_terms_by_hand():
    h = Host(cores=2, slice_s=0.004, sched_cv=0.5)
    assert (h.share(1), h.share(2), h.share(4), h.share(5)) == (1.0, 1.0, 2.0, 2.5)
    assert h.skew_s(2) == 0.0 and h.skew_s(4) == pytest.approx(0.004) and h.skew_s(5) == pytest.approx(0.006)
    assert h.cv(2) == 0.0 and h.cv(4) == pytest.approx(0.5)
    assert Host.from_dict(h.to_dict()) == h
    for kw, word in (({"cores": 0}, "cores"), ({"cores": 2, "slice_s": -1.0}, "slice_s"),
                     ({"cores": 2, "sched_cv": math.nan}, "sched_cv"), ({"cores": 2.5}, "cores")):
        with pytest.raises(ValueError, match=word):
            Host(**kw)
    with pytest.raises(ValueError, match="cores"):
        Host.from_dict({"slice_s": 1.0})


def test_per_call_cost_and_profile_round_trip():
    prof = Profile(kernels={"int8.compress": 1e8}, call_s={"int8.compress": 1e-4}, host=Host(2, 0.003, 0.4))
    assert prof.seconds("int8.compress", 1e6, calls=3) == pytest.approx(3e-4 + 1e-2)
    assert prof.seconds("int8.compress", 1e6) == pytest.approx(1e-4 + 1e-2)
    back = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert back.host == Host(2, 0.003, 0.4) and back.call_s == {"int8.compress": 1e-4}
    with pytest.raises(ValueError, match="call_s"):
        Profile(call_s={"int8.squash": 1.0})
    with pytest.raises(ValueError, match="call_s"):
        Profile(call_s={"int8.compress": -1.0})


def test_ring_with_sharing_and_skew_by_hand(profile):
    # int8 ring over 4 ranks, 40,000 elements: chunks of 10,000, wire 48 + 4 * 40 + 10,000 = 10,208
    # bytes, 1.0208 ms on a 10 MB/s link; CPU work twice as slow (share 2)
    c, rc, d = 2 * 1e4 / 1e8, 2 * 1e4 / 5e7, 2 * 1e4 / 2e8
    hop = 1e-4 + 2e-3  # the 2 ms scheduling delay exceeds the transfer: it sets the step
    t = allreduce_seconds(CODECS["int8"], "ring", 40_000, 4, 1e-4, 1e7, profile, share=2.0, skew=2e-3)
    assert t["total"] == pytest.approx((c + 3 * hop + 3 * rc) + (3 * hop + d))
    assert t["transfer"] == pytest.approx(6 * hop)
    hop = 1e-4 + 10_208 / 1e7  # a 0.5 ms delay hides behind the 1.02 ms transfer
    t = allreduce_seconds(CODECS["int8"], "ring", 40_000, 4, 1e-4, 1e7, profile, share=2.0, skew=5e-4)
    assert t["total"] == pytest.approx((c + 3 * hop + 3 * rc) + (3 * hop + d))
    # sparse allgather: 3 size messages of 8 bytes and 3 payloads, each at least the delay
    p = allreduce_bytes(CODECS["topk-ef"], "allgather", 40_000, 4)[0] / 3 - 8
    t = allreduce_seconds(CODECS["topk-ef"], "allgather", 40_000, 4, 1e-4, 1e7, profile, skew=2e-3)
    assert t["transfer"] == pytest.approx(3 * (1e-4 + 2e-3) + 3 * (1e-4 + max(2e-3, p / 1e7)))


def test_sync_step_on_a_shared_host_by_hand(profile):
    host = Host(cores=2, slice_s=2e-3, sched_cv=0.25)
    s = Setting(nodes=4, link_bytes_per_s=1e7, params=40_000, compute_s=0.010, apply_s=0.001, host=host,
                ranks_per_host=4)
    p = predict("sync", "int8", "ring", s, profile)
    slowest = _lognormal_max(4, 0.010, 0.25)  # hand-off scatter: CV 0.25 x (4 / 2 - 1)
    hop = 1e-4 + 2e-3
    comm = (2e-4 + 3 * hop + 3 * 4e-4) + (3 * hop + 1e-4)
    assert p.step_s == pytest.approx(slowest + comm + 0.001, rel=1e-4)
    assert p.wait_s == pytest.approx(slowest - 0.010, rel=1e-3)
    # with the configured jitter the CVs add in quadrature: 0.3 and 0.4 make 0.5
    s2 = Setting(nodes=4, link_bytes_per_s=1e7, params=40_000, compute_s=0.010, apply_s=0.001,
                 host=Host(2, 2e-3, 0.4), ranks_per_host=4, straggler_cv=0.3)
    assert s2.compute_cv() == pytest.approx(0.5)
    # a straggler hands off last: the others wait idle in the collective, no step waits
    # for a descheduled peer (hop = alpha + transfer), CPU work still shared
    s3 = Setting(nodes=4, link_bytes_per_s=1e7, params=40_000, compute_s=0.010, apply_s=0.001,
                 host=Host(2, 2e-3, 0.0), ranks_per_host=4, straggler_factor=3.0)
    hop = 1e-4 + 10_208 / 1e7
    assert predict("sync", "int8", "ring", s3, profile).step_s == pytest.approx(
        0.030 + (2e-4 + 3 * hop + 3 * 4e-4) + (3 * hop + 1e-4) + 0.001)
    # one rank per core: the plain alpha-beta model
    plain = Setting(nodes=4, link_bytes_per_s=1e7, params=40_000, compute_s=0.010, apply_s=0.001)
    same = Setting(nodes=4, link_bytes_per_s=1e7, params=40_000, compute_s=0.010, apply_s=0.001,
                   host=Host(8, 5e-3, 1.0), ranks_per_host=4)
    assert predict("sync", "int8", "ring", same, profile).step_s == pytest.approx(
        predict("sync", "int8", "ring", plain, profile).step_s)


def test_closed_queue_by_hand():
    # two workers, think 1 s, service 1 s: population 1: R = 1, Q = 1/2; population 2: R = 1.5
    assert mva_response([(2, 1.0)], 1.0) == pytest.approx([1.5])
    # one worker thinking 1 s and one 3 s: Q(1,0) = 1/2, Q(0,1) = 1/4, so
    # R_a = 1 + Q(0,1) = 1.25 and R_b = 1 + Q(1,0) = 1.5
    assert mva_response([(1, 1.0), (1, 3.0)], 1.0) == pytest.approx([1.25, 1.5])
    # saturation: 50 workers, think 0: X = 50 / (50 D) = 1 / D
    r = mva_response([(50, 0.0)], 0.01)[0]
    assert 50 / r == pytest.approx(100.0)
    with pytest.raises(ValueError, match="groups"):
        mva_response([], 1.0)


def test_async_on_a_shared_host_queues_behind_the_server(profile):
    # 8 workers and the server on 2 cores (share 4.5): the server's work per push is
    # the decompress-add of 1e5 elements at 1e8/s (the pull's compression with a
    # residual has no rate in this profile: free), the queue's service D
    s = Setting(nodes=8, link_bytes_per_s=1e12, params=100_000, compute_s=1e-3, apply_s=0.0, alpha_s=1e-9,
                host=Host(2), ranks_per_host=9)
    p = predict("async", "int8", "ps", s, profile)
    b = ps_bytes(CODECS["int8"], 100_000, 1, 1)
    d = 4.5 * 1e5 / 1e8
    # away from the server: compute, compress the push and decompress-add the pull
    # (4.5 x 1 ms each), 6 messages, the bytes
    think = 1e-3 + 4.5e-3 + 4.5e-3 + 6e-9 + (b["push"] + b["pull"]) / 1e12
    q = 0.0
    for n in range(1, 9):  # exact mean value analysis, by hand
        r = d * (1 + q)
        q = n * r / (think + r)
    assert p.step_s == pytest.approx(think + r)
    assert p.wait_s == pytest.approx(r - d)
    assert p.throughput == pytest.approx(8 / (think + r))
    assert p.throughput * d > 0.9 and "server-bound" in p.notes


# ---- validate: what the run records say ------------------------------------------------

def test_sparse_bytes_with_fixed_width_indices_by_hand():
    # topk-int8-ef, 1000 elements, k = 10: header 48 + int32 indices 40 + int8 values
    # payload 48 + 4 + 10; compact: Elias-Fano L = 6, ceil(60 / 8) + ceil((10 + 999 >> 6) / 8) = 12 -> 16
    c = CODECS["topk-int8-ef"]
    assert allreduce_bytes(c.with_compact_indices(False), "allgather", 1000, 2) == (150 + 8, 150 + 8)
    assert allreduce_bytes(c, "allgather", 1000, 2) == (126 + 8, 126 + 8)
    assert CODECS["int8"].with_compact_indices(False) is CODECS["int8"]


def _run(**kw):
    run = {"mode": "sync", "compressor": "int8", "algorithm": "ring", "world_size": 4, "params": 40_000,
           "link": {"name": "80mbit", "configured_bps": 8e7, "achieved_bps": 8e7}, "seed": 0,
           "scenario": {"name": "80mbit"}, "straggler": None, "compute_jitter_cv": 0.0,
           "step_time_median_s": 0.030,
           "phases_median_s": {"compute": 0.010, "apply": 0.001},
           "phases_mean_s": {"compute": 0.011, "compress": 0.001, "communicate": 0.012, "wait": 0.004,
                             "decompress": 0.0005, "apply": 0.001, "other": 0.0005},
           "idle_share": 0.1, "bytes_per_worker_step": 61_248, "staleness_mean": None}
    run.update(kw)
    return run


def test_validate_prices_the_recorded_index_layout(profile):
    # 20,000 elements (a compressed bucket), k = 200: int8 values payload 48 + 4 + 200 = 252;
    # int32 indices 800 bytes; Elias-Fano L = 6: ceil(1200 / 8) + ceil((200 + 19999 >> 6) / 8)
    # = 150 + 64 = 214 -> 216; payloads 48 + 800 + 252 and 48 + 216 + 252, + an 8-byte size
    fixed = _run(compressor="topk-int8-ef", algorithm="allgather", world_size=2, params=20_000,
                 bytes_per_worker_step=1108 + 3)
    compact = dict(fixed, bytes_per_worker_step=524 - 3)
    rows = validate_runs({"runs": [fixed, compact]}, profile)["rows"]
    assert [r["bytes"]["predicted"] for r in rows] == [1108, 524]


def test_validate_setting_of_an_async_run(profile):
    data = {"model": {"layers": [64, 384, 256, 10]}, "runs": []}
    assert _tensors({}, data) == 6 and _tensors({"param_tensors": 3}, data) == 3 and _tensors({}, {}) == 1
    run = _run(mode="async", world_size=5, workers=4, straggler={"rank": 1, "factor": 3.0})
    s = _setting(run, profile, Host(2), 6)
    # the world holds the server: 4 workers, 5 processes on the host; compute 10 ms is the
    # mean over workers, so the fast ones take 10 * 4 / (3 + 3) ms
    assert (s.nodes, s.ranks_per_host, s.tensors, s.apply_s) == (4, 5, 6, None)
    assert s.compute_s == pytest.approx(0.010 * 4 / 6)


def _synthetic(profile, truth: Host) -> dict:
    """Runs whose measured step and idle share are what the model predicts with ``truth``."""
    runs = []
    for seed in (0, 1):
        for comp, alg, compute in (("int8", "ring", 0.010), ("none", "ring", 0.020), ("int8", "ring", 0.030)):
            runs.append(_run(seed=seed, compressor=comp, algorithm=alg,
                             phases_median_s={"compute": compute * (1 + seed / 10), "apply": 0.001}))
    prof = Profile.from_dict({**profile.to_dict(), "host": truth.to_dict()})
    for run, row in zip(runs, validate_runs({"runs": runs}, prof)["rows"]):
        run["step_time_median_s"] = row["step_s"]["predicted"]
        run["idle_share"] = row["idle_share"]["predicted"]
    return {"runs": runs, "host": {"cores": 2}}


def test_fit_host_recovers_known_constants(profile):
    truth = Host(2, 2e-3, 0.3)
    data = _synthetic(profile, truth)
    host, info = fit_host(data, profile, [0], slices=[0.0, 1e-3, 2e-3, 3e-3], cvs=[0.0, 0.1, 0.2, 0.3, 0.4])
    assert host == truth and info["runs"] == 3 and info["seeds"] == [0]
    assert info["step_mdape_pct"] == pytest.approx(0.0, abs=1e-9)
    held = validate_runs({**data, "runs": [r for r in data["runs"] if r["seed"] == 1]},
                         Profile.from_dict({**profile.to_dict(), "host": host.to_dict()}))
    assert held["step_mdape_pct"] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="no run has a seed"):
        fit_host(data, profile, [7])
    with pytest.raises(ValueError, match="core count"):
        fit_host({"runs": data["runs"]}, profile, [0])


def test_validate_command_fits_and_breaks_down(tmp_path, capsys, profile):
    data = _synthetic(profile, Host(2, 2e-3, 0.3))
    data["profile"] = PROFILE
    (tmp_path / "results.json").write_text(json.dumps(data))
    out_json = tmp_path / "out.json"
    assert main(["plan", "validate", str(tmp_path), "--fit-seeds", "0", "--breakdown",
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "host fitted on seeds [0] (3 runs): 2 cores" in out
    assert "per group" in out and "80mbit sync int8" in out
    assert "on the runs not fitted (3)" in out
    saved = json.loads(out_json.read_text())
    assert saved["held_out"]["runs"] == 3 and saved["by_scenario"]["80mbit"]["runs"] == 6
    assert main(["plan", "validate", str(tmp_path), "--no-host"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("argv, words", [
    (["plan", "validate", ".", "--fit-seeds", "x"], "seeds"),
    (["plan", "validate", ".", "--host-cores", "0"], "cores"),
])
def test_bad_validate_arguments_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert words in err[-1]


def test_other_kernels_drop_the_measured_per_call_costs():
    from gradcomp.lab.plan.cli import _build, _profile

    base = ["--nodes", "4", "--link", "1gbit", "--params", "1M", "--compute-ms", "10"]
    assert _profile(_build("recommend").parse_args(base)).call_s  # the shipped profile's, measured on CPU
    roofline = _profile(_build("recommend").parse_args(base + ["--kernel-gbps", "1000"]))
    assert roofline.call_s == {} and roofline.seconds("int8.compress", 1e9) == pytest.approx(
        1e9 * (5 + 4 / 256) / 1e12)


def test_background_load_shares_the_cores(profile):
    kw = dict(nodes=2, link_bytes_per_s=1e7, params=40_000, compute_s=0.010, apply_s=0.001, host=Host(2, 2e-3, 0.0))
    quiet = Setting(**kw, ranks_per_host=2)
    busy = Setting(**kw, ranks_per_host=2, background_load=2.0)
    assert quiet.share() == 1.0 and busy.share() == 2.0 and busy.skew_s() == pytest.approx(2e-3)
    # 2 ranks, 20,000-element chunks (wire 48 + 4 * 79 + 20,000 = 20,364 bytes, 2.0364 ms):
    # one reduce-scatter and one allgather step; CPU work doubled by the background
    hop = 1e-4 + 20_364 / 1e7
    c, rc, d = 2 * 2e4 / 1e8, 2 * 2e4 / 5e7, 2 * 2e4 / 2e8
    assert predict("sync", "int8", "ring", busy, profile).step_s == pytest.approx(
        0.010 + (c + hop + rc) + (hop + d) + 0.001)
    with pytest.raises(ValueError, match="background_load"):
        Setting(**kw, background_load=-1.0)
    run = _run(host={"cores": 2, "background_load": 1.5})
    assert _setting(run, profile, Host(2)).runnable == 5.5
