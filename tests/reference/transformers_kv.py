"""Hugging Face transformers' KV cache for given token ids: the independent reference of
`tests/capture/test_reference.py`. Runs in a Python of its own with torch, transformers, gguf
and accelerate (``make reference``: ``.cache/reference``), never imports kvsnap.

    python transformers_kv.py MODEL.gguf IDS.json OUT.npz

Loads the GGUF with transformers' own loader (``gguf_file=``, dequantized to float32, q/k rows
in the checkpoint's order), runs one forward pass over the ids, and writes per layer ``k{L}``
(post-RoPE, ``past_key_values``), ``pre{L}`` (K before RoPE: the ``k_proj`` output, after
``k_norm`` where the model has one) and ``v{L}``, each ``(kv_heads, n_tokens, head_dim)``
float32. Gemma-3's embedding scale is rounded to bfloat16 as mlx-lm rounds it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def _read_once() -> None:
    """transformers opens the GGUF twice with ``gguf.GGUFReader`` (its config, then its weights),
    and each parse of the tokenizer's vocabulary (262k strings for Gemma-3) takes ~17 s here: the
    second open gets the first reader, which holds the same file's same fields.

    The reader parses through ``np.memmap`` slices, each a memmap object whose creation runs
    Python code (``__array_finalize__``): millions of them for a vocabulary, and again per row
    when the weights are dequantized. A plain ndarray view of the same mapped bytes gives the same
    fields and tensors (the same values, read from the same pages) at a third of the time."""
    import gguf
    import numpy as np
    from gguf.gguf_reader import GGUFReader

    build = GGUFReader._build_fields

    def build_on_plain_view(self: GGUFReader, offs: int, count: int) -> int:
        self.data = self.data.view(np.ndarray)  # keeps the memmap (its base) alive
        return build(self, offs, count)

    GGUFReader._build_fields = build_on_plain_view  # type: ignore[method-assign]
    original = gguf.GGUFReader
    readers: dict[str, object] = {}

    def reader(path: object, *args: object, **kwargs: object) -> object:
        key = str(Path(str(path)).resolve())
        if args or kwargs or key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[assignment]


def main(gguf: str, ids_path: str, out: str) -> None:
    path = Path(gguf)
    _read_once()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inner = model.model
    embed = inner.embed_tokens
    if hasattr(embed, "embed_scale"):  # Gemma: mlx-lm multiplies by sqrt(hidden) rounded to bfloat16
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.bfloat16).to(torch.float32)
        embed.embed_scale = scale
    pre: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        def hook(_module: object, _inputs: object, output: torch.Tensor) -> None:
            pre[layer] = output.detach()

        return hook

    for index, block in enumerate(inner.layers):
        attention = block.self_attn
        source = attention.k_norm if hasattr(attention, "k_norm") else attention.k_proj
        source.register_forward_hook(keep(index))
    ids = torch.tensor([json.loads(Path(ids_path).read_text())])
    with torch.no_grad():
        result = model(ids, use_cache=True)
    cache = result.past_key_values
    arrays: dict[str, np.ndarray] = {}
    n = ids.shape[1]
    for layer in range(config.num_hidden_layers):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        arrays[f"k{layer}"] = keys[0].float().numpy()
        arrays[f"v{layer}"] = values[0].float().numpy()
        before = pre[layer][0].float().reshape(n, kv_heads, head_dim).permute(1, 0, 2)
        arrays[f"pre{layer}"] = before.numpy()
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:4])
