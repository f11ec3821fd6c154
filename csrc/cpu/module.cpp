// Python bindings of gradcomp._C (pybind11 over numpy buffers; no libtorch).
//
// The Python side (gradcomp/kernels/cpu.py) passes contiguous 1-D numpy views
// of CPU tensors: float32/float64 as themselves, float16/bfloat16 as 2-byte
// integer views, plus a dtype name. Every argument is checked here (clear
// ValueError / TypeError naming it); the kernels then run with the GIL
// released. Selection results are returned as numpy arrays that own the
// kernel's buffers (no copy).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "isa_kernels.h"
#include "kernels.h"
#include "pyargs.h"

namespace py = pybind11;

namespace gradcomp {

std::atomic<int> g_num_threads{0};

namespace {

using namespace pyargs;

py::array owned_array(Buffer<unsigned char>&& buf, size_t count, const py::dtype& dt) {
    if (count == 0) return py::array(dt, std::vector<py::ssize_t>{0});
    unsigned char* raw = buf.release();
    py::capsule owner(raw, [](void* p) { std::free(p); });
    return py::array(dt, std::vector<py::ssize_t>{py::ssize_t(count)},
                     std::vector<py::ssize_t>{py::ssize_t(dt.itemsize())}, raw, owner);
}

py::tuple to_python(Selection&& s, size_t n, DType dt) {
    const py::dtype idx_dt = n >= (size_t(1) << 31) ? py::dtype::of<int64_t>() : py::dtype::of<int32_t>();
    py::dtype val_dt = dt == DType::F32   ? py::dtype::of<float>()
                       : dt == DType::F64 ? py::dtype::of<double>()
                                          : py::dtype::of<int16_t>();
    return py::make_tuple(owned_array(std::move(s.idx), s.count, idx_dt),
                          owned_array(std::move(s.val), s.count, val_dt));
}

void py_quantize(const py::array& x, const std::string& dtype, py::ssize_t block_size, bool stochastic,
                 uint32_t key, const py::array& q, const py::array& scales, const py::object& residual) {
    const DType dt = parse_dtype(dtype, "dtype");
    const size_t block = checked_block(block_size);
    const void* xp = float_data(x, "x", dt);
    const size_t n = size_t(x.size());
    auto* qp = static_cast<int8_t*>(data_of(q, "q", "i", 1, true));
    auto* sp = static_cast<float*>(data_of(scales, "scales", "f", 4, true));
    check_len("q", size_t(q.size()), n);
    check_len("scales", size_t(scales.size()), (n + block - 1) / block);
    float* rp = nullptr;
    if (!residual.is_none()) {
        const auto r = residual.cast<py::array>();
        rp = static_cast<float*>(data_of(r, "residual", "f", 4, true));
        check_len("residual", size_t(r.size()), n);
    }
    py::gil_scoped_release nogil;
    quantize_int8(dt, xp, rp, n, block, stochastic, key, qp, sp);
}

bool py_dequantize(const py::array& q, const py::array& scales, py::ssize_t block_size,
                   const py::array& out, const std::string& out_dtype, bool check_int8) {
    const DType dt = parse_dtype(out_dtype, "out_dtype");
    const size_t block = checked_block(block_size);
    const auto* qp = static_cast<const int8_t*>(data_of(q, "q", "i", 1, false));
    const auto* sp = static_cast<const float*>(data_of(scales, "scales", "f", 4, false));
    void* op = float_data(out, "out", dt, true);
    const size_t n = size_t(q.size());
    check_len("scales", size_t(scales.size()), (n + block - 1) / block);
    check_len("out", size_t(out.size()), n);
    py::gil_scoped_release nogil;
    return dequantize_int8(qp, sp, n, block, dt, op, check_int8);
}

bool py_dequantize_add(const py::array& acc, const py::array& q, const py::array& scales,
                       py::ssize_t block_size, bool check_int8) {
    const size_t block = checked_block(block_size);
    auto* ap = static_cast<float*>(data_of(acc, "acc", "f", 4, true));
    const auto* qp = static_cast<const int8_t*>(data_of(q, "q", "i", 1, false));
    const auto* sp = static_cast<const float*>(data_of(scales, "scales", "f", 4, false));
    const size_t n = size_t(q.size());
    check_len("scales", size_t(scales.size()), (n + block - 1) / block);
    check_len("acc", size_t(acc.size()), n);
    py::gil_scoped_release nogil;
    return dequantize_int8_add(ap, qp, sp, n, block, check_int8);
}

bool py_reduce_quantize(const py::array& acc, const py::array& q_in, const py::array& scales_in,
                        py::ssize_t block_size, double divisor, bool stochastic, uint32_t key,
                        const py::array& q, const py::array& scales, bool decode, bool check_int8) {
    const size_t block = checked_block(block_size);
    auto* ap = static_cast<float*>(data_of(acc, "acc", "f", 4, true));
    const auto* qip = static_cast<const int8_t*>(data_of(q_in, "q_in", "i", 1, false));
    const auto* sip = static_cast<const float*>(data_of(scales_in, "scales_in", "f", 4, false));
    auto* qp = static_cast<int8_t*>(data_of(q, "q", "i", 1, true));
    auto* sp = static_cast<float*>(data_of(scales, "scales", "f", 4, true));
    const size_t n = size_t(acc.size()), nb = (n + block - 1) / block;
    check_len("q_in", size_t(q_in.size()), n);
    check_len("q", size_t(q.size()), n);
    check_len("scales_in", size_t(scales_in.size()), nb);
    check_len("scales", size_t(scales.size()), nb);
    if (!(divisor > 0) || float(divisor) != divisor)
        throw std::invalid_argument("divisor must be a positive float32 value, got " + std::to_string(divisor));
    py::gil_scoped_release nogil;
    return reduce_quantize_int8(ap, qip, sip, n, block, float(divisor), stochastic, key, qp, sp, decode,
                                check_int8);
}

py::tuple py_topk(const py::array& x, const std::string& dtype, py::ssize_t k) {
    const DType dt = parse_dtype(dtype, "dtype");
    if (k < 0) throw std::invalid_argument("k must be >= 0, got " + std::to_string(k));
    const void* xp = float_data(x, "x", dt);
    const size_t n = size_t(x.size());
    Selection s;
    {
        py::gil_scoped_release nogil;
        s = topk(dt, xp, n, size_t(k));
    }
    return to_python(std::move(s), n, dt);
}

py::tuple py_threshold(const py::array& x, const std::string& dtype, double tau) {
    const DType dt = parse_dtype(dtype, "dtype");
    if (!(tau >= 0)) throw std::invalid_argument("tau must be >= 0, got " + std::to_string(tau));
    const void* xp = float_data(x, "x", dt);
    const size_t n = size_t(x.size());
    Selection s;
    {
        py::gil_scoped_release nogil;
        s = threshold(dt, xp, n, tau);
    }
    return to_python(std::move(s), n, dt);
}

py::tuple py_approx_topk(const py::array& x, const std::string& dtype, py::ssize_t k, py::ssize_t sample,
                         py::ssize_t sample_k, py::ssize_t lo, py::ssize_t hi) {
    const DType dt = parse_dtype(dtype, "dtype");
    if (k < 0) throw std::invalid_argument("k must be >= 0, got " + std::to_string(k));
    if (sample < 0 || sample_k < 0 || lo < 0 || hi < lo)
        throw std::invalid_argument("approx_topk needs sample >= 0, sample_k >= 0 and 0 <= lo <= hi");
    const void* xp = float_data(x, "x", dt);
    const size_t n = size_t(x.size());
    Selection s;
    {
        py::gil_scoped_release nogil;
        s = approx_topk(dt, xp, n, size_t(k), size_t(sample), size_t(sample_k), size_t(lo), size_t(hi));
    }
    return to_python(std::move(s), n, dt);
}

void py_scatter_add(const py::array& acc, const py::array& indices, const py::array& values,
                    const std::string& values_dtype) {
    const DType vdt = parse_dtype(values_dtype, "values_dtype");
    auto* ap = static_cast<float*>(data_of(acc, "acc", "f", 4, true));
    const size_t isz = size_t(indices.itemsize());
    if (isz != 4 && isz != 8)
        throw std::invalid_argument("indices must be int32 or int64, got " + describe(indices));
    const void* ip = data_of(indices, "indices", "i", isz, false);
    const void* vp = float_data(values, "values", vdt);
    check_len("values", size_t(values.size()), size_t(indices.size()));
    const size_t n = size_t(acc.size()), m = size_t(indices.size());
    py::gil_scoped_release nogil;
    scatter_add(ap, n, ip, isz == 8, m, vdt, vp);
}

void py_ef_encode(const py::array& indices, int L, const py::array& lo, const py::array& hi) {
    const size_t isz = size_t(indices.itemsize());
    if (isz != 4 && isz != 8)
        throw std::invalid_argument("indices must be int32 or int64, got " + describe(indices));
    if (L < 0 || L > 62) throw std::invalid_argument("L must be in [0, 62], got " + std::to_string(L));
    const void* ip = data_of(indices, "indices", "i", isz, false);
    const size_t k = size_t(indices.size());
    auto* lp = static_cast<uint8_t*>(data_of(lo, "lo", "u", 1, true));
    auto* hp = static_cast<uint8_t*>(data_of(hi, "hi", "u", 1, true));
    check_len("lo", size_t(lo.size()), (k * size_t(L) + 7) / 8);
    bool ok;
    {
        py::gil_scoped_release nogil;
        ok = ef_encode(ip, isz == 8, k, L, lp, hp, size_t(hi.size()));
    }
    if (!ok) throw std::invalid_argument("indices must be ascending and non-negative, with high bits that fit in hi");
}

int py_ef_decode(const py::array& lo, const py::array& hi, uint64_t n, int L, const py::array& out) {
    if (L < 0 || L > 62) throw std::invalid_argument("L must be in [0, 62], got " + std::to_string(L));
    const size_t osz = size_t(out.itemsize());
    if (osz != 4 && osz != 8) throw std::invalid_argument("out must be int32 or int64, got " + describe(out));
    auto* op = data_of(out, "out", "i", osz, true);
    const size_t k = size_t(out.size());
    const auto* lp = static_cast<const uint8_t*>(data_of(lo, "lo", "u", 1, false));
    const auto* hp = static_cast<const uint8_t*>(data_of(hi, "hi", "u", 1, false));
    check_len("lo", size_t(lo.size()), (k * size_t(L) + 7) / 8);
    py::gil_scoped_release nogil;
    return ef_decode(lp, size_t(lo.size()), hp, size_t(hi.size()), n, k, L, op, osz == 8);
}

// g (read), u and v (written): float32 arrays of one length
struct DgcArrays {
    const float* g;
    float* u;
    float* v;
    size_t n;
};

DgcArrays dgc_arrays(const py::array& g, const py::array& u, const py::array& v) {
    DgcArrays a{static_cast<const float*>(data_of(g, "g", "f", 4, false)),
                static_cast<float*>(data_of(u, "u", "f", 4, true)),
                static_cast<float*>(data_of(v, "v", "f", 4, true)), size_t(g.size())};
    check_len("u", size_t(u.size()), a.n);
    check_len("v", size_t(v.size()), a.n);
    return a;
}

void py_dgc_accumulate(const py::array& g, const py::array& u, const py::array& v, float momentum, float scale) {
    const DgcArrays a = dgc_arrays(g, u, v);
    py::gil_scoped_release nogil;
    dgc_accumulate(a.g, a.u, a.v, a.n, momentum, scale);
}

py::tuple py_dgc_topk(const py::array& g, const py::array& u, const py::array& v, float momentum, float scale,
                      py::ssize_t k) {
    const DgcArrays a = dgc_arrays(g, u, v);
    if (k < 0) throw std::invalid_argument("k must be >= 0, got " + std::to_string(k));
    Selection s;
    {
        py::gil_scoped_release nogil;
        s = dgc_topk(a.g, a.u, a.v, a.n, momentum, scale, size_t(k));
    }
    return to_python(std::move(s), a.n, DType::F32);
}

void py_set_num_threads(int n) {
    if (n < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = OpenMP default), got " + std::to_string(n));
    g_num_threads.store(n, std::memory_order_relaxed);
}

py::dict build_info() {
    py::dict d;
#ifdef _OPENMP
    d["openmp"] = true;
#else
    d["openmp"] = false;
#endif
#ifdef __F16C__
    d["f16c"] = true;
#else
    d["f16c"] = false;
#endif
#ifdef __AVX2__
    d["avx2"] = true;
#else
    d["avx2"] = false;
#endif
#ifdef __AVX512F__
    d["avx512f"] = true;
#else
    d["avx512f"] = false;
#endif
#ifdef __VERSION__
    d["compiler"] = __VERSION__;
#endif
    d["isa_supported"] = isa_supported();
    try {
        d["isa"] = isa_kernels().name;
    } catch (const std::invalid_argument& e) {
        d["isa"] = std::string("unavailable: ") + e.what();
    }
    return d;
}

std::string py_cpu_isa() { return isa_kernels().name; }

}  // namespace

void bind_lowbit(py::module_& m);  // module_lowbit.cpp

}  // namespace gradcomp

PYBIND11_MODULE(_C, m) {
    using namespace gradcomp;
    namespace py = pybind11;
    m.doc() =
        "Native CPU kernels of gradcomp (OpenMP, numpy buffers). Called through "
        "gradcomp.kernels (backend 'cpu'); the numerics are those of gradcomp.kernels.reference.";

    m.def("quantize_int8", &py_quantize, py::arg("x"), py::arg("dtype"), py::arg("block_size"),
          py::arg("stochastic"), py::arg("key"), py::arg("q"), py::arg("scales"),
          py::arg("residual") = py::none(),
          "Blockwise absmax int8 quantization of x (1-D, `dtype` = float32|float16|bfloat16|float64;\n"
          "float16/bfloat16 passed as 2-byte integer views) into q (int8, n) and scales (float32,\n"
          "ceil(n / block_size)). key = reference.stream_key(seed, counter) for stochastic rounding.\n"
          "With residual (float32, n, updated in place): fused error feedback, p = x + residual.");
    m.def("dequantize_int8", &py_dequantize, py::arg("q"), py::arg("scales"), py::arg("block_size"),
          py::arg("out"), py::arg("out_dtype"), py::arg("check_int8") = false,
          "out[i] = q[i] * scales[i // block_size] (float32 product, then converted to out_dtype).\n"
          "check_int8: return False (else True) when a block holds code -128 or a negative or\n"
          "infinite scale; that block is not written, other blocks may or may not be.");
    m.def("dequantize_int8_add", &py_dequantize_add, py::arg("acc"), py::arg("q"), py::arg("scales"),
          py::arg("block_size"), py::arg("check_int8") = false,
          "acc[i] += q[i] * scales[i // block_size] (float32, product rounded first); check_int8 as\n"
          "dequantize_int8.");
    m.def("reduce_quantize_int8", &py_reduce_quantize, py::arg("acc"), py::arg("q_in"), py::arg("scales_in"),
          py::arg("block_size"), py::arg("divisor"), py::arg("stochastic"), py::arg("key"), py::arg("q"),
          py::arg("scales"), py::arg("decode"), py::arg("check_int8") = false,
          "One pass per block: p = (acc + q_in * scales_in) / divisor (no division when divisor == 1);\n"
          "(q, scales) = quantize_int8(p); acc <- q * scales if decode, else p. acc float32 (n), q_in / q\n"
          "int8 (n), scales_in / scales float32 (ceil(n / block_size)); check_int8 as dequantize_int8.");
    m.def("topk", &py_topk, py::arg("x"), py::arg("dtype"), py::arg("k"),
          "Exact top-k by |x| (NaN largest, ties to the lower index) -> (indices, values), ascending;\n"
          "indices int32 (int64 when n >= 2**31), values in x's storage type.");
    m.def("threshold", &py_threshold, py::arg("x"), py::arg("dtype"), py::arg("tau"),
          "Every element with |x| >= tau or NaN -> (indices, values), ascending.");
    m.def("approx_topk", &py_approx_topk, py::arg("x"), py::arg("dtype"), py::arg("k"), py::arg("sample"),
          py::arg("sample_k"), py::arg("lo"), py::arg("hi"),
          "Sampled-threshold top-k (DGC): a top set whose size is in [lo, hi] (exactly k on a miss).");
    m.def("scatter_add", &py_scatter_add, py::arg("acc"), py::arg("indices"), py::arg("values"),
          py::arg("values_dtype"),
          "acc[indices[j]] += values[j] in order; ValueError if an index is outside [0, acc.size).");
    m.def("ef_encode", &py_ef_encode, py::arg("indices"), py::arg("L"), py::arg("lo"), py::arg("hi"),
          "Elias-Fano code ascending indices: low bits into lo, high bits OR-ed into zeroed hi.");
    m.def("ef_decode", &py_ef_decode, py::arg("lo"), py::arg("hi"), py::arg("n"), py::arg("L"), py::arg("out"),
          "Decode Elias-Fano indices into out; returns 0, or 1 (bit count), 2 (range), 3 (order).");
    m.def("dgc_accumulate", &py_dgc_accumulate, py::arg("g"), py::arg("u"), py::arg("v"), py::arg("momentum"),
          py::arg("scale"), "u = u * momentum + g * scale; v += u (float32, in place).");
    m.def("dgc_topk", &py_dgc_topk, py::arg("g"), py::arg("u"), py::arg("v"), py::arg("momentum"),
          py::arg("scale"), py::arg("k"), "dgc_accumulate, then the exact top-k of v, in one fused pass.");
    m.def("set_num_threads", &py_set_num_threads, py::arg("n"),
          "Threads for every kernel of this module (0 = omp_get_max_threads(), the OpenMP default).");
    m.def("get_num_threads", &max_threads, "Threads the kernels of this module use now.");
    bind_lowbit(m);
    m.def("cpu_isa", &py_cpu_isa,
          "The kernel variant (instruction set) this process runs: baseline, avx2 or avx512, chosen once\n"
          "from GRADCOMP_CPU_ISA or the CPU's features; ValueError with the reason when GRADCOMP_CPU_ISA\n"
          "names one that cannot run here.");
    m.def("cpu_isas", &isa_supported, "The kernel variants this CPU and build can run, comma-separated.");
    m.def("build_info", &build_info, "Compile-time features of this build (OpenMP, F16C, AVX2, ...).");
}
