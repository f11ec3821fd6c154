"""``gradcomp bench kernels`` peers: the fused torch.compile int8 functions give gradcomp's
codes and scales (derived here in float64), bitsandbytes gets preallocated buffers, and
every peer runs at every thread setting."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import gradcomp.kernels as K
from gradcomp.lab.bench.kernels import main
from gradcomp.lab.bench.kernels import peers as P
from gradcomp.lab.bench.kernels.cases import Case

BLOCK = 256


def _data() -> torch.Tensor:
    """Three whole blocks and a 100-element tail: random (scaled per block), exact
    half-integer ties (absmax 127, so x * 127 / m = x exactly) and an all-zero block."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3 * BLOCK + 100, generator=g, dtype=torch.float64)
    x[:BLOCK] *= 1e-3
    ties = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -126.5], dtype=torch.float64)
    x[BLOCK:2 * BLOCK] = 0.25
    x[BLOCK:BLOCK + len(ties)] = ties
    x[2 * BLOCK:3 * BLOCK] = 0.0
    return x.float()


def _expected(x: torch.Tensor):
    """float64: scale = m / 127 rounded once to float32, y = x * 127 / m (exact up to one
    rounding), and where y is within 1e-4 of a half-integer (the last ulp of a float32
    product decides the code there)."""
    x64 = x.double()
    blocks = [x64[i:i + BLOCK] for i in range(0, len(x64), BLOCK)]
    m = torch.stack([b.abs().max() for b in blocks])
    scale = (m / 127).float()
    y = torch.cat([b * 127 / mb if mb > 0 else torch.zeros_like(b) for b, mb in zip(blocks, m)])
    near_tie = ((y - y.floor()) - 0.5).abs() < 1e-4
    return scale, y, near_tie


def _compiled(fn):
    return torch.compile(fn, fullgraph=True, dynamic=False)


@pytest.mark.slow  # inductor runs a C++ compiler
def test_compiled_quantize_and_dequantize_agree_with_gradcomp():
    torch._dynamo.reset()
    x = _data()
    n = x.numel()
    nb = -(-n // BLOCK)
    q, s = torch.empty(n, dtype=torch.int8), torch.empty(nb)
    _compiled(P.fused_quantize_int8)(x, q, s, BLOCK)
    scale, y, near_tie = _expected(x)
    ours_q, ours_s = K.quantize_int8(x, BLOCK)

    # scales: m / 127 correctly rounded, bit for bit, and the same as gradcomp's
    assert torch.equal(s, scale) and torch.equal(ours_s, scale)
    assert s[2] == 0 and not q[2 * BLOCK:3 * BLOCK].any()  # the zero block
    # exact ties round half to even
    assert q[BLOCK:BLOCK + 8].tolist() == [127, 2, 4, -2, 0, 0, 2, -126]
    # away from ties the codes are the correctly rounded y, gradcomp's too; at a tie
    # within an ulp the two float32 products may round either way: one code apart
    exact = torch.round(y).to(torch.int8)
    away = ~near_tie
    assert torch.equal(q[away], exact[away]) and torch.equal(ours_q[away], exact[away])
    assert (q.int() - ours_q.int()).abs().max() <= 1
    assert near_tie.any() and ((q.int() - exact.int())[near_tie].abs() <= 1).all()

    out = torch.empty(n)
    _compiled(P.fused_dequantize_int8)(ours_q, ours_s, out, BLOCK)
    # an int8 code times a float32 scale is exact in float64: one rounding to float32
    want = (ours_q.double() * ours_s.double().repeat_interleave(BLOCK)[:n]).float()
    assert torch.equal(out, want) and torch.equal(K.dequantize_int8(ours_q, ours_s, BLOCK), want)
    torch._dynamo.reset()


def test_error_feedback_and_accumulate_peers_match_a_float64_derivation():
    x = _data()
    n = x.numel()
    g = torch.Generator().manual_seed(4)
    res0 = torch.randn(n, generator=g) * 1e-3
    res, q, s = res0.clone(), torch.empty(n, dtype=torch.int8), torch.empty(-(-n // BLOCK))
    P.fused_quantize_int8_ef(x, res, q, s, BLOCK)
    p = (x.double() + res0.double()).float()  # one float32 addition
    scale, y, near_tie = _expected(p)
    assert torch.equal(s, scale)
    assert torch.equal(q[~near_tie], torch.round(y).to(torch.int8)[~near_tie])
    s_el = s.double().repeat_interleave(BLOCK)[:n]
    deq = (q.double() * s_el).float()
    assert torch.equal(res, (p.double() - deq.double()).float())

    acc0 = torch.randn(n, generator=g)
    acc = acc0.clone()
    P.fused_dequantize_int8_add_(acc, q, s, BLOCK)
    assert torch.equal(acc, (acc0.double() + deq.double()).float())


class _FakeBnb:
    """Records bitsandbytes.functional calls; codes / absmax written like blockwise absmax."""

    def __init__(self):
        self.calls = []

    def create_dynamic_map(self):
        return torch.linspace(-1, 1, 256)

    def quantize_blockwise(self, A, code=None, absmax=None, out=None, blocksize=4096, nested=False):
        self.calls.append(("q", A, code, absmax, out, blocksize))
        if absmax is None:
            return torch.zeros(A.numel(), dtype=torch.uint8), None
        absmax.copy_(A.abs().view(-1, blocksize).amax(1))
        out.fill_(7)
        return out, None

    def dequantize_blockwise(self, A, quant_state=None, absmax=None, code=None, out=None, blocksize=4096,
                             nested=False):
        self.calls.append(("d", A, code, absmax, out, blocksize))
        return out


@pytest.fixture
def fake_bnb(monkeypatch):
    fake = _FakeBnb()
    pkg = types.ModuleType("bitsandbytes")
    functional = types.ModuleType("bitsandbytes.functional")
    for name in ("create_dynamic_map", "quantize_blockwise", "dequantize_blockwise"):
        setattr(functional, name, getattr(fake, name))
    pkg.functional = functional
    monkeypatch.setitem(sys.modules, "bitsandbytes", pkg)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", functional)
    P.bitsandbytes.cache_clear()
    yield fake
    P.bitsandbytes.cache_clear()


@pytest.mark.parametrize("op", ["quantize_int8", "dequantize_int8"])
def test_bitsandbytes_peer_writes_into_preallocated_buffers(fake_bnb, op):
    n = 4 * BLOCK
    x = torch.randn(n)
    peer = P.bitsandbytes_peer(Case("cpu", "1", op, n, "float32"), {"x": x}, BLOCK)
    assert peer.bytes == n * 4 + n + 4 * 4  # float32 in or out, int8 codes, one scale per block
    fake_bnb.calls.clear()
    peer.fn()
    peer.fn()
    (kind1, a1, code1, absmax1, out1, bs1), (_, _, code2, absmax2, out2, _) = fake_bnb.calls
    assert kind1 == ("q" if op == "quantize_int8" else "d") and bs1 == BLOCK
    assert code1 is not None and absmax1 is not None and out1 is not None
    assert code1 is code2 and absmax1 is absmax2 and out1 is out2  # nothing allocated per call
    assert absmax1.shape == (4,) and absmax1.dtype == torch.float32
    if op == "quantize_int8":
        assert a1 is x and out1.dtype == torch.uint8 and out1.shape == (n,)
        assert torch.equal(absmax1, x.abs().view(4, BLOCK).amax(1))
    else:
        assert a1.dtype == torch.uint8 and out1.dtype == x.dtype and out1.shape == (n,)


def test_bitsandbytes_missing_is_a_reason_not_a_failure(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import raises ImportError
    P.bitsandbytes.cache_clear()
    try:
        F, reason = P.bitsandbytes()
        assert F is None and "bitsandbytes" in reason
        assert P.bitsandbytes_peer(Case("cpu", "1", "quantize_int8", 512, "float32"),
                                   {"x": torch.randn(512)}, BLOCK) is None
    finally:
        P.bitsandbytes.cache_clear()


@pytest.mark.slow  # inductor runs a C++ compiler
def test_every_peer_runs_at_one_and_all_threads(tmp_path, capsys):
    argv = ["--sizes", "4096", "--ops", "quantize_int8", "--threads", "1,all", "--compile-ops",
            "quantize_int8", "--repeat", "3", "--budget", "0.01", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    for threads in ("1", "all"):
        by = {r["name"]: r for r in rows if r["threads"] == threads}
        assert {"copy", "compiled", "reference"} <= set(by), sorted(by)
        assert by["compiled"]["rounds"] == 3
        if "cpu" in by:  # the ratio is the peer's median over ours, from the same run
            assert by["cpu"]["speedup_vs_compiled"] == pytest.approx(
                by["compiled"]["median_s"] / by["cpu"]["median_s"])
    assert "compiled" in out and "x comp" in out
    assert "torch.compile of the peers: 2 compilations" in out
