"""Foreign KV-cache files into `.kv`: go-mlx's MLXKV001 snapshots (`mlxkv.import_mlxkv`), and its
State logs, KVST containers and bundle manifests into a series, one snapshot per bundle
(`bundles.import_bundles`); `kvformat.sniff`
recognises them by their first bytes. Imported on first use (``kvformat.import_mlxkv``).
"""

from kvformat.importers.bundles import BundleReport, import_bundles, list_bundles
from kvformat.importers.mlxkv import ImportReport, import_mlxkv

__all__ = ["BundleReport", "ImportReport", "import_bundles", "import_mlxkv", "list_bundles"]
