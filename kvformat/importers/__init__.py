"""Foreign KV-cache files into `.kv`, one importer per format (`contract.Importer`; the registry,
`registry.importers`, finds every module here that defines ``IMPORTER``): go-mlx's MLXKV001
snapshots (`mlxkv`), and its State logs, KVST containers and bundle manifests into a series, one
snapshot per bundle (`bundles`). ``kvsnap import`` converts with them; a `.kv` reader given such a
file names that command. Imported on first use (``kvformat.import_mlxkv``).
"""

from kvformat.importers.bundles import BundleReport, import_bundles, list_bundles
from kvformat.importers.contract import Imported, Importer
from kvformat.importers.mlxkv import ImportReport, import_mlxkv
from kvformat.importers.registry import by_magic, for_source, importers, register

__all__ = [
    "BundleReport",
    "ImportReport",
    "Imported",
    "Importer",
    "by_magic",
    "for_source",
    "import_bundles",
    "import_mlxkv",
    "importers",
    "list_bundles",
    "register",
]
