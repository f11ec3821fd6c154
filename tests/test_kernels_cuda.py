"""The CUDA backend (csrc/cuda/*.cu + gradcomp/kernels/cuda.py) against the reference.

Three levels:
* ``test_nvcc_compiles``: every .cu, exactly as the loader hands it to NVRTC
  (``#include "common.cuh"`` pasted in), compiles with ``nvcc --ptx`` for
  sm_90. Runs wherever nvcc is on PATH, GPU or not.
* ``emu``: the kernels built for the CPU by the host C++ compiler with a small
  CUDA emulation (one OS thread per CUDA thread, a barrier for
  ``__syncthreads``, ``std::atomic_ref`` for atomics), driven by the real
  launch code of ``cuda.py`` on CPU tensors. Checks indexing, reductions,
  scans, the radix select and argument packing without a GPU.
* ``gpu``: the backend through the public API on CUDA tensors (needs a CUDA
  device and CuPy), bit-exact against the reference computed on the CPU.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import backend_checks as C

import gradcomp.kernels as K
from gradcomp.kernels import cuda as cuda_backend
from gradcomp.kernels import reference as R
from gradcomp.kernels import registry

FAMILIES = sorted(cuda_backend.SOURCES)


# ----------------------------------------------------------------- compile


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_nvcc_compiles(family, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    src = tmp_path / cuda_backend.SOURCES[family]
    src.write_text(cuda_backend.source(family))
    out = tmp_path / (family + ".ptx")
    r = subprocess.run(
        [nvcc, "-std=c++17", "--ptx", "-arch=compute_90", "--fmad=false", "--ftz=false",
         "--prec-div=true", str(src), "-o", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert r.returncode == 0, f"nvcc failed on {src.name}:\n{r.stderr}"
    ptx = out.read_text()
    assert "fma.rn.f32" not in ptx, "a float multiply-add was fused"
    assert ".ftz" not in ptx, "subnormals must not be flushed"


def test_sources_found_and_inlined():
    assert cuda_backend.source_dir() is not None
    for family in FAMILIES:
        text = cuda_backend.source(family)
        assert re.search(r"^\s*#\s*include", text, re.MULTILINE) is None
        assert 'extern "C" __global__' in text



def test_compile_error_is_a_python_exception(monkeypatch):
    class BrokenModule:
        def __init__(self, code, options):
            assert "__global__" in code and "-std=c++17" in options

        def get_function(self, name):
            raise ValueError("error: identifier undefined")  # what a failed NVRTC run raises

    fake = types.SimpleNamespace(RawModule=BrokenModule)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda_backend, "_modules", {})
    monkeypatch.setattr(cuda_backend, "_functions", {})
    with pytest.raises(RuntimeError, match="gc_quantize_f32 from quantize.cu failed"):
        cuda_backend._function("quantize", "gc_quantize_f32")


def test_unavailable_reason_is_clear():
    reason = cuda_backend.unavailable_reason()
    if reason is None:
        assert torch.cuda.is_available()
    else:
        assert any(w in reason for w in ("cupy", "CUDA device", "sources")), reason

# --------------------------------------------------------------- emulation

_EMU_HEADER = r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <math.h>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define GRADCOMP_CUDA_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(x)

struct gc_emu_dim3 { unsigned x = 0, y = 1, z = 1; };
inline thread_local gc_emu_dim3 threadIdx, blockIdx;
inline gc_emu_dim3 blockDim, gridDim;
inline std::barrier<>* gc_emu_bar = nullptr;

inline void __syncthreads() { gc_emu_bar->arrive_and_wait(); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline long long __double_as_longlong(double d) { long long u; std::memcpy(&u, &d, 8); return u; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __uint2float_rn(unsigned u) { return (float)u; }
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }
inline float __double2float_rn(double d) { return (float)d; }
template <class T, class U> inline T atomicAdd(T* p, U v) {
  return std::atomic_ref<T>(*p).fetch_add((T)v);
}
template <class T> inline T __shfl_down_sync(unsigned, T v, int off) {
  static T buf[1024];
  buf[threadIdx.x] = v;
  __syncthreads();
  const unsigned lane = threadIdx.x & 31u;
  const T r = lane + off < 32 ? buf[threadIdx.x + off] : v;
  __syncthreads();
  return r;
}
"""

_EMU_LAUNCH = r"""
// A pool of worker threads, one per CUDA thread of a block; blocks run in turn.
struct gc_emu_pool {
  std::mutex m;
  std::condition_variable wake, done;
  std::function<void(unsigned)> job;
  unsigned size = 0, active = 0, remaining = 0, generation = 0;
  void loop(unsigned id) {
    unsigned seen = 0;
    std::unique_lock<std::mutex> lock(m);
    for (;;) {
      wake.wait(lock, [&] { return generation != seen; });
      seen = generation;
      if (id >= active) continue;
      auto j = job;
      lock.unlock();
      j(id);
      lock.lock();
      if (--remaining == 0) done.notify_all();
    }
  }
  void run(unsigned n, std::function<void(unsigned)> j) {
    std::unique_lock<std::mutex> lock(m);
    while (size < n) std::thread([this, id = size] { loop(id); }).detach(), ++size;
    job = std::move(j);
    active = remaining = n;
    ++generation;
    wake.notify_all();
    done.wait(lock, [&] { return remaining == 0; });
  }
};
static gc_emu_pool* gc_emu_workers = new gc_emu_pool;  // never destroyed: workers stay parked

template <typename... A, std::size_t... I>
static void gc_emu_call(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}
template <typename... A>
static void gc_emu_launch(void (*k)(A...), unsigned grid, unsigned block, void** args) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned b = 0; b < grid; ++b) {
    std::barrier<> bar(block);
    gc_emu_bar = &bar;
    gc_emu_workers->run(block, [=](unsigned t) {
      threadIdx.x = t;
      blockIdx.x = b;
      gc_emu_call(k, args, std::index_sequence_for<A...>{});
    });
  }
}
"""


class _Emulator:
    """Launches the emulated kernels; stands in for ``cuda._launch``."""

    def __init__(self, lib):
        self.lib = lib

    def launch(self, family, kernel, grid, block, args, device):
        assert device.type == "cpu"
        for a in args:  # the real launcher relies on exact numpy scalar types
            assert isinstance(a, np.generic), f"{kernel}: argument {a!r} is not a numpy scalar"
        bufs = [ctypes.create_string_buffer(a.tobytes(), a.nbytes) for a in args]
        argv = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
        getattr(self.lib, "emu_" + kernel)(ctypes.c_uint(grid), ctypes.c_uint(block), argv)


def _build_emulator(tmp):
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler for the CUDA emulation")
    body = "".join(cuda_backend.source(f) for f in FAMILIES)
    src = _EMU_HEADER + body + _EMU_LAUNCH
    pre = subprocess.run([cxx, "-std=c++20", "-E", "-x", "c++", "-"], input=src,
                         capture_output=True, text=True)
    if pre.returncode != 0:
        pytest.skip(f"host compiler cannot preprocess the emulation: {pre.stderr[-500:]}")
    names = sorted(set(re.findall(r'extern\s+"C"\s+void\s+(gc_\w+)\s*\(', pre.stdout)))
    assert len(names) >= 20, names
    src += "".join(
        f'extern "C" void emu_{n}(unsigned g, unsigned b, void** a) {{ gc_emu_launch(&{n}, g, b, a); }}\n'
        for n in names
    )
    (tmp / "emu.cpp").write_text(src)
    lib = tmp / "libgc_emu.so"
    r = subprocess.run([cxx, "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-pthread",
                        str(tmp / "emu.cpp"), "-o", str(lib)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        if "barrier" in r.stderr or "atomic_ref" in r.stderr or "_Float16" in r.stderr:
            pytest.skip("host compiler lacks C++20 <barrier>/atomic_ref or _Float16")
        raise AssertionError("emulation build failed:\n" + r.stderr[-4000:])
    return _Emulator(ctypes.CDLL(str(lib)))


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return _build_emulator(tmp_path_factory.mktemp("cuda_emu"))


def _gpu_ready():
    if not torch.cuda.is_available():
        return "no CUDA device"
    registry.reset()
    return registry.available_backends()["cuda"]


# the emulator compiles the CUDA sources with the host C++ compiler and runs threads: slow tier
TARGETS = [pytest.param("emu", marks=pytest.mark.slow), pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=TARGETS)
def target(request, monkeypatch):
    """``(device, call)``: call(op, *args) runs the CUDA backend's op."""
    if request.param == "gpu":
        reason = _gpu_ready()
        if reason is not None:
            pytest.skip(f"CUDA backend unavailable: {reason}")
        return "cuda", lambda op, *a: getattr(K, op)(*a, backend="cuda")
    emu = request.getfixturevalue("emulator")
    monkeypatch.setattr(cuda_backend, "_launch", emu.launch)
    # few CTAs: emulated threads are costly, and grid-stride loops then iterate
    monkeypatch.setattr(cuda_backend, "_MAX_GRID", 2)
    # the emulated backend runs on CPU tensors: forced, the public functions call its kernels
    monkeypatch.setattr(cuda_backend, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cuda_backend, "devices", lambda: frozenset({"cpu"}))
    registry.reset()
    request.addfinalizer(registry.reset)
    return "cpu", lambda op, *a: getattr(K, op)(*a, backend="cuda")


# ------------------------------------------------------------------ inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]



# ------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,rounding", [(32, "nearest"), (256, "stochastic"), (1024, "nearest")])
def test_quantize(target, dtype, block_size, rounding):
    device, call = target
    x = C.data(1531, dtype, seed=block_size)
    q, s = call("quantize_int8", x.to(device), block_size, rounding, 11, 2**33 + 5)
    rq, rs = R.quantize_int8(x, block_size, rounding, 11, 2**33 + 5)
    C.assert_bitwise(q, rq, "codes")
    assert torch.equal(C.bits(s), C.bits(rs)), "scales"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_ef(target, dtype, rounding):
    device, call = target
    x = C.data(1000, dtype, seed=3)
    res = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 0.1
    res_dev = res.clone().to(device)
    q, s = call("quantize_int8_ef", x.to(device), res_dev, 64, rounding, 1, 2)
    rq, rs = R.quantize_int8_ef(x, res, 64, rounding, 1, 2)
    C.assert_bitwise(q, rq, "codes")
    assert torch.equal(C.bits(s), C.bits(rs)), "scales"
    C.assert_bitwise(res_dev, res, "residual")


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_dequantize(target, out_dtype):
    device, call = target
    rq, rs = R.quantize_int8(C.data(777, torch.float32, seed=5), 128)
    out = torch.empty(777, dtype=out_dtype, device=device)
    got = call("dequantize_int8", rq.to(device), rs.to(device), 128, out)
    ref = torch.empty(777, dtype=out_dtype)
    R.dequantize_int8(rq, rs, 128, ref)
    C.assert_bitwise(got, ref, "dequantized")
    got = call("dequantize_int8", rq.to(device), rs.to(device), 128)
    C.assert_bitwise(got, R.dequantize_int8(rq, rs, 128), "dequantized float32")
    acc = torch.randn(777)
    acc_dev = acc.clone().to(device)
    call("dequantize_int8_add_", acc_dev, rq.to(device), rs.to(device), 128)
    C.assert_bitwise(acc_dev, R.dequantize_int8_add_(acc, rq, rs, 128), "accumulated")



@pytest.mark.parametrize("dtype", DTYPES)
def test_topk(target, dtype):
    device, call = target
    x = C.data(2500, dtype, seed=7)
    x[100:160] = 0.75  # a long run of ties across the k-th element
    xd = x.to(device)
    a = x.float().abs()
    k_tie = int(((a > 0.75) | a.isnan()).sum()) + 30  # keeps half of the tied run
    for k in (0, 1, 2, 37, k_tie, 2499, 2500):
        C.assert_selection(call("topk", xd, k), R.topk(x, k), f"topk k={k}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold(target, dtype):
    device, call = target
    x = C.data(2100, dtype, seed=8)
    xd = x.to(device)
    for tau in (0.0, 1.25, 2.0, 1e-40, 1e30):
        C.assert_selection(call("threshold", xd, tau), R.threshold(x, tau), f"threshold tau={tau}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_approx_topk(target, dtype):
    device, call = target
    for n, k, special in ((6000, 60, True), (5000, 1, False), (3000, 2900, True)):
        x = C.data(n, dtype, seed=n, special=special)
        C.assert_selection(call("approx_topk", x.to(device), k), R.approx_topk(x, k), f"approx n={n} k={k}")


def test_approx_topk_nan_heavy(target):
    device, call = target
    x = C.data(5000, torch.float32, seed=9)
    x[::7] = float("nan")  # NaN counts as Inf for the threshold: many survivors
    x[1::11] = float("inf")
    for k in (50, 700, 1500):
        C.assert_selection(call("approx_topk", x.to(device), k), R.approx_topk(x, k), f"approx k={k}")



def test_approx_topk_correction_paths(target):
    device, call = target
    # too few survivors -> exact top-k; too many (estimate or ties) -> top-k of the survivors
    cases = [(C.skewed(20000, True), 2000), (C.skewed(20000, False), 2000),
             ((torch.randn(3000, generator=torch.Generator().manual_seed(16)) * 2).round() / 2, 300)]
    for x, k in cases:
        C.assert_selection(call("approx_topk", x.to(device), k), R.approx_topk(x, k), f"k={k}")


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("val_dtype", DTYPES)
def test_scatter_add(target, idx_dtype, val_dtype):
    device, call = target
    g = torch.Generator().manual_seed(10)
    idx = torch.randint(0, 300, (900,), generator=g).to(idx_dtype)  # duplicates
    vals = torch.randint(-8, 8, (900,), generator=g).to(val_dtype)  # exact sums in any order
    acc = torch.randn(300, generator=g).round()
    acc_dev = acc.clone().to(device)
    call("scatter_add_", acc_dev, idx.to(device), vals.to(device))
    C.assert_bitwise(acc_dev, R.scatter_add_(acc, idx, vals), "scatter_add_")


def test_empty_inputs(target):
    device, call = target
    x = torch.empty(0, device=device)
    q, s = call("quantize_int8", x, 64, "nearest", 0, 0)
    assert q.numel() == 0 and s.numel() == 0
    i, v = call("threshold", x, 1.0)
    assert i.numel() == 0 and i.dtype == torch.int32


@pytest.mark.gpu
def test_gpu_large_and_streams():
    reason = _gpu_ready()
    if reason is not None:
        pytest.skip(f"CUDA backend unavailable: {reason}")
    x = C.data((1 << 22) + 3, torch.float32, seed=12)
    xd = x.cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # kernels follow the current torch stream
        q, sc = K.quantize_int8(xd, 256, "stochastic", 3, 4, backend="cuda")
        i, v = K.topk(xd, 5000, backend="cuda")
    s.synchronize()
    rq, rs = R.quantize_int8(x, 256, "stochastic", 3, 4)
    assert torch.equal(q.cpu(), rq) and torch.equal(C.bits(sc), C.bits(rs))
    C.assert_selection((i, v), R.topk(x, 5000), "topk 4M")
    for k in (4000, 40000):
        C.assert_selection(K.approx_topk(xd, k, backend="cuda"), R.approx_topk(x, k), f"approx k={k}")


# ------------------------------------------------ sub-byte and fp8 block codecs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("block_size", [32, 512])
def test_lowbit_quantize(target, dtype, block_size):
    device, call = target
    x = C.data(1200, dtype, seed=block_size)
    xd = x.to(device)
    for op, args in (("quantize_packed", (4, block_size, "nearest")),
                     ("quantize_packed", (2, block_size, "stochastic", 11, 2**33 + 5)),
                     ("quantize_sign", (block_size,)), ("quantize_fp8", ("e4m3", block_size)),
                     ("quantize_fp8", ("e5m2", block_size))):
        got = call(op, xd, *args)
        want = getattr(K, op)(x, *args, backend="reference")
        C.assert_bitwise(got[0], want[0], f"{op}{args} codes")
        C.assert_bitwise(got[1], want[1], f"{op}{args} scales")


def test_lowbit_error_feedback_and_decoding(target):
    device, call = target
    n = 900
    x = C.data(n, torch.float32, seed=3)
    r = torch.randn(n, generator=torch.Generator().manual_seed(4)) * 0.1
    for ef, dec, add, args, dargs in (
        ("quantize_packed_ef", "dequantize_packed", "dequantize_packed_add_", (4, 64, "stochastic", 1, 2), (4, 64)),
        ("quantize_sign_ef", "dequantize_sign", "dequantize_sign_add_", (64,), (64,)),
        ("quantize_fp8_ef", "dequantize_fp8", "dequantize_fp8_add_", ("e4m3", 64), ("e4m3", 64)),
    ):
        r_dev, r_ref = r.clone().to(device), r.clone()
        got = call(ef, x.to(device), r_dev, *args)
        want = getattr(K, ef)(x, r_ref, *args, backend="reference")
        C.assert_bitwise(got[0], want[0], f"{ef} codes")
        C.assert_bitwise(r_dev, r_ref, f"{ef} residual")
        size = (n,) if dec != "dequantize_fp8" else ()
        C.assert_bitwise(call(dec, *got, *size, *dargs), getattr(K, dec)(*want, *size, *dargs, backend="reference"),
                         f"{dec}")
        acc = torch.randn(n)
        acc_dev = acc.clone().to(device)
        call(add, acc_dev, *got, *dargs)
        C.assert_bitwise(acc_dev, getattr(K, add)(acc, *want, *dargs, backend="reference"), f"{add}")
