"""Recurrent state in a snapshot (SPEC 15.4): which arrays a layer's ``state`` attribute
describes, their names, and reading one back in its own shape.

A hybrid or state-space model's layer keeps, per slot, an array whose first axis is the sequence
(batch): ``(S, a, b, ...)``, or ``(S, H, a, b, ...)`` with a head axis (4 or more axes). Each is
attached to every snapshot as array chunks named ``state/{layer}/{slot}`` or, one per head,
``state/{layer}/{slot}/{head}``; integer slots are stored bit for bit as float32 words.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvformat import dtypes, pages
from kvformat.errors import CorruptFileError

PREFIX = "state"

WORDS: dict[str, int] = {"int32": 1, "uint32": 1, "int64": 2, "uint64": 2}
"""Integer slot types and the float32 words each element takes (SPEC 15.4)."""


def array_name(layer: int, slot: int, head: int | None = None) -> str:
    """The snapshot array name of a slot (and head) of a layer's state."""
    return f"{PREFIX}/{layer}/{slot}" if head is None else f"{PREFIX}/{layer}/{slot}/{head}"


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a slot's ``dtype`` name: a format element type or an integer type."""
    return np.dtype(name) if name in WORDS else dtypes.from_name(name).numpy


def checked(layer: int, described: Any) -> list[dict[str, Any] | None]:
    """A layer's ``state`` attribute, checked to be a state description (SPEC 15.2): a list of
    ``null`` or ``{"shape", "dtype", "heads", ...}``; anything else is `CorruptFileError` naming
    the layer."""
    ok = isinstance(described, list) and len(described) <= 1024 and all(map(_slot_described, described))
    if not ok:
        raise CorruptFileError(f"layer {layer}: its 'state' attribute is not a state description (SPEC 15.4)")
    return described


def _slot_described(entry: Any) -> bool:
    """Whether one entry of a ``state`` attribute is ``null`` or a slot's description."""
    if entry is None:
        return True
    if not isinstance(entry, dict):
        return False
    shape, heads, dtype = entry.get("shape"), entry.get("heads"), entry.get("dtype")
    if not _shape_described(shape) or not (
        isinstance(dtype, str) and (dtype in dtypes.BY_NAME or dtype in WORDS)
    ):
        return False
    assert isinstance(shape, list)
    return heads is None if len(shape) < 4 else heads == shape[1]


def _shape_described(shape: Any) -> bool:
    """A list of 1 to 8 integers in ``0 .. 2^40``."""
    return (
        isinstance(shape, list)
        and 1 <= len(shape) <= 8
        and all(type(n) is int and 0 <= n < 2**40 for n in shape)
    )


@dataclass(frozen=True)
class StateArray:
    """One stored array of a layer's state: a slot, or one head of a slot with a head axis.
    ``shape`` is the array's own, sequence axis first (a head's: the slot's without axis 1)."""

    layer: int
    slot: int
    head: int | None
    role: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def name(self) -> str:
        return array_name(self.layer, self.slot, self.head)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize


def state_arrays(layers: Any) -> Iterator[StateArray]:
    """Every state array the layers (a snapshot's ``layers``: `LayerSpec` objects) describe, in
    layer, slot and head order."""
    for index, spec in enumerate(layers):
        attributes = getattr(spec, "attributes", None) or {}
        if "state" not in attributes:
            continue
        for slot, entry in enumerate(checked(index, attributes["state"])):
            if entry is None:
                continue
            shape = tuple(entry["shape"])
            role = str(entry.get("role", f"slot{slot}"))
            if entry["heads"] is None:
                yield StateArray(index, slot, None, role, shape, entry["dtype"])
            else:
                for head in range(entry["heads"]):
                    yield StateArray(index, slot, head, role, (shape[0], *shape[2:]), entry["dtype"])


def read(snapshot: Any, array: StateArray, *, release: bool = False) -> np.ndarray | None:
    """The array in its own shape and type, or None where the snapshot holds none (no state at
    that moment); a stored array of another size is `CorruptFileError`. ``release``: a copy, and
    the chunk's pages are dropped from the process (a pass over every snapshot's state keeps a
    resident set of one array, not of the file)."""
    stored = snapshot.array(array.name)
    if stored is None:
        return None
    dtype = numpy_dtype(array.dtype)
    stored = np.array(stored) if release else np.ascontiguousarray(stored)
    if release:
        pages.of(snapshot).release_chunk(snapshot.array_chunk(array.name))
    if array.dtype in WORDS:
        if stored.dtype != np.float32:
            raise CorruptFileError(f"state array {array.name!r}: integer slots are stored as float32 words")
        stored = stored.view(dtype)
    if stored.size != math.prod(array.shape) or stored.dtype != dtype:
        raise CorruptFileError(
            f"state array {array.name!r} holds {stored.shape} {stored.dtype}; the layer describes "
            f"{list(array.shape)} {array.dtype}"
        )
    return stored.reshape(array.shape)
