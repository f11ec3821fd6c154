"""The reference kernels against independent numpy oracles and the stated properties."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from gradcomp import kernels as K
from gradcomp.kernels import reference as R

import oracle

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BLOCK = 32


def bits(t):
    return t.view(torch.int32)


def test_hash_matches_oracle():
    for seed, counter in [(0, 0), (1, 7), (2**40 + 3, 2**33 + 5)]:
        assert R.stream_key(seed, counter) == oracle.key(seed, counter)
        np.testing.assert_array_equal(R.uniform(300, seed, counter).numpy(),
                                      oracle.uniforms(300, seed, counter))


@given(
    n=st.sampled_from([0, 1, 2, BLOCK - 1, BLOCK + 1, 97, 257, 1000]),
    rounding=st.sampled_from(["nearest", "stochastic"]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**63),
    counter=st.integers(0, 2**40),
    data=st.data(),
)
def test_quantize_matches_oracle(n, rounding, dtype, seed, counter, data):
    scale = data.draw(st.sampled_from([1.0, 1e-40, 1e38, 1e-3]))
    if dtype in (torch.float16,) and scale > 6e4:
        scale = 1e4
    if dtype == torch.float16 and scale < 1e-7:
        scale = 1e-3
    if dtype == torch.bfloat16 and scale < 1e-37:
        scale = 1e-3
    g = torch.Generator().manual_seed(seed % 2**31)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
    q, s = K.quantize_int8(x, BLOCK, rounding, seed, counter, backend="reference")
    eq, es = oracle.quantize(x.to(torch.float32).numpy(), BLOCK, rounding, seed, counter)
    np.testing.assert_array_equal(q.numpy(), eq)
    assert torch.equal(bits(s), bits(torch.from_numpy(es)))


def test_error_bounds_nearest_and_stochastic():
    x = torch.randn(100_003, dtype=torch.float32) * torch.logspace(-3, 3, 100_003)
    for rounding, bound in [("nearest", 0.5), ("stochastic", 1.0)]:
        q, s = K.quantize_int8(x, 256, rounding, 5, 9, backend="reference")
        d = K.dequantize_int8(q, s, 256, backend="reference")
        sc = s.repeat_interleave(256)[: x.numel()]
        err = (d.double() - x.double()).abs()
        # float32 arithmetic adds a few ulps of |x| on top of the rounding step
        tol = bound * sc.double() * (1 + 1e-5) + 4 * torch.finfo(torch.float32).eps * x.double().abs()
        if rounding == "stochastic":
            assert bool((err < tol).all())
        else:
            assert bool((err <= tol).all())
        assert int(q.min()) >= -127 and int(q.max()) <= 127


def test_stochastic_rounding_is_unbiased():
    torch.manual_seed(0)
    x = torch.randn(256)
    draws = 4000
    acc = torch.zeros(256, dtype=torch.float64)
    for c in range(draws):
        q, s = K.quantize_int8(x, 256, "stochastic", seed=11, counter=c, backend="reference")
        acc += K.dequantize_int8(q, s, 256, backend="reference").double()
    mean = acc / draws
    scale = float(s[0])
    # each draw has variance <= scale^2 / 4: the mean is within 5 sigma (CLT)
    bound = 5 * scale / (2 * math.sqrt(draws)) + 1e-6
    assert float((mean - x.double()).abs().max()) <= bound


def test_zero_blocks_and_nonfinite_blocks():
    x = torch.zeros(3 * 64)
    x[64:128] = torch.randn(64)
    x[130] = float("nan")
    x[200 - 64] = float("inf")
    x = torch.cat([x, torch.zeros(10)])
    q, s = K.quantize_int8(x, 64, backend="reference")
    d = K.dequantize_int8(q, s, 64, backend="reference")
    assert torch.equal(d[:64], torch.zeros(64))  # exact zeros, no NaN
    assert bool(torch.isnan(d[128:192]).all())    # the non-finite block stays non-finite
    assert bool(torch.isfinite(d[64:128]).all()) and bool(torch.isfinite(d[192:]).all())
    assert bits(s[2]).item() == 0x7FC00000


def test_noncontiguous_equals_contiguous():
    x = torch.randn(64, 33).t()
    a = K.quantize_int8(x, 32, backend="reference")
    b = K.quantize_int8(x.contiguous(), 32, backend="reference")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    y = torch.randn(1000)[::3]
    assert torch.equal(K.topk(y, 7)[0], K.topk(y.contiguous(), 7)[0])


def test_dequantize_add_and_out():
    x = torch.randn(1001)
    q, s = K.quantize_int8(x, 64)
    acc = torch.randn(1001)
    expect = acc + K.dequantize_int8(q, s, 64)
    K.dequantize_int8_add_(acc, q, s, 64)
    assert torch.equal(acc, expect)
    out = torch.empty(1001, dtype=torch.float16)
    K.dequantize_int8(q, s, 64, out=out)
    assert torch.equal(out, K.dequantize_int8(q, s, 64).half())


def test_ef_fused_matches_composition_and_telescopes():
    torch.manual_seed(1)
    r = torch.zeros(777)
    total_in = torch.zeros(777, dtype=torch.float64)
    total_out = torch.zeros(777, dtype=torch.float64)
    for step in range(20):
        x = torch.randn(777)
        p = x + r
        q, s = K.quantize_int8_ef(x, r, 64, "stochastic", 3, step, backend="reference")
        q2, s2 = K.quantize_int8(p, 64, "stochastic", 3, step)
        assert torch.equal(q, q2) and torch.equal(s, s2)
        total_in += x.double()
        total_out += K.dequantize_int8(q, s, 64).double()
    # sum of decompressed + final residual == sum of inputs (up to float32 rounding)
    assert torch.allclose(total_out + r.double(), total_in, atol=1e-4)


@given(n=st.integers(1, 400), data=st.data())
def test_topk_matches_sort_oracle(n, data):
    k = data.draw(st.integers(0, n))
    vals = data.draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, -2.5, 1e-3, float("nan"), 7.0]),
                              min_size=n, max_size=n))
    x = torch.tensor(vals) + torch.randn(n) * data.draw(st.sampled_from([0.0, 1.0]))
    idx, v = K.topk(x, k, backend="reference")
    np.testing.assert_array_equal(idx.numpy(), oracle.topk_indices(x.numpy(), k))
    assert idx.dtype == torch.int32
    # the values are the inputs at idx, bit for bit (NaN payloads included)
    assert v.dtype == x.dtype == torch.float32
    assert torch.equal(v.view(torch.int32), x[idx.long()].view(torch.int32))


def test_topk_large_negative_beats_small_positive():
    x = torch.tensor([0.5, -9.0, 0.1, 3.0])
    idx, v = K.topk(x, 2)
    assert idx.tolist() == [1, 3] and v.tolist() == [-9.0, 3.0]


@given(n=st.integers(0, 500), tau=st.floats(0, 3), dtype=st.sampled_from(DTYPES))
def test_threshold_matches_oracle(n, tau, dtype):
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    if n > 3:
        x[3] = float("nan")
    idx, v = K.threshold(x, tau, backend="reference")
    a = x.to(torch.float64 if dtype == torch.float64 else torch.float32).abs().numpy()
    t = np.float64(tau) if dtype == torch.float64 else np.float32(tau)
    expect = np.nonzero((a >= t) | np.isnan(a))[0]
    np.testing.assert_array_equal(idx.numpy(), expect)


@pytest.mark.parametrize("n,k", [(100_000, 1000), (100_000, 100), (5000, 4999), (4096, 1)])
def test_approx_topk_contract(n, k):
    x = torch.randn(n)
    idx, v = K.approx_topk(x, k, backend="reference")
    c = idx.numel()
    assert math.ceil(0.9 * k) <= c <= math.floor(1.1 * k) or c == k
    assert bool((idx[1:] > idx[:-1]).all())
    mask = torch.zeros(n, dtype=torch.bool)
    mask[idx.long()] = True
    if bool((~mask).any()):
        assert float(x[mask].abs().min()) >= float(x[~mask].abs().max())


def test_scatter_add():
    acc = torch.zeros(10)
    K.scatter_add_(acc, torch.tensor([1, 3, 3], dtype=torch.int32), torch.tensor([1.0, 2.0, 5.0]))
    assert acc.tolist() == [0, 1, 0, 7, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    "kwargs,exc,word",
    [
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=-64), ValueError, "block_size"),
        (dict(block_size=48), ValueError, "block_size"),
        (dict(block_size=16), ValueError, "block_size"),
        (dict(block_size=131072), ValueError, "block_size"),
        (dict(block_size=64.0), TypeError, "block_size"),
        (dict(rounding="up"), ValueError, "rounding"),
    ],
)
def test_bad_quantize_arguments(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        K.quantize_int8(torch.randn(10), **kwargs)


def test_bad_kernel_arguments():
    with pytest.raises(TypeError, match="x"):
        K.quantize_int8(torch.arange(10))
    with pytest.raises(ValueError, match="k"):
        K.topk(torch.randn(5), 6)
    with pytest.raises(ValueError, match="tau"):
        K.threshold(torch.randn(5), -1.0)
    with pytest.raises(ValueError, match="backend"):
        K.topk(torch.randn(5), 1, backend="nope")


def test_registry_reports_and_forced_backend(monkeypatch):
    from gradcomp.errors import BackendUnavailable
    from gradcomp.kernels import ops, registry

    av = K.available_backends()
    assert set(av) == {"reference", "cpu", "triton", "cuda"} and av["reference"] is None
    if not torch.cuda.is_available():
        assert isinstance(av["cuda"], str) and av["cuda"]  # no GPU: a reason is given
    if av["cuda"] is not None:  # an unavailable backend, forced, fails loudly
        with pytest.raises(BackendUnavailable, match="cuda"):
            K.topk(torch.randn(5), 1, backend="cuda")
        monkeypatch.setenv("GRADCOMP_BACKEND", "cuda")
        with pytest.raises(BackendUnavailable):
            K.topk(torch.randn(5), 1)
    monkeypatch.setenv("GRADCOMP_BACKEND", "reference")
    assert registry.backend_name("topk", "cpu") == "reference"
    assert registry.resolve("topk", "cpu") is ops.kernels("reference")["topk"]
