"""Compression ratio of every dense codec, from the wire bytes it writes, and its error.

For a float32 tensor of ``--numel`` standard normal elements (``--seed``), each codec compresses
once; printed per codec: wire bytes (``payload.nbytes``, header included), bits per element,
the compression ratio against the uncompressed payload (NoCompression's wire bytes), the
relative L2 error of one round trip, and the same after ``--steps`` error-feedback steps on
fresh draws (the residual carried; the error of the running sum, which error feedback keeps
bounded). Usage::

    python benchmarks/codec_ratios.py [--numel 16777216] [--steps 8] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

import gradcomp as gc

CODECS = {
    "none": gc.NoCompression, "fp16": gc.FP16, "bf16": gc.BF16, "int8": gc.Int8Quantizer,
    "fp8 e4m3": lambda: gc.FP8("e4m3"), "fp8 e5m2": lambda: gc.FP8("e5m2"),
    "int4": lambda: gc.IntQuantizer(4), "int4 stochastic": lambda: gc.IntQuantizer(4, rounding="stochastic"),
    "int2": lambda: gc.IntQuantizer(2), "sign (block 1024)": gc.SignQuantizer,
    "sign (block 256)": lambda: gc.SignQuantizer(block_size=256),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(numel: int, steps: int, seed: int) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=g) for _ in range(steps)]
    raw = gc.NoCompression().compress(xs[0]).nbytes
    rows = []
    for name, make in CODECS.items():
        c = make()
        p = c.compress(xs[0])
        one = _rel(c.decompress(p), xs[0])
        ef, sent = gc.ErrorFeedback(make()), torch.zeros(numel, dtype=torch.float64)
        for x in xs:
            sent += ef.decompress(ef.compress(x, key=0)).double()
        total = sum(x.double() for x in xs)
        rows.append((name, p.nbytes, 8 * p.nbytes / numel, raw / p.nbytes, one, _rel(sent, total)))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=2**24)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(f"float32, numel {args.numel}, standard normal (seed {args.seed}); ratio vs NoCompression's wire bytes")
    print(f"{'codec':<20}{'wire bytes':>12}{'bits/elem':>10}{'ratio':>8}{'rel err':>10}"
          f"{f'EF err ({args.steps})':>14}")
    for name, nbytes, bits, ratio, one, ef in run(args.numel, args.steps, args.seed):
        print(f"{name:<20}{nbytes:>12}{bits:>10.3f}{ratio:>8.2f}{one:>10.4f}{ef:>14.5f}")


if __name__ == "__main__":
    main()
