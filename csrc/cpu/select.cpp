// Magnitude selections: exact top-k, threshold and sampled-threshold top-k.
//
// Every element is ranked by its key: the bits of |x| with NaN mapped to the
// largest key (sel_key in common.h), an unsigned integer whose order is the
// order of |x| with NaN above +Inf. All three ops reduce to "keep the elements
// whose key is >= T (plus some ties)", done by a parallel stream compaction:
// the input is split into one contiguous chunk per thread; each chunk scans
// its elements 32 at a time (a compare mask, AVX2 or SSE2 when available) and either
// writes them at an offset known in advance (exclusive prefix sum of per-chunk
// counts from a histogram) or, when the counts are not known, appends them to
// its own buffer, after which the buffers are concatenated at the prefix sum
// of their sizes. Chunks keep index order, so output indices come out ascending.
//
// * topk (exact; radix select, as in Alabi et al. 2012, "Fast k-selection
//   algorithms for graphics processing units"): a strided sample gives a
//   lower bound L of the k-th largest key (a few standard deviations of
//   margin); one compaction pass collects the keys >= L (about 1.4 k
//   elements at 1% density, 2.5 k at 0.1%). If that is at least k elements
//   -- almost always -- 8-bit MSB radix histograms over the candidates find
//   the exact k-th key K, and a last compaction over them keeps the keys > K
//   and the first (lowest-index) keys == K until k are kept. Otherwise (an
//   unlucky or adversarial sample) one histogram pass over the top 15 key
//   bits (per-chunk histograms) finds the bin holding the k-th key, one
//   compaction pass collects that bin and above, and the same radix select
//   finishes. No sort in either path.
// * threshold: the key of tau is computed once; one compaction pass keeps
//   key >= key(tau) (== |x| >= tau or NaN, compared in float32, or in float64
//   for float64 input).
// * approx_topk (Deep Gradient Compression, Lin et al. 2018): the threshold is
//   the sample_k-th largest key of the strided sample of the reference
//   (nth_element on the sample); one compaction pass keeps key >= t; the set is
//   returned if its size is in [lo, hi], its exact top k if larger, and the
//   exact topk if smaller.
// * dgc_topk: Deep Gradient Compression's momentum correction fused with the
//   topk of its result: the sample is computed from g, u and v at the sample
//   points, then one pass over blocks of 1024 elements accumulates each block
//   and runs topk's compaction scan over it while it is in L1 cache.
#include "kernels.h"

#include <cmath>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

namespace gradcomp {

namespace {

constexpr int HIST_BITS = 15;  // first radix digit: the top 15 key bits (the sign bit is 0)
constexpr size_t HIST_BINS = size_t(1) << HIST_BITS;

template <class E>
constexpr int key_bits() {
    return int(8 * sizeof(typename E::Key));
}

// Split [0, n) into one chunk per thread, each shorter than 2**31 elements so
// that uint32 counters never overflow.
inline int select_chunks(size_t n) {
    int c = chunks_for(n);
    const size_t cap = size_t(1) << 31;
    if (n / size_t(c) >= cap) c = int(n / cap + 1);
    return c;
}

// Index/value arrays of selected elements (malloc'd, handed to Python as is).
template <class I, class K>
struct Candidates {
    Buffer<unsigned char> idx, val;
    size_t count = 0, capacity = 0;
    I* indices() { return reinterpret_cast<I*>(idx.get()); }
    K* values() { return reinterpret_cast<K*>(val.get()); }
    // exactly n elements (count = n); throws std::bad_alloc
    void allocate(size_t n) {
        idx = alloc_buffer<unsigned char>(n * sizeof(I));
        val = alloc_buffer<unsigned char>(n * sizeof(K));
        count = capacity = n;
    }
    // room for `cap` elements, keeping the first `count`; false when out of
    // memory (nothing thrown: called inside parallel regions)
    bool reserve(size_t cap) {
        if (cap <= capacity) return true;
        if (!grow(idx, cap * sizeof(I)) || !grow(val, cap * sizeof(K))) return false;
        capacity = cap;
        return true;
    }
    void push(I i, K v) {
        indices()[count] = i;
        values()[count] = v;
        ++count;
    }
    Selection release() {
        Selection s;
        s.idx = std::move(idx);
        s.val = std::move(val);
        s.count = count;
        return s;
    }

   private:
    static bool grow(Buffer<unsigned char>& b, size_t bytes) {
        void* p = std::realloc(b.get(), std::max<size_t>(bytes, 1));
        if (!p) return false;
        (void)b.release();
        b.reset(static_cast<unsigned char*>(p));
        return true;
    }
};

// The predicate "key >= t" on raw element bits: with a = raw & ABS (|x| bits),
// key >= t  <=>  a >= lim, lim = min(t, INF + 1), because a NaN has a > INF
// and key ABS >= t. `a` and `lim` have a zero top bit, so signed compares work.
template <class E>
inline typename E::Key ge_limit(typename E::Key t) {
    using K = typename E::Key;
    return std::min<K>(t, K(E::INF + 1));
}

template <class E>
inline bool passes(typename E::Key raw, typename E::Key lim) {
    return typename E::Key(raw & E::ABS) >= lim;
}

// Bit j of the result is passes(x[j], lim), j < 32: compares of 8 (AVX2) or
// 4 (SSE2, every x86-64) keys at a time where the key type allows, else one by one.
template <class E>
inline uint32_t pass_mask32(const typename E::Key* x, typename E::Key lim) {
    using K = typename E::Key;
#ifdef __AVX2__
    if (lim == 0) return 0xFFFFFFFFu;
    if constexpr (sizeof(K) == 4) {
        const __m256i absm = _mm256_set1_epi32(int32_t(E::ABS)), thr = _mm256_set1_epi32(int32_t(lim - 1));
        uint32_t m = 0;
        for (int j = 0; j < 4; ++j) {
            const __m256i a = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * j)), absm);
            m |= uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(a, thr)))) << (8 * j);
        }
        return m;
    } else if constexpr (sizeof(K) == 2) {
        const __m256i absm = _mm256_set1_epi16(int16_t(E::ABS)), thr = _mm256_set1_epi16(int16_t(lim - 1));
        const __m256i a0 = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), absm);
        const __m256i a1 = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)), absm);
        const __m256i p = _mm256_packs_epi16(_mm256_cmpgt_epi16(a0, thr), _mm256_cmpgt_epi16(a1, thr));
        return uint32_t(_mm256_movemask_epi8(_mm256_permute4x64_epi64(p, 0xD8)));
    } else {
        const __m256i absm = _mm256_set1_epi64x(int64_t(E::ABS)), thr = _mm256_set1_epi64x(int64_t(lim - 1));
        uint32_t m = 0;
        for (int j = 0; j < 8; ++j) {
            const __m256i a = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 4 * j)), absm);
            m |= uint32_t(_mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpgt_epi64(a, thr)))) << (4 * j);
        }
        return m;
    }
#elif defined(__SSE2__)
    if (lim == 0) return 0xFFFFFFFFu;
    if constexpr (sizeof(K) == 4) {
        const __m128i absm = _mm_set1_epi32(int32_t(E::ABS)), thr = _mm_set1_epi32(int32_t(lim - 1));
        uint32_t m = 0;
        for (int j = 0; j < 8; ++j) {
            const __m128i a = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 4 * j)), absm);
            m |= uint32_t(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(a, thr)))) << (4 * j);
        }
        return m;
    } else if constexpr (sizeof(K) == 2) {
        const __m128i absm = _mm_set1_epi16(int16_t(E::ABS)), thr = _mm_set1_epi16(int16_t(lim - 1));
        uint32_t m = 0;
        for (int j = 0; j < 2; ++j) {
            const __m128i a0 = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16 * j)), absm);
            const __m128i a1 = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16 * j + 8)), absm);
            const __m128i p = _mm_packs_epi16(_mm_cmpgt_epi16(a0, thr), _mm_cmpgt_epi16(a1, thr));
            m |= uint32_t(_mm_movemask_epi8(p)) << (16 * j);
        }
        return m;
    }
#endif
    uint32_t m = 0;
    for (int j = 0; j < 32; ++j) m |= uint32_t(passes<E>(x[j], lim)) << j;
    return m;
}

// Calls f(i, mask) for [lo, hi) in groups of 32 elements starting at i, bit j
// of mask telling whether x[i + j] passes.
template <class E, class F>
inline void scan_pass(const typename E::Key* x, size_t lo, size_t hi, typename E::Key lim, F&& f) {
    size_t i = lo;
    for (; i + 32 <= hi; i += 32) f(i, pass_mask32<E>(x + i, lim));
    if (i < hi) {
        uint32_t m = 0;
        for (size_t j = 0; i + j < hi; ++j) m |= uint32_t(passes<E>(x[i + j], lim)) << j;
        f(i, m);
    }
}

// Write (index, value) of every key >= t, chunk c starting at offs[c] (the
// per-chunk counts are known).
template <class E, class I>
void write_ge(const typename E::Key* x, size_t n, int nchunks, typename E::Key t,
              const std::vector<size_t>& offs, I* oi, typename E::Key* ov) {
    const typename E::Key lim = ge_limit<E>(t);
#pragma omp parallel for schedule(static, 1) num_threads(nchunks) if (nchunks > 1)
    for (int c = 0; c < nchunks; ++c) {
        const size_t lo = chunk_begin(n, nchunks, c), hi = chunk_begin(n, nchunks, c + 1);
        size_t o = offs[size_t(c)];
        scan_pass<E>(x, lo, hi, lim, [&](size_t i, uint32_t m) {
            while (m) {
                const size_t j = size_t(ctz32(m));
                m &= m - 1;
                oi[o] = I(i + j);
                ov[o] = x[i + j];
                ++o;
            }
        });
    }
}

// All elements with key >= t, ascending, in one pass over x: each chunk
// appends to its own growing buffer (first sized for `expect` elements in
// all, when the caller has an estimate), then the buffers are concatenated at
// the prefix sums of their sizes. `scan(lo, hi, lim, f)` walks a chunk as
// scan_pass does (x must hold the chunk's final values before f reads them).
template <class E, class I, class Scan>
Candidates<I, typename E::Key> collect_ge_scan(const typename E::Key* x, size_t n, typename E::Key t,
                                               size_t expect, Scan&& scan) {
    using K = typename E::Key;
    const K lim = ge_limit<E>(t);
    const int nchunks = select_chunks(n);
    std::vector<Candidates<I, K>> parts(static_cast<size_t>(nchunks));
    int out_of_memory = 0;
#pragma omp parallel for schedule(static, 1) num_threads(nchunks) if (nchunks > 1) reduction(| : out_of_memory)
    for (int c = 0; c < nchunks; ++c) {
        const size_t lo = chunk_begin(n, nchunks, c), hi = chunk_begin(n, nchunks, c + 1);
        Candidates<I, K>& part = parts[size_t(c)];
        const size_t guess = size_t(double(expect) * double(hi - lo) / double(n)) + 4096;
        bool ok = part.reserve(std::min(hi - lo, guess));
        scan(lo, hi, lim, [&](size_t i, uint32_t m) {
            if (!m || !ok) return;
            const size_t need = part.count + size_t(popcount32(m));
            if (need > part.capacity) ok = part.reserve(std::min(hi - lo, std::max(need, 2 * part.capacity)));
            if (!ok) return;
            while (m) {
                const size_t j = size_t(ctz32(m));
                m &= m - 1;
                part.push(I(i + j), x[i + j]);
            }
        });
        out_of_memory |= int(!ok);
    }
    if (out_of_memory) throw std::bad_alloc();
    if (nchunks == 1) return std::move(parts[0]);
    std::vector<size_t> offs(parts.size());
    size_t total = 0;
    for (size_t c = 0; c < parts.size(); ++c) {
        offs[c] = total;
        total += parts[c].count;
    }
    Candidates<I, K> out;
    out.allocate(total);
#pragma omp parallel for schedule(static, 1) num_threads(nchunks)
    for (int c = 0; c < nchunks; ++c) {
        Candidates<I, K>& part = parts[size_t(c)];
        if (!part.count) continue;
        std::memcpy(out.indices() + offs[size_t(c)], part.indices(), part.count * sizeof(I));
        std::memcpy(out.values() + offs[size_t(c)], part.values(), part.count * sizeof(K));
    }
    return out;
}

template <class E, class I>
Candidates<I, typename E::Key> collect_ge(const typename E::Key* x, size_t n, typename E::Key t,
                                          size_t expect = 0) {
    using K = typename E::Key;
    return collect_ge_scan<E, I>(x, n, t, expect, [x](size_t lo, size_t hi, K lim, auto&& f) {
        scan_pass<E>(x, lo, hi, lim, f);
    });
}

// The k largest keys of the candidates (0 < k <= count), ties to the lower
// position, in candidate order.
template <class E, class I>
Selection finish_select(Candidates<I, typename E::Key>& cand, size_t k) {
    using K = typename E::Key;
    const size_t C = cand.count;
    if (k >= C) return cand.release();
    const K* cv = cand.values();
    const I* ci = cand.indices();

    // 8-bit MSB-first radix select of the k-th largest key K; `need` ends as
    // the number of keys equal to K to keep.
    std::vector<K> ws(C);
    for (size_t i = 0; i < C; ++i) ws[i] = sel_key<E>(cv[i]);
    size_t need = k;
    K prefix = 0;
    int shift = key_bits<E>();
    while (shift > 0) {
        const int d = std::min(8, shift);
        shift -= d;
        const K mask = K((1u << d) - 1u);
        size_t hist[256] = {0};
        for (const K key : ws) ++hist[(key >> shift) & mask];
        size_t above = 0;
        int bin = int(mask);
        for (; bin > 0; --bin) {
            if (above + hist[bin] >= need) break;
            above += hist[bin];
        }
        need -= above;
        prefix = K(prefix | (K(bin) << shift));
        const K want = K(prefix >> shift);
        size_t w = 0;
        for (const K key : ws)
            if (K(key >> shift) == want) ws[w++] = key;
        ws.resize(w);
    }
    const K kth = prefix;

    // keep key > K, and the first `need` keys == K (chunk counts + prefix sum)
    const int nchunks = select_chunks(C);
    const size_t nc = size_t(nchunks);
    std::vector<size_t> gt(nc), eq(nc);
#pragma omp parallel for schedule(static, 1) num_threads(nchunks) if (nchunks > 1)
    for (int c = 0; c < nchunks; ++c) {
        const size_t lo = chunk_begin(C, nchunks, c), hi = chunk_begin(C, nchunks, c + 1);
        size_t g = 0, e = 0;
        for (size_t i = lo; i < hi; ++i) {
            const K key = sel_key<E>(cv[i]);
            g += key > kth;
            e += key == kth;
        }
        gt[size_t(c)] = g;
        eq[size_t(c)] = e;
    }
    std::vector<size_t> offs(nc), eq_take(nc);
    size_t s = 0, left = need;
    for (size_t c = 0; c < nc; ++c) {
        eq_take[c] = std::min(eq[c], left);
        left -= eq_take[c];
        offs[c] = s;
        s += gt[c] + eq_take[c];
    }
    Candidates<I, K> out;
    out.allocate(k);
    I* oi = out.indices();
    K* ov = out.values();
#pragma omp parallel for schedule(static, 1) num_threads(nchunks) if (nchunks > 1)
    for (int c = 0; c < nchunks; ++c) {
        const size_t lo = chunk_begin(C, nchunks, c), hi = chunk_begin(C, nchunks, c + 1);
        size_t o = offs[size_t(c)], eq_left = eq_take[size_t(c)];
        for (size_t i = lo; i < hi; ++i) {
            const K key = sel_key<E>(cv[i]);
            const bool keep = key > kth || (key == kth && eq_left > 0);
            if (keep) {
                eq_left -= key == kth;
                oi[o] = ci[i];
                ov[o] = cv[i];
                ++o;
            }
        }
    }
    return out.release();
}

template <class E, class I>
Selection all_elements(const typename E::Key* x, size_t n) {
    Candidates<I, typename E::Key> out;
    out.allocate(n);
    I* oi = out.indices();
    for (size_t i = 0; i < n; ++i) oi[i] = I(i);
    if (n) std::memcpy(out.values(), x, n * sizeof(typename E::Key));
    return out.release();
}

// `size` keys key_at(j * (n / size)), j < size (0 < size <= n), read by up
// to one thread per 4096 keys.
template <class K, class KeyAt>
std::vector<K> strided_sample(size_t n, size_t size, KeyAt&& key_at) {
    std::vector<K> keys(size);
    const size_t stride = n / size;
    const int nchunks = chunks_for(size, 4096);
#pragma omp parallel for schedule(static, 1) num_threads(nchunks) if (nchunks > 1)
    for (int c = 0; c < nchunks; ++c)
        for (size_t j = chunk_begin(size, nchunks, c), e = chunk_begin(size, nchunks, c + 1); j < e; ++j)
            keys[j] = key_at(j * stride);
    return keys;
}

// Size of the strided sample whose keys bound the k-th largest key (n >= 8192).
// Each sample point is a cache miss (three for dgc_topk) that costs about as
// much as streaming 3 or 4 cache lines; 16384 points keep the sample a small
// part of the scan from n = 2**20 on, for about 1.4 k (1% density) to 2.5 k
// (0.1%) candidates.
inline size_t bound_sample_size(size_t n) { return std::min<size_t>(size_t(1) << 14, n / 4); }

// Lower bound of the k-th largest key from a strided sample of n elements:
// the r-th largest sampled key, r = expected count k * sample / n plus four
// standard deviations (binomial) plus 8 (destroys the keys' order).
template <class E>
typename E::Key lower_bound_of_sample(std::vector<typename E::Key>& keys, size_t n, size_t k) {
    using K = typename E::Key;
    const size_t sample = keys.size();
    const double expect = double(sample) * double(k) / double(n);
    const size_t r = std::min(sample, size_t(std::ceil(expect + 4.0 * std::sqrt(expect) + 8.0)));
    std::nth_element(keys.begin(), keys.begin() + std::ptrdiff_t(r - 1), keys.end(), std::greater<K>());
    return keys[r - 1];
}

// Expected number of elements >= the bound above: k scaled by the margin.
inline size_t sampled_count_estimate(size_t n, size_t k, size_t sample) {
    const double expect = double(sample) * double(k) / double(n);
    return size_t(double(k) * (expect + 4.0 * std::sqrt(expect) + 8.0) / std::max(expect, 1.0));
}

// Exact top k by one histogram pass (top 15 key bits, per-chunk histograms)
// and one compaction pass of the bin holding the k-th key and above.
template <class E, class I>
Selection topk_by_histogram(const typename E::Key* x, size_t n, size_t k) {
    using K = typename E::Key;
    constexpr int shift = key_bits<E>() - 1 - HIST_BITS;
    const int nchunks = select_chunks(n);
    std::vector<uint32_t> hist(size_t(nchunks) * HIST_BINS, 0u);
#pragma omp parallel for schedule(static, 1) num_threads(nchunks) if (nchunks > 1)
    for (int c = 0; c < nchunks; ++c) {
        const size_t lo = chunk_begin(n, nchunks, c), hi = chunk_begin(n, nchunks, c + 1);
        uint32_t* h = hist.data() + size_t(c) * HIST_BINS;
        for (size_t i = lo; i < hi; ++i) ++h[sel_key<E>(x[i]) >> shift];
    }
    std::vector<size_t> total(HIST_BINS, 0);
    for (int c = 0; c < nchunks; ++c)
        for (size_t b = 0; b < HIST_BINS; ++b) total[b] += hist[size_t(c) * HIST_BINS + b];
    size_t above = 0, bin = HIST_BINS - 1;
    for (; bin > 0; --bin) {
        if (above + total[bin] >= k) break;
        above += total[bin];
    }
    // per-chunk counts of the bins >= bin give each chunk its output offset
    std::vector<size_t> offs(static_cast<size_t>(nchunks), 0);
    size_t count = 0;
    for (int c = 0; c < nchunks; ++c) {
        offs[size_t(c)] = count;
        for (size_t b = bin; b < HIST_BINS; ++b) count += hist[size_t(c) * HIST_BINS + b];
    }
    Candidates<I, K> cand;
    cand.allocate(count);
    write_ge<E, I>(x, n, nchunks, K(K(bin) << shift), offs, cand.indices(), cand.values());
    return finish_select<E, I>(cand, k);
}

// Exact top k of x (n >= 8192, 0 < k < n) from the sampled lower bound:
// key_at(i) is the key x[i] holds when scanned, scan(lo, hi, lim, f) walks a
// chunk as scan_pass does (collect_ge_scan). If the bound misses (fewer than k
// keys >= it), the exact histogram path runs over x as the scan left it.
template <class E, class I, class KeyAt, class Scan>
Selection topk_sampled(const typename E::Key* x, size_t n, size_t k, KeyAt&& key_at, Scan&& scan) {
    using K = typename E::Key;
    const size_t sample = bound_sample_size(n);
    std::vector<K> keys = strided_sample<K>(n, sample, key_at);
    Candidates<I, K> cand =
        collect_ge_scan<E, I>(x, n, lower_bound_of_sample<E>(keys, n, k), sampled_count_estimate(n, k, sample), scan);
    if (cand.count >= k) return finish_select<E, I>(cand, k);
    return topk_by_histogram<E, I>(x, n, k);
}

template <class E, class I>
Selection topk_impl(const typename E::Key* x, size_t n, size_t k) {
    using K = typename E::Key;
    if (k == 0) return Candidates<I, K>().release();
    if (k >= n) return all_elements<E, I>(x, n);
    if (n < 8192) {  // small: every element is a candidate
        Candidates<I, K> cand = collect_ge<E, I>(x, n, K(0));
        return finish_select<E, I>(cand, k);
    }
    return topk_sampled<E, I>(x, n, k, [x](size_t i) { return sel_key<E>(x[i]); },
                              [x](size_t lo, size_t hi, K lim, auto&& f) { scan_pass<E>(x, lo, hi, lim, f); });
}

// Deep Gradient Compression's accumulation fused with the top-k of its
// result: u = u * m + g * scale, v = v + u (dgc_accumulate's arithmetic),
// then exactly topk_impl(v): the sample is computed from g, u and v at its
// positions, and the compaction pass runs inside the accumulation pass, block
// by block on the values just written.
template <class I>
Selection dgc_topk_impl(const float* g, float* u, float* v, size_t n, float m, float scale, size_t k) {
    using K = F32::Key;
    auto* vk = reinterpret_cast<const K*>(v);
    if (k == 0 || k >= n || n < 8192) {
        dgc_accumulate(g, u, v, n, m, scale);
        return topk_impl<F32, I>(vk, n, k);
    }
    auto new_key = [=](size_t i) {
        const float ui = u[i] * m + (scale == 1.0f ? g[i] : g[i] * scale);
        return sel_key<F32>(f32_bits(v[i] + ui));
    };
    auto accumulate_scan = [=](size_t lo, size_t hi, K lim, auto&& f) {
        // blocks of 1024 elements: accumulated (vectorised), then scanned while in L1
        constexpr size_t B = 1024;
        for (size_t b = lo; b < hi; b += B) {
            const size_t e = std::min(hi, b + B);
            dgc_accumulate_range(g, u, v, b, e, m, scale);
            scan_pass<F32>(vk, b, e, lim, f);
        }
    };
    return topk_sampled<F32, I>(vk, n, k, new_key, accumulate_scan);
}

template <class E>
typename E::Key threshold_key(double tau) {
    using K = typename E::Key;
    if constexpr (std::is_same_v<E, F64>) {
        return tau > 0 ? K(f64_bits(tau)) : K(0);
    } else {
        // tau rounded to float32 (nearest even; from FLT_MAX + ulp/2 up it is +Inf)
        const float t = tau >= 0x1.ffffffp+127 ? std::numeric_limits<float>::infinity()
                                               : static_cast<float>(tau);
        if (!(t > 0)) return K(0);
        if constexpr (std::is_same_v<E, F32>) {
            return K(f32_bits(t));
        } else {  // smallest 16-bit key whose float32 value is >= t (Inf always is)
            uint32_t lo = 0, hi = E::INF;
            while (lo < hi) {
                const uint32_t mid = (lo + hi) / 2;
                if (E::to_float(uint16_t(mid)) >= t) hi = mid;
                else lo = mid + 1;
            }
            return K(lo);
        }
    }
}

template <class E, class I>
Selection threshold_impl(const typename E::Key* x, size_t n, double tau) {
    return collect_ge<E, I>(x, n, threshold_key<E>(tau)).release();
}

template <class E, class I>
Selection approx_topk_impl(const typename E::Key* x, size_t n, size_t k, size_t sample,
                           size_t sample_k, size_t lo, size_t hi) {
    using K = typename E::Key;
    if (k == 0) return Candidates<I, K>().release();
    if (k >= n) return all_elements<E, I>(x, n);
    sample = std::max<size_t>(1, std::min(sample, n));
    sample_k = std::max<size_t>(1, std::min(sample_k, sample));
    std::vector<K> keys = strided_sample<K>(n, sample, [x](size_t i) { return sel_key<E>(x[i]); });
    std::nth_element(keys.begin(), keys.begin() + std::ptrdiff_t(sample_k - 1), keys.end(),
                     std::greater<K>());
    Candidates<I, K> cand = collect_ge<E, I>(x, n, keys[sample_k - 1], hi);
    if (cand.count < lo) return topk_impl<E, I>(x, n, k);  // estimate too high: exact selection
    if (cand.count <= hi) return cand.release();
    return finish_select<E, I>(cand, k);  // too many: the exact top k among them
}

template <template <class, class> class Op, class... Args>
Selection dispatch(DType dt, const void* x, size_t n, Args... args) {
    const bool wide = n >= (size_t(1) << 31);
#define GRADCOMP_SEL(E)                                                                     \
    {                                                                                       \
        const auto* xk = static_cast<const typename E::Key*>(x);                            \
        return wide ? Op<E, int64_t>::run(xk, n, args...) : Op<E, int32_t>::run(xk, n, args...); \
    }
    switch (dt) {
        case DType::F32: GRADCOMP_SEL(F32)
        case DType::F16: GRADCOMP_SEL(F16)
        case DType::BF16: GRADCOMP_SEL(BF16)
        case DType::F64: GRADCOMP_SEL(F64)
    }
#undef GRADCOMP_SEL
    throw std::invalid_argument("unknown dtype");
}

template <class E, class I>
struct TopkOp {
    static Selection run(const typename E::Key* x, size_t n, size_t k) { return topk_impl<E, I>(x, n, k); }
};
template <class E, class I>
struct ThresholdOp {
    static Selection run(const typename E::Key* x, size_t n, double tau) {
        return threshold_impl<E, I>(x, n, tau);
    }
};
template <class E, class I>
struct ApproxOp {
    static Selection run(const typename E::Key* x, size_t n, size_t k, size_t s, size_t sk, size_t lo,
                         size_t hi) {
        return approx_topk_impl<E, I>(x, n, k, s, sk, lo, hi);
    }
};

}  // namespace

Selection topk(DType dt, const void* x, size_t n, size_t k) {
    return dispatch<TopkOp>(dt, x, n, std::min(k, n));
}

Selection dgc_topk(const float* g, float* u, float* v, size_t n, float momentum, float scale, size_t k) {
    k = std::min(k, n);
    if (n >= (size_t(1) << 31)) return dgc_topk_impl<int64_t>(g, u, v, n, momentum, scale, k);
    return dgc_topk_impl<int32_t>(g, u, v, n, momentum, scale, k);
}

Selection threshold(DType dt, const void* x, size_t n, double tau) {
    if (!(tau >= 0)) throw std::invalid_argument("tau must be a number >= 0");
    return dispatch<ThresholdOp>(dt, x, n, tau);
}

Selection approx_topk(DType dt, const void* x, size_t n, size_t k, size_t sample, size_t sample_k,
                      size_t lo, size_t hi) {
    if (lo > hi) throw std::invalid_argument("approx_topk: lo must be <= hi");
    return dispatch<ApproxOp>(dt, x, n, std::min(k, n), sample, sample_k, lo, hi);
}

}  // namespace gradcomp
