"""gradcomp.catalog: one table of named compressors, and every menu draws its names from it."""

import math
import subprocess
import sys

import pytest
import torch

import gradcomp as gc
from gradcomp import catalog
from gradcomp.adaptive import CANDIDATES, CONVERGENCE, DEFAULT_CANDIDATES
from gradcomp.lab import ps_demo
from gradcomp.lab.plan import model as plan
from gradcomp.lab.study import config as study

# the study's rows that are not compressors: a policy over catalog codecs, the backend's collective
STUDY_OWN_ROWS = {"auto", "native", "powersgd4", "powersgd4-alt", "torch-powersgd4", "sign-ef-sgd",
                  "powersgd32", "torch-powersgd32"}


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


def _dense_bytes(kind: str, n: int) -> int:
    # the wire format: a 40-byte header plus 8 bytes per dimension, then the codec's section
    header = 48
    # blockwise codecs: one float32 scale per block (256 elements; sign 1024), then the codes
    # packed: 8 bits (int8, fp8), 4 (two a byte), 2 (four a byte), 1 (sign: eight a byte)
    return header + {"raw": 4 * n, "fp16": 2 * n, "bf16": 2 * n, "int8": n + 4 * math.ceil(n / 256),
                     "fp8e4m3": n + 4 * math.ceil(n / 256), "fp8e5m2": n + 4 * math.ceil(n / 256),
                     "int4": math.ceil(n / 2) + 4 * math.ceil(n / 256),
                     "int2": math.ceil(n / 4) + 4 * math.ceil(n / 256),
                     "sign": math.ceil(n / 8) + 4 * math.ceil(n / 1024)}[kind]


def _sparse_bytes(values: str, n: int, k: int) -> int:
    # header, int32 indices padded to 8 bytes, then the kept values as a nested dense payload
    return 48 + _pad8(4 * k) + _dense_bytes("raw" if values == "raw" else "int8", k)


def _same(a, b):
    """Two compressors that are the same codec: same type and settings, same wire sizes."""
    assert type(a) is type(b) and repr(a) == repr(b), (a, b)
    for n in (1, 1000, 70_001):
        assert a.wire_nbytes((n,)) == b.wire_nbytes((n,)), (a, n)


@pytest.mark.parametrize("name", catalog.NAMES)
def test_each_entry_builds_what_its_facts_say(name):
    e = catalog.entry(name)
    assert e.name == name and e.label
    kwargs = {"threshold": 2.5} if e.kind == "threshold" else {}  # |x| >= 2.5: about 1% of N(0, 1)
    comp = e.build(compact_indices=False, **kwargs)
    assert comp.codec == e.kind and comp.sparse == e.sparse
    assert not isinstance(comp, gc.ErrorFeedback)  # the transport adds the residual
    x = torch.randn(70_001, generator=torch.Generator().manual_seed(0))
    payload = comp.compress(x)
    if e.kind == "threshold":
        nnz = int((x.abs() >= 2.5).sum())
        assert payload.wire.numel() == _sparse_bytes(e.values, x.numel(), nnz)
    elif e.sparse:
        k = math.ceil(e.density * x.numel())
        assert comp.wire_nbytes(x.shape) == payload.wire.numel() == _sparse_bytes(e.values, x.numel(), k)
        # the default codes the indices compactly where that is smaller
        assert e.build().wire_nbytes(x.shape) <= _sparse_bytes(e.values, x.numel(), k)
    else:
        assert comp.wire_nbytes(x.shape) == payload.wire.numel() == _dense_bytes(e.kind, x.numel())
    assert e.build(**kwargs) is not e.build(**kwargs)  # a fresh compressor each time


@pytest.mark.parametrize("name, cls, settings", [
    ("int4", gc.IntQuantizer, {"bits": 4, "block_size": 256}), ("int4-ef", gc.IntQuantizer, {"bits": 4}),
    ("int2-ef", gc.IntQuantizer, {"bits": 2, "block_size": 256}), ("sign-ef", gc.SignQuantizer, {"block_size": 1024}),
    ("fp8", gc.FP8, {"format": "e4m3", "block_size": 256}), ("fp8-e5m2", gc.FP8, {"format": "e5m2"})])
def test_the_low_bit_entries_build_their_codec(name, cls, settings):
    comp = catalog.build(name)
    assert type(comp) is cls and all(getattr(comp, k) == v for k, v in settings.items())
    assert catalog.entry(name).block_size == comp.block_size
    # bits per element at a large size: 4 + 32/256, 2 + 32/256, 1 + 32/1024, 8 + 32/256 (header aside)
    n = 1 << 20
    bits = 8 * (comp.wire_nbytes((n,)) - 48) / n
    assert bits == {"int4": 4.125, "int4-ef": 4.125, "int2-ef": 2.125, "sign-ef": 1.03125, "fp8": 8.125,
                    "fp8-e5m2": 8.125}[name]


def test_every_blockwise_entry_names_its_block_size():
    from gradcomp import wire
    for e in catalog.ENTRIES.values():
        assert (e.block_size is not None) == (e.kind in wire.BLOCK_CODE_BITS), e.name
        if e.block_size is not None:
            assert e.build().block_size == e.block_size
    assert (catalog.entry("int4").block_size, catalog.entry("sign-ef").block_size) == (256, 1024)


def test_the_facts_of_the_names():
    e = catalog.ENTRIES
    assert (e["topk"].kind, e["topk"].values, e["topk"].density) == ("topk", "raw", 0.01)
    assert (e["topk-int8"].values, e["topk-int8-ef"].values) == ("int8", "int8")
    assert [n for n in catalog.NAMES if e[n].error_feedback] == [n for n in catalog.NAMES if n.endswith("-ef")
                                                                  or e[n].dgc]
    assert {n for n in catalog.NAMES if e[n].dgc} == {"dgc", "dgc-int8"}
    assert e["dgc"].density == 0.001 and e["dgc"].error_feedback
    assert len({x.label for x in e.values()}) == len(e)  # one label per name


def test_unknown_names_and_misplaced_arguments():
    with pytest.raises(ValueError, match=r"unknown compressor 'top-k'; allowed: none, fp16, .*dgc-int8"):
        catalog.entry("top-k")
    with pytest.raises(ValueError, match="unknown compressor"):
        catalog.build(None)
    with pytest.raises(ValueError, match="threshold-ef needs a threshold"):
        catalog.build("threshold-ef")
    with pytest.raises(ValueError, match="threshold applies to threshold entries only"):
        catalog.build("int8-ef", threshold=0.1)
    with pytest.raises(ValueError, match="density applies to top-k entries only"):
        catalog.build("int8", density=0.5)
    assert catalog.build("topk", density=0.25).k_for(100) == 25
    assert gc.catalog.build("int8-ef").wire_nbytes((1000,)) == _dense_bytes("int8", 1000)


def test_the_study_menu_is_the_catalog():
    assert set(study.COMPRESSORS) - STUDY_OWN_ROWS <= set(catalog.NAMES)
    assert not STUDY_OWN_ROWS & set(catalog.NAMES)  # no name of the study means another thing there
    assert set(study.DEFAULT_COMPRESSORS) <= set(catalog.NAMES)
    for name, row in study.COMPRESSORS.items():
        if name in STUDY_OWN_ROWS:
            continue
        e = catalog.entry(name)
        assert (row.label, row.error_feedback, row.dgc, row.sparse) == (e.label, e.error_feedback, e.dgc, e.sparse)
        threshold = 0.5 if e.kind == "threshold" else None
        _same(row.build(threshold=threshold), e.build(threshold=threshold))
    _same(study.COMPRESSORS["native"].build(), catalog.build("none"))
    assert repr(study.COMPRESSORS["powersgd4"].build()) == repr(gc.PowerSGD(rank=4))
    # sign-ef-sgd: the catalog's sign-ef, only the optimizer differs
    plain, sign = study.COMPRESSORS["sign-ef-sgd"], study.COMPRESSORS["sign-ef"]
    _same(plain.build(), catalog.build("sign-ef"))
    assert (plain.error_feedback, plain.sparse, plain.modes) == (True, False, ("sync",))
    assert plain.optimizer(0.1, 0.9) == pytest.approx((1.0, 0.0)) and sign.optimizer(0.1, 0.9) == (0.1, 0.9)
    assert plain.optimizer(0.05, 0.0) == (0.05, 0.0)
    cfg = study.TrainConfig(algorithm="ring")
    assert (cfg.algorithm_for(plain), cfg.algorithm_for(sign)) == ("two_phase", "ring")  # owners keep a residual
    assert plain.server_ef and not sign.server_ef
    for name in ("fp8", "fp8-e5m2", "int4", "int4-ef", "int2-ef", "sign-ef"):  # the low-bit rows
        assert study.parse_compressors(name) == (name,)
    with pytest.raises(ValueError, match="unknown compressor name"):
        study.parse_compressors("sign")  # biased without error feedback: no training row


def test_the_planner_menu_is_the_catalog():
    assert set(plan.CODECS) <= set(catalog.NAMES)
    for name, c in plan.CODECS.items():
        e = catalog.entry(name)
        assert (c.label, c.kind, c.values, c.density, c.error_feedback) == (
            e.label, e.kind, e.values, e.density, e.error_feedback)
        if e.kind != "threshold":  # a threshold is priced as a top-k payload at its density
            _same(c.compressor(1000), e.build())
    assert set(plan.GAP_PTS) <= set(plan.CODECS) and set(plan.GAP_UNMEASURED) <= set(plan.CODECS)
    for name in ("int4-ef", "int2-ef", "sign-ef", "fp8", "fp8-e5m2"):
        assert name in plan.CODECS and plan.CODECS[name].gap_pts is None  # no study measured it yet


def test_the_adaptive_candidates_are_the_catalog():
    assert set(CANDIDATES) <= set(catalog.NAMES)
    assert set(DEFAULT_CANDIDATES) <= set(CANDIDATES) and set(CONVERGENCE) <= set(CANDIDATES)
    for name, make in CANDIDATES.items():
        _same(make(), catalog.build(name))
        assert not catalog.entry(name).error_feedback  # the policy keeps the residuals itself
    assert gc.Adaptive(["topk"]).candidates[0].values is None  # raw top-k, as everywhere
    # the sub-8-bit codecs and fp8 are explicit candidates, not in the default ladder
    for name in ("fp8", "fp8-e5m2", "int4", "int2", "sign"):
        assert name in CANDIDATES and name not in DEFAULT_CANDIDATES
    policy = gc.Adaptive(["none", "int8", "int4", "sign"], convergence={"sign": 1.5})
    assert policy.convergence == (1.0, 1.0, 1.0, 1.5)


def test_the_ps_demo_menu_is_the_catalog():
    assert set(ps_demo.PS_COMPRESSORS) <= set(catalog.NAMES)
    for name in ps_demo.PS_COMPRESSORS:
        if name == "none":
            assert ps_demo.demo_compressor(name) is None  # the server's default, int8 pull deltas
        else:
            _same(ps_demo.demo_compressor(name), catalog.build(name))
    with pytest.raises(ValueError, match="compressor must be one of none, fp16, int8, topk-int8"):
        ps_demo.demo_compressor("topk")


@pytest.mark.slow
def test_the_catalog_imports_no_torch():
    # command-line parsers list the names (gradcomp train --help) before torch would load
    code = "import sys, gradcomp.catalog as c; assert c.NAMES; print(sorted(m for m in sys.modules if m == 'torch'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_planner_prices_the_low_bit_codecs_from_wire_bytes_and_kernel_rates():
    from gradcomp.lab.plan.costs import allreduce_bytes, compress_s
    from gradcomp.lab.plan.profile import BYTES_PER_ELEMENT, Profile
    from gradcomp.lab.plan.recommend import rank

    n, world = 4000, 4  # chunks of 1000: 48-byte header, 4 scales, the packed codes
    chunk = {"int4-ef": 48 + 16 + 500, "int2-ef": 48 + 16 + 250, "sign-ef": 48 + 4 + 125, "fp8": 48 + 16 + 1000}
    for name, w in chunk.items():  # the ring sends N - 1 chunks in each phase
        assert allreduce_bytes(plan.CODECS[name], "ring", n, world) == (2 * (world - 1) * w, 2 * (world - 1) * w)
    # kernel time: the fused error-feedback kernel at its bytes per element (roofline at 1 GB/s)
    prof = Profile.roofline(1.0)
    assert BYTES_PER_ELEMENT["int4.compress_ef"] == 12 + 0.5 + 4 / 256
    assert compress_s(plan.CODECS["int4-ef"], prof, 10**6, True) == pytest.approx(10**6 * 12.515625 / 1e9)
    assert compress_s(plan.CODECS["sign-ef"], prof, 10**6, False) == pytest.approx(10**6 * (4.125 + 4 / 1024) / 1e9)
    # recommend: an unmeasured accuracy gap is left out unless the codec is named
    s = plan.Setting(nodes=8, link_bytes_per_s=1.25e8, params=10**7, compute_s=0.05)
    kept, excluded = rank(s, prof)
    assert all(p.compressor not in plan.GAP_UNMEASURED for p in kept)
    assert {p.compressor for p, why in excluded if "not measured" in why} == set(plan.GAP_UNMEASURED)
    kept, _ = rank(s, prof, compressors=["int8-ef", "sign-ef"])
    assert kept[0].compressor == "sign-ef"  # 1.03 bits per element on a 1 Gbit/s link: the fewest bytes win


def test_plan_recommend_takes_the_low_bit_names(capsys):
    from gradcomp.lab.cli import main

    base = ["plan", "recommend", "--nodes", "16", "--link", "100mbit", "--params", "25M", "--compute-ms", "50",
            "--alpha-us", "20", "--kernel-gbps", "10"]
    assert main(base + ["--compressors", "int8-ef,int4-ef,sign-ef"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "recommended: sync sign-ef" in out  # 1.03 bits per element on a 100 Mbit/s link
    with pytest.raises(SystemExit):
        main(base + ["--compressors", "sign"])  # no plan row: biased without error feedback
    assert "unknown compressor 'sign'" in capsys.readouterr().err
