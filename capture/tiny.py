"""Tiny random-weight models built through mlx-lm's own model classes (no downloads), one per
cache layout capture must handle: full (llama, qwen3), sliding window (gemma3_text), chunked
attention blocks (llama4_text), recurrent hybrid (lfm2), latent MLA (deepseek_v3); and model
arguments that name things their own way: the width as ``hidden_dim`` (afm7) or ``n_embd``
(lille-130m), a config holding an infinite value (nemotron_h's ``time_step_limit``); attention
computed without mlx-lm's ``scaled_dot_product_attention`` (gemma2)."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn

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
    module = importlib.import_module(f"mlx_lm.models.{_MODULES.get(architecture, config['model_type'])}")
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model
