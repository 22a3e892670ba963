"""What every importer of a foreign KV-cache format is: `Importer` (recognise a file by its first
bytes, convert it into a `.kv` file, optionally list what it holds) and `Imported` (what a
conversion wrote, in one line for the user). A new format is one module in `kvformat.importers`
defining an `Importer` subclass as ``IMPORTER``: the registry (`kvformat.importers.registry`)
finds it, ``kvsnap import`` converts with it, and a reader given such a file names the command
(`kvformat.ForeignFormatError`)."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from kvformat.codecs import Codec
from kvformat.errors import UnsupportedFeatureError


@dataclass(frozen=True)
class Imported:
    """What an import wrote: the `.kv` file and one line saying what it holds."""

    path: str
    summary: str


class Importer(ABC):
    """One foreign format (a family of files) and its conversion into `.kv`."""

    name: ClassVar[str]
    """Short name, as ``kvsnap import --format NAME`` takes it (``mlxkv``)."""
    description: ClassVar[str]
    """What its files are, for messages (``go-mlx MLXKV001 snapshot``)."""
    magics: ClassVar[tuple[bytes, ...]] = ()
    """The first bytes of its files; `recognises` compares them."""

    def recognises(self, prefix: bytes) -> bool:
        """Whether a file beginning with ``prefix`` (its first 64 bytes, or all of a shorter
        file) is this format's."""
        return any(prefix.startswith(magic) for magic in self.magics)

    def what(self, prefix: bytes) -> str:
        """What the file beginning with ``prefix`` is, for a message (`description` by default)."""
        return self.description

    @abstractmethod
    def convert(
        self,
        source: str | os.PathLike[str],
        output: str | os.PathLike[str],
        *,
        codec: str | Codec = "raw",
        overwrite: bool = False,
        **options: Any,
    ) -> Imported:
        """Write ``source`` as the `.kv` file ``output`` (never replacing an existing file unless
        ``overwrite``; never leaving a partial one). A malformed source raises a
        `kvformat.KVFormatError` naming the problem; an option the format does not take raises
        `kvformat.errors.InvalidArgumentError`."""

    def listing(self, source: str | os.PathLike[str]) -> list[str]:
        """Lines describing what ``source`` holds, without converting it (``kvsnap import
        --list``). Formats without parts to list refuse."""
        raise UnsupportedFeatureError(f"{os.fspath(source)}: a {self.description} holds nothing to list")
