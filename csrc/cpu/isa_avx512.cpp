// The hot kernels compiled for AVX-512 F, BW, DQ, VL (x86-64-v4: Intel Skylake-X, AMD Zen 4 and later),
// by a target pragma over the shared bodies (the module itself stays portable;
// isa.cpp runs these only on a CPU that has them). Everything the bodies define
// has internal linkage or lives in namespace isa_avx512, and the standard headers
// come before the pragma, so no baseline caller ever reaches this code.
// (the condition of GC_ISA_DISPATCH in isa_kernels.h)
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include "system_headers.h"

#define GC_ISA_AVX512 1
#define GC_ISA_AVX2 1
#define GC_ISA_F16C 1
#define GC_ISA_SSE41 1
#define GC_ISA_NS isa_avx512
// (a build for the machine's own CPU that already targets this set keeps its flags:
// the pragma would narrow them, and intrinsics compiled for more cannot inline)
#if !defined(__AVX512F__)
#define GC_ISA_PRAGMA 1
#endif
#if defined(GC_ISA_PRAGMA) && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,sse4.1,sse4.2"))), apply_to = function)
#elif defined(GC_ISA_PRAGMA)
#pragma GCC target("arch=x86-64-v4")
#endif
// GCC 12 warns that the intrinsics' deliberately undefined pass-through operands
// (`__Y = __Y` in its headers) may be used uninitialized: they are not
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include "lowbit_body.h"
#include "quantize_body.h"
#if defined(GC_ISA_PRAGMA) && defined(__clang__)
#pragma clang attribute pop
#endif
#endif
