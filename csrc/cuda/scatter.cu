// Sparse accumulation acc[indices[i]] += float(values[i]) with float32 atomic
// adds (duplicates accumulate; their order, and so the rounding of their sum,
// is unspecified). Indices outside [0, n) are skipped: never an out-of-bounds
// write, whatever the caller passes. Grid-stride loop over the m pairs.
#include "common.cuh"

template <typename I, typename V>
__device__ void gc_scatter_add(float* __restrict__ acc, gc_i64 n, const I* __restrict__ indices,
                               const V* __restrict__ values, gc_i64 m) {
  const gc_i64 step = (gc_i64)gridDim.x * blockDim.x;
  for (gc_i64 i = (gc_i64)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += step) {
    const gc_i64 j = (gc_i64)indices[i];
    if (j >= 0 && j < n) atomicAdd(acc + j, gc_to_float(values[i]));
  }
}

#define GC_SCATTER(SFX, I, V)                                                                  \
  extern "C" __global__ void gc_scatter_add_##SFX(float* acc, gc_i64 n, const I* indices,       \
                                                  const V* values, gc_i64 m) {                 \
    gc_scatter_add<I, V>(acc, n, indices, values, m);                                          \
  }

GC_SCATTER(i32_f32, int, float)
GC_SCATTER(i32_f16, int, gc_half)
GC_SCATTER(i32_bf16, int, gc_bf16)
GC_SCATTER(i32_f64, int, double)
GC_SCATTER(i64_f32, gc_i64, float)
GC_SCATTER(i64_f16, gc_i64, gc_half)
GC_SCATTER(i64_bf16, gc_i64, gc_bf16)
GC_SCATTER(i64_f64, gc_i64, double)
