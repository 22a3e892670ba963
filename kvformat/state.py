"""Recurrent state in a snapshot (SPEC 15.4): which arrays a layer's ``state`` attribute
describes, their names, and reading one back in its own shape.

A hybrid or state-space model's layer keeps, per slot, an array whose first axis is the sequence
(batch): ``(S, a, b, ...)``, or ``(S, H, a, b, ...)`` with a head axis (4 or more axes). Each is
attached to every snapshot as array chunks named ``state/{layer}/{slot}`` or, one per head,
``state/{layer}/{slot}/{head}``; integer slots are stored bit for bit as float32 words. A slot
whose axis 1 changes length between snapshots (deepseek_v41's sliding window, compressed groups
and open group) is described with ``null`` there; each snapshot's array gives its length. One
whose rows are only ever appended (its compressed groups, their index keys) is ``append``: a
snapshot with a parent stores only the rows added since it, so a series stores each row once.
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
    if not _shape_described(shape):
        return False
    assert isinstance(shape, list)
    if not (
        (isinstance(dtype, str) and (dtype in dtypes.BY_NAME or dtype in WORDS))
        or (dtype is None and len(shape) == 3 and shape[1] is None)  # a slot not set yet
    ):
        return False
    append, last = entry.get("append", False), entry.get("last")
    if type(append) is not bool or (append and not (len(shape) == 3 and shape[1] is None)):
        return False  # appended rows: a growing (S, n, b) slot only
    if last is not None and not (append and type(last) is int and 1 <= last < 2**40):
        return False  # the last rows of an appended slot only
    return heads is None if len(shape) < 4 else heads == shape[1]


def _shape_described(shape: Any) -> bool:
    """A list of 1 to 8 integers in ``0 .. 2^40``; of 2 or 3 items, its second MAY be ``null``
    (an axis that grows: the length each snapshot's array has), and of 3 items with a growing
    second, its third too (the width each snapshot's chunk has)."""
    return (
        isinstance(shape, list)
        and 1 <= len(shape) <= 8
        and all(
            (type(n) is int and 0 <= n < 2**40)
            or (n is None and len(shape) <= 3 and (i == 1 or (i == 2 and shape[1] is None)))
            for i, n in enumerate(shape)
        )
    )


@dataclass(frozen=True)
class StateArray:
    """One stored array of a layer's state: a slot, or one head of a slot with a head axis.
    ``shape`` is the array's own, sequence axis first (a head's: the slot's without axis 1);
    None at axis 1 where its length changes between snapshots (`read` gives each one's)."""

    layer: int
    slot: int
    head: int | None
    role: str
    shape: tuple[int | None, ...]
    dtype: str | None  # None: a slot not set when the file was written (its chunks' float type)
    append: bool = False  # only rows appended: a snapshot stores those added since its parent
    last: int | None = None  # an appended slot holding only its last rows (a sliding window)

    @property
    def name(self) -> str:
        return array_name(self.layer, self.slot, self.head)

    @property
    def grows(self) -> bool:
        """Whether axis 1's length is each snapshot's own (described as ``null``)."""
        return None in self.shape

    @property
    def nbytes(self) -> int:
        """Bytes of one snapshot's array (a growing axis counted as 0 long)."""
        if self.dtype is None:
            return 0
        return math.prod(n or 0 for n in self.shape) * numpy_dtype(self.dtype).itemsize


def state_arrays(layers: Any) -> Iterator[StateArray]:
    """Every state array the layers (a snapshot's ``layers``: `LayerSpec` objects) describe, in
    layer, slot and head order."""
    for index, spec in enumerate(layers):
        attributes = getattr(spec, "attributes", None) or {}
        if "state" not in attributes:
            continue
        for slot, entry in enumerate(checked(index, attributes["state"])):
            if entry is not None:
                yield from slot_arrays(index, slot, entry)


def slot_arrays(layer: int, slot: int, entry: dict[str, Any]) -> list[StateArray]:
    """The stored arrays of one slot described by ``entry`` (checked): itself, or one per head."""
    shape, dtype = tuple(entry["shape"]), entry["dtype"]
    role = str(entry.get("role", f"slot{slot}"))
    if entry["heads"] is None:
        return [
            StateArray(layer, slot, None, role, shape, dtype, bool(entry.get("append")), entry.get("last"))
        ]
    return [
        StateArray(layer, slot, head, role, (shape[0], *shape[2:]), dtype) for head in range(entry["heads"])
    ]


def read(snapshot: Any, array: StateArray, *, release: bool = False) -> np.ndarray | None:
    """The array in its own shape and type, or None where the snapshot holds none (no state at
    that moment); a stored array of another size is `CorruptFileError`. ``release``: a copy, and
    the chunk's pages are dropped from the process (a pass over every snapshot's state keeps a
    resident set of one array, not of the file). An appended slot (``append``) is the rows
    every snapshot of the parent chain added, oldest first, along axis 1 (with ``last``: the
    last ``last`` of them; the chain is read back only as far as they reach)."""
    if not array.append:
        return _stored(snapshot, array, release)
    parts: list[np.ndarray] = []
    rows = 0
    current: Any = snapshot
    for _ in range(snapshot.num_snapshots):  # parents are earlier snapshots: a chain ends
        found = _stored(current, array, release)
        if found is not None:
            parts.append(found)
            rows += found.shape[1]
        if current.parent is None or (array.last is not None and rows >= array.last):
            break
        current = current.select(current.parent)
    if not parts:
        return None
    joined = parts[0] if len(parts) == 1 else np.concatenate(parts[::-1], axis=1)
    return joined if array.last is None else joined[:, -array.last :]


def _stored(snapshot: Any, array: StateArray, release: bool) -> np.ndarray | None:
    """What ``snapshot`` itself stores of ``array``, in its own shape, or None."""
    stored = snapshot.array(array.name)
    if stored is None:
        return None
    dtype = stored.dtype if array.dtype is None else numpy_dtype(array.dtype)
    stored = np.array(stored) if release else np.ascontiguousarray(stored)
    if release:
        pages.of(snapshot).release_chunk(snapshot.array_chunk(array.name))
    if array.dtype is not None and array.dtype in WORDS:
        if stored.dtype != np.float32:
            raise CorruptFileError(f"state array {array.name!r}: integer slots are stored as float32 words")
        stored = stored.view(dtype)
    shape = grown_shape(array.shape, stored.shape)
    if shape is None or stored.size != math.prod(shape) or stored.dtype != dtype:
        raise CorruptFileError(
            f"state array {array.name!r} holds {stored.shape} {stored.dtype}; the layer describes "
            f"{list(array.shape)} {array.dtype}"
        )
    return stored.reshape(shape)


def grown_shape(shape: tuple[int | None, ...], stored: tuple[int, ...]) -> tuple[int, ...] | None:
    """``shape`` with its growing axes (None: axis 1, and axis 2 of a slot not yet set when the
    file was written) given by the stored chunk array ``stored`` ``(rows, width)``, or None where
    the chunk holds no whole rows of it; ``shape`` itself where nothing grows."""
    if None not in shape:
        return tuple(int(n) for n in shape)  # type: ignore[arg-type]
    rows, width = (stored[0], stored[1]) if len(stored) == 2 else (0, 0)
    batch = int(shape[0])  # type: ignore[arg-type]
    if len(stored) != 2 or batch == 0 or rows % batch:
        return None
    if len(shape) == 2:
        return (batch, width) if rows == batch else None
    third = width if shape[2] is None else int(shape[2])
    return (batch, rows // batch, third) if third == width else None
