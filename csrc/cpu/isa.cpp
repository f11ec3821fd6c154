// Runtime choice of the kernel variant (instruction set), once per process, as
// numpy and PyTorch's ATen do: GRADCOMP_CPU_ISA=baseline|avx2|avx512 forces one
// (refused with the reason when this CPU or build cannot run it), otherwise the
// best this CPU supports. The entry points of kernels.h forward to the chosen
// variant; every variant computes the same bits (the reference's).
#include <cstdlib>
#include <string>

#include "isa_kernels.h"

namespace gradcomp {

namespace {

struct IsaChoice {
    const IsaKernels* kernels = nullptr;
    std::string error;      // why GRADCOMP_CPU_ISA cannot be honoured ("" when it can)
    std::string supported;  // e.g. "baseline, avx2, avx512"
};

const IsaKernels BASELINE = GC_ISA_TABLE(baseline);
#ifdef GC_ISA_DISPATCH
const IsaKernels AVX2 = GC_ISA_TABLE(avx2);
const IsaKernels AVX512 = GC_ISA_TABLE(avx512);

// What the variant's target needs and this CPU lacks ("" when it has it all);
// __builtin_cpu_supports also checks that the OS saves the vector registers.
std::string missing(bool avx512) {
    std::string m;
    auto need = [&m](bool ok, const char* what) {
        if (!ok) m += (m.empty() ? "" : ", ") + std::string(what);
    };
#if defined(__clang__)
    need(__builtin_cpu_supports("avx2"), "AVX2");
    need(__builtin_cpu_supports("fma"), "FMA");
    need(__builtin_cpu_supports("bmi2"), "BMI2");
    need(__builtin_cpu_supports("popcnt"), "POPCNT");
    if (avx512) {
        need(__builtin_cpu_supports("avx512f"), "AVX-512F");
        need(__builtin_cpu_supports("avx512bw"), "AVX-512BW");
        need(__builtin_cpu_supports("avx512vl"), "AVX-512VL");
        need(__builtin_cpu_supports("avx512dq"), "AVX-512DQ");
    }
#else
    need(__builtin_cpu_supports("x86-64-v3"), "x86-64-v3 (AVX2, FMA, F16C, BMI2, MOVBE, LZCNT)");
    if (avx512) need(__builtin_cpu_supports("x86-64-v4"), "x86-64-v4 (AVX-512 F, BW, CD, DQ, VL)");
#endif
    return m;
}
#endif

IsaChoice choose() {
    IsaChoice c;
    const IsaKernels* runnable[3] = {&BASELINE, nullptr, nullptr};
    std::string why[3];
#ifdef GC_ISA_DISPATCH
    __builtin_cpu_init();
    why[1] = missing(false);
    why[2] = missing(true);
    if (why[1].empty()) runnable[1] = &AVX2;
    if (why[2].empty()) runnable[2] = &AVX512;
#else
    why[1] = why[2] = "a build for x86-64 with GCC or Clang";
#endif
    const char* names[3] = {"baseline", "avx2", "avx512"};
    for (int i = 0; i < 3; ++i)
        if (runnable[i]) c.supported += (c.supported.empty() ? "" : ", ") + std::string(names[i]);
    const char* env = std::getenv("GRADCOMP_CPU_ISA");
    if (env == nullptr || *env == '\0') {
        for (int i = 2; i >= 0 && !c.kernels; --i) c.kernels = runnable[i];
        return c;
    }
    const std::string want(env);
    for (int i = 0; i < 3; ++i) {
        if (want != names[i]) continue;
        if (runnable[i]) c.kernels = runnable[i];
        else c.error = "GRADCOMP_CPU_ISA=" + want + " cannot run here: it needs " + why[i] +
                       " (this CPU runs " + c.supported + ")";
        return c;
    }
    c.error = "GRADCOMP_CPU_ISA must be one of baseline, avx2, avx512 (or unset: the best this CPU runs), got '" +
              want + "'";
    return c;
}

const IsaChoice& choice() {
    static const IsaChoice c = choose();
    return c;
}

}  // namespace

const IsaKernels& isa_kernels() {
    const IsaChoice& c = choice();
    if (!c.error.empty()) throw std::invalid_argument(c.error);
    return *c.kernels;
}

std::string isa_supported() { return choice().supported; }

void quantize_int8(DType dt, const void* x, float* residual, size_t n, size_t block, bool stochastic,
                   uint32_t key, int8_t* q, float* scales) {
    isa_kernels().quantize_int8(dt, x, residual, n, block, stochastic, key, q, scales);
}

bool dequantize_int8(const int8_t* q, const float* scales, size_t n, size_t block, DType out_dt, void* out,
                     bool check_int8) {
    return isa_kernels().dequantize_int8(q, scales, n, block, out_dt, out, check_int8);
}

bool dequantize_int8_add(float* acc, const int8_t* q, const float* scales, size_t n, size_t block,
                         bool check_int8) {
    return isa_kernels().dequantize_int8_add(acc, q, scales, n, block, check_int8);
}

bool reduce_quantize_int8(float* acc, const int8_t* q_in, const float* scales_in, size_t n, size_t block,
                          float divisor, bool stochastic, uint32_t key, int8_t* q, float* scales, bool decode,
                          bool check_int8) {
    return isa_kernels().reduce_quantize_int8(acc, q_in, scales_in, n, block, divisor, stochastic, key, q, scales,
                                              decode, check_int8);
}

void quantize_packed(DType dt, const void* x, float* residual, size_t n, size_t block, int bits, bool stochastic,
                     uint32_t key, uint8_t* codes, float* scales) {
    isa_kernels().quantize_packed(dt, x, residual, n, block, bits, stochastic, key, codes, scales);
}

void dequantize_packed(const uint8_t* codes, const float* scales, size_t n, size_t block, int bits, float* out,
                       bool add) {
    isa_kernels().dequantize_packed(codes, scales, n, block, bits, out, add);
}

void reduce_quantize_packed(float* acc, const uint8_t* codes_in, const float* scales_in, size_t n, size_t block,
                            int bits, float divisor, bool stochastic, uint32_t key, uint8_t* codes, float* scales,
                            bool decode) {
    isa_kernels().reduce_quantize_packed(acc, codes_in, scales_in, n, block, bits, divisor, stochastic, key, codes,
                                         scales, decode);
}

void quantize_sign(DType dt, const void* x, float* residual, size_t n, size_t block, uint8_t* codes,
                   float* scales) {
    isa_kernels().quantize_sign(dt, x, residual, n, block, codes, scales);
}

void dequantize_sign(const uint8_t* codes, const float* scales, size_t n, size_t block, float* out, bool add) {
    isa_kernels().dequantize_sign(codes, scales, n, block, out, add);
}

void quantize_fp8(DType dt, const void* x, float* residual, size_t n, size_t block, Fp8 fmt, uint8_t* codes,
                  float* scales) {
    isa_kernels().quantize_fp8(dt, x, residual, n, block, fmt, codes, scales);
}

void dequantize_fp8(const uint8_t* codes, const float* scales, size_t n, size_t block, Fp8 fmt, float* out,
                    bool add) {
    isa_kernels().dequantize_fp8(codes, scales, n, block, fmt, out, add);
}

}  // namespace gradcomp
