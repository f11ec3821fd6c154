// The standard headers the kernel bodies use, included by each kernel
// variant's file before its target pragma: their inline functions and
// templates then keep the baseline target in every variant (a definition
// compiled for AVX2 that the linker kept for all callers would crash a CPU
// without it).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif
