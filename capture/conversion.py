"""mlx arrays <-> numpy arrays without a copy where the layout allows (bfloat16 through uint16)."""

from __future__ import annotations

import ml_dtypes
import mlx.core as mx
import numpy as np


def host_dtype(dtype: mx.Dtype) -> np.dtype:
    """The numpy dtype `to_numpy` gives an mlx array of ``dtype``, read from its name: no array is
    made or evaluated (an evaluation on the generating thread waits for the step in flight)."""
    name = str(dtype).rsplit(".", 1)[-1]
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:  # a type numpy does not name alike: ask an (empty) array
        return to_numpy(mx.zeros((0,), dtype)).dtype


def to_numpy(array: mx.array) -> np.ndarray:
    """A numpy view of an evaluated mlx array (bfloat16 through a uint16 view); no copy."""
    if array.dtype == mx.bfloat16:
        return np.asarray(array.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.asarray(array)


def to_mlx(array: np.ndarray) -> mx.array:
    """An mlx array from numpy (bfloat16 via uint16)."""
    if array.dtype == ml_dtypes.bfloat16:
        return mx.array(array.view(np.uint16)).view(mx.bfloat16)
    return mx.array(array)
