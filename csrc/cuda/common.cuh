// Shared device helpers for the gradcomp CUDA kernels.
//
// Compiled by NVRTC (through CuPy) at first use, so this file includes no
// headers: fixed-width types are spelled out, fp16/bf16 values are handled as
// 16-bit patterns, and conversions use PTX `cvt` or exact bit operations.
// The Python loader (gradcomp/kernels/cuda.py) pastes this file in place of
// `#include "common.cuh"`; nvcc finds it with `-I csrc/cuda`.
// GRADCOMP_CUDA_HOST_EMULATION is defined only by the test that runs these
// kernels on CPU threads (tests/test_kernels_cuda.py); it swaps the two PTX
// conversions for the host compiler's _Float16.
#ifndef GRADCOMP_COMMON_CUH
#define GRADCOMP_COMMON_CUH

typedef unsigned short gc_u16;
typedef unsigned int gc_u32;
typedef long long gc_i64;
typedef unsigned long long gc_u64;

// 16-bit floating storage types (bit patterns): distinct types so that
// overloads pick the right conversion.
struct gc_half {
  gc_u16 bits;
};
struct gc_bf16 {
  gc_u16 bits;
};

template <typename T>
__device__ __forceinline__ T gc_min(T a, T b) {
  return a < b ? a : b;
}

// ---- widening to float32 (exact) ------------------------------------------
__device__ __forceinline__ float gc_to_float(float v) { return v; }
__device__ __forceinline__ float gc_to_float(double v) { return __double2float_rn(v); }
__device__ __forceinline__ float gc_to_float(gc_half v) {
#ifdef GRADCOMP_CUDA_HOST_EMULATION
  return (float)__builtin_bit_cast(_Float16, v.bits);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
#endif
}
__device__ __forceinline__ float gc_to_float(gc_bf16 v) {
  return __uint_as_float(((gc_u32)v.bits) << 16);
}

// ---- narrowing from float32 (round to nearest even) ------------------------
__device__ __forceinline__ void gc_store(float* p, float v) { *p = v; }
__device__ __forceinline__ void gc_store(double* p, float v) { *p = (double)v; }
__device__ __forceinline__ void gc_store(gc_half* p, float v) {
#ifdef GRADCOMP_CUDA_HOST_EMULATION
  p->bits = __builtin_bit_cast(gc_u16, (_Float16)v);
#else
  gc_u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  p->bits = h;
#endif
}
__device__ __forceinline__ void gc_store(gc_bf16* p, float v) {
  gc_u32 u = __float_as_uint(v);
  gc_u16 r;
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    r = (gc_u16)0x7FC0u;  // NaN
  } else {
    r = (gc_u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  p->bits = r;
}

// ---- order-preserving keys of |x| (selection) ------------------------------
// The bit pattern of |x| with the sign cleared sorts like |x|; every NaN gets
// one key above +Inf, or the +Inf key when nan_as_inf (the DGC threshold).
__device__ __forceinline__ gc_u32 gc_key32(float f, int nan_as_inf) {
  gc_u32 b = __float_as_uint(f) & 0x7FFFFFFFu;
  if (b > 0x7F800000u) b = nan_as_inf ? 0x7F800000u : 0x7FFFFFFFu;
  return b;
}
__device__ __forceinline__ gc_u32 gc_key(float v, int nan_as_inf) { return gc_key32(v, nan_as_inf); }
__device__ __forceinline__ gc_u32 gc_key(gc_half v, int nan_as_inf) {
  return gc_key32(gc_to_float(v), nan_as_inf);
}
__device__ __forceinline__ gc_u32 gc_key(gc_bf16 v, int nan_as_inf) {
  return gc_key32(gc_to_float(v), nan_as_inf);
}
__device__ __forceinline__ gc_u64 gc_key(double v, int nan_as_inf) {
  gc_u64 b = (gc_u64)__double_as_longlong(v) & 0x7FFFFFFFFFFFFFFFull;
  if (b > 0x7FF0000000000000ull) b = nan_as_inf ? 0x7FF0000000000000ull : 0x7FFFFFFFFFFFFFFFull;
  return b;
}

// ---- counter-based randomness (reference.py: mix32 = lowbias32) -----------
__device__ __forceinline__ gc_u32 gc_mix32(gc_u32 x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

#endif  // GRADCOMP_COMMON_CUH
