// The hot kernels compiled for AVX2, FMA, F16C, BMI2 (x86-64-v3: Intel Haswell, AMD Zen and later),
// by a target pragma over the shared bodies (the module itself stays portable;
// isa.cpp runs these only on a CPU that has them). Everything the bodies define
// has internal linkage or lives in namespace isa_avx2, and the standard headers
// come before the pragma, so no baseline caller ever reaches this code.
// (the condition of GC_ISA_DISPATCH in isa_kernels.h)
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include "system_headers.h"

#define GC_ISA_AVX2 1
#define GC_ISA_F16C 1
#define GC_ISA_SSE41 1
#define GC_ISA_NS isa_avx2
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,sse4.1,sse4.2"))), apply_to = function)
#else
#pragma GCC target("arch=x86-64-v3")
#endif
#include "lowbit_body.h"
#include "quantize_body.h"
#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
