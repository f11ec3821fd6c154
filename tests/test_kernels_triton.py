"""The Triton backend (gradcomp/kernels/triton/) against the reference, bit for bit.

Without a GPU the kernels run in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set by conftest.py or when this module is imported, before Triton is;
restored when its tests are done). With a CUDA device (and ``TRITON_INTERPRET`` not set to 1)
the same tests run compiled on CUDA tensors, plus larger sizes; those are
marked ``gpu``. The reference is always evaluated on the CPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import backend_checks as C

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

import gradcomp.kernels as K
from gradcomp.kernels import reference as R
from gradcomp.kernels import ops, registry

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if ON_GPU else "cpu"
_OLD_INTERPRET = os.environ.get("TRITON_INTERPRET")
if ON_GPU:
    pytestmark = pytest.mark.gpu
elif "triton" in sys.modules and _OLD_INTERPRET != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set; run this file in its own "
                "process or with TRITON_INTERPRET=1", allow_module_level=True)
else:
    # Triton reads TRITON_INTERPRET when it is imported and when kernels are defined
    os.environ["TRITON_INTERPRET"] = "1"
    pytestmark = pytest.mark.slow  # the CPU interpreter takes seconds per kernel


@pytest.fixture(scope="module", autouse=True)
def _triton_mode():
    """Probe the registry afresh (it caches reasons); restore the environment after."""
    registry.reset()
    reason = registry.available_backends()["triton"]
    if reason is not None:
        pytest.skip(f"triton backend unavailable: {reason}")
    yield
    if _OLD_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _OLD_INTERPRET
    registry.reset()


def _backend():
    from gradcomp.kernels import triton as backend

    return backend


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]



# ------------------------------------------------------------ quantization


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,rounding", [(32, "nearest"), (256, "stochastic"), (1024, "nearest")])
def test_quantize(dtype, block_size, rounding):
    x = C.data(2531, dtype, seed=block_size)
    q, s = K.quantize_int8(x.to(DEVICE), block_size, rounding, 11, 2**33 + 5, backend="triton")
    rq, rs = R.quantize_int8(x, block_size, rounding, 11, 2**33 + 5)
    C.assert_bitwise(q, rq, "codes")
    assert torch.equal(C.bits(s), C.bits(rs)), "scales"


@pytest.mark.parametrize("n", [1, 31, 33, 257])
def test_quantize_odd_sizes_and_large_key(n):
    # seed/counter chosen so the 32-bit stream key is >= 2**31 (unsigned arithmetic)
    seed, counter = 2**40 + 1, 7
    assert R.stream_key(seed, counter) >= 2**31
    x = C.data(n, torch.float32, seed=n, special=False)
    q, s = K.quantize_int8(x.to(DEVICE), 64, "stochastic", seed, counter, backend="triton")
    rq, rs = R.quantize_int8(x, 64, "stochastic", seed, counter)
    C.assert_bitwise(q, rq, "codes")
    assert torch.equal(C.bits(s), C.bits(rs)), "scales"


def test_quantize_special_blocks():
    x = torch.zeros(200)
    x[64:128] = float("nan")
    x[128:192] = torch.linspace(-1, 1, 64) * 1e-39  # subnormal absmax
    x[192:] = 0.5  # |y| == 127 exactly
    x[5] = -0.0
    for rounding in ("nearest", "stochastic"):
        q, s = K.quantize_int8(x.to(DEVICE), 64, rounding, backend="triton")
        rq, rs = R.quantize_int8(x, 64, rounding)
        C.assert_bitwise(q, rq, "codes")
        assert torch.equal(C.bits(s), C.bits(rs)), "scales"
    assert C.bits(s)[1].item() == 0x7FC00000


def test_quantize_noncontiguous_and_out():
    x = C.data(2 * 700, torch.float32, seed=2).view(700, 2).t()  # non-contiguous 2 x 700
    out_q = torch.empty(1400, dtype=torch.int8, device=DEVICE)
    out_s = torch.empty(22, dtype=torch.float32, device=DEVICE)
    q, s = K.quantize_int8(x.to(DEVICE), 64, out_q=out_q, out_scales=out_s, backend="triton")
    assert q.data_ptr() == out_q.data_ptr() and s.data_ptr() == out_s.data_ptr()
    rq, rs = R.quantize_int8(x.contiguous(), 64)
    C.assert_bitwise(q, rq, "codes")
    assert torch.equal(C.bits(s), C.bits(rs)), "scales"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_ef(dtype, rounding):
    x = C.data(1500, dtype, seed=3)
    res = torch.randn(1500, generator=torch.Generator().manual_seed(4)) * 0.1
    res_dev = res.clone().to(DEVICE)
    q, s = K.quantize_int8_ef(x.to(DEVICE), res_dev, 128, rounding, 1, 2, backend="triton")
    rq, rs = R.quantize_int8_ef(x, res, 128, rounding, 1, 2)
    C.assert_bitwise(q, rq, "codes")
    assert torch.equal(C.bits(s), C.bits(rs)), "scales"
    C.assert_bitwise(res_dev, res, "residual")


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize(out_dtype):
    rq, rs = R.quantize_int8(C.data(1777, torch.float32, seed=5), 128)
    out = torch.empty(1777, dtype=out_dtype, device=DEVICE)
    got = K.dequantize_int8(rq.to(DEVICE), rs.to(DEVICE), 128, out, backend="triton")
    assert got.data_ptr() == out.data_ptr()
    ref = torch.empty(1777, dtype=out_dtype)
    R.dequantize_int8(rq, rs, 128, ref)
    C.assert_bitwise(got, ref, "dequantized")


def test_dequantize_add():
    rq, rs = R.quantize_int8(C.data(1777, torch.float32, seed=6), 32)
    C.assert_bitwise(K.dequantize_int8(rq.to(DEVICE), rs.to(DEVICE), 32, backend="triton"),
                    R.dequantize_int8(rq, rs, 32), "dequantized float32")
    acc = torch.randn(1777)
    acc_dev = acc.clone().to(DEVICE)
    K.dequantize_int8_add_(acc_dev, rq.to(DEVICE), rs.to(DEVICE), 32, backend="triton")
    C.assert_bitwise(acc_dev, R.dequantize_int8_add_(acc, rq, rs, 32), "accumulated")


# --------------------------------------------------------------- selection


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk(dtype):
    x = C.data(2500, dtype, seed=7)
    x[100:160] = 0.75  # a run of ties across the k-th element
    xd = x.to(DEVICE)
    a = x.float().abs()
    k_tie = int(((a > 0.75) | a.isnan()).sum()) + 30  # keeps half of the tied run
    for k in (0, 1, 37, k_tie, 2499, 2500):
        C.assert_selection(K.topk(xd, k, backend="triton"), R.topk(x, k), f"topk k={k}")


def test_topk_nan_and_noncontiguous():
    x = C.data(1200, torch.float32, seed=8).view(40, 30).t()  # non-contiguous
    x[3, 4] = float("nan")
    x[5, 6] = -float("nan")
    xd = x.to(DEVICE)
    for k in (1, 2, 3, 61):
        C.assert_selection(K.topk(xd, k, backend="triton"), R.topk(x.contiguous(), k), f"topk k={k}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold(dtype):
    x = C.data(2100, dtype, seed=9)
    xd = x.to(DEVICE)
    for tau in (0.0, 1.25, 1e-40, 1e30):
        C.assert_selection(K.threshold(xd, tau, backend="triton"), R.threshold(x, tau), f"threshold tau={tau}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_approx_topk(dtype):
    for n, k, special in ((6000, 60, True), (3000, 2900, True), (2000, 1, False)):
        x = C.data(n, dtype, seed=n, special=special)
        got = K.approx_topk(x.to(DEVICE), k, backend="triton")
        C.assert_selection(got, R.approx_topk(x, k), f"approx n={n} k={k}")
        c = got[0].numel()
        assert -(-9 * k // 10) <= c <= 11 * k // 10 or c == k


def test_approx_topk_strided_sample():
    # n > 4096 and k > 400 n / 4096: the threshold comes from every 4th element
    x = C.data(20000, torch.float32, seed=11)
    for k in (2000,):
        assert R.approx_topk_sample_size(20000, k) < 20000
        C.assert_selection(K.approx_topk(x.to(DEVICE), k, backend="triton"), R.approx_topk(x, k), f"k={k}")


def test_approx_topk_nan_heavy():
    x = C.data(5000, torch.float32, seed=12)
    x[::7] = float("nan")  # NaN counts as Inf for the threshold
    x[1::11] = float("inf")
    for k in (50, 1500):
        C.assert_selection(K.approx_topk(x.to(DEVICE), k, backend="triton"), R.approx_topk(x, k), f"k={k}")



def test_approx_topk_correction_paths():
    # too few survivors -> exact top-k; too many (estimate or ties) -> top-k of the survivors
    cases = [(C.skewed(20000, True), 2000), (C.skewed(20000, False), 2000),
             ((torch.randn(3000, generator=torch.Generator().manual_seed(16)) * 2).round() / 2, 300)]
    for x, k in cases:
        C.assert_selection(K.approx_topk(x.to(DEVICE), k, backend="triton"), R.approx_topk(x, k), f"k={k}")


# ----------------------------------------------------------------- scatter


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("val_dtype", DTYPES)
def test_scatter_add(idx_dtype, val_dtype):
    g = torch.Generator().manual_seed(13)
    idx = torch.randint(0, 300, (900,), generator=g).to(idx_dtype)  # duplicates
    vals = torch.randint(-8, 8, (900,), generator=g).to(val_dtype)  # sums exact in any order
    acc = torch.randn(300, generator=g).round()
    acc_dev = acc.clone().to(DEVICE)
    K.scatter_add_(acc_dev, idx.to(DEVICE), vals.to(DEVICE), backend="triton")
    C.assert_bitwise(acc_dev, R.scatter_add_(acc, idx, vals), "scatter_add_")


def test_scatter_add_never_writes_out_of_bounds(monkeypatch):
    from gradcomp.kernels.triton import scatter

    buf = torch.zeros(40, device=DEVICE)
    acc = buf[10:30]
    idx = torch.tensor([-5, 0, 19, 20, 1000], device=DEVICE)
    with pytest.raises(ValueError, match=r"must be in \[0, 20\)"):  # the kernel's host launcher checks
        scatter.scatter_add_(acc, idx, torch.ones(5, device=DEVICE))
    assert buf.eq(0).all()
    # and the device kernel itself masks indices outside [0, n)
    monkeypatch.setattr(scatter.reference, "check_indices", lambda indices, n: None)
    scatter.scatter_add_(acc, idx, torch.ones(5, device=DEVICE))
    assert buf[:10].eq(0).all() and buf[30:].eq(0).all()
    assert acc[0].item() == 1 and acc[19].item() == 1 and acc.sum().item() == 2


def test_empty_inputs():
    x = torch.empty(0, device=DEVICE)
    q, s = K.quantize_int8(x, 64, backend="triton")
    assert q.numel() == 0 and s.numel() == 0
    i, v = K.threshold(x, 1.0, backend="triton")
    assert i.numel() == 0 and i.dtype == torch.int32
    i, v = K.topk(x, 0, backend="triton")
    assert i.numel() == 0


# ------------------------------------------------------------------ registry


def test_backend_module_contract():
    b = _backend()
    assert "cuda" in b.devices()
    assert ("cpu" in b.devices()) == (os.environ.get("TRITON_INTERPRET") == "1")
    declared = ops.kernels("triton")
    assert set(declared) == set(registry.OPS)  # every op but the fused ones, declared in the op files
    assert {fn.__module__ for fn in declared.values()} == set(b.KERNEL_MODULES)
    # a fused op the backend leaves out is the composition of its kernels, with the same results
    x = C.data(700, torch.float32, seed=21)
    acc, acc_ref = x.clone().to(DEVICE), x.clone()
    rq, rs = R.quantize_int8(x.flip(0), 64)
    got = K.reduce_quantize_int8(acc, rq.to(DEVICE), rs.to(DEVICE), 64, 2, decode=True, backend="triton")
    want = K.reduce_quantize_int8(acc_ref, rq, rs, 64, 2, decode=True, backend="reference")
    C.assert_bitwise(got[0], want[0], "codes")
    C.assert_bitwise(got[1], want[1], "scales")
    C.assert_bitwise(acc, acc_ref, "decoded")


@pytest.mark.skipif(ON_GPU, reason="checks the reason given when no GPU is present")
def test_unavailable_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = _backend().unavailable_reason()
    assert reason is not None and "TRITON_INTERPRET" in reason


_AOT_SCRIPT = textwrap.dedent(r"""
    import re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gradcomp.kernels.triton import quantize as Q, scatter as SC, select as S

    C = "constexpr"
    SEL = {"KIND": C, "NAN_AS_INF": C, "TILE": C}
    cases = [
        ("quantize", Q._quantize_kernel,
         {"x_ptr": "*fp32", "r_ptr": "*fp32", "q_ptr": "*i8", "s_ptr": "*fp32", "n": "i64", "nblocks": "i64",
          "key": "i32", "BLOCK_SIZE": C, "ROWS": C, "CHUNK": C, "KIND": C, "EF": C, "STOCHASTIC": C},
         [{"BLOCK_SIZE": 256, "ROWS": 16, "CHUNK": 256, "KIND": 0, "EF": True, "STOCHASTIC": True},
          {"BLOCK_SIZE": 65536, "ROWS": 1, "CHUNK": 4096, "KIND": 2, "EF": False, "STOCHASTIC": False}]),
        ("dequantize", Q._dequantize_kernel,
         {"q_ptr": "*i8", "s_ptr": "*fp32", "out_ptr": "*i16", "n": "i64", "BLOCK_SIZE": C, "TILE": C,
          "ADD": C, "OUT_BF16": C},
         [{"BLOCK_SIZE": 256, "TILE": 4096, "ADD": False, "OUT_BF16": True}]),
        ("radix_hist", S._radix_hist_kernel,
         {"x_ptr": "*fp64", "count": "i64", "stride": "i64", "state_ptr": "*i64", "hist_ptr": "*i64",
          "shift": "i32", "hi_mask": "i64", "ntiles": "i32", "nprog": "i32", **SEL},
         [{"KIND": 3, "NAN_AS_INF": True, "TILE": 2048}]),
        ("radix_pick", S._radix_pick_kernel, {"hist_ptr": "*i64", "state_ptr": "*i64", "shift": "i32"}, [{}]),
        ("count", S._count_kernel,
         {"x_ptr": "*fp16", "n": "i64", "state_ptr": "*i64", "gt_ptr": "*i64", "eq_ptr": "*i64", **SEL},
         [{"KIND": 1, "NAN_AS_INF": False, "TILE": 2048}]),
        ("compact", S._compact_kernel,
         {"x_ptr": "*i16", "n": "i64", "state_ptr": "*i64", "gt_base_ptr": "*i64", "eq_base_ptr": "*i64",
          "idx_ptr": "*i32", "val_ptr": "*i16", **SEL},
         [{"KIND": 2, "NAN_AS_INF": False, "TILE": 2048}]),
        ("scatter", SC._scatter_add_kernel,
         {"acc_ptr": "*fp32", "n": "i64", "idx_ptr": "*i64", "val_ptr": "*fp64", "m": "i64", "KIND": C, "TILE": C},
         [{"KIND": 3, "TILE": 1024}]),
    ]
    try:
        srcs = [(name, ASTSource(fn, sig, consts)) for name, fn, sig, cs in cases for consts in cs]
    except Exception as e:  # another Triton's ahead-of-time API
        print("SKIP", type(e).__name__, e)
        sys.exit(0)
    for name, src in srcs:
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"enable_fp_fusion": False, "num_warps": 8}).asm["ptx"]
        assert not re.search(r"\bfma\.", ptx), name + ": fused multiply-add"
        assert ".ftz" not in ptx, name + ": flush-to-zero"
        assert not re.search(r"\bdiv\.(full|approx)", ptx), name + ": approximate division"
        if name == "quantize":
            assert "div.rn.f32" in ptx and "0f4B400000" in ptx and "0fCB400000" in ptx, name
        print("compiled", name)
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """Every kernel family lowers through Triton's NVIDIA backend to sm_90 PTX
    (no GPU needed) without FMA, flush-to-zero or approximate division; the
    interpreter alone does not catch lowering errors."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    if r.stdout.startswith("SKIP"):
        pytest.skip(r.stdout.strip())
    assert r.stdout.count("compiled") == 8, r.stdout

# --------------------------------------------------------- GPU-only sizes


@pytest.mark.skipif(not ON_GPU, reason="large sizes run on a GPU only")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_large(dtype):
    n = (1 << 22) + 3
    x = C.data(n, dtype, seed=14)
    xd = x.cuda()
    for bs, rnd in ((256, "stochastic"), (65536, "nearest")):
        q, s = K.quantize_int8(xd, bs, rnd, 5, 6, backend="triton")
        rq, rs = R.quantize_int8(x, bs, rnd, 5, 6)
        C.assert_bitwise(q, rq, f"codes bs={bs}")
        assert torch.equal(C.bits(s), C.bits(rs)), f"scales bs={bs}"
    C.assert_selection(K.topk(xd, 5000, backend="triton"), R.topk(x, 5000), "topk")
    C.assert_selection(K.approx_topk(xd, 40000, backend="triton"), R.approx_topk(x, 40000), "approx")
    C.assert_selection(K.threshold(xd, 3.0, backend="triton"), R.threshold(x, 3.0), "threshold")


# ------------------------------------------------ sub-byte and fp8 block codecs


def _lowbit_cases(x, block_size, n):
    """``(name, call(backend))`` of every quantizing op of the sub-byte and fp8 codecs."""
    return [
        ("int4", lambda b: K.quantize_packed(x, 4, block_size, "nearest", backend=b)),
        ("int2 stochastic", lambda b: K.quantize_packed(x, 2, block_size, "stochastic", 11, 2**33 + 5, backend=b)),
        ("sign", lambda b: K.quantize_sign(x, block_size, backend=b)),
        ("fp8 e4m3", lambda b: K.quantize_fp8(x, "e4m3", block_size, backend=b)),
        ("fp8 e5m2", lambda b: K.quantize_fp8(x, "e5m2", block_size, backend=b)),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block_size", [(1531, 32), (2100, 1024)])
def test_lowbit_quantize(dtype, n, block_size):
    x = C.data(n, dtype, seed=n)
    xd = x.to(DEVICE)
    for (name, call), (_, ref) in zip(_lowbit_cases(xd, block_size, n), _lowbit_cases(x, block_size, n)):
        got = call("triton")
        want = ref("reference")
        C.assert_bitwise(got[0], want[0], f"{name} codes")
        C.assert_bitwise(got[1], want[1], f"{name} scales")


@pytest.mark.parametrize("bits,rounding", [(4, "stochastic"), (2, "nearest")])
def test_lowbit_error_feedback_and_decoding(bits, rounding):
    n = 1000
    x = C.data(n, torch.float32, seed=3).to(DEVICE)
    r = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 0.1
    for ef, dec, add, args in (
        (K.quantize_packed_ef, lambda c, s, **k: K.dequantize_packed(c, s, n, bits, 64, **k),
         lambda a, c, s, **k: K.dequantize_packed_add_(a, c, s, bits, 64, **k), (bits, 64, rounding, 1, 2)),
        (K.quantize_sign_ef, lambda c, s, **k: K.dequantize_sign(c, s, n, 64, **k),
         lambda a, c, s, **k: K.dequantize_sign_add_(a, c, s, 64, **k), (64,)),
        (K.quantize_fp8_ef, lambda c, s, **k: K.dequantize_fp8(c, s, "e5m2", 64, **k),
         lambda a, c, s, **k: K.dequantize_fp8_add_(a, c, s, "e5m2", 64, **k), ("e5m2", 64)),
    ):
        r_dev, r_ref = r.clone().to(DEVICE), r.clone()
        got = ef(x, r_dev, *args, backend="triton")
        want = ef(x.cpu(), r_ref, *args, backend="reference")
        C.assert_bitwise(got[0], want[0], "codes")
        C.assert_bitwise(r_dev, r_ref, "residual")
        C.assert_bitwise(dec(*got, backend="triton"), dec(*want, backend="reference"), "decoded")
        acc = torch.randn(n)
        acc_dev = acc.clone().to(DEVICE)
        add(acc_dev, *got, backend="triton")
        C.assert_bitwise(acc_dev, add(acc, *want, backend="reference"), "accumulated")


def test_lowbit_reduce_quantize_composes_the_triton_ops():
    x = C.data(700, torch.float32, seed=5)
    codes, scales = K.quantize_packed(x, 4, 32)
    acc = torch.randn(700)
    acc_dev = acc.clone().to(DEVICE)
    got = K.reduce_quantize_packed(acc_dev, codes.to(DEVICE), scales.to(DEVICE), 4, 32, 3, "stochastic", 1, 2,
                                   decode=True, backend="triton")
    want = K.reduce_quantize_packed(acc, codes, scales, 4, 32, 3, "stochastic", 1, 2, decode=True,
                                    backend="reference")
    C.assert_bitwise(got[0], want[0], "codes")
    C.assert_bitwise(acc_dev, acc, "acc")
