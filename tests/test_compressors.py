"""Compressor objects: round trips, properties, error feedback, bad arguments."""

import math
import pickle

import pytest
import torch
from hypothesis import given, strategies as st

import gradcomp as gc

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def all_compressors():
    return [
        gc.NoCompression(),
        gc.FP16(),
        gc.BF16(),
        gc.Int8Quantizer(block_size=32),
        gc.Int8Quantizer(block_size=64, rounding="stochastic", seed=3),
        gc.TopK(ratio=0.1),
        gc.TopK(ratio=0.1, values=gc.Int8Quantizer(block_size=32)),
        gc.TopK(ratio=0.1, exact=False),
        gc.Threshold(0.5),
        gc.ErrorFeedback(gc.Int8Quantizer(block_size=32)),
        gc.ErrorFeedback(gc.TopK(ratio=0.2)),
    ]


@given(
    ci=st.integers(0, 10),
    n=st.sampled_from([0, 1, 2, 31, 33, 97, 1024]),
    dtype=st.sampled_from(DTYPES),
    transpose=st.booleans(),
)
def test_round_trip_shape_dtype_and_acc(ci, n, dtype, transpose):
    c = all_compressors()[ci]
    x = torch.randn(n, 3, dtype=torch.float64).to(dtype)
    if transpose:
        x = x.t()
    p = c.compress(x) if not isinstance(c, gc.ErrorFeedback) else c.compress(x, key="k")
    assert p.wire.dtype == torch.uint8 and p.wire.dim() == 1 and p.nbytes == p.wire.numel()
    y = c.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    acc = torch.ones(x.numel())
    c.decompress_add_(p, acc)
    ref = c.decompress(gc.decode(p.wire)).reshape(-1).float()  # rounded to x's dtype
    eps = torch.finfo(dtype).eps
    assert torch.allclose(acc - 1, ref, rtol=2 * eps, atol=1e-5)


def test_noncontiguous_same_as_contiguous_copy():
    x = torch.randn(40, 50)[::2, 1::3]
    for c in all_compressors()[:9]:
        a = c.clone().compress(x)
        b = c.clone().compress(x.contiguous())
        assert torch.equal(a.wire, b.wire), c


def test_no_compression_is_exact():
    for dtype in DTYPES:
        x = torch.randn(7, 9, dtype=torch.float64).to(dtype)
        assert torch.equal(gc.NoCompression().decompress(gc.NoCompression().compress(x)), x)


def test_fp16_keeps_finite_values_finite_and_exact_scaling():
    x = torch.tensor([1e6, -3e5, 2.0, 0.0, 65504.0 * 4])
    c = gc.FP16()
    p = c.compress(x)
    assert p.exponent > 0
    y = c.decompress(p)
    assert bool(torch.isfinite(y).all())
    # a power-of-two scale is exact to undo: the result equals float16 rounding of x / 2**e, times 2**e
    expect = (x * 2.0 ** -p.exponent).half().float() * 2.0 ** p.exponent
    assert torch.equal(y, expect)
    # the smallest exponent that fits
    assert float(x.abs().max()) * 2.0 ** -(p.exponent - 1) > 65504
    big = torch.tensor([1e300, -1.0], dtype=torch.float64)
    yb = c.decompress(c.compress(big))
    assert bool(torch.isfinite(yb).all()) and abs(float(yb[0]) / 1e300 - 1) < 1e-3
    # values within float16's range are scaled up to its top binade: 2 * 2**14 = 32768 <= 65504 < 65536
    assert c.compress(torch.tensor([1.0, 2.0])).exponent == -14
    z = c.decompress(c.compress(torch.tensor([float("inf"), 1.0, float("nan")])))
    assert math.isinf(z[0]) and math.isnan(z[2])
    assert c.compress(torch.tensor([float("inf"), 1.0])).exponent == 0  # no scale from a non-finite max


def test_fp16_scales_small_gradients_up_by_a_power_of_two():
    """A gradient of magnitude 1e-8 (below float16's smallest subnormal, 2**-24
    ~ 6e-8) used to come back all zeros."""
    c = gc.FP16()
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1e-8
    for dtype in (torch.float32, torch.float64):
        x = g.to(dtype)
        p = c.compress(x)
        amax = float(x.abs().max())
        # the largest power of two that fits: amax * 2**-e in (32752, 65504]
        assert 65504 / 2 < amax * 2.0 ** -p.exponent <= 65504 and p.exponent < 0
        y = c.decompress(gc.decode(p.wire))
        assert y.dtype == dtype and bool((y != 0).all())
        # exactly undoable: float16 rounding of x * 2**-e (exact in float64), times 2**e
        expect = (x.double() * 2.0 ** -p.exponent).half().double() * 2.0 ** p.exponent
        assert torch.equal(y.double(), expect)
        rel = ((y.double() - x.double()).abs() / x.double().abs())
        big = x.double().abs() >= amax * 2.0 ** -10  # normal float16 range after scaling
        assert float(rel[big].max()) <= 2.0 ** -11  # half an ulp of float16
    # extremes clamp to exponents whose scales are normal numbers
    assert c.compress(torch.tensor([1e-44])).exponent == -126
    assert c.compress(torch.tensor([1e-320], dtype=torch.float64)).exponent == -1022
    tiny = c.decompress(c.compress(torch.tensor([3e-38, 0.0])))
    assert abs(float(tiny[0]) / 3e-38 - 1) < 2.0 ** -10 and tiny[1] == 0


def test_bf16_is_a_cast():
    x = torch.randn(100)
    assert torch.equal(gc.BF16().decompress(gc.BF16().compress(x)), x.bfloat16().float())


def test_int8_counter_advances_and_state_dict():
    c = gc.Int8Quantizer(rounding="stochastic", seed=1)
    x = torch.randn(1000)
    a = c.compress(x).wire
    b = c.compress(x).wire
    assert not torch.equal(a, b)  # the draws differ per call
    sd = c.state_dict()
    d = c.compress(x).wire
    c2 = gc.Int8Quantizer(rounding="stochastic", seed=1)
    c2.load_state_dict(sd)
    assert torch.equal(c2.compress(x).wire, d)
    assert pickle.loads(pickle.dumps(c)).counter == c.counter


@pytest.mark.parametrize("ratio,n,k", [(0.01, 1000, 10), (0.001, 10, 1), (0.3, 10, 3), (1.0, 7, 7), (0.015, 1000, 15)])
def test_topk_k_formula(ratio, n, k):
    t = gc.TopK(ratio=ratio)
    assert t.k_for(n) == max(1, math.ceil(ratio * n)) == k
    p = t.compress(torch.randn(n))
    assert p.nnz == k and p.indices.dtype == torch.int32
    assert bool((p.indices[1:] > p.indices[:-1]).all())


def test_topk_selects_by_magnitude():
    x = torch.tensor([[0.1, -5.0], [3.0, 0.2]])
    y = gc.TopK(k=2).decompress(gc.TopK(k=2).compress(x))
    assert torch.equal(y, torch.tensor([[0.0, -5.0], [3.0, 0.0]]))


def test_nonfinite_propagates():
    x = torch.randn(512)
    x[10] = float("nan")
    x[300] = float("inf")
    for c in [gc.Int8Quantizer(block_size=256), gc.TopK(ratio=0.01), gc.Threshold(1.0), gc.FP16(), gc.BF16()]:
        y = c.decompress(c.compress(x))
        assert not bool(torch.isfinite(y).all()), c
    y = gc.Int8Quantizer(block_size=256).decompress(gc.Int8Quantizer(block_size=256).compress(x))
    assert bool(torch.isnan(y[:256]).all()) and bool(torch.isnan(y[256:]).all())


def test_error_feedback_telescoping_identity():
    torch.manual_seed(0)
    for inner in [gc.Int8Quantizer(block_size=32), gc.TopK(ratio=0.05), gc.FP16(),
                  gc.TopK(ratio=0.05, values=gc.Int8Quantizer(block_size=32)), gc.Threshold(1.0)]:
        ef = gc.ErrorFeedback(inner)
        s_in = torch.zeros(300, dtype=torch.float64)
        s_out = torch.zeros(300, dtype=torch.float64)
        for _ in range(30):
            x = torch.randn(300)
            s_in += x.double()
            s_out += ef.decompress(ef.compress(x, key="w")).double()
        assert torch.allclose(s_out + ef.residual("w").double(), s_in, atol=1e-4), inner


def test_error_feedback_keys_state_dict_and_nonfinite():
    ef = gc.ErrorFeedback(gc.TopK(k=1))
    ef.compress(torch.tensor([1.0, 2.0, 3.0]), key="a")
    ef.compress(torch.tensor([1.0, 2.0]), key="b")
    assert ef.residual("a").tolist() == [1.0, 2.0, 0.0]
    with pytest.raises(ValueError, match="key"):
        ef.compress(torch.randn(5), key="a")
    sd = ef.state_dict()
    ef2 = gc.ErrorFeedback(gc.TopK(k=1))
    ef2.load_state_dict(sd)
    assert torch.equal(ef2.residual("a"), ef.residual("a"))
    p = ef.compress(torch.tensor([float("nan"), 0.0, 0.0]), key="a")
    assert ef.residual("a") is None and ef.nonfinite_resets == 1
    assert not bool(torch.isfinite(ef.decompress(p)).all())


@pytest.mark.parametrize("make", [lambda: gc.ErrorFeedback(gc.TopK(k=1)),
                                  lambda: gc.ErrorFeedback(gc.Int8Quantizer()),
                                  lambda: gc.DGC(gc.TopK(k=1))])
def test_error_feedback_unhashable_key_names_the_argument(make):
    # was a bare "unhashable type: 'list'" from the residual dict
    ef = make()
    with pytest.raises(TypeError, match="key must be hashable .* got list"):
        ef.compress(torch.randn(3), key=[1])
    assert not ef.residuals


@pytest.mark.parametrize("inner", [
    gc.TopK(ratio=0.05), gc.TopK(ratio=0.05, values=gc.Int8Quantizer(block_size=32)),
    gc.TopK(k=7, compact_indices=False), gc.Threshold(1.0), gc.TopK(k=40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_error_feedback_residual_equals_input_less_decoded_bit_for_bit(inner, dtype):
    # the sparse residual is updated at the kept indices only; it must be the
    # same bits as the dense formula p - D(C(p)), signed zeros included
    torch.manual_seed(1)
    ef = gc.ErrorFeedback(inner)
    r = torch.zeros(300)
    for step in range(4):
        x = torch.randn(300).to(dtype)
        if step == 3:
            x[10:] = -0.0  # fewer non-zeros than k: -0.0 elements are kept
        p = ef.compress(x, key="w")
        px = x.to(torch.float32) + r
        want = px - ef.decompress_add_(p, torch.zeros(300))  # the float32 decode, dense
        r = ef.residual("w")
        assert torch.equal(r.view(torch.int32), want.view(torch.int32)), (inner, step)


def test_int8_ef_uses_fused_kernel_equivalently():
    x1, x2 = torch.randn(100), torch.randn(100)
    ef = gc.ErrorFeedback(gc.Int8Quantizer(block_size=32))
    ef.compress(x1, key=0)
    p = ef.compress(x2, key=0)
    # the same computed by composition
    q = gc.Int8Quantizer(block_size=32)
    d1 = q.decompress(q.compress(x1))
    p2 = q.compress(x2 + (x1 - d1))
    assert torch.equal(p.wire, p2.wire)


def test_mismatched_payload_and_compressor():
    p = gc.Int8Quantizer().compress(torch.randn(10))
    with pytest.raises(ValueError, match="codec"):
        gc.TopK(k=1).decompress(p)
    with pytest.raises(ValueError, match="codec"):
        gc.FP16().decompress_add_(p.wire, torch.zeros(10))
    with pytest.raises(ValueError, match="acc"):
        gc.Int8Quantizer().decompress_add_(p, torch.zeros(11))


@pytest.mark.parametrize(
    "make,exc,word",
    [
        (lambda: gc.Int8Quantizer(block_size=0), ValueError, "block_size"),
        (lambda: gc.Int8Quantizer(block_size=100), ValueError, "block_size"),
        (lambda: gc.Int8Quantizer(rounding="floor"), ValueError, "rounding"),
        (lambda: gc.TopK(ratio=0.0), ValueError, "ratio"),
        (lambda: gc.TopK(ratio=1.5), ValueError, "ratio"),
        (lambda: gc.TopK(ratio=-0.1), ValueError, "ratio"),
        (lambda: gc.TopK(), ValueError, "ratio"),
        (lambda: gc.TopK(ratio=0.1, k=3), ValueError, "ratio"),
        (lambda: gc.TopK(k=0), ValueError, "k"),
        (lambda: gc.TopK(k="3"), TypeError, "k"),
        (lambda: gc.Threshold(-1.0), ValueError, "threshold"),
        (lambda: gc.Threshold("x"), TypeError, "threshold"),
        (lambda: gc.ErrorFeedback(3), TypeError, "compressor"),
        (lambda: gc.ErrorFeedback(gc.ErrorFeedback(gc.FP16())), ValueError, "compressor"),
        (lambda: gc.TopK(k=1, values=gc.TopK(k=1)), ValueError, "values"),
    ],
)
def test_bad_arguments(make, exc, word):
    with pytest.raises(exc, match=word):
        make()


def test_bad_tensors():
    with pytest.raises(TypeError, match="t"):
        gc.Int8Quantizer().compress(torch.arange(10))
    with pytest.raises(TypeError):
        gc.FP16().compress([1.0, 2.0])
    with pytest.raises(ValueError, match="k"):
        gc.TopK(k=20).compress(torch.randn(10))


@pytest.mark.parametrize("values, want", [
    ([1.0, -2.0], True), ([3e38, 3e38], True),  # a sum that overflows from finite elements
    ([float("nan"), 1.0], False), ([float("inf"), float("-inf")], False), ([1.0, float("-inf")], False),
    ([], True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_all_finite_is_isfinite_all(values, want, dtype):
    from gradcomp._validate import all_finite

    t = torch.tensor(values, dtype=torch.float32).to(dtype)
    if dtype == torch.float16 and values == [3e38, 3e38]:
        t = torch.tensor([60000.0, 60000.0], dtype=dtype)
    assert all_finite(t) is want
    assert want == bool(torch.isfinite(t).all())


@pytest.mark.parametrize("c", [gc.Int8Quantizer(), gc.TopK(k=3), gc.NoCompression()])
def test_decoding_into_a_tensor_autograd_records_is_refused(c):
    # int8 / top-k wrote such a tensor behind autograd's back (its grad_fn unchanged),
    # NoCompression through autograd: gradients through it were silently wrong
    w = c.compress(torch.arange(100, dtype=torch.float32)).wire
    for decode in (gc.decompress_add_, c.decompress_add_):
        with pytest.raises(ValueError, match="acc must not require grad"):
            decode(w, torch.zeros(100, requires_grad=True) * 1)
    for decode in (gc.decompress, c.decompress):
        with pytest.raises(ValueError, match="out must not require grad"):
            decode(w, out=torch.zeros(100, requires_grad=True))
    acc = torch.zeros(100, requires_grad=True)
    with torch.no_grad():  # how a parameter is updated in place
        gc.decompress_add_(w, acc)
    assert torch.equal(acc.detach(), gc.decompress(w))
