"""Element types of tensor chunks: the numeric code stored on disk and the numpy dtype."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kvformat.errors import UnsupportedFeatureError


@dataclass(frozen=True)
class DType:
    """One element type: ``code`` on disk, ``name`` in JSON, ``numpy`` for arrays."""

    code: int
    name: str
    numpy: np.dtype
    itemsize: int


FLOAT32 = DType(1, "float32", np.dtype("<f4"), 4)
FLOAT16 = DType(2, "float16", np.dtype("<f2"), 2)
BFLOAT16 = DType(3, "bfloat16", np.dtype(ml_dtypes.bfloat16), 2)

ALL: tuple[DType, ...] = (FLOAT32, FLOAT16, BFLOAT16)
BY_CODE: dict[int, DType] = {d.code: d for d in ALL}
BY_NAME: dict[str, DType] = {d.name: d for d in ALL}


def from_name(name: str) -> DType:
    """Look up a dtype by its JSON name (``"float32"``, ``"float16"``, ``"bfloat16"``)."""
    try:
        return BY_NAME[name]
    except (KeyError, TypeError):
        raise UnsupportedFeatureError(f"unknown dtype {name!r}; known: {sorted(BY_NAME)}") from None


def from_code(code: int) -> DType:
    """Look up a dtype by its on-disk code."""
    try:
        return BY_CODE[code]
    except KeyError:
        raise UnsupportedFeatureError(f"unknown dtype code {code}") from None


def from_numpy(dtype: np.dtype | type) -> DType:
    """Map a numpy dtype (native or little-endian) to a format dtype."""
    dt = np.dtype(dtype)
    for d in ALL:
        if dt == d.numpy:
            return d
    raise TypeError(f"unsupported array dtype {dt}; use float32, float16 or bfloat16")
