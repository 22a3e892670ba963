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
"""

from typing import TYPE_CHECKING

from kvformat.codecs import BytePlaneZstd, Raw, Zstd
from kvformat.dtypes import BFLOAT16, FLOAT16, FLOAT32, DType
from kvformat.errors import (
    ChecksumError,
    CorruptFileError,
    ForeignFormatError,
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
)
from kvformat.layout import MAJOR, MINOR
from kvformat.manifest import LayerSpec
from kvformat.reader import Head, Segment, Snapshot, VerifyReport, open
from kvformat.recover import RecoverReport, recover
from kvformat.saving import Layer, save, write_snapshot
from kvformat.writer import Writer

if TYPE_CHECKING:  # imported on first use (`__getattr__`)
    from kvformat.bundles import BundleReport, import_bundles
    from kvformat.mlxkv import ImportReport, import_mlxkv

__version__ = "0.1.0"
FORMAT_VERSION = (MAJOR, MINOR)

__all__ = [
    "BFLOAT16",
    "FLOAT16",
    "FLOAT32",
    "FORMAT_VERSION",
    "BundleReport",
    "BytePlaneZstd",
    "ChecksumError",
    "CorruptFileError",
    "DType",
    "ForeignFormatError",
    "Head",
    "ImportReport",
    "KVFormatError",
    "KVSnapError",
    "Layer",
    "LayerSpec",
    "LimitExceededError",
    "MissingKeysError",
    "OutOfRangeError",
    "Raw",
    "RecoverReport",
    "RemoteError",
    "RemoteNotFoundError",
    "Segment",
    "Snapshot",
    "TruncatedFileError",
    "UnsupportedFeatureError",
    "UnsupportedVersionError",
    "VerifyReport",
    "Writer",
    "Zstd",
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
        from kvformat import mlxkv

        return getattr(mlxkv, name)
    if name in ("BundleReport", "import_bundles"):
        from kvformat import bundles

        return getattr(bundles, name)
    raise AttributeError(f"module 'kvformat' has no attribute {name!r}")
