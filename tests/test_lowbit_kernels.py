"""Kernels of the sub-byte and fp8 block codecs: the oracle against hand-computed values, the
native CPU backend against the oracle bit for bit (NaN bit patterns included), and argument errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import backend_checks as C

import gradcomp.kernels as K
from gradcomp.kernels import reference_lowbit as L

CPU = K.available_backends()["cpu"] is None
needs_cpu = pytest.mark.skipif(not CPU, reason="gradcomp._C is not built")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _bits(t):
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(_bits(a), _bits(b)), f"{what}: {int((_bits(a) != _bits(b)).sum())} elements differ"


# ------------------------------------------------------------ the oracle by hand


def test_pack_layout_by_hand():
    # int4: element 2j in the low nibble, 2j + 1 in the high one, two's complement
    assert L.pack(torch.tensor([1, -1, -7, 7, 3]), 4).tolist() == [0xF1, 0x79, 0x03]
    # int2: element 4j + k in bits 2k, 2k + 1
    assert L.pack(torch.tensor([1, -1, 0, 1, -1]), 2).tolist() == [0b01001101, 0b11]
    assert L.pack(torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 1]), 1).tolist() == [0b11111001, 1]
    g = torch.Generator().manual_seed(0)
    for bits in (4, 2):
        q = L.qmax(bits)
        c = torch.randint(-q, q + 1, (1001,), generator=g)
        assert torch.equal(L.unpack(L.pack(c, bits), bits, 1001), c.int())


def test_packed_quantization_by_hand():
    # one block of 32: absmax 3.5, int4 scale 0.5, codes x / 0.5 rounded half to even
    x = torch.zeros(32)
    x[:6] = torch.tensor([3.5, -3.5, 0.25, 0.75, -1.25, 1.0])
    codes, scales = L.quantize_packed(x, 4, 32, False, 0)
    assert scales.tolist() == [0.5] and codes.numel() == 16
    assert L.unpack(codes, 4, 32)[:6].tolist() == [7, -7, 0, 2, -2, 2]
    # int2: scale = absmax, codes round(x / absmax)
    codes, scales = L.quantize_packed(x, 2, 32, False, 0)
    assert scales.tolist() == [3.5] and L.unpack(codes, 2, 32)[:6].tolist() == [1, -1, 0, 0, 0, 0]


def test_stochastic_rounding_is_unbiased():
    x = torch.tensor([0.3, -0.55, 0.9, 0.0, 1.0] + [0.0] * 27)
    acc = torch.zeros(32, dtype=torch.float64)
    trials = 4000
    for counter in range(trials):
        key = __import__("gradcomp").kernels.reference.stream_key(7, counter)
        c, s = L.quantize_packed(x, 2, 32, True, key)
        acc += L.dequantize_packed(c, s, 2, 32, 32).double()
    mean = acc / trials
    # 2-bit codes of a block with absmax 1: Bernoulli draws, standard error <= 0.5 / sqrt(trials)
    assert (mean - x.double()).abs().max() < 4 * 0.5 / math.sqrt(trials)


def test_sign_scale_and_bits_by_hand():
    x = torch.tensor([1.0, -2.0, 3.0, -4.0, 0.0, -0.0] + [0.5] * 26 + [8.0, -8.0])  # blocks of 32: 32 + 2
    codes, scales = L.quantize_sign(x, 32)
    assert scales.tolist() == [(1 + 2 + 3 + 4 + 26 * 0.5) / 32, 8.0]  # mean |x|, exact here
    bits = L.unpack(codes, 1, 34, signed=False).tolist()
    assert bits[:6] == [0, 1, 0, 1, 0, 0] and bits[32:] == [0, 1]  # -0.0 is not negative
    assert codes.numel() == 5 and int(codes[-1]) == 0b10  # padding bits zero
    d = L.dequantize_sign(codes, scales, 32, 34)
    assert d[:4].tolist() == [scales[0].item(), -scales[0].item(), scales[0].item(), -scales[0].item()]


def _halving_then_left_to_right(v):
    """The documented order, written out with numpy float32 scalars."""
    import numpy as np

    tiles = []
    for t0 in range(0, len(v), 256):
        a = [np.float32(e) for e in v[t0:t0 + 256]]
        h = len(a) // 2
        while h:
            a = [a[i] + a[i + h] for i in range(h)]
            h //= 2
        tiles.append(a[0])
    s = tiles[0]
    for t in tiles[1:]:
        s = s + t
    return float(s)


def test_sign_sum_order_is_halving_then_left_to_right():
    g = torch.Generator().manual_seed(5)
    # magnitudes spread over 2**-10 .. 2**24: the float32 sum depends on the order
    v = (torch.exp2(torch.rand(2048, generator=g) * 34 - 10)).tolist()
    got = L.block_abs_sum(torch.tensor(v).view(1, 2048)).item()
    assert got == _halving_then_left_to_right(v)
    naive = torch.tensor(0.0)
    for e in v:
        naive = naive + e
    assert got != naive.item()  # the order matters for these values


def test_sign_scale_never_exceeds_the_absmax():
    x = torch.full((64,), 3.0e38)  # the float32 sum overflows
    _, scales = L.quantize_sign(x, 64)
    assert torch.equal(scales, x[:1])  # min(inf, absmax)


@pytest.mark.parametrize("fmt,dtype,top", [("e4m3", torch.float8_e4m3fn, 448.0), ("e5m2", torch.float8_e5m2, 57344.0)])
def test_fp8_codes_are_torch_casts_of_the_scaled_block(fmt, dtype, top):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, generator=g) * torch.exp2(torch.randint(-20, 20, (100,), generator=g).float())
    codes, scales = L.quantize_fp8(x, fmt, 32)
    m = torch.cat([x, x.new_zeros(28)]).view(4, 32).abs().amax(1)
    # top / m correctly rounded to float32: the float64 quotient rounded once more is (53 >= 2 * 24 + 2)
    inv = (top / m.double()).float()
    want = (torch.cat([x, x.new_zeros(28)]).view(4, 32) * inv[:, None]).to(dtype).view(torch.uint8)
    assert torch.equal(codes, want.reshape(-1)[:100])
    assert torch.equal(scales, m / top)
    assert int(codes.view(dtype).float().abs().max()) == int(top)  # each block's absmax maps to the top


def test_non_finite_and_zero_blocks():
    x = torch.randn(96)
    x[0:32] = 0.0
    x[40] = float("nan")
    x[70] = float("inf")
    nan_bits = 0x7FC00000
    for codes, scales in (L.quantize_packed(x, 4, 32, False, 0), L.quantize_sign(x, 32),
                          L.quantize_fp8(x, "e4m3", 32)):
        assert scales[0].item() == 0.0 and _bits(scales)[1:].tolist() == [nan_bits, nan_bits]
        assert int(codes.max()) == 0  # every code 0
    out = L.dequantize_packed(*L.quantize_packed(x, 4, 32, False, 0), 4, 32, 96)
    assert (out[:32] == 0).all() and out[32:].isnan().all()


# ------------------------------------------------------- the CPU backend, bit for bit

CASES = st.tuples(st.integers(0, 3000), st.sampled_from([32, 64, 256, 1024]), st.sampled_from(DTYPES),
                  st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 10**6))


def _x(n, dtype, seed):
    x = C.data(n, torch.float32, seed=seed)
    return x.to(dtype)


@needs_cpu
@settings(max_examples=40, deadline=None)
@given(CASES, st.sampled_from([4, 2]), st.sampled_from(["nearest", "stochastic"]))
def test_packed_matches_reference(case, bits, rounding):
    n, block, dtype, seed, counter, data_seed = case
    x = _x(n, dtype, data_seed)
    got = K.quantize_packed(x, bits, block, rounding, seed, counter, backend="cpu")
    want = K.quantize_packed(x, bits, block, rounding, seed, counter, backend="reference")
    _same(got[0], want[0], "codes")
    _same(got[1], want[1], "scales")
    r1 = torch.randn(n, generator=torch.Generator().manual_seed(data_seed)) * 0.1
    r2 = r1.clone()
    a = K.quantize_packed_ef(x, r1, bits, block, rounding, seed, counter, backend="cpu")
    b = K.quantize_packed_ef(x, r2, bits, block, rounding, seed, counter, backend="reference")
    _same(a[0], b[0], "ef codes")
    _same(r1, r2, "residual")
    _same(K.dequantize_packed(*a, n, bits, block, backend="cpu"),
          K.dequantize_packed(*a, n, bits, block, backend="reference"), "decoded")
    acc1 = torch.randn(n)
    acc2 = acc1.clone()
    K.dequantize_packed_add_(acc1, *a, bits, block, backend="cpu")
    K.dequantize_packed_add_(acc2, *a, bits, block, backend="reference")
    _same(acc1, acc2, "accumulated")


@needs_cpu
@settings(max_examples=30, deadline=None)
@given(CASES)
def test_sign_and_fp8_match_reference(case):
    n, block, dtype, _, _, data_seed = case
    x = _x(n, dtype, data_seed)
    r = torch.randn(n, generator=torch.Generator().manual_seed(data_seed)) * 0.1
    runs = [("sign", (block,), lambda c, s, **k: K.dequantize_sign(c, s, n, block, **k))]
    runs += [(f, (f, block), lambda c, s, f=f, **k: K.dequantize_fp8(c, s, f, block, **k)) for f in ("e4m3", "e5m2")]
    for name, args, decode in runs:
        quant = K.quantize_sign if name == "sign" else K.quantize_fp8
        quant_ef = K.quantize_sign_ef if name == "sign" else K.quantize_fp8_ef
        a, b = quant(x, *args, backend="cpu"), quant(x, *args, backend="reference")
        _same(a[0], b[0], f"{name} codes")
        _same(a[1], b[1], f"{name} scales")
        r1, r2 = r.clone(), r.clone()
        a, b = quant_ef(x, r1, *args, backend="cpu"), quant_ef(x, r2, *args, backend="reference")
        _same(a[0], b[0], f"{name} ef codes")
        _same(r1, r2, f"{name} residual")
        _same(decode(*a, backend="cpu"), decode(*a, backend="reference"), f"{name} decoded")


@needs_cpu
def test_accumulate_sign_and_fp8_match_reference():
    x = C.data(3001, torch.float32, seed=4)
    acc = torch.randn(3001)
    for codes, scales, add in (
        (*K.quantize_sign(x, 64), lambda a, c, s, **k: K.dequantize_sign_add_(a, c, s, 64, **k)),
        (*K.quantize_fp8(x, "e5m2", 128), lambda a, c, s, **k: K.dequantize_fp8_add_(a, c, s, "e5m2", 128, **k)),
    ):
        a1, a2 = acc.clone(), acc.clone()
        add(a1, codes, scales, backend="cpu")
        add(a2, codes, scales, backend="reference")
        _same(a1, a2, "accumulated")


@needs_cpu
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_reduce_quantize_packed_is_the_composition(bits, rounding):
    for n, block in ((5003, 32), (70001, 1024), (300, 256)):
        x = C.data(n, torch.float32, seed=n)
        codes, scales = K.quantize_packed(x, bits, block)
        for divisor, decode in ((1, False), (3, True), (4, False), (2, True)):
            acc = torch.randn(n, generator=torch.Generator().manual_seed(divisor))
            acc[7] = float("nan") if n > 300 else acc[7]
            a1, a2 = acc.clone(), acc.clone()
            q1 = K.reduce_quantize_packed(a1, codes, scales, bits, block, divisor, rounding, 5, 9, decode=decode,
                                          backend="cpu")
            q2 = K.reduce_quantize_packed(a2, codes, scales, bits, block, divisor, rounding, 5, 9, decode=decode,
                                          backend="reference")
            _same(q1[0], q2[0], "codes")
            _same(q1[1], q2[1], "scales")
            _same(a1, a2, "acc")


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_large_and_parallel(dtype):
    """Zero, NaN / Inf and subnormal blocks, several threads, every dtype, bit for bit."""
    from gradcomp.kernels import cpu

    n = 2**18 + 77
    x = C.data(n, torch.float32, seed=11)
    x[1000:1300] = 0.0
    x[5000:5010] = torch.tensor([1e-41, -3e-39, 2e-45, 0.0, -0.0, 1e-44, 5e-42, -1e-40, 1e-39, 0.0])
    x = x.to(dtype)
    calls = [lambda b: K.quantize_packed(x, 4, 256, "stochastic", 1, 2, backend=b),
             lambda b: K.quantize_packed(x, 2, 64, "nearest", backend=b),
             lambda b: K.quantize_sign(x, 1024, backend=b),
             lambda b: K.quantize_sign(x, 32, backend=b),
             lambda b: K.quantize_fp8(x, "e4m3", 32, backend=b),
             lambda b: K.quantize_fp8(x, "e5m2", 2048, backend=b)]
    before = cpu.get_num_threads()
    try:
        for threads in (1, 2):
            cpu.set_num_threads(threads)
            for call in calls:
                a, b = call("cpu"), call("reference")
                _same(a[0], b[0], "codes")
                _same(a[1], b[1], "scales")
    finally:
        cpu.set_num_threads(before)


@needs_cpu
def test_strided_and_shaped_inputs_read_as_their_contiguous_copy():
    base = torch.randn(64, 80, generator=torch.Generator().manual_seed(2))
    view = base[:, ::2].t()  # non-contiguous
    for fn in (lambda t: K.quantize_packed(t, 4, 32, "stochastic", 3, 1), lambda t: K.quantize_sign(t, 64),
               lambda t: K.quantize_fp8(t, "e5m2", 32)):
        a, b = fn(view), fn(view.contiguous().view(-1))
        _same(a[0], b[0], "codes")
        _same(a[1], b[1], "scales")


def test_empty_inputs():
    x = torch.empty(0)
    for codes, scales in (K.quantize_packed(x), K.quantize_sign(x), K.quantize_fp8(x)):
        assert codes.numel() == 0 and scales.numel() == 0 and codes.dtype == torch.uint8
    assert K.dequantize_packed(torch.empty(0, dtype=torch.uint8), torch.empty(0), 0).numel() == 0


def test_preallocated_outputs_are_written():
    x = torch.randn(100)
    codes, scales = torch.empty(50, dtype=torch.uint8), torch.empty(4)
    c, s = K.quantize_packed(x, 4, 32, out_codes=codes, out_scales=scales)
    assert c.data_ptr() == codes.data_ptr() and s.data_ptr() == scales.data_ptr()
    out = torch.empty(100)
    assert K.dequantize_packed(codes, scales, 100, 4, 32, out=out) is out
    torch.testing.assert_close(out, x, atol=float(scales.max()) / 2 + 1e-6, rtol=0)


def test_bad_arguments_name_the_argument_and_the_allowed_values():
    x = torch.randn(100)
    with pytest.raises(ValueError, match=r"bits must be one of \(4, 2\), got 3"):
        K.quantize_packed(x, 3)
    with pytest.raises(ValueError, match=r"format must be one of \('e4m3', 'e5m2'\), got 'e4m3fnuz'"):
        K.quantize_fp8(x, "e4m3fnuz")
    with pytest.raises(ValueError, match="block_size must be a power of two from 32 to 65536"):
        K.quantize_sign(x, 100)
    with pytest.raises(ValueError, match="rounding must be one of"):
        K.quantize_packed(x, 4, 32, "up")
    with pytest.raises(TypeError, match="x must have dtype in"):
        K.quantize_packed(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_codes must be a contiguous torch.uint8 tensor of 50 elements"):
        K.quantize_packed(x, 4, 32, out_codes=torch.empty(49, dtype=torch.uint8))
    codes, scales = K.quantize_packed(x, 4, 32)
    with pytest.raises(ValueError, match="codes must have 51 bytes for 101 elements"):
        K.dequantize_packed(codes, scales, 101, 4, 32)
    with pytest.raises(ValueError, match=r"scales must have ceil\(n / block_size\) = 2 elements"):
        K.dequantize_packed(codes, scales, 100, 4, 64)
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor"):
        K.dequantize_packed(codes, scales, 100, 4, 32, out=torch.empty(100, dtype=torch.float64))
    with pytest.raises(ValueError, match="divisor must be >= 1"):
        K.reduce_quantize_packed(torch.zeros(100), codes, scales, 4, 32, 0)
    with pytest.raises(TypeError, match="codes must have dtype in \\(uint8\\)"):
        K.dequantize_sign(codes.to(torch.int8), scales, 100, 32)


def test_public_functions_trace_under_torch_compile():
    torch._dynamo.reset()

    def step(x, residual, acc):
        c, s = K.quantize_packed_ef(x * 2.0, residual, 4, 64, "stochastic", 3, 4)
        K.dequantize_packed_add_(acc, c, s, 4, 64)
        c2, s2 = K.quantize_sign(acc, 128)
        c3, s3 = K.quantize_fp8(x, "e4m3", 64)
        return c, s, c2, s2, K.dequantize_sign(c2, s2, x.numel(), 128), K.dequantize_fp8(c3, s3, "e4m3", 64)

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    args = lambda: (x.clone(), torch.zeros(1000), torch.ones(1000))  # noqa: E731
    eager_args, compiled_args = args(), args()
    eager = step(*eager_args)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled_args)
    for a, b in zip(got, eager):
        _same(a, b, "compiled")
    _same(compiled_args[1], eager_args[1], "residual")


@pytest.mark.parametrize("fmt,top_code", [("e4m3", 0x7E), ("e5m2", 0x7B)])
def test_fp8_absmax_scaled_past_the_top_still_codes_the_top(fmt, top_code):
    # m * RN(F / m) rounds one ulp above F for this m (checked below); the code stays F's
    m = 6.257877826690674
    f = L.FP8_MAX[fmt]
    assert (torch.tensor([m]) * (torch.full((1,), f) / torch.tensor([m]))).item() > f
    x = torch.tensor([m, -m] + [0.5] * 30)
    want = [top_code, top_code | 0x80]
    backends = ["reference"] + (["cpu"] if CPU else [])
    for b in backends:
        codes, _ = K.quantize_fp8(x, fmt, 32, backend=b)
        assert codes[:2].tolist() == want, b


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp8_codes_round_ties_to_even_in_blocks_of_normals(fmt, dtype):
    # every midpoint between neighbouring normal fp8 values, one ulp either side, both signs,
    # in blocks led by the format's top (scale factor exactly 1, so each code is the torch cast
    # of the value itself); no zero or subnormal in a block: the kernels' all-normal path
    top = L.FP8_MAX[fmt]
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    normal = vals[(vals >= 2.0 ** (-6 if fmt == "e4m3" else -14)) & (vals <= top)].unique()
    mid = (normal[:-1] + normal[1:]) / 2
    up, down = torch.nextafter(mid, mid * 2), torch.nextafter(mid, mid / 2)
    v = torch.cat([mid, up, down, normal])
    v = torch.cat([v, -v])
    per = 255
    nb = -(-v.numel() // per)
    body = torch.full((nb * per,), top / 2)
    body[: v.numel()] = v
    x = torch.cat([torch.full((nb, 1), top), body.view(nb, per)], 1).reshape(-1)
    want = x.to(dtype).view(torch.uint8)
    for b in ["reference"] + (["cpu"] if CPU else []):
        codes, scales = K.quantize_fp8(x, fmt, 256, backend=b)
        assert torch.equal(codes, want), b
        assert torch.equal(scales, torch.full((nb,), 1.0))


@pytest.mark.skipif(not CPU, reason="gradcomp._C is not built")
@pytest.mark.parametrize("offset", [0, 1])
def test_codes_streamed_past_the_caches_match_the_reference(offset):
    # inputs of 2**21 elements or more take the non-temporal stores and the prefetch of the
    # blocks ahead (the buffer's last blocks prefetch past its end); offset 1 starts the codes
    # off their alignment (plain stores at the head); block 4096 spans tiles, 64 streams nothing
    n = (1 << 21) + 100
    x = C.data(n, torch.float32, seed=21)
    res = torch.randn(n, generator=torch.Generator().manual_seed(2)) * 0.01

    def out(nbytes):
        return torch.empty(nbytes + offset, dtype=torch.uint8)[offset:]

    for bs in (64, 256, 4096):
        nb = -(-n // bs)
        runs = {
            "int8": lambda b: K.quantize_int8(x, bs, "nearest", 0, 0, out_q=out(n).view(torch.int8),
                                              out_scales=torch.empty(nb), backend=b),
            "int8 sr ef": lambda b: (*K.quantize_int8_ef(x, r := res.clone(), bs, "stochastic", 3, 1,
                                                         out_q=out(n).view(torch.int8), backend=b), r),
            "int4": lambda b: K.quantize_packed(x, 4, bs, out_codes=out(-(-n // 2)), backend=b),
            "int2 ef": lambda b: (*K.quantize_packed_ef(x, r := res.clone(), 2, bs, out_codes=out(-(-n // 4)),
                                                        backend=b), r),
            "fp8": lambda b: K.quantize_fp8(x, "e5m2", bs, out_codes=out(n), backend=b),
            "fp8 ef": lambda b: (*K.quantize_fp8_ef(x, r := res.clone(), "e4m3", bs, out_codes=out(n), backend=b), r),
            # (sign's codes of a tile fill half a line: never streamed, but its input is prefetched)
            "sign ef": lambda b: (*K.quantize_sign_ef(x, r := res.clone(), bs, out_codes=out(-(-n // 8)), backend=b), r),
        }
        for name, fn in runs.items():
            C.cpu_matches_reference(fn, f"{name} block {bs}")
