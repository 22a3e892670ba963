"""Kernels fill a `HeadAccumulator` from rows; each implements the same small interface
(`Backend`), and a pass picks one by name, once (`of`), and sizes and places its work by the
kernel's `Profile` (`profile`): the engine asks what a kernel needs, never its name.

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
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..dependencies import kvformat_errors

if TYPE_CHECKING:
    import numpy as np

    from kvformat import PayloadCheck

    from ..stats.sums import RunningSums
    from .mlx_pipeline import Pipeline

NAMES = ("cpu", "numpy", "mlx")
DEFAULT = "cpu"
"""The kernel a pass uses unless told otherwise."""
CHOICES = ("cpu", "mlx")
"""The kernels a user picks (``--backend``); ``"numpy"``, the reference, is accepted too."""
_MODULES = {"cpu": "compiled", "numpy": "reference", "mlx": "mlx"}


class Profile(NamedTuple):
    """How the engine sizes and places a pass for one kernel: what it asks instead of its name.

    ``device``: the kernel drives an accelerator from one thread per process (mlx): a pass in
    this process runs on one thread, worker processes are spawned (they carry no CPU kernels) and
    sized by the device's memory (`mlx_sizing.processes`), each with a device pipeline, and a
    layer's accumulators are stacked for the device's folds. ``worker_processes``: a big local
    file's pass may run on worker processes. ``splits_files``: a batch may split a file's layers
    over processes, a core each. ``start_method``: how its worker processes start
    (``"forkserver"``: forked from a server that has loaded the CPU kernels). ``tasks_per_worker``:
    the tasks a worker's share of a file is cut into, so that uneven tasks even out. (A named
    tuple: the command line's early start reads it before anything heavy is imported.)"""

    name: str
    device: bool
    worker_processes: bool
    splits_files: bool
    start_method: str
    tasks_per_worker: int

    def processes(self, workers: int) -> int:
        """The worker processes a pass asked for ``workers`` workers starts."""
        return _device_modules()[1].processes(workers) if self.device else workers

    def row_threads(self, processes: int) -> int:
        """Threads computing rows beside the device, in each of ``processes`` processes that
        drive it (`mlx_sizing.row_threads`); 1 for a host kernel."""
        return _device_modules()[1].row_threads(processes) if self.device else 1

    def pipeline(self, processes: int, worker: bool) -> Pipeline | None:
        """A device kernel's pipeline (`mlx_pipeline.Pipeline`), sized for ``processes``
        processes driving the device, ``worker``: this one a worker process; None for a host
        kernel."""
        if not self.device:
            return None
        pipeline, sizing = _device_modules()
        return pipeline.Pipeline(
            sizing.batch_bytes(worker=worker), copy_threads=sizing.copy_threads(processes)
        )

    def eigenvalues(self, covariance: np.ndarray) -> np.ndarray:
        """The eigenvalues of each symmetric matrix of ``covariance`` ``(b, n, n)`` float64, each
        row descending: the C solver where this kernel is the compiled one and it is built
        (without the interpreter's lock), else LAPACK (the numpy reference, and mlx, which never
        loads the CPU kernels)."""
        import numpy as np

        if self.name == "cpu":
            from . import kernel

            if kernel.AVAILABLE:
                from .eigen import eigenvalues_of

                return eigenvalues_of(covariance)
        return np.linalg.eigvalsh(covariance)[:, ::-1]


# 16 tasks per CPU worker: more even out heads of uneven cost, fewer cost less. 4 on mlx: a
# worker's device pipeline drains at the end of each task. mlx workers are spawned, not forked from
# the fork server: they start mlx and a CUDA context of their own either way (a fork cannot share
# one), and a spawned worker does not carry the server's compiled kernels, which would count in each
# worker's resident set (on mlx the rows' eigenvalues are LAPACK's).
_PROFILES = {
    "cpu": Profile("cpu", False, True, True, "forkserver", 16),
    "numpy": Profile("numpy", False, False, False, "forkserver", 16),
    "mlx": Profile("mlx", True, True, False, "spawn", 4),
}


def _device_modules() -> tuple[Any, Any]:
    """`mlx_pipeline` and `mlx_sizing`, imported when a device kernel's pass first asks (a host
    kernel's pass never loads them)."""
    from . import mlx_pipeline, mlx_sizing

    return mlx_pipeline, mlx_sizing


def profile(name: str) -> Profile:
    """The `Profile` of kernel ``name`` (`NAMES`); ValueError for another name."""
    if name not in _PROFILES:
        raise kvformat_errors.UnknownNameError(f"unknown backend {name!r}: one of {', '.join(NAMES)}")
    return _PROFILES[name]


def check(name: str) -> None:
    """ValueError for an unknown kernel, or ``"mlx"`` where mlx is not installed (looked for, not
    imported). ``"numpy"`` (the reference) is accepted too."""
    if name not in NAMES:
        raise kvformat_errors.UnknownNameError(f"unknown backend {name!r}; choose from {', '.join(CHOICES)}")
    module: Backend = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    if profile(name).device and not module.available():
        raise kvformat_errors.InvalidArgumentError(
            f"backend {name!r} needs mlx: pip install 'kvsnap[capture]' (or mlx-cuda, mlx[cpu])"
        )


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
        raise kvformat_errors.UnknownNameError(f"unknown backend {name!r}: one of {', '.join(NAMES)}")
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
