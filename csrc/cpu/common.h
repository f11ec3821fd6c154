// Shared helpers of the CPU kernels (module gradcomp._C): element types and
// their conversions to/from float32, the counter-based hash, thread control
// and output buffers. No Python here: kernels take raw pointers and element
// counts; csrc/cpu/module.cpp validates numpy buffers and calls them with the
// GIL released.
//
// Every function here has internal linkage (static, or an unnamed namespace),
// so the kernel variants compiled for several instruction sets never share one.
// Numerics follow gradcomp/kernels/reference.py bit for bit. Float16 <->
// float32 conversions follow the x86 F16C instructions (exact widening, round
// to nearest even when narrowing, NaN payloads kept and quieted), which is
// what PyTorch's vectorised CPU conversions do; float32 -> bfloat16 rounds to
// nearest even and writes every NaN as 0xFFFF, as PyTorch's vectorised CPU
// conversion does.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif
// Instruction sets this translation unit may use: those the compiler targets
// (-march), or those a kernel variant's file declares before including this
// header (isa_avx2.cpp, isa_avx512.cpp: GC_ISA_* with a target pragma).
#if defined(__F16C__) || defined(GC_ISA_F16C)
#define GC_HAS_F16C 1
#endif
#if defined(__SSE4_1__) || defined(GC_ISA_SSE41)
#define GC_HAS_SSE41 1
#endif
#if defined(__AVX2__) || defined(GC_ISA_AVX2)
#define GC_HAS_AVX2 1
#endif
#if defined(__AVX512F__) || defined(GC_ISA_AVX512)
#define GC_HAS_AVX512 1
#endif
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <immintrin.h>  // declarations only: a function uses an instruction set only where allowed
#endif
#ifdef _MSC_VER
#include <intrin.h>
#endif

namespace gradcomp {

// ---------------------------------------------------------------------------
// bit casts (memcpy: well defined, compiled to register moves)

static inline uint32_t f32_bits(float v) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    return b;
}
static inline float bits_f32(uint32_t b) {
    float v;
    std::memcpy(&v, &b, 4);
    return v;
}
static inline uint64_t f64_bits(double v) {
    uint64_t b;
    std::memcpy(&b, &v, 8);
    return b;
}

// ---------------------------------------------------------------------------
// scalar float16 / bfloat16 conversions (portable; same results as F16C)

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    if (exp == 0x1F)  // Inf, or NaN: payload kept, quiet bit set
        return bits_f32(sign | 0x7F800000u | (mant ? 0x400000u : 0u) | (mant << 13));
    if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
    if (mant == 0) return bits_f32(sign);
    int e = 113;  // subnormal: normalise
    while (!(mant & 0x400u)) {
        mant <<= 1;
        --e;
    }
    return bits_f32(sign | (uint32_t(e) << 23) | ((mant & 0x3FFu) << 13));
}

static inline uint16_t f32_to_f16(float f) {
    const uint32_t x = f32_bits(f);
    const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN
    if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds to Inf (or is Inf)
    if (a < 0x38800000u) {  // result subnormal or zero: round |f| * 2**24 to an integer
        if (a < 0x33000000u) return sign;  // below half the smallest subnormal
        const uint32_t e = a >> 23;
        const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
        const uint32_t shift = 126u - e;  // 14 .. 24
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) ++r;
        return uint16_t(sign | r);
    }
    // normal: rebias the exponent, round the mantissa to 10 bits (half to even)
    uint32_t r = a - 0x38000000u;
    r += 0xFFFu + ((r >> 13) & 1u);
    return uint16_t(sign | (r >> 13));
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

static inline uint16_t f32_to_bf16(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFu;
    return uint16_t((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------------------
// element types: storage type, key type (|x| bits, order preserving) and bulk
// conversions to/from float32. In an unnamed namespace: each translation unit
// (each kernel variant's instruction set) gets its own copy, never another's.

namespace {

struct F32 {
    using T = float;
    using Key = uint32_t;
    static constexpr Key ABS = 0x7FFFFFFFu, INF = 0x7F800000u;
    static constexpr const char* name = "float32";
    static inline Key bits(T v) { return f32_bits(v); }
    static inline float to_float(T v) { return v; }
    static inline void to_float(const T* s, float* d, size_t n) { std::memcpy(d, s, n * 4); }
    static inline void from_float(const float* s, T* d, size_t n) { std::memcpy(d, s, n * 4); }
};

struct F64 {
    using T = double;
    using Key = uint64_t;
    static constexpr Key ABS = 0x7FFFFFFFFFFFFFFFull, INF = 0x7FF0000000000000ull;
    static constexpr const char* name = "float64";
    static inline Key bits(T v) { return f64_bits(v); }
    static inline float to_float(T v) { return static_cast<float>(v); }
    static inline void to_float(const T* s, float* d, size_t n) {
        for (size_t i = 0; i < n; ++i) d[i] = static_cast<float>(s[i]);
    }
    static inline void from_float(const float* s, T* d, size_t n) {
        for (size_t i = 0; i < n; ++i) d[i] = static_cast<double>(s[i]);
    }
};

struct BF16 {
    using T = uint16_t;
    using Key = uint16_t;
    static constexpr Key ABS = 0x7FFFu, INF = 0x7F80u;
    static constexpr const char* name = "bfloat16";
    static inline Key bits(T v) { return v; }
    static inline float to_float(T v) { return bf16_to_f32(v); }
    static inline void to_float(const T* s, float* d, size_t n) {
        for (size_t i = 0; i < n; ++i) d[i] = bits_f32(uint32_t(s[i]) << 16);
    }
    static inline void from_float(const float* s, T* d, size_t n) {
        for (size_t i = 0; i < n; ++i) {
            const uint32_t x = f32_bits(s[i]);
            const uint16_t r = uint16_t((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
            d[i] = (x & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0xFFFFu) : r;
        }
    }
};

struct F16 {
    using T = uint16_t;
    using Key = uint16_t;
    static constexpr Key ABS = 0x7FFFu, INF = 0x7C00u;
    static constexpr const char* name = "float16";
    static inline Key bits(T v) { return v; }
    static inline float to_float(T v) { return f16_to_f32(v); }
    static inline void to_float(const T* s, float* d, size_t n) {
        size_t i = 0;
#ifdef GC_HAS_F16C
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
#endif
        for (; i < n; ++i) d[i] = f16_to_f32(s[i]);
    }
    static inline void from_float(const float* s, T* d, size_t n) {
        size_t i = 0;
#ifdef GC_HAS_F16C
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; ++i) d[i] = f32_to_f16(s[i]);
    }
};

}  // namespace

// Selection key of an element: the bits of |x|, with every NaN mapped to the
// largest key (so NaN ranks above +Inf). Order of keys == order of |x|.
// `raw` is the element's bit pattern (selection kernels read inputs as keys).
template <class E>
static inline typename E::Key sel_key(typename E::Key raw) {
    using K = typename E::Key;
    const K k = K(raw & E::ABS);
    return k > E::INF ? E::ABS : k;
}

// a + b as PyTorch's CPU addition computes it, NaN payloads included: when b
// is NaN the result is b (quieted), whatever a is; otherwise a + b.
// (Integer select so that GCC vectorises loops of it.)
static inline float add_like_torch(float a, float b) {
    const uint32_t rb = f32_bits(a + b), bb = f32_bits(b);
    const uint32_t b_nan = 0u - uint32_t((bb & 0x7FFFFFFFu) > 0x7F800000u);  // all ones if b is NaN
    return bits_f32(((bb | 0x400000u) & b_nan) | (rb & ~b_nan));
}

// ---------------------------------------------------------------------------
// bit counting

static inline int popcount32(uint32_t m) {
#ifdef _MSC_VER
    return int(__popcnt(m));
#else
    return __builtin_popcount(m);
#endif
}

// index of the lowest set bit; m != 0
static inline int ctz32(uint32_t m) {
#ifdef _MSC_VER
    unsigned long i;
    _BitScanForward(&i, m);
    return int(i);
#else
    return __builtin_ctz(m);
#endif
}
static inline int ctz64(uint64_t m) {
#ifdef _MSC_VER
    unsigned long i;
    _BitScanForward64(&i, m);
    return int(i);
#else
    return __builtin_ctzll(m);
#endif
}

// ---------------------------------------------------------------------------
// counter-based randomness (reference.py: mix32 = lowbias32, C. Wellons)

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

// ---------------------------------------------------------------------------
// threads: one setting for the whole module, used by every parallel region
// (0 = omp_get_max_threads() of the calling thread: OMP_NUM_THREADS, all
// cores, or what torch.set_num_threads chose when PyTorch shares the runtime).

extern std::atomic<int> g_num_threads;

static inline int max_threads() {
#ifdef _OPENMP
    const int t = g_num_threads.load(std::memory_order_relaxed);
    return t > 0 ? t : omp_get_max_threads();
#else
    return 1;
#endif
}

// Number of contiguous chunks (one per thread) to split n elements into; a
// single chunk below `grain` elements per extra thread.
static inline int chunks_for(size_t n, size_t grain = size_t(1) << 15) {
    const size_t t = size_t(max_threads());
    const size_t c = std::min(t, std::max<size_t>(1, n / grain));
    return int(c);
}
static inline size_t chunk_begin(size_t n, int nchunks, int c) {
    const size_t q = n / size_t(nchunks), r = n % size_t(nchunks);
    return q * size_t(c) + std::min(size_t(c), r);
}

// ---------------------------------------------------------------------------
// uninitialised heap buffers handed to Python without a copy

struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
};
template <class T>
using Buffer = std::unique_ptr<T[], FreeDeleter>;

template <class T>
static inline Buffer<T> alloc_buffer(size_t n) {
    void* p = std::malloc(std::max<size_t>(n, 1) * sizeof(T));
    if (!p) throw std::bad_alloc();
    return Buffer<T>(static_cast<T*>(p));
}

// Result of a selection op: `count` ascending indices (int32 or int64 per
// `wide`) and the raw element values there.
struct Selection {
    Buffer<unsigned char> idx;
    Buffer<unsigned char> val;
    size_t count = 0;
};

}  // namespace gradcomp
