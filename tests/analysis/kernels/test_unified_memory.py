"""`analysis.unified_memory` against a recording stand-in for the CUDA driver (this machine has no
GPU), and `mlx_staging.Staging`'s placement setting. The real driver is exercised on the H200
machine by `benchmarks/mlx_copy_bench.py --placements` (every placement's device results
checked against numpy)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvsnap.analysis.kernels import unified_memory
from kvsnap.analysis.kernels.unified_memory import UnifiedMemory, UnifiedMemoryError


class _Function:
    """A driver entry point: records its arguments, returns ``code``."""

    def __init__(self, calls: list[tuple[Any, ...]], name: str, code: int = 0) -> None:
        self.calls, self.name, self.code = calls, name, code
        self.argtypes: list[Any] = []

    def __call__(self, *args: Any) -> int:
        self.calls.append((self.name, *args))
        return self.code


class _Driver:
    """The entry points `UnifiedMemory` calls; ``v2``: whether the location-taking versions
    exist (CUDA 12.2 and later drivers)."""

    def __init__(self, v2: bool = True, failing: str = "") -> None:
        self.calls: list[tuple[Any, ...]] = []
        names = [
            "cuInit",
            "cuDeviceGet",
            "cuDevicePrimaryCtxRetain",
            "cuCtxSetCurrent",
            "cuStreamCreate",
            "cuStreamSynchronize",
            "cuMemAdvise",
            "cuMemPrefetchAsync",
            "cuPointerGetAttribute",
        ]
        if v2:
            names += ["cuMemAdvise_v2", "cuMemPrefetchAsync_v2"]
        for name in names:
            setattr(self, name, _Function(self.calls, name, 1 if name == failing else 0))

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [call[1:] for call in self.calls if call[0] == name]


def _location(argument: Any) -> tuple[int, int]:
    return (argument.type, argument.id)


def test_host_placement_prefers_host_memory_and_maps_it_for_the_device() -> None:
    driver = _Driver()
    memory = UnifiedMemory(driver, device=0)  # type: ignore[arg-type]
    memory.place(0x1000, 4096, "host")
    advice = driver.named("cuMemAdvise_v2")
    # preferred location: host (type 2); accessed by: device 0 (type 1)
    assert [(a[0], a[1], a[2], _location(a[3])) for a in advice] == [
        (0x1000, 4096, 3, (2, 0)),
        (0x1000, 4096, 5, (1, 0)),
    ]
    assert driver.named("cuCtxSetCurrent"), "a context must be current for the advice"
    memory.unplace(0x1000, 4096, "host")
    assert [a[2] for a in driver.named("cuMemAdvise_v2")[2:]] == [4, 6]


def test_older_drivers_get_the_device_ordinal_calls() -> None:
    driver = _Driver(v2=False)
    memory = UnifiedMemory(driver, device=0)  # type: ignore[arg-type]
    memory.place(0x2000, 8192, "host")
    memory.place(0x2000, 8192, "mostly")
    # CU_DEVICE_CPU is -1 in the version 1 calls
    assert driver.named("cuMemAdvise") == [(0x2000, 8192, 3, -1), (0x2000, 8192, 5, 0), (0x2000, 8192, 1, 0)]
    memory.prefetch(0x2000, 8192)
    (prefetch,) = driver.named("cuMemPrefetchAsync")
    assert prefetch[:3] == (0x2000, 8192, 0)
    assert len(driver.named("cuStreamSynchronize")) == 1


def test_prefetch_moves_then_waits_on_its_own_stream() -> None:
    driver = _Driver()
    memory = UnifiedMemory(driver, device=0)  # type: ignore[arg-type]
    memory.prefetch(0x3000, 65536)
    memory.prefetch(0x3000, 65536, host=True)
    first, second = driver.named("cuMemPrefetchAsync_v2")
    assert _location(first[2]) == (1, 0) and _location(second[2]) == (2, 0)
    assert len(driver.named("cuStreamCreate")) == 1  # one stream per thread, reused
    assert [call[0] for call in driver.calls if "Prefetch" in call[0] or "Synchronize" in call[0]] == [
        "cuMemPrefetchAsync_v2",
        "cuStreamSynchronize",
        "cuMemPrefetchAsync_v2",
        "cuStreamSynchronize",
    ]


def test_fault_sets_nothing_and_unknown_modes_are_refused() -> None:
    driver = _Driver()
    memory = UnifiedMemory(driver, device=0)  # type: ignore[arg-type]
    memory.place(0x1000, 4096, "fault")
    assert not driver.named("cuMemAdvise_v2")
    with pytest.raises(ValueError, match="unknown placement 'pinned'"):
        memory.place(0x1000, 4096, "pinned")


def test_a_failing_driver_call_is_named() -> None:
    memory = UnifiedMemory(_Driver(failing="cuMemAdvise_v2"), device=0)  # type: ignore[arg-type]
    with pytest.raises(UnifiedMemoryError, match="cuMemAdvise_v2 failed with CUresult 1"):
        memory.place(0x1000, 4096, "host")
    with pytest.raises(UnifiedMemoryError, match="cuDeviceGet"):
        UnifiedMemory(_Driver(failing="cuDeviceGet"), device=0)  # type: ignore[arg-type]


def test_load_without_a_driver_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unified_memory, "_LOADED", {})
    monkeypatch.setattr(unified_memory.cuda_driver, "driver", lambda: None)
    assert UnifiedMemory.load() is None
    monkeypatch.setattr(unified_memory, "_LOADED", {})
    monkeypatch.setattr(unified_memory.cuda_driver, "driver", lambda: _Driver(failing="cuInit"))
    assert UnifiedMemory.load() is None  # a driver without a usable device


def test_load_is_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    drivers: list[_Driver] = []

    def opened(name: str) -> _Driver:
        drivers.append(_Driver())
        return drivers[-1]

    monkeypatch.setattr(unified_memory, "_LOADED", {})
    monkeypatch.setattr(unified_memory.cuda_driver, "driver", lambda: opened("libcuda.so.1"))
    first = UnifiedMemory.load()
    assert first is not None and UnifiedMemory.load() is first
    assert len(drivers) == 1 and len(drivers[0].named("cuDevicePrimaryCtxRetain")) == 1


def test_is_managed_reads_the_pointer_attribute() -> None:
    driver = _Driver()
    memory = UnifiedMemory(driver, device=0)  # type: ignore[arg-type]
    assert memory.is_managed(0x1000) is False  # the stand-in leaves the flag at 0
    (call,) = driver.named("cuPointerGetAttribute")
    assert call[1:] == (8, 0x1000)  # CU_POINTER_ATTRIBUTE_IS_MANAGED


def test_staging_refuses_an_unknown_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvsnap.analysis.kernels.mlx_staging import Staging

    monkeypatch.setenv("KVSNAP_MLX_STAGING", "pinned")
    with pytest.raises(ValueError, match="KVSNAP_MLX_STAGING='pinned': one of fault, host, prefetch, mostly"):
        Staging(1)


def test_staging_off_cuda_sets_no_hints() -> None:
    from kvsnap.analysis.kernels.mlx_staging import Staging

    staging = Staging(2, placement="host")
    try:
        rows = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
        _, stacked = staging.fill([rows, rows + 1])
        assert staging.memory is None and not staging.managed
        assert np.array_equal(np.array(stacked), np.stack([rows, rows + 1]))
    finally:
        staging.close()


def test_the_float32_copy_changes_no_result() -> None:
    """``copy`` (float32 rows read over the bus) computes what the plain path computes."""
    from kvsnap.analysis.kernels import mlx as mlx_backend
    from kvsnap.analysis.kernels import mlx_fold
    from kvsnap.analysis.kernels.arrays import PIECE

    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((2, PIECE, 64)) * np.linspace(0.1, 4, 64)).astype(np.float32)
    rows[0, 5, 7] = 900.0  # a massive row: the Gram leaves it out
    bins = mx.array(np.stack([mlx_fold.piece_bins(np.arange(PIECE))] * 2))
    flags = (True, True, False, True, True, True)
    plain = mlx_backend.piece_function(*flags, batched=True)(mx.array(rows), bins)
    copied = mlx_backend.piece_function(*flags, batched=True, copy=True)(mx.array(rows), bins)
    assert plain.keys() == copied.keys()
    for name in plain:
        assert np.array_equal(np.array(plain[name]), np.array(copied[name]), equal_nan=True), name


def test_a_failing_hint_turns_the_placement_off_not_the_pass() -> None:
    """A driver call that fails while placing a staging buffer warns once and leaves the pass
    to the driver's defaults (hints only move pages): the rows still arrive."""
    from kvsnap.analysis.kernels.mlx_staging import Staging

    class Refusing:
        def is_managed(self, address: int) -> bool:
            return True

        def place(self, address: int, size: int, mode: str) -> None:
            raise UnifiedMemoryError("cuMemAdvise_v2 failed with CUresult 801")

    staging = Staging(2, placement="host")
    staging.memory = Refusing()  # type: ignore[assignment]
    try:
        rows = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
        with pytest.warns(RuntimeWarning, match="placement 'host' off: cuMemAdvise_v2 failed"):
            _, stacked = staging.fill([rows])
        assert staging.memory is None and not staging.managed
        assert np.array_equal(np.array(stacked)[0], rows)
    finally:
        staging.close()
