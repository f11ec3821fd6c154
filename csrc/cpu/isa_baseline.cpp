// The hot kernels for the compiler's baseline CPU (x86-64: SSE2), the variant
// every machine runs; isa_avx2.cpp / isa_avx512.cpp compile the same bodies for
// newer instruction sets and isa.cpp picks one at load.
#define GC_ISA_NS isa_baseline
#include "lowbit_body.h"
#include "quantize_body.h"
