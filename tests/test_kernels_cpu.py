"""The native CPU backend (gradcomp._C) against the pure-PyTorch reference.

Quantization, dequantization, error feedback, top-k, threshold and
scatter-add must match the reference bit for bit (codes, scale and residual
bits, index sets, values); approx_topk must meet its contract. Everything goes
through the public wrappers with ``backend="cpu"`` unless a test is about the
backend module itself.
"""

import math
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import given, strategies as st

pytest.importorskip(
    "gradcomp._C", reason="gradcomp._C is not built (run `python setup.py build_ext --inplace`)"
)

import gradcomp as gc  # noqa: E402
from gradcomp import kernels as K  # noqa: E402
from gradcomp.kernels import cpu as C  # noqa: E402
from gradcomp.kernels import reference as R  # noqa: E402
from gradcomp.kernels import registry  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ROUNDINGS = ["nearest", "stochastic"]
SMALL_SIZES = [0, 1, 2, 31, 33, 97, 255, 257, 1009, 4099]
BLOCKS = [2**i for i in range(5, 17)]  # 32 .. 65536
NAN, INF = float("nan"), float("inf")
SPECIALS = [0.0, -0.0, NAN, INF, -INF, 1e-40, -1e-40, 1e38, -1e38, 3e-45]

_INT_VIEW = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.int8: torch.int8,
    torch.int32: torch.int32,
    torch.int64: torch.int64,
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.dtype])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = ""):
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if not torch.equal(bits(a), bits(b)):
        bad = (bits(a) != bits(b)).nonzero().view(-1)[:5].tolist()
        raise AssertionError(f"{what}: differ at {bad}: {a.view(-1)[bad].tolist()} vs {b.view(-1)[bad].tolist()}")


def make(n, dtype=torch.float32, seed=0, scale=1.0, special_rate=0.0, zero_block=None):
    """randn * scale (in float64, then rounded to dtype) with special values
    sprinkled at rate special_rate and, optionally, the first block all zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    if special_rate and n:
        where = torch.rand(n, generator=g) < special_rate
        pick = torch.randint(len(SPECIALS), (n,), generator=g)
        x = torch.where(where, torch.tensor(SPECIALS, dtype=torch.float64)[pick], x)
    if zero_block and n:
        x[:zero_block] = 0.0
    return x.to(dtype)


def check_quantize(x, block, rounding, seed=0, counter=0):
    q1, s1 = K.quantize_int8(x, block, rounding, seed, counter, backend="cpu")
    q2, s2 = K.quantize_int8(x, block, rounding, seed, counter, backend="reference")
    assert_bits_equal(q1, q2, "codes")
    assert_bits_equal(s1, s2, "scales")
    return q1, s1


# ---------------------------------------------------------------------------
# quantize_int8


@given(
    n=st.sampled_from(SMALL_SIZES),
    block=st.sampled_from([32, 64, 256, 1024]),
    dtype=st.sampled_from(DTYPES),
    rounding=st.sampled_from(ROUNDINGS),
    seed=st.integers(-(2**63), 2**64 - 1),
    counter=st.integers(0, 2**64 - 1),
    scale=st.sampled_from([1.0, 1e-3, 3e4, 1e-40, 1e38]),
    special_rate=st.sampled_from([0.0, 0.0, 0.01, 0.3]),
    data_seed=st.integers(0, 2**31 - 1),
)
def test_quantize_matches_reference(n, block, dtype, rounding, seed, counter, scale, special_rate, data_seed):
    x = make(n, dtype, data_seed, scale, special_rate, zero_block=block if data_seed % 3 == 0 else None)
    check_quantize(x, block, rounding, seed, counter)


@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_every_block_size(block):
    n = 2 * block + 7  # a full block, a full block, a short one
    x = make(n, torch.float32, seed=block, special_rate=0.001)
    for rounding in ROUNDINGS:
        check_quantize(x, block, rounding, seed=block, counter=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_quantize_large(dtype, rounding):
    n = 2**20 if dtype == torch.float32 else 2**20 - 3
    x = make(n, dtype, seed=11, special_rate=1e-5)
    check_quantize(x, 256, rounding, seed=7, counter=2**40 + 1)
    if dtype == torch.float32:
        check_quantize(x, 65536, rounding, seed=7, counter=5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_special_blocks(dtype):
    b = 32
    blocks = [
        [0.0] * b,  # all zero -> scale 0, codes 0
        [-0.0] * b,
        [1e-40] + [0.0] * (b - 1),  # denormal max
        [1e-40 * (i - 16) for i in range(b)],
        [1e38, -1e38] + [1.0] * (b - 2),
        [NAN] + [1.0] * (b - 1),  # non-finite -> scale NaN, codes 0
        [INF] + [1.0] * (b - 1),
        [-INF] * b,
        [0.5 * (i - 16) for i in range(b)],  # exact halves: ties to even
        [1e39, 1.0] + [0.0] * (b - 2),  # float64: beyond float32 range -> inf
        [1e-50, 1e-50] + [0.0] * (b - 2),  # float64: rounds to 0 in float32
        [3e-45, -1.4e-45] + [0.0] * (b - 2),
    ]
    x = torch.tensor(sum(blocks, []), dtype=torch.float64).to(dtype)
    for rounding in ROUNDINGS:
        for seed in (0, 1, 2**64 - 1):
            check_quantize(x, b, rounding, seed, 9)
            check_quantize(x[:-5], b, rounding, seed, 9)


def test_quantize_noncontiguous_and_shapes():
    base = make(64 * 75, torch.float32, seed=3).view(64, 75)
    for x in (base[:, ::2], base.t(), base[3:, 5:60], base.view(-1)[::3]):
        assert not x.is_contiguous()
        for rounding in ROUNDINGS:
            check_quantize(x, 32, rounding, 5, 6)
    check_quantize(base.to(torch.bfloat16).t(), 64, "stochastic", 1, 1)


def test_quantize_into_preallocated_outputs():
    x = make(1000, torch.float16, seed=4)
    q = torch.full((1000,), 99, dtype=torch.int8)
    s = torch.empty(4, dtype=torch.float32)
    q1, s1 = K.quantize_int8(x, 256, "stochastic", 3, 4, out_q=q, out_scales=s, backend="cpu")
    assert q1.data_ptr() == q.data_ptr() and s1.data_ptr() == s.data_ptr()
    q2, s2 = K.quantize_int8(x, 256, "stochastic", 3, 4, backend="reference")
    assert_bits_equal(q, q2, "codes")
    assert_bits_equal(s, s2, "scales")


def test_quantize_same_result_for_any_thread_count():
    x = make(2**19 + 13, torch.float32, seed=8, special_rate=1e-4)
    before = C.get_num_threads()
    try:
        results = []
        for t in (1, 2, 3):
            C.set_num_threads(t)
            results.append(K.quantize_int8(x, 128, "stochastic", 1, 2, backend="cpu"))
    finally:
        C.set_num_threads(0)
    assert C.get_num_threads() == before
    for q, s in results[1:]:
        assert_bits_equal(q, results[0][0], "codes")
        assert_bits_equal(s, results[0][1], "scales")


# ---------------------------------------------------------------------------
# dequantize_int8, dequantize_int8_add_


@given(
    n=st.sampled_from(SMALL_SIZES),
    block=st.sampled_from([32, 128, 2048]),
    out_dtype=st.sampled_from([None] + DTYPES),
    data_seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([1.0, 1e-40, 1e38, 6e4]),
)
def test_dequantize_matches_reference(n, block, out_dtype, data_seed, scale):
    x = make(n, torch.float32, data_seed, scale, special_rate=0.01, zero_block=block)
    q, s = K.quantize_int8(x, block, "nearest", backend="reference")
    if out_dtype is None:
        d1 = K.dequantize_int8(q, s, block, backend="cpu")
        d2 = K.dequantize_int8(q, s, block, backend="reference")
    else:
        o1, o2 = torch.empty(n, dtype=out_dtype), torch.empty(n, dtype=out_dtype)
        d1 = K.dequantize_int8(q, s, block, out=o1, backend="cpu")
        d2 = K.dequantize_int8(q, s, block, out=o2, backend="reference")
        assert d1 is o1
    assert_bits_equal(d1, d2, "dequantized")

    acc1 = make(n, torch.float32, data_seed + 1, special_rate=0.05)
    acc2 = acc1.clone()
    r = K.dequantize_int8_add_(acc1, q, s, block, backend="cpu")
    K.dequantize_int8_add_(acc2, q, s, block, backend="reference")
    assert r is acc1
    assert_bits_equal(acc1, acc2, "accumulated")


def test_dequantize_arbitrary_codes_and_scales():
    g = torch.Generator().manual_seed(1)
    n, block = 3000, 32
    q = torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)  # -128 too
    s = torch.randn(-(-n // block), generator=g) * torch.logspace(-42, 38, -(-n // block))
    s[3], s[4], s[5] = NAN, INF, -0.0
    for dt in DTYPES:
        o1, o2 = torch.empty(n, dtype=dt), torch.empty(n, dtype=dt)
        K.dequantize_int8(q, s, block, out=o1, backend="cpu")
        K.dequantize_int8(q, s, block, out=o2, backend="reference")
        assert_bits_equal(o1, o2, f"dequantized to {dt}")


@pytest.mark.parametrize("offset", [0, 1, 3, 4, 8])  # floats: 4 is 16- but not 32-byte aligned
@pytest.mark.parametrize("block", [32, 256])
def test_dequantize_large_output_any_alignment(offset, block):
    # 2**21 + 37 elements: the native kernel writes float32 outputs this large
    # with non-temporal stores, aligned inside each block, plain at the edges
    n = 2**21 + 37
    g = torch.Generator().manual_seed(offset + block)
    q = torch.randint(-127, 128, (n,), dtype=torch.int8, generator=g)
    s = torch.rand(-(-n // block), generator=g) * 0.01
    s[::97] = 0.0
    s[5] = NAN
    big = torch.full((n + offset,), -7.0)
    out = big[offset:]  # 4 * offset bytes past an aligned start
    assert K.dequantize_int8(q, s, block, out=out, check_int8=bool(offset % 2), backend="cpu") is out
    assert_bits_equal(out, K.dequantize_int8(q, s, block, backend="reference"), "dequantized")
    assert bool((big[:offset] == -7.0).all())  # nothing written before the output


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("n", [1000, 2**17 + 5])  # one thread / several
def test_check_int8_rejects_minus_128(backend, n):
    g = torch.Generator().manual_seed(n)
    block = 64
    q = torch.randint(-127, 128, (n,), dtype=torch.int8, generator=g)
    s = torch.rand(-(-n // block), generator=g)
    acc = torch.randn(n, generator=g)
    # valid codes: checking changes nothing
    assert_bits_equal(K.dequantize_int8(q, s, block, check_int8=True, backend=backend),
                      K.dequantize_int8(q, s, block, backend="reference"), "checked dequantize")
    a1, a2 = acc.clone(), acc.clone()
    K.dequantize_int8_add_(a1, q, s, block, check_int8=True, backend=backend)
    K.dequantize_int8_add_(a2, q, s, block, backend="reference")
    assert_bits_equal(a1, a2, "checked dequantize_add")
    r1, r2 = acc.clone(), acc.clone()
    c1 = K.reduce_quantize_int8(r1, q, s, block, 2, check_int8=True, decode=True, backend=backend)
    c2 = K.reduce_quantize_int8(r2, q, s, block, 2, decode=True, backend="reference")
    assert_bits_equal(c1[0], c2[0], "checked reduce codes")
    assert_bits_equal(r1, r2, "checked reduce acc")
    # one code of -128 in a middle block: every op raises when checking
    q[n // 2 + 3] = -128
    with pytest.raises(gc.PayloadError, match="-128"):
        K.dequantize_int8(q, s, block, check_int8=True, backend=backend)
    with pytest.raises(gc.PayloadError, match="-128"):
        K.dequantize_int8_add_(acc.clone(), q, s, block, check_int8=True, backend=backend)
    with pytest.raises(gc.PayloadError, match="-128"):
        K.reduce_quantize_int8(acc.clone(), q, s, block, 2, check_int8=True, backend=backend)
    with pytest.raises(TypeError, match="check_int8 must be True or False"):
        K.dequantize_int8(q, s, block, check_int8=None, backend=backend)
    with pytest.raises(TypeError, match="check_int8 must be True or False"):
        K.reduce_quantize_int8(acc.clone(), q, s, block, check_int8=1, backend=backend)
    # and reads it as it is when not asked to check
    d = K.dequantize_int8(q, s, block, backend=backend)
    assert float(d[n // 2 + 3]) == -128 * float(s[(n // 2 + 3) // block])
    # a negative or infinite scale is out of range too; NaN (a non-finite block) is not
    q[n // 2 + 3] = 0
    for bad in (-1.0, float("inf"), float("-inf")):
        s2 = s.clone()
        s2[-1] = bad
        with pytest.raises(gc.PayloadError, match="scale"):
            K.dequantize_int8(q, s2, block, check_int8=True, backend=backend)
        with pytest.raises(gc.PayloadError, match="scale"):
            K.reduce_quantize_int8(acc.clone(), q, s2, block, check_int8=True, backend=backend)
    s2 = s.clone()
    s2[0] = NAN
    s2[1] = -0.0
    assert bool(K.dequantize_int8(q, s2, block, check_int8=True, backend=backend)[:block].isnan().all())


def test_dequantize_out_of_other_shape():
    x = make(600, torch.float32, seed=2)
    q, s = K.quantize_int8(x, 64, backend="cpu")
    out = torch.empty(20, 30, dtype=torch.bfloat16)
    ref = torch.empty(20, 30, dtype=torch.bfloat16)
    assert K.dequantize_int8(q, s, 64, out=out, backend="cpu") is out
    K.dequantize_int8(q, s, 64, out=ref, backend="reference")
    assert_bits_equal(out, ref)


# ---------------------------------------------------------------------------
# quantize_int8_ef (fused error feedback)


@given(
    n=st.sampled_from(SMALL_SIZES),
    block=st.sampled_from([32, 256, 4096]),
    dtype=st.sampled_from(DTYPES),
    rounding=st.sampled_from(ROUNDINGS),
    seed=st.integers(0, 2**64 - 1),
    counter=st.integers(0, 2**64 - 1),
    special_rate=st.sampled_from([0.0, 0.02]),
    data_seed=st.integers(0, 2**31 - 1),
)
def test_quantize_ef_matches_reference(n, block, dtype, rounding, seed, counter, special_rate, data_seed):
    x = make(n, dtype, data_seed, 1.0, special_rate, zero_block=block if data_seed % 2 else None)
    res1 = make(n, torch.float32, data_seed + 1, 0.01, special_rate / 2)
    res2 = res1.clone()
    for step in range(2):  # the second step starts from the updated residual
        q1, s1 = K.quantize_int8_ef(x, res1, block, rounding, seed, counter + step, backend="cpu")
        q2, s2 = K.quantize_int8_ef(x, res2, block, rounding, seed, counter + step, backend="reference")
        assert_bits_equal(q1, q2, "codes")
        assert_bits_equal(s1, s2, "scales")
        assert_bits_equal(res1, res2, "residual")


def test_quantize_ef_large_and_special():
    n = 2**20 + 5
    x = make(n, torch.float32, seed=5, special_rate=1e-5)
    x[:256] = 0.0
    r1 = torch.zeros(n)
    r2 = torch.zeros(n)
    for step in range(3):
        q1, s1 = K.quantize_int8_ef(x, r1, 256, "stochastic", 1, step, backend="cpu")
        q2, s2 = K.quantize_int8_ef(x, r2, 256, "stochastic", 1, step, backend="reference")
        assert_bits_equal(q1, q2, "codes")
        assert_bits_equal(s1, s2, "scales")
        assert_bits_equal(r1, r2, "residual")


# ---------------------------------------------------------------------------
# topk, threshold, approx_topk


def tie_heavy(n, dtype, seed):
    """Magnitudes from a tiny set: ties everywhere, +x and -x, zeros, NaN, +-Inf."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, NAN, INF, -INF, 1e-40, 3.0])
    x = vals[torch.randint(len(vals), (n,), generator=g)]
    return x.to(dtype)


def check_selection(got, want, what):
    assert_bits_equal(got[0], want[0], f"{what} indices")
    assert_bits_equal(got[1], want[1], f"{what} values")


@given(
    n=st.sampled_from(SMALL_SIZES),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(["randn", "ties", "specials", "constant"]),
    density=st.floats(0.0, 1.0),
    data_seed=st.integers(0, 2**31 - 1),
)
def test_topk_matches_reference(n, dtype, kind, density, data_seed):
    if kind == "randn":
        x = make(n, dtype, data_seed)
    elif kind == "ties":
        x = tie_heavy(n, dtype, data_seed)
    elif kind == "specials":
        x = make(n, dtype, data_seed, special_rate=0.2)
    else:
        x = torch.full((n,), -0.25, dtype=dtype)
        x[::3] = 0.25
    k = min(n, int(round(density * n)))
    check_selection(K.topk(x, k, backend="cpu"), K.topk(x, k, backend="reference"), "topk")


@pytest.mark.slow  # large inputs: seconds each
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_large_parallel_ties(dtype):
    n = 2**20 + 3
    x = tie_heavy(n, dtype, seed=4)
    y = make(n, dtype, seed=5)
    try:
        for t in (1, 2):
            C.set_num_threads(t)
            for k in (1, 1000, n // 100, n // 2):
                check_selection(K.topk(x, k, backend="cpu"), K.topk(x, k, backend="reference"), "ties")
            check_selection(K.topk(y, n // 1000, backend="cpu"), K.topk(y, n // 1000, backend="reference"), "randn")
    finally:
        C.set_num_threads(0)


def test_topk_index_dtype_and_values():
    x = torch.tensor([1.0, -5.0, 3.0, NAN, -INF, 2.0])
    i, v = K.topk(x, 3, backend="cpu")
    assert i.dtype == torch.int32 and i.tolist() == [1, 3, 4]  # ascending
    assert torch.equal(v.isnan(), torch.tensor([False, True, False]))
    assert v[0].item() == -5.0 and v[2].item() == -INF


@given(
    n=st.sampled_from(SMALL_SIZES),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(["randn", "ties", "specials"]),
    tau=st.sampled_from([0.0, -0.0, 1e-45, 1e-40, 0.5, 1.0, 1.0000001, 2.0, 1.5, 65504.0, 65520.0, 3e38, 1e300]),
    data_seed=st.integers(0, 2**31 - 1),
)
def test_threshold_matches_reference(n, dtype, kind, tau, data_seed):
    if kind == "randn":
        x = make(n, dtype, data_seed)
    elif kind == "ties":
        x = tie_heavy(n, dtype, data_seed)
    else:
        x = make(n, dtype, data_seed, special_rate=0.2)
    check_selection(K.threshold(x, tau, backend="cpu"), K.threshold(x, tau, backend="reference"), "threshold")


@pytest.mark.slow  # large inputs: seconds each
@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_large_and_float64_precision(dtype):
    x = make(2**20 + 1, dtype, seed=6, special_rate=1e-4)
    for tau in (0.0, 1.0, 3.3, 1.0 + 2**-40):
        check_selection(K.threshold(x, tau, backend="cpu"), K.threshold(x, tau, backend="reference"), "threshold")
    # float64 compares in float64: 1 + 2**-40 keeps 1 + 2**-39 and drops 1.0
    y = torch.tensor([1.0, 1.0 + 2**-39, -1.0 - 2**-41], dtype=torch.float64)
    assert K.threshold(y, 1.0 + 2**-40, backend="cpu")[0].tolist() == [1]


def check_approx_contract(x, k, idx, val):
    n = x.numel()
    flat = x.reshape(-1)
    c = idx.numel()
    lo, hi = math.ceil(0.9 * k), math.floor(1.1 * k)
    assert lo <= c <= hi or c == k, f"kept {c} for k={k}"
    assert idx.dtype == R.index_dtype(n) and val.dtype == x.dtype
    if c:
        assert bool((idx[1:] > idx[:-1]).all()), "indices not strictly ascending"
        assert 0 <= int(idx[0]) and int(idx[-1]) < n
        assert_bits_equal(val, flat[idx.long()], "values")
    # top set: min kept magnitude >= max dropped magnitude (NaN largest)
    a = flat.to(torch.float64).abs()
    rank = torch.where(a.isnan(), torch.full_like(a, float("inf")), a)
    nan = a.isnan()
    kept = torch.zeros(n, dtype=torch.bool)
    kept[idx.long()] = True
    if c and c < n:
        if bool(nan[~kept].any()):
            assert bool(nan[kept].all()), "dropped a NaN while keeping a number"
        else:
            kmin = rank[kept & ~nan].min() if bool((kept & ~nan).any()) else float("inf")
            assert kmin >= rank[~kept].max(), "not a top set"


@given(
    n=st.sampled_from([1, 2, 97, 1009, 5000, 20011]),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(["randn", "ties", "specials", "layered"]),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 1.0]),
    data_seed=st.integers(0, 2**31 - 1),
)
def test_approx_topk_contract(n, dtype, kind, density, data_seed):
    if kind == "randn":
        x = make(n, dtype, data_seed)
    elif kind == "ties":
        x = tie_heavy(n, dtype, data_seed)
    elif kind == "specials":
        x = make(n, dtype, data_seed, special_rate=0.05)
    else:  # magnitudes growing along the tensor: a coarse sample misjudges them
        x = (make(n, torch.float64, data_seed) * torch.logspace(-3, 3, n, dtype=torch.float64)).to(dtype)
    k = int(round(density * n))
    idx, val = K.approx_topk(x, k, backend="cpu")
    check_approx_contract(x, k, idx, val)


def test_approx_topk_paths():
    n = 2**20
    x = make(n, torch.float32, seed=9)
    for k in (n // 100, n // 1000, n // 10000):
        got = K.approx_topk(x, k, backend="cpu")
        check_approx_contract(x, k, *got)
        if R.approx_topk_sample_size(n, k) <= C._APPROX_MAX_SAMPLE:
            # the same strided sample as the reference: the same set
            check_selection(got, K.approx_topk(x, k, backend="reference"), "approx_topk")
    # too many kept (ties at the estimated threshold): exactly k, the exact top k
    t = tie_heavy(n, torch.float32, seed=10)
    got = K.approx_topk(t, 5000, backend="cpu")
    check_approx_contract(t, 5000, *got)
    check_selection(got, K.topk(t, 5000, backend="reference"), "approx_topk (too many)")
    # too few kept: the only large values sit on the sample points -> exact topk
    k = 1000
    stride = n // min(R.approx_topk_sample_size(n, k), C._APPROX_MAX_SAMPLE)
    y = make(n, torch.float32, seed=12)
    y[: 100 * stride : stride] = 5.0
    got = K.approx_topk(y, k, backend="cpu")
    check_approx_contract(y, k, *got)
    check_selection(got, K.topk(y, k, backend="reference"), "approx_topk (too few)")


@pytest.mark.slow  # large inputs: seconds
def test_topk_when_the_sampled_bound_misses():
    # the exact path through the histogram: the sample points hold the largest
    # values, so the sampled lower bound lies above the k-th largest
    n = 2**20 + 7
    stride = n // min(2**14, n // 4)  # the kernel's sample points (bound_sample_size)
    for dtype in DTYPES:
        x = make(n, dtype, seed=13)
        x[::stride] = torch.arange(1000, 1000 + len(range(0, n, stride)), dtype=torch.float64).to(dtype)
        for k in (5000, 2**17):
            check_selection(K.topk(x, k, backend="cpu"), K.topk(x, k, backend="reference"), "topk (histogram)")


@pytest.mark.parametrize("threads", [1, 2])
def test_dgc_topk_fused_matches_the_reference_over_steps(threads):
    # the fused momentum correction + top-k against the pure-PyTorch reference
    # (u = u m + g s, v += u; stable sort of |v|), with the sent coordinates
    # masked between steps; n is no multiple of the fused pass's 1024-element
    # blocks or of 32, two threads split it in two chunks; the steps bring ties
    # (the first: v is the gradient), a scale, NaN / Inf, and a gradient whose
    # largest values sit on the sample points (the sampled bound misses: the
    # histogram path runs over v)
    n = 2**17 + 5
    stride = n // min(2**14, n // 4)  # the kernel's sample points (bound_sample_size)
    g = torch.Generator().manual_seed(21)
    ties = (torch.randint(-3, 4, (n,), generator=g) * 0.5).float()
    on_sample = make(n, seed=23)
    on_sample[::stride] = torch.arange(1e4, 1e4 + len(range(0, n, stride)))
    steps = [(ties, 1.0, 2000)] + [(make(n, seed=s), 1.0, 3000) for s in range(3)] + [
        (make(n, seed=3), 0.37, 130), (make(n, seed=4, scale=1e3, special_rate=0.002), 0.5, 400),
        (on_sample, 1.0, 5000)]
    got_u, got_v = torch.zeros(n), torch.zeros(n)
    want_u, want_v = torch.zeros(n), torch.zeros(n)
    try:
        C.set_num_threads(threads)
        for step, (grad, scale, k) in enumerate(steps):
            got = K.dgc_topk_(grad, got_u, got_v, 0.9, scale, k, backend="cpu")
            want_u.mul_(0.9).add_(grad * scale if scale != 1.0 else grad)
            want_v.add_(want_u)
            order = torch.sort(want_v.abs(), descending=True, stable=True).indices[:k].sort().values
            check_selection(got, (order.int(), want_v[order]), f"step {step} selection")
            assert_bits_equal(got_u, want_u, f"step {step} u")
            assert_bits_equal(got_v, want_v, f"step {step} v")
            for t in (got_u, got_v, want_u, want_v):
                t.index_fill_(0, order, 0.0)
    finally:
        C.set_num_threads(0)


# ---------------------------------------------------------------------------
# scatter_add_


@given(
    n=st.sampled_from([1, 2, 97, 1009]),
    m=st.sampled_from([0, 1, 5, 300, 3000]),
    idx_dtype=st.sampled_from([torch.int32, torch.int64]),
    val_dtype=st.sampled_from(DTYPES),
    data_seed=st.integers(0, 2**31 - 1),
)
def test_scatter_add_matches_reference(n, m, idx_dtype, val_dtype, data_seed):
    g = torch.Generator().manual_seed(data_seed)
    idx = torch.randint(n, (m,), generator=g).to(idx_dtype)  # duplicates accumulate in order
    vals = make(m, val_dtype, data_seed + 1, scale=1e3, special_rate=0.01 if val_dtype != torch.float16 else 0.0)
    acc1 = make(n, torch.float32, data_seed + 2, special_rate=0.05)
    acc2 = acc1.clone()
    assert K.scatter_add_(acc1, idx, vals, backend="cpu") is acc1
    K.scatter_add_(acc2, idx, vals, backend="reference")
    assert_bits_equal(acc1, acc2, "acc")


@pytest.mark.parametrize("bad", [-1, 10, 2**31 - 1, -(2**31)])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_scatter_add_out_of_bounds_raises(bad, idx_dtype):
    acc = torch.zeros(10)
    idx = torch.tensor([0, 3, bad, 9], dtype=idx_dtype)
    with pytest.raises(ValueError, match="out of bounds"):
        K.scatter_add_(acc, idx, torch.ones(4), backend="cpu")
    assert bool((acc == 0).all()), "acc was written before the bounds check"
    with pytest.raises(ValueError, match="out of bounds"):
        K.scatter_add_(torch.zeros(0), torch.tensor([0], dtype=idx_dtype), torch.ones(1), backend="cpu")
    big = torch.randint(10, (2**17,), dtype=idx_dtype)
    big[-1] = bad
    with pytest.raises(ValueError, match=r"indices\[131071\]"):
        K.scatter_add_(acc, big, torch.ones(2**17), backend="cpu")


# ---------------------------------------------------------------------------
# backend module: errors, empty inputs, laziness, threads


def test_empty_inputs():
    for dt in DTYPES:
        x = torch.empty(0, dtype=dt)
        q, s = K.quantize_int8(x, backend="cpu")
        assert q.shape == (0,) and s.shape == (0,)
        assert K.dequantize_int8(q, s, backend="cpu").shape == (0,)
        r = torch.empty(0)
        K.quantize_int8_ef(x, r, backend="cpu")
        for i, v in (K.topk(x, 0, backend="cpu"), K.threshold(x, 1.0, backend="cpu"), K.approx_topk(x, 0, backend="cpu")):
            assert i.dtype == torch.int32 and i.numel() == 0 and v.dtype == dt and v.numel() == 0
        K.scatter_add_(torch.zeros(3), torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=dt), backend="cpu")


def test_backend_argument_errors():
    """The native kernels (schema arguments, see gradcomp.kernels.ops) check
    their buffers themselves: they can be called through torch.ops directly."""
    x = torch.randn(100)
    q = torch.empty(100, dtype=torch.int8)
    s = torch.empty(4)
    with pytest.raises(ValueError, match="q must"):
        C.quantize_int8(x, 32, False, 0, torch.empty(99, dtype=torch.int8), s)
    with pytest.raises(ValueError, match="scales"):
        C.quantize_int8(x, 32, False, 0, q, torch.empty(3))
    with pytest.raises(ValueError, match="block_size"):
        C.quantize_int8(x, 0, False, 0, q, s)
    with pytest.raises(ValueError, match="residual"):
        C.quantize_int8_ef(x, torch.zeros(99), 32, False, 0, q, s)
    with pytest.raises(ValueError, match="scales"):
        C.dequantize_int8(q, torch.ones(3), 32, False, torch.empty(100))
    with pytest.raises(ValueError, match="out"):
        C.dequantize_int8(q, torch.ones(4), 32, False, torch.empty(99))
    with pytest.raises(TypeError, match="out"):
        C.dequantize_int8(q, torch.ones(4), 32, False, torch.empty(100, dtype=torch.int32))
    with pytest.raises(ValueError, match="acc"):
        C.dequantize_int8_add_(torch.zeros(99), q, torch.ones(4), 32, False)
    with pytest.raises(TypeError, match="x"):
        C.topk(torch.arange(10), 3)
    with pytest.raises(ValueError, match="tau"):
        C.threshold(x, -1.0)
    with pytest.raises(ValueError, match="values"):
        C.scatter_add_(torch.zeros(10), torch.zeros(3, dtype=torch.int64), torch.ones(2))
    assert registry.auto_kernel("quantize_int8", "cpu") is C.quantize_int8
    with pytest.raises(ValueError, match="q must"):  # the same check through the dispatcher
        torch.ops.gradcomp.quantize_int8(x, 32, False, 0, torch.empty(99, dtype=torch.int8), s)
    native = C.native()
    with pytest.raises(ValueError, match="dtype"):
        native.topk(x.numpy(), "float8", 3)
    with pytest.raises(ValueError, match="x must be a 1-D array"):
        native.topk(x.view(10, 10).numpy(), "float32", 3)
    with pytest.raises(ValueError, match="contiguous"):
        native.topk(x.numpy()[::2], "float32", 3)
    with pytest.raises(ValueError, match="writable"):
        ro = torch.empty(100, dtype=torch.int8).numpy()
        ro.setflags(write=False)
        native.quantize_int8(x.numpy(), "float32", 32, False, 0, ro, torch.empty(4).numpy())


def test_registry_and_threads():
    assert K.available_backends()["cpu"] is None
    assert C.unavailable_reason() is None and C.devices() == frozenset({"cpu"})
    info = C.native().build_info()
    assert isinstance(info["openmp"], bool)
    with pytest.raises(ValueError):
        C.set_num_threads(-1)


@pytest.mark.slow
def test_import_is_lazy():
    code = (
        "import sys, torch, gradcomp, gradcomp.kernels.cpu as c\n"
        "assert 'gradcomp._C' not in sys.modules\n"
        "gradcomp.kernels.quantize_int8(torch.ones(4))\n"
        "assert 'gradcomp._C' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kernels_release_the_gil():
    x = make(2**18, torch.float32, seed=1)
    want = K.quantize_int8(x, 256, "stochastic", 1, 1, backend="reference")
    out, errors = [], []

    def work():
        try:
            for _ in range(5):
                out.append(K.quantize_int8(x, 256, "stochastic", 1, 1, backend="cpu"))
                K.topk(x, 100, backend="cpu")
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for q, s in out:
        assert_bits_equal(q, want[0])
        assert_bits_equal(s, want[1])
