"""What a file is, from its first bytes: a kvsnap ``.kv`` file, a go-mlx MLXKV001 snapshot, a go-mlx
State log or ``KVST`` container, a GGUF model, a zip (``.npz``) archive, or none of these. Nothing is
parsed beyond the magic."""

from __future__ import annotations

KV = b"\x89KVS\r\n\x1a\n"  # kvsnap .kv (SPEC section 3)
MLXKV = b"MLXKV001"  # go-mlx snapshot (kvformat.importers.mlxkv)
KVST = b"KVST"  # go-mlx state-pack container (kvformat.importers.statelog); also named *.kv
STATE_LOGS = (b"go-inference-state-file-log-v1\n", b"go-mlx-memvid-file-log-v1\n")  # *.mvlog
GGUF = b"GGUF"
ZIP = b"PK\x03\x04"  # numpy's .npz

MAGICS = {"kv": KV, "mlxkv": MLXKV, "kvst": KVST, "statelog": STATE_LOGS[0], "statelog-legacy": STATE_LOGS[1]}
MAGICS |= {"gguf": GGUF, "npz": ZIP}
PREFIX_BYTES = max(len(magic) for magic in MAGICS.values())


def kind(prefix: bytes) -> str | None:
    """The name in `MAGICS` of a file starting with ``prefix`` (at least `PREFIX_BYTES` of it,
    where the file has them), else None."""
    for name, magic in MAGICS.items():
        if prefix[: len(magic)] == magic:
            return name
    return None


def is_go_mlx(prefix: bytes) -> bool:
    """Whether a file starting with ``prefix`` is a go-mlx file ``kvsnap import`` reads: an MLXKV001
    snapshot, a State log or a ``KVST`` container."""
    return kind(prefix) in ("mlxkv", "kvst", "statelog", "statelog-legacy")
