// Python bindings of the sub-byte and fp8 block codecs (lowbit.cpp), added to
// gradcomp._C by module.cpp. Arguments as the int8 bindings: 1-D contiguous
// numpy views (float16/bfloat16 as 2-byte integers plus a dtype name), codes
// as uint8, checked here; the kernels run with the GIL released.
#include "pyargs.h"

namespace gradcomp {

namespace {

using namespace pyargs;

// what every quantizing binding receives, checked
struct QuantizeArgs {
    DType dt;
    const void* x;
    float* residual;
    size_t n, block;
    uint8_t* codes;
    float* scales;
};

QuantizeArgs quantize_args(const py::array& x, const std::string& dtype, py::ssize_t block_size,
                           const py::array& codes, size_t ncodes, const py::array& scales,
                           const py::object& residual) {
    QuantizeArgs a{};
    a.dt = parse_dtype(dtype, "dtype");
    a.block = checked_block(block_size);
    a.x = float_data(x, "x", a.dt);
    a.n = size_t(x.size());
    a.codes = static_cast<uint8_t*>(data_of(codes, "codes", "u", 1, true));
    a.scales = static_cast<float*>(data_of(scales, "scales", "f", 4, true));
    check_len("codes", size_t(codes.size()), ncodes);
    check_len("scales", size_t(scales.size()), (a.n + a.block - 1) / a.block);
    if (!residual.is_none()) {
        const auto r = residual.cast<py::array>();
        a.residual = static_cast<float*>(data_of(r, "residual", "f", 4, true));
        check_len("residual", size_t(r.size()), a.n);
    }
    return a;
}

// what every decoding binding receives, checked: out (or acc) has the element count
struct DecodeArgs {
    const uint8_t* codes;
    const float* scales;
    float* out;
    size_t n, block;
};

DecodeArgs decode_args(const py::array& codes, const py::array& scales, py::ssize_t block_size,
                       const py::array& out, size_t (*ncodes)(size_t, int), int bits) {
    DecodeArgs a{};
    a.block = checked_block(block_size);
    a.out = static_cast<float*>(data_of(out, "out", "f", 4, true));
    a.n = size_t(out.size());
    a.codes = static_cast<const uint8_t*>(data_of(codes, "codes", "u", 1, false));
    a.scales = static_cast<const float*>(data_of(scales, "scales", "f", 4, false));
    check_len("codes", size_t(codes.size()), ncodes(a.n, bits));
    check_len("scales", size_t(scales.size()), (a.n + a.block - 1) / a.block);
    return a;
}

size_t packed_bytes(size_t n, int bits) { return (n * size_t(bits) + 7) / 8; }
size_t fp8_bytes(size_t n, int) { return n; }

int checked_bits(int bits) {
    if (bits != 4 && bits != 2) throw std::invalid_argument("bits must be 4 or 2, got " + std::to_string(bits));
    return bits;
}

Fp8 parse_fp8(const std::string& fmt) {
    if (fmt == "e4m3") return Fp8::E4M3;
    if (fmt == "e5m2") return Fp8::E5M2;
    throw std::invalid_argument("fmt must be one of e4m3, e5m2, got " + fmt);
}

void py_quantize_packed(const py::array& x, const std::string& dtype, int bits, py::ssize_t block_size,
                        bool stochastic, uint32_t key, const py::array& codes, const py::array& scales,
                        const py::object& residual) {
    checked_bits(bits);
    const QuantizeArgs a = quantize_args(x, dtype, block_size, codes, packed_bytes(size_t(x.size()), bits), scales,
                                         residual);
    py::gil_scoped_release nogil;
    quantize_packed(a.dt, a.x, a.residual, a.n, a.block, bits, stochastic, key, a.codes, a.scales);
}

void py_dequantize_packed(const py::array& codes, const py::array& scales, int bits, py::ssize_t block_size,
                          const py::array& out, bool add) {
    const DecodeArgs a = decode_args(codes, scales, block_size, out, packed_bytes, checked_bits(bits));
    py::gil_scoped_release nogil;
    dequantize_packed(a.codes, a.scales, a.n, a.block, bits, a.out, add);
}

void py_reduce_quantize_packed(const py::array& acc, const py::array& codes_in, const py::array& scales_in,
                               int bits, py::ssize_t block_size, double divisor, bool stochastic, uint32_t key,
                               const py::array& codes, const py::array& scales, bool decode) {
    const DecodeArgs in = decode_args(codes_in, scales_in, block_size, acc, packed_bytes, checked_bits(bits));
    auto* cp = static_cast<uint8_t*>(data_of(codes, "codes", "u", 1, true));
    auto* sp = static_cast<float*>(data_of(scales, "scales", "f", 4, true));
    check_len("codes", size_t(codes.size()), packed_bytes(in.n, bits));
    check_len("scales", size_t(scales.size()), (in.n + in.block - 1) / in.block);
    if (!(divisor > 0) || float(divisor) != divisor)
        throw std::invalid_argument("divisor must be a positive float32 value, got " + std::to_string(divisor));
    py::gil_scoped_release nogil;
    reduce_quantize_packed(in.out, in.codes, in.scales, in.n, in.block, bits, float(divisor), stochastic, key, cp,
                           sp, decode);
}

void py_quantize_sign(const py::array& x, const std::string& dtype, py::ssize_t block_size,
                      const py::array& codes, const py::array& scales, const py::object& residual) {
    const QuantizeArgs a = quantize_args(x, dtype, block_size, codes, packed_bytes(size_t(x.size()), 1), scales,
                                         residual);
    py::gil_scoped_release nogil;
    quantize_sign(a.dt, a.x, a.residual, a.n, a.block, a.codes, a.scales);
}

void py_dequantize_sign(const py::array& codes, const py::array& scales, py::ssize_t block_size,
                        const py::array& out, bool add) {
    const DecodeArgs a = decode_args(codes, scales, block_size, out, packed_bytes, 1);
    py::gil_scoped_release nogil;
    dequantize_sign(a.codes, a.scales, a.n, a.block, a.out, add);
}

void py_quantize_fp8(const py::array& x, const std::string& dtype, const std::string& fmt, py::ssize_t block_size,
                     const py::array& codes, const py::array& scales, const py::object& residual) {
    const Fp8 f = parse_fp8(fmt);
    const QuantizeArgs a = quantize_args(x, dtype, block_size, codes, size_t(x.size()), scales, residual);
    py::gil_scoped_release nogil;
    quantize_fp8(a.dt, a.x, a.residual, a.n, a.block, f, a.codes, a.scales);
}

void py_dequantize_fp8(const py::array& codes, const py::array& scales, const std::string& fmt,
                       py::ssize_t block_size, const py::array& out, bool add) {
    const Fp8 f = parse_fp8(fmt);
    const DecodeArgs a = decode_args(codes, scales, block_size, out, fp8_bytes, 0);
    py::gil_scoped_release nogil;
    dequantize_fp8(a.codes, a.scales, a.n, a.block, f, a.out, add);
}

}  // namespace

void bind_lowbit(py::module_& m) {
    m.def("quantize_packed", &py_quantize_packed, py::arg("x"), py::arg("dtype"), py::arg("bits"),
          py::arg("block_size"), py::arg("stochastic"), py::arg("key"), py::arg("codes"), py::arg("scales"),
          py::arg("residual") = py::none(),
          "Blockwise absmax quantization to bits (4 or 2) -bit codes packed 8 / bits to a byte (uint8,\n"
          "ceil(n bits / 8)), scales float32 (ceil(n / block_size)); residual: fused error feedback.");
    m.def("dequantize_packed", &py_dequantize_packed, py::arg("codes"), py::arg("scales"), py::arg("bits"),
          py::arg("block_size"), py::arg("out"), py::arg("add"),
          "out[i] = code[i] * scale (float32), or out[i] += that product when add.");
    m.def("reduce_quantize_packed", &py_reduce_quantize_packed, py::arg("acc"), py::arg("codes_in"),
          py::arg("scales_in"), py::arg("bits"), py::arg("block_size"), py::arg("divisor"), py::arg("stochastic"),
          py::arg("key"), py::arg("codes"), py::arg("scales"), py::arg("decode"),
          "reduce_quantize_int8 with packed codes in and out, one pass per block.");
    m.def("quantize_sign", &py_quantize_sign, py::arg("x"), py::arg("dtype"), py::arg("block_size"),
          py::arg("codes"), py::arg("scales"), py::arg("residual") = py::none(),
          "Scaled sign: bits x < 0 (uint8, ceil(n / 8)) and scales min(mean |x|, max |x|) per block.");
    m.def("dequantize_sign", &py_dequantize_sign, py::arg("codes"), py::arg("scales"), py::arg("block_size"),
          py::arg("out"), py::arg("add"), "out[i] = bit ? -scale : scale, or out[i] += that when add.");
    m.def("quantize_fp8", &py_quantize_fp8, py::arg("x"), py::arg("dtype"), py::arg("fmt"), py::arg("block_size"),
          py::arg("codes"), py::arg("scales"), py::arg("residual") = py::none(),
          "Blockwise-scaled fp8 (fmt e4m3 | e5m2): codes fp8 bit patterns (uint8, n), scales absmax / max.");
    m.def("dequantize_fp8", &py_dequantize_fp8, py::arg("codes"), py::arg("scales"), py::arg("fmt"),
          py::arg("block_size"), py::arg("out"), py::arg("add"),
          "out[i] = float(code[i]) * scale, or out[i] += that product when add.");
}

}  // namespace gradcomp
