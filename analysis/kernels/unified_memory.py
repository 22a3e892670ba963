"""Placement hints for CUDA managed memory, through the CUDA driver (``libcuda``) with ctypes.

mlx's CUDA backend gives an array whose memory the host touches (the buffer protocol, as
`mlx_staging.Staging` uses) CUDA managed memory. By default its pages move on demand, one fault at
a time: the device faults the rows the host just wrote in, the host faults them back at its next
write into the same buffer. This module tells the driver where such a buffer should live instead:

- ``host``: the pages stay in host memory and the device reads them in place over the bus
  (``SET_PREFERRED_LOCATION`` host, ``SET_ACCESSED_BY`` the device): nothing moves, no faults.
- ``prefetch``: after each host write the whole buffer is moved to the device in one transfer
  (``cuMemPrefetchAsync``) before the device reads it.
- ``mostly``: ``SET_READ_MOSTLY``: a prefetch copies the pages to the device and keeps the host's;
  the host's next write only drops the device's copy.

Nothing here imports mlx; everything is a no-op (`UnifiedMemory.load` gives None) where
``libcuda`` is missing (macOS, CPU-only Linux) or the pointer is not managed memory.
"""

from __future__ import annotations

import ctypes
import threading
from typing import ClassVar

from kvformat import KVSnapError
from kvformat.errors import UnknownNameError

from . import cuda_driver

MODES = ("fault", "host", "prefetch", "mostly")
"""``fault``: the driver's default (no hint); the others as in the module's docstring."""

# CUmem_advise (each UNSET is its SET + 1)
_SET_READ_MOSTLY = 1
_SET_PREFERRED_LOCATION = 3
_SET_ACCESSED_BY = 5
# CUmemLocationType
_LOCATION_DEVICE = 1
_LOCATION_HOST = 2
_CPU_DEVICE = -1  # CU_DEVICE_CPU in the version 1 calls
_POINTER_IS_MANAGED = 8  # CU_POINTER_ATTRIBUTE_IS_MANAGED
_STREAM_NON_BLOCKING = 1


class _Location(ctypes.Structure):
    _fields_: ClassVar = [("type", ctypes.c_int), ("id", ctypes.c_int)]


_LOADED: dict[int, UnifiedMemory | None] = {}
_LOCK = threading.Lock()


class UnifiedMemoryError(KVSnapError, RuntimeError):
    """A CUDA driver call failed (its name and CUresult code in the message)."""


class UnifiedMemory:
    """The driver calls this module needs, bound to ``device`` (an ordinal)."""

    def __init__(self, library: ctypes.CDLL, device: int = 0) -> None:
        self._cuda = library
        self.device = device
        self._local = threading.local()
        self._context = ctypes.c_void_p()
        self._check("cuInit", library.cuInit(0))
        handle = ctypes.c_int()
        self._check("cuDeviceGet", library.cuDeviceGet(ctypes.byref(handle), device))
        self._handle = handle.value
        # the primary context: the one the CUDA runtime (and so mlx) uses on this device
        self._check(
            "cuDevicePrimaryCtxRetain",
            library.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), self._handle),
        )
        self._advise_v2 = getattr(library, "cuMemAdvise_v2", None)
        self._prefetch_v2 = getattr(library, "cuMemPrefetchAsync_v2", None)
        if self._advise_v2 is not None:
            self._advise_v2.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _Location]
        if self._prefetch_v2 is not None:
            self._prefetch_v2.argtypes = [
                ctypes.c_uint64,
                ctypes.c_size_t,
                _Location,
                ctypes.c_uint,
                ctypes.c_void_p,
            ]
        size, address = ctypes.c_size_t, ctypes.c_uint64
        library.cuMemAdvise.argtypes = [address, size, ctypes.c_int, ctypes.c_int]
        library.cuMemPrefetchAsync.argtypes = [address, size, ctypes.c_int, ctypes.c_void_p]
        library.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, address]

    @classmethod
    def load(cls, device: int = 0) -> UnifiedMemory | None:
        """The driver's calls on ``device``, or None where there is no CUDA driver or it fails;
        made once per process and device (the primary context is retained once)."""
        with _LOCK:
            if device not in _LOADED:
                _LOADED[device] = cls._load(device)
            return _LOADED[device]

    @classmethod
    def _load(cls, device: int) -> UnifiedMemory | None:
        library = cuda_driver.driver()
        if library is None:
            return None
        try:
            return cls(library, device)
        except (UnifiedMemoryError, AttributeError):
            return None

    @staticmethod
    def _check(name: str, code: int) -> None:
        if code != 0:
            raise UnifiedMemoryError(f"{name} failed with CUresult {code}")

    def _current(self) -> None:
        """Make the device's primary context current on this thread (once per thread)."""
        if getattr(self._local, "ready", False):
            return
        self._check("cuCtxSetCurrent", self._cuda.cuCtxSetCurrent(self._context))
        self._local.ready = True

    def _stream(self) -> ctypes.c_void_p:
        """This thread's non-blocking stream for prefetches (created on first use)."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            self._current()
            stream = ctypes.c_void_p()
            self._check(
                "cuStreamCreate", self._cuda.cuStreamCreate(ctypes.byref(stream), _STREAM_NON_BLOCKING)
            )
            self._local.stream = stream
        return stream

    def is_managed(self, address: int) -> bool:
        """Whether ``address`` lies in CUDA managed memory."""
        self._current()
        value = ctypes.c_uint(0)
        code = self._cuda.cuPointerGetAttribute(ctypes.byref(value), _POINTER_IS_MANAGED, address)
        return code == 0 and bool(value.value)

    def _advise(self, address: int, size: int, advice: int, host: bool) -> None:
        self._current()
        if self._advise_v2 is not None:
            location = _Location(_LOCATION_HOST if host else _LOCATION_DEVICE, 0 if host else self._handle)
            self._check("cuMemAdvise_v2", self._advise_v2(address, size, advice, location))
        else:
            target = _CPU_DEVICE if host else self._handle
            self._check("cuMemAdvise", self._cuda.cuMemAdvise(address, size, advice, target))

    def place(self, address: int, size: int, mode: str) -> None:
        """Set the hints of ``mode`` (`MODES`) on ``size`` bytes of managed memory at ``address``."""
        if mode == "host":
            self._advise(address, size, _SET_PREFERRED_LOCATION, host=True)
            self._advise(address, size, _SET_ACCESSED_BY, host=False)
        elif mode == "mostly":
            self._advise(address, size, _SET_READ_MOSTLY, host=False)
        elif mode not in MODES:
            raise UnknownNameError(f"unknown placement {mode!r}: one of {', '.join(MODES)}")

    def unplace(self, address: int, size: int, mode: str) -> None:
        """Clear the hints `place` set for ``mode``."""
        if mode == "host":
            self._advise(address, size, _SET_PREFERRED_LOCATION + 1, host=True)
            self._advise(address, size, _SET_ACCESSED_BY + 1, host=False)
        elif mode == "mostly":
            self._advise(address, size, _SET_READ_MOSTLY + 1, host=False)

    def prefetch(self, address: int, size: int, host: bool = False) -> None:
        """Move ``size`` bytes at ``address`` to the device (to the host if ``host``) on this
        thread's stream, and wait for the move."""
        stream = self._stream()
        if self._prefetch_v2 is not None:
            location = _Location(_LOCATION_HOST if host else _LOCATION_DEVICE, 0 if host else self._handle)
            code = self._prefetch_v2(address, size, location, 0, stream)
            self._check("cuMemPrefetchAsync_v2", code)
        else:
            target = _CPU_DEVICE if host else self._handle
            self._check("cuMemPrefetchAsync", self._cuda.cuMemPrefetchAsync(address, size, target, stream))
        self._check("cuStreamSynchronize", self._cuda.cuStreamSynchronize(stream))
