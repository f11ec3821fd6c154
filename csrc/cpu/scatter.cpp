// scatter_add: acc[indices[j]] += float(values[j]), j in order (duplicates
// accumulate in that order, as torch.Tensor.index_add_ does on the CPU).
//
// Every index is checked first (in parallel); an index outside [0, n) raises
// std::invalid_argument before anything is written. The accumulation itself
// is sequential: duplicate indices make a parallel version either racy or
// order-changing, and the loop is bound by random memory access anyway.
#include "kernels.h"

#include <type_traits>

namespace gradcomp {

namespace {

constexpr size_t TILE = 256;

template <class Idx>
void check_indices(const Idx* idx, size_t m, size_t n) {
    const int nt = m >= (size_t(1) << 16) ? max_threads() : 1;
    (void)nt;
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1) reduction(| : bad)
    for (size_t j = 0; j < m; ++j) bad |= int(idx[j] < 0) | int(uint64_t(idx[j]) >= n);
    if (!bad) return;
    for (size_t j = 0; j < m; ++j) {
        if (idx[j] < 0 || uint64_t(idx[j]) >= n)
            throw std::invalid_argument("indices[" + std::to_string(j) + "] = " + std::to_string(idx[j]) +
                                        " is out of bounds for acc with " + std::to_string(n) +
                                        " elements");
    }
}

template <class Idx, class E>
void scatter_impl(float* acc, size_t n, const Idx* idx, size_t m, const typename E::T* vals) {
    check_indices(idx, m, n);
    alignas(64) float buf[TILE];
    for (size_t t = 0; t < m; t += TILE) {
        const size_t tl = std::min(TILE, m - t);
        const float* v;
        if constexpr (std::is_same_v<E, F32>) {
            v = vals + t;
        } else {
            E::to_float(vals + t, buf, tl);
            v = buf;
        }
        const Idx* ix = idx + t;
        for (size_t j = 0; j < tl; ++j) acc[ix[j]] = add_like_torch(acc[ix[j]], v[j]);
    }
}

template <class Idx>
void scatter_dispatch(float* acc, size_t n, const Idx* idx, size_t m, DType vdt, const void* v) {
    switch (vdt) {
        case DType::F32: return scatter_impl<Idx, F32>(acc, n, idx, m, static_cast<const float*>(v));
        case DType::F16: return scatter_impl<Idx, F16>(acc, n, idx, m, static_cast<const uint16_t*>(v));
        case DType::BF16: return scatter_impl<Idx, BF16>(acc, n, idx, m, static_cast<const uint16_t*>(v));
        case DType::F64: return scatter_impl<Idx, F64>(acc, n, idx, m, static_cast<const double*>(v));
    }
}

}  // namespace

void scatter_add(float* acc, size_t n, const void* indices, bool idx64, size_t m, DType vdt,
                 const void* values) {
    if (m == 0) return;
    if (idx64) scatter_dispatch(acc, n, static_cast<const int64_t*>(indices), m, vdt, values);
    else scatter_dispatch(acc, n, static_cast<const int32_t*>(indices), m, vdt, values);
}

}  // namespace gradcomp
