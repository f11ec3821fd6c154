"""IntQuantizer (int4 / int2), SignQuantizer and FP8 as compressors: wire sizes, decoding from the
bytes alone, error feedback, malformed bytes, bad arguments, and the collectives and DDP hook."""

from __future__ import annotations

import copy
import math
import pickle
import struct
import zlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp as gc
from gradcomp import wire as W
from gradcomp.compressors import Compressor
from gradcomp.launch import launch

MAKERS = {
    "int4": lambda: gc.IntQuantizer(4),
    "int4_sr": lambda: gc.IntQuantizer(4, block_size=64, rounding="stochastic", seed=3),
    "int2": lambda: gc.IntQuantizer(2, block_size=128),
    "sign": lambda: gc.SignQuantizer(),
    "sign_b32": lambda: gc.SignQuantizer(block_size=32),
    "fp8e4m3": lambda: gc.FP8("e4m3"),
    "fp8e5m2": lambda: gc.FP8("e5m2", block_size=1024),
}
CODE_BITS = {"int4": 4, "int2": 2, "sign": 1, "fp8e4m3": 8, "fp8e5m2": 8}


def _x(n=3000, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("name", MAKERS)
@pytest.mark.parametrize("shape", [(3000,), (7, 33), (1,), (0,), (2, 0, 3)])
def test_round_trip_sizes_and_decoding_from_bytes(name, shape):
    c = MAKERS[name]()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    p = c.compress(x)
    n = x.numel()
    want = W.header_nbytes(len(shape)) + 4 * math.ceil(n / c.block_size) + math.ceil(n * CODE_BITS[c.codec] / 8)
    assert p.nbytes == want == c.wire_nbytes(shape) == p.wire.numel()
    y = c.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    q = gc.decode(p.wire.clone())
    assert q.codec == c.codec and q.block_size == c.block_size
    assert torch.equal(gc.decompress(p.wire.clone()), y)  # no compressor needed
    acc = torch.ones(n)
    assert torch.equal(c.decompress_add_(p, acc), torch.ones(n) + y.reshape(-1))
    out = torch.empty(shape)
    assert c.decompress(p.wire, out=out) is out and torch.equal(out, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["int4", "sign", "fp8e4m3"])
def test_other_dtypes_decode_to_their_dtype(name, dtype):
    c = MAKERS[name]()
    x = _x(1000).to(dtype)
    y = c.decompress(c.compress(x))
    assert y.dtype == dtype
    out = torch.empty(1000, dtype=dtype)
    assert torch.equal(c.decompress(c.compress(x), out=out), y)
    assert torch.equal(y, c.decompress(c.compress(x.float())).to(dtype))


def test_errors_within_the_codec_bounds():
    x = _x(4096)
    blocks = x.view(-1, 256).abs().amax(1).repeat_interleave(256)
    for bits, q in ((4, 7), (2, 1)):
        err = (gc.IntQuantizer(bits).decompress(gc.IntQuantizer(bits).compress(x)) - x).abs()
        assert (err <= 0.5 * blocks / q * (1 + 1e-5)).all(), bits
    err = (gc.FP8("e4m3").decompress(gc.FP8("e4m3").compress(x)) - x).abs()
    # half a unit in the last place: 2**-4 relative with 3 mantissa bits, 2**-10 of the scale for subnormals
    assert (err <= x.abs() * (2**-4 + 1e-6) + blocks / 448 * 2**-10).all()
    s = gc.SignQuantizer(block_size=256)
    y = s.decompress(s.compress(x))
    means = x.view(-1, 256).abs().mean(1).repeat_interleave(256)
    torch.testing.assert_close(y.abs(), means, rtol=1e-5, atol=0)
    assert torch.equal(torch.sign(y), torch.where(x < 0, -1.0, 1.0))


def test_compression_ratios_are_the_documented_ones():
    n = 2**20
    ratio = {name: 4 * n / MAKERS[name]().wire_nbytes((n,)) for name in ("int4", "sign")}
    assert 7.5 <= ratio["int4"] < 8 and 30 <= ratio["sign"] < 32  # 7.76x at block 256; 1.03 bits at 1024
    assert gc.IntQuantizer(2).wire_nbytes((n,)) * 15 < 4 * n


def test_int_quantizer_at_8_bits_is_int8():
    x = _x()
    for rounding in ("nearest", "stochastic"):
        a, b = gc.IntQuantizer(8, 64, rounding, seed=2), gc.Int8Quantizer(64, rounding, seed=2)
        assert torch.equal(a.compress(x).wire, b.compress(x).wire)
        assert a.codec == b.codec == "int8" and isinstance(b, gc.IntQuantizer)
    assert gc.Int8Quantizer().part_align() == 256 and gc.IntQuantizer(4).part_align() == 0


@pytest.mark.parametrize("name", MAKERS)
def test_fused_error_feedback_equals_the_unfused_definition(name):
    ef, c = gc.ErrorFeedback(MAKERS[name]()), MAKERS[name]()
    r = torch.zeros(3000)
    for step in range(4):
        x = _x(seed=step)
        p = ef.compress(x, key="w")
        px = x + r
        want = c._encode(px, x.dtype, x.shape)  # Compressor's path: compress the sum, decode it
        r = px - c.decompress(want)
        assert torch.equal(p.wire, want.wire), step
        assert torch.equal(ef.residual("w"), r), step
    # nothing is lost: what was decoded plus the residual is the sum of the inputs
    total = sum(_x(seed=s).double() for s in range(4))
    dec = gc.ErrorFeedback(MAKERS[name]())
    got = sum(dec.decompress(dec.compress(_x(seed=s), key=0)).double() for s in range(4))
    torch.testing.assert_close(got + dec.residual(0).double(), total, rtol=0, atol=1e-4)


def test_non_finite_input_decodes_to_nan_and_resets_the_residual():
    x = _x(1024)
    x[5] = float("inf")
    for name in ("int4", "int2", "sign", "fp8e4m3", "fp8e5m2"):
        ef = gc.ErrorFeedback(MAKERS[name]())
        y = ef.decompress(ef.compress(x, key=1))
        assert y[: MAKERS[name]().block_size].isnan().all() and ef.nonfinite_resets == 1, name


@pytest.mark.parametrize("name", ["int4", "int4_sr", "int2"])
@pytest.mark.parametrize("divisor,decode", [(1, False), (3, True), (4, False)])
def test_reduce_compress_is_the_composition(name, divisor, decode):
    fast, slow = MAKERS[name](), MAKERS[name]()
    p = MAKERS[name]().compress(_x(5003, 1))
    acc = _x(5003, 2)
    a1, a2 = acc.clone(), acc.clone()
    out = torch.empty(fast.wire_nbytes((5003,)), dtype=torch.uint8)
    r1 = fast.reduce_compress_(p, a1, divisor=divisor, out=out, decode=decode)
    r2 = Compressor.reduce_compress_(slow, p, a2, divisor=divisor, decode=decode)
    assert r1.wire is out and torch.equal(r1.wire, r2.wire) and torch.equal(a1, a2)
    assert fast.state_dict() == slow.state_dict()


def test_copies_pickles_and_state():
    c = gc.IntQuantizer(2, 64, "stochastic", seed=9)
    c.compress(_x())
    for d in (copy.deepcopy(c), pickle.loads(pickle.dumps(c)), c.clone()):
        assert type(d) is gc.IntQuantizer and d.state_dict() == {"counter": 1, "seed": 9} and d.bits == 2
        assert torch.equal(d.compress(_x()).wire, copy.deepcopy(c).compress(_x()).wire)
    e = gc.IntQuantizer(4)
    e.load_state_dict(c.state_dict())
    assert e.counter == 1
    for r in (repr(c), repr(gc.SignQuantizer(64)), repr(gc.FP8("e5m2"))):
        assert r in ("IntQuantizer(bits=2, block_size=64, rounding='stochastic', seed=9)",
                     "SignQuantizer(block_size=64)", "FP8(format='e5m2', block_size=256)")


def test_bad_arguments():
    cases = [
        (lambda: gc.IntQuantizer(3), ValueError, r"bits must be one of \(8, 4, 2\), got 3"),
        (lambda: gc.IntQuantizer(True), ValueError, "bits must be one of"),
        (lambda: gc.IntQuantizer(4, block_size=48), ValueError, "block_size must be a power of two"),
        (lambda: gc.IntQuantizer(4, rounding="floor"), ValueError, r"rounding must be one of \('nearest'"),
        (lambda: gc.IntQuantizer(4, seed=1.5), TypeError, "seed must be an int"),
        (lambda: gc.SignQuantizer(block_size=2**17), ValueError, "block_size must be a power of two from 32"),
        (lambda: gc.SignQuantizer(backend="gpu"), ValueError, "backend must be None or one of"),
        (lambda: gc.FP8("e4m3fn"), ValueError, r"format must be one of \('e4m3', 'e5m2'\), got 'e4m3fn'"),
        (lambda: gc.FP8(block_size=0), ValueError, "block_size must be a power of two"),
    ]
    for make, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            make()
    with pytest.raises(ValueError, match="payload codec 'int2' does not match compressor IntQuantizer"):
        gc.IntQuantizer(4).decompress(gc.IntQuantizer(2).compress(_x()))
    with pytest.raises(ValueError, match="out must be a contiguous 1-D uint8 tensor"):
        gc.SignQuantizer().compress(_x(), out=torch.empty(10, dtype=torch.uint8))


# ------------------------------------------------------------------ malformed bytes


def _rewrite(wire: torch.Tensor, **fields) -> torch.Tensor:
    """``wire`` with header fields replaced (flags, param) and a valid CRC."""
    b = bytearray(wire.numpy().tobytes())
    if "flags" in fields:
        b[8] = fields["flags"]
    if "param" in fields:
        b[12:16] = struct.pack("<I", fields["param"])
    h = 40 + 8 * b[7]
    b[h - 8: h - 4] = struct.pack("<I", zlib.crc32(bytes(b[: h - 8])))
    return torch.frombuffer(b, dtype=torch.uint8)


def _codes_at(p) -> int:
    return W.header_nbytes(len(p.shape)) + 4 * p.scales.numel()


@pytest.mark.parametrize("name,byte,match", [
    ("int4", 0x80, "outside the format"), ("int4", 0x08, "outside the format"),
    ("int2", 0b00100000, "outside the format"), ("int2", 0b10, "outside the format"),
    ("fp8e4m3", 0x7F, "outside the format"), ("fp8e4m3", 0xFF, "outside the format"),
    ("fp8e5m2", 0x7C, "outside the format"), ("fp8e5m2", 0xFE, "outside the format"),
])
def test_codes_outside_the_format_are_payload_errors(name, byte, match):
    p = MAKERS[name]().compress(_x(1000))
    w = p.wire.clone()
    w[_codes_at(p) + 17] = byte
    with pytest.raises(gc.PayloadError, match=match):
        gc.decode(w)
    with pytest.raises(gc.PayloadError):
        gc.decompress_add_(w, torch.zeros(1000))


@pytest.mark.parametrize("name", MAKERS)
def test_bad_sections_and_headers_are_payload_errors(name):
    c = MAKERS[name]()
    p = c.compress(_x(1001))
    hs = W.header_nbytes(1)
    for scale in (-1.0, float("inf")):
        w = p.wire.clone()
        w[hs: hs + 4] = torch.tensor([scale]).view(torch.uint8)
        with pytest.raises(gc.PayloadError, match="scales must be >= 0 and finite"):
            gc.decode(w)
    w = p.wire.clone()
    w[hs: hs + 4] = torch.tensor([float("nan")]).view(torch.uint8)
    gc.decode(w)  # a NaN scale marks a non-finite block: valid
    for cut in (1, 4, p.nbytes - hs):
        with pytest.raises(gc.PayloadError):
            gc.decode(p.wire[:-cut].clone())
    with pytest.raises(gc.PayloadError, match="must be"):
        gc.decode(torch.cat([p.wire, torch.zeros(1, dtype=torch.uint8)]))
    for bad in (48, 16, 2**17, 0):
        with pytest.raises(gc.PayloadError, match="block size"):
            gc.decode(_rewrite(p.wire, param=bad))
    bad_flags = 4 if c.codec.startswith("int") else 1  # stochastic only for the integer codes
    with pytest.raises(gc.PayloadError):
        gc.decode(_rewrite(p.wire, flags=bad_flags))
    if CODE_BITS[c.codec] < 8:  # 1001 elements leave unused bits in the last byte
        w = p.wire.clone()
        w[-1] |= 0x80
        with pytest.raises(gc.PayloadError, match="padding bits"):
            gc.decode(w)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(MAKERS)), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                 min_size=1, max_size=4), st.integers(0, 40))
def test_fuzzed_bytes_raise_payload_errors_only(name, flips, cut):
    p = MAKERS[name]().compress(_x(300, 4))
    w = p.wire.clone()
    for pos, val in flips:
        w[pos % w.numel()] = val
    w = w[: w.numel() - cut] if cut < w.numel() else w[:1]
    try:
        q = gc.decode(w)
    except gc.PayloadError:
        return
    y = gc.decompress(q)  # whatever decodes, decodes to a tensor of its declared size
    assert y.numel() == q.numel


# ------------------------------------------------------------------ collectives and DDP

def _inputs(rank, n=5003):
    return torch.randn(n, generator=torch.Generator().manual_seed(rank)) * (1 + rank)


def _bound(c, xs, quantizations):
    """Per-element bound on |result - exact| of op="sum": every quantization of a (partial) sum
    in a block whose absmax is at most A_b (the sum over ranks of their own absmax in that block of
    the chunk) and whose elements are at most S_i (the sum over ranks of |x|) errs by at most
    nearest int: 0.5 A_b / qmax; stochastic int: A_b / qmax; sign: A_b (|p - s sign(p)| <= max(|p|, s));
    fp8: half an ulp, S_i 2**-4 (e4m3) or 2**-3 (e5m2), or half a subnormal step of the scale."""
    from gradcomp.comm import chunk_bounds

    n, world = xs[0].numel(), len(xs)
    a = torch.zeros(n, dtype=torch.float64)
    for lo, hi in chunk_bounds(n, world):
        for b0 in range(lo, hi, c.block_size):
            b1 = min(hi, b0 + c.block_size)
            a[b0:b1] = sum(float(x[b0:b1].abs().max()) for x in xs)
    s_abs = torch.stack([x.abs() for x in xs]).sum(0)
    if c.codec.startswith("int"):
        per = (1.0 if c.rounding == "stochastic" else 0.5) * a / (2 ** (c.bits - 1) - 1)
    elif c.codec == "sign":
        per = a
    else:
        rel, sub, top = (2.0**-4, 2.0**-10, 448.0) if c.format == "e4m3" else (2.0**-3, 2.0**-17, 57344.0)
        per = s_abs * rel + a / top * sub
    return quantizations * 1.02 * per + 1e-6 * s_abs


def _collectives(rank, world):
    out = {}
    xs = [_inputs(r).double() for r in range(world)]
    exact = torch.stack(xs).sum(0)
    for name, make in MAKERS.items():
        for algorithm in ("ring", "two_phase"):
            for ef in (False, True):
                comp = gc.ErrorFeedback(make()) if ef else make()
                y = gc.allreduce(_inputs(rank), comp, op="sum", algorithm=algorithm, timeout=60)
                ys = [torch.empty_like(y) for _ in range(world)]
                dist.all_gather(ys, y)
                bound = _bound(make(), xs, world if algorithm == "ring" else 2)
                excess = float(((y.double() - exact).abs() / bound).max())
                out[(name, algorithm, ef)] = (all(torch.equal(ys[0], t) for t in ys), excess)
    return out


@pytest.mark.slow
def test_every_codec_through_ring_and_two_phase_is_bit_identical_on_every_rank():
    res = launch(_collectives, 3, timeout=240)
    assert res[0] == res[1] == res[2]
    for (name, algorithm, ef), (same, excess) in res[0].items():
        assert same, (name, algorithm, ef)
        assert excess <= 1.0, (name, algorithm, ef, excess)  # within the per-element bound of _bound


def _ddp(rank, world, name):
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 4)))
    state = gc.ddp.GradCompState(compressor=MAKERS[name](), error_feedback=True, start_iter=0,
                                 min_compress_numel=0)
    model.register_comm_hook(state, gc.ddp.compressed_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(20, 4, generator=torch.Generator().manual_seed(99))
    losses, same = [], True
    for _ in range(40):
        x = torch.randn(32, 20, generator=g)
        loss = nn.functional.mse_loss(model(x), x @ w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        same = same and all(torch.equal(gathered[0], t) for t in gathered) and bool(flat.isfinite().all())
    return same, losses[0], sum(losses[-5:]) / 5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["int4", "int2", "sign", "fp8e4m3"])
def test_ddp_hook_trains_with_every_codec(name):
    for same, first, last in launch(_ddp, 2, (name,), timeout=180):
        assert same  # bit-identical parameters on every rank after every step
        assert last < 0.7 * first, (name, first, last)  # it learns
