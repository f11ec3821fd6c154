// Element type names of the kernels' entry points (kernels.h).
#include "kernels.h"

namespace gradcomp {

DType parse_dtype(const std::string& s, const char* arg) {
    if (s == "float32") return DType::F32;
    if (s == "float16") return DType::F16;
    if (s == "bfloat16") return DType::BF16;
    if (s == "float64") return DType::F64;
    throw std::invalid_argument(std::string(arg) +
                                " must be one of float32, float16, bfloat16, float64, got " + s);
}

size_t dtype_size(DType d) {
    switch (d) {
        case DType::F32: return 4;
        case DType::F64: return 8;
        default: return 2;
    }
}

const char* dtype_name(DType d) {
    switch (d) {
        case DType::F32: return F32::name;
        case DType::F16: return F16::name;
        case DType::BF16: return BF16::name;
        default: return F64::name;
    }
}

}  // namespace gradcomp
