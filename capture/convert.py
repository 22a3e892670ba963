"""GGUF -> mlx-lm model directory (config.json, model.safetensors, tokenizer files).

Reads metadata and tensors with the ``gguf`` package, dequantizes every quant type to float32,
and maps names and config for the llama family and gemma3. Known traps handled here:

- llama.cpp permutes llama q/k projection rows (and biases) so that its interleaved RoPE pairs
  ``(2i, 2i+1)`` line up with the checkpoint's ``(i, i + d/2)``; the permutation is undone here
  (`unpermute_rows`, as transformers' and mlx-lm's own GGUF loaders do) and the model uses
  ``rope_traditional: false``, so a converted model's q, K and V are in the checkpoint's channel
  order: channel ``c`` of a K head is channel ``c`` of the same model loaded from safetensors.
- llama.cpp's Gemma conversion stores RMSNorm weights with +1 added; mlx-lm adds 1 itself, so
  1 is subtracted here.
- Gemma-3 GGUF files omit the sliding pattern (every 6th layer global), the local RoPE base
  (1e4) and ``query_pre_attn_scalar`` (head_dim); llama.cpp hard-codes them, and so do we.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvformat.errors import UnknownNameError
from kvformat.io.outputs import check_output, output_path

from .errors import UnsupportedModelError

DTYPES = ("float16", "bfloat16", "float32")

_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class _Metadata:
    """Typed access to GGUF key/values with clear errors for missing keys."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self.architecture: str = self.get("general.architecture")

    def get(self, key: str, default: Any = ...) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise UnsupportedModelError(f"GGUF file lacks required key {key!r}")
            return default
        return field.contents()

    def arch(self, key: str, default: Any = ...) -> Any:
        return self.get(f"{self.architecture}.{key}", default)


def _llama_config(meta: _Metadata, names: set[str]) -> dict[str, Any]:
    heads = int(meta.arch("attention.head_count"))
    hidden = int(meta.arch("embedding_length"))
    if meta.arch("rope.scaling.type", None) not in (None, "none"):
        raise UnsupportedModelError(
            f"RoPE scaling {meta.arch('rope.scaling.type')!r} is not converted yet; refusing to "
            "produce a model with wrong positions"
        )
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError("llama3-style rope_freqs tensors are not converted yet")
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(meta.arch("block_count")),
        "intermediate_size": int(meta.arch("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.arch("attention.head_count_kv", heads)),
        "head_dim": int(meta.arch("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta.arch("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(meta.arch("vocab_size", len(meta.get("tokenizer.ggml.tokens")))),
        "max_position_embeddings": int(meta.arch("context_length", 4096)),
        "rope_theta": float(meta.arch("rope.freq_base", 10000.0)),
        "rope_traditional": False,  # q/k rows un-permuted: the checkpoint's (i, i + d/2) pairs
        "tie_word_embeddings": "output.weight" not in names,
    }


def _gemma3_config(meta: _Metadata, names: set[str]) -> dict[str, Any]:
    head_dim = int(meta.arch("attention.key_length"))
    return {
        "model_type": "gemma3_text",
        "hidden_size": int(meta.arch("embedding_length")),
        "num_hidden_layers": int(meta.arch("block_count")),
        "intermediate_size": int(meta.arch("feed_forward_length")),
        "num_attention_heads": int(meta.arch("attention.head_count")),
        "num_key_value_heads": int(meta.arch("attention.head_count_kv")),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.arch("attention.layer_norm_rms_epsilon")),
        "vocab_size": len(meta.get("tokenizer.ggml.tokens")),
        "max_position_embeddings": int(meta.arch("context_length")),
        "rope_theta": float(meta.arch("rope.freq_base", 1_000_000.0)),
        # Not stored in GGUF; llama.cpp's gemma3 loader hard-codes these.
        "rope_local_base_freq": 10_000.0,
        "sliding_window": int(meta.arch("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": head_dim,
        "tie_word_embeddings": True,
    }


_ARCHITECTURES: dict[str, tuple[Callable[[_Metadata, set[str]], dict[str, Any]], dict[str, str], bool]] = {
    # architecture: (config builder, tensor names, norms stored with +1)
    "llama": (_llama_config, _LLAMA_NAMES, False),
    "gemma3": (_gemma3_config, _GEMMA3_NAMES, True),
}


def unpermute_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``'s ``permute``) of a
    projection weight ``(heads * head_dim, hidden)`` or bias ``(heads * head_dim,)``: within each
    head, GGUF row ``2i`` is the checkpoint's row ``i`` and ``2i + 1`` is ``i + head_dim / 2``."""
    rows = weights.shape[0]
    if rows % (2 * heads):
        raise UnsupportedModelError(f"cannot un-permute {rows} rows into {heads} heads of even size")
    half = rows // heads // 2
    return np.ascontiguousarray(
        weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
    )


def _unpermute(target: str, array: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """The llama family's q/k projections back in the checkpoint's row order."""
    if config["model_type"] != "llama":
        return array
    if ".self_attn.q_proj." in target:
        return unpermute_rows(array, int(config["num_attention_heads"]))
    if ".self_attn.k_proj." in target:
        return unpermute_rows(array, int(config["num_key_value_heads"]))
    return array


def _target_name(name: str, names: dict[str, str]) -> str:
    if name in names:
        return names[name]
    match = _BLOCK.match(name)
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"
    raise UnsupportedModelError(f"GGUF tensor {name!r} has no mlx-lm counterpart in this converter")


def open_gguf(gguf_path: str | os.PathLike[str]) -> Any:
    """A ``gguf.GGUFReader`` of the file that parses a plain ndarray view of its memory map: the
    same fields and tensors from the same pages, ~3x faster where a vocabulary is large
    (Gemma-3's 262k strings: 2.5 s instead of 7.7 s on a 2-core x86-64 VM), since each slice of
    an ``np.memmap`` runs Python code (``__array_finalize__``) and a plain view's does not."""
    from gguf import GGUFReader

    class _PlainViewReader(GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:
            self.data = self.data.view(np.ndarray)  # type: ignore[assignment]  # its base, the memmap, stays alive
            return int(super()._build_fields(offs, count))

    return _PlainViewReader(os.fspath(gguf_path))


def dequantized_tensors(
    gguf_path: str | os.PathLike[str], rows: dict[str, slice] | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of a GGUF file as float32 in numpy (row-major) shape, under its GGUF name;
    ``rows`` names tensors of which only those rows (of the first axis) are wanted, for checking
    a large tensor by sample (quantized rows are independent: only those are dequantized)."""
    from gguf.quants import dequantize

    reader = open_gguf(gguf_path)
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        data = tensor.data
        wanted = (rows or {}).get(tensor.name)
        if wanted is not None:
            data = data.reshape(shape[0], -1)[wanted]
            shape = (data.shape[0], *shape[1:])
        array = dequantize(data, tensor.tensor_type)
        yield tensor.name, np.asarray(array, dtype=np.float32).reshape(shape)


def sha256_of(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, read in 16 MiB pieces."""
    import hashlib  # here: the CLI imports this module for every command

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _gguf_tokenizer_mapping() -> tuple[Any, Any]:
    """transformers' GGUF tokenizer mapping and converter, imported without its "PyTorch was not
    found" advice (only its tokenizer code is used: torch is never needed here)."""
    quiet = "TRANSFORMERS_NO_ADVISORY_WARNINGS" not in os.environ
    if quiet:
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    finally:
        if quiet:
            del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
    return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer


def _tokenizer_files(meta: _Metadata, out: Path) -> None:
    """tokenizer.json (built from the GGUF vocabulary) and tokenizer_config.json."""
    from tokenizers import pre_tokenizers, processors

    GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer = _gguf_tokenizer_mapping()
    fields = {
        name: meta.get(f"tokenizer.{key}")
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if meta.get(f"tokenizer.{key}", None) is not None
    }
    tokenizer, _ = convert_gguf_tokenizer(meta.architecture, fields)
    if fields.get("pre_tokenizer_type") == "smollm":
        # llama.cpp's smollm pre-tokenizer: every digit alone, then the GPT-2 split.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tokens = fields["tokens"]
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", meta.architecture == "gemma3"))
    bos_id = meta.get("tokenizer.ggml.bos_token_id", None)
    if add_bos and bos_id is not None:
        # The fast tokenizer adds BOS only through its post-processor (Gemma is lost without it).
        bos = tokenizer.id_to_token(int(bos_id))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    tokenizer.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}", None)
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(meta.arch("context_length", 4096)),
    }
    template = meta.get("tokenizer.chat_template", None)
    if template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str = "float16",
    *,
    overwrite: bool = False,
) -> Path:
    """Convert a GGUF file to a new mlx-lm model directory ``out_dir``; return it.

    ``dtype`` is the weight dtype (``float16``, ``bfloat16`` or ``float32``). Deterministic: the
    same input gives byte-identical files. The directory is written under a temporary name and
    renamed at the end (a failed conversion leaves nothing); an existing one is refused unless
    ``overwrite`` (then replaced whole).
    """
    if dtype not in DTYPES:
        raise UnknownNameError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    gguf_path = Path(gguf_path)
    try:
        reader = open_gguf(gguf_path)
    except (ValueError, OSError) as exc:  # gguf's own messages do not name the file
        raise UnsupportedModelError(f"{gguf_path}: not a readable GGUF file ({exc})") from None
    meta = _Metadata(reader)
    if meta.architecture not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {meta.architecture!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    build_config, names, norms_plus_one = _ARCHITECTURES[meta.architecture]
    tensor_names = {t.name for t in reader.tensors}
    config = build_config(meta, tensor_names)
    final = Path(out_dir)
    check_output(final, inputs=[gguf_path], force=overwrite, folder=True)
    with output_path(final, inputs=[gguf_path], force=overwrite, folder=True) as temporary:
        _write_model(gguf_path, meta, config, names, norms_plus_one, dtype, Path(temporary))
    return final


def _write_model(
    gguf_path: Path,
    meta: _Metadata,
    config: dict[str, Any],
    names: dict[str, str],
    norms_plus_one: bool,
    dtype: str,
    out: Path,
) -> None:
    """The files of the mlx-lm directory, into the existing folder ``out``."""
    import mlx.core as mx

    weights: dict[str, mx.array] = {}
    for name, array in dequantized_tensors(gguf_path):
        target = _target_name(name, names)
        if norms_plus_one and target.endswith("norm.weight"):
            array = array - np.float32(1.0)
        array = _unpermute(target, array, config)
        weights[target] = mx.array(array).astype(getattr(mx, dtype))
    config["kvsnap_source"] = {
        "gguf": gguf_path.name,
        "sha256": sha256_of(gguf_path),
        "dtype": dtype,
        # The GGUF's own description of the model (general.*), for provenance in captures.
        "name": meta.get("general.name", None),
        "architecture": meta.architecture,
        "size_label": meta.get("general.size_label", None),
        "file_type": meta.get("general.file_type", None),
    }
    mx.save_safetensors(str(out / "model.safetensors"), dict(sorted(weights.items())), {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _tokenizer_files(meta, out)
