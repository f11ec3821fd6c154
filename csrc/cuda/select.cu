// Magnitude selection: radix select for exact top-k, stream compaction for
// top-k / threshold, as in gradcomp/kernels/reference.py (same index sets).
//
// Keys (common.cuh) order |x| exactly: 32-bit for float32/float16/bfloat16,
// 64-bit for float64; NaN above +Inf (or equal to +Inf when nan_as_inf).
//
// Radix select (Alabi et al. 2012, "Fast k-selection algorithms for graphics
// processing units"), 8-bit digits from the top, all state on the device:
//   state = int64[2] = {prefix, k_rem}
//   per digit: gc_radix_hist_* counts the digit of the keys whose higher bits
//   equal prefix; gc_radix_pick picks the digit holding the k_rem-th largest,
//   appends it to prefix, subtracts the counts above it from k_rem and clears
//   the histogram. After the last digit prefix = T, the k-th largest key, and
//   k_rem = how many keys equal to T belong to the top k (lowest index first).
// Compaction: gc_select_count_* counts keys > T and == T per tile; the host
// turns them into exclusive prefix sums (torch.cumsum); gc_select_write_*
// writes every kept element at gt_before + min(eq_before, k_rem), so indices
// come out ascending. threshold is the same with T = key(tau), k_rem = n.
#include "common.cuh"

#define GC_S_THREADS 256
#define GC_S_ITEMS 8
#define GC_S_TILE (GC_S_THREADS * GC_S_ITEMS)
#define GC_S_WARPS (GC_S_THREADS / 32)

template <typename T>
struct gc_key_type {
  typedef gc_u32 type;
};
template <>
struct gc_key_type<double> {
  typedef gc_u64 type;
};

// Histogram of digit (key >> shift) & 255 over x[i * stride], i < count, for keys
// that agree with state[0] on the bits above the digit. hist: 256 x u64.
template <typename T>
__device__ void gc_radix_hist(const T* __restrict__ x, gc_i64 count, gc_i64 stride,
                              const gc_i64* __restrict__ state, int shift, int nan_as_inf,
                              gc_u64* __restrict__ hist) {
  typedef typename gc_key_type<T>::type K;
  const int bits = (int)sizeof(K) * 8;
  __shared__ gc_u32 h[GC_S_WARPS][256];  // one sub-histogram per warp
  for (int b = threadIdx.x; b < GC_S_WARPS * 256; b += blockDim.x) (&h[0][0])[b] = 0;
  __syncthreads();
  const K prefix = (K)state[0];
  const int hi = shift + 8;
  const K hi_mask = hi >= bits ? (K)0 : ~(((K)1 << hi) - 1);
  gc_u32* mine = h[threadIdx.x / 32];
  const gc_i64 step = (gc_i64)gridDim.x * blockDim.x;
  for (gc_i64 i = (gc_i64)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += step) {
    const K k = gc_key(x[i * stride], nan_as_inf);
    if ((k & hi_mask) == (prefix & hi_mask)) atomicAdd(&mine[(k >> shift) & 255], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    gc_u32 c = 0;
    for (int w = 0; w < GC_S_WARPS; ++w) c += h[w][b];
    if (c) atomicAdd(&hist[b], (gc_u64)c);
  }
}

// One CTA: choose the digit, update state, clear hist for the next digit.
extern "C" __global__ void gc_radix_pick(gc_u64* hist, gc_i64* state, int shift) {
  if (threadIdx.x == 0) {
    const gc_u64 k_rem = (gc_u64)state[1];
    gc_u64 above = 0;
    int b = 255;
    for (; b > 0; --b) {
      if (above + hist[b] >= k_rem) break;
      above += hist[b];
    }
    state[0] = (gc_i64)((gc_u64)state[0] | ((gc_u64)b << shift));
    state[1] = (gc_i64)(k_rem - above);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
}

// Block-wide exclusive scan of two counters (Hillis-Steele in shared memory).
__device__ __forceinline__ void gc_scan2(gc_u32& a, gc_u32& b) {
  __shared__ gc_u32 sa[GC_S_THREADS];
  __shared__ gc_u32 sb[GC_S_THREADS];
  const int t = threadIdx.x;
  sa[t] = a;
  sb[t] = b;
  __syncthreads();
  for (int off = 1; off < GC_S_THREADS; off <<= 1) {
    const gc_u32 va = t >= off ? sa[t - off] : 0u;
    const gc_u32 vb = t >= off ? sb[t - off] : 0u;
    __syncthreads();
    sa[t] += va;
    sb[t] += vb;
    __syncthreads();
  }
  a = sa[t] - a;
  b = sb[t] - b;
}

// Per tile of GC_S_TILE elements: number of keys > T and == T (T = state[0]).
template <typename T>
__device__ void gc_select_count(const T* __restrict__ x, gc_i64 n, const gc_i64* __restrict__ state,
                                int nan_as_inf, gc_i64* __restrict__ count_gt,
                                gc_i64* __restrict__ count_eq) {
  typedef typename gc_key_type<T>::type K;
  __shared__ gc_u32 s_gt[GC_S_WARPS];
  __shared__ gc_u32 s_eq[GC_S_WARPS];
  const K t = (K)state[0];
  const gc_i64 base = (gc_i64)blockIdx.x * GC_S_TILE;
  gc_u32 gt = 0, eq = 0;
  for (int j = threadIdx.x; j < GC_S_TILE; j += GC_S_THREADS) {
    const gc_i64 i = base + j;
    if (i < n) {
      const K k = gc_key(x[i], nan_as_inf);
      gt += k > t;
      eq += k == t;
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    gt += __shfl_down_sync(0xFFFFFFFFu, gt, off);
    eq += __shfl_down_sync(0xFFFFFFFFu, eq, off);
  }
  if ((threadIdx.x & 31) == 0) {
    s_gt[threadIdx.x / 32] = gt;
    s_eq[threadIdx.x / 32] = eq;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    gc_i64 a = 0, b = 0;
    for (int w = 0; w < GC_S_WARPS; ++w) {
      a += s_gt[w];
      b += s_eq[w];
    }
    count_gt[blockIdx.x] = a;
    count_eq[blockIdx.x] = b;
  }
}

// Write the kept elements of one tile; thread t owns GC_S_ITEMS consecutive elements.
// gt_base / eq_base: exclusive prefix sums of the per-tile counts.
template <typename T>
__device__ void gc_select_write(const T* __restrict__ x, gc_i64 n, const gc_i64* __restrict__ state,
                                int nan_as_inf, const gc_i64* __restrict__ gt_base,
                                const gc_i64* __restrict__ eq_base, void* __restrict__ out_idx,
                                int idx64, T* __restrict__ out_val) {
  typedef typename gc_key_type<T>::type K;
  const K t = (K)state[0];
  const gc_i64 k_rem = state[1];
  const gc_i64 first = (gc_i64)blockIdx.x * GC_S_TILE + (gc_i64)threadIdx.x * GC_S_ITEMS;
  gc_u32 gt = 0, eq = 0;
  for (int j = 0; j < GC_S_ITEMS; ++j) {
    const gc_i64 i = first + j;
    if (i < n) {
      const K k = gc_key(x[i], nan_as_inf);
      gt += k > t;
      eq += k == t;
    }
  }
  gc_scan2(gt, eq);  // now: counts in this tile before this thread
  gc_i64 gt_before = gt_base[blockIdx.x] + gt;
  gc_i64 eq_before = eq_base[blockIdx.x] + eq;
  for (int j = 0; j < GC_S_ITEMS; ++j) {
    const gc_i64 i = first + j;
    if (i >= n) break;
    const T v = x[i];
    const K k = gc_key(v, nan_as_inf);
    const bool is_gt = k > t;
    const bool is_eq = k == t;
    if (is_gt || (is_eq && eq_before < k_rem)) {
      const gc_i64 pos = gt_before + gc_min(eq_before, k_rem);
      if (idx64) {
        ((gc_i64*)out_idx)[pos] = i;
      } else {
        ((int*)out_idx)[pos] = (int)i;
      }
      out_val[pos] = v;
    }
    gt_before += is_gt;
    eq_before += is_eq;
  }
}

#define GC_SELECT(SFX, T)                                                                        \
  extern "C" __global__ void __launch_bounds__(GC_S_THREADS)                                     \
      gc_radix_hist_##SFX(const T* x, gc_i64 count, gc_i64 stride, const gc_i64* state, int shift, \
                          int nan_as_inf, gc_u64* hist) {                                        \
    gc_radix_hist<T>(x, count, stride, state, shift, nan_as_inf, hist);                          \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(GC_S_THREADS)                                     \
      gc_select_count_##SFX(const T* x, gc_i64 n, const gc_i64* state, int nan_as_inf,           \
                            gc_i64* count_gt, gc_i64* count_eq) {                                \
    gc_select_count<T>(x, n, state, nan_as_inf, count_gt, count_eq);                             \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(GC_S_THREADS)                                     \
      gc_select_write_##SFX(const T* x, gc_i64 n, const gc_i64* state, int nan_as_inf,           \
                            const gc_i64* gt_base, const gc_i64* eq_base, void* out_idx,         \
                            int idx64, T* out_val) {                                             \
    gc_select_write<T>(x, n, state, nan_as_inf, gt_base, eq_base, out_idx, idx64, out_val);      \
  }

GC_SELECT(f32, float)
GC_SELECT(f16, gc_half)
GC_SELECT(bf16, gc_bf16)
GC_SELECT(f64, double)
