"""The native CPU kernels' variants (baseline, AVX2, AVX-512), chosen at load: each one this
machine runs gives the reference's bits, and GRADCOMP_CPU_ISA forces one or says why it cannot."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gradcomp.kernels import available_backends

pytestmark = pytest.mark.skipif(available_backends()["cpu"] is not None, reason="gradcomp._C is not built")

HERE = os.path.dirname(os.path.abspath(__file__))

# every variant's kernels against the reference: every dtype, tails, zero / non-finite /
# subnormal blocks, both roundings, the fused reduce steps (bit patterns compared, NaN included)
CHECK = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {here!r})
    import backend_checks as C
    import gradcomp.kernels as K
    from gradcomp.kernels import cpu
    both = C.cpu_matches_reference

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for n in (1, 77, 3001, 70003):
            x = C.data(n, dtype, seed=n)
            if n > 3000:
                x[200:260] = torch.tensor([1e-41, -3e-39] * 30).to(dtype)  # subnormal block tails
            for bs in (32, 256, 4096):
                for r in ("nearest", "stochastic"):
                    both(lambda b: K.quantize_int8(x, bs, r, 3, 9, backend=b), "int8")
                    for bits in (4, 2):
                        both(lambda b: K.quantize_packed(x, bits, bs, r, 3, 9, backend=b), f"int{{bits}}")
                both(lambda b: K.quantize_sign(x, bs, backend=b), "sign")
                if dtype == torch.float32:  # fused error feedback; residual -0 keeps p = x (x[43] = -0)
                    for r in ("nearest", "stochastic"):
                        both(lambda b: (*K.quantize_int8_ef(x, e := torch.zeros(n).neg(), bs, r, 3, 9, backend=b), e),
                             "int8 ef")
                        both(lambda b: (*K.quantize_packed_ef(x, e := torch.zeros(n).neg(), 4, bs, r, 3, 9, backend=b), e),
                             "int4 ef")
                for f in ("e4m3", "e5m2"):
                    both(lambda b: K.quantize_fp8(x, f, bs, backend=b), f)
    x = C.data(70003, torch.float32, seed=1)
    for bs in (64, 1024):
        q, s = K.quantize_int8(x, bs)
        c, t = K.quantize_packed(x, 4, bs)
        for div, dec in ((1, False), (3, True)):
            def red8(b):
                acc = torch.linspace(-2, 2, 70003)
                return (*K.reduce_quantize_int8(acc, q, s, bs, div, "stochastic", 1, 2, decode=dec, backend=b), acc)
            def red4(b):
                acc = torch.linspace(-2, 2, 70003)
                return (*K.reduce_quantize_packed(acc, c, t, 4, bs, div, "nearest", decode=dec, backend=b), acc)
            both(red8, "reduce int8")
            both(red4, "reduce int4")
        for out_dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            def deq(b):
                out = torch.empty(70003, dtype=out_dtype)
                return (K.dequantize_int8(q, s, bs, out=out, backend=b),)
            both(deq, "dequantize int8")
        both(lambda b: (K.dequantize_packed(c, t, 70003, 4, bs, backend=b),), "dequantize int4")
        sc, ss = K.quantize_sign(x, bs)
        both(lambda b: (K.dequantize_sign(sc, ss, 70003, bs, backend=b),), "dequantize sign")
        fc, fs = K.quantize_fp8(x, "e5m2", bs)
        both(lambda b: (K.dequantize_fp8_add_(torch.ones(70003), fc, fs, "e5m2", bs, backend=b),), "add fp8")
    print(cpu.isa())
""").format(here=HERE)


# every variant's quantizers on the edges of their vector loops, against the reference: lengths
# around one vector (8 / 16 lanes) and one packed byte, values on the rounding ties of each code
# (half-integers of the int8 / int4 / int2 grid, midpoints of the fp8 grids, normal and
# subnormal), signed zeros, and the fused error-feedback variants (codes, scales, residual)
EDGES = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {here!r})
    import backend_checks as C
    import gradcomp.kernels as K
    from gradcomp.kernels import cpu
    both = C.cpu_matches_reference

    def ties():
        t = [127.0, -127.0] + [k + 0.5 for k in range(-127, 127)]  # int8: absmax 127, y = x
        t += [7.0, -7.0] + [k + 0.5 for k in range(-7, 7)] + [0.5, -0.5, 1.5, -1.5]
        e4 = [448.0] + [(1 + (2 * j + 1) / 16) * 2.0 ** e for e in range(-6, 8) for j in range(8)]
        e4 += [(2 * j + 1) * 2.0 ** -10 for j in range(8)] + [-0.0, 0.0, -2.0 ** -10, 2.0 ** -11]
        e5 = [57344.0] + [(1 + (2 * j + 1) / 8) * 2.0 ** e for e in range(-14, 15) for j in range(4)]
        e5 += [(2 * j + 1) * 2.0 ** -17 for j in range(4)] + [-0.0, -2.0 ** -17]
        return [torch.tensor(v, dtype=torch.float32) for v in (t, e4, e5)]

    g = torch.Generator().manual_seed(5)
    cases = [torch.randn(n, generator=g) for n in (1, 3, 7, 8, 9, 15, 16, 17, 24, 31, 33, 47, 63, 65, 263)]
    cases += ties()
    for i, x in enumerate(cases):
        if i % 2:
            x[::5] = -0.0
        res = torch.randn(x.numel(), generator=g) * 0.1
        for bs in (32, 256):
            for r in ("nearest", "stochastic"):
                both(lambda b: (*K.quantize_int8_ef(x, e := res.clone(), bs, r, 4, 2, backend=b), e), "int8 ef")
                for bits in (4, 2):
                    both(lambda b: K.quantize_packed(x, bits, bs, r, 4, 2, backend=b), f"int{{bits}}")
                    both(lambda b: (*K.quantize_packed_ef(x, e := res.clone(), bits, bs, r, 4, 2, backend=b), e),
                         f"int{{bits}} ef")
            both(lambda b: K.quantize_sign(x, bs, backend=b), "sign")
            both(lambda b: (*K.quantize_sign_ef(x, e := res.clone(), bs, backend=b), e), "sign ef")
            for f in ("e4m3", "e5m2"):
                both(lambda b: K.quantize_fp8(x, f, bs, backend=b), f)
                both(lambda b: (*K.quantize_fp8_ef(x, e := res.clone(), f, bs, backend=b), e), f + " ef")
    # fp8: one lane that codes to a subnormal (or to zero) in tile k of block k, blocks of four
    # tiles: the block's smallest |p| keeps every tile of the block off the all-normal path
    x = 0.5 + torch.rand(4096, generator=g)
    for k, tiny in enumerate((3e-5, 2.0 ** -32, -3e-5, -1e-7)):
        x[1024 * k + 256 * k + 7] = tiny
    for f in ("e4m3", "e5m2"):
        both(lambda b: K.quantize_fp8(x, f, 1024, backend=b), f + " small lane")
        both(lambda b: (*K.quantize_fp8_ef(x, e := torch.zeros(4096), f, 1024, backend=b), e), f + " small lane ef")
    print(cpu.isa())
""").format(here=HERE)


# every variant's integer quantizers against the reference on values within a few ulps of a
# rounding tie of y = (p / m) * Q (a half-integer; for stochastic rounding an integer of y + u,
# u the reference's draw), in blocks of 32 led by their absmax m (normal, tiny and subnormal
# blocks): lanes where a product by the reciprocal, rint(p * (Q / m)), would give another code
# than the reference's division (the script counts them and prints the count), so a kernel
# that skipped the division without falling back to it on such lanes fails here.
NEAR_TIES = textwrap.dedent("""
    import sys, numpy as np, torch
    sys.path.insert(0, {here!r})
    import backend_checks as C
    import gradcomp.kernels as K
    from gradcomp.kernels import cpu, reference as R
    both = C.cpu_matches_reference
    f32, BS, NB = np.float32, 32, 384
    rng = np.random.default_rng(11)

    def near_ties(q, stochastic, scale):
        m = (rng.uniform(0.3, 5.0, NB) * scale).astype(f32)
        k = rng.integers(-q, q, (NB, BS)).astype(f32)
        u = R.uniform(NB * BS, 4, 2).numpy().reshape(NB, BS)
        t = k + (f32(1) - u) if stochastic else k + f32(0.5)  # y on the tie, exactly
        p = (t * m[:, None] / f32(q)).astype(f32)
        for _ in range(3):  # a few ulps either way
            step = rng.integers(-1, 2, p.shape)
            p = np.where(step > 0, np.nextafter(p, f32(np.inf)), np.where(step < 0, np.nextafter(p, f32(-np.inf)), p))
        p = np.clip(p, -m[:, None], m[:, None]).astype(f32)
        p[:, 0] = m
        with np.errstate(over="ignore"):  # q / m overflows in the subnormal blocks
            y, yf = (p / m[:, None]).astype(f32) * f32(q), p * (f32(q) / m)[:, None]
        if stochastic:
            c, cf = np.floor(y + u), np.floor(yf + u)
        else:
            c, cf = np.rint(y), np.rint(yf)
        wrong = int((np.clip(c, -q, q) != np.clip(cf, -q, q)).sum())
        return torch.from_numpy(p.reshape(-1)), wrong

    total = 0
    for q, bits in ((127, 8), (7, 4), (1, 2)):
        for r in ("nearest", "stochastic"):
            for scale in (1.0, 2.0 ** -99, 2.0 ** -105, 2.0 ** -130):
                x, wrong = near_ties(q, r == "stochastic", scale)
                if scale == 1.0 and r == "nearest":
                    assert wrong > 0, q  # the data does separate the division from the reciprocal
                    total += wrong
                res = torch.zeros(x.numel())  # p = x + 0 keeps the ties
                if bits == 8:
                    both(lambda b: K.quantize_int8(x, BS, r, 4, 2, backend=b), "int8")
                    both(lambda b: (*K.quantize_int8_ef(x, e := res.clone(), BS, r, 4, 2, backend=b), e), "int8 ef")
                else:
                    both(lambda b: K.quantize_packed(x, bits, BS, r, 4, 2, backend=b), f"int{{bits}}")
                    both(lambda b: (*K.quantize_packed_ef(x, e := res.clone(), bits, BS, r, 4, 2, backend=b), e),
                         f"int{{bits}} ef")
    print(cpu.isa(), total)
""").format(here=HERE)


def _run(code: str, isa: str | None):
    env = dict(os.environ)
    env.pop("GRADCOMP_CPU_ISA", None)
    if isa is not None:
        env["GRADCOMP_CPU_ISA"] = isa
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_chosen_variant_is_one_this_cpu_runs():
    from gradcomp.kernels import cpu

    if os.environ.get("GRADCOMP_CPU_ISA"):
        pytest.skip("GRADCOMP_CPU_ISA is set for this run")
    assert cpu.isas()[0] == "baseline"
    assert cpu.isa() == cpu.isas()[-1]  # the best it runs
    info = cpu.native().build_info()
    assert info["isa"] == cpu.isa() and info["isa_supported"] == ", ".join(cpu.isas())


@pytest.mark.slow
def test_every_variant_this_cpu_runs_matches_the_reference():
    from gradcomp.kernels import cpu

    for isa in cpu.isas():
        r = _run(CHECK, isa)
        assert r.returncode == 0, f"{isa}:\n{r.stderr[-3000:]}"
        assert r.stdout.strip() == isa


@pytest.mark.slow
def test_every_variant_matches_the_reference_on_vector_tails_and_rounding_ties():
    from gradcomp.kernels import cpu

    for isa in cpu.isas():
        r = _run(EDGES, isa)
        assert r.returncode == 0, f"{isa}:\n{r.stderr[-3000:]}"
        assert r.stdout.strip() == isa


@pytest.mark.slow
def test_every_variant_matches_the_reference_where_a_reciprocal_would_round_otherwise():
    from gradcomp.kernels import cpu

    for isa in cpu.isas():
        r = _run(NEAR_TIES, isa)
        assert r.returncode == 0, f"{isa}:\n{r.stderr[-3000:]}"
        name, wrong = r.stdout.split()
        assert name == isa and int(wrong) > 0


@pytest.mark.slow
def test_a_forced_variant_that_cannot_run_raises_with_the_reason():
    from gradcomp.kernels import cpu

    code = ("import torch, gradcomp.kernels as K\n"
            "try:\n    K.quantize_int8(torch.randn(100), backend='cpu')\n"
            "except ValueError as e:\n    print(e)\n")
    r = _run(code, "sse9")
    assert r.returncode == 0, r.stderr
    assert "GRADCOMP_CPU_ISA must be one of baseline, avx2, avx512" in r.stdout and "'sse9'" in r.stdout
    missing = [v for v in ("avx2", "avx512") if v not in cpu.isas()]
    for isa in missing:  # on a CPU without them: the reason names what it lacks
        r = _run(code, isa)
        assert f"GRADCOMP_CPU_ISA={isa} cannot run here: it needs" in r.stdout, r.stdout + r.stderr
