"""gradcomp.lab.plan: the step-time model against hand-computed cases, calibration, validation, CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import torch
import pytest

from gradcomp.lab.cli import main
from gradcomp.lab.plan import calibrate as C
from gradcomp.lab.plan.lognormal import expected_max
from gradcomp.lab.plan.model import (CODECS, Setting, allreduce_bytes, async_throughput, bubble_fraction,
                                 pipeline_step, predict, ps_bytes)
from gradcomp.lab.plan.profile import OPS, Profile
from gradcomp.lab.units import parse_count, parse_rate
from gradcomp.lab.plan.validate import validate_runs

# ---- wire bytes ---------------------------------------------------------------------


def test_ring_bytes_by_hand():
    # 1001 elements over 4 ranks: chunks 251, 250, 250, 250; int8 chunk payload =
    # 48-byte header + 4 bytes of scale (one block) + one byte per element
    w0, w = 48 + 4 + 251, 48 + 4 + 250
    # rank 0: reduce-scatter sends chunks 3, 2, 1; allgather sends 0, 3, 2
    assert allreduce_bytes(CODECS["int8"], "ring", 1001, 4, 0) == (3 * w + (w0 + 2 * w),
                                                                  # receives 2, 1, 0 then 3, 2, 1
                                                                  (w0 + 2 * w) + 3 * w)
    # rank 1 sends 0, 3, 2 then 1, 0, 3 and receives 3, 2, 1 then 0, 3, 2
    assert allreduce_bytes(CODECS["int8"], "ring", 1001, 4, 1) == ((w0 + 2 * w) + (w0 + 2 * w),
                                                                  3 * w + (w0 + 2 * w))
    # float32 chunks: 48 + 4 * len
    r0 = 48 + 4 * 251
    r = 48 + 1000
    assert allreduce_bytes(CODECS["none"], "ring", 1001, 4, 0) == (3 * r + (r0 + 2 * r), (r0 + 2 * r) + 3 * r)


def test_two_phase_bytes_by_hand():
    w0, w = 48 + 4 + 251, 48 + 4 + 250
    # sends chunks 1, 2, 3 to their owners, then its own chunk 0 around the ring
    # (forwarding 3 and 2): the ring's bytes sent; receives three payloads of chunk 0
    assert allreduce_bytes(CODECS["int8"], "two_phase", 1001, 4, 0) == (3 * w + (w0 + 2 * w), 3 * w0 + 3 * w)
    assert allreduce_bytes(CODECS["int8"], "two_phase", 1001, 4, 2) == ((w0 + 2 * w) + (w0 + 2 * w),
                                                                       3 * w + (w0 + 2 * w))


def test_matches_the_recorded_study_bytes():
    # README's default study: 126,090 parameters, 4 workers, bytes sent per worker
    # per step as the TrafficMeter counted them (mean over the 4 workers)
    for name, alg, measured in (("none", "ring", 756_828), ("fp16", "ring", 378_558),
                                ("int8", "ring", 192_399), ("topk-ef", "allgather", 19_500),
                                ("topk-int8-ef", "allgather", 8_211)):
        sent = [allreduce_bytes(CODECS[name], alg, 126_090, 4, r)[0] for r in range(4)]
        assert sum(sent) / 4 == measured, name


def test_sparse_allgather_grows_with_world_size():
    # top-k 1% of 10,000: k = 100; indices Elias-Fano coded (smaller than 400 bytes of
    # int32): L = floor(log2(10000 / 100)) = 6 low bits, ceil(100 * 6 / 8) = 75 bytes, then
    # ceil((100 + (9999 >> 6)) / 8) = 32 bytes of unary high parts: 107, padded to 112;
    # payload = header 48 + 112 + nested raw values (48 + 400); each rank forwards
    # N - 1 payloads plus N - 1 sizes
    p = 48 + 112 + 48 + 400
    for n in (2, 4, 8, 64):
        assert allreduce_bytes(CODECS["topk-ef"], "allgather", 10_000, n) == ((n - 1) * (p + 8),) * 2
    dense = [allreduce_bytes(CODECS["int8"], "ring", 10**6, n)[0] for n in (8, 64, 512)]
    sparse = [allreduce_bytes(CODECS["topk-int8-ef"], "allgather", 10**6, n)[0] for n in (8, 64, 512)]
    assert dense[2] < 1.2 * dense[0]  # the ring's 2 (N - 1) / N stays flat
    assert sparse[2] > 60 * sparse[0]  # the allgather's N - 1 grows


def test_ps_bytes_by_hand():
    # 2 servers, 4 tensors of 1000 elements: each shard pushes one ZeroMQ message,
    # an 80-byte header frame (+ 2 bytes of ZMTP frame header) and a data frame
    # (+ 9): an 8 + 2 * 8 byte size table and two int8 payloads (48 + 16 + 1000)
    b = ps_bytes(CODECS["int8"], 4000, servers=2, tensors=4, compress_pull=False)
    push_shard = 82 + 9 + 8 + 16 + 2 * (48 + 16 + 1000)
    pull_shard = 82 + 9 + 8 + 16 + 2 * (48 + 4000)
    assert (b["push"], b["pull"], b["push_shard"]) == (2 * push_shard, 2 * pull_shard, push_shard)
    assert b["sent"] == 2 * push_shard + 2 * 82  # + the pull requests
    assert b["received"] == 2 * pull_shard + 2 * 82  # + the push replies


@pytest.mark.slow
def test_bytes_match_the_meter_of_real_collectives():
    from gradcomp.launch import launch

    out = launch(_metered_allreduces, 3, timeout=120)
    for rank, got in enumerate(out):
        for (name, alg, n), (sent, received) in got.items():
            assert allreduce_bytes(CODECS[name], alg, n, 3, rank) == (sent, received), (name, alg, n, rank)


def _metered_allreduces(rank, world_size):
    import torch

    import gradcomp as gc

    codecs = {"none": gc.NoCompression(), "fp16": gc.FP16(), "int8": gc.Int8Quantizer(),
              "topk-int8-ef": gc.TopK(ratio=0.01, values=gc.Int8Quantizer())}
    got = {}
    for name, alg, n in (("none", "ring", 1001), ("fp16", "two_phase", 777), ("int8", "ring", 5000),
                         ("int8", "two_phase", 5000), ("topk-int8-ef", "allgather", 3000),
                         ("int8", "halving_doubling", 5000), ("none", "halving_doubling", 1001),
                         ("topk-int8-ef", "sparse_reduce_scatter", 3000)):
        meter = gc.TrafficMeter()
        gc.allreduce(torch.randn(n), codecs[name], algorithm=alg, meter=meter, check=False)
        got[(name, alg, n)] = (meter.bytes_sent, meter.bytes_received)
    return got


# ---- stragglers, pipeline -----------------------------------------------------------


@pytest.mark.parametrize("n, cv", [(16, 0.3), (1024, 0.2), (8, 1.0)])
def test_expected_max_against_monte_carlo(n, cv):
    sigma = math.sqrt(math.log(1 + cv * cv))
    x = np.exp(np.random.default_rng(1).normal(-sigma * sigma / 2, sigma, size=(8000, n))).max(axis=1)
    se = x.std() / math.sqrt(len(x))
    assert abs(expected_max([1.0] * n, cv) - x.mean()) < 4 * se


def test_expected_max_with_a_straggler():
    # factor 3 on one of 16, tiny jitter: the straggler is the maximum
    assert expected_max({1.0: 15, 3.0: 1}, 0.01) == pytest.approx(3.0, rel=0.01)
    assert expected_max([2.0, 5.0], 0.0) == 5.0
    rng = np.random.default_rng(2)
    sigma = math.sqrt(math.log(1 + 0.5**2))
    draws = np.exp(rng.normal(-sigma**2 / 2, sigma, size=(40000, 4))) * np.array([1, 1, 1, 2.0])
    assert expected_max({1.0: 3, 2.0: 1}, 0.5) == pytest.approx(draws.max(axis=1).mean(), rel=0.01)


def test_bubble_fraction():
    assert bubble_fraction(4, 8) == 3 / 11
    assert bubble_fraction(1, 5) == 0.0
    g = pipeline_step(1.0, 4, 8, "gpipe")
    assert g["step_s"] == pytest.approx(11 * 1.0 / 32)  # 11 slots of 1 / (4 * 8)
    assert g["efficiency"] == pytest.approx(8 / 11)
    assert (g["peak_microbatches"], pipeline_step(1.0, 4, 8, "1f1b")["peak_microbatches"]) == (8, 4)
    # boundary time: forward and backward passes as flow shops (forward 1/3 of the compute)
    # compute-bound: f = 0.4 / 8, g = 0.8 / 8, each way 0.04 s per micro-batch
    assert pipeline_step(1.2, 2, 4, boundary_s=0.08)["step_s"] == pytest.approx(
        (2 * 0.05 + 0.04 + 3 * 0.05) + (2 * 0.1 + 0.04 + 3 * 0.1))
    # link-bound: f = 0.005, g = 0.01, each way 0.1 s: the link's 4 transfers set the pace
    lb = pipeline_step(0.12, 2, 4, boundary_s=0.2)
    assert lb["step_s"] == pytest.approx((0.01 + 0.1 + 0.3) + (0.02 + 0.1 + 0.3))
    assert lb["bubble"] == pytest.approx(1 - 0.06 / 0.83)
    with pytest.raises(ValueError, match="microbatches"):
        bubble_fraction(4, 0)


# ---- calibration ---------------------------------------------------------------------


def test_fit_recovers_alpha_beta_from_synthetic_timings():
    alpha, beta = 75e-6, 1.25e8  # 1 Gbit/s
    sizes = np.array(C.sizes_for(beta), dtype=float)
    t = alpha + sizes / beta + np.random.default_rng(0).normal(0, 1e-6, size=len(sizes))  # 1 us jitter
    a, b, info = C.fit_alpha_beta(sizes, t)
    assert a == pytest.approx(alpha, rel=0.05)
    assert b == pytest.approx(beta, rel=0.01)
    assert info["r2"] > 0.999
    exact = C.fit_alpha_beta([8, 1000, 10**6], [alpha + 8 / beta, alpha + 1000 / beta, alpha + 1e6 / beta])
    assert exact[:2] == pytest.approx((alpha, beta), rel=1e-9)


def test_fit_takes_the_latency_from_the_smallest_message():
    """One-way times recorded on the emulated 1 Gbit link (tbf), 8 B to 12.5 MB:
    the least-squares intercept comes out at -0.26 ms, yet 8 bytes take
    0.64 ms: alpha is the smallest message's time, beta the line's slope."""
    sizes = [8, 195312, 781250, 3125000, 6250000, 12500000]
    t = [0.000638583, 0.000838047, 0.005683406, 0.024812455, 0.050014485, 0.100467929]
    ols_intercept = np.polyfit(sizes, t, 1)[1]
    assert ols_intercept < 0
    a, b, info = C.fit_alpha_beta(sizes, t)
    assert 0.5 * t[0] < a <= t[0]
    assert b == pytest.approx(1.25e8, rel=0.03)  # 1 Gbit/s
    assert "alpha_clamped_from_s" not in info
    assert info["line_intercept_s"] < 0
    # relative noise of 5% on a known line: recovered within its noise
    alpha, beta = 5e-4, 1.25e8
    x = np.array(sizes, dtype=float)
    noisy = (alpha + x / beta) * (1 + 0.05 * np.random.default_rng(1).standard_normal(len(x)))
    a, b, _ = C.fit_alpha_beta(x, noisy)
    assert a == pytest.approx(alpha, rel=0.15) and b == pytest.approx(beta, rel=0.1)


def test_fit_rejects_times_that_do_not_grow():
    with pytest.raises(ValueError, match="do not grow"):
        C.fit_alpha_beta([10, 20, 30], [3.0, 2.0, 1.0])
    with pytest.raises(ValueError, match="two distinct"):
        C.fit_alpha_beta([10, 10], [1.0, 1.0])


def test_kernel_timing_interleaves_the_ops_round_by_round(monkeypatch):
    # each round times every op once, so a burst of load from other jobs hits every op alike
    calls, clock = [], iter(range(100))
    monkeypatch.setattr(C.time, "perf_counter", lambda: float(next(clock)))
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    ticks = []
    medians = C._median_times(fns, 3, tick=lambda: ticks.append(len(calls)))
    assert calls == ["a", "b", "c"] + ["a", "b", "c"] * 3  # warm-ups, then 3 interleaved rounds
    assert ticks == [0, 1, 2]  # one tick per op, before its warm-up
    # the fake clock advances 1 per read: every timing is 1 s
    assert medians == {"a": 1.0, "b": 1.0, "c": 1.0}


def test_kernel_timing_times_each_codec_with_its_own_compressor():
    import gradcomp as gc

    x, y, acc = torch.randn(512), torch.empty(512), torch.zeros(512)
    thunks = {**C._codec_thunks("fp16", gc.FP16(), x, y, acc), **C._codec_thunks("int8", gc.Int8Quantizer(), x, y, acc)}
    thunks["fp16.decompress"]()
    assert torch.equal(y, x.half().float())  # fp16's thunk decodes fp16, not the last codec built
    thunks["int8.decompress"]()
    assert not torch.equal(y, x.half().float()) and (y - x).abs().max() <= x.abs().max() / 127


@pytest.mark.slow
def test_calibrate_on_loopback_writes_a_profile(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["plan", "calibrate", "--out", str(out), "--repeats", "1", "--kernel-numel", "65536"]) == 0
    prof = Profile.load(str(out))
    assert prof.alpha_s > 0 and prof.beta_bytes_per_s > 0 and prof.link == "none"
    assert set(prof.kernels) == set(OPS) and len(prof.fit["sizes"]) == len(C.DEFAULT_SIZES)
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow
def test_calibrate_two_tier_measures_both_tiers(tmp_path, capsys):
    from gradcomp.lab.cluster import requirements_missing

    if requirements_missing() is not None:
        pytest.skip(f"emulated cluster unavailable: {requirements_missing()}")
    out = tmp_path / "profile.json"
    assert main(["plan", "calibrate", "--link", "1gbit", "--topology", "2x2", "--intra-link", "400mbit",
                 "--out", str(out), "--repeats", "1", "--kernel-numel", "65536"]) == 0
    prof = Profile.load(str(out))
    assert prof.topology == "2x2" and prof.link == "1gbit" and prof.intra["link"] == "400mbit"
    # each tier's fitted bandwidth near its rate (TCP payload of a tbf-shaped layer-2 rate)
    assert 0.7 < prof.beta_bytes_per_s / 125e6 < 1.1, prof.beta_bytes_per_s
    assert 0.7 < prof.intra["beta_bytes_per_s"] / 50e6 < 1.1, prof.intra
    cluster = prof.source["cluster"]
    assert cluster["configured_bps"] == 10**9 and cluster["intra"]["configured_bps"] == 4 * 10**8
    assert cluster["achieved_bps"] > 0 and cluster["intra"]["achieved_bps"] > 0
    assert "intra-host (2x2)" in capsys.readouterr().out


def test_kernel_rates_from_kernels_json(tmp_path):
    def row(op, name, n, median, kind="backend", **kw):
        return {"device": "cpu", "threads": "all", "op": op, "n": n, "dtype": "float32", "density": None,
                "k": None, "name": name, "kind": kind, "median_s": median, **kw}
    rows = [row("quantize_int8", "cpu", 2**20, 1e-3), row("quantize_int8", "reference", 2**20, 4e-3),
            row("quantize_int8", "cpu", 2**16, 1e-5),  # a smaller size: not used
            row("dequantize_int8_add_", "cpu", 2**20, 2e-3),
            row("scatter_add_", "cpu", 2**20, 1e-4, density=0.01, k=10486),
            row("copy", "copy", 2**20, 1e-3, kind="baseline", gbps=8.0),
            dict(row("quantize_int8", "cpu", 2**20, 1e-9), threads="1")]  # another thread setting
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"rows": rows}))
    k = Profile.from_kernels_json(str(path)).kernels
    assert k["int8.compress"] == pytest.approx(2**20 / 1e-3)
    assert k["int8.decompress_add"] == pytest.approx(2**20 / 2e-3)
    assert k["int8.reduce_compress"] == pytest.approx(2**20 / 3e-3)  # dequantize-add, then quantize
    assert k["sparse.decompress_add"] == pytest.approx(10486 / 1e-4)
    assert k["fp16.compress"] == pytest.approx(8e9 / 6)  # copy bandwidth / (4 read + 2 written) bytes
    with pytest.raises(ValueError, match="no float32 rows"):
        Profile.from_kernels_json(str(path), device="cuda")


# ---- predictions of a small recorded profile --------------------------------------------

RATES = {"compress": 1e8, "reduce_compress": 5e7, "decompress": 2e8, "decompress_add": 1e8}
PROFILE = {"version": 1, "alpha_s": 1e-4, "beta_bytes_per_s": None, "link": "none",
           "kernels": {f"{c}.{op}": r for c in ("raw", "int8") for op, r in RATES.items()}}


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return Profile.load(str(path))


def test_sync_ring_step_by_hand(profile):
    s = Setting(nodes=4, link_bytes_per_s=1e7, params=40_000, compute_s=0.010, apply_s=0.001)
    p = predict("sync", "int8", "ring", s, profile)
    # one bucket (under DDP's first 1 MiB), chunks of 10,000: wire 48 + 4 * 40 + 10,000
    hop = 1e-4 + 10_208 / 1e7
    c, rc, d = 10_000 / 1e8, 10_000 / 5e7, 10_000 / 2e8
    allreduce = (c + 3 * hop + 3 * rc) + (hop + 2 * max(hop, d) + d)
    assert p.exposed_comm_s == pytest.approx(allreduce)  # the only bucket is ready when backward ends
    assert p.step_s == pytest.approx(0.010 + allreduce + 0.001)
    assert p.comm_share == pytest.approx(allreduce / p.step_s)
    assert p.bytes_sent == 6 * 10_208 and p.idle_share == 0.0


def test_overlap_hides_early_buckets(profile):
    # 3 buckets of 100,000 elements: the first two reduce during backward
    s = Setting(nodes=2, link_bytes_per_s=1e9, params=300_000, compute_s=0.3, apply_s=0.0,
                backward_share=1.0, bucket_bytes=400_000, first_bucket_bytes=400_000)
    p = predict("sync", "none", "ring", s, profile)
    # N = 2: one hop each way of 50,000 float32 + 48 bytes
    hop = 1e-4 + (48 + 200_000) / 1e9
    one = (50_000 / 1e8 + hop + 50_000 / 5e7) + (hop + 50_000 / 2e8)
    assert one < 0.1  # each bucket's reduction finishes before the next is ready
    assert p.exposed_comm_s == pytest.approx(one)


def test_stragglers_and_idle_share(profile):
    base = dict(nodes=4, link_bytes_per_s=1e7, params=40_000, compute_s=0.010, apply_s=0.001)
    p = predict("sync", "none", "ring", Setting(**base, straggler_factor=2.0), profile)
    # the straggler computes 20 ms, the others 10: mean 12.5 ms, wait 7.5 ms on average
    hop = 1e-4 + (48 + 40_000) / 1e7
    allreduce = (1e-4 + 3 * hop + 3 * 2e-4) + (3 * hop + 5e-5)
    assert p.step_s == pytest.approx(0.020 + allreduce + 0.001)
    assert p.wait_s == pytest.approx(0.0075)
    assert p.idle_share == pytest.approx(0.0075 / p.step_s)


def test_async_server_bound_and_staleness(profile):
    # compute-bound: a worker's cycle is its compute; staleness -> N - 1 updates
    s = Setting(nodes=8, link_bytes_per_s=1e12, params=1000, compute_s=1.0, apply_s=0.0, alpha_s=1e-9)
    p = async_throughput(CODECS["none"], s, profile)
    assert p.throughput == pytest.approx(8.0, rel=1e-3)
    assert p.staleness_mean == pytest.approx(7.0, rel=1e-3)
    # server-bound: one server, its link takes one push shard per push_shard / beta seconds
    s = Setting(nodes=8, link_bytes_per_s=1e6, params=250_000, compute_s=1e-3, apply_s=0.0)
    p = async_throughput(CODECS["int8"], s, profile)
    push = 82 + 9 + 8 + 8 + 48 + 4 * 977 + 250_000  # header frame and framed data frame: the bundle
    # a closed queue of 8 workers: the throughput approaches 1 / D from below
    assert p.throughput == pytest.approx(1e6 / push, rel=1e-4) and p.throughput < 1e6 / push
    assert "server-bound" in p.notes


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="nodes"):
        Setting(nodes=0, link_bytes_per_s=1e9, params=10, compute_s=1.0)
    with pytest.raises(ValueError, match="straggler_factor"):
        Setting(nodes=2, link_bytes_per_s=1e9, params=10, compute_s=1.0, straggler_factor=0.5)
    s = Setting(nodes=2, link_bytes_per_s=1e9, params=10, compute_s=1.0)
    with pytest.raises(ValueError, match="algorithm"):
        predict("sync", "topk-ef", "ring", s, Profile())
    with pytest.raises(ValueError, match="unknown compressor"):
        predict("sync", "gzip", "ring", s, Profile())
    with pytest.raises(ValueError, match="unknown kernel op"):
        Profile(kernels={"int9.compress": 1.0})


def test_units():
    assert parse_count("25M") == 25_000_000 and parse_count("7B") == 7 * 10**9
    assert parse_rate("10gbit") == 1e10 and parse_rate("100mbit") == 1e8  # bits per second
    for bad in ("10gbps", "-1gbit", "fast"):
        with pytest.raises(ValueError, match="link"):
            parse_rate(bad)


# ---- validate ------------------------------------------------------------------------


def _run(**kw):
    run = {"mode": "sync", "compressor": "int8", "algorithm": "ring", "world_size": 4, "params": 40_000,
           "batch_size": 64, "link": {"name": "80mbit", "configured_bps": 8e7, "achieved_bps": 8e7},
           "straggler": None, "compute_jitter_cv": 0.0, "steps": 100, "step_time_median_s": 0.020,
           "step_time_p95_s": 0.025,
           "phases_median_s": {"compute": 0.010, "compress": 0.001, "communicate": 0.008,
                               "exposed_comm": 0.008, "wait": 0.0, "apply": 0.001},
           "idle_share": 0.01, "exposed_comm_share": 0.4, "bytes_per_worker_step": 61_248,
           "staleness_mean": None}
    run.update(kw)
    return run


def _results(tmp_path):
    runs = [_run(),
            _run(compressor="none", straggler={"rank": 1, "factor": 2.0}, step_time_median_s=0.050,
                 phases_median_s={"compute": 0.0125, "apply": 0.001}, idle_share=0.2),
            _run(mode="local")]
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs, "profile": PROFILE}))
    return tmp_path


def test_validate_against_hand_computed_predictions(tmp_path, profile):
    out = validate_runs(json.loads((_results(tmp_path) / "results.json").read_text()), profile)
    hop = 1e-4 + 10_208 / 1e7
    int8_step = 0.010 + (1e-4 + 3 * hop + 3 * 2e-4) + (3 * hop + 5e-5) + 0.001
    hop = 1e-4 + 40_048 / 1e7
    none_step = 0.020 + (1e-4 + 3 * hop + 3 * 2e-4) + (3 * hop + 5e-5) + 0.001
    a, b = out["rows"]
    assert a["step_s"]["predicted"] == pytest.approx(int8_step)
    assert a["step_error_pct"] == pytest.approx(100 * (int8_step - 0.020) / 0.020)
    assert a["bytes"]["predicted"] == 61_248
    # compute 12.5 ms is the mean over workers: the fast ones take 12.5 * 4 / 5 = 10 ms
    assert b["step_s"]["predicted"] == pytest.approx(none_step)
    assert b["idle_share"]["predicted"] == pytest.approx(0.0075 / none_step)
    errors = sorted(abs(100 * (p - m) / m) for p, m in ((int8_step, 0.020), (none_step, 0.050)))
    assert out["step_mdape_pct"] == pytest.approx(sum(errors) / 2)
    assert out["skipped"][0][1] == "mode 'local' is not modelled by validate"


def test_validate_reads_threshold_density_from_bytes(profile):
    # 2 ranks, 40,000 elements, threshold kept k = 1000: Elias-Fano indices with
    # L = floor(log2(40)) = 5: ceil(5000 / 8) = 625 + ceil((1000 + (39999 >> 5)) / 8) = 282
    # bytes = 907, padded to 912; payload 48 + 912 + 48 + 4000 bytes, + an 8-byte size
    run = _run(compressor="threshold-ef", algorithm="allgather", world_size=2,
               bytes_per_worker_step=5008 + 8)
    out = validate_runs({"runs": [run]}, profile)
    assert out["rows"][0]["bytes"]["predicted"] == 5008 + 8


def test_validate_command(tmp_path, capsys):
    d = _results(tmp_path)
    saved = tmp_path / "validated.json"
    assert main(["plan", "validate", str(d), "--save-profile", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "median absolute error: step time" in out and "over 2 runs" in out
    assert Profile.load(str(saved)).fit["validation_runs"] == 2
    assert main(["plan", "recommend", "--nodes", "4", "--link", "80mbit", "--params", "40000",
                 "--compute-ms", "10", "--profile", str(saved)]) == 0
    assert "median step-time error" in capsys.readouterr().out


# ---- command line --------------------------------------------------------------------


def test_projection_and_recommend_commands(tmp_path, capsys):
    assert main(["plan", "--nodes", "16,64", "--link", "10gbit", "--params", "25M", "--compute-ms", "50",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert [r["nodes"] for r in rows] == [16, 64] and (tmp_path / "plan.png").stat().st_size > 10_000
    assert main(["plan", "recommend", "--nodes", "64", "--link", "1gbit", "--params", "1B",
                 "--compute-ms", "200", "--alpha-us", "20", "--kernel-gbps", "1000"]) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "runner-up: " in out and "no compression: sync none on ring" in out
    assert "stays first in" in out


@pytest.mark.parametrize("argv, words", [
    (["plan", "--nodes", "0"], "--nodes"),
    (["plan", "--link", "10gbps"], "--link"),
    (["plan", "--params", "-5"], "--params"),
    (["plan", "--straggler-cv", "-1"], "--straggler-cv"),
    (["plan", "recommend", "--nodes", "8", "--link", "1gbit", "--params", "1B"], "--compute-ms"),
    (["plan", "recommend", "--nodes", "8", "--link", "1gbit", "--params", "1B", "--compute-ms", "1",
      "--max-gap", "x"], "--max-gap"),
    (["plan", "calibrate", "--link", "fast"], "--link"),
    (["plan", "calibrate", "--topology", "2"], "--topology"),
    (["plan", "calibrate", "--topology", "1x4", "--link", "1gbit"], "--topology"),
    (["plan", "calibrate", "--topology", "2x2"], "--topology"),
    (["plan", "validate", "/nonexistent/dir"], "results /nonexistent/dir: no such file or directory"),
    (["plan", "validate", "/"], "results / holds no results.json"),
    (["plan", "--profile", "/nonexistent.json"], "No such file"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, words):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert words in err and err.count("\n") == 1


def test_calibrate_link_without_cluster_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradcomp.lab.cluster", None)  # import fails
    assert main(["plan", "calibrate", "--link", "1gbit"]) == 2
    err = capsys.readouterr().err
    assert "gradcomp.lab.cluster" in err and err.count("\n") == 1


@pytest.mark.slow
def test_plan_does_not_import_train_or_cluster():
    code = ("import sys, gradcomp.lab.plan, gradcomp.lab.plan.cli, gradcomp.lab.plan.validate, gradcomp.lab.plan.recommend; "
            "bad = [m for m in sys.modules if m.startswith(('gradcomp.lab.study', 'gradcomp.lab.cluster'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ---- halving-doubling and the sparse reduce-scatter ---------------------------------------

def _int8_wire(m):
    return 48 + 4 * -(-m // 256) + m  # header, one float32 scale per 256, a code per element


def test_halving_doubling_bytes_by_hand():
    # p = N = 8, n = 8 * 256 * 4: every half and chunk a whole number of blocks, and of 8 bytes.
    # Halving sends W(n/2) + W(n/4) + W(n/8), doubling W(n/8) + 2 W(n/8) + 4 W(n/8)
    n = 8 * 1024
    c = CODECS["int8"]
    sent = _int8_wire(n // 2) + _int8_wire(n // 4) + _int8_wire(n // 8) + 7 * _int8_wire(n // 8)
    for rank in range(8):
        assert allreduce_bytes(c, "halving_doubling", n, 8, rank) == (sent, sent)
    # the ring's data bytes (14 chunks of n / 8) in 10 payloads instead of 14: 4 headers fewer
    assert sent == allreduce_bytes(c, "ring", n, 8, 0)[0] - 4 * 48
    # N = 3: p = 2, rank 0 folded into rank 1; rank 2 and rank 1 halve and double once
    w_half = _int8_wire(n // 2)
    assert allreduce_bytes(c, "halving_doubling", n, 3, 0) == (_int8_wire(n), 2 * w_half)
    assert allreduce_bytes(c, "halving_doubling", n, 3, 1) == (2 * w_half + 2 * w_half, 2 * w_half + _int8_wire(n))
    assert allreduce_bytes(c, "halving_doubling", n, 3, 2) == (2 * w_half, 2 * w_half)


def test_halving_doubling_pads_each_owners_payload_to_8_bytes():
    # n = 4 * 1001 elements over p = 4: chunks of 1001, wire 48 + 16 + 1001 = 1065 -> 1072 in the doubling
    c = CODECS["int8"]
    n = 4 * 1001
    halving = _int8_wire(2002) + _int8_wire(1001)
    assert allreduce_bytes(c, "halving_doubling", n, 4, 0)[0] == halving + 1072 + 2 * 1072


def _topk_int8_wire(m, density=0.01):
    k = math.ceil(density * m)
    b = (m // k).bit_length() - 1
    index = min(-(-4 * k // 8) * 8, -(-(-(-k * b // 8) + -(-(k + ((m - 1) >> b)) // 8)) // 8) * 8)
    return 48 + index + 48 + 4 * -(-k // 256) + k


def test_sparse_reduce_scatter_bytes_by_hand():
    # N - 1 region payloads in each phase; regions of n / N elements
    c = CODECS["topk-int8-ef"]
    for world in (2, 4, 8):
        n = 2**20
        w = _topk_int8_wire(n // world)
        assert allreduce_bytes(c, "sparse_reduce_scatter", n, world, 0) == (2 * (world - 1) * w,) * 2
        whole = _topk_int8_wire(n)
        assert allreduce_bytes(c, "allgather", n, world, 0)[0] == (world - 1) * (whole + 8)
        # bytes per rank stay under twice one payload, within 10% of 2 (N - 1) / N of it
        assert 2 * (world - 1) * w < 2 * whole
        assert 2 * (world - 1) * w == pytest.approx(2 * (world - 1) / world * whole, rel=0.10)
    with pytest.raises(ValueError, match="algorithm for threshold-ef"):
        allreduce_bytes(CODECS["threshold-ef"], "sparse_reduce_scatter", 1000, 4)


def test_messages_and_quantizations():
    from gradcomp.lab.plan.model import allreduce_messages, quantizations

    assert [allreduce_messages("ring", n) for n in (1, 2, 8, 1024)] == [0, 2, 14, 2046]
    assert [allreduce_messages("halving_doubling", n) for n in (2, 4, 8, 1024)] == [2, 4, 6, 20]
    # N = 6: p = 4, ranks 0 and 2 folded into 1 and 3
    assert [allreduce_messages("halving_doubling", 6, r) for r in range(6)] == [1, 5, 1, 5, 4, 4]
    assert allreduce_messages("sparse_reduce_scatter", 8) == allreduce_messages("allgather", 8) == 14
    assert [quantizations("ring", n) for n in (2, 8)] == [2, 8]
    assert [quantizations("halving_doubling", n) for n in (2, 3, 8, 1024)] == [2, 3, 4, 11]
    assert quantizations("sparse_reduce_scatter", 8) == 2 and quantizations("two_phase", 8) == 2
    with pytest.raises(ValueError, match="algorithm must be one of"):
        quantizations("ps", 4)


def test_halving_doubling_seconds_by_hand(profile):
    # N = 4, n = 40,000, int8: L = 10,000 per chunk; two halving steps, the owner's
    # reduce-compress, two doubling steps (the first block decoded during the second)
    from gradcomp.lab.plan.model import allreduce_seconds

    alpha, beta = 1e-4, 1e7
    c, da, rc, d = 1 / 1e8, 1 / 1e8, 1 / 5e7, 1 / 2e8  # seconds per element
    hop = lambda m: alpha + m / beta  # noqa: E731
    w = _int8_wire
    halving = (20_000 * c + hop(w(20_000)) + 20_000 * da) + (10_000 * c + hop(w(10_000))) + 10_000 * rc
    doubling = hop(w(10_000)) + max(hop(2 * w(10_000)), 10_000 * d) + 2 * 10_000 * d
    t = allreduce_seconds(CODECS["int8"], "halving_doubling", 40_000, 4, alpha, beta, profile)
    assert t["total"] == pytest.approx(halving + doubling)
    assert t["transfer"] == pytest.approx(hop(w(20_000)) + hop(w(10_000)) + hop(w(10_000)) + hop(2 * w(10_000)))
    # the latency term: 2 log2 N messages on the path, against the ring's 2 (N - 1)
    for world in (2, 8, 64, 1024):
        hd = allreduce_seconds(CODECS["none"], "halving_doubling", 0 + 4096, world, 1.0, 1e30, Profile())
        ring = allreduce_seconds(CODECS["none"], "ring", 4096, world, 1.0, 1e30, Profile())
        assert hd["total"] == pytest.approx(2 * math.log2(world))
        assert ring["total"] == pytest.approx(2 * (world - 1))
    # N = 3: the fold in and out add one message each on the path
    assert allreduce_seconds(CODECS["none"], "halving_doubling", 4096, 3, 1.0, 1e30, Profile())["total"] == \
        pytest.approx(4.0)


def test_sparse_reduce_scatter_seconds_by_hand(tmp_path):
    from gradcomp.lab.plan.model import allreduce_seconds

    prof = Profile(alpha_s=1e-4, kernels={"topk.select": 1e8, "int8.compress": 1e8, "ef.update": 1e9,
                                          "sparse.decompress_add": 1e7, "int8.decompress": 1e8})
    alpha, beta, world, n = 1e-4, 1e7, 4, 400_000
    L, k = 100_000, 1000
    comp = L / 1e8 + k / 1e8 + L / 1e9  # select, int8 values, error feedback
    da = k / 1e7 + k / 1e8  # scatter-add of the kept values, their int8 decode
    w = _topk_int8_wire(L)
    hop = alpha + w / beta
    rs = 3 * comp + 3 * alpha + 3 * w / beta + 3 * da + comp
    ag = hop + 2 * max(hop, da) + da
    t = allreduce_seconds(CODECS["topk-int8-ef"], "sparse_reduce_scatter", n, world, alpha, beta, prof)
    assert t["total"] == pytest.approx(rs + ag)
    assert t["transfer"] == pytest.approx(3 * alpha + 3 * w / beta + 3 * hop)


def test_projection_prices_the_new_algorithms():
    # the projection's candidates include both; at 1024 nodes with a per-message cost,
    # halving-doubling's 20 messages beat the ring's 2046
    from gradcomp.lab.plan.project import project

    prof = Profile(alpha_s=50e-6, kernels={op: 1e10 for op in ("int8.compress", "int8.reduce_compress",
                                                              "int8.decompress", "int8.decompress_add")})
    rows = project([1024], [("10gbit", 1.25e9)], [10**8], prof, compute_s=0.1)
    sync = rows[0]["sync"]
    assert {"int8/halving_doubling", "topk-int8-ef/sparse_reduce_scatter"} <= set(sync)
    assert sync["int8/halving_doubling"]["step_s"] < sync["int8/ring"]["step_s"]
    assert sync["topk-int8-ef/sparse_reduce_scatter"]["bytes_sent"] < sync["topk-int8-ef/allgather"]["bytes_sent"] / 100


def test_two_tier_model_bytes_and_time():
    from gradcomp.comm.chunks import chunk_bounds
    from gradcomp.lab.plan.model import CODECS
    from gradcomp.lab.plan.tiers import hierarchical_bytes, hierarchical_seconds

    # NoCompression, one segment: the hand formula of tests/test_hierarchical.py (48-byte headers)
    n, hosts, per = 3 * 4096 + 7, 2, 2
    got = hierarchical_bytes(CODECS["none"], n, hosts, per, segments=1)
    inter = 0
    for local in range(per):
        lo, hi = chunk_bounds(n, per)[local]
        lens = [b - a for a, b in chunk_bounds(hi - lo, hosts)]
        inter += sum(48 + 4 * k for j, k in enumerate(lens) if j != 0) + sum(
            48 + 4 * k for j, k in enumerate(lens) if j != 1)
    s0 = chunk_bounds(n, per)[0][1]
    assert got == {"inter_host_per_host": inter,
                   "intra_host_per_rank": 4 * (n - s0) + (per - 1) * (hosts * 48 + 4 * s0)}
    # int8, 2 x 4, 2**24: per host 2 (H - 1) / H of the compressed bucket, within 0.1%
    int8 = CODECS["int8"]
    bucket = int8.compressor(2**24).wire_nbytes((2**24,))
    per_host = hierarchical_bytes(int8, 2**24, 2, 4)["inter_host_per_host"]
    assert abs(per_host / bucket - 1.0) < 1e-3
    # time: the inter-host leg shares the host's link; pipelining hides the shorter stage
    prof = Profile(alpha_s=1e-4, beta_bytes_per_s=12.5e6, kernels={op: 1e9 for op in OPS},
                   intra={"alpha_s": 5e-5, "beta_bytes_per_s": 5e8})
    one = hierarchical_seconds(int8, 2**24, 2, 4, prof, segments=1)
    four = hierarchical_seconds(int8, 2**24, 2, 4, prof, segments=4)
    assert one["total"] == pytest.approx(one["intra"] + one["inter"])
    assert max(four["inter"], four["intra"]) < four["total"] < one["total"]
    # the link's bytes over its rate bound the inter-host leg from below
    assert one["inter"] > per_host / prof.beta_bytes_per_s
    fast = hierarchical_seconds(int8, 2**24, 2, 4, Profile(alpha_s=1e-4, beta_bytes_per_s=125e6,
                                                             kernels=prof.kernels, intra=prof.intra))
    assert fast["inter"] < one["inter"] / 5
