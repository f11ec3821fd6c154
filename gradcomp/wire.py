"""Wire format: a compressed tensor as one self-describing ``torch.uint8`` tensor.

Only these bytes travel between ranks; a payload decodes from them alone. A 40 + 8 ndim
byte header (magic ``b"GCMP"``, version, codec id, original dtype, ndim, flags, a
codec parameter such as the block size, numel, nnz, shape, CRC-32) is followed by the
codec's sections. :data:`CODECS` is the one table of codecs: each row names its id and
kind, the parser that validates its sections, and its decoder. The layout of every
codec (packed int4 / int2 / sign bits, fp8 bit patterns, Elias-Fano sparse indices) is
documented in ``docs/wire-format.md``.

Decoding validates the header and every section against the byte length, and the data
where a bad value could cause harm or lies outside the format; any inconsistency raises
:class:`gradcomp.PayloadError`, and decoding never reads out of bounds.
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from gradcomp import _validate as v
from gradcomp import index_codec
from gradcomp.errors import PayloadError

__all__ = [
    "MAGIC",
    "VERSION",
    "Codec",
    "CODECS",
    "codec",
    "register_decoder",
    "Payload",
    "decode",
    "header_nbytes",
    "dense_nbytes",
    "sparse_nbytes",
    "index_section",
    "build_header",
    "BLOCK_CODE_BITS",
    "DEFAULT_MAX_NUMEL",
    "header_tensor",
]

MAGIC = b"GCMP"
#: the newest version written (compact sparse indices); version 1 is the rest
VERSION = 2
VERSIONS = (1, 2)
MAX_NDIM = 8
_FIXED = struct.Struct("<4sBBBBB3sIQQ")  # 32 bytes
assert _FIXED.size == 32



@dataclass(eq=False)
class Codec:
    """One wire codec: a row of :data:`CODECS`, the only table of codecs.

    Attributes:
        name: the codec's name (``Payload.codec``, ``Compressor.codec``).
        id: its byte in the header (offset 5).
        sparse: payloads hold (indices, values) of some elements; dense ones hold every element.
        lossy: decoding does not give back the encoded values exactly.
        decoder: how its payloads decode from their bytes alone (a
            :class:`gradcomp.compressors.Decoder`), registered by the
            compressor module that writes the codec (:func:`register_decoder`);
            None until that module is imported.
        parse: ``parse(p, wire, h, flags, param)`` fills payload ``p``'s sections
            from the bytes after the ``h``-byte header, validating them (PayloadError);
            None for the codecs :func:`decode` parses itself.
    """

    name: str
    id: int
    sparse: bool
    lossy: bool
    decoder: object = field(default=None, repr=False)
    parse: Callable | None = field(default=None, repr=False)


def _fail(msg: str):
    raise PayloadError(msg)


def _view(wire: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` at byte offset ``start`` (copied if misaligned)."""
    isz = torch.empty(0, dtype=dtype).element_size()
    seg = wire[start : start + count * isz]
    if count == 0:
        return torch.empty(0, dtype=dtype, device=wire.device)
    if (seg.storage_offset() % isz) != 0:
        seg = seg.clone()
    return seg.view(dtype)


def _bad_int4(c: torch.Tensor) -> bool:
    """Whether a nibble of the packed int4 codes is ``0b1000`` (-8, outside [-7, 7])."""
    low = c & 0x77
    any_low = low | (low >> 1) | (low >> 2)  # bit 0 / bit 4: any of the nibble's low three bits
    return bool(((c >> 3) & 0x11 & ~any_low).any())


def _bad_int2(c: torch.Tensor) -> bool:
    """Whether a 2-bit field of the packed int2 codes is ``0b10`` (-2, outside [-1, 1])."""
    return bool(((c & 0xAA) & ~((c & 0x55) << 1)).any())


def _bad_fp8e4m3(c: torch.Tensor) -> bool:
    """Whether a float8_e4m3fn code is NaN (``0x7F`` / ``0xFF``: an encoder never writes one)."""
    return bool(((c & 0x7F) == 0x7F).any())


def _bad_fp8e5m2(c: torch.Tensor) -> bool:
    """Whether a float8_e5m2 code is Inf or NaN (an all-ones exponent)."""
    return bool(((c & 0x7C) == 0x7C).any())


def _parse_blocks(p: "Payload", wire: torch.Tensor, h: int, flags: int, param: int, *, bits: int,
                  stochastic: bool, bad_codes: Callable | None) -> None:
    """Sections of a blockwise codec (int4, int2, sign, fp8): ``ceil(n / B)`` float32 scales,
    then the codes, ``bits`` per element (packed, unused bits of the last byte zero)."""
    name, n, b = p.codec, p.numel, param
    if b < 32 or b > 65536 or b & (b - 1):
        _fail(f"{name} block size {b} is not a power of two in [32, 65536]")
    if flags & ~(FLAG_STOCHASTIC if stochastic else 0):
        _fail(f"flags {flags:#x} are not valid for codec {name!r}")
    nb, ncodes = -(-n // b), -(-n * bits // 8)
    if wire.numel() != h + 4 * nb + ncodes:
        _fail(f"{name} payload of shape {tuple(p.shape)} must be {h + 4 * nb + ncodes} bytes, got {wire.numel()}")
    p.block_size, p.stochastic = b, bool(flags & FLAG_STOCHASTIC)
    p.scales = _view(wire, h, nb, torch.float32)
    p.codes = wire[h + 4 * nb:]
    if nb and bool(((p.scales < 0) | torch.isinf(p.scales)).any()):
        _fail(f"{name} scales must be >= 0 and finite (or NaN for a non-finite block)")
    spare = ncodes * 8 - n * bits  # unused bits at the top of the last byte
    if spare and int(p.codes[-1]) >> (8 - spare):
        _fail(f"{name} padding bits after the last code are not zero")
    if n and bad_codes is not None and bad_codes(p.codes):
        _fail(f"{name} codes hold a value outside the format (see docs/wire-format.md)")


def _blocks_codec(name: str, cid: int, bits: int, stochastic: bool, bad_codes: Callable | None) -> "Codec":
    def parse(p, wire, h, flags, param):
        _parse_blocks(p, wire, h, flags, param, bits=bits, stochastic=stochastic, bad_codes=bad_codes)

    return Codec(name, cid, sparse=False, lossy=True, parse=parse)


#: name -> :class:`Codec`, the codecs this gradcomp reads and writes
CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("raw", 1, sparse=False, lossy=False),
    Codec("fp16", 2, sparse=False, lossy=True),
    Codec("bf16", 3, sparse=False, lossy=True),
    Codec("int8", 4, sparse=False, lossy=True),
    Codec("topk", 5, sparse=True, lossy=True),
    Codec("threshold", 6, sparse=True, lossy=True),
    _blocks_codec("int4", 7, 4, True, _bad_int4),
    _blocks_codec("int2", 8, 2, True, _bad_int2),
    _blocks_codec("sign", 9, 1, False, None),
    _blocks_codec("fp8e4m3", 10, 8, False, _bad_fp8e4m3),
    _blocks_codec("fp8e5m2", 11, 8, False, _bad_fp8e5m2),
)}
#: bits per element of the codes of each blockwise codec (after the float32 scales)
BLOCK_CODE_BITS = {"int8": 8, "int4": 4, "int2": 2, "sign": 1, "fp8e4m3": 8, "fp8e5m2": 8}
_BY_ID = {c.id: c for c in CODECS.values()}


def codec(key: str | int) -> Codec:
    """The row of :data:`CODECS` for a codec name or a header's codec id.

    Raises:
        PayloadError: an unknown id (it came from bytes).
        ValueError: an unknown name. TypeError: neither a str nor an int.
    """
    if isinstance(key, str):
        row = CODECS.get(key)
        if row is None:
            raise ValueError(f"codec must be one of {tuple(CODECS)}, got {key!r}")
        return row
    if isinstance(key, bool) or not isinstance(key, int):
        raise TypeError(f"codec must be a codec name (str) or wire id (int), got {type(key).__name__}")
    row = _BY_ID.get(key)
    if row is None:
        _fail(f"unknown codec id {key}, expected one of {sorted(_BY_ID)}")
    return row


def register_decoder(name: str, decoder) -> None:
    """Set the decoder of codec ``name`` (done once, by the compressor module writing it).

    Raises:
        ValueError: an unknown name, or a codec that already has another decoder.
    """
    row = codec(name)
    if row.decoder is not None and row.decoder is not decoder:
        raise ValueError(f"codec {name!r} already has a decoder ({row.decoder!r})")
    row.decoder = decoder

DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
_DTYPE_OF = {v: k for k, v in DTYPES.items()}
FLAG_STOCHASTIC = 1
FLAG_INDEX64 = 2
FLAG_COMPACT = 4
_MAX_NUMEL = 1 << 48
#: default largest number of elements :func:`decode` accepts (2**31, 8 GiB as
#: float32): a sparse payload of a few bytes may declare any numel, and
#: decompressing it allocates that many elements
DEFAULT_MAX_NUMEL = 1 << 31
#: fp16 scale exponent range per dtype (not float64 / float64): 2.0 ** e and
#: 2.0 ** -e are normal numbers of the decoding float type
FP16_EXPONENT_RANGE = ((-126, 127), (-1022, 1023))


def header_nbytes(ndim: int) -> int:
    """Header size in bytes for a tensor of ``ndim`` dimensions."""
    return 40 + 8 * ndim


def _pad8(nbytes: int) -> int:
    return (nbytes + 7) & ~7


def dense_nbytes(codec: str, shape, dtype: torch.dtype = torch.float32, block_size: int = 256) -> int:
    """Exact wire size in bytes of a dense payload (raw, fp16, bf16 or a blockwise codec)."""
    shape = tuple(shape)
    n = math.prod(shape)
    h = header_nbytes(len(shape))
    if codec == "raw":
        return h + n * torch.empty(0, dtype=dtype).element_size()
    if codec in ("fp16", "bf16"):
        return h + 2 * n
    if codec in BLOCK_CODE_BITS:
        return h + 4 * (-(-n // block_size)) + -(-n * BLOCK_CODE_BITS[codec] // 8)
    raise ValueError(f"codec must be one of {('raw', 'fp16', 'bf16', *BLOCK_CODE_BITS)}, got {codec!r}")


def index_section(n: int, nnz: int, compact: bool = True) -> tuple[bool, int]:
    """``(compact, nbytes)``: how ``nnz`` indices in ``[0, n)`` are written and
    their section's size in bytes, padding included. ``compact`` (Elias-Fano)
    is used when asked and smaller than fixed-width int32/int64 indices."""
    fixed = _pad8(nnz * (4 if n < 2**31 else 8))
    if compact and nnz:
        ef = _pad8(index_codec.section_nbytes(n, nnz))
        if ef < fixed:
            return True, ef
    return False, fixed


def sparse_nbytes(shape, nnz: int, values_nbytes: int, compact: bool = True) -> int:
    """Exact wire size in bytes of a top-k/threshold payload whose nested values
    payload has ``values_nbytes`` bytes (``compact``: indices coded compactly
    where that is smaller, as the sparse compressors do by default)."""
    shape = tuple(shape)
    return header_nbytes(len(shape)) + index_section(math.prod(shape), nnz, compact)[1] + values_nbytes


def build_header(
    codec: str,
    dtype: torch.dtype,
    shape,
    *,
    param: int = 0,
    nnz: int = 0,
    flags: int = 0,
) -> bytes:
    """The header bytes (see the module docstring); version 2 when ``flags``
    has :data:`FLAG_COMPACT`, else 1."""
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensors of at most {MAX_NDIM} dimensions are supported, got {len(shape)}")
    n = math.prod(shape)
    fixed = _FIXED.pack(
        MAGIC, 2 if flags & FLAG_COMPACT else 1, CODECS[codec].id, DTYPES[dtype], len(shape), flags, b"\0\0\0",
        param & 0xFFFFFFFF, n, nnz,
    )
    body = fixed + struct.pack(f"<{len(shape)}q", *shape)
    return body + struct.pack("<I", zlib.crc32(body)) + b"\0\0\0\0"


def header_tensor(header: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)


@dataclass
class Payload:
    """A decoded (or freshly encoded) compressed tensor.

    Attributes:
        wire: 1-D ``torch.uint8`` tensor, exactly the bytes that travel.
        codec: a name of :data:`CODECS` (``"raw"``, ``"int8"``, ``"int4"``, ``"topk"``, ...).
        dtype: the original tensor's dtype; shape: its shape.
        block_size: block size of the blockwise codecs (elements); exponent: fp16 power-of-two exponent.
        stochastic: int8 / int4 / int2 codes were drawn with stochastic rounding.
        nnz: kept elements (sparse codecs).
        data: raw/fp16/bf16 values (views into ``wire``).
        scales, codes: blockwise sections: float32 ``[ceil(n/B)]`` scales; codes int8 ``[n]``
            (int8), else uint8 (packed int4 / int2 / sign bits, fp8 bit patterns; docs/wire-format.md).
        indices: sparse indices (int32/int64 ``[nnz]``); values: nested dense Payload.
        int8_checked: int8 codes and scales were checked to be in range
            (False after ``decode(..., check_int8=False)``: the kernel that
            reads them checks them).
    """

    wire: torch.Tensor
    codec: str
    dtype: torch.dtype
    shape: torch.Size
    block_size: int = 0
    exponent: int = 0
    stochastic: bool = False
    nnz: int = 0
    data: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    values: "Payload | None" = None
    meta: dict = field(default_factory=dict)
    int8_checked: bool = True

    @property
    def nbytes(self) -> int:
        """Wire size in bytes (``== wire.numel()``)."""
        return self.wire.numel()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.wire.device

    @property
    def sparse(self) -> bool:
        return CODECS[self.codec].sparse

    def __repr__(self) -> str:
        return (
            f"Payload(codec={self.codec!r}, dtype={self.dtype}, shape={tuple(self.shape)}, "
            f"nbytes={self.nbytes}, nnz={self.nnz}, block_size={self.block_size})"
        )


def _parse_header(wire: torch.Tensor):
    total = wire.numel()
    if total < 40:
        _fail(f"payload truncated: {total} bytes is shorter than the smallest header (40 bytes)")
    # one device-to-host copy covers the largest header
    head = bytes(wire[: header_nbytes(MAX_NDIM)].cpu().numpy().tobytes())
    magic, version, codec_id, dtype, ndim, flags, reserved, param, n, nnz = _FIXED.unpack_from(head)
    if magic != MAGIC:
        _fail(f"bad magic {magic!r}, expected {MAGIC!r}: not a gradcomp payload")
    if version not in VERSIONS:
        _fail(f"unsupported payload version {version}, this gradcomp reads versions {VERSIONS}")
    name = codec(codec_id).name  # PayloadError for an unknown id
    if dtype not in _DTYPE_OF:
        _fail(f"unknown dtype id {dtype}, expected one of {sorted(_DTYPE_OF)}")
    if ndim > MAX_NDIM:
        _fail(f"ndim {ndim} exceeds the maximum {MAX_NDIM}")
    if reserved != b"\0\0\0" or flags & ~(FLAG_STOCHASTIC | FLAG_INDEX64 | FLAG_COMPACT):
        _fail("reserved header bits are set")
    if bool(flags & FLAG_COMPACT) != (version == 2):
        _fail(f"compact-index flag {'set' if flags & FLAG_COMPACT else 'clear'} in a version {version} "
              "payload (version 2 is exactly the payloads with compact indices)")
    h = header_nbytes(ndim)
    if total < h:
        _fail(f"payload truncated: {total} bytes, header alone needs {h}")
    head = head[:h]
    (crc,) = struct.unpack_from("<I", head, h - 8)
    if zlib.crc32(head[: h - 8]) != crc or head[h - 4 :] != b"\0\0\0\0":
        _fail("header checksum mismatch: the header bytes are corrupted")
    shape = struct.unpack_from(f"<{ndim}q", head, 32)
    if any(d < 0 for d in shape):
        _fail(f"negative dimension in shape {shape}")
    if math.prod(shape) != n or n >= _MAX_NUMEL:
        _fail(f"numel {n} does not match shape {shape}")
    return name, _DTYPE_OF[dtype], torch.Size(shape), flags, param, n, nnz, h


def decode(wire: torch.Tensor, _nested: bool = False, *, check_int8: bool = True,
           max_numel: int = DEFAULT_MAX_NUMEL) -> Payload:
    """Decode wire bytes into a :class:`Payload`, validating everything.

    Args:
        wire: 1-D ``torch.uint8`` tensor on any device (a contiguous byte buffer).
        max_numel: largest number of elements accepted (default
            :data:`DEFAULT_MAX_NUMEL` = 2**31): what decompressing untrusted
            bytes may allocate, since a sparse payload's numel is not backed
            by its length. Raise it to decode larger tensors.
        check_int8: check here that int8 codes are in [-127, 127] and scales
            are >= 0 and finite, or NaN (a pass over them). ``False`` leaves it
            to the compressor's kernel call, which raises
            :class:`~gradcomp.PayloadError` (the native CPU kernel checks each
            block as it reads it, saving that pass; other backends make the
            same pass there); the collectives use it for the payloads they
            reduce, whose output is unspecified after an error anyway.
            Everything else is checked here.

    Returns:
        The payload; its section tensors are views into ``wire`` where aligned.

    Raises:
        TypeError: ``wire`` is not a uint8 tensor.
        PayloadError: the bytes are malformed in any way (see module docstring).
    """
    v.flag("check_int8", check_int8)
    max_numel = v.integer("max_numel", max_numel, 0)
    if not isinstance(wire, torch.Tensor):
        raise TypeError(f"wire must be a torch.Tensor of dtype uint8, got {type(wire).__name__}")
    if wire.dtype != torch.uint8:
        raise TypeError(f"wire must have dtype torch.uint8, got {wire.dtype}")
    if wire.is_meta or wire.layout != torch.strided:
        raise TypeError("wire must be a dense uint8 tensor holding the bytes, got a "
                        + ("meta tensor (no data)" if wire.is_meta else f"{wire.layout} tensor"))
    if sys.byteorder != "little":  # pragma: no cover
        raise PayloadError("gradcomp payloads are little-endian; this host is big-endian")
    wire = wire.reshape(-1)
    if not wire.is_contiguous():
        wire = wire.contiguous()
    codec, dtype, shape, flags, param, n, nnz, h = _parse_header(wire)
    if n > max_numel:
        _fail(f"payload declares {n} elements, more than max_numel={max_numel} "
              "(pass a larger max_numel to decode it)")
    total = wire.numel()
    p = Payload(wire=wire, codec=codec, dtype=dtype, shape=shape)
    if nnz != 0 and not CODECS[codec].sparse:
        _fail(f"dense codec {codec!r} with nonzero nnz {nnz}")
    if CODECS[codec].parse is not None:
        CODECS[codec].parse(p, wire, h, flags, param)
        return p
    sparse = CODECS[codec].sparse
    if codec != "int8" and flags & FLAG_STOCHASTIC:
        _fail(f"stochastic flag set on codec {codec!r}")
    if not sparse and flags & (FLAG_INDEX64 | FLAG_COMPACT):
        _fail(f"index flag set on codec {codec!r}")
    compact = bool(flags & FLAG_COMPACT)
    if codec not in ("int8", "fp16") and not compact and param != 0:
        _fail(f"codec {codec!r} with nonzero parameter {param}")

    def expect(size: int):
        if total != size:
            _fail(f"{codec} payload of shape {tuple(shape)} must be {size} bytes, got {total}")

    if codec == "raw":
        isz = torch.empty(0, dtype=dtype).element_size()
        expect(h + n * isz)
        p.data = _view(wire, h, n, dtype)
    elif codec in ("fp16", "bf16"):
        if codec == "fp16":
            # an encoder never needs more than ~1008 for float64 (its largest value
            # over 65504) or 113 for the others (float32's), nor less than the
            # bounds it clamps to; a larger exponent would overflow the scale
            # itself (2.0 ** 1024 raises, 2.0 ** 128 is inf in float32 and turns
            # zeros into NaN)
            e = param - (1 << 32) if param >= 1 << 31 else param
            lo, hi = FP16_EXPONENT_RANGE[dtype == torch.float64]
            if not lo <= e <= hi:
                _fail(f"fp16 exponent {e} out of range [{lo}, {hi}] for dtype {dtype}")
            p.exponent = e
        expect(h + 2 * n)
        p.data = _view(wire, h, n, torch.float16 if codec == "fp16" else torch.bfloat16)
    elif codec == "int8":
        b = param
        if b < 32 or b > 65536 or b & (b - 1):
            _fail(f"int8 block size {b} is not a power of two in [32, 65536]")
        nb = -(-n // b)
        expect(h + 4 * nb + n)
        p.block_size = b
        p.stochastic = bool(flags & FLAG_STOCHASTIC)
        p.scales = _view(wire, h, nb, torch.float32)
        p.codes = _view(wire, h + 4 * nb, n, torch.int8)
        if not check_int8:
            p.int8_checked = False
        else:
            if n and int(p.codes.min()) == -128:  # a reduction: no n-byte temporary
                _fail("int8 code -128 is outside [-127, 127]")
            if nb and bool(((p.scales < 0) | torch.isinf(p.scales)).any()):
                _fail("int8 scales must be >= 0 and finite (or NaN for a non-finite block)")
    else:  # sparse
        if _nested:
            _fail("a sparse payload cannot nest another sparse payload")
        if nnz > n:
            _fail(f"nnz {nnz} exceeds numel {n}")
        big = bool(flags & FLAG_INDEX64)
        if big != (n >= 2**31):
            _fail("index width flag does not match numel")
        if compact:
            if nnz == 0 or not index_section(n, nnz)[0]:
                _fail(f"compact indices for nnz {nnz} of numel {n}, where they are not smaller")
            if param != index_codec.low_bits(n, nnz):
                _fail(f"compact-index low-bit width {param}, expected {index_codec.low_bits(n, nnz)}")
            used = index_codec.section_nbytes(n, nnz)
        else:
            used = nnz * (8 if big else 4)
        off = h + _pad8(used)
        if total < off + 40:
            _fail(f"{codec} payload truncated: {total} bytes, indices end at {off}")
        if bool(wire[h + used : off].any()):
            _fail("nonzero padding after the indices")
        p.nnz = nnz
        if compact:
            p.indices = index_codec.decode(wire[h : h + used], n, nnz, torch.int64 if big else torch.int32)
        else:
            p.indices = _view(wire, h, nnz, torch.int64 if big else torch.int32)
            if nnz:
                first, last = int(p.indices[0]), int(p.indices[-1])
                if first < 0 or last >= n:
                    _fail(f"sparse index out of range [0, {n})")
                if nnz > 1 and not bool((p.indices[1:] > p.indices[:-1]).all()):
                    _fail("sparse indices are not strictly ascending")
        try:
            p.values = decode(wire[off:], _nested=True, max_numel=max_numel)
        except PayloadError as e:
            raise PayloadError(f"{codec} values: {e}") from None
        if p.values.shape != torch.Size([nnz]) or p.values.dtype != dtype:
            _fail(
                f"{codec} values payload must have shape ({nnz},) and dtype {dtype}, "
                f"got {tuple(p.values.shape)} and {p.values.dtype}"
            )
    return p
