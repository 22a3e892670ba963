"""Sparse attention (DeepSeek-V3.2's indexer, format 1.7) held to mlx-lm's own model on the
prompt's calls, which the architecture check skips (it compares an absorbed latent model's decode
calls): mlx-lm's ``deepseek_v32`` built tiny (an indexer top-k of 4 over a 12-token prompt), every
prefill attention call hooked; attention recomputed from the file, mapped to each head's value
space by the model's own up-projection, equals the hooked output, and would not without the
recorded selections."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

import kvformat
from kvformat import attention


def test_the_prompts_sparse_attention_is_the_models(tmp_path: Path) -> None:
    from mlx_lm.sample_utils import make_sampler

    from kvsnap.capture import generate
    from kvsnap.capture.architectures import _Kernel
    from kvsnap.capture.tiny import build, byte_tokenizer

    model = build("deepseek_v32")
    prompt = "sparse keys!"
    path = tmp_path / "sparse.kv"
    with _Kernel() as kernel:  # every call of mlx-lm's attention function: (queries, keys, output)
        list(
            generate(
                model,
                byte_tokenizer(),
                prompt,
                max_tokens=2,
                output=path,
                queries="all",
                sampler=make_sampler(0.0),
            )
        )
    # the prompt's calls (per-head, unabsorbed: several queries a call)
    calls = [(q, np.array(out.astype(mx.float32))) for q, _, out in kernel.calls if q.shape[2] > 1]
    length = len(byte_tokenizer().encode(prompt))
    layers = [layer for layer in model.model.layers if hasattr(layer.self_attn, "indexer")]
    assert len(calls) == len(layers) and length > layers[0].self_attn.indexer.index_topk
    with kvformat.open(path) as snap:
        assert snap.version == (1, 7)
        for layer, (module, (_, output)) in enumerate(zip(layers, calls, strict=True)):
            spec = snap.layers[layer].queries
            chosen = snap.selection(layer)
            assert spec is not None and chosen is not None and spec.selection == 4
            prompt_rows = chosen.rows[chosen.positions < length]
            assert prompt_rows.shape[0] == length  # the cache held more keys than the top-k
            assert bool(np.any(prompt_rows > chosen.positions[:length, None]))  # future keys, masked
            up = np.array(module.self_attn.unembed_out.weight.astype(mx.float32))  # (heads, v_dim, rank)
            worst = 0.0
            ignored = 0.0
            called = output.shape[2]  # the prompt's call: every position but the last
            for head in range(spec.num_heads):
                latent, positions = snap.attention_output(layer, head, queries=(0, called))
                assert positions.tolist() == list(range(called))
                expected = output[0, head]
                worst = max(worst, float(np.abs(latent @ up[head].T - expected).max()))
                # the same without the selections: every visible key
                found = snap.queries(layer, head, positions=(0, called))
                assert found is not None
                keys = attention.context_keys(snap, layer, 0, 0, found.positions)
                dense = attention.weights(spec, head, found.q, keys.k, found.positions, keys.positions)
                ignored = max(ignored, float(np.abs((dense @ keys.v) @ up[head].T - expected).max()))
            scale = float(np.abs(output).max())
            print(
                f"layer {layer}: {worst / scale:.1e} relative, {ignored / scale:.1e} without the selections"
            )
            assert worst <= 1e-5 * scale, (layer, worst, scale)
            assert ignored > 1e-3 * scale  # the check can fail


def test_deepseek_v41s_attention_is_its_window_and_the_groups_its_indexer_chose(tmp_path: Path) -> None:
    """DeepSeek-V4.1 (format 1.8): every call of its sparse attention (window 8, groups of 4 and
    2, an indexer top-k of 4; 20 positions, a snapshot every token) equals attention recomputed
    from the file, prompt and decode, and would not from the window alone, nor from every whole
    group where the indexer chose some."""
    from mlx_lm.sample_utils import make_sampler

    from kvsnap.capture import generate
    from kvsnap.capture.architectures import _Kernel
    from kvsnap.capture.tiny import build, byte_tokenizer

    model = build("deepseek_v41")
    path = tmp_path / "v41.kv"
    with _Kernel() as kernel:  # (queries (B, H, S, D), window keys, output (B, H, S, D)) a call
        list(
            generate(
                model,
                byte_tokenizer(),
                "pooled",  # within the window: every prompt query's keys are in the first snapshot
                max_tokens=14,
                output=path,
                every=1,
                queries="all",
                sampler=make_sampler(0.0),
            )
        )
    layers = len(model.layers)
    calls = [np.array(out.astype(mx.float32)) for _, _, out in kernel.calls]
    assert len(calls) % layers == 0 and len(calls) >= 5 * layers  # prompt and decode steps, per layer
    with kvformat.open(path) as snap:
        assert snap.version == (1, 8)
        pooled_layers, selective = 0, 0.0
        for layer in range(layers):
            window = layers + layer  # the layer's window keys (SPEC 15.2, holds)
            spec = snap.layers[window].queries
            assert spec is not None and snap.layers[window].attributes["holds"] == "window"
            steps = calls[layer::layers]
            expected = np.concatenate([c[0].transpose(1, 0, 2) for c in steps], axis=0)  # (positions, H, D)
            worst, without, unchosen = 0.0, 0.0, 0.0
            for head in range(spec.num_heads):
                output, positions = snap.attention_output(window, head)
                assert positions.tolist() == list(range(positions.size)) and positions.size > 16
                expected = expected[: positions.size]  # a step after the last snapshot: not stored
                scale = float(np.abs(expected[:, head]).max())
                worst = max(worst, float(np.abs(output - expected[:, head]).max()) / scale)
                if spec.pooled is not None:  # the window alone: what ignoring the pooled keys gives
                    found = snap.queries(window, head)
                    keys = snap.head(window, 0)
                    assert found is not None and keys is not None
                    plain = kvformat.QuerySpec(
                        spec.num_heads,
                        spec.dim,
                        spec.dtype,
                        spec.scale,
                        spec.kv_heads,
                        window=spec.window,
                        sinks=spec.sinks,
                    )
                    alone = (
                        attention.weights(plain, head, found.q, keys.k, positions, keys.positions) @ keys.v
                    )
                    without = max(without, float(np.abs(alone - expected[:, head]).max()) / scale)
                    # Every whole group, as if the indexer had chosen them all.
                    every = attention.context_keys(snap, window, 0, 0, positions, pooled=True)
                    unselected = attention.weights(
                        spec, head, found.q, every.k, positions, every.positions, None, every.pooled
                    )
                    error = float(np.abs(unselected @ every.v - expected[:, head]).max()) / scale
                    unchosen = max(unchosen, error)
            assert worst <= 1e-5, (layer, worst)
            if spec.pooled is not None:
                pooled_layers += 1
                assert spec.selection == 4 and without > 1e-3, (layer, without)
                selective = max(selective, unchosen)
        assert pooled_layers >= 2 and selective > 1e-3  # the indexer's choice mattered somewhere
