"""Tiny random-weight models built through mlx-lm's own model classes (no downloads): `build`
makes one of any architecture in ``mlx_lm.models`` (`tiny_config`, `OVERRIDES`); `CONFIGS` names
one per cache layout capture must handle: full (llama, qwen3), sliding window (gemma3_text), chunked
attention blocks (llama4_text), recurrent hybrid (lfm2), latent MLA (deepseek_v3); and model
arguments that name things their own way: the width as ``hidden_dim`` (afm7) or ``n_embd``
(lille-130m), a config holding an infinite value (nemotron_h's ``time_step_limit``); attention
computed without mlx-lm's ``scaled_dot_product_attention`` (gemma2)."""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .errors import UnsupportedModelError

_COMMON = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "model_type": "llama",
        "head_dim": 32,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "head_dim": 16,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    },
    "gemma3_text": {
        **_COMMON,
        "model_type": "gemma3_text",
        "head_dim": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 16,
        "num_key_value_heads": 1,
    },
    "llama4": {
        **_COMMON,
        "model_type": "llama4_text",
        "head_dim": 16,
        "attention_chunk_size": 8,
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "intermediate_size_mlp": 128,
        "interleave_moe_layer_step": 2,
        "no_rope_layers": [1, 1, 1, 0],
        "rope_theta": 10000.0,
        "use_qk_norm": True,
        "tie_word_embeddings": False,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
    },
    "lfm2": {
        **_COMMON,
        "model_type": "lfm2",
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1, 3],
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "tie_embedding": True,
    },
    "deepseek_v3": {
        **_COMMON,
        "model_type": "deepseek_v3",
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 4,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
    },
    "gemma2": {  # computes its attention itself, not through mlx-lm's hooked function
        **_COMMON,
        "model_type": "gemma2",
        "head_dim": 16,
        "rope_theta": 10000.0,
        "attn_logit_softcapping": 0.5,  # small enough that soft-capping changes the weights
    },
    "afm7": {
        "model_type": "afm7",
        "vocab_size": 256,
        "hidden_dim": 64,
        "num_layers": 4,
        "num_kv_reuse_layers": 1,
        "num_heads": 4,
        "num_kv_heads": 2,
    },
    "lille-130m": {
        "model_type": "lille-130m",
        "block_size": 128,
        "layer_norm_eps": 1e-5,
        "n_embd": 64,
        "n_head": 4,
        "n_kv_heads": 2,
        "n_layer": 2,
        "rope_theta": 10000.0,
        "vocab_size": 256,
    },
    "nemotron_h": {
        **_COMMON,
        "model_type": "nemotron_h",
        "max_position_embeddings": 256,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": "M*-M",
    },
}

_MODULES = {"llama4": "llama4_text"}


def tiny_model(architecture: str, seed: int = 0) -> nn.Module:
    """A small random-weight mlx-lm model of ``architecture`` (a key of `CONFIGS`)."""
    config = CONFIGS[architecture]
    return _random_weights(_MODULES.get(architecture, config["model_type"]), config, seed)


def _random_weights(module_name: str, config: dict[str, Any], seed: int) -> nn.Module:
    """The model of ``mlx_lm.models.{module_name}`` built from ``config``, its weights drawn with
    ``seed`` and evaluated."""
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model


# -- every architecture --------------------------------------------------------------------------

SIZES: dict[str, Any] = {
    # widths, depths and heads of a tiny model, under every name mlx-lm's model arguments use
    **dict.fromkeys(("hidden_size", "hidden_dim", "n_embd", "d_model", "dim", "model_dim"), 64),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers"), 4),
    **dict.fromkeys(("num_attention_heads", "num_heads", "n_head", "n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_hidden_size",
            "ff_intermediate_size",
            "moe_intermediate_size",
            "expert_ffn_hidden_size",
            "shared_expert_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "intermediate_size_mlp",
            "block_ff_dim",
        ),
        64,
    ),
    "head_dim": 16,
    "kv_channels": 16,
    "vocab_size": 256,
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "decoder_sparse_step": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_topk": 4,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "block_size", "seq_length"), 256),
    **dict.fromkeys(
        ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon"), 1e-5
    ),
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state", "d_state"), 16),
    **dict.fromkeys(("conv_kernel", "mamba_d_conv", "d_conv", "conv_L_cache", "conv1d_width"), 4),
    **dict.fromkeys(("mamba_num_heads", "mamba_n_heads"), 4),
    **dict.fromkeys(("mamba_head_dim", "mamba_d_head"), 16),
    **dict.fromkeys(("n_groups", "mamba_n_groups"), 1),
    "time_step_rank": 8,
    "mamba_expand": 2,
    "expand": 2,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "num_nextn_predict_layers": 0,
    **dict.fromkeys(("rope_theta", "rotary_emb_base", "rope_embedding_base", "rotary_base"), 10000.0),
    "rotary_pct": 1.0,
    "partial_rotary_factor": 1.0,
}
"""A tiny size for every model argument of that name (where the architecture's own default,
or the lack of one, would build a big model)."""


def _zero(kind: Any) -> Any:
    """A neutral value of a model argument's type, for a required argument `SIZES` does not name."""
    simple = {int: 1, float: 1.0, bool: False, str: ""}
    if kind in simple:
        return simple[kind]
    origin = typing.get_origin(kind)
    if origin in (list, tuple):
        return []
    if origin is dict:
        return {}
    return None


def tiny_config(model_type: str) -> dict[str, Any]:
    """A config for a tiny random-weight ``model_type`` of ``mlx_lm.models``: `CONFIGS` where it
    has one, else every model argument `SIZES` names at its tiny size, the others at their
    defaults (a required one without a size: a neutral value of its type), a text model's
    arguments (``text_config``) filled alike, then `OVERRIDES`."""
    if model_type in CONFIGS and CONFIGS[model_type]["model_type"] == model_type:
        return dict(CONFIGS[model_type])
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = _filled(module.ModelArgs, model_type)
    if any(item.name == "text_config" for item in dataclasses.fields(module.ModelArgs)):
        text_type, text_args = _text_arguments(module)
        config["text_config"] = {**_filled(text_args, text_type), **OVERRIDES.get(f"{model_type}.text", {})}
    config.update(OVERRIDES.get(model_type, {}))
    return config


def _filled(arguments: Any, model_type: str) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": model_type}
    for item in dataclasses.fields(arguments):
        if item.name == "model_type":
            continue
        if item.name in SIZES:
            config[item.name] = SIZES[item.name]
        elif item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
            config[item.name] = _zero(item.type)
    return config


def _text_arguments(module: Any) -> tuple[str, Any]:
    """The model type and argument class of a multimodal model's language model: a text
    argument class of its own, else the model module it imports."""
    for name in ("TextModelArgs", "TextConfig", "TextArgs"):
        if hasattr(module, name):
            return getattr(module, name).__module__.rsplit(".", 1)[-1], getattr(module, name)
    source = Path(module.__file__).read_text(encoding="utf-8")
    for imported in re.findall(r"^from \.(?: import )?(\w+)", source, re.M):
        candidate = importlib.import_module(f"mlx_lm.models.{imported}")
        if hasattr(candidate, "ModelArgs"):
            if any(item.name == "text_config" for item in dataclasses.fields(candidate.ModelArgs)):
                return _text_arguments(candidate)  # itself a wrapper (qwen3_5_moe of qwen3_5)
            return imported, candidate.ModelArgs
    raise UnsupportedModelError(f"{module.__name__}: no text model arguments found to build it tiny")


_FOUR_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}

OVERRIDES: dict[str, dict[str, Any]] = {
    "afmoe": {"layer_types": _FOUR_TYPES, "num_dense_layers": 1, "mup_enabled": False},
    "baichuan_m1": {"sliding_window_layers": [0, 2], "conv_window": 2, "sliding_window": 8},
    "dbrx": {
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
    },
    "exaone_moe": {
        "layer_types": _FOUR_TYPES,
        "is_moe_layer": [False, True, True, True],
        "rope_parameters": _ROPE,
    },
    # Every part of DeepSeek-V4.1's attention state: windows (8), compressed groups of 4 and 2
    # rows, index keys, the indexer's top-k (4 of 5 groups by the last token) and candidate blocks.
    "deepseek_v41": {
        "compress_ratios": [0, 4, 4, 2],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 2],
        "candidate_source_layer_id": 1,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 2,
    },
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_chunk_size": 8},
    "gear": {"layer_types": _FOUR_TYPES},
    "mellum": {
        "layer_types": _FOUR_TYPES,
        "rope_parameters": {"sliding_attention": _ROPE, "full_attention": _ROPE},
    },
    "spark2_5": {
        "layer_types": _FOUR_TYPES,
        "rope_parameters": {"sliding_attention": _ROPE, "full_attention": _ROPE},
    },
    "jamba": {
        "layers_block_type": ["mamba", "attention", "mamba", "attention"],
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
        "mamba_dt_rank": 8,
    },
    "mamba2": {"num_heads": 4, "head_dim": 16, "time_step_limit": [0.0, float("inf")], "n_groups": 1},
    "lfm2_moe": {
        "rope_parameters": _ROPE,
        "full_attn_idxs": [1, 3],
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "num_dense_layers": 1,
    },
    "kimi_linear": {
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        },
    },
    "recurrent_gemma": {
        "block_types": ["recurrent", "attention"],
        "attention_window_size": 8,
        "lru_width": 64,
        "logits_soft_cap": 30.0,
    },
    "openelm": {
        "num_transformer_layers": 2,
        "num_query_heads": [4, 4],
        "num_kv_heads": [2, 2],
        "ffn_multipliers": [1.0, 1.0],
        "ffn_dim_divisor": 16,
        "model_dim": 64,
    },
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"n_heads_in_group": 2}, "ffn": {"no_op": True}},
        ]
    },
    "llama4_text": {
        "no_rope_layers": [1, 1, 1, 0],
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 8,
    },
    "llama4.text": {
        "no_rope_layers": [1, 1, 1, 0],
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 8,
        "num_experts_per_tok": 1,
        "num_local_experts": 2,
        "intermediate_size_mlp": 64,
        "use_qk_norm": True,
    },
    "qwen3_next": {"mlp_only_layers": [], "full_attention_interval": 2},
    "gptj": {"rotary_dim": 8},
    "phixtral": {"rotary_dim": 8},
    "granitemoehybrid": {
        "layer_types": ["mamba", "attention", "mamba", "attention"],
        "shared_intermediate_size": 64,
    },
    "minimax": {"rotary_dim": 8},
    "plamo": {"n_shared_head": 2, "num_key_value_heads": 2},
    "step3p5": {"moe_num_experts": 8, "moe_top_k": 2},
    "deepseek_v2": {
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "rope_scaling": {"factor": 1.0, "type": "yarn", "original_max_position_embeddings": 256},
    },
    "minicpm3": {"dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 12.0, "rope_scaling": {}},
    "hunyuan": {
        "num_shared_expert": 1,
        "cla_share_factor": 2,
        "use_cla": False,
        "use_mixed_mlp_moe": True,
        "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    },
    "glm_moe_dsa": {"rope_parameters": _ROPE, "topk_method": "noaux_tc"},
    "mimo_v2_flash": {
        "moe_layer_freq": [0, 1, 1, 1],
        "hybrid_layer_pattern": [0, 1, 0, 1],
        "sliding_window_size": 8,
        "topk_method": "noaux_tc",
        "swa_head_dim": 16,
        "swa_v_head_dim": 16,
        "swa_rope_theta": 10000.0,
    },
    "minimax_m3_vl.text": {"moe_layer_freq": [0, 1, 1, 1]},
    "ministral3": {
        "rope_parameters": {**_ROPE, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 256}
    },
    "mistral4": {  # its Llama-4 query scale departs from 1 from position 4 on
        "rope_parameters": {**_ROPE, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 4}
    },
    "mistral3.text": {
        "model_type": "ministral3",
        "rope_parameters": {**_ROPE, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 256},
    },
    "muse_spark.text": {
        "num_shared_experts": 0,
        "mlp_layer_types": ["sparse"] * 4,
        "rope_parameters": _ROPE,
        "layer_rope_theta": [10000.0, 0, 10000.0, 0],
        "layer_types": _FOUR_TYPES,
        "moe_hidden_size": 64,
        "post_norm_eps": 1e-5,
        "output_multiplier": 1.0,
        "final_logit_softcapping": 30.0,
    },
    "longcat_flash": {
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "zero_expert_num": 1,
        "zero_expert_type": "identity",
    },
    "longcat_flash_ngram": {
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "zero_expert_num": 1,
        "zero_expert_type": "identity",
    },
    "kimi_k3.text": {
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        }
    },
    "kimi_k3": {
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        }
    },
    "lfm2-vl.text": {
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "block_dim": 64,
        "block_ff_dim": 64,
        "conv_L_cache": 3,
    },
    "gemma3.text": {"sliding_window_pattern": 2},
    "gemma3n.text": {
        "layer_types": _FOUR_TYPES,
        "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": 256,
        "hidden_size_per_layer_input": 8,
        "activation_sparsity_pattern": [0.0] * 4,
        "altup_num_inputs": 2,
        "altup_coef_clip": 120.0,
        "altup_active_idx": 0,
        "laurel_rank": 4,
        "final_logit_softcapping": 30.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 8,
    },
    **{
        key: {
            "num_kv_shared_layers": 2,
            "sliding_window_pattern": 2,
            "layer_types": None,
            "vocab_size_per_layer_input": 256,
            "hidden_size_per_layer_input": 8,
        }
        for key in ("gemma4_text", "gemma4.text")
    },
}
"""Per architecture, what a tiny config needs beyond `SIZES` (a layer pattern, a text config)."""


def build(model_type: str, seed: int = 0) -> nn.Module:
    """A tiny random-weight model of any architecture in ``mlx_lm.models`` (`tiny_config`)."""
    return _random_weights(model_type, tiny_config(model_type), seed)


def byte_tokenizer() -> Any:
    """A real byte-level tokenizer of 256 tokens (ids = bytes), wrapped as mlx-lm wraps Hugging
    Face ones: what the tiny models (vocabulary 256) are driven with."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=backend))
