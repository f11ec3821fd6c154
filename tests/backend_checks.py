"""Inputs and comparisons shared by the GPU-backend tests (Triton, CUDA)."""

import torch


def data(n, dtype, seed=0, special=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    if special and n > 64:
        x[3:40] = 0.0  # an all-zero block for block_size 32
        x[41] = 1.25
        x[42] = -1.25  # ties in |x|
        x[43] = -0.0  # in a live block: its code is 0, its residual -0
        x[50:53] = torch.tensor([1e-41, -3e-39, 2e-45])  # float32 subnormals
        if n > 160:  # a block of subnormals alone for block_size 32 (1 / absmax overflows)
            x[96:128] = torch.tensor([1e-41, -3e-39] * 16)
        x[n // 2] = float("nan")
        x[n - 5] = float("inf")
        x[n - 40] = -float("inf")
    return x.to(dtype)


def bits(t):
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a, b, what):
    """Bit-identical, NaN payloads included (one CPU's backends against each other)."""
    assert torch.equal(bits(a), bits(b)), what


def cpu_matches_reference(fn, what):
    """``fn(backend)`` returns a tuple of tensors: the CPU kernels' equal the reference's bit for bit."""
    for i, (u, v) in enumerate(zip(fn("cpu"), fn("reference"))):
        same_bits(u, v, f"{what}[{i}]")


def assert_bitwise(a, b, what):
    """Bit-identical, except that two NaNs match whatever their payload (a GPU
    produces the canonical NaN where x86 propagates an operand's)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    ab, bb = bits(a), bits(b)
    if a.is_floating_point():
        nan = torch.isnan(a.detach().cpu().float()) & torch.isnan(b.detach().cpu().float())
        ab, bb = ab[~nan], bb[~nan]
    bad = (ab != bb).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.numel()} elements differ, first at {bad[:5].view(-1).tolist()}"


def assert_selection(got, ref, what):
    assert got[0].dtype == ref[0].dtype, (what, got[0].dtype, ref[0].dtype)
    assert torch.equal(got[0].cpu(), ref[0]), f"{what}: index sets differ"
    assert torch.equal(bits(got[1]), bits(ref[1])), f"{what}: values differ"


def skewed(n, big_every_4th):
    """Data whose strided sample (every 4th element) misestimates the threshold."""
    g = torch.Generator().manual_seed(15)
    x = torch.rand(n, generator=g)
    sampled = torch.zeros(n, dtype=torch.bool)
    sampled[::4] = True
    return torch.where(sampled == big_every_4th, x + 10.0, x)
