// Elias-Fano coding of sparse payload indices (gradcomp/index_codec.py holds
// the format and the pure-PyTorch version of both directions) and the Deep
// Gradient Compression accumulation pass.
//
// Layout: k fields of L low bits, LSB first, in ceil(k L / 8) bytes; then the
// high-bit vector of k + ((n - 1) >> L) bits with bit (idx[i] >> L) + i set.
// Encoding is one sequential pass over the indices; decoding walks the set
// bits of the high vector 64 at a time and validates as it goes.
#include "kernels.h"

namespace gradcomp {

namespace {

template <class I>
bool ef_encode_impl(const I* idx, size_t k, int L, uint8_t* lo, uint8_t* hi, size_t hi_nbytes) {
    const uint64_t mask = L ? (uint64_t(1) << L) - 1 : 0;
    uint64_t acc = 0;  // low-bit writer: pending bits, LSB first
    int pending = 0;
    size_t out = 0;
    for (size_t i = 0; i < k; ++i) {
        const uint64_t x = uint64_t(idx[i]);
        if (L) {
            const uint64_t low = x & mask;
            acc |= low << pending;
            const int room = 64 - pending;
            pending += L;
            if (pending >= 64) {
                std::memcpy(lo + out, &acc, 8);
                out += 8;
                pending -= 64;
                acc = room < 64 ? low >> room : 0;
            }
        }
        const uint64_t p = (x >> L) + i;
        if (idx[i] < 0 || (i && idx[i] <= idx[i - 1]) || (p >> 3) >= hi_nbytes) return false;
        hi[p >> 3] |= uint8_t(1u << (p & 7));
    }
    for (; pending > 0; pending -= 8, acc >>= 8) lo[out++] = uint8_t(acc);
    return true;
}

template <class I>
int ef_decode_impl(const uint8_t* lo, size_t lo_nbytes, const uint8_t* hi, size_t hi_nbytes, uint64_t n,
                   size_t k, int L, I* out) {
    const uint64_t mask = L ? (uint64_t(1) << L) - 1 : 0;
    uint64_t lacc = 0;  // low-bit reader
    int lbits = 0;
    size_t lpos = 0;
    size_t i = 0;
    uint64_t prev = 0;
    for (size_t b = 0; b < hi_nbytes; b += 8) {
        uint64_t w = 0;
        std::memcpy(&w, hi + b, std::min<size_t>(8, hi_nbytes - b));
        while (w) {
            if (i == k) return EF_COUNT;
            const uint64_t pos = 8 * uint64_t(b) + uint64_t(ctz64(w));
            w &= w - 1;
            uint64_t low = 0;
            if (L) {
                while (lbits < L) {  // refill a byte at a time (the section is ceil(k L / 8) bytes)
                    lacc |= uint64_t(lo[lpos++]) << lbits;
                    lbits += 8;
                }
                low = lacc & mask;
                lacc = L < 64 ? lacc >> L : 0;
                lbits -= L;
            }
            const uint64_t x = ((pos - i) << L) | low;
            if (x >= n) return EF_RANGE;
            if (i && x <= prev) return EF_ORDER;
            out[i++] = I(x);
            prev = x;
        }
    }
    (void)lo_nbytes;
    return i == k ? EF_OK : EF_COUNT;
}

}  // namespace

bool ef_encode(const void* idx, bool idx64, size_t k, int L, uint8_t* lo, uint8_t* hi, size_t hi_nbytes) {
    if (idx64) return ef_encode_impl(static_cast<const int64_t*>(idx), k, L, lo, hi, hi_nbytes);
    return ef_encode_impl(static_cast<const int32_t*>(idx), k, L, lo, hi, hi_nbytes);
}

int ef_decode(const uint8_t* lo, size_t lo_nbytes, const uint8_t* hi, size_t hi_nbytes, uint64_t n, size_t k,
              int L, void* out, bool out64) {
    if (out64) return ef_decode_impl(lo, lo_nbytes, hi, hi_nbytes, n, k, L, static_cast<int64_t*>(out));
    return ef_decode_impl(lo, lo_nbytes, hi, hi_nbytes, n, k, L, static_cast<int32_t*>(out));
}

void dgc_accumulate_range(const float* g, float* u, float* v, size_t lo, size_t hi, float momentum,
                          float scale) {
    if (scale == 1.0f) dgc_range<false>(g, u, v, lo, hi, momentum, scale);
    else dgc_range<true>(g, u, v, lo, hi, momentum, scale);
}

void dgc_accumulate(const float* g, float* u, float* v, size_t n, float momentum, float scale) {
    const int nchunks = chunks_for(n);
    (void)nchunks;
#pragma omp parallel for schedule(static) num_threads(nchunks) if (nchunks > 1)
    for (int c = 0; c < nchunks; ++c)
        dgc_accumulate_range(g, u, v, chunk_begin(n, nchunks, c), chunk_begin(n, nchunks, c + 1), momentum, scale);
}

}  // namespace gradcomp
