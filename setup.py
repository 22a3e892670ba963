"""The one part of the build pyproject.toml cannot declare: the CPU backend's kernels in C
(`analysis/kernels/kernels.c`), compiled at install time into ``kvsnap/analysis/kernels/_native``
and loaded by `kvsnap.analysis.kernels.native` with ctypes. Optional: without a C compiler the install still
succeeds and the numpy reference computes the same tables, slower (`analysis/kernels/native.py`)."""

import sys
import tempfile
import zlib
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -ffp-contract=off: no fused multiply-adds (the quantization errors round as numpy's do);
# -fno-math-errno: sqrt without a call; -fno-trapping-math: a compare-and-select vectorizes (no
# code reads the FP exception flags); -fopenmp-simd: the ``omp simd`` reductions vectorize (no
# OpenMP runtime is linked). A compiler that rejects one (checked first) builds without it.
FLAGS = (
    []
    if sys.platform == "win32"
    else ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd"]
)


class BuildWithAcceptedFlags(build_ext):
    """`build_ext` that passes each of `FLAGS` only if the compiler accepts it (Apple's clang
    and GCC differ in what they take), so that a flag never costs the whole extension."""

    def build_extensions(self) -> None:
        accepted = [flag for flag in FLAGS if self._accepts(flag)]
        for extension in self.extensions:
            extension.extra_compile_args = accepted
        super().build_extensions()

    def _accepts(self, flag: str) -> bool:
        from setuptools.errors import CompileError

        with tempfile.TemporaryDirectory() as folder:
            source = Path(folder) / "flag.c"
            source.write_text("int main(void) { return 0; }\n")
            try:
                self.compiler.compile([str(source)], output_dir=folder, extra_postargs=[flag, "-Werror"])
            except CompileError:
                return False
        return True


SOURCE = Path(__file__).parent / "analysis" / "kernels" / "kernels.c"
# The library records its source's CRC-32: `analysis/kernels/native.py` refuses a build whose source has
# changed since (a source tree edited or checked out after `pip install -e .`).
SOURCE_CRC = f"{zlib.crc32(SOURCE.read_bytes()):08x}"

setup(
    ext_modules=[
        Extension(
            "kvsnap.analysis.kernels._native",
            ["analysis/kernels/kernels.c"],
            define_macros=[("Py_LIMITED_API", "0x030B0000"), ("KVSNAP_SOURCE_CRC", f'"{SOURCE_CRC}"')],
            py_limited_api=True,
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildWithAcceptedFlags},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
