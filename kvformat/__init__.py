"""kvformat: the `.kv` KV-cache snapshot format (see ``spec/SPEC.md``).

Reading::

    with kvformat.open("run.kv") as snap:
        h = snap.head(layer=3, head=1)      # h.k (n_tokens, k_dim), h.v, h.positions

    kvformat.open("https://host/run.kv")   # or s3://..., or filesystem=fsspec/pyarrow fs:
                                           # byte-range reads of the index and the chunks used

Writing: `save` for in-memory arrays, `Writer` to stream layers and token ranges as they come.
Importing: `import_mlxkv` converts a go-mlx MLXKV001 snapshot into a `.kv` file, `import_bundles`
a go-mlx State log, KVST container or bundle manifest into a series (one snapshot per bundle).
Depends only on numpy, zstandard, ml-dtypes and crc32c (fsspec, optional, for s3:// and other object
stores; HTTP uses the standard library).

The public API is `__all__` plus the modules of `PUBLIC_MODULES`: `kvformat.attention` (SPEC 10.1's
attention recomputed from a file), `kvformat.checksum` (CRC-32C and its combination over pieces),
`kvformat.codecs` and `kvformat.dtypes` (the format's codecs and element types by name),
`kvformat.errors` (every error class: `KVSnapError` at the root, `KVFormatError` for a file and
`UsageError` for a request),
`kvformat.channel_order` (the recorded RoPE channel order), `kvformat.sniff` (a file's kind from
its first bytes), `kvformat.pages` (page management for a pass over a whole file: batched reads,
releasing and prefetching pages; `kvformat.pages.of(snap)`), `kvformat.io` (local, HTTP and
object-store sources; the rule for every file written), `kvformat.importers` (go-mlx files) and
`kvformat.state` (a hybrid model's recurrent state, SPEC 15.4) and `kvformat.writer_process` (a
`Writer` run by a child process, fed through a pipe).
Every other module is the implementation.
"""

from typing import TYPE_CHECKING

from kvformat.channel_order import gguf_channel_order
from kvformat.codecs import BytePlaneZstd, Raw, Zstd
from kvformat.dtypes import BFLOAT16, FLOAT16, FLOAT32, DType
from kvformat.errors import (
    ChecksumError,
    CorruptFileError,
    ForeignFormatError,
    IncompleteRecoveryError,
    IncompleteSnapshotError,
    KVFormatError,
    KVSnapError,
    LimitExceededError,
    MissingKeysError,
    OutOfRangeError,
    RemoteError,
    RemoteNotFoundError,
    TruncatedFileError,
    UnsupportedFeatureError,
    UnsupportedVersionError,
    UsageError,
)
from kvformat.layout import MAJOR, MINOR
from kvformat.manifest import LayerSpec, Pooled, QuerySpec
from kvformat.pages import PayloadCheck
from kvformat.quantization import BITS as QUANTIZATION_BITS
from kvformat.quantization import Quantization
from kvformat.queries import Queries, Selection
from kvformat.reader import Head, Segment, Snapshot, VerifyReport, open
from kvformat.recover import RecoverReport, recover
from kvformat.saving import Layer, save, write_snapshot
from kvformat.writer import DEFAULT_CHUNK_BYTES, Writer

if TYPE_CHECKING:  # imported on first use (`__getattr__`)
    from kvformat.importers.bundles import BundleReport, import_bundles
    from kvformat.importers.mlxkv import ImportReport, import_mlxkv

__version__ = "0.1.0"
FORMAT_VERSION = (MAJOR, MINOR)
PUBLIC_MODULES = (
    "attention",
    "channel_order",
    "checksum",
    "codecs",
    "dtypes",
    "errors",
    "importers",
    "io",
    "pages",
    "sniff",
    "state",
    "writer_process",
)
"""Submodules that are part of the public API, beside `__all__`."""

__all__ = [
    "BFLOAT16",
    "DEFAULT_CHUNK_BYTES",
    "FLOAT16",
    "FLOAT32",
    "FORMAT_VERSION",
    "PUBLIC_MODULES",
    "QUANTIZATION_BITS",
    "BundleReport",
    "BytePlaneZstd",
    "ChecksumError",
    "CorruptFileError",
    "DType",
    "ForeignFormatError",
    "Head",
    "ImportReport",
    "IncompleteRecoveryError",
    "IncompleteSnapshotError",
    "KVFormatError",
    "KVSnapError",
    "Layer",
    "LayerSpec",
    "LimitExceededError",
    "MissingKeysError",
    "OutOfRangeError",
    "PayloadCheck",
    "Pooled",
    "Quantization",
    "Queries",
    "QuerySpec",
    "Raw",
    "RecoverReport",
    "RemoteError",
    "RemoteNotFoundError",
    "Segment",
    "Selection",
    "Snapshot",
    "TruncatedFileError",
    "UnsupportedFeatureError",
    "UnsupportedVersionError",
    "UsageError",
    "VerifyReport",
    "Writer",
    "Zstd",
    "gguf_channel_order",
    "import_bundles",
    "import_mlxkv",
    "open",
    "recover",
    "save",
    "write_snapshot",
]


def __getattr__(name: str) -> object:
    """The go-mlx importer on first use (most programs never import a foreign file)."""
    if name in ("ImportReport", "import_mlxkv"):
        from kvformat.importers import mlxkv

        return getattr(mlxkv, name)
    if name in ("BundleReport", "import_bundles"):
        from kvformat.importers import bundles

        return getattr(bundles, name)
    raise AttributeError(f"module 'kvformat' has no attribute {name!r}")
