"""``KVSNAP_BLAS``: a BLAS library loaded before mlx, for mlx's matrix products on the CPU.

mlx's CPU wheel for Linux (``mlx[cpu]``) carries the reference (netlib) BLAS, compiled without
vectorised kernels: a float32 matrix product runs at ~4 GFLOP/s on a 2-core x86-64 VM, and
SmolLM2-135M in float32 takes 21 s to read a 240-token prompt. An optimised BLAS exporting the
same names (OpenBLAS: Debian's ``libopenblas0-pthread``) loaded first, into the process's global
symbol scope, is the one mlx calls: 94 GFLOP/s on one core, the same prompt in 0.9 s
(``OPENBLAS_NUM_THREADS`` sets its threads). The results are the same sums in another order
(float32 rounding apart). On macOS mlx uses Accelerate: nothing to do.

    export KVSNAP_BLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0

`kvsnap` loads it when first imported, before any stage imports mlx; a program that imports
mlx itself before kvsnap keeps mlx's own BLAS (call `load` first).
"""

from __future__ import annotations

import os
import warnings

VARIABLE = "KVSNAP_BLAS"
_loaded: str | None = None


def load(path: str | None = None) -> str | None:
    """Load the BLAS library ``path`` (default: ``$KVSNAP_BLAS``; nothing where neither is set)
    into the global symbol scope, once; a library that does not load is a warning naming it, and
    mlx keeps its own. Returns the library loaded, if any."""
    global _loaded
    path = path or os.environ.get(VARIABLE) or None
    if path is None or _loaded == path:
        return _loaded
    import ctypes

    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as error:
        warnings.warn(f"{VARIABLE}={path}: not loaded ({error}); mlx keeps its own BLAS", stacklevel=2)
        return _loaded
    _loaded = path
    return _loaded
