// Blockwise absmax int8 quantization, dequantization and fused error feedback.
//
// Numerics are those of gradcomp/kernels/reference.py, bit for bit
// (symmetric absmax blocks as in Dettmers et al. 2022; stochastic rounding
// unbiased as in QSGD, Alistarh et al. 2017):
//   m = max |p| per block; a block holding NaN/Inf -> scale NaN (0x7FC00000),
//   codes 0; m == 0 -> scale 0, codes 0;
//   y = (p / m) * 127 with __fdiv_rn / __fmul_rn (never fused into an FMA);
//   nearest: rintf(y) (half to even); stochastic: floorf(y + u) with
//   u = (mix32((i mod 2^32) ^ key) >> 8) * 2^-24 (lowbias32 hash);
//   codes clamped to [-127, 127]; scale = m / 127.
//
// Launch: THREADS threads per CTA. A quantization block is handled by a group
// of G = min(block_size, THREADS) threads (block_size is a power of two),
// THREADS / G blocks per CTA, grid = ceil(nblocks / (THREADS / G)).
#include "common.cuh"

#define GC_Q_THREADS 256

template <typename T, bool EF>
__device__ __forceinline__ float gc_quant_input(const T* x, const float* residual, gc_i64 i) {
  float p = gc_to_float(x[i]);
  if (EF) p = __fadd_rn(p, residual[i]);
  return p;
}

template <typename T, bool EF>
__device__ void gc_quantize(const T* __restrict__ x, float* __restrict__ residual,
                            signed char* __restrict__ q, float* __restrict__ scales, gc_i64 n,
                            int block_size, int stochastic, gc_u32 key) {
  __shared__ float s_max[GC_Q_THREADS];
  __shared__ int s_bad[GC_Q_THREADS];
  const int tid = threadIdx.x;
  const int group = block_size < GC_Q_THREADS ? block_size : GC_Q_THREADS;
  const int lane = tid & (group - 1);
  const int first = tid - lane;  // first thread of this group
  const gc_i64 nblocks = (n + block_size - 1) / block_size;
  const gc_i64 blk = (gc_i64)blockIdx.x * (GC_Q_THREADS / group) + tid / group;
  const bool active = blk < nblocks;
  const gc_i64 start = blk * block_size;
  const gc_i64 end = active ? gc_min(start + (gc_i64)block_size, n) : start;

  // pass 1: absmax and non-finite flag of the block
  float m = 0.0f;
  int bad = 0;
  for (gc_i64 i = start + lane; i < end; i += group) {
    const gc_u32 b = __float_as_uint(gc_quant_input<T, EF>(x, residual, i)) & 0x7FFFFFFFu;
    if (b >= 0x7F800000u) {
      bad = 1;
    } else {
      m = fmaxf(m, __uint_as_float(b));
    }
  }
  s_max[tid] = m;
  s_bad[tid] = bad;
  __syncthreads();
  for (int s = group / 2; s > 0; s >>= 1) {
    if (lane < s) {
      s_max[tid] = fmaxf(s_max[tid], s_max[tid + s]);
      s_bad[tid] |= s_bad[tid + s];
    }
    __syncthreads();
  }
  m = s_max[first];
  bad = s_bad[first];
  if (!active) return;

  const bool live = !bad && m > 0.0f;
  const float scale = bad ? __uint_as_float(0x7FC00000u) : __fdiv_rn(m, 127.0f);
  if (lane == 0) scales[blk] = scale;

  // pass 2: codes (and the new residual)
  for (gc_i64 i = start + lane; i < end; i += group) {
    const float p = gc_quant_input<T, EF>(x, residual, i);
    float c = 0.0f;
    if (live) {
      const float y = __fmul_rn(__fdiv_rn(p, m), 127.0f);
      if (stochastic) {
        const gc_u32 r = gc_mix32((gc_u32)(gc_u64)i ^ key);
        const float u = __fmul_rn(__uint2float_rn(r >> 8), 5.9604644775390625e-08f);
        c = floorf(__fadd_rn(y, u));
      } else {
        c = rintf(y);
      }
      c = fminf(fmaxf(c, -127.0f), 127.0f);
    }
    const signed char code = (signed char)__float2int_rn(c);
    q[i] = code;
    if (EF) residual[i] = __fsub_rn(p, __fmul_rn((float)code, scale));
  }
}

#define GC_QUANTIZE(NAME, T, EF)                                                              \
  extern "C" __global__ void __launch_bounds__(GC_Q_THREADS)                                  \
      NAME(const T* x, float* residual, signed char* q, float* scales, gc_i64 n, int block_size, \
           int stochastic, gc_u32 key) {                                                      \
    gc_quantize<T, EF>(x, residual, q, scales, n, block_size, stochastic, key);               \
  }

GC_QUANTIZE(gc_quantize_f32, float, false)
GC_QUANTIZE(gc_quantize_f16, gc_half, false)
GC_QUANTIZE(gc_quantize_bf16, gc_bf16, false)
GC_QUANTIZE(gc_quantize_ef_f32, float, true)
GC_QUANTIZE(gc_quantize_ef_f16, gc_half, true)
GC_QUANTIZE(gc_quantize_ef_bf16, gc_bf16, true)

// out[i] = code * scale (float32 product, then rounded to O); grid-stride loop.
template <typename O>
__device__ void gc_dequantize(const signed char* __restrict__ q, const float* __restrict__ scales,
                              O* __restrict__ out, gc_i64 n, int log2_block) {
  const gc_i64 step = (gc_i64)gridDim.x * blockDim.x;
  for (gc_i64 i = (gc_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    gc_store(out + i, __fmul_rn((float)q[i], scales[i >> log2_block]));
  }
}

#define GC_DEQUANTIZE(NAME, O)                                                               \
  extern "C" __global__ void NAME(const signed char* q, const float* scales, O* out, gc_i64 n, \
                                  int log2_block) {                                          \
    gc_dequantize<O>(q, scales, out, n, log2_block);                                         \
  }

GC_DEQUANTIZE(gc_dequantize_f32, float)
GC_DEQUANTIZE(gc_dequantize_f16, gc_half)
GC_DEQUANTIZE(gc_dequantize_bf16, gc_bf16)
GC_DEQUANTIZE(gc_dequantize_f64, double)

// acc[i] = acc[i] + code * scale (product rounded first).
extern "C" __global__ void gc_dequantize_add(const signed char* __restrict__ q,
                                             const float* __restrict__ scales,
                                             float* __restrict__ acc, gc_i64 n, int log2_block) {
  const gc_i64 step = (gc_i64)gridDim.x * blockDim.x;
  for (gc_i64 i = (gc_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    acc[i] = __fadd_rn(acc[i], __fmul_rn((float)q[i], scales[i >> log2_block]));
  }
}
