"""The CUDA libraries the mlx backend calls directly (the driver, NVRTC), loaded once per process
with one rule: the copy this process has loaded already (mlx's CUDA build links it), found in
``/proc/self/maps``, else the library's usual names. None where there is none (macOS, a Linux
without an NVIDIA driver)."""

from __future__ import annotations

import ctypes
import functools
import os


@functools.cache
def library(prefix: str, names: tuple[str, ...]) -> ctypes.CDLL | None:
    """The loaded ``prefix`` library (``"libcuda"``, ``"libnvrtc"``), or None where it is not found."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith(prefix + ".so"):
                    return ctypes.CDLL(path)
    except OSError:
        pass
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def driver() -> ctypes.CDLL | None:
    """The CUDA driver (``libcuda``), or None."""
    return library("libcuda", ("libcuda.so.1", "libcuda.so"))
