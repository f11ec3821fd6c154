#!/usr/bin/env bash
# GPU check for a machine with one CUDA device and no package registry.
#
# Expects: Python with torch (CUDA), triton, cupy (cupy-cuda12x/13x), pybind11,
# pytest, hypothesis already installed. Run from anywhere:
#
#     bash benchmarks/gpu_check.sh            # results under $OUT, else bench-results/gpu-check
#
# Steps (each under `timeout`; all of them together stop before BUDGET_S, 290 s):
#   1. pip install --no-build-isolation --no-deps -e .   (again with GRADCOMP_NO_NATIVE=1 if the
#      native CPU build fails, so the GPU checks still run)
#   2. the Triton and CUDA kernel tests, compiled on CUDA tensors (tests/test_kernels_{triton,cuda}.py)
#   3. timing: device-to-device copy bandwidth, then quantize / dequantize / fused error feedback
#      effective bandwidth per backend as % of that copy, and topk / approx_topk vs torch.topk
#   4. the other tests marked `gpu` (pytest -m gpu)
#   5. python benchmarks/kernels.py --quick, if that file exists
# Output files: summary.txt, install.log, kernel_tests.log, timing.log, timing.json,
# gpu_tests.log, kernels_quick.log.
#
# Environment: OUT (output folder), BUDGET_S (total seconds, default 290), PYTHON (default python3),
# GPU_CHECK_SKIP_INSTALL=1 (use the package as installed), GPU_CHECK_DRY=1 (tiny CPU-sized timing
# run, for checking this script on a machine without a GPU).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/bench-results/gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-290}"
export PYTHONUNBUFFERED=1
START=$SECONDS
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

# run NAME CAP_S LOGFILE CMD...: run CMD with at most CAP_S seconds (less if the budget is short)
run() {
  local name=$1 cap=$2 log=$3
  shift 3
  local left=$((BUDGET_S - (SECONDS - START)))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    echo "$name: skipped (time budget spent)" | tee -a "$SUMMARY"
    return 0
  fi
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=$?
  local verdict=ok
  if ((rc == 5)) && [[ " $* " == *" pytest "* ]]; then verdict="ok (no tests selected)"; rc=0
  elif ((rc == 124 || rc == 137)); then verdict="TIMED OUT"; elif ((rc != 0)); then verdict="FAILED"; fi
  ((rc != 0)) && FAILED=1
  echo "$name: $verdict (rc=$rc, $((SECONDS - t0))s)" | tee -a "$SUMMARY"
  return $rc
}

{
  echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $ROOT"
  "$PY" - <<'EOF' 2>&1
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for m in ("triton", "cupy", "pybind11"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "missing:", type(e).__name__, e)
EOF
} | tee -a "$SUMMARY"

# 1. install (editable: builds gradcomp._C and copies csrc/cuda into gradcomp/_cuda_src)
if [[ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]]; then
  run install 80 "$OUT/install.log" "$PY" -m pip install --no-build-isolation --no-deps -e . ||
    run install_without_native 60 "$OUT/install.log" \
      env GRADCOMP_NO_NATIVE=1 "$PY" -m pip install --no-build-isolation --no-deps -e .
fi

# 2. kernel tests on CUDA tensors (Triton compiled, CUDA through CuPy) + nvcc/emulation checks
run kernel_tests 140 "$OUT/kernel_tests.log" \
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_kernels_triton.py tests/test_kernels_cuda.py

# 3. timing
run timing 50 "$OUT/timing.log" "$PY" - "$OUT/timing.json" <<'EOF'
import importlib, json, os, statistics, sys, time

import torch

import gradcomp.kernels as K
from gradcomp.kernels import registry

DRY = os.environ.get("GPU_CHECK_DRY") == "1"
dev = "cuda" if torch.cuda.is_available() and not DRY else "cpu"
if dev == "cpu" and not DRY:
    sys.exit("no CUDA device (set GPU_CHECK_DRY=1 for a CPU dry run)")
N = 1 << 12 if DRY else 1 << 28          # quantize sizes: 1 GiB of float32 on the GPU
NSEL = 1 << 12 if DRY else 1 << 26       # selection sizes
REPS, WARM = (2, 1) if DRY else (10, 3)
BS = 256


def timed(fn):
    """Median / min / p90 milliseconds of fn() over REPS runs after WARM warm-ups."""
    for _ in range(WARM):
        fn()
    ts = []
    for _ in range(REPS):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t = time.perf_counter(); fn(); ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return {"median_ms": statistics.median(ts), "min_ms": ts[0], "p90_ms": ts[int(0.9 * (len(ts) - 1))]}


registry.reset()
avail = registry.available_backends()
backends = [b for b in ("cuda", "triton", "reference")
            if avail[b] is None and dev in importlib.import_module(registry.BACKENDS[b]).devices()]
res = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (dry run)",
       "n": N, "n_select": NSEL, "block_size": BS, "backends": backends,
       "unavailable": {b: r for b, r in avail.items() if r is not None}, "ops": {}}
print("backends:", backends, "unavailable:", res["unavailable"])

x = torch.randn(N, device=dev)
y = torch.empty_like(x)
copy = timed(lambda: y.copy_(x))
copy_gbs = 2 * x.numel() * 4 / copy["median_ms"] / 1e6
res["copy"] = dict(copy, bytes=2 * N * 4, GBps=copy_gbs)
print(f"device-to-device copy: {copy['median_ms']:.3f} ms, {copy_gbs:.0f} GB/s (read + write)")
del y

nb = -(-N // BS)
q = torch.empty(N, dtype=torch.int8, device=dev)
s = torch.empty(nb, dtype=torch.float32, device=dev)
out = torch.empty(N, device=dev)
res_buf = torch.zeros(N, device=dev)
cases = {  # op -> (callable taking backend, minimal bytes moved)
    "quantize_int8/nearest": (lambda b: K.quantize_int8(x, BS, out_q=q, out_scales=s, backend=b), 5 * N + 4 * nb),
    "quantize_int8/stochastic": (lambda b: K.quantize_int8(x, BS, "stochastic", 1, 2, out_q=q, out_scales=s,
                                                           backend=b), 5 * N + 4 * nb),
    "quantize_int8_ef": (lambda b: K.quantize_int8_ef(x, res_buf, BS, out_q=q, out_scales=s, backend=b),
                         13 * N + 4 * nb),
    "dequantize_int8": (lambda b: K.dequantize_int8(q, s, BS, out, backend=b), 5 * N + 4 * nb),
    "dequantize_int8_add_": (lambda b: K.dequantize_int8_add_(out, q, s, BS, backend=b), 9 * N + 4 * nb),
}
for op, (fn, nbytes) in cases.items():
    for b in backends:
        try:
            t = timed(lambda: fn(b))
        except Exception as e:  # report and go on
            res["ops"].setdefault(op, {})[b] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{op:26s} {b:9s} ERROR {type(e).__name__}: {e}")
            continue
        gbs = nbytes / t["median_ms"] / 1e6
        res["ops"].setdefault(op, {})[b] = dict(t, GBps=gbs, pct_of_copy=100 * gbs / copy_gbs)
        print(f"{op:26s} {b:9s} {t['median_ms']:8.3f} ms  {gbs:7.0f} GB/s  {100 * gbs / copy_gbs:5.1f}% of copy")
del x, q, s, out, res_buf

xs = torch.randn(NSEL, device=dev)
for density in (0.001, 0.01):
    k = max(1, int(NSEL * density))
    row = {"k": k, "torch.topk": timed(lambda: torch.topk(xs.abs(), k, sorted=False))}
    for b in backends:
        for op in ("topk", "approx_topk"):
            try:
                row[f"{op}/{b}"] = timed(lambda: getattr(K, op)(xs, k, backend=b))
            except Exception as e:
                row[f"{op}/{b}"] = {"error": f"{type(e).__name__}: {e}"}
    res["ops"][f"select/density={density}"] = row
    print(f"selection n={NSEL} k={k}:")
    for name, t in row.items():
        if isinstance(t, dict):
            print(f"   {name:22s} " + (f"{t['median_ms']:8.3f} ms" if "median_ms" in t else t["error"]))

with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
print("wrote", sys.argv[1])
EOF

# 4. every other test marked gpu
run gpu_tests 50 "$OUT/gpu_tests.log" \
  "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests \
  --ignore=tests/test_kernels_triton.py --ignore=tests/test_kernels_cuda.py

# 5. the kernel benchmark, if present
if [[ -f benchmarks/kernels.py ]]; then
  run kernels_quick 40 "$OUT/kernels_quick.log" "$PY" benchmarks/kernels.py --quick
else
  echo "kernels_quick: skipped (benchmarks/kernels.py not present)" | tee -a "$SUMMARY"
fi

echo "total $((SECONDS - START))s; results in $OUT" | tee -a "$SUMMARY"
exit $FAILED
