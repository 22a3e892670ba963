"""Backends fill a `HeadAccumulator` from rows; each implements the same small interface
(`Backend`), and a pass picks one by name, once (`of`):

- ``"cpu"``: `compiled`, the fused compiled kernel (C, `analysis.kernels.native`, where the install built
  it) plus BLAS (the default);
- ``"numpy"``: `reference`, every sum written out plainly, the oracle the others are held to
  (``"cpu"`` where the C kernels are not built: `missing_note` says so);
- ``"mlx"``: `mlx`, the statistics as mlx array operations on mlx's default device, with a
  pipeline that batches many accumulators per device call (`mlx_pipeline`).

A backend writes only the accumulator's public sums (`accumulator.SUMS`); work it leaves in
flight it hands to the accumulator as a `accumulator.Pending`, which `settle` folds in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from kvformat import PayloadCheck

    from ..stats.sums import RunningSums

NAMES = ("cpu", "numpy", "mlx")
_MODULES = {"cpu": "compiled", "numpy": "reference", "mlx": "mlx"}


class Backend(Protocol):
    """What a pass calls: ``add`` rows ``(n_tokens, dim)`` at ``positions`` ``(n_tokens,)`` into an
    accumulator, checking ``check`` (the CRC the rows must have: `kvformat.ChecksumError` when they
    do not, the accumulator then to be dropped). Rows holding inf or NaN are left out and counted
    (`RunningSums.drop_nonfinite`)."""

    NAME: str

    def available(self) -> bool: ...

    def add(
        self, acc: RunningSums, rows: np.ndarray, positions: np.ndarray, check: PayloadCheck | None = None
    ) -> None: ...


def of(name: str) -> Backend:
    """The backend called ``name`` (`NAMES`): ``"cpu"`` is the compiled kernel where the C
    library is built, else the numpy reference. Raises ValueError for another name."""
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}: one of {', '.join(NAMES)}")
    module: Backend = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    if name == "cpu" and not module.available():
        return of("numpy")
    return module


def missing_note(name: str) -> str | None:
    """One line for the user where backend ``name`` wants the C kernels and they are not built
    (`native.missing_note`), else None."""
    if name != "cpu":
        return None
    from . import native

    return native.missing_note()
