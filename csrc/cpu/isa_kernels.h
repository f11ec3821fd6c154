// The kernels compiled once per instruction set (quantize_body.h,
// lowbit_body.h), declared in each variant's namespace, and the table of one
// variant's entry points that isa.cpp picks from. Signatures: kernels.h.
#pragma once

#include "kernels.h"

// Variants beyond the baseline are built for x86-64 with GCC or Clang (target
// pragmas); elsewhere the baseline alone runs. isa_avx2.cpp and isa_avx512.cpp
// test the same condition before they include anything.
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define GC_ISA_DISPATCH 1
#endif

#define GC_ISA_KERNELS                                                                                      \
    void quantize_int8(DType dt, const void* x, float* residual, size_t n, size_t block, bool stochastic,    \
                       uint32_t key, int8_t* q, float* scales);                                            \
    bool dequantize_int8(const int8_t* q, const float* scales, size_t n, size_t block, DType out_dt,         \
                         void* out, bool check_int8);                                                      \
    bool dequantize_int8_add(float* acc, const int8_t* q, const float* scales, size_t n, size_t block,       \
                             bool check_int8);                                                             \
    bool reduce_quantize_int8(float* acc, const int8_t* q_in, const float* scales_in, size_t n,              \
                              size_t block, float divisor, bool stochastic, uint32_t key, int8_t* q,       \
                              float* scales, bool decode, bool check_int8);                                \
    void quantize_packed(DType dt, const void* x, float* residual, size_t n, size_t block, int bits,         \
                         bool stochastic, uint32_t key, uint8_t* codes, float* scales);                    \
    void dequantize_packed(const uint8_t* codes, const float* scales, size_t n, size_t block, int bits,      \
                           float* out, bool add);                                                          \
    void reduce_quantize_packed(float* acc, const uint8_t* codes_in, const float* scales_in, size_t n,       \
                                size_t block, int bits, float divisor, bool stochastic, uint32_t key,      \
                                uint8_t* codes, float* scales, bool decode);                               \
    void quantize_sign(DType dt, const void* x, float* residual, size_t n, size_t block, uint8_t* codes,     \
                       float* scales);                                                                     \
    void dequantize_sign(const uint8_t* codes, const float* scales, size_t n, size_t block, float* out,      \
                         bool add);                                                                        \
    void quantize_fp8(DType dt, const void* x, float* residual, size_t n, size_t block, Fp8 fmt,             \
                      uint8_t* codes, float* scales);                                                      \
    void dequantize_fp8(const uint8_t* codes, const float* scales, size_t n, size_t block, Fp8 fmt,          \
                        float* out, bool add);

namespace gradcomp {
namespace isa_baseline {
GC_ISA_KERNELS
}
#ifdef GC_ISA_DISPATCH
namespace isa_avx2 {
GC_ISA_KERNELS
}
namespace isa_avx512 {
GC_ISA_KERNELS
}
#endif

// One variant's entry points.
struct IsaKernels {
    const char* name;
    decltype(&isa_baseline::quantize_int8) quantize_int8;
    decltype(&isa_baseline::dequantize_int8) dequantize_int8;
    decltype(&isa_baseline::dequantize_int8_add) dequantize_int8_add;
    decltype(&isa_baseline::reduce_quantize_int8) reduce_quantize_int8;
    decltype(&isa_baseline::quantize_packed) quantize_packed;
    decltype(&isa_baseline::dequantize_packed) dequantize_packed;
    decltype(&isa_baseline::reduce_quantize_packed) reduce_quantize_packed;
    decltype(&isa_baseline::quantize_sign) quantize_sign;
    decltype(&isa_baseline::dequantize_sign) dequantize_sign;
    decltype(&isa_baseline::quantize_fp8) quantize_fp8;
    decltype(&isa_baseline::dequantize_fp8) dequantize_fp8;
};

#define GC_ISA_TABLE(NS)                                                                                    \
    IsaKernels {                                                                                            \
        #NS, &isa_##NS::quantize_int8, &isa_##NS::dequantize_int8, &isa_##NS::dequantize_int8_add,          \
            &isa_##NS::reduce_quantize_int8, &isa_##NS::quantize_packed, &isa_##NS::dequantize_packed,      \
            &isa_##NS::reduce_quantize_packed, &isa_##NS::quantize_sign, &isa_##NS::dequantize_sign,        \
            &isa_##NS::quantize_fp8, &isa_##NS::dequantize_fp8                                              \
    }

// The variant chosen for this process (isa.cpp): GRADCOMP_CPU_ISA when set,
// else the best this CPU runs. Throws std::invalid_argument with the reason when
// GRADCOMP_CPU_ISA names no variant, or one this CPU (or this build) cannot run.
const IsaKernels& isa_kernels();
// Names of the variants this CPU and build can run, best last ("baseline", "avx2", "avx512").
std::string isa_supported();

}  // namespace gradcomp
