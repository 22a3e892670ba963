"""What a snapshot records about the model: architecture, config digest, heads, RoPE, layers."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import mlx.nn as nn

import kvformat

from .state import ROLES


def model_config(model: nn.Module) -> dict[str, Any]:
    """The model's config as plain JSON (its ``args`` dataclass, or what it exposes); a number
    JSON cannot hold (``inf`` in nemotron_h's ``time_step_limit``) as the string ``"Infinity"``,
    ``"-Infinity"`` or ``"NaN"`` (SPEC 15.1)."""
    args = getattr(model, "args", None)
    if args is None:
        return {}
    items = vars(args) if hasattr(args, "__dict__") else {}
    return _finite(json.loads(json.dumps(items, default=str)))


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float written as its JSON-less name, a string."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


_WIDTHS = ("hidden_size", "hidden_dim", "n_embd", "d_model", "dim")  # what model args call it
_HEADS = ("num_attention_heads", "num_heads", "n_head", "n_heads")


def head_dim_of(config: dict[str, Any], model: nn.Module | None = None) -> int | None:
    """The attention head dim: the config's ``head_dim``, else what the model's own attention
    modules hold (mlx-lm's record ``head_dim``), else width / heads under the names the model's
    arguments use; None where none of them says."""
    value = config.get("head_dim")
    if isinstance(value, int) and value > 0:
        return value
    return _held_head_dim(model) or _width_over_heads(config)


def _held_head_dim(model: nn.Module | None) -> int | None:
    """The first positive integer ``head_dim`` a module of the model holds."""
    for module in model.modules() if model is not None else []:
        value = getattr(module, "head_dim", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _width_over_heads(config: dict[str, Any]) -> int | None:
    """Width / heads under the names the model's arguments use, where both are there."""
    width = next((config[k] for k in _WIDTHS if isinstance(config.get(k), int)), None)
    heads = next((config[k] for k in _HEADS if isinstance(config.get(k), int) and config[k] > 0), None)
    return width // heads if width and heads else None


def rope_description(config: dict[str, Any], head_dim: int | None = None) -> dict[str, Any] | None:
    """RoPE as analysis needs it: base, scaling, rotary dims, pairing (interleaved or half); None
    where the model has no RoPE base or its head dim is unknown."""
    if "rope_theta" not in config and "rope_local_base_freq" not in config:
        return None
    head_dim = head_dim or head_dim_of(config)
    if head_dim is None:
        return None
    partial = config.get("partial_rotary_factor", 1.0)
    traditional = bool(config.get("rope_traditional", False))
    return {
        "base": float(config.get("rope_theta", 10000.0)),
        "scaling": config.get("rope_scaling"),
        "dims": int(head_dim * partial),
        "traditional": traditional,
        "pairing": "interleaved" if traditional else "half",
    }


def layer_rope_base(config: dict[str, Any], layer: int) -> float | None:
    """A per-layer RoPE base where the model uses more than one (Gemma-3 local layers)."""
    if config.get("model_type") == "gemma3_text":
        pattern = int(config.get("sliding_window_pattern", 6))
        if (layer + 1) % pattern != 0:
            return float(config.get("rope_local_base_freq", 10000.0))
    return None


def latent_module(model: nn.Module | None) -> Any:
    """The model's multi-head latent attention (MLA) module in mlx-lm's absorbed form, recognised
    by its structure (a ``kv_lora_rank`` and the absorbed query projection ``embed_q``), or None."""
    if model is None:
        return None
    for module in model.modules():
        rank = getattr(module, "kv_lora_rank", None)
        if isinstance(rank, int) and not isinstance(rank, bool) and hasattr(module, "embed_q"):
            return module
    return None


def latent_attributes(model: nn.Module | None) -> dict[str, Any] | None:
    """Layer attributes of a multi-head latent attention (MLA) cache, or None for other models.

    mlx-lm's MLA layers (DeepSeek-V3, Kimi-K2.5, GLM-4.7-lite, Mistral-4, ...) cache the
    compressed latent (after its layernorm) in the K slot and the shared RoPE'd key part in the
    V slot; the attributes say so (spec 15.2, kind "latent"). Recognised from the model's modules
    (`latent_module`), not from its name.
    """
    module = latent_module(model)
    if module is None:
        return None
    return {
        "kind": "latent",
        "k_holds": "kv_latent",
        "v_holds": "k_rope",
        "kv_lora_rank": int(module.kv_lora_rank),
        "qk_rope_head_dim": getattr(module, "qk_rope_head_dim", None),
        "qk_nope_head_dim": getattr(module, "qk_nope_head_dim", None),
        "v_head_dim": getattr(module, "v_head_dim", None),
    }


def gguf_source(model_path: str | None) -> dict[str, Any] | None:
    """What `convert_gguf` recorded about the GGUF a model directory came from (its
    ``config.json`` key ``kvsnap_source``, which mlx-lm's model arguments drop), or None."""
    if not model_path:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    source = config.get("kvsnap_source") if isinstance(config, dict) else None
    return source if isinstance(source, dict) else None


def file_metadata(model: nn.Module, model_path: str | None, tokenizer: Any = None) -> dict[str, Any]:
    """File-level metadata per spec section 15.1."""
    config = model_config(model)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    source = gguf_source(model_path)
    name = (model_path or "").rstrip("/").split("/")[-1] or config.get("model_type")
    if source is not None:  # a converted GGUF: its directory is named by a hash; use the GGUF's name
        name = source.get("name") or str(source.get("gguf", name)).removesuffix(".gguf")
    metadata: dict[str, Any] = {
        "model": {
            "name": name,
            "path": model_path,
            "architecture": config.get("model_type"),
            "config_sha256": digest,
            "num_layers": config.get("num_hidden_layers"),
            "num_attention_heads": config.get("num_attention_heads"),
            "num_kv_heads": config.get("num_key_value_heads"),
            "config": config,
        },
        "tool": {"name": "kvsnap", "version": kvformat.__version__},
    }
    if source is not None:
        metadata["model"]["gguf"] = {
            "file": source.get("gguf"),
            "sha256": source.get("sha256"),  # the identity of the weights
            "name": source.get("name"),
            "architecture": source.get("architecture"),
            "size_label": source.get("size_label"),
            "file_type": source.get("file_type"),
            "converted_dtype": source.get("dtype"),
        }
    rope = rope_description(config, head_dim_of(config, model))
    if rope:
        metadata["rope"] = rope
    if tokenizer is not None:
        metadata["tokenizer"] = {
            "vocab_size": getattr(tokenizer, "vocab_size", None),
            "bos_token_id": getattr(tokenizer, "bos_token_id", None),
            "eos_token_ids": sorted(getattr(tokenizer, "eos_token_ids", []) or []),
        }
    return metadata


def annotate_layers(
    attributes: list[dict[str, Any]],
    present: list[bool],
    model: nn.Module | None,
    dims: list[tuple[int, int] | None] | None = None,
) -> None:
    """Add what the model says about each layer to its attributes (in place): a per-layer RoPE
    base, the latent (MLA) layout of present layers, and what each recurrent state slot holds."""
    if model is None:
        return
    config = model_config(model)
    latent = latent_attributes(model)
    roles = ROLES.get(str(config.get("model_type")), ())
    for index, (attrs, here) in enumerate(zip(attributes, present, strict=True)):
        base = layer_rope_base(config, index)
        if base is not None:
            attrs["rope_base"] = base
        # A latent layer caches the latent and the RoPE key (a sparse-attention indexer's keys,
        # in a layer of their own, are not one): its K and V widths say so, where known.
        shape = dims[index] if dims is not None else None
        if latent is not None and here and attrs.get("kind") == "full" and _latent_shape(shape, latent):
            attrs.update(latent)
        _name_state_roles(attrs.get("state"), roles)


def _latent_shape(shape: tuple[int, int] | None, latent: dict[str, Any]) -> bool:
    """Whether a layer's K and V widths (None: unknown) are a latent layer's."""
    return shape is None or shape == (latent["kv_lora_rank"], latent["qk_rope_head_dim"])


def _name_state_roles(state: Any, roles: tuple[str, ...]) -> None:
    """Each described slot of a layer's ``state`` attribute gets its ``role`` (in place)."""
    if isinstance(state, list):
        for slot, entry in enumerate(state):
            if isinstance(entry, dict) and slot < len(roles):
                entry["role"] = roles[slot]
