"""Build of the native CPU module ``gradcomp._C`` (pybind11, numpy buffers, no libtorch).

Environment switches:
    GRADCOMP_NO_NATIVE=1   skip the native module (the pure-PyTorch reference still works)
    GRADCOMP_NO_OPENMP=1   build without OpenMP
    GRADCOMP_NATIVE_ARCH=1 compile for this machine's CPU (-march=native; the module may die with
                           SIGILL on another CPU). The default is the compiler's portable baseline
                           (x86-64: SSE2), safe for wheels and shared installs; its hot kernels are
                           also compiled for AVX2 and AVX-512 (csrc/cpu/isa_*.cpp) and chosen at
                           load from the CPU's features (csrc/cpu/isa.cpp).

The CUDA sources in csrc/cuda/ are not compiled here: they are copied into the
package (gradcomp/_cuda_src/) and compiled at first use by CuPy (NVRTC).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _copy_cuda_sources(dst_root: str) -> None:
    dst = os.path.join(dst_root, "gradcomp", "_cuda_src")
    os.makedirs(dst, exist_ok=True)
    for src in glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cu*")):
        shutil.copy2(src, dst)


class BuildPy(build_py):
    """Ship csrc/cuda/*.cu inside the package."""

    def run(self):
        _copy_cuda_sources(HERE)  # source tree (editable installs)
        super().run()
        _copy_cuda_sources(self.build_lib)


def _compiler_accepts(flag: str) -> bool:
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.cpp")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        try:
            r = subprocess.run([cxx, flag, src, "-o", os.path.join(d, "t")], capture_output=True)
        except OSError:
            return False
        return r.returncode == 0


def arch_flags(env) -> list[str]:
    """Target-CPU flags: none (portable) unless ``GRADCOMP_NATIVE_ARCH=1`` asks for -march=native."""
    value = env.get("GRADCOMP_NATIVE_ARCH", "0")
    if value not in ("0", "1"):
        raise ValueError(f"GRADCOMP_NATIVE_ARCH must be 0 (portable, the default) or 1 (-march=native), "
                         f"got {value!r}")
    return ["-march=native"] if value == "1" and sys.platform != "win32" else []


def _extensions():
    if os.environ.get("GRADCOMP_NO_NATIVE") == "1":
        return []
    from pybind11.setup_helpers import Pybind11Extension

    cflags = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
    lflags = []
    if sys.platform != "win32":
        # hot loops at 32-byte boundaries: their speed then depends less on where the
        # linker happens to place them (builds of the same kernels differed by up to 10%)
        cflags.append("-falign-loops=32")
    if sys.platform != "win32" and os.environ.get("GRADCOMP_NO_OPENMP") != "1":
        if _compiler_accepts("-fopenmp"):
            cflags.append("-fopenmp")
            lflags.append("-fopenmp")
    cflags += arch_flags(os.environ)
    sources = sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    if not sources:
        return []
    return [
        Pybind11Extension(
            "gradcomp._C",
            sources,
            depends=sorted(glob.glob(os.path.join("csrc", "cpu", "*.h"))),  # rebuild on header edits
            cxx_std=17,
            extra_compile_args=cflags,
            extra_link_args=lflags,
        )
    ]


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import arch_flags
    setup(ext_modules=_extensions(), cmdclass={"build_py": BuildPy})
