// Body of the int8 kernels, compiled once per instruction set into namespace
// GC_ISA_NS (isa_baseline.cpp, isa_avx2.cpp, isa_avx512.cpp; isa.cpp picks one).
//
// Blockwise absmax int8 quantization, dequantization and the fused
// error-feedback variant (Dettmers et al. 2022, "8-bit Optimizers via
// Block-wise Quantization"; error feedback: Seide et al. 2014). Numerics are
// those of gradcomp/kernels/reference.py, bit for bit:
//   m = max |x| per block; non-finite block -> scale NaN (0x7FC00000), codes 0;
//   m == 0 -> scale 0, codes 0; else y = (x / m) * 127 (two rounded float32
//   operations; built with -ffp-contract=off so nothing is fused), code =
//   rint(y) or floor(y + u), clamped to [-127, 127]; scale = m / 127.
//
// Each block is read twice (absmax, then codes) in tiles of at most 256
// elements, so the second read hits L1; blocks are spread over OpenMP threads.
#include "kernels.h"
#include "blockwise.h"

#include <atomic>
#include <cmath>
#include <type_traits>

#include <cstring>

namespace gradcomp {
namespace GC_ISA_NS {

namespace {

using namespace blockwise;

// float32 outputs of at least this many elements (8 MiB, beyond the caches)
// are written with non-temporal stores: no read-for-ownership of lines that
// are only overwritten, about a third less memory traffic for dequantize.
constexpr size_t STREAM_MIN = size_t(1) << 21;

// Whether a block's scale is out of range (negative or infinite; NaN marks a
// non-finite block and is valid) or its codes hold -128 (outside [-127, 127]);
// the block is about to be read anyway, so this costs no extra memory pass.
inline bool bad_block(const int8_t* c, size_t len, float scale) {
    if (scale < 0.0f || scale == INFINITY) return true;
    uint8_t hit = 0;
    for (size_t i = 0; i < len; ++i) hit |= static_cast<uint8_t>(c[i] == -128);
    return hit != 0;
}

// Shared by the code-reading loops: skip the rest once a bad block was seen.
struct Int8Check {
    bool on;
    std::atomic<bool> bad{false};
    explicit Int8Check(bool enabled) : on(enabled) {}
    // true when the block (codes [c, c + len), its scale) must not be processed
    bool stop(const int8_t* c, size_t len, float scale) {
        if (!on) return false;
        if (bad.load(std::memory_order_relaxed)) return true;
        if (bad_block(c, len, scale)) {
            bad.store(true, std::memory_order_relaxed);
            return true;
        }
        return false;
    }
    bool ok() const { return !bad.load(); }
};

template <class E, bool EF, bool STOCH>
void quantize_impl(const typename E::T* x, float* res, size_t n, size_t block, uint32_t key,
                   int8_t* q, float* scales) {
    const size_t nb = (n + block - 1) / block;
    const size_t tile = std::min(block, TILE);
    const int nt = n >= PAR_MIN ? max_threads() : 1;
    const bool stream = streams_codes(n, block);
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
    for (size_t b = 0; b < nb; ++b) {
        alignas(64) float buf[TILE];
        alignas(64) int8_t cbuf[TILE];  // a tile's codes, when they are streamed out
        const size_t lo = b * block, len = std::min(block, n - lo);
        uint32_t mx = 0;
        const float* last = nullptr;  // the loaded tile: reused below when it is the whole block
        for (size_t t = 0; t < len; t += tile) {
            const size_t tl = std::min(tile, len - t);
            last = load_tile<E, EF>(x + lo + t, EF ? res + lo + t : nullptr, buf, tl);
            mx = std::max(mx, tl == TILE ? absmax_bits(last, TILE) : absmax_bits(last, tl));
        }
        if (mx >= 0x7F800000u || mx == 0) {  // non-finite block or all zeros
            scales[b] = mx ? bits_f32(NAN_BITS) : 0.0f;
            std::memset(q + lo, 0, len);
            if constexpr (EF) {
                // residual = p - 0 * scale: p itself (+-0) in a zero block; in a
                // non-finite block the NaN of the product, 0x7FC00000 (PyTorch's
                // subtraction returns its second operand when both are NaN).
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
        const float s = m / 127.0f;
        scales[b] = s;
        // beyond the caches: a later block's lines arrive while these codes are computed
        // (a block of several tiles: the same tile of a later block, tile by tile)
        const bool multi = len > tile;
        if (stream && !multi) prefetch_block<EF>(x + lo, EF ? res + lo : nullptr, len);
        for (size_t t = 0; t < len; t += tile) {
            const size_t tl = std::min(tile, len - t);
            if (stream && multi) prefetch_tile_of_next_block<EF>(x + lo + t, EF ? res + lo + t : nullptr, tl, len);
            const float* p =
                len <= tile ? last : load_tile<E, EF>(x + lo + t, EF ? res + lo + t : nullptr, buf, tl);
            float* r = EF ? res + lo + t : nullptr;
            int8_t* c = stream ? cbuf : q + lo + t;
            if (tl == TILE)  // the common case: a constant length, loops without remainders
                int_codes<127, STOCH, EF>(p, TILE, m, s, uint32_t(lo + t), key, c, r);
            else
                int_codes<127, STOCH, EF>(p, tl, m, s, uint32_t(lo + t), key, c, r);
            if (stream)
                stream_bytes(reinterpret_cast<uint8_t*>(q + lo + t), reinterpret_cast<const uint8_t*>(cbuf), tl);
        }
    }
    if (stream) stream_fence();
    }
}

template <class E>
void quantize_dispatch(const void* x, float* res, size_t n, size_t block, bool stochastic,
                       uint32_t key, int8_t* q, float* scales) {
    const auto* xt = static_cast<const typename E::T*>(x);
    if (res) {
        if (stochastic) quantize_impl<E, true, true>(xt, res, n, block, key, q, scales);
        else quantize_impl<E, true, false>(xt, res, n, block, key, q, scales);
    } else {
        if (stochastic) quantize_impl<E, false, true>(xt, res, n, block, key, q, scales);
        else quantize_impl<E, false, false>(xt, res, n, block, key, q, scales);
    }
}

// o[i] = float(c[i]) * s with non-temporal stores where o is aligned (the
// same float32 products as the plain loop; plain stores at the edges). Only
// built with AVX2 or SSE4.1 (sign-extending int8 loads); otherwise plain.
inline void scale_stream(const int8_t* c, float s, float* o, size_t len) {
    size_t i = 0;
#if defined(GC_HAS_AVX2)
    for (; i < len && (reinterpret_cast<uintptr_t>(o + i) & 31u) != 0; ++i)
        o[i] = static_cast<float>(c[i]) * s;
    const __m256 vs = _mm256_set1_ps(s);
    for (; i + 8 <= len; i += 8) {
        const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + i));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8));
        _mm256_stream_ps(o + i, _mm256_mul_ps(v, vs));
    }
#elif defined(GC_HAS_SSE41)
    for (; i < len && (reinterpret_cast<uintptr_t>(o + i) & 15u) != 0; ++i)
        o[i] = static_cast<float>(c[i]) * s;
    const __m128 vs = _mm_set1_ps(s);
    for (; i + 4 <= len; i += 4) {
        int32_t word;
        std::memcpy(&word, c + i, 4);
        const __m128 v = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(word)));
        _mm_stream_ps(o + i, _mm_mul_ps(v, vs));
    }
#endif
    for (; i < len; ++i) o[i] = static_cast<float>(c[i]) * s;
}

template <class O>
bool dequantize_impl(const int8_t* q, const float* scales, size_t n, size_t block, typename O::T* out,
                     bool check_int8) {
    Int8Check check(check_int8);
    const size_t nb = (n + block - 1) / block;
    const size_t tile = std::min(block, TILE);
    const int nt = n >= PAR_MIN ? max_threads() : 1;
    const bool stream = std::is_same_v<O, F32> && n >= STREAM_MIN;
    (void)nt;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (size_t b = 0; b < nb; ++b) {
            alignas(64) float buf[TILE];
            const size_t lo = b * block, len = std::min(block, n - lo);
            if (check.stop(q + lo, len, scales[b])) continue;
            const float s = scales[b];
            for (size_t t = 0; t < len; t += tile) {
                const size_t tl = std::min(tile, len - t);
                const int8_t* c = q + lo + t;
                if constexpr (std::is_same_v<O, F32>) {
                    float* o = out + lo + t;
                    if (stream) {
                        scale_stream(c, s, o, tl);
                    } else {
                        for (size_t i = 0; i < tl; ++i) o[i] = static_cast<float>(c[i]) * s;
                    }
                } else {
                    for (size_t i = 0; i < tl; ++i) buf[i] = static_cast<float>(c[i]) * s;
                    O::from_float(buf, out + lo + t, tl);
                }
            }
        }
        if (stream) stream_fence();  // this thread's non-temporal stores are visible before the join
    }
    return check.ok();
}

// reduce_quantize_int8: each block is summed into a stack tile (or, for blocks
// longer than a tile, back into acc, which the second loop then reads), its
// absmax taken, its codes written, and acc overwritten with the decoded codes
// (or the sum) while the block is still in L1.
template <bool STOCH, bool DIV>
bool reduce_quantize_impl(float* acc, const int8_t* qin, const float* sin, size_t n, size_t block,
                          float d, uint32_t key, int8_t* q, float* scales, bool decode, bool check_int8) {
    Int8Check check(check_int8);
    const size_t nb = (n + block - 1) / block;
    const size_t tile = std::min(block, TILE);
    const int nt = n >= PAR_MIN ? max_threads() : 1;
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (size_t b = 0; b < nb; ++b) {
        alignas(64) float buf[TILE];
        const size_t lo = b * block, len = std::min(block, n - lo);
        if (check.stop(qin + lo, len, sin[b])) continue;
        const bool whole = len <= tile;  // the block's sum fits in buf
        float* a = acc + lo;
        const float s_in = sin[b];
        uint32_t mx = 0;
        for (size_t t = 0; t < len; t += tile) {
            const size_t tl = std::min(tile, len - t);
            sum_tile<DIV>(a + t, qin + lo + t, s_in, d, buf, tl);
            if (!whole) std::memcpy(a + t, buf, tl * sizeof(float));
            mx = std::max(mx, absmax_bits(buf, tl));
        }
        if (mx >= 0x7F800000u || mx == 0) {  // non-finite block or all zeros: codes 0
            scales[b] = mx ? bits_f32(NAN_BITS) : 0.0f;
            std::memset(q + lo, 0, len);
            if (decode) {  // 0 * scale: NaN (0x7FC00000) or +0
                const float z = mx ? bits_f32(NAN_BITS) : 0.0f;
                for (size_t i = 0; i < len; ++i) a[i] = z;
            } else if (whole) {
                std::memcpy(a, buf, len * sizeof(float));
            }
            continue;
        }
        const float m = bits_f32(mx);
        const float s = m / 127.0f;
        scales[b] = s;
        for (size_t t = 0; t < len; t += tile) {
            const size_t tl = std::min(tile, len - t);
            const float* p = whole ? buf : a + t;
            int8_t* c = q + lo + t;
            int_codes<127, STOCH, false>(p, tl, m, s, uint32_t(lo + t), key, c, nullptr);
            if (decode) {
                for (size_t i = 0; i < tl; ++i) a[t + i] = static_cast<float>(c[i]) * s;
            } else if (whole) {
                std::memcpy(a + t, p, tl * sizeof(float));
            }
        }
    }
    return check.ok();
}

}  // namespace

bool reduce_quantize_int8(float* acc, const int8_t* q_in, const float* scales_in, size_t n, size_t block,
                          float divisor, bool stochastic, uint32_t key, int8_t* q, float* scales,
                          bool decode, bool check_int8) {
    if (block == 0) throw std::invalid_argument("block_size must be positive");
    if (n == 0) return true;
    const bool div = divisor != 1.0f;
    const bool c = check_int8;
    if (stochastic) {
        if (div) return reduce_quantize_impl<true, true>(acc, q_in, scales_in, n, block, divisor, key, q, scales, decode, c);
        return reduce_quantize_impl<true, false>(acc, q_in, scales_in, n, block, divisor, key, q, scales, decode, c);
    } else {
        if (div) return reduce_quantize_impl<false, true>(acc, q_in, scales_in, n, block, divisor, key, q, scales, decode, c);
        return reduce_quantize_impl<false, false>(acc, q_in, scales_in, n, block, divisor, key, q, scales, decode, c);
    }
}

void quantize_int8(DType dt, const void* x, float* residual, size_t n, size_t block,
                   bool stochastic, uint32_t key, int8_t* q, float* scales) {
    if (block == 0) throw std::invalid_argument("block_size must be positive");
    if (n == 0) return;
    switch (dt) {
        case DType::F32: return quantize_dispatch<F32>(x, residual, n, block, stochastic, key, q, scales);
        case DType::F16: return quantize_dispatch<F16>(x, residual, n, block, stochastic, key, q, scales);
        case DType::BF16: return quantize_dispatch<BF16>(x, residual, n, block, stochastic, key, q, scales);
        case DType::F64: return quantize_dispatch<F64>(x, residual, n, block, stochastic, key, q, scales);
    }
}

bool dequantize_int8(const int8_t* q, const float* scales, size_t n, size_t block, DType out_dt,
                     void* out, bool check_int8) {
    if (block == 0) throw std::invalid_argument("block_size must be positive");
    if (n == 0) return true;
    const bool c = check_int8;
    switch (out_dt) {
        case DType::F32: return dequantize_impl<F32>(q, scales, n, block, static_cast<float*>(out), c);
        case DType::F16: return dequantize_impl<F16>(q, scales, n, block, static_cast<uint16_t*>(out), c);
        case DType::BF16: return dequantize_impl<BF16>(q, scales, n, block, static_cast<uint16_t*>(out), c);
        case DType::F64: return dequantize_impl<F64>(q, scales, n, block, static_cast<double*>(out), c);
    }
    return true;
}

bool dequantize_int8_add(float* acc, const int8_t* q, const float* scales, size_t n, size_t block,
                         bool check_int8) {
    if (block == 0) throw std::invalid_argument("block_size must be positive");
    if (n == 0) return true;
    Int8Check check(check_int8);
    const size_t nb = (n + block - 1) / block;
    const int nt = n >= PAR_MIN ? max_threads() : 1;
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (size_t b = 0; b < nb; ++b) {
        const size_t lo = b * block, len = std::min(block, n - lo);
        if (check.stop(q + lo, len, scales[b])) continue;
        const float s = scales[b];
        float* a = acc + lo;
        const int8_t* c = q + lo;
        for (size_t i = 0; i < len; ++i) a[i] = add_like_torch(a[i], static_cast<float>(c[i]) * s);
    }
    return check.ok();
}

}  // namespace GC_ISA_NS
}  // namespace gradcomp
