"""kvpress 0.5.5 loading kvsnap's exports, as a user would: ``ExpectedAttentionStatsPress(
stats_folder=DIR)`` and ``DuoAttentionPress`` reading a head pattern folder. Runs in the
reference Python (``make reference``), never imports kvsnap.

    python kvpress_exports.py MODEL.gguf IDS.json STATS_DIR DUO_DIR OUT.npz

Writes ``loaded_mean`` / ``loaded_cov`` (what the press loaded), ``reference_mean`` /
``reference_cov`` (the same statistics computed here as kvpress's ``collect_queries`` forms them,
from transformers' pre-RoPE queries on the same ids), ``streaming_mask`` (DuoAttentionPress's,
layers x KV heads), ``sink_size`` / ``recent_size``, and ``kept_duo`` / ``kept_stats``: how many
keys each layer keeps after a prefill with each press (the presses run end to end).

DuoAttentionPress fetches its pattern from the DuoAttention repository over HTTP; here the fetch
is answered from DUO_DIR's two files, read byte for byte, so that the press's own parsing reads
them unchanged.
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


class _Answer:
    def __init__(self, data: bytes) -> None:
        self.text = data.decode("utf-8")

    def json(self) -> object:
        return json.loads(self.text)


def main(gguf: str, ids_path: str, stats_dir: str, duo_dir: str, out: str) -> None:
    from kvpress.presses import duo_attention_press
    from kvpress.presses.duo_attention_press import DuoAttentionPress
    from kvpress.presses.expected_attention_with_stats import (
        ExpectedAttentionStatsPress,
        patch_rotary_embedding,
    )

    path = Path(gguf)
    _read_once()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    ids = torch.tensor([json.loads(Path(ids_path).read_text())])
    arrays: dict[str, np.ndarray] = {}

    # ExpectedAttention: the statistics the press loads, and the same computed here
    press = ExpectedAttentionStatsPress(compression_ratio=0.5, stats_folder=stats_dir)
    press.post_init_from_model(model)
    arrays["loaded_mean"], arrays["loaded_cov"] = press.mu.float().numpy(), press.cov.float().numpy()
    with torch.no_grad(), patch_rotary_embedding(model) as captured:
        model(ids)
    queries = torch.cat(captured, dim=0)[:, :, 4:, :].double()  # (layers, heads, positions, dim)
    mean = queries.mean(dim=-2)
    centred = queries - mean.unsqueeze(-2)
    arrays["reference_mean"] = mean.numpy()
    arrays["reference_cov"] = (centred.transpose(-2, -1) @ centred / (queries.shape[-2] - 1)).numpy()
    arrays["kept_stats"] = _kept(model, ids, press)

    # DuoAttention: the pattern fetched from DUO_DIR
    folder = Path(duo_dir)
    duo_attention_press.PATTERNS_DICT[model.config.name_or_path] = "kvsnap-export"
    duo_attention_press.requests.get = lambda url, *a, **k: _Answer(
        (folder / url.rsplit("/", 1)[1]).read_bytes()
    )
    duo = DuoAttentionPress(head_compression_ratio=0.5)
    duo.post_init_from_model(model)
    arrays["streaming_mask"] = duo.streaming_mask.numpy()
    arrays["sink_size"], arrays["recent_size"] = np.array(duo.sink_size), np.array(duo.recent_size)
    arrays["kept_duo"] = np.array([duo_compressed(model, ids, duo)])
    np.savez(out, **arrays)


def _kept(model: torch.nn.Module, ids: torch.Tensor, press: object) -> np.ndarray:
    cache = DynamicCache()
    with torch.no_grad(), press(model):  # type: ignore[operator]
        model(ids, past_key_values=cache, use_cache=True)
    return np.array([layer.keys.shape[2] for layer in cache.layers])


def duo_compressed(model: torch.nn.Module, ids: torch.Tensor, press: object) -> float:
    """The share of the cache DuoAttentionPress masks in a prefill (its ``compression_ratio``)."""
    cache = DynamicCache()
    with torch.no_grad(), press(model):  # type: ignore[operator]
        model(ids, past_key_values=cache, use_cache=True)
    return float(press.compression_ratio)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main(*sys.argv[1:6])
