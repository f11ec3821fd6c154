"""Wire format: exact sizes, round trips, and a fuzz test (only PayloadError)."""

import math
import random
import struct
import zlib

import pytest
import torch

import gradcomp as gc
from gradcomp import wire as W
from gradcomp.compressors import decompress


def H(ndim):
    return 40 + 8 * ndim


@pytest.mark.parametrize("shape", [(0,), (1,), (255,), (257,), (3, 5, 7), (1000,)])
@pytest.mark.parametrize("block", [32, 256, 4096])
def test_int8_size_formula(shape, block):
    x = torch.randn(shape)
    n = x.numel()
    p = gc.Int8Quantizer(block_size=block).compress(x)
    assert p.nbytes == p.wire.numel() == H(len(shape)) + n + 4 * math.ceil(n / block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_dense_size_formulas(dtype):
    x = torch.randn(4, 25).to(dtype)
    isz = x.element_size()
    assert gc.NoCompression().compress(x).nbytes == H(2) + 100 * isz
    assert gc.FP16().compress(x).nbytes == H(2) + 200
    assert gc.BF16().compress(x).nbytes == H(2) + 200


def test_sparse_size_formula():
    x = torch.randn(10, 100)
    p = gc.TopK(ratio=0.013, compact_indices=False).compress(x)  # k = 13, int32 indices
    assert p.nnz == 13 and p.wire[4] == 1  # version 1
    pad8 = (13 * 4 + 7) // 8 * 8
    assert p.nbytes == H(2) + pad8 + (H(1) + 13 * 4)
    # compact: L = floor(log2(1000 / 13)) = 6; 13 * 6 = 78 low bits -> 10 bytes,
    # 13 + (999 >> 6) = 28 high bits -> 4 bytes; 14 padded to 16 (int32: 56)
    p = gc.TopK(ratio=0.013).compress(x)
    assert p.wire[4] == 2 and p.nbytes == H(2) + 16 + (H(1) + 13 * 4)
    p = gc.TopK(k=13, values=gc.Int8Quantizer(block_size=32)).compress(x)
    assert p.nbytes == H(2) + 16 + (H(1) + 13 + 4)
    assert p.nbytes == gc.TopK(k=13, values=gc.Int8Quantizer(block_size=32)).wire_nbytes((10, 100))
    p = gc.Threshold(100.0).compress(x)  # nothing kept: still a valid payload
    assert p.nnz == 0 and p.nbytes == H(2) + H(1)
    assert torch.equal(gc.Threshold(100.0).decompress(p.wire), torch.zeros(10, 100))


def _samples():
    torch.manual_seed(0)
    x = torch.randn(3, 70)
    x16 = x.half()
    return [
        gc.NoCompression().compress(x),
        gc.NoCompression().compress(x.double()),
        gc.FP16().compress(x * 1e6),
        gc.BF16().compress(x16),
        gc.Int8Quantizer(block_size=32).compress(x),
        gc.Int8Quantizer(block_size=64, rounding="stochastic").compress(x16),
        gc.TopK(ratio=0.05).compress(x),  # compact indices (version 2)
        gc.TopK(ratio=0.05, values=gc.Int8Quantizer(block_size=32)).compress(x),
        gc.TopK(ratio=0.05, compact_indices=False).compress(x),  # int32 indices (version 1)
        gc.TopK(k=40).compress(torch.randn(5000)),  # L = 6, fields crossing bytes
        gc.TopK(k=1).compress(torch.randn(300)),  # one index
        gc.Threshold(1.0, values=gc.FP16()).compress(x),
        gc.Int8Quantizer().compress(torch.randn(())),
    ]


@pytest.mark.parametrize("i", range(13))
def test_decode_round_trip(i):
    p = _samples()[i]
    q = gc.decode(p.wire.clone())
    assert (q.codec, q.dtype, q.shape, q.nnz, q.block_size) == (p.codec, p.dtype, p.shape, p.nnz, p.block_size)
    assert torch.equal(decompress(q), decompress(p))
    # a misaligned buffer (payload at an odd offset of a larger buffer) decodes too
    big = torch.cat([torch.zeros(3, dtype=torch.uint8), p.wire])
    assert torch.equal(decompress(gc.decode(big[3:])), decompress(p))


def _check_only_payload_errors(buf):
    try:
        p = gc.decode(buf)
    except gc.PayloadError:
        return "rejected"
    # whatever decodes must also decompress without error
    decompress(p)
    return "accepted"


def test_fuzz_random_truncated_mutated():
    rng = random.Random(1234)
    samples = _samples()
    outcomes = {"rejected": 0, "accepted": 0}
    # random buffers, some starting with the magic
    for _ in range(1500):
        n = rng.randrange(0, 300)
        b = bytes(rng.randrange(256) for _ in range(n))
        if rng.random() < 0.5:
            b = W.MAGIC + bytes([rng.choice(W.VERSIONS)]) + b
        outcomes[_check_only_payload_errors(torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8))] += 1
    for p in samples:
        raw = p.wire.numpy().tobytes()
        # every truncation
        for cut in range(0, len(raw)):
            outcomes[_check_only_payload_errors(torch.frombuffer(bytearray(raw[:cut]), dtype=torch.uint8) if cut else torch.empty(0, dtype=torch.uint8))] += 1
        # single bit flips and random byte mutations
        for _ in range(300):
            b = bytearray(raw)
            pos = rng.randrange(len(b))
            if rng.random() < 0.5:
                b[pos] ^= 1 << rng.randrange(8)
            else:
                b[pos] = rng.randrange(256)
            outcomes[_check_only_payload_errors(torch.frombuffer(b, dtype=torch.uint8))] += 1
        # extra trailing bytes
        outcomes[_check_only_payload_errors(torch.frombuffer(bytearray(raw + b"\0"), dtype=torch.uint8))] += 1
    assert outcomes["rejected"] > 1000


def _refresh_crc(b: bytearray, ndim: int) -> bytearray:
    h = H(ndim)
    struct.pack_into("<I", b, h - 8, zlib.crc32(bytes(b[: h - 8])))
    return b


def test_fuzz_header_fields_with_valid_crc():
    """Mutate header fields and recompute the CRC so the deeper checks are exercised."""
    rng = random.Random(99)
    for p in _samples():
        raw = p.wire.numpy().tobytes()
        ndim = raw[7]
        for _ in range(400):
            b = bytearray(raw)
            pos = rng.randrange(4, H(ndim) - 8)
            b[pos] = rng.randrange(256)
            _refresh_crc(b, ndim)
            _check_only_payload_errors(torch.frombuffer(b, dtype=torch.uint8))


def test_specific_corruptions_are_named():
    p = gc.Int8Quantizer(block_size=32).compress(torch.randn(100))
    raw = bytearray(p.wire.numpy().tobytes())
    bad = bytearray(raw)
    bad[0:4] = b"XXXX"
    with pytest.raises(gc.PayloadError, match="magic"):
        gc.decode(torch.frombuffer(bad, dtype=torch.uint8))
    with pytest.raises(gc.PayloadError, match="truncated|bytes"):
        gc.decode(torch.frombuffer(bytearray(raw[:-1]), dtype=torch.uint8))
    bad = bytearray(raw)
    bad[9] = 1
    with pytest.raises(gc.PayloadError):
        gc.decode(torch.frombuffer(bad, dtype=torch.uint8))
    bad = bytearray(raw)
    bad[-1] = 0x80  # code -128
    with pytest.raises(gc.PayloadError, match="-128"):
        gc.decode(torch.frombuffer(bad, dtype=torch.uint8))
    # left to the kernel that reads the codes: decode passes, every use raises
    lazy = gc.decode(torch.frombuffer(bad, dtype=torch.uint8), check_int8=False)
    assert not lazy.int8_checked and gc.decode(p.wire).int8_checked
    with pytest.raises(TypeError, match="check_int8 must be True or False"):
        gc.decode(p.wire, check_int8=0)
    q = gc.Int8Quantizer(block_size=32)
    assert gc.wire.header_nbytes(1) == 48  # the scales start right after a 1-d header
    bad = bytearray(raw)
    bad[48:52] = b"\x00\x00\x80\xff"  # the first scale: -inf
    with pytest.raises(gc.PayloadError, match="scales"):
        gc.decode(torch.frombuffer(bad, dtype=torch.uint8))
    with pytest.raises(gc.PayloadError, match="scale"):
        q.decompress(gc.decode(torch.frombuffer(bad, dtype=torch.uint8), check_int8=False))
    for use in (lambda: q.decompress(lazy), lambda: q.decompress(lazy, out=torch.empty(100)),
                lambda: q.decompress_add_(lazy, torch.zeros(100)),
                lambda: q.reduce_compress_(lazy, torch.zeros(100), divisor=2)):
        with pytest.raises(gc.PayloadError, match="-128"):
            use()
    with pytest.raises(TypeError):
        gc.decode(torch.zeros(50, dtype=torch.float32))
    # sparse index out of range / not ascending, with a valid header
    s = gc.TopK(k=3, compact_indices=False).compress(torch.tensor([5.0, 0, 0, 4, 0, 3]))
    raw = bytearray(s.wire.numpy().tobytes())
    struct.pack_into("<i", raw, H(1), 7)
    with pytest.raises(gc.PayloadError, match="range|ascending"):
        gc.decode(torch.frombuffer(raw, dtype=torch.uint8))


def test_payload_error_is_value_error():
    assert issubclass(gc.PayloadError, ValueError)
    with pytest.raises(ValueError):
        gc.decode(torch.zeros(10, dtype=torch.uint8))


def _fp16_wire(dtype_id: int, exponent: int, values=(1.0, 0.0)) -> torch.Tensor:
    """An fp16 payload with a valid header CRC and the given scale exponent."""
    n = len(values)
    body = struct.pack("<4sBBBBB3sIQQq", W.MAGIC, 1, W.CODECS["fp16"].id, dtype_id, 1, 0, b"\0\0\0",
                       exponent, n, 0, n)
    head = body + struct.pack("<I", zlib.crc32(body)) + b"\0\0\0\0"
    return torch.frombuffer(bytearray(head + struct.pack(f"<{n}e", *values)), dtype=torch.uint8)


@pytest.mark.parametrize("dtype, limit", [(torch.float32, 127), (torch.float16, 127),
                                          (torch.bfloat16, 127), (torch.float64, 1023)])
def test_fp16_exponent_bounded_by_dtype(dtype, limit):
    """Exponents 1024..1100 used to decode and then raise OverflowError in
    decompress (a 66-byte push could stop a parameter server); float32 with an
    exponent >= 128 turned zeros into NaN."""
    did = W.DTYPES[dtype]
    p = gc.decode(_fp16_wire(did, limit))
    y = gc.FP16().decompress(p)
    assert y.dtype == dtype and y[1] == 0  # zero stays zero
    for e in (limit + 1, 1024, 1100, 2**31):
        with pytest.raises(gc.PayloadError, match="exponent"):
            gc.decode(_fp16_wire(did, e))
    low = -126 if limit == 127 else -1022  # scaled up: the exponent is a signed int32
    p = gc.decode(_fp16_wire(did, low & 0xFFFFFFFF, (2.0, 0.0)))
    assert p.exponent == low
    y = gc.FP16().decompress(p)
    assert y[0] == torch.tensor(2.0 * 2.0 ** low, dtype=torch.float64).to(dtype) and y[1] == 0
    for e in (low - 1, -2**31):
        with pytest.raises(gc.PayloadError, match=f"exponent {e} out of range"):
            gc.decode(_fp16_wire(did, e & 0xFFFFFFFF))


def test_max_numel_bounds_what_untrusted_bytes_may_allocate():
    """A 96-byte sparse payload may declare 2**40 elements: decompressing it
    would allocate them all. decode refuses numel above max_numel
    (default 2**31), settable per call."""
    assert W.DEFAULT_MAX_NUMEL == 2**31
    p = gc.TopK(k=2).compress(torch.tensor([0.0, 5.0, 0.0, -7.0]))
    n = 2**40  # 1 TiB of float32 from a header edit; int64 indices from 2**31 on
    head = bytearray(p.wire[:48].numpy().tobytes())  # 1-D: 40 + 8 bytes
    head[8] = 2  # FLAG_INDEX64
    struct.pack_into("<Q", head, 16, n)  # numel
    struct.pack_into("<q", head, 32, n)  # shape
    struct.pack_into("<I", head, 40, zlib.crc32(bytes(head[:40])))
    idx = struct.pack("<2q", 1, 3)  # int64 indices replace the two int32 ones
    huge = torch.frombuffer(bytearray(bytes(head) + idx + p.wire[48 + 8:].numpy().tobytes()), dtype=torch.uint8)
    with pytest.raises(gc.PayloadError, match=f"declares {n} elements, more than max_numel=2147483648"):
        gc.decode(huge)
    with pytest.raises(gc.PayloadError, match="max_numel"):
        gc.TopK(k=2).decompress(huge)  # wire bytes go through decode with the default limit
    assert gc.decode(huge, max_numel=n).numel == n  # allowed when asked for (nothing allocated yet)
    small = gc.Int8Quantizer().compress(torch.randn(1000)).wire
    assert gc.decode(small, max_numel=1000).numel == 1000
    with pytest.raises(gc.PayloadError, match="more than max_numel=999"):
        gc.decode(small, max_numel=999)
    with pytest.raises(TypeError, match="max_numel"):
        gc.decode(small, max_numel=1.5)
    with pytest.raises(ValueError, match="max_numel"):
        gc.decode(small, max_numel=-1)


def test_largest_legitimate_fp16_exponents_decode():
    for x in (torch.tensor([3.4e38, 0.0]), torch.tensor([1.7e308, 0.0], dtype=torch.float64)):
        p = gc.FP16().compress(x)
        y = gc.FP16().decompress(gc.decode(p.wire))
        assert torch.isfinite(y).all() and y[1] == 0


def test_meta_wire_is_a_type_error():
    with pytest.raises(TypeError, match="meta"):
        gc.decode(torch.empty(100, dtype=torch.uint8, device="meta"))
