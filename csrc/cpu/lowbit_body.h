// Body of the sub-byte and fp8 block codecs' kernels, compiled once per
// instruction set into namespace GC_ISA_NS (see quantize_body.h).
//
// The sub-byte and fp8 block codecs: packed int4/int2 codes (symmetric absmax,
// as int8), scaled sign (EF-SignSGD, Karimireddy et al. 2019) and blockwise-
// scaled fp8 (e4m3fn, e5m2). Numerics are gradcomp/kernels/reference_lowbit.py's,
// bit for bit: one float32 scale per block, a non-finite block gets scale NaN
// (0x7FC00000) and codes 0, a zero block scale 0 and codes 0.
//
// One driver runs every codec: per block (blocks spread over OpenMP threads),
// pass 1 reads the block in tiles of at most 256 elements for its absmax (and,
// for sign, the sum of |x| in the reference's order), pass 2 writes the codes
// (and the error-feedback residual) tile by tile. Blocks hold a multiple of 32
// elements, so every block starts on a byte of the packed codes and no two
// threads write one byte.
#include "blockwise.h"
#include "kernels.h"

#include <cmath>
#include <limits>

namespace gradcomp {
namespace GC_ISA_NS {

namespace {

using namespace blockwise;

// ------------------------------------------------------------------ packing

// c: `len` codes in [-8, 7] (bits 4) or [-2, 1] (bits 2); out: ceil(len * BITS / 8)
// bytes. Whole bytes by straight-line shifts (loops compilers vectorise), then
// the last, partial byte with zeros in its unused bits.
template <int BITS>
inline void pack_tile(const int8_t* __restrict c, size_t len, uint8_t* __restrict out) {
    constexpr size_t PER = 8 / BITS;
    const size_t whole = len / PER;
    const uint8_t* u = reinterpret_cast<const uint8_t*>(c);
    // the codes of one output byte read as one little-endian word, their fields
    // moved together by shifts of the whole word (no byte shuffles)
#if defined(__BYTE_ORDER__)
    static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "pack_tile reads codes as little-endian words");
#endif
    if constexpr (BITS == 4) {
        for (size_t j = 0; j < whole; ++j) {
            uint16_t w;
            std::memcpy(&w, u + 2 * j, 2);
            w = uint16_t(w & 0x0F0Fu);
            out[j] = uint8_t(w | (w >> 4));
        }
    } else {
        for (size_t j = 0; j < whole; ++j) {
            uint32_t w;
            std::memcpy(&w, u + 4 * j, 4);
            w &= 0x03030303u;
            w |= w >> 6;
            out[j] = uint8_t(w | (w >> 12));
        }
    }
    if (whole * PER < len) {
        uint32_t b = 0;
        for (size_t k = 0; whole * PER + k < len; ++k) b |= (uint32_t(u[whole * PER + k]) & ((1u << BITS) - 1u)) << (k * BITS);
        out[whole] = uint8_t(b);
    }
}

// the first `len` signed codes of `in` (two's complement fields of BITS bits):
// each field shifted to the top of a byte, then arithmetically back (sign extension)
template <int BITS>
inline void unpack_tile(const uint8_t* in, size_t len, int8_t* c) {
    constexpr size_t PER = 8 / BITS;
    const size_t whole = len / PER;
    if constexpr (BITS == 4) {
        for (size_t j = 0; j < whole; ++j) {
            c[2 * j] = int8_t(int8_t(in[j] << 4) >> 4);
            c[2 * j + 1] = int8_t(int8_t(in[j]) >> 4);
        }
    } else {
        for (size_t j = 0; j < whole; ++j) {
            c[4 * j] = int8_t(int8_t(in[j] << 6) >> 6);
            c[4 * j + 1] = int8_t(int8_t(in[j] << 4) >> 6);
            c[4 * j + 2] = int8_t(int8_t(in[j] << 2) >> 6);
            c[4 * j + 3] = int8_t(int8_t(in[j]) >> 6);
        }
    }
    for (size_t i = whole * PER; i < len; ++i)
        c[i] = int8_t(int8_t(in[i / PER] << (8 - BITS - (i % PER) * BITS)) >> (8 - BITS));
}

// sign bits of `len` floats (1 where p < 0; -0.0 is not), 8 to a byte, bit k
// for element 8j + k; the last byte's unused bits are 0
inline void sign_bits(const float* p, size_t len, uint8_t* out) {
    size_t j = 0;
#if defined(GC_HAS_AVX512)
    const __m512 z16 = _mm512_setzero_ps();  // 16 bits (two bytes) per compare
    for (; 8 * j + 16 <= len; j += 2) {
        const uint16_t k = uint16_t(_mm512_cmp_ps_mask(_mm512_loadu_ps(p + 8 * j), z16, _CMP_LT_OQ));
        std::memcpy(out + j, &k, 2);
    }
#elif defined(GC_HAS_AVX2)
    const __m256 z8 = _mm256_setzero_ps();  // one byte per compare
    for (; 8 * j + 8 <= len; ++j)
        out[j] = uint8_t(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + 8 * j), z8, _CMP_LT_OQ)));
#endif
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
    const __m128 zero = _mm_setzero_ps();  // SSE: every x86-64 has it
    for (; 8 * j + 8 <= len; ++j) {
        const int lo = _mm_movemask_ps(_mm_cmplt_ps(_mm_loadu_ps(p + 8 * j), zero));
        const int hi = _mm_movemask_ps(_mm_cmplt_ps(_mm_loadu_ps(p + 8 * j + 4), zero));
        out[j] = uint8_t(lo | (hi << 4));
    }
#endif
    for (; 8 * j < len; ++j) {
        uint32_t b = 0;
        for (size_t k = 0; k < 8 && 8 * j + k < len; ++k) b |= uint32_t(p[8 * j + k] < 0.0f) << k;
        out[j] = uint8_t(b);
    }
}

// ------------------------------------------------------------------- fp8

template <Fp8 F>
struct Fp8Traits;
template <>
struct Fp8Traits<Fp8::E4M3> {
    static constexpr float MAX = 448.0f;
    static constexpr uint32_t NORMAL_MIN = 121u << 23, DENORM = 141u << 23, SHIFT = 20;
    static constexpr uint32_t BIAS = uint32_t(7 - 127) << 23;
};
template <>
struct Fp8Traits<Fp8::E5M2> {
    static constexpr float MAX = 57344.0f;
    static constexpr uint32_t NORMAL_MIN = 113u << 23, DENORM = 134u << 23, SHIFT = 21;
    static constexpr uint32_t BIAS = uint32_t(15 - 127) << 23;
};

// float32 -> fp8 bits, round half to even, for |f| <= the format's largest finite
// value (PyTorch's c10 conversion on that range: below the smallest normal the
// addition of a power of two rounds the mantissa, above it an integer bias does).
// Branch-free (both results, then a select on a mask) so that loops vectorise;
// |f| < 2**31 as bits, so the comparison may be signed (AVX2 has no unsigned one).
template <Fp8 F>
inline uint8_t to_fp8(float f) {
    using T = Fp8Traits<F>;
    uint32_t b = f32_bits(f);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    const uint32_t sub = f32_bits(bits_f32(b) + bits_f32(T::DENORM)) - T::DENORM;
    const uint32_t nrm = (b + T::BIAS + ((1u << (T::SHIFT - 1)) - 1u) + ((b >> T::SHIFT) & 1u)) >> T::SHIFT;
    const uint32_t small = 0u - uint32_t(int32_t(b) < int32_t(T::NORMAL_MIN));  // all ones below the normals
    // the code moved to the top byte and back: the final shift reads the upper
    // bits, so the compiler keeps the select in 32-bit lanes (narrowing each
    // operand to bytes first costs more shuffles than it saves)
    return uint8_t(((((sub & small) | (nrm & ~small)) << 24) | sign) >> 24);
}

// fp8 bits -> float32, exactly, branch-free: a normal code's exponent rebiased
// and mantissa moved up, a subnormal's mantissa times its power of two; the
// format's NaN / Inf codes (which the wire parser never lets through) give NaN / Inf
template <Fp8 F>
inline float fp8_value(uint32_t c) {
    constexpr bool E4 = F == Fp8::E4M3;
    constexpr uint32_t MB = E4 ? 3u : 2u, REBIAS = E4 ? 120u : 112u;
    constexpr float SUB = E4 ? 0x1p-9f : 0x1p-16f;
    const uint32_t e = (c & 0x7Fu) >> MB, m = c & ((1u << MB) - 1u);
    const uint32_t normal = ((e + REBIAS) << 23) | (m << (23 - MB));
    const uint32_t sub = f32_bits(static_cast<float>(static_cast<int32_t>(m)) * SUB);
    const uint32_t zero_e = 0u - uint32_t(e == 0);
    uint32_t v = (sub & zero_e) | (normal & ~zero_e);
    const uint32_t special = E4 ? 0u - uint32_t((c & 0x7Fu) == 0x7Fu) : 0u - uint32_t(e == 31u);
    const uint32_t nan_inf = (E4 || m) ? 0x7FC00000u : 0x7F800000u;
    v = (nan_inf & special) | (v & ~special);
    return bits_f32(v | ((c & 0x80u) << 24));
}

#if defined(GC_HAS_AVX512)
// to_fp8 of 16 lanes, each code in its lane's low byte: the same operations,
// the select by a mask register and the sign merged by one ternary-logic step
// (the compiler's loop narrows the operands and takes several more shuffles)
template <Fp8 F>
inline __m512i to_fp8_x16(__m512 f) {
    using T = Fp8Traits<F>;
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i b = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i denorm = _mm512_set1_epi32(int32_t(T::DENORM));
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(b), _mm512_castsi512_ps(denorm))), denorm);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, T::SHIFT), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_set1_epi32(int32_t(T::BIAS + ((1u << (T::SHIFT - 1)) - 1u)));
    const __m512i nrm = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, bias), lsb), T::SHIFT);
    const __mmask16 small = _mm512_cmplt_epi32_mask(b, _mm512_set1_epi32(int32_t(T::NORMAL_MIN)));
    const __m512i code = _mm512_mask_blend_epi32(small, nrm, sub);
    // code | ((bits >> 24) & 0x80): ternary logic A | (B & C)
    return _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80), 0xF8);
}

// to_fp8_x16 where every lane is at least the smallest normal: the normal
// rounding on the signed bits (the bias takes no borrow from the sign, which
// lands on bit 31 - SHIFT), then the sign moved to bit 7 by one bitwise select
template <Fp8 F>
inline __m512i to_fp8_normal_x16(__m512 f) {
    using T = Fp8Traits<F>;
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, T::SHIFT), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_set1_epi32(int32_t(T::BIAS + ((1u << (T::SHIFT - 1)) - 1u)));
    const __m512i t = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, bias), lsb), T::SHIFT);
    // bits 0-6 of t (the code), bit 7 of t >> (24 - SHIFT) (the sign): C ? A : B
    return _mm512_ternarylogic_epi32(t, _mm512_srli_epi32(t, 24 - T::SHIFT), _mm512_set1_epi32(0x7F), 0xE4);
}

#endif

#if defined(GC_HAS_AVX2)
// to_fp8_normal_x16's rounding on 8 lanes, the sign left where it lands: the
// code in bits 0-6, the sign at bit 31 - SHIFT (fp8_merge_sign_x16 moves it).
// The round-to-even bit is subtracted as a compare's all-ones (-1 where the
// code's lowest bit is set) rather than shifted down and added.
template <Fp8 F>
inline __m256i fp8_normal_unmerged_x8(__m256 f) {
    using T = Fp8Traits<F>;
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i lsb_bit = _mm256_set1_epi32(int32_t(1u << T::SHIFT));
    const __m256i odd = _mm256_cmpeq_epi32(_mm256_and_si256(bits, lsb_bit), lsb_bit);  // -1 where the lsb is set
    const __m256i bias = _mm256_set1_epi32(int32_t(T::BIAS + ((1u << (T::SHIFT - 1)) - 1u)));
    return _mm256_srli_epi32(_mm256_sub_epi32(_mm256_add_epi32(bits, bias), odd), T::SHIFT);
}

// 16 lanes of fp8_normal_unmerged_x8 packed to 16 bits: a negative lane (above
// 0x7F) loses 2**(31 - SHIFT) and gains 0x80, so the sign lands on bit 7
template <Fp8 F>
inline __m256i fp8_merge_sign_x16(__m256i t) {
    constexpr int32_t SIGN = int32_t(1u << (31 - Fp8Traits<F>::SHIFT));
    const __m256i neg = _mm256_cmpgt_epi16(t, _mm256_set1_epi16(0x7F));
    return _mm256_sub_epi16(t, _mm256_and_si256(neg, _mm256_set1_epi16(int16_t(SIGN - 0x80))));
}

#endif

// fp8 codes of p * (max / m) over one tile (|p * (max / m)| <= max rounded up
// by at most one ulp, which to_fp8 rounds to max), or of (p / m) * max where
// max / m overflows (m below max / FLT_MAX); mn: the bits of the smallest |p|
// of the tile or of a range that holds it (the block)
template <Fp8 F>
inline void fp8_codes(const float* __restrict p, size_t len, float m, uint32_t mn, uint8_t* __restrict o) {
    const float inv = Fp8Traits<F>::MAX / m;
    if (!(inv <= std::numeric_limits<float>::max())) {
        for (size_t i = 0; i < len; ++i) o[i] = to_fp8<F>((p[i] / m) * Fp8Traits<F>::MAX);
        return;
    }
    size_t i = 0;
#if defined(GC_HAS_AVX2)
    // every lane normal when the smallest is (|p| * inv rounds monotonically): no
    // subnormal path, no select (typical gradients: no zeros, min |p| / m well
    // above 2**-6 / 448)
    const bool all_normal = bits_f32(mn) * inv >= bits_f32(Fp8Traits<F>::NORMAL_MIN);
#else
    (void)mn;
#endif
#if defined(GC_HAS_AVX512)
    const __m512 vinv = _mm512_set1_ps(inv);
    if (all_normal) {
        for (; i + 16 <= len; i += 16) {
            const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(p + i), vinv);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), _mm512_cvtepi32_epi8(to_fp8_normal_x16<F>(y)));
        }
    }
    for (; i + 16 <= len; i += 16) {
        const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(p + i), vinv);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), _mm512_cvtepi32_epi8(to_fp8_x16<F>(y)));
    }
#elif defined(GC_HAS_AVX2)
    // the all-normal path only; 32 codes per step: two in-lane packs to bytes,
    // then the dwords back in order
    if (all_normal) {
        const __m256 vinv = _mm256_set1_ps(inv);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (; i + 32 <= len; i += 32) {
            __m256i c[4];
            for (int k = 0; k < 4; ++k)
                c[k] = fp8_normal_unmerged_x8<F>(_mm256_mul_ps(_mm256_loadu_ps(p + i + 8 * k), vinv));
            const __m256i lo = fp8_merge_sign_x16<F>(_mm256_packus_epi32(c[0], c[1]));
            const __m256i hi = fp8_merge_sign_x16<F>(_mm256_packus_epi32(c[2], c[3]));
            const __m256i w = _mm256_packus_epi16(lo, hi);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm256_permutevar8x32_epi32(w, order));
        }
    }
#endif
    for (; i < len; ++i) o[i] = to_fp8<F>(p[i] * inv);
}

// ------------------------------------------------------------------ codecs
// Each codec: scale(m, sum, len) of a live block, codes(p, len, m, s, mn, first,
// key, o, res) of one tile starting at element `first` of the tensor, its
// nbytes(len) bytes written to o (the codes' byte byte_of(first), or a buffer).
// SUM: the block's sum of |p| is computed for scale; MIN: mn is the bits of the
// block's smallest |p| (otherwise 0).

template <int BITS, bool STOCH>
struct PackedCodec {
    static constexpr bool SUM = false, MIN = false;
    static constexpr int32_t Q = (1 << (BITS - 1)) - 1;
    static constexpr size_t byte_of(size_t i) { return i * BITS / 8; }
    static constexpr size_t nbytes(size_t len) { return (len * BITS + 7) / 8; }
    static float scale(float m, float, size_t) { return m / float(Q); }
    template <bool EF>
    static void codes(const float* p, size_t len, float m, float s, uint32_t, size_t first, uint32_t key,
                      uint8_t* o, float* res) {
        alignas(64) int8_t c[TILE];
        // the element index mod 2**32, as the reference
        int_codes<Q, STOCH, EF>(p, len, m, s, uint32_t(first), key, c, res);
        pack_tile<BITS>(c, len, o);
    }
};

struct SignCodec {
    static constexpr bool SUM = true, MIN = false;
    static constexpr size_t byte_of(size_t i) { return i / 8; }
    static constexpr size_t nbytes(size_t len) { return (len + 7) / 8; }
    static float scale(float m, float sum, size_t len) { return std::min(sum / float(len), m); }
    template <bool EF>
    static void codes(const float* p, size_t len, float, float s, uint32_t, size_t, uint32_t, uint8_t* o,
                      float* res) {
        sign_bits(p, len, o);
        if constexpr (EF)
            for (size_t i = 0; i < len; ++i) res[i] = p[i] - (p[i] < 0.0f ? -s : s);
    }
};

template <Fp8 F>
struct Fp8Codec {
    static constexpr bool SUM = false, MIN = true;
    static constexpr size_t byte_of(size_t i) { return i; }
    static constexpr size_t nbytes(size_t len) { return len; }
    static float scale(float m, float, size_t) { return m / Fp8Traits<F>::MAX; }
    template <bool EF>
    static void codes(const float* p, size_t len, float m, float s, uint32_t mn, size_t, uint32_t, uint8_t* o,
                      float* res) {
        fp8_codes<F>(p, len, m, mn, o);
        if constexpr (EF)
            for (size_t i = 0; i < len; ++i) res[i] = p[i] - fp8_value<F>(o[i]) * s;
    }
};

// Sum of |p| over one tile of `width` elements (len of them given, the rest
// zero) by halving, as reference_lowbit.block_abs_sum: the first halving reads
// p directly, the others work in place on half a tile
inline float fold_abs(const float* p, size_t len, size_t width) {
    static_assert(TILE == 256, "the register folds below halve 16 vectors of 16 (or 2 x 16 of 8)");
#if defined(GC_HAS_AVX512)
    if (len == TILE && width == TILE) {  // the common case, in registers: the same pairs, the same order
        const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF);
        __m512 v[16];
        for (int k = 0; k < 16; ++k) v[k] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p + 16 * k), abs));
        for (int h = 8; h > 0; h /= 2)  // element i + 16 h joins element i
            for (int k = 0; k < h; ++k) v[k] = _mm512_add_ps(v[k], v[k + h]);
        __m256 y = _mm256_add_ps(_mm512_castps512_ps256(v[0]), _mm512_extractf32x8_ps(v[0], 1));  // i + 8
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));           // i + 4
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));                                                   // i + 2
        x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));                                               // i + 1
        return _mm_cvtss_f32(x);
    }
#elif defined(GC_HAS_AVX2)
    if (len == TILE && width == TILE) {  // as above, in 8-lane registers
        const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 v[16];
        for (int k = 0; k < 16; ++k)  // element i + 128 joins element i
            v[k] = _mm256_add_ps(_mm256_and_ps(_mm256_loadu_ps(p + 8 * k), abs),
                                 _mm256_and_ps(_mm256_loadu_ps(p + 128 + 8 * k), abs));
        for (int h = 8; h > 0; h /= 2)  // element i + 8 h joins element i
            for (int k = 0; k < h; ++k) v[k] = _mm256_add_ps(v[k], v[k + h]);
        __m128 x = _mm_add_ps(_mm256_castps256_ps128(v[0]), _mm256_extractf128_ps(v[0], 1));  // i + 4
        x = _mm_add_ps(x, _mm_movehl_ps(x, x));                                                // i + 2
        x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));                                            // i + 1
        return _mm_cvtss_f32(x);
    }
#endif
    alignas(64) float a[TILE / 2];
    size_t h = width / 2;
    if (width == 1) return bits_f32(f32_bits(p[0]) & 0x7FFFFFFFu);
    if (len == width) {
        for (size_t i = 0; i < h; ++i)
            a[i] = bits_f32(f32_bits(p[i]) & 0x7FFFFFFFu) + bits_f32(f32_bits(p[i + h]) & 0x7FFFFFFFu);
    } else {
        for (size_t i = 0; i < h; ++i) {
            const float lo = i < len ? bits_f32(f32_bits(p[i]) & 0x7FFFFFFFu) : 0.0f;
            a[i] = lo + (i + h < len ? bits_f32(f32_bits(p[i + h]) & 0x7FFFFFFFu) : 0.0f);
        }
    }
    for (h /= 2; h > 0; h /= 2)
        for (size_t i = 0; i < h; ++i) a[i] = a[i] + a[i + h];
    return a[0];
}

// ------------------------------------------------------------------ driver

template <class E, bool EF, class C>
void quantize_blocks(const typename E::T* x, float* res, size_t n, size_t block, uint32_t key, uint8_t* codes,
                     float* scales) {
    const size_t nb = (n + block - 1) / block;
    const size_t tile = std::min(block, TILE);
    const int nt = n >= PAR_MIN ? max_threads() : 1;
    const bool ahead = streams_codes(n, block);  // beyond the caches, in whole tiles
    const bool stream = C::nbytes(TILE) % 64 == 0 && ahead;  // codes in whole lines
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
    for (size_t b = 0; b < nb; ++b) {
        alignas(64) float buf[TILE];
        alignas(64) uint8_t cbuf[TILE];  // a tile's codes, when they are streamed out
        const size_t lo = b * block, len = std::min(block, n - lo);
        uint32_t mx = 0, mn = C::MIN ? 0x7FFFFFFFu : 0u;
        float sum = 0.0f;
        const float* last = nullptr;  // the loaded tile: reused below when it is the whole block
        for (size_t t = 0; t < len; t += tile) {
            const size_t tl = std::min(tile, len - t);
            last = load_tile<E, EF>(x + lo + t, EF ? res + lo + t : nullptr, buf, tl);
            mx = std::max(mx, tl == TILE ? absmax_bits<C::MIN>(last, TILE, &mn) : absmax_bits<C::MIN>(last, tl, &mn));
            if constexpr (C::SUM) {
                const float f = fold_abs(last, tl, tile);
                sum = t == 0 ? f : sum + f;
            }
        }
        if (mx >= 0x7F800000u || mx == 0) {  // non-finite block or all zeros: codes 0
            scales[b] = mx ? bits_f32(NAN_BITS) : 0.0f;
            std::memset(codes + C::byte_of(lo), 0, C::nbytes(len));
            if constexpr (EF) {  // residual p - 0 * scale: NaN (0x7FC00000), or p itself (+-0)
                for (size_t t = 0; t < len; t += tile) {
                    const size_t tl = std::min(tile, len - t);
                    float* r = res + lo + t;
                    if (mx) {
                        for (size_t i = 0; i < tl; ++i) r[i] = bits_f32(NAN_BITS);
                    } else {
                        const float* p = len <= tile ? last : load_tile<E, EF>(x + lo + t, r, buf, tl);
                        std::memcpy(r, p, tl * sizeof(float));
                    }
                }
            }
            continue;
        }
        const float m = bits_f32(mx);
        const float s = C::scale(m, sum, len);
        scales[b] = s;
        // beyond the caches: a later block's lines arrive while these codes are computed
        // (a block of several tiles: the same tile of a later block, tile by tile)
        const bool multi = len > tile;
        if (ahead && !multi) prefetch_block<EF>(x + lo, EF ? res + lo : nullptr, len);
        for (size_t t = 0; t < len; t += tile) {
            const size_t tl = std::min(tile, len - t);
            if (ahead && multi) prefetch_tile_of_next_block<EF>(x + lo + t, EF ? res + lo + t : nullptr, tl, len);
            const float* p = len <= tile ? last : load_tile<E, EF>(x + lo + t, EF ? res + lo + t : nullptr, buf, tl);
            float* r = EF ? res + lo + t : nullptr;
            uint8_t* o = stream ? cbuf : codes + C::byte_of(lo + t);
            if (tl == TILE)  // the common case: a constant length, loops without remainders
                C::template codes<EF>(p, TILE, m, s, mn, lo + t, key, o, r);
            else
                C::template codes<EF>(p, tl, m, s, mn, lo + t, key, o, r);
            if (stream) stream_bytes(codes + C::byte_of(lo + t), cbuf, C::nbytes(tl));
        }
    }
    if (stream) stream_fence();
    }
}

template <class C>
void quantize_typed(DType dt, const void* x, float* res, size_t n, size_t block, uint32_t key, uint8_t* codes,
                    float* scales) {
    if (block == 0) throw std::invalid_argument("block_size must be positive");
    if (n == 0) return;
    switch (dt) {
#define GC_CASE(D, E)                                                                                    \
    case DType::D:                                                                                       \
        if (res) return quantize_blocks<E, true, C>(static_cast<const E::T*>(x), res, n, block, key, codes, scales); \
        return quantize_blocks<E, false, C>(static_cast<const E::T*>(x), res, n, block, key, codes, scales);
        GC_CASE(F32, F32)
        GC_CASE(F16, F16)
        GC_CASE(BF16, BF16)
        GC_CASE(F64, F64)
#undef GC_CASE
    }
}

// Decoding: out[i] = value(code) * scale, or acc[i] + that product (rounded first).
template <class Values>
void decode_blocks(const uint8_t* codes, const float* scales, size_t n, size_t block, float* out, bool add) {
    const size_t nb = (n + block - 1) / block;
    const size_t tile = std::min(block, TILE);
    const int nt = n >= PAR_MIN ? max_threads() : 1;
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (size_t b = 0; b < nb; ++b) {
        alignas(64) float v[TILE];
        const size_t lo = b * block, len = std::min(block, n - lo);
        const float s = scales[b];
        for (size_t t = 0; t < len; t += tile) {
            const size_t tl = std::min(tile, len - t);
            float* o = out + lo + t;
            if (add) {
                Values::decode(codes, lo + t, tl, s, v);
                for (size_t i = 0; i < tl; ++i) o[i] = add_like_torch(o[i], v[i]);
            } else {
                Values::decode(codes, lo + t, tl, s, o);
            }
        }
    }
}

template <int BITS>
struct PackedValues {
    static void decode(const uint8_t* codes, size_t first, size_t len, float s, float* v) {
        // 32 bits of codes at a time: field k shifted to the top of the word, then
        // arithmetically back (sign extension); the same shifts for every word vectorise
        constexpr uint32_t PER_WORD = 32 / BITS;
        const uint8_t* in = codes + first * BITS / 8;
        const size_t words = len / PER_WORD;
        for (size_t j = 0; j < words; ++j) {
            uint32_t w;
            std::memcpy(&w, in + 4 * j, 4);
            for (uint32_t k = 0; k < PER_WORD; ++k)
                v[PER_WORD * j + k] = static_cast<float>(int32_t(w << (32 - BITS - BITS * k)) >> (32 - BITS)) * s;
        }
        alignas(64) int8_t c[TILE];
        const size_t done = words * PER_WORD;
        unpack_tile<BITS>(in + done * BITS / 8, len - done, c);
        for (size_t i = done; i < len; ++i) v[i] = static_cast<float>(c[i - done]) * s;
    }
};

struct SignValues {
    static void decode(const uint8_t* codes, size_t first, size_t len, float s, float* v) {
        // -s is s with its sign bit flipped: XOR each element's bit into bit 31
        const uint8_t* c = codes + first / 8;
        const uint32_t sb = f32_bits(s);
        const size_t whole = len / 8;
        for (size_t j = 0; j < whole; ++j) {
            const uint32_t b = c[j];
            for (uint32_t k = 0; k < 8; ++k) v[8 * j + k] = bits_f32(sb ^ (((b >> k) & 1u) << 31));
        }
        for (size_t i = 8 * whole; i < len; ++i) v[i] = bits_f32(sb ^ (((uint32_t(c[i / 8]) >> (i % 8)) & 1u) << 31));
    }
};

template <Fp8 F>
struct Fp8Values {
    static void decode(const uint8_t* codes, size_t first, size_t len, float s, float* v) {
        for (size_t i = 0; i < len; ++i) v[i] = fp8_value<F>(codes[first + i]) * s;
    }
};

// reduce_quantize_packed: as reduce_quantize_int8 (quantize.cpp), with packed codes in and out
template <int BITS, bool STOCH, bool DIV>
void reduce_packed_impl(float* acc, const uint8_t* cin, const float* sin, size_t n, size_t block, float d,
                        uint32_t key, uint8_t* codes, float* scales, bool decode) {
    using C = PackedCodec<BITS, STOCH>;
    const size_t nb = (n + block - 1) / block;
    const size_t tile = std::min(block, TILE);
    const int nt = n >= PAR_MIN ? max_threads() : 1;
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (size_t b = 0; b < nb; ++b) {
        alignas(64) float buf[TILE];
        alignas(64) int8_t c[TILE];
        const size_t lo = b * block, len = std::min(block, n - lo);
        const bool whole = len <= tile;  // the block's sum fits in buf
        float* a = acc + lo;
        uint32_t mx = 0;
        for (size_t t = 0; t < len; t += tile) {
            const size_t tl = std::min(tile, len - t);
            unpack_tile<BITS>(cin + (lo + t) * BITS / 8, tl, c);
            sum_tile<DIV>(a + t, c, sin[b], d, buf, tl);
            if (!whole) std::memcpy(a + t, buf, tl * sizeof(float));
            mx = std::max(mx, absmax_bits(buf, tl));
        }
        if (mx >= 0x7F800000u || mx == 0) {
            scales[b] = mx ? bits_f32(NAN_BITS) : 0.0f;
            std::memset(codes + C::byte_of(lo), 0, C::nbytes(len));
            if (decode) {
                const float z = mx ? bits_f32(NAN_BITS) : 0.0f;
                for (size_t i = 0; i < len; ++i) a[i] = z;
            } else if (whole) {
                std::memcpy(a, buf, len * sizeof(float));
            }
            continue;
        }
        const float m = bits_f32(mx), s = C::scale(m, 0.0f, len);
        scales[b] = s;
        for (size_t t = 0; t < len; t += tile) {
            const size_t tl = std::min(tile, len - t);
            const float* p = whole ? buf : a + t;
            C::template codes<false>(p, tl, m, s, 0u, lo + t, key, codes + C::byte_of(lo + t), nullptr);
            if (decode) {
                PackedValues<BITS>::decode(codes, lo + t, tl, s, a + t);
            } else if (whole) {
                std::memcpy(a + t, p, tl * sizeof(float));
            }
        }
    }
}

void check_bits(int bits) {
    if (bits != 4 && bits != 2) throw std::invalid_argument("bits must be 4 or 2, got " + std::to_string(bits));
}

}  // namespace

void quantize_packed(DType dt, const void* x, float* residual, size_t n, size_t block, int bits, bool stochastic,
                     uint32_t key, uint8_t* codes, float* scales) {
    check_bits(bits);
    if (bits == 4) {
        if (stochastic) return quantize_typed<PackedCodec<4, true>>(dt, x, residual, n, block, key, codes, scales);
        return quantize_typed<PackedCodec<4, false>>(dt, x, residual, n, block, key, codes, scales);
    }
    if (stochastic) return quantize_typed<PackedCodec<2, true>>(dt, x, residual, n, block, key, codes, scales);
    return quantize_typed<PackedCodec<2, false>>(dt, x, residual, n, block, key, codes, scales);
}

void dequantize_packed(const uint8_t* codes, const float* scales, size_t n, size_t block, int bits, float* out,
                       bool add) {
    check_bits(bits);
    if (block == 0) throw std::invalid_argument("block_size must be positive");
    if (n == 0) return;
    if (bits == 4) return decode_blocks<PackedValues<4>>(codes, scales, n, block, out, add);
    return decode_blocks<PackedValues<2>>(codes, scales, n, block, out, add);
}

void reduce_quantize_packed(float* acc, const uint8_t* codes_in, const float* scales_in, size_t n, size_t block,
                            int bits, float divisor, bool stochastic, uint32_t key, uint8_t* codes, float* scales,
                            bool decode) {
    check_bits(bits);
    if (block == 0) throw std::invalid_argument("block_size must be positive");
    if (n == 0) return;
    const bool div = divisor != 1.0f;
#define GC_REDUCE(B, S, D) reduce_packed_impl<B, S, D>(acc, codes_in, scales_in, n, block, divisor, key, codes, scales, decode)
    if (bits == 4) {
        if (stochastic) return div ? GC_REDUCE(4, true, true) : GC_REDUCE(4, true, false);
        return div ? GC_REDUCE(4, false, true) : GC_REDUCE(4, false, false);
    }
    if (stochastic) return div ? GC_REDUCE(2, true, true) : GC_REDUCE(2, true, false);
    return div ? GC_REDUCE(2, false, true) : GC_REDUCE(2, false, false);
#undef GC_REDUCE
}

void quantize_sign(DType dt, const void* x, float* residual, size_t n, size_t block, uint8_t* codes,
                   float* scales) {
    quantize_typed<SignCodec>(dt, x, residual, n, block, 0, codes, scales);
}

void dequantize_sign(const uint8_t* codes, const float* scales, size_t n, size_t block, float* out, bool add) {
    if (block == 0) throw std::invalid_argument("block_size must be positive");
    if (n == 0) return;
    decode_blocks<SignValues>(codes, scales, n, block, out, add);
}

void quantize_fp8(DType dt, const void* x, float* residual, size_t n, size_t block, Fp8 fmt, uint8_t* codes,
                  float* scales) {
    if (fmt == Fp8::E4M3) return quantize_typed<Fp8Codec<Fp8::E4M3>>(dt, x, residual, n, block, 0, codes, scales);
    quantize_typed<Fp8Codec<Fp8::E5M2>>(dt, x, residual, n, block, 0, codes, scales);
}

void dequantize_fp8(const uint8_t* codes, const float* scales, size_t n, size_t block, Fp8 fmt, float* out,
                    bool add) {
    if (block == 0) throw std::invalid_argument("block_size must be positive");
    if (n == 0) return;
    if (fmt == Fp8::E4M3) return decode_blocks<Fp8Values<Fp8::E4M3>>(codes, scales, n, block, out, add);
    decode_blocks<Fp8Values<Fp8::E5M2>>(codes, scales, n, block, out, add);
}

}  // namespace GC_ISA_NS
}  // namespace gradcomp
