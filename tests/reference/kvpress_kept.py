"""NVIDIA kvpress's own presses on Hugging Face transformers: which keys each press keeps for given
token ids, the reference `tests/analysis/attention/test_kvpress.py` holds ``kvsnap simulate``'s
choices to. Runs in the reference Python (``make reference``: torch, transformers, kvpress),
never imports kvsnap.

    python kvpress_kept.py MODEL.gguf IDS.json PRESSES.json OUT.npz

``PRESSES.json``: a list of ``{"name", "press": "snapkv" | "pyramidkv" | "streaming" | "observed"
| "tova" | "expected_attention" | "knorm" | "keydiff" | "lagkv" | "cur", "compression_ratio", and
the press's own arguments (``window_size``, ``kernel_size``, ``lag_size``)}``. For each press the
ids are prefilled once
with the press applied (kvpress compresses the cache at the end of the prefill); the positions of
the keys left in each layer's cache are found by matching them to an uncompressed prefill's keys.
Writes ``{name}/{layer}``: ``(kv_heads, n_kept)`` int64 key positions, increasing; for
``"adakv"`` (``AdaKVPress`` over ``"scorer"``, which masks keys rather than dropping them, so each
KV head keeps its own number) ``(kv_heads, n)`` bool, the keys left unmasked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).parent))
from transformers_kv import _read_once


def _press(config: dict[str, object]) -> object:
    import kvpress

    presses = {
        "snapkv": kvpress.SnapKVPress,
        "pyramidkv": kvpress.PyramidKVPress,
        "streaming": kvpress.StreamingLLMPress,
        "observed": kvpress.ObservedAttentionPress,
        "tova": kvpress.TOVAPress,
        "expected_attention": kvpress.ExpectedAttentionPress,
        "knorm": kvpress.KnormPress,
        "keydiff": kvpress.KeyDiffPress,
        "lagkv": kvpress.LagKVPress,
        "cur": kvpress.CURPress,
    }
    arguments = {k: v for k, v in config.items() if k not in ("name", "press", "scorer")}
    if config["press"] == "adakv":  # AdaKVPress over a scorer, the ratio the scorer's
        return kvpress.AdaKVPress(press=presses[str(config["scorer"])](**arguments))
    return presses[str(config["press"])](**arguments)


def _prefill(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return [layer.keys[0].float() for layer in cache.layers]


def main(gguf: str, ids_path: str, presses_path: str, out: str) -> None:
    path = Path(gguf)
    _read_once()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    ids = torch.tensor([json.loads(Path(ids_path).read_text())])
    full = _prefill(model, ids)
    arrays: dict[str, np.ndarray] = {}
    masking = None  # AdaKVPress masks keys instead of dropping them, under sdpa attention only
    for config in json.loads(Path(presses_path).read_text()):
        if config["press"] == "adakv":
            if masking is None:
                masking = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
                ).eval()
            with _press(config)(masking):  # type: ignore[operator]
                _prefill(masking, ids)
            for layer, block in enumerate(masking.model.layers):
                kept = np.ones((masking.config.num_key_value_heads, ids.shape[1]), bool)
                _, heads, positions = block.self_attn.masked_key_indices
                kept[heads.numpy(), positions.numpy()] = False
                arrays[f"{config['name']}/{layer}"] = kept
            continue
        with _press(config)(model):  # type: ignore[operator]
            kept = _prefill(model, ids)
        for layer, (compressed, original) in enumerate(zip(kept, full, strict=True)):
            # (kv_heads, n_kept, n): each kept key against every key of the uncompressed cache
            distance = torch.cdist(compressed, original)
            positions = distance.argmin(dim=-1).numpy()
            arrays[f"{config['name']}/{layer}"] = np.sort(positions, axis=-1).astype(np.int64)
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:5])
