"""gradcomp.lab.plan on two tiers: the hierarchical, halving-doubling and sparse reduce-scatter
steps against formulas derived by hand, and validate on a two-tier results file (adaptive rows,
algorithm ``auto``)."""

from __future__ import annotations

import math
import statistics

import pytest

from gradcomp.lab.plan.costs import allreduce_seconds
from gradcomp.lab.plan.model import CODECS, Setting, predict
from gradcomp.lab.plan.profile import OPS, Profile
from gradcomp.lab.plan.schedule import run_schedule
from gradcomp.lab.plan.validate import validate_runs

RATE = 1e9  # elements per second of every op; no per-call cost
ALPHA, BETA = 2e-4, 12.5e6  # the link between hosts
ALPHA_I, BETA_I = 5e-5, 1e9  # the intra-host tier


@pytest.fixture
def prof():
    return Profile(alpha_s=ALPHA, beta_bytes_per_s=BETA, kernels={op: RATE for op in OPS},
                   intra={"alpha_s": ALPHA_I, "beta_bytes_per_s": BETA_I})


def _wire(name: str, n: int) -> int:
    return CODECS[name].compressor(n).wire_nbytes((n,))


def test_hierarchical_step_by_hand(prof):
    # 2 hosts x 2 ranks, one bucket of 4000 elements, int8 (no error feedback), one segment:
    # shard s = 2000, inter-host chunks L = 1000
    n, s, L = 4000, 2000, 1000
    w = _wire("int8", L)
    e = L / RATE  # any op on one chunk
    rs = ALPHA_I + 4 * s / BETA_I + s / RATE  # one peer's float32 shard in, added
    hop = ALPHA + w / (BETA / 2)  # the 2 ranks of a host share its link
    inter = e + hop + e + (hop + e)  # compress, hop, reduce-compress; allgather hop, decode
    ag = 2 * ALPHA_I + 2 * w / BETA_I + 2 * e  # the peer's 2 chunk payloads in, decoded
    compute, apply = 0.01, 0.001
    st = Setting(nodes=4, link_bytes_per_s=BETA, params=n, compute_s=compute, apply_s=apply,
                 min_compress_numel=1, local_ranks=2)
    p = predict("sync", "int8", "hierarchical", st, prof)
    assert p.step_s == pytest.approx(compute + rs + inter + ag + apply, rel=1e-12)
    # bytes local rank 0 sends: half its host's inter-host bytes, 4 s float32, its shard's payloads
    assert p.bytes_sent == 2 * w + 4 * s + 2 * w
    # one rank per host: no intra-host stage, the flat ring of the whole bucket across hosts
    flat = Setting(nodes=4, link_bytes_per_s=BETA, params=n, compute_s=compute, apply_s=apply,
                   min_compress_numel=1)
    assert predict("sync", "int8", "hierarchical", flat, prof).step_s == pytest.approx(
        predict("sync", "int8", "ring", flat, prof).step_s, rel=1e-12)


def test_halving_doubling_on_two_tiers_by_hand(prof):
    # 2 x 2, 4000 elements, int8: halving at distance 2 (between hosts, both ranks of a host on
    # its link) then 1 (inside); doubling at distance 1 (inside) then 2 (between hosts)
    n = 4000
    w1, w2, wl = _wire("int8", 2000), _wire("int8", 1000), _wire("int8", 1000)
    e = 1 / RATE
    halving = (ALPHA + 2 * w1 / BETA) + (ALPHA_I + w2 / BETA_I)
    kernel = 2000 * e + 2000 * e + 1000 * e + 1000 * e  # compress, add; compress; owner's reduce-compress
    hop1 = ALPHA_I + wl / BETA_I
    hop2 = ALPHA + 2 * (2 * wl) / BETA
    kernel += max(0.0, 1000 * e - hop2) + 2 * 1000 * e  # the last block decoded behind hop 2; 2 blocks
    got = allreduce_seconds(CODECS["int8"], "halving_doubling", n, 4, ALPHA, BETA, prof,
                            local_ranks=2, intra=(ALPHA_I, BETA_I))
    assert got["total"] == pytest.approx(halving + hop1 + hop2 + kernel, rel=1e-12)
    # one rank per host: every step on the rank's own link
    one = allreduce_seconds(CODECS["int8"], "halving_doubling", n, 4, ALPHA, BETA, prof)
    assert one["total"] == pytest.approx((ALPHA + w1 / BETA) + (ALPHA + w2 / BETA) + (ALPHA + wl / BETA)
                                         + (ALPHA + 2 * wl / BETA) + 6000 * e + 2000 * e, rel=1e-12)


def test_sparse_reduce_scatter_on_two_tiers_by_hand(prof):
    # 2 x 2, top-k 1% + int8 + error feedback of 40,000 elements: regions L = 10,000, k = 100
    n, L, k = 40_000, 10_000, 100
    w = _wire("topk-int8-ef", L)
    c = L / RATE + k / RATE + L / RATE  # select, int8 values, residual update
    da = k / RATE  # the whole payload decode (sparse.payload_decompress_add), per kept element
    rs = 3 * ALPHA + 4 * w / BETA  # R (N - R) = 4 region payloads cross a host's link
    rs_kernel = 3 * c + 3 * da + c  # the other regions' selections, adds, the owner's re-selection
    hop = ALPHA + w / BETA
    ag = hop + 2 * max(hop, da) + da
    got = allreduce_seconds(CODECS["topk-int8-ef"], "sparse_reduce_scatter", n, 4, ALPHA, BETA, prof,
                            local_ranks=2, intra=(ALPHA_I, BETA_I))
    assert got["total"] == pytest.approx(rs + rs_kernel + ag, rel=1e-12)
    flat = allreduce_seconds(CODECS["topk-int8-ef"], "sparse_reduce_scatter", n, 4, ALPHA, BETA, prof)
    assert got["total"] - flat["total"] == pytest.approx(w / BETA, rel=1e-9)  # 4 payloads instead of 3


def test_sparse_decode_uses_the_measured_whole_call(prof):
    # a profile without the whole-call rate prices scatter-add + int8 decode of the k values
    from gradcomp.lab.plan.costs import decompress_add_s

    c = CODECS["topk-int8-ef"]
    assert decompress_add_s(c, prof, 10_000) == pytest.approx(100 / RATE)
    older = Profile(alpha_s=ALPHA, kernels={op: RATE for op in OPS if op != "sparse.payload_decompress_add"})
    assert decompress_add_s(c, older, 10_000) == pytest.approx(200 / RATE)


# ---- validate on a two-tier results file ------------------------------------------------

LINK = {"name": "100mbit", "configured_bps": 1e8, "achieved_bps": 1e8, "hosts": 2, "ranks_per_host": 2,
        "topology": "2x2", "intra": {"name": "none", "achieved_bps": 8e9}}


def _run(compressor, algorithm, **kw):
    run = {"mode": "sync", "compressor": compressor, "algorithm": algorithm, "world_size": 4,
           "params": 40_000, "link": LINK, "seed": 0, "scenario": {"name": "100mbit"}, "straggler": None,
           "compute_jitter_cv": 0.0, "step_time_median_s": 0.03, "steps": 60,
           "phases_median_s": {"compute": 0.010, "apply": 0.001},
           "phases_mean_s": {"compute": 0.0125, "compress": 0.001, "communicate": 0.012, "wait": 0.004,
                             "decompress": 0.0005, "apply": 0.001, "other": 0.0},
           "idle_share": 0.1, "bytes_per_worker_step": None, "meter": {"switches": []}}
    run.update(kw)
    return run


def _setting(**kw):
    # compute CV from mean / median 1.25: sqrt(1.25^2 - 1) = 0.75; the intra tier's achieved rate
    return Setting(nodes=4, link_bytes_per_s=1e8 / 8, params=40_000, compute_s=0.010, apply_s=0.001,
                   straggler_cv=0.75, local_ranks=2, intra_bytes_per_s=1e9, ranks_per_host=4, **kw)


def test_validate_predicts_every_algorithm_of_a_two_tier_run(prof):
    runs = [_run("int8-ef", alg) for alg in ("ring", "two_phase", "halving_doubling", "hierarchical")]
    runs += [_run("topk-int8-ef", alg) for alg in ("allgather", "sparse_reduce_scatter")]
    out = validate_runs({"runs": runs}, prof)
    assert out["skipped"] == []
    assert [r["predicted_as"][0][2] for r in out["rows"]] == [r["algorithm"] for r in runs]
    for run, row in zip(runs, out["rows"]):
        want = predict("sync", run["compressor"], run["algorithm"], _setting(), prof)
        assert row["step_s"]["predicted"] == pytest.approx(want.step_s, rel=1e-12)
        assert row["idle_share"]["predicted"] > 0.05  # the compute scatter's wait
    # hierarchical bytes by hand: shard 20,000, chunks 10,000: 2 payloads over hosts, 4 x 20,000 bytes
    # of float32 to the peer, the shard's 2 chunk payloads back to it
    w = _wire("int8-ef", 10_000)
    assert out["rows"][3]["bytes"]["predicted"] == 2 * w + 80_000 + 2 * w


def test_validate_auto_rows(prof):
    # adaptive codec: none for 4 steps, then top-k + int8 (with error feedback: the policy's residuals)
    switch = {"step": 4, "bucket": 0, "numel": 40_000, "from": "none", "to": "topk-int8"}
    auto = _run("auto", "ring", meter={"switches": [switch]})
    # algorithm auto (recorded by the chooser as kind "algorithm" at a call), and one without a record
    alg_switch = {"kind": "algorithm", "key": 0, "numel": 40_000, "call": 6, "from": None, "to": "two_phase"}
    chosen = _run("int8-ef", "auto", meter={"switches": [alg_switch]})
    unknown = _run("int8-ef", "auto")
    out = validate_runs({"runs": [auto, chosen, unknown]}, prof)
    assert [r["predicted_as"] for r in out["rows"]] == [
        [(4, "none", "ring"), (56, "topk-int8-ef", "allgather")], [(60, "int8-ef", "two_phase")]]
    none = predict("sync", "none", "ring", _setting(), prof)
    topk = predict("sync", "topk-int8-ef", "allgather", _setting(), prof)
    row = out["rows"][0]
    assert row["step_s"]["predicted"] == pytest.approx(statistics.median([none.step_s] * 4 + [topk.step_s] * 56))
    assert row["bytes"]["predicted"] == round((4 * none.bytes_sent + 56 * topk.bytes_sent) / 60)
    assert out["rows"][1]["step_s"]["predicted"] == pytest.approx(
        predict("sync", "int8-ef", "two_phase", _setting(), prof).step_s)
    assert len(out["skipped"]) == 1 and "algorithm it ran is not recorded" in out["skipped"][0][1]


def test_run_schedule_rejects_what_it_cannot_place():
    sw = [{"step": 3, "bucket": 0, "from": "none", "to": "int8"},
          {"step": 9, "bucket": 1, "from": "none", "to": "int8"}]
    with pytest.raises(ValueError, match="more than one bucket"):
        run_schedule(_run("auto", "ring", meter={"switches": sw}))
    with pytest.raises(ValueError, match="outside the run"):
        run_schedule(_run("auto", "ring", meter={"switches": [dict(sw[0], step=61)]}))
    with pytest.raises(ValueError, match="not recorded"):
        run_schedule(_run("auto", "ring"))
    # int8 with the policy's residuals is priced as int8-ef; fp16 as itself
    got = run_schedule(_run("auto", "two_phase", meter={"switches": [dict(sw[0], to="fp16"),
                                                                      dict(sw[0], step=30, **{"from": "fp16"})]}))
    assert got == [(3, "none", "two_phase"), (27, "fp16", "two_phase"), (30, "int8-ef", "two_phase")]
    assert math.isclose(sum(k for k, _, _ in got), 60)
