"""Buffer reuse and the fused reduce step: ``compress(out=)``, ``decompress(out=)``,
``Compressor.reduce_compress_`` and ``kernels.reduce_quantize_int8``.

Each fast path is checked bit for bit against the composition it stands for
(``dequantize_int8_add_``, ``div_``, ``quantize_int8``, ``dequantize_int8`` on
the reference backend; ``compress`` / ``decompress`` allocating their results).
"""

import itertools

import pytest
import torch

import gradcomp as gc
from gradcomp import kernels as K
from gradcomp.compressors import Compressor

NATIVE = K.available_backends()["cpu"] is None


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _same(a, b):
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _special(n, block, seed):
    """acc, codes and scales with NaN / Inf / -0 / subnormal / zero blocks."""
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(n, generator=g) * 3
    x = torch.randn(n, generator=g)
    if n > 2 * block:
        acc[5] = float("nan")
        acc[block + 3] = float("inf")
        x[block:2 * block] = 0
        acc[block:2 * block] = 0
        acc[block + 1] = -0.0
        acc[block + 2] = 1e-40
    q, s = K.quantize_int8(x, block, backend="reference")
    if n > 4 * block:
        s[3] = float("inf")  # not a valid payload scale, but the kernel must still match
        q[3 * block] = 0
        acc[3 * block] = float("nan")
        s[2] = float("nan")
        q[2 * block:3 * block] = 0
    return acc, q, s


@pytest.mark.skipif(not NATIVE, reason="gradcomp._C not built")
@pytest.mark.parametrize("n,block", [(0, 256), (1, 32), (255, 256), (1000, 32), (70001, 256), (20000, 4096)])
def test_native_reduce_quantize_matches_the_composition(n, block):
    for divisor, rounding, decode in itertools.product([1, 2, 3, 4, 7], ["nearest", "stochastic"], [False, True]):
        acc, q, s = _special(n, block, seed=n + divisor)
        a1, a2 = acc.clone(), acc.clone()
        q1, s1 = K.reduce_quantize_int8(a1, q, s, block, divisor, rounding, 5, 9, decode=decode, backend="cpu")
        q2, s2 = K.reduce_quantize_int8(a2, q, s, block, divisor, rounding, 5, 9, decode=decode,
                                        backend="reference")
        where = f"n={n} block={block} divisor={divisor} {rounding} decode={decode}"
        assert _same(q1, q2) and _same(s1, s2) and _same(a1, a2), where


def test_reference_reduce_quantize_is_the_composition():
    acc, q, s = _special(5000, 64, seed=1)
    a1, a2 = acc.clone(), acc.clone()
    q1, s1 = K.reduce_quantize_int8(a1, q, s, 64, 3, "stochastic", 2, 7, decode=True, backend="reference")
    K.dequantize_int8_add_(a2, q, s, 64, backend="reference")
    a2.div_(3)
    q2, s2 = K.quantize_int8(a2, 64, "stochastic", 2, 7, backend="reference")
    K.dequantize_int8(q2, s2, 64, out=a2, backend="reference")
    assert _same(q1, q2) and _same(s1, s2) and _same(a1, a2)


def test_reduce_quantize_outputs_and_errors():
    acc, q, s = _special(1000, 32, seed=2)
    oq, os_ = torch.empty(1000, dtype=torch.int8), torch.empty(32)
    rq, rs = K.reduce_quantize_int8(acc, q, s, 32, out_q=oq, out_scales=os_)
    assert rq.data_ptr() == oq.data_ptr() and rs.data_ptr() == os_.data_ptr()
    with pytest.raises(ValueError):
        K.reduce_quantize_int8(acc, q, s, 32, divisor=0)
    with pytest.raises(ValueError):
        K.reduce_quantize_int8(acc[:10], q, s, 32)
    with pytest.raises(ValueError):
        K.reduce_quantize_int8(acc, q, s, 32, out_q=torch.empty(5, dtype=torch.int8))


def _dense():
    return [gc.NoCompression(), gc.FP16(), gc.BF16(), gc.Int8Quantizer(block_size=32),
            gc.Int8Quantizer(block_size=64, rounding="stochastic", seed=3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_compress_and_decompress_into_buffers(dtype):
    x = (torch.randn(7, 91) * 100).to(dtype)
    for c in _dense():
        twin = c.clone()
        want = twin.compress(x)
        out = torch.full((c.wire_nbytes(x.shape, dtype),), 0xAB, dtype=torch.uint8)
        p = c.compress(x, out=out)
        assert p.wire is out and torch.equal(out, want.wire), repr(c)
        y = torch.empty(91, 7, dtype=dtype)  # any shape with the payload's numel
        assert c.decompress(p, out=y) is y
        assert torch.equal(y.view(-1).view(torch.uint8), c.decompress(p).reshape(-1).view(torch.uint8)), repr(c)
        assert torch.equal(c.decompress(out, out=torch.empty_like(x)), c.decompress(p))  # from bytes


def test_error_feedback_compress_into_a_buffer():
    x = torch.randn(1000)
    a, b = gc.ErrorFeedback(gc.Int8Quantizer()), gc.ErrorFeedback(gc.Int8Quantizer())
    for _ in range(3):
        want = a.compress(x, key="w")
        out = torch.empty(want.nbytes, dtype=torch.uint8)
        assert torch.equal(b.compress(x, key="w", out=out).wire, want.wire)
        assert torch.equal(a.residual("w"), b.residual("w"))


def test_out_argument_errors():
    x = torch.randn(100)
    c = gc.Int8Quantizer()
    n = c.wire_nbytes(x.shape)
    for bad in (torch.empty(n - 1, dtype=torch.uint8), torch.empty(n, dtype=torch.int8),
                torch.empty(2, n, dtype=torch.uint8)[:, 0], "bytes"):
        with pytest.raises(ValueError):
            c.compress(x, out=bad)
    with pytest.raises(ValueError):
        gc.TopK(ratio=0.1).compress(x, out=torch.empty(n, dtype=torch.uint8))
    p = c.compress(x)
    for bad in (torch.empty(99), torch.empty(100, dtype=torch.float16), torch.empty(200)[::2], None.__class__):
        with pytest.raises(ValueError):
            c.decompress(p, out=bad)


@pytest.mark.parametrize("make", [lambda: gc.Int8Quantizer(block_size=32),
                                  lambda: gc.Int8Quantizer(block_size=64, rounding="stochastic", seed=5),
                                  gc.FP16, gc.NoCompression])
def test_reduce_compress_is_the_composition(make):
    g = torch.Generator().manual_seed(0)
    for n, divisor, decode in itertools.product([0, 1, 333, 4096], [1, 2, 3], [False, True]):
        x, acc = torch.randn(n, generator=g), torch.randn(n, generator=g) * 2
        fast, slow = make(), make()
        p = make().compress(x).wire
        a1, a2 = acc.clone(), acc.clone()
        out = torch.empty(fast.wire_nbytes(acc.shape), dtype=torch.uint8)
        r1 = fast.reduce_compress_(p, a1, divisor=divisor, out=out, decode=decode)
        r2 = Compressor.reduce_compress_(slow, p, a2, divisor=divisor, decode=decode)
        assert r1.wire is out and torch.equal(r1.wire, r2.wire) and _same(a1, a2), (make(), n, divisor, decode)
        assert fast.state_dict() == slow.state_dict()


def test_reduce_compress_respects_subclass_overrides():
    class Scaled(gc.Int8Quantizer):  # an old-style override: no out= argument
        def compress(self, t):
            return super().compress(t * 2)

    c = Scaled(block_size=32)
    assert not c._takes_out() and gc.Int8Quantizer()._takes_out()
    x, acc = torch.randn(100), torch.randn(100)
    a1, a2 = acc.clone(), acc.clone()
    r1 = c.reduce_compress_(gc.Int8Quantizer(block_size=32).compress(x), a1)
    a2 += gc.Int8Quantizer(block_size=32).decompress(gc.Int8Quantizer(block_size=32).compress(x))
    assert torch.equal(r1.wire, gc.Int8Quantizer(block_size=32).compress(a2 * 2).wire)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fp16_bf16_buffer_paths_match_the_decoded_values(dtype):
    """FP16 / BF16 decode and add without a float32 temporary (exact widening,
    exact power-of-two rescaling), bit for bit as the allocating path."""
    g = torch.Generator().manual_seed(3)
    for c, scale in itertools.product([gc.FP16(), gc.BF16()], [1.0, 1e6, 1e30]):
        x = (torch.randn(3000, generator=g, dtype=torch.float64) * scale)
        x[5], x[6] = -0.0, 1e-8
        x = x.to(dtype)
        p = c.compress(x)
        assert isinstance(c, gc.BF16) or scale == 1.0 or p.exponent > 0
        want = c._decode_flat(p).to(p.dtype)
        got = c.decompress(p, out=torch.empty_like(x))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (c, scale)
        acc = torch.randn(3000, generator=g)
        ref = acc.clone().add_(c._decode_flat(p).to(torch.float32))
        assert _same(c.decompress_add_(p, acc), ref), (c, scale)
