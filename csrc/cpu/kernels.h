// Kernel entry points of gradcomp._C (raw pointers, no Python). Every
// function here may be called with the GIL released; none throws from inside
// a parallel region (arguments are checked before any work starts).
#pragma once

#include "common.h"

namespace gradcomp {

enum class DType { F32, F16, BF16, F64 };

// Parses "float32" | "float16" | "bfloat16" | "float64"; throws
// std::invalid_argument naming `arg` otherwise.
DType parse_dtype(const std::string& s, const char* arg);
size_t dtype_size(DType d);
const char* dtype_name(DType d);

// Blockwise absmax int8 quantization (reference.quantize_int8). x: n elements
// of `dt`; q: n int8; scales: ceil(n / block) float32. With residual != null
// this is the fused error-feedback variant (reference.quantize_int8_ef):
// p = float(x) + residual; quantize p; residual <- p - code * scale.
void quantize_int8(DType dt, const void* x, float* residual, size_t n, size_t block,
                   bool stochastic, uint32_t key, int8_t* q, float* scales);

// The ops below read int8 codes and scales from payloads. With check_int8
// they also check, block by block before writing it, that no code is -128
// (outside the format's [-127, 127]) and that the scale is >= 0 and finite, or
// NaN; a bad block is not processed, any other block may or may not have been
// (threads stop at their next block), and the op returns false. Without it
// they return true and read every value as it is.

// out[i] = code * scale, rounded to float32, then converted to `out_dt`.
bool dequantize_int8(const int8_t* q, const float* scales, size_t n, size_t block, DType out_dt,
                     void* out, bool check_int8);

// acc[i] = acc[i] + (code * scale), the product rounded first.
bool dequantize_int8_add(float* acc, const int8_t* q, const float* scales, size_t n, size_t block,
                         bool check_int8);

// One reduce step of a compressed collective, fused in one pass per block:
// p = acc + code_in * scale_in (as dequantize_int8_add), p = p / divisor when
// divisor != 1 (a float32 division); (q, scales) = quantize_int8(p) with
// `block` (the input codes use the same block size); then acc <- q * scale
// when `decode`, else acc <- p. Bit for bit the composition of those ops.
bool reduce_quantize_int8(float* acc, const int8_t* q_in, const float* scales_in, size_t n, size_t block,
                          float divisor, bool stochastic, uint32_t key, int8_t* q, float* scales,
                          bool decode, bool check_int8);

// The sub-byte and fp8 block codecs (gradcomp/kernels/reference_lowbit.py; lowbit.cpp).
// Codes are bytes: `bits`-bit two's complement fields packed 8 / bits to a byte
// (ceil(n * bits / 8) bytes), sign bits 8 to a byte (ceil(n / 8)), one fp8 bit
// pattern per element (n). residual != null: fused error feedback, as
// quantize_int8. The decoders write out[i] = value * scale (float32), or with
// `add` acc[i] + that product (rounded first). Codes are read as they are: the
// wire parser validates payloads before any of these run.
enum class Fp8 { E4M3, E5M2 };
void quantize_packed(DType dt, const void* x, float* residual, size_t n, size_t block, int bits, bool stochastic,
                     uint32_t key, uint8_t* codes, float* scales);
void dequantize_packed(const uint8_t* codes, const float* scales, size_t n, size_t block, int bits, float* out,
                       bool add);
// As reduce_quantize_int8, with packed codes in and out (bits 4 or 2).
void reduce_quantize_packed(float* acc, const uint8_t* codes_in, const float* scales_in, size_t n, size_t block,
                            int bits, float divisor, bool stochastic, uint32_t key, uint8_t* codes, float* scales,
                            bool decode);
void quantize_sign(DType dt, const void* x, float* residual, size_t n, size_t block, uint8_t* codes,
                   float* scales);
void dequantize_sign(const uint8_t* codes, const float* scales, size_t n, size_t block, float* out, bool add);
void quantize_fp8(DType dt, const void* x, float* residual, size_t n, size_t block, Fp8 fmt, uint8_t* codes,
                  float* scales);
void dequantize_fp8(const uint8_t* codes, const float* scales, size_t n, size_t block, Fp8 fmt, float* out,
                    bool add);

// Selections: ascending indices (int64 when n >= 2**31, else int32) and values.
Selection topk(DType dt, const void* x, size_t n, size_t k);
Selection threshold(DType dt, const void* x, size_t n, double tau);
Selection approx_topk(DType dt, const void* x, size_t n, size_t k, size_t sample, size_t sample_k,
                      size_t lo, size_t hi);

// acc[indices[j]] += float(values[j]) for j = 0 .. m-1 in order; throws
// std::invalid_argument (before writing anything) if an index is outside [0, n).
void scatter_add(float* acc, size_t n, const void* indices, bool idx64, size_t m, DType vdt,
                 const void* values);

// Elias-Fano indices (gradcomp/index_codec.py): k ascending indices, L low
// bits each. ef_encode writes the low fields into lo (ceil(k L / 8) bytes) and
// ORs the high bits into hi (hi_nbytes bytes, zeroed by the caller); it
// returns false, at the first offending index, for indices that are negative,
// not strictly ascending or too large for hi. ef_decode writes k
// indices and returns EF_OK, or the first problem found: more or fewer set
// high bits than k, an index >= n, or indices not strictly ascending.
enum { EF_OK = 0, EF_COUNT = 1, EF_RANGE = 2, EF_ORDER = 3 };
bool ef_encode(const void* idx, bool idx64, size_t k, int L, uint8_t* lo, uint8_t* hi, size_t hi_nbytes);
int ef_decode(const uint8_t* lo, size_t lo_nbytes, const uint8_t* hi, size_t hi_nbytes, uint64_t n, size_t k,
              int L, void* out, bool out64);

// Deep Gradient Compression's momentum correction (Lin et al. 2018), one pass:
// u <- u * momentum + g * scale (each product rounded to float32, then the
// sum; g * 1 is exact), v <- v + u.
void dgc_accumulate(const float* g, float* u, float* v, size_t n, float momentum, float scale);

// The same on elements [lo, hi), one thread.
template <bool Scaled>
inline void dgc_range(const float* __restrict g, float* __restrict u, float* __restrict v, size_t lo, size_t hi,
                      float momentum, float scale) {
    for (size_t i = lo; i < hi; ++i) {
        const float ui = u[i] * momentum + (Scaled ? g[i] * scale : g[i]);
        u[i] = ui;
        v[i] = v[i] + ui;
    }
}
void dgc_accumulate_range(const float* g, float* u, float* v, size_t lo, size_t hi, float momentum, float scale);

// dgc_accumulate followed by topk(F32, v, n, k), fused: the top-k's
// compaction pass runs inside the accumulation pass. Same results bit for bit.
Selection dgc_topk(const float* g, float* u, float* v, size_t n, float momentum, float scale, size_t k);

}  // namespace gradcomp
