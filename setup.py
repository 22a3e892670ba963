"""The one part of the build pyproject.toml cannot declare: the CPU backend's kernels in C
(`analysis/kernels.c`), compiled at install time into ``kvsnap/analysis/_native`` and loaded by
`kvsnap.analysis.native` with ctypes. Optional: without a C compiler the install still succeeds and
the kernels run on numba (slower to start: `analysis/native.py`)."""

import sys

from setuptools import Extension, setup

# -ffp-contract=off: no fused multiply-adds (the quantization errors round as numpy's do);
# -fno-trapping-math: a compare-and-select vectorizes (no code reads the FP exception flags);
# -fopenmp-simd: the ``omp simd`` reductions vectorize (no OpenMP runtime is linked).
FLAGS = (
    []
    if sys.platform == "win32"
    else ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp-simd"]
)

setup(
    ext_modules=[
        Extension(
            "kvsnap.analysis._native",
            ["analysis/kernels.c"],
            extra_compile_args=FLAGS,
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
            optional=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
