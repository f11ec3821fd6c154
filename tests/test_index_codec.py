"""Compact (Elias-Fano) sparse indices: exact sizes, round trips on both
backends, the bytes-per-index targets, version-1 payloads, tampered streams."""

import struct

import pytest
import torch

import gradcomp as gc
from gradcomp import index_codec as C
from gradcomp import wire as W

BACKENDS = ("cpu", "reference")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("GRADCOMP_BACKEND", request.param)
    return request.param


def _sizes_by_hand(n, k):
    """(L, low bytes, high bytes) of the format, from its definition."""
    L = 0
    while (n // k) >> (L + 1):  # the largest L with 2**L <= n / k
        L += 1
    return L, -(-k * L // 8), -(-(k + ((n - 1) >> L)) // 8)


# n = 2**20, k = 1000: L = 10, 10000 low bits = 1250 bytes, 1000 + 1023 high bits = 253 bytes
# k = 3 {0, 1, n - 1}: L = 18, 54 bits = 7 bytes, 3 + 3 bits = 1 byte
# k = 1: L = 20, 20 bits = 3 bytes, 1 + 0 bits = 1 byte
# n = 1000, k = 500: L = 1, 500 bits = 63 bytes, 500 + 499 bits = 125 bytes
@pytest.mark.parametrize("kind,n,nbytes", [("random", 2**20, 1503), ("clustered", 2**20, 1503),
                                           ("first_last", 2**20, 8), ("single", 2**20, 4),
                                           ("single_last", 2**20, 4), ("dense", 1000, 188)])
def test_round_trip_exact_bytes(backend, kind, n, nbytes):
    g = torch.Generator().manual_seed(0)
    idx = {"random": lambda: torch.randperm(n, generator=g)[:1000].sort().values,
           "clustered": lambda: torch.arange(5000, 6000),
           "first_last": lambda: torch.tensor([0, 1, n - 1]),
           "single": lambda: torch.tensor([0]),
           "single_last": lambda: torch.tensor([n - 1]),
           "dense": lambda: torch.arange(0, 1000, 2)}[kind]().to(torch.int32)
    k = idx.numel()
    L, lo, hi = _sizes_by_hand(n, k)
    assert C.low_bits(n, k) == L and C.section_nbytes(n, k) == lo + hi == nbytes
    data = C.encode(idx, n)
    assert data.dtype == torch.uint8 and data.numel() == nbytes
    assert torch.equal(C.decode(data, n, k, torch.int32), idx)
    assert torch.equal(C.decode(data, n, k), idx.long())


def test_both_backends_write_the_same_bytes(monkeypatch):
    idx = torch.randperm(300_000)[:4321].sort().values
    out = []
    for b in BACKENDS:
        monkeypatch.setenv("GRADCOMP_BACKEND", b)
        out.append(C.encode(idx, 300_000))
    assert torch.equal(out[0], out[1])


def test_a_known_stream_bit_by_bit():
    # n = 64, idx = [3, 9, 40]: L = floor(log2(64 / 3)) = 4; low fields 3, 9, 8 -> bits
    # 0011 1001 0001 (LSB first) = bytes 0x93, 0x08; high parts 0, 0, 2 -> bits 0, 1, 4
    # of 3 + (63 >> 4) = 6 bits = 0b010011 = 0x13
    data = C.encode(torch.tensor([3, 9, 40]), 64)
    assert data.tolist() == [0x93, 0x08, 0x13]
    assert C.decode(data, 64, 3).tolist() == [3, 9, 40]


@pytest.mark.parametrize("density,target", [(0.001, 2.0), (0.01, 2.5)])
def test_bytes_per_index_targets(density, target):
    n = 2**24
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    p = gc.TopK(ratio=density).compress(x)
    k = p.nnz
    index_bytes = p.nbytes - W.header_nbytes(1) - p.values.nbytes
    assert index_bytes / k <= target
    # and exactly the formula: L = 9 (0.1%) or 6 (1%)
    L, lo, hi = _sizes_by_hand(n, k)
    assert index_bytes == (lo + hi + 7) // 8 * 8 and L == {0.001: 9, 0.01: 6}[density]
    q = gc.decode(p.wire)
    ref = gc.TopK(ratio=density, compact_indices=False).compress(x)
    assert q.wire[4] == 2 and ref.wire[4] == 1 and torch.equal(q.indices, ref.indices)
    assert torch.equal(gc.TopK(k=1).decompress(q), gc.TopK(k=1).decompress(ref))


def test_payload_picks_the_smaller_form():
    # k = 1: 4 compact bytes pad to 8, as 4 int32 bytes do: not smaller, version 1
    p = gc.TopK(k=1).compress(torch.randn(2**20))
    assert p.wire[4] == 1 and p.nbytes == W.header_nbytes(1) + 8 + W.header_nbytes(1) + 4
    # k = 3 of 2**20: 8 compact bytes against 16: compact, version 2, exact size
    p = gc.TopK(k=3).compress(torch.randn(2**20))
    assert p.wire[4] == 2 and p.nbytes == W.header_nbytes(1) + 8 + W.header_nbytes(1) + 12
    assert p.nbytes == gc.TopK(k=3).wire_nbytes((2**20,))
    # threshold payloads use it too
    x = torch.zeros(10_000)
    x[::100] = 1.0
    p = gc.Threshold(0.5).compress(x)
    assert p.wire[4] == 2 and torch.equal(gc.Threshold(0.5).decompress(p.wire), x)


def test_old_version_one_payloads_still_decode():
    # a version-1 top-k payload written byte by byte as the first format defined it
    idx = [2, 7, 11]
    vals = [1.5, -2.0, 0.25]
    body = struct.pack("<4sBBBBB3sIQQ", b"GCMP", 1, 5, 1, 1, 0, b"\0\0\0", 0, 16, 3) + struct.pack("<q", 16)
    import zlib

    header = body + struct.pack("<I", zlib.crc32(body)) + b"\0" * 4
    inner = struct.pack("<4sBBBBB3sIQQ", b"GCMP", 1, 1, 1, 1, 0, b"\0\0\0", 0, 3, 0) + struct.pack("<q", 3)
    inner = inner + struct.pack("<I", zlib.crc32(inner)) + b"\0" * 4 + struct.pack("<3f", *vals)
    raw = header + struct.pack("<3i", *idx) + b"\0" * 4 + inner
    p = gc.decode(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    want = torch.zeros(16)
    want[idx] = torch.tensor(vals)
    assert p.indices.tolist() == idx and torch.equal(gc.TopK(k=1).decompress(p), want)


def _fails(data, n, k, match):
    with pytest.raises(gc.PayloadError, match=match):
        C.decode(torch.tensor(data, dtype=torch.uint8), n, k)


def test_tampered_streams_raise(backend):
    base = C.encode(torch.tensor([3, 9, 40]), 64).tolist()  # [0x93, 0x08, 0x13]: see above
    _fails([base[0], base[1], 0x03], 64, 3, "set bits")  # a high bit cleared: 2 indices
    # one set too many: [3, 9, 8, ...]; found as a count or an order error, whichever comes first
    _fails([base[0], base[1], 0x17], 64, 3, "set bits|ascending")
    _fails([0x33, 0x08, 0x13], 64, 3, "ascending")  # second low field 3: [3, 3, 40]
    _fails([base[0], base[1], 0x93], 64, 3, "padding")  # high vector bit 7 (6 bits used)
    _fails([base[0], 0x18, 0x13], 64, 3, "padding")  # low bits: 12 used of 16
    # n = 60 (same L = 4, 6 high bits): third high part 3, low 15: index 63 >= 60
    assert C.decode(torch.tensor(base, dtype=torch.uint8), 60, 3).tolist() == [3, 9, 40]
    _fails([base[0], 0x0F, 0x23], 60, 3, "range")


def test_tampered_payload_raises(backend):
    idx = torch.randperm(2**20, generator=torch.Generator().manual_seed(2))[:1000]
    x = torch.zeros(2**20)
    x[idx] = 1.0 + torch.rand(1000)
    p = gc.TopK(k=1000).compress(x)
    assert p.wire[4] == 2
    high = W.header_nbytes(1) + 1250  # the high-bit vector (see test_round_trip_exact_bytes)
    for pos in (high, high + 10, high + 200):
        bad = p.wire.clone()
        bad[pos] ^= 1
        with pytest.raises(gc.PayloadError, match="compact indices"):
            gc.decode(bad)
    bad = p.wire.clone()
    bad[12] ^= 1  # L in the header: caught by the header CRC
    with pytest.raises(gc.PayloadError, match="checksum"):
        gc.decode(bad)
