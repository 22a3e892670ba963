"""Element types of tensor chunks: the numeric code stored on disk and the numpy dtype."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kvformat.errors import InvalidArrayError, UnsupportedFeatureError


@dataclass(frozen=True)
class DType:
    """One element type: ``code`` on disk, ``name`` in JSON, ``numpy`` for arrays."""

    code: int
    name: str
    itemsize: int

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype (little-endian); bfloat16's comes from ml_dtypes, imported on first
        use (its extension loads slowly on some machines, and most commands never need it)."""
        return _numpy_dtype(self.name)


@functools.cache
def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name).newbyteorder("<")


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a name: the format's dtype names, and numpy's own (little-endian)."""
    return _numpy_dtype(name)


FLOAT32 = DType(1, "float32", 4)
FLOAT16 = DType(2, "float16", 2)
BFLOAT16 = DType(3, "bfloat16", 2)

INT32 = DType(4, "int32", 4)
"""Format 1.7: the key positions of selection chunks only (SPEC 6); never a layer's or queries'
element type, so it has no JSON name here."""

ALL: tuple[DType, ...] = (FLOAT32, FLOAT16, BFLOAT16)
BY_CODE: dict[int, DType] = {d.code: d for d in (*ALL, INT32)}
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
    for d in ALL:  # bfloat16 last: its numpy dtype is only looked up (imported) when needed
        if (d is not BFLOAT16 or dt.name == "bfloat16") and dt == d.numpy:
            return d
    raise InvalidArrayError(f"unsupported array dtype {dt}; use float32, float16 or bfloat16")
