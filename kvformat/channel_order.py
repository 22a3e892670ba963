"""Which channel order a file's K is in, read from its metadata (SPEC section 15.1, ``rope``).

RoPE rotates pairs of channels. A checkpoint (safetensors, transformers, mlx-lm loading it) pairs
channel ``i`` with ``i + dims/2`` (``pairing: "half"``). llama.cpp permutes the q/k projection rows
of llama-family models in its GGUF files so that the pairs become ``(2i, 2i+1)``; a capture from a
GGUF conversion that kept that permutation (kvsnap before conversion 3) records
``pairing: "interleaved"`` and holds K in llama.cpp's order, not the checkpoint's.
"""

from __future__ import annotations

from typing import Any


def gguf_channel_order(metadata: dict[str, Any]) -> bool:
    """Whether K is in llama.cpp's GGUF channel order: a llama-family capture from a GGUF
    conversion with interleaved RoPE pairing."""
    model = metadata.get("model")
    rope = metadata.get("rope")
    if not isinstance(model, dict) or not isinstance(rope, dict):
        return False
    return (
        isinstance(model.get("gguf"), dict)
        and model.get("architecture") == "llama"
        and rope.get("pairing") == "interleaved"
    )


def describe(metadata: dict[str, Any]) -> str | None:
    """One line for ``kvsnap info``: the RoPE pairing and whether it is the checkpoint's order;
    None when the file records no RoPE."""
    rope = metadata.get("rope")
    if not isinstance(rope, dict) or rope.get("pairing") not in ("interleaved", "half"):
        return None
    if gguf_channel_order(metadata):
        return (
            "llama.cpp's GGUF order, RoPE pairs (2i, 2i+1), not the checkpoint's "
            "(kvsnap.checkpoint_keys(snap, layer, head) reorders it)"
        )
    if rope["pairing"] == "half":
        return "RoPE pairs (i, i + dims/2), the checkpoint's order"
    return "RoPE pairs (2i, 2i+1), as the model's checkpoint pairs them"
