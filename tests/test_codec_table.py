"""The one codec table (gradcomp.wire.CODECS): payloads decode by their own codec,
with no compressor object; ErrorFeedback wraps a compressor without being one."""

import ast
import functools
import pathlib
import struct
import zlib

import numpy as np
import pytest
import torch

import gradcomp as gc
from gradcomp import wire as W
from gradcomp.comm.local import Local
from gradcomp.compressors import decoder, split, unwrapped

# the wire format as documented (docs/wire-format.md), written out by hand
SPEC = {"raw": (1, False, False), "fp16": (2, False, True), "bf16": (3, False, True),
        "int8": (4, False, True), "topk": (5, True, True), "threshold": (6, True, True),
        "int4": (7, False, True), "int2": (8, False, True), "sign": (9, False, True),
        "fp8e4m3": (10, False, True), "fp8e5m2": (11, False, True)}
PACKAGE = pathlib.Path(gc.__file__).parent


def test_table_matches_the_documented_format_and_has_a_decoder_per_codec():
    assert {name: (c.id, c.sparse, c.lossy) for name, c in W.CODECS.items()} == SPEC
    for name, (cid, _, _) in SPEC.items():
        assert W.codec(name) is W.codec(cid) is W.CODECS[name]
        dec = W.codec(name).decoder
        assert isinstance(dec, gc.compressors.Decoder) and not isinstance(dec, gc.Compressor), name
        assert decoder(name) is dec and decoder(cid) is dec
    # a compressor's kind is its codec's row
    for c in (gc.NoCompression(), gc.FP16(), gc.BF16(), gc.Int8Quantizer(), gc.TopK(k=1), gc.Threshold(0.1),
              gc.IntQuantizer(4), gc.IntQuantizer(2), gc.IntQuantizer(8), gc.SignQuantizer(), gc.FP8(),
              gc.FP8("e5m2")):
        assert (c.sparse, c.lossy) == SPEC[c.codec][1:], c


# ---- decoding by hand from the bytes (float64 / numpy), against the table's decoder
def _bytes(wire: torch.Tensor) -> bytes:
    return wire.numpy().tobytes()


def _hand_dense(b: bytes) -> np.ndarray:
    """Values of a 1-D dense payload, read from its bytes by hand."""
    codec_id, ndim = b[5], b[7]
    (param,) = struct.unpack_from("<i", b, 12)
    (n,) = struct.unpack_from("<q", b, 16)
    h = 40 + 8 * ndim
    if codec_id == 1:
        return np.frombuffer(b, np.float32, n, h).astype(np.float64)
    if codec_id == 2:
        return np.frombuffer(b, np.float16, n, h).astype(np.float64) * 2.0 ** param
    if codec_id == 3:
        return (np.frombuffer(b, np.uint16, n, h).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    assert 4 <= codec_id <= 11
    nb = -(-n // param)
    scales = np.repeat(np.frombuffer(b, np.float32, nb, h), param)[:n]
    raw = np.frombuffer(b, np.uint8, len(b) - h - 4 * nb, h + 4 * nb)
    if codec_id == 9:  # sign: bit k of byte j is element 8j + k, 1 for -scale
        bit = (raw[:, None] >> np.arange(8)) & 1
        return np.where(bit.reshape(-1)[:n] == 1, -scales, scales).astype(np.float64)
    if codec_id in (10, 11):  # fp8 bit patterns, widened by hand
        mb, bias = (3, 7) if codec_id == 10 else (2, 15)
        e, m = (raw.astype(np.int64) & 0x7F) >> mb, raw.astype(np.int64) & ((1 << mb) - 1)
        mag = np.where(e == 0, m * 2.0 ** (1 - bias - mb), (m + 2 ** mb) * 2.0 ** (e - bias - mb))
        return (np.where(raw >= 128, -mag, mag).astype(np.float32) * scales).astype(np.float64)
    bits = {4: 8, 7: 4, 8: 2}[codec_id]  # two's complement fields, element j of a byte at bits j * bits
    fields = (raw[:, None].astype(np.int64) >> np.arange(0, 8, bits)) & ((1 << bits) - 1)
    codes = fields.reshape(-1)[:n]
    codes = np.where(codes >= 1 << (bits - 1), codes - (1 << bits), codes)
    # float32 products, rounded once (what every backend computes)
    return (codes.astype(np.float32) * scales).astype(np.float64)


def _hand(b: bytes) -> np.ndarray:
    codec_id, ndim, flags = b[5], b[7], b[8]
    if codec_id not in (5, 6):
        return _hand_dense(b)
    assert flags & 4 == 0  # fixed-width int32 indices
    (n, nnz) = struct.unpack_from("<qq", b, 16)
    h = 40 + 8 * ndim
    idx = np.frombuffer(b, np.int32, nnz, h)
    out = np.zeros(n)
    out[idx] = _hand_dense(b[h + (4 * nnz + 7) // 8 * 8:])
    return out


def _samples():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1000, generator=g) * 3
    x[::97] = 0.0
    return [
        gc.NoCompression().compress(x),
        gc.FP16().compress(x * 1e6),  # exponent > 0
        gc.FP16().compress(x * 1e-7),  # exponent < 0
        gc.BF16().compress(x),
        gc.Int8Quantizer(block_size=64).compress(x),
        gc.Int8Quantizer(block_size=32, rounding="stochastic", seed=5).compress(x),
        gc.TopK(k=50, compact_indices=False).compress(x),
        gc.TopK(k=50, values=gc.Int8Quantizer(block_size=32), compact_indices=False).compress(x),
        gc.Threshold(4.0, values=gc.FP16(), compact_indices=False).compress(x),
        gc.Threshold(100.0, compact_indices=False).compress(x),  # nothing kept
        gc.IntQuantizer(4, block_size=64).compress(x),
        gc.IntQuantizer(2, block_size=32, rounding="stochastic", seed=3).compress(x),
        gc.SignQuantizer(block_size=128).compress(x),
        gc.FP8("e4m3", block_size=64).compress(x * 1e-3),
        gc.FP8("e5m2", block_size=32).compress(x),
        gc.TopK(k=50, values=gc.IntQuantizer(4, block_size=32), compact_indices=False).compress(x),
    ]


@pytest.mark.parametrize("i", range(16))
def test_every_codec_decodes_from_its_bytes_alone(i):
    p = _samples()[i]
    wire = p.wire.clone()
    want = torch.from_numpy(_hand(_bytes(wire))).to(torch.float32)
    got = gc.decompress(wire)  # bytes in, values out: no compressor object
    assert got.dtype == torch.float32 and got.shape == (1000,)
    assert torch.equal(got, want), p
    out = torch.full((1000,), 9.0)
    assert gc.decompress(wire, out=out) is out and torch.equal(out, want)
    acc = torch.zeros(1000)
    assert gc.decompress_add_(wire, acc) is acc and torch.equal(acc, want)
    acc = torch.linspace(-1, 1, 1000)
    gc.decompress_add_(gc.decode(wire), acc)
    torch.testing.assert_close(acc, torch.linspace(-1, 1, 1000) + want)
    # the compressor that wrote it decodes the same bits by the same decoder
    assert torch.equal(gc.decompress(wire).view(torch.int32), want.view(torch.int32))


def test_compact_indices_decode_by_the_table_like_fixed_ones():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    compact = gc.TopK(k=40).compress(x)
    fixed = gc.TopK(k=40, compact_indices=False).compress(x)
    assert compact.wire[4] == 2 and compact.nbytes < fixed.nbytes
    want = torch.from_numpy(_hand(_bytes(fixed.wire))).float()
    assert torch.equal(gc.decompress(compact.wire), want)


def _with_codec_id(cid: int) -> torch.Tensor:
    head = bytearray(W.build_header("raw", torch.float32, (2,)))
    head[5] = cid
    h = len(head)
    head[h - 8: h - 4] = struct.pack("<I", zlib.crc32(bytes(head[: h - 8])))  # a valid CRC
    return torch.frombuffer(head + bytes(8), dtype=torch.uint8)


@pytest.mark.parametrize("cid", [0, 12, 255])
def test_unknown_codec_id_is_a_payload_error(cid):
    wire = _with_codec_id(cid)
    for fn in (gc.decode, gc.decompress, lambda w: gc.decompress_add_(w, torch.zeros(2))):
        with pytest.raises(gc.PayloadError, match=f"unknown codec id {cid}"):
            fn(wire)
    with pytest.raises(gc.PayloadError, match="unknown codec id"):
        W.codec(cid)
    assert torch.equal(gc.decompress(_with_codec_id(1)), torch.zeros(2))  # the same bytes with id 1 are fine


def test_bad_codec_lookups():
    with pytest.raises(ValueError, match="codec must be one of"):
        W.codec("lz4")
    with pytest.raises(TypeError, match="codec must be"):
        W.codec(4.0)
    with pytest.raises(ValueError, match="already has a decoder"):
        W.register_decoder("int8", W.codec("raw").decoder)
    with pytest.raises(TypeError, match="p must be a gradcomp Payload"):
        gc.decompress([1, 2])


# ---- ErrorFeedback: a wrapper, split in one place
def test_error_feedback_wraps_a_compressor_without_being_one():
    assert not issubclass(gc.ErrorFeedback, gc.Compressor) and not issubclass(gc.DGC, gc.Compressor)
    q = gc.Int8Quantizer(block_size=32)
    ef = gc.ErrorFeedback(q)
    assert split(q) == (q, None) and split(ef) == (q, ef)
    dgc = gc.DGC(gc.TopK(ratio=0.1))
    assert split(dgc) == (dgc.wraps, dgc)
    assert (ef.codec, ef.sparse, ef.lossy) == ("int8", False, True)
    assert (dgc.codec, dgc.sparse) == ("topk", True)
    with pytest.raises(TypeError, match="compressor must be a gradcomp compressor or None"):
        split("int8", "compressor", " or None")
    with pytest.raises(ValueError, match="x must not be an ErrorFeedback: pass the compressor itself; because"):
        unwrapped(ef, "x", "because")
    assert unwrapped(q, "x", "because") is q
    # a collective's view of this rank: codec for sums, the error feedback for its own data
    local = Local(torch.zeros(64), ef, key="k")
    assert local.inner is q and local.mode == "keyed"
    # the payload is the wrapped compressor's, decoded by the table; the residual holds the error
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    p = ef.compress(x, key="k")
    assert torch.equal(p.wire, gc.Int8Quantizer(block_size=32).compress(x).wire)
    torch.testing.assert_close(gc.decompress(p.wire).double() + ef.residual("k").double(), x.double())
    assert torch.equal(ef.decompress(p), gc.decompress(p))
    assert ef.wire_nbytes((64,)) == p.nbytes == 48 + 4 * 2 + 64
    c = ef.clone()
    assert c is not ef and c.wraps is not q and torch.equal(c.residual("k"), ef.residual("k"))


def test_values_compressor_must_not_be_an_error_feedback():
    with pytest.raises(ValueError, match="values must be a dense compressor"):
        gc.TopK(k=1, values=gc.ErrorFeedback(gc.Int8Quantizer()))


# ---- one table: no other module maps codec names to ids or decoders
@functools.cache
def _sources() -> tuple[tuple[str, str, ast.AST], ...]:
    """``(path relative to the package, source, tree)`` of every gradcomp module."""
    return tuple((p.relative_to(PACKAGE).as_posix(), p.read_text(), ast.parse(p.read_text()))
                 for p in sorted(PACKAGE.rglob("*.py")))


def _codec_maps(tree: ast.AST) -> list[int]:
    """Lines of dict displays keyed by wire codec names with ids (or keyed by
    "raw": a codec -> compressor table), or keyed by ids with codec names as
    values, and tuples/sets/lists of codec names listing the sparse ones."""
    names = set(SPEC)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            vals = [v.value for v in node.values if isinstance(v, ast.Constant)]
            by_name = len(names & {k for k in keys if isinstance(k, str)}) >= 2
            if by_name and ("raw" in keys or any(isinstance(v, int) for v in vals)):
                lines.append(node.lineno)
            if len(names & {v for v in vals if isinstance(v, str)}) >= 2 and any(isinstance(k, int) for k in keys):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Tuple, ast.Set, ast.List)):
            elts = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if {"topk", "threshold"} <= elts <= names:  # not the kernel ops' lists
                lines.append(node.lineno)
    return lines


def test_no_module_but_the_wire_defines_a_codec_table():
    found = {}
    for rel, src, tree in _sources():
        if rel == "wire.py":
            continue
        hits = _codec_maps(tree)
        for word in ("_DECODERS", "decoder_for", "compressor_for_codec", "SPARSE_CODECS", "TopK(k=1)",
                     "Threshold(0.0)"):
            if word in src:
                hits.append(word)
        if "register_decoder(" in src and not rel.startswith("compressors/"):
            hits.append("register_decoder outside gradcomp/compressors")
        if hits:
            found[rel] = hits
    assert found == {}
    # and the scan does catch the old tables
    old = ('T = {"raw": NoCompression, "fp16": FP16, "int8": Int8Quantizer}\n'
           'CODECS = {"raw": 1, "fp16": 2}\nNAMES = {1: "raw", 2: "fp16"}\nSPARSE = ("topk", "threshold")\n')
    assert _codec_maps(ast.parse(old)) == [1, 2, 3, 4]


def test_no_isinstance_error_feedback_branch_in_the_transports():
    """Transports and integrations ask split() / unwrapped(), never the type."""
    allowed = {"compressors/error_feedback.py", "adaptive.py"}
    found = []
    for rel, _, tree in _sources():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                    and len(node.args) == 2 and "ErrorFeedback" in ast.unparse(node.args[1])
                    and rel not in allowed):
                found.append((rel, node.lineno))
    assert found == []
