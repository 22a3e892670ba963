"""The index section that ends every finished file: chunk table, index JSON and footer (SPEC
sections 7-9). Written by `Writer.close` and by `recover`."""

from __future__ import annotations

from collections.abc import Sequence

from kvformat.checksum import crc32c
from kvformat.layout import DESCRIPTOR_SIZE, Footer, pack_header
from kvformat.manifest import Manifest, dumps, format_minor
from kvformat.series import APPEND_CHUNKS, Entry


def index_bytes(
    index_offset: int, table: Sequence[bytes], manifest: Manifest, snapshots: Sequence[Entry]
) -> bytes:
    """Chunk table, index JSON and footer for a file whose records end at ``index_offset``;
    ``table``: the packed descriptors of every table chunk in chunk order, in blocks of any
    number of 64-byte descriptors."""
    joined = b"".join(table)
    document = manifest.to_json()
    if any(s.chunk_ranges.size for s in snapshots) and APPEND_CHUNKS not in manifest.required_features:
        document["required_features"] = [*manifest.required_features, APPEND_CHUNKS]
    index_json = dumps({"manifest": document, "snapshots": [s.to_json() for s in snapshots]})
    minor = format_minor(manifest)
    crc = crc32c(index_json, crc32c(joined, crc32c(pack_header(minor))))
    footer = Footer(index_offset, len(joined) // DESCRIPTOR_SIZE, len(index_json), crc, minor).pack()
    return joined + index_json + footer
