// Argument checks of the Python bindings (module.cpp, module_lowbit.cpp):
// numpy buffers in, raw pointers out, std::invalid_argument (ValueError in
// Python) naming the argument otherwise.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>

#include "kernels.h"

namespace gradcomp {
namespace pyargs {

namespace py = pybind11;

inline std::string describe(const py::array& a) {
    return std::string(py::str(a.dtype())) + " array with ndim " + std::to_string(a.ndim());
}

// Pointer to the data of a contiguous 1-D array of `itemsize`-byte elements of
// numpy kind in `kinds` (e.g. "f", "iu"); throws ValueError naming `name`.
inline void* data_of(py::array a, const char* name, const char* kinds, size_t itemsize, bool writable) {
    const char kind = a.dtype().kind();
    if (a.ndim() != 1 || size_t(a.itemsize()) != itemsize || !std::strchr(kinds, kind))
        throw std::invalid_argument(std::string(name) + " must be a 1-D array of " +
                                    std::to_string(itemsize) + "-byte elements of kind '" + kinds +
                                    "', got a " + describe(a));
    if (a.size() > 1 && a.strides(0) != py::ssize_t(itemsize))
        throw std::invalid_argument(std::string(name) + " must be contiguous");
    if (writable) {
        if (!a.writeable()) throw std::invalid_argument(std::string(name) + " must be writable");
        return a.size() ? a.mutable_data() : nullptr;
    }
    return a.size() ? const_cast<void*>(a.data()) : nullptr;
}

inline void* float_data(py::array a, const char* name, DType dt, bool writable = false) {
    const bool narrow = dt == DType::F16 || dt == DType::BF16;
    return data_of(a, name, narrow ? "iuf" : "f", dtype_size(dt), writable);
}

inline void check_len(const char* name, size_t got, size_t want) {
    if (got != want)
        throw std::invalid_argument(std::string(name) + " must have " + std::to_string(want) +
                                    " elements, got " + std::to_string(got));
}

inline size_t checked_block(py::ssize_t block) {
    if (block <= 0) throw std::invalid_argument("block_size must be positive, got " + std::to_string(block));
    return size_t(block);
}

}  // namespace pyargs
}  // namespace gradcomp
