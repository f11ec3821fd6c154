// Helpers of the blockwise quantizers (int8 in quantize.cpp, the sub-byte and
// fp8 codecs in lowbit.cpp): tiles of float32 values, absmax, rounding and the
// reduce step's sum. Numerics: gradcomp/kernels/reference.py and
// reference_lowbit.py, bit for bit (built with -ffp-contract=off).
#pragma once

#include <type_traits>

#include "common.h"

namespace gradcomp {
namespace blockwise {
namespace {  // internal linkage: one copy per kernel variant

constexpr size_t TILE = 256;
constexpr uint32_t NAN_BITS = 0x7FC00000u;
constexpr size_t PAR_MIN = size_t(1) << 16;  // elements below which one thread is faster

// Inputs of at least this many elements (8 MiB of float32, beyond the caches)
// get their codes written with non-temporal stores: the input streaming through
// would evict the codes anyway, and a plain store first reads each line it
// overwrites (read-for-ownership), a fifth more memory traffic for int8 codes.
constexpr size_t STREAM_CODES_MIN = size_t(1) << 21;

// Whether a quantizer streams its codes: a large input, in blocks of whole
// tiles (a codec whose tile of codes does not fill whole cache lines, as
// sign's 32 bytes, streams nothing: half-written lines leave the write-combining
// buffers one by one; the caller checks that)
inline bool streams_codes(size_t n, size_t block) { return n >= STREAM_CODES_MIN && block >= TILE; }

// dst[0, bytes) = src[0, bytes), non-temporal where dst is 16-byte aligned
// (SSE2, which every x86-64 has; plain stores at the edges and elsewhere).
// The caller issues stream_fence() before another thread may read dst.
inline void stream_bytes(uint8_t* __restrict dst, const uint8_t* __restrict src, size_t bytes) {
    size_t i = 0;
#if defined(__SSE2__)
    for (; i < bytes && (reinterpret_cast<uintptr_t>(dst + i) & 15u) != 0; ++i) dst[i] = src[i];
    for (; i + 16 <= bytes; i += 16)
        _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
#endif
    std::memcpy(dst + i, src + i, bytes - i);
}

// How far ahead of a block its input is prefetched (bytes) while the block's codes are
// computed. The codes pass reads only L1 (the absmax pass loaded the block), so the
// hardware prefetcher, which runs on cache misses, issues nothing while it computes; memory
// then idles through every codes pass and the two add up. Prefetching the block this far
// ahead, one line at a time, overlaps them. Only beyond the caches (streams_codes' size) and
// only where the codes pass is long against a line's transfer: the baseline and avx2
// variants (on AVX2-only cores the int8 quantizer ran at the sum of its in-cache time and
// a read of its input); the avx512 variant's codes pass is short, and a prefetch of this
// kind measured slower there (docs/results/codecs.md).
constexpr size_t PREFETCH_AHEAD = 4096;

// Prefetch the `count` elements from p, `bytes` ahead (a hint: an address past the buffer's
// end is never read and never faults; it is formed as an integer, not by pointer arithmetic
// past the buffer).
template <class T>
inline void prefetch_ahead(const T* p, size_t count, size_t bytes = PREFETCH_AHEAD) {
#if defined(__SSE__) && !defined(GC_HAS_AVX512)
    const uintptr_t a = reinterpret_cast<uintptr_t>(p) + bytes;
    for (size_t k = 0; k < count * sizeof(T); k += 64) _mm_prefetch(reinterpret_cast<const char*>(a + k), _MM_HINT_T0);
#else
    (void)p;
    (void)count;
    (void)bytes;
#endif
}

// A block's inputs prefetched ahead: x and, with error feedback, the residual (len elements from
// each; res is not read without EF)
template <bool EF, class T>
inline void prefetch_block(const T* x, const float* res, size_t len) {
    prefetch_ahead(x, len);
    if constexpr (EF) prefetch_ahead(res, len);
}

// For a block of several tiles, called once per tile of its codes pass: the same tile of a
// later block (block_len elements on, or PREFETCH_AHEAD bytes of x where that is further), so
// that the lines arrive spread over the pass (a whole block's lines requested at once stall
// the core until enough of them arrive) and are not lines of this block, already in cache.
// The bodies call prefetch_block before their tile loop and this inside it, each under its
// own condition: one helper that chose between the two per call compiled to a single
// merged prefetch loop that ran the quantizers slower (docs/results/codecs.md).
template <bool EF, class T>
inline void prefetch_tile_of_next_block(const T* x, const float* res, size_t tile_len, size_t block_len) {
    const size_t ahead = std::max(block_len, PREFETCH_AHEAD / sizeof(T));  // elements
    prefetch_ahead(x, tile_len, ahead * sizeof(T));
    if constexpr (EF) prefetch_ahead(res, tile_len, ahead * sizeof(float));
}

// this thread's non-temporal stores ordered before its later stores (and so
// visible to the threads that synchronise with it afterwards)
inline void stream_fence() {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

// The float32 values p of one tile: float(x) (+ residual for error feedback).
// Returns x itself for float32 input without residual (no copy).
template <class E, bool EF>
inline const float* load_tile(const typename E::T* x, const float* res, float* buf, size_t len) {
    if constexpr (std::is_same_v<E, F32> && !EF) {
        (void)res;
        (void)buf;
        (void)len;
        return x;
    } else if constexpr (std::is_same_v<E, F32>) {
        for (size_t i = 0; i < len; ++i) buf[i] = x[i] + res[i];
        return buf;
    } else {
        E::to_float(x, buf, len);
        if constexpr (EF)
            for (size_t i = 0; i < len; ++i) buf[i] = buf[i] + res[i];
        return buf;
    }
}

// max over the tile of the bits of |p|: an integer max (|x| bits are ordered
// like |x|); >= 0x7F800000 exactly when the tile holds an Inf or NaN. MIN: the
// smallest bits of |p| folded into *mn in the same pass (the fp8 codec's test for
// subnormal codes reads it; a min beside the max costs nothing while the pass
// waits on memory).
template <bool MIN = false>
inline uint32_t absmax_bits(const float* p, size_t len, uint32_t* mn = nullptr) {
    uint32_t m = 0, lo = MIN ? *mn : 0u;
    for (size_t i = 0; i < len; ++i) {
        const uint32_t b = f32_bits(p[i]) & 0x7FFFFFFFu;
        m = b > m ? b : m;
        if constexpr (MIN) lo = b < lo ? b : lo;
    }
    if constexpr (MIN) *mn = lo;
    return m;
}

// std::rint for |y| < 2**22 in the default rounding mode: adding 1.5 * 2**23
// leaves no fraction bits, so the addition itself rounds y to the nearest
// integer, ties to even, and the subtraction is exact. Plain float arithmetic
// vectorises with SSE2; std::rint needs SSE4.1's roundps, which a portable
// build does not have (it then calls rint once per element). Only the sign of
// a zero result differs from std::rint (+0 for -0.5 <= y <= -0), which no
// caller can see: both convert to the integer 0 and v - rint(v) keeps its sign.
// With SSE4.1 (the avx2 / avx512 variants) rint itself is one instruction
// (roundps), one fewer than the addition and subtraction; it differs from the
// above only in the sign of a zero result.
inline float rint_small(float y) {
#if defined(GC_HAS_SSE41)
    return __builtin_rintf(y);
#else
    constexpr float k = 12582912.0f;  // 1.5 * 2**23
    return (y + k) - k;
#endif
}

// ------------------------------------------------------------- integer codes

// uniform [0, 1) of element idx of the stream `key` (reference.uniform_key)
inline float uniform24(uint32_t idx, uint32_t key) {
    return static_cast<float>(static_cast<int32_t>(mix32(idx ^ key) >> 8)) * 0x1p-24f;
}

// floor(v) for |v| < 2**22, clamped to [-Q, Q]: rint(v) - (rint(v) > v), the
// comparison made on the sign of the exact difference (integer-only selects,
// which vectorise without -fno-trapping-math)
template <int Q>
inline int32_t floor_clamped(float v) {
    const float rv = rint_small(v);
    const int32_t c = static_cast<int32_t>(rv) - (int32_t(f32_bits(rv - v)) > 0);
    return c < -Q ? -Q : (c > Q ? Q : c);
}

// Whether the int2 (Q = 1) nearest codes may skip the division: rint(p / m)
// is +-1 exactly when |p| > m / 2 (m / 2 exact). If |p| <= m / 2, the rounded
// quotient is at most 0.5, a tie to even: 0. If |p| > m / 2, then |p| is at
// least m / 2 + ulp(m / 2) > m (0.5 + 2**-25), so the quotient rounds above
// 0.5. Both steps hold for normal m / 2; m >= 2**-100 keeps well clear.
template <int Q>
inline bool int2_by_compare(float m) {
    return Q == 1 && m >= 0x1p-100f;
}

// codes rint((p / m) * Q) (nearest) or floor((p / m) * Q + u) clamped to
// [-Q, Q] (stochastic, u of element first + i): the reference's operations in
// its order (a division, then a product). |p| <= m, so nearest needs no clamp.
// EF: also the error-feedback residual res = p - code * s, in the same loop.
template <int Q, bool STOCH, bool EF>
inline void int_codes(const float* __restrict p, size_t len, float m, float s, uint32_t first, uint32_t key,
                      int8_t* __restrict c, float* __restrict res) {
    uint32_t i = 0;
#if defined(GC_HAS_AVX512)
    // nearest: 16 lanes per step with the conversion's own round-to-nearest-even
    // (the same integer as rint for |y| <= Q, whatever MXCSR says) and one
    // narrowing to bytes; the compiler's loop takes rint, a truncating
    // conversion and two narrowing steps for the same codes
    if constexpr (!STOCH) {
        const __m512 vm = _mm512_set1_ps(m), vq = _mm512_set1_ps(float(Q)), vs = _mm512_set1_ps(s);
        if (int2_by_compare<Q>(m)) {  // +-1 where |p| > m / 2, else 0
            const __m512 half = _mm512_set1_ps(m * 0.5f), abs = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
            const __m512i one = _mm512_set1_epi32(1);
            for (; i + 16 <= uint32_t(len); i += 16) {
                const __m512 pv = _mm512_loadu_ps(p + i);
                const __m512i ci = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(_mm512_and_ps(pv, abs), half, _CMP_GT_OQ),
                                                          _mm512_or_si512(_mm512_srai_epi32(_mm512_castps_si512(pv), 31), one));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm512_cvtepi32_epi8(ci));
                if constexpr (EF) _mm512_storeu_ps(res + i, _mm512_sub_ps(pv, _mm512_mul_ps(_mm512_cvtepi32_ps(ci), vs)));
            }
        }
        for (; i + 16 <= uint32_t(len); i += 16) {
            const __m512 pv = _mm512_loadu_ps(p + i);
            const __m512i ci =
                _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_div_ps(pv, vm), vq), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm512_cvtepi32_epi8(ci));
            if constexpr (EF) _mm512_storeu_ps(res + i, _mm512_sub_ps(pv, _mm512_mul_ps(_mm512_cvtepi32_ps(ci), vs)));
        }
    }
#elif defined(GC_HAS_AVX2)
    // nearest, 32 lanes per step: roundps to nearest even (not MXCSR's mode), an
    // exact truncating conversion, two in-lane packs to bytes, the dwords back in order
    if constexpr (!STOCH) {
        const __m256 vm = _mm256_set1_ps(m), vq = _mm256_set1_ps(float(Q)), vs = _mm256_set1_ps(s);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256 half = _mm256_set1_ps(m * 0.5f);
        const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        const __m256i one = _mm256_set1_epi32(1);
        const bool compare = int2_by_compare<Q>(m);
        for (; i + 32 <= uint32_t(len); i += 32) {
            __m256i ci[4];
            for (int k = 0; k < 4; ++k) {
                const __m256 pv = _mm256_loadu_ps(p + i + 8 * k);
                if (compare) {  // +-1 where |p| > m / 2 (an all-ones compare), else 0
                    const __m256 nz = _mm256_cmp_ps(_mm256_and_ps(pv, abs), half, _CMP_GT_OQ);
                    ci[k] = _mm256_and_si256(_mm256_castps_si256(nz),
                                             _mm256_or_si256(_mm256_srai_epi32(_mm256_castps_si256(pv), 31), one));
                } else {
                    ci[k] = _mm256_cvttps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_div_ps(pv, vm), vq),
                                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                }
                if constexpr (EF)  // the integer code as a float (a rounded -0 would leave -0 - -0 = +0 for p = -0)
                    _mm256_storeu_ps(res + i + 8 * k, _mm256_sub_ps(pv, _mm256_mul_ps(_mm256_cvtepi32_ps(ci[k]), vs)));
            }
            const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(ci[0], ci[1]), _mm256_packs_epi32(ci[2], ci[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i), _mm256_permutevar8x32_epi32(w, order));
        }
    }
#endif
    for (; i < uint32_t(len); ++i) {
        const float y = (p[i] / m) * float(Q);
        int32_t ci;
        if constexpr (STOCH)
            ci = floor_clamped<Q>(y + uniform24(first + i, key));
        else
            ci = static_cast<int32_t>(rint_small(y));
        c[i] = int8_t(ci);
        if constexpr (EF) res[i] = p[i] - static_cast<float>(ci) * s;
    }
}

// p = acc + code * scale over one tile (dequantize_int8_add's addition; a
// plain addition when the scale is finite, as then no product is NaN), then
// p / d when DIV (float32 division, as torch's div_ by a scalar; for a power
// of two d the product by 1 / d, which is exact and rounds the same way).
template <bool DIV>
inline void sum_tile(const float* a, const int8_t* c, float s, float d, float* p, size_t len) {
    const bool pow2 = DIV && (f32_bits(d) & 0x7FFFFFu) == 0;
    const float inv = 1.0f / d;
    if ((f32_bits(s) & 0x7F800000u) != 0x7F800000u) {
        if (!DIV)
            for (size_t i = 0; i < len; ++i) p[i] = a[i] + static_cast<float>(c[i]) * s;
        else if (pow2)
            for (size_t i = 0; i < len; ++i) p[i] = (a[i] + static_cast<float>(c[i]) * s) * inv;
        else
            for (size_t i = 0; i < len; ++i) p[i] = (a[i] + static_cast<float>(c[i]) * s) / d;
        return;
    }
    for (size_t i = 0; i < len; ++i) {
        const float v = add_like_torch(a[i], static_cast<float>(c[i]) * s);
        p[i] = DIV ? v / d : v;
    }
}

}  // namespace
}  // namespace blockwise
}  // namespace gradcomp
