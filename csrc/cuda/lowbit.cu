// The sub-byte and fp8 block codecs: packed int4/int2 codes, scaled sign and
// blockwise-scaled fp8 (e4m3fn, e5m2). Numerics are those of
// gradcomp/kernels/reference_lowbit.py, bit for bit: divisions __fdiv_rn,
// products and sums __fmul_rn / __fadd_rn (nothing fused into an FMA); a
// block holding NaN/Inf gets scale NaN (0x7FC00000) and codes 0.
//
// Launch (as quantize.cu): GC_L_THREADS threads per CTA, a quantization block
// handled by a group of G = min(block_size, GC_L_THREADS) threads. Pass 1:
// absmax and non-finite flag by a shared-memory max; for sign, the sum of |p|
// of each tile of G elements by halving (s[t] += s[t + h], h = G/2 .. 1, the
// reference's order), the tiles' sums added left to right by the group's
// first thread. Pass 2: each thread writes whole output bytes (8 / bits
// elements each). Decoding: one thread per element, grid-stride.
#include "common.cuh"

#define GC_L_THREADS 256

// codec kinds, as gradcomp/kernels/cuda_lowbit.py passes them
#define GC_PACKED 0
#define GC_SIGN 1
#define GC_FP8 2

// float32 -> fp8 bits, round half to even, for |f| <= the format's largest
// finite value (fmt 0: e4m3fn, 1: e5m2), as PyTorch's c10 conversion
__device__ __forceinline__ gc_u32 gc_to_fp8(float f, int fmt) {
  gc_u32 b = __float_as_uint(f);
  const gc_u32 sign = b & 0x80000000u;
  b ^= sign;
  gc_u32 r;
  if (fmt == 0) {
    r = b < 0x3C800000u ? __float_as_uint(__fadd_rn(__uint_as_float(b), 16384.0f)) - 0x46800000u
                        : (b - 0x3C000000u + 0x7FFFFu + ((b >> 20) & 1u)) >> 20;
  } else {
    r = b < 0x38800000u ? __float_as_uint(__fadd_rn(__uint_as_float(b), 128.0f)) - 0x43000000u
                        : (b - 0x38000000u + 0xFFFFFu + ((b >> 21) & 1u)) >> 21;
  }
  return r | (sign >> 24);
}

// fp8 bits (not NaN / Inf) -> float32, exactly
__device__ __forceinline__ float gc_from_fp8(gc_u32 c, int fmt) {
  const int mb = fmt == 0 ? 3 : 2;
  const gc_u32 e = (c & 0x7Fu) >> mb, m = c & ((1u << mb) - 1u);
  float v;
  if (e == 0) {
    v = __fmul_rn((float)m, fmt == 0 ? 0.001953125f : 1.52587890625e-05f);  // m * 2**-9, m * 2**-16
  } else {
    v = __uint_as_float(((e + (fmt == 0 ? 120u : 112u)) << 23) | (m << (23 - mb)));
  }
  return (c & 0x80u) ? -v : v;
}

struct GcCodec {
  int kind, bits, stochastic, fmt;
};

// the code (field bits) of p in a live block of absmax m, element index i
__device__ __forceinline__ gc_u32 gc_code(float p, float m, gc_i64 i, gc_u32 key, GcCodec k) {
  if (k.kind == GC_SIGN) return p < 0.0f ? 1u : 0u;
  if (k.kind == GC_FP8) {
    const float top = k.fmt == 0 ? 448.0f : 57344.0f, inv = __fdiv_rn(top, m);
    // p * (top / m); (p / m) * top where top / m overflows (m below top / FLT_MAX)
    return gc_to_fp8(inv <= 3.4028234663852886e38f ? __fmul_rn(p, inv) : __fmul_rn(__fdiv_rn(p, m), top), k.fmt);
  }
  const float q = (float)((1 << (k.bits - 1)) - 1);
  const float y = __fmul_rn(__fdiv_rn(p, m), q);
  float c;
  if (k.stochastic) {
    const gc_u32 r = gc_mix32((gc_u32)(gc_u64)i ^ key);
    c = floorf(__fadd_rn(y, __fmul_rn(__uint2float_rn(r >> 8), 5.9604644775390625e-08f)));
    c = fminf(fmaxf(c, -q), q);
  } else {
    c = rintf(y);
  }
  return (gc_u32)__float2int_rn(c) & ((1u << k.bits) - 1u);
}

// the decoded value of field bits c in a block of scale s
__device__ __forceinline__ float gc_value(gc_u32 c, float s, GcCodec k) {
  if (k.kind == GC_SIGN) return c ? -s : s;
  if (k.kind == GC_FP8) return __fmul_rn(gc_from_fp8(c, k.fmt), s);
  const int half = 1 << (k.bits - 1);
  return __fmul_rn((float)(((int)c ^ half) - half), s);
}

template <typename T, bool EF>
__device__ __forceinline__ float gc_lowbit_input(const T* x, const float* residual, gc_i64 i) {
  float p = gc_to_float(x[i]);
  if (EF) p = __fadd_rn(p, residual[i]);
  return p;
}

template <typename T, bool EF>
__device__ void gc_lowbit_quantize(const T* __restrict__ x, float* __restrict__ residual,
                                   unsigned char* __restrict__ codes, float* __restrict__ scales, gc_i64 n,
                                   int block_size, gc_u32 key, GcCodec k) {
  __shared__ float s_max[GC_L_THREADS];
  __shared__ float s_sum[GC_L_THREADS];
  __shared__ int s_bad[GC_L_THREADS];
  const int tid = threadIdx.x;
  const int group = block_size < GC_L_THREADS ? block_size : GC_L_THREADS;
  const int lane = tid & (group - 1);
  const int first = tid - lane;
  const gc_i64 nblocks = (n + block_size - 1) / block_size;
  const gc_i64 blk = (gc_i64)blockIdx.x * (GC_L_THREADS / group) + tid / group;
  const bool active = blk < nblocks;
  const gc_i64 start = blk * block_size;
  const gc_i64 end = active ? gc_min(start + (gc_i64)block_size, n) : start;

  float m = 0.0f, total = 0.0f;
  int bad = 0;
  for (int t = 0; t < block_size; t += group) {  // every group of a CTA runs the same trip count
    const gc_i64 i = start + t + lane;
    float a = 0.0f;
    if (i < end) {
      const gc_u32 b = __float_as_uint(gc_lowbit_input<T, EF>(x, residual, i)) & 0x7FFFFFFFu;
      if (b >= 0x7F800000u) {
        bad = 1;
      } else {
        a = __uint_as_float(b);
        m = fmaxf(m, a);
      }
    }
    if (k.kind == GC_SIGN) {
      s_sum[tid] = a;
      __syncthreads();
      for (int h = group / 2; h > 0; h >>= 1) {
        if (lane < h) s_sum[tid] = __fadd_rn(s_sum[tid], s_sum[tid + h]);
        __syncthreads();
      }
      total = t == 0 ? s_sum[first] : __fadd_rn(total, s_sum[first]);
      __syncthreads();
    }
  }
  s_max[tid] = m;
  s_bad[tid] = bad;
  __syncthreads();
  for (int h = group / 2; h > 0; h >>= 1) {
    if (lane < h) {
      s_max[tid] = fmaxf(s_max[tid], s_max[tid + h]);
      s_bad[tid] |= s_bad[tid + h];
    }
    __syncthreads();
  }
  m = s_max[first];
  bad = s_bad[first];
  if (!active) return;

  const bool live = !bad && m > 0.0f;
  float scale;
  if (k.kind == GC_SIGN) scale = fminf(__fdiv_rn(total, (float)(end - start)), m);
  else if (k.kind == GC_FP8) scale = __fdiv_rn(m, k.fmt == 0 ? 448.0f : 57344.0f);
  else scale = __fdiv_rn(m, (float)((1 << (k.bits - 1)) - 1));
  if (bad) scale = __uint_as_float(0x7FC00000u);
  if (lane == 0) scales[blk] = scale;

  const int per = 8 / k.bits;
  for (gc_i64 byte = start / per + lane; byte * per < end; byte += group) {
    gc_u32 out = 0;
    for (int j = 0; j < per && byte * per + j < end; ++j) {
      const gc_i64 i = byte * per + j;
      const float p = gc_lowbit_input<T, EF>(x, residual, i);
      const gc_u32 c = live ? gc_code(p, m, i, key, k) : 0u;
      out |= c << (j * k.bits);
      if (EF) residual[i] = __fsub_rn(p, gc_value(c, scale, k));
    }
    codes[byte] = (unsigned char)out;
  }
}

#define GC_LOWBIT_QUANTIZE(NAME, T, EF)                                                                \
  extern "C" __global__ void __launch_bounds__(GC_L_THREADS)                                           \
      NAME(const T* x, float* residual, unsigned char* codes, float* scales, gc_i64 n, int block_size,   \
           gc_u32 key, int kind, int bits, int stochastic, int fmt) {                                  \
    GcCodec k = {kind, bits, stochastic, fmt};                                                         \
    gc_lowbit_quantize<T, EF>(x, residual, codes, scales, n, block_size, key, k);                      \
  }

GC_LOWBIT_QUANTIZE(gc_lowbit_quantize_f32, float, false)
GC_LOWBIT_QUANTIZE(gc_lowbit_quantize_f16, gc_half, false)
GC_LOWBIT_QUANTIZE(gc_lowbit_quantize_bf16, gc_bf16, false)
GC_LOWBIT_QUANTIZE(gc_lowbit_quantize_ef_f32, float, true)
GC_LOWBIT_QUANTIZE(gc_lowbit_quantize_ef_f16, gc_half, true)
GC_LOWBIT_QUANTIZE(gc_lowbit_quantize_ef_bf16, gc_bf16, true)

// out[i] = value(code_i) * scale, or out[i] + that when add (float32); grid-stride.
extern "C" __global__ void gc_lowbit_decode(const unsigned char* __restrict__ codes,
                                            const float* __restrict__ scales, float* __restrict__ out,
                                            gc_i64 n, int log2_block, int kind, int bits, int fmt, int add) {
  GcCodec k = {kind, bits, 0, fmt};
  const int per = 8 / bits;
  const gc_i64 step = (gc_i64)gridDim.x * blockDim.x;
  for (gc_i64 i = (gc_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
    const gc_u32 c = ((gc_u32)codes[i / per] >> ((int)(i % per) * bits)) & ((1u << bits) - 1u);
    const float v = gc_value(c, scales[i >> log2_block], k);
    out[i] = add ? __fadd_rn(out[i], v) : v;
  }
}
