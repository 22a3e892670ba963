"""Capture: every mlx-lm cache class read in temporal order with positions, saved, read back
bit-exactly and restored; generation with snapshots and resume on tiny and real models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.models import cache as cache_module
from mlx_lm.sample_utils import make_sampler

import kvformat
from kvformat.quantization import Quantization
from kvsnap.analysis.stats.rope import Rope
from kvsnap.capture.caches import build_cache, read_layer, to_numpy, unified_memory
from kvsnap.capture.errors import UnsupportedModelError
from kvsnap.capture.generation import generate
from kvsnap.capture.resume import layers_of as restore_layers
from kvsnap.capture.resume import restore, text_of, tokens_of
from kvsnap.capture.snapshot import snapshot_kv
from kvsnap.capture.tiny import tiny_model

H, D = 2, 8


def feed(cache: Any, steps: list[int], seed: int = 0, dim: int = D) -> tuple[np.ndarray, np.ndarray]:
    """Feed random K/V in updates of the given sizes; return every K and V fed, (H, T, D)."""
    rng = np.random.default_rng(seed)
    ks, vs = [], []
    for n in steps:
        k = rng.standard_normal((1, H, n, dim)).astype(np.float32)
        v = rng.standard_normal((1, H, n, dim)).astype(np.float32)
        cache.update_and_fetch(mx.array(k), mx.array(v))
        ks.append(k[0])
        vs.append(v[0])
    mx.eval(cache.state)
    return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)


def roundtrip(tmp_path: Path, caches: list[Any]) -> kvformat.Snapshot:
    snap = snapshot_kv(caches)
    path = tmp_path / "c.kv"
    path.unlink(missing_ok=True)
    snap.save(path)
    return kvformat.open(path)


STEPS = [5, 1, 1, 1, 4, 1, 1, 1, 1, 1, 1, 1]  # 19 tokens: a prefill, single steps, a chunk


@pytest.mark.parametrize(
    "make,expected_positions",
    [
        (lambda: cache_module.KVCache(), lambda t: np.arange(t)),
        (lambda: cache_module.ConcatenateKVCache(), lambda t: np.arange(t)),
        (lambda: cache_module.RotatingKVCache(max_size=8, keep=0), None),
        (lambda: cache_module.RotatingKVCache(max_size=8, keep=2), None),
        (lambda: cache_module.ChunkedKVCache(chunk_size=6), None),
    ],
    ids=["KVCache", "ConcatenateKVCache", "Rotating", "Rotating-keep", "Chunked"],
)
def test_cache_class_roundtrip_is_bit_exact(tmp_path: Path, make: Any, expected_positions: Any) -> None:
    cache = make()
    if isinstance(cache, cache_module.ChunkedKVCache):
        k_all, v_all = feed(cache, STEPS[:6])
        cache.maybe_trim_front()
    else:
        k_all, v_all = feed(cache, STEPS)
    total = k_all.shape[1]
    layer = read_layer(cache)
    positions = layer.positions[0]
    if expected_positions is not None:
        assert positions.tolist() == expected_positions(total).tolist()
    # Whatever positions the cache says it holds, K/V are exactly what was fed at them.
    assert positions[-1] == total - 1
    np.testing.assert_array_equal(layer.k[0], k_all[:, positions])
    np.testing.assert_array_equal(layer.v[0], v_all[:, positions])
    with roundtrip(tmp_path, [cache]) as snap:
        for head in range(H):
            got = snap.head(0, head)
            assert got is not None
            np.testing.assert_array_equal(got.k, k_all[head, positions])
            np.testing.assert_array_equal(got.positions, positions)
        assert snap.layers[0].attributes["cache_class"] == type(cache).__name__
        rebuilt = read_layer(build_cache(read_layer(cache)))
        np.testing.assert_array_equal(rebuilt.k[0], layer.k[0])
        np.testing.assert_array_equal(rebuilt.positions[0], positions)


def test_strided_heads_are_gathered_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Save gathers strided K/V heads on the writer's helper thread into a ring of reused buffers:
    every head of many work units (far more than the ring holds) reads back equal to the cache,
    in bf16 too."""
    monkeypatch.setattr(kvformat.writer, "PIPELINE_BYTES", 0)  # pipeline even this small cache
    monkeypatch.setattr(kvformat.writer, "_UNIT_BYTES", 4096)  # and in many small work units
    rng = np.random.default_rng(5)
    caches, expected = [], []
    for layer in range(7):
        cache = cache_module.KVCache()
        shape = (1, 256 * (1 + layer % 2), 3, 16)  # (B, L, H, D) transposed, as attention does;
        # a prefill of whole 256-token steps stays a strided view of it in the cache
        k = mx.array(rng.standard_normal(shape).astype(np.float32)).transpose(0, 2, 1, 3)
        v = mx.array(rng.standard_normal(shape).astype(np.float32)).transpose(0, 2, 1, 3)
        if layer % 2:
            k, v = k.astype(mx.bfloat16), v.astype(mx.bfloat16)
        cache.update_and_fetch(k, v)
        caches.append(cache)
        expected.append((to_numpy(k)[0], to_numpy(v)[0]))
    snap = snapshot_kv(caches)
    # With unified memory (CPU here, Apple silicon) the snapshot is a view of the cache, strided
    # where the cache is; on CUDA it would be copied contiguous on the device first.
    assert snap.layers[0].v[0][0].flags.c_contiguous != unified_memory()
    assert snap.layers[1].k[0][2].flags.c_contiguous != unified_memory()
    snap.save(tmp_path / "s.kv")
    with kvformat.open(tmp_path / "s.kv") as back:
        for layer, (k, v) in enumerate(expected):
            for head in range(3):
                got = back.head(layer, head)
                assert got is not None
                np.testing.assert_array_equal(got.k, k[head])
                np.testing.assert_array_equal(got.v, v[head])


def test_rotating_window_positions() -> None:
    cache = cache_module.RotatingKVCache(max_size=8, keep=2)
    feed(cache, STEPS)
    assert read_layer(cache).positions[0].tolist() == [0, 1, 13, 14, 15, 16, 17, 18]
    big = cache_module.RotatingKVCache(max_size=8, keep=0)
    feed(big, [12])  # a prefill longer than the window holds every token until the next step
    assert read_layer(big).positions[0].tolist() == list(range(12))
    feed(big, [1])
    assert read_layer(big).positions[0].tolist() == list(range(5, 13))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_cache_is_stored_natively(tmp_path: Path, bits: int) -> None:
    cache = cache_module.QuantizedKVCache(group_size=32, bits=bits)
    feed(cache, STEPS, dim=64)
    with roundtrip(tmp_path, [cache]) as snap:
        assert snap.layers[0].quantization == Quantization(bits, 32)
        head = snap.head(0, 1)
        assert head is not None and head.positions.tolist() == list(range(19))
        w, scales, biases = (x[..., :19, :] for x in cache.keys)
        expected = mx.dequantize(w, scales, biases, group_size=32, bits=bits)
        np.testing.assert_array_equal(head.k, to_numpy(expected)[0, 1])  # dequantized on read, exactly
        stored = snap.quantized_head(0, 1)
        assert stored is not None
        for got, part in zip(stored[0], (w, scales, biases), strict=True):
            np.testing.assert_array_equal(got, to_numpy(part)[0, 1])  # packed words, scales, biases
        restored = build_cache(restore_layers(snap)[0])
        for a, b in zip(restored.keys, cache.keys, strict=True):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b[..., :19, :]))


def test_batch_cache_removes_left_padding(tmp_path: Path) -> None:
    cache = cache_module.BatchKVCache(left_padding=[2, 0])
    rng = np.random.default_rng(0)
    k = rng.standard_normal((2, H, 6, D)).astype(np.float32)
    cache.update_and_fetch(mx.array(k), mx.array(k))
    mx.eval(cache.state)
    with roundtrip(tmp_path, [cache]) as snap:
        assert snap.num_seqs == 2
        first, second = snap.head(0, 1, seq=0), snap.head(0, 1, seq=1)
        assert first is not None and second is not None
        np.testing.assert_array_equal(first.k, k[0, 1, 2:])
        assert first.positions.tolist() == [0, 1, 2, 3]
        np.testing.assert_array_equal(second.k, k[1, 1])


def test_batch_rotating_cache_per_sequence_windows(tmp_path: Path) -> None:
    cache = cache_module.BatchRotatingKVCache(max_size=8, left_padding=[2, 0])
    rng = np.random.default_rng(4)
    prefill = rng.standard_normal((2, H, 6, D)).astype(np.float32)
    cache.update_and_fetch(mx.array(prefill), mx.array(prefill))
    fed = [prefill]
    for _ in range(10):
        step = rng.standard_normal((2, H, 1, D)).astype(np.float32)
        cache.update_and_fetch(mx.array(step), mx.array(step))
        fed.append(step)
    everything = np.concatenate(fed, axis=2)  # (2, H, 16, D) slots as fed, padding included
    with roundtrip(tmp_path, [cache]) as snap:
        for seq, pad in enumerate((2, 0)):
            head = snap.head(0, 1, seq=seq)
            assert head is not None
            real = everything[seq, 1, pad:]  # this sequence's tokens in order
            assert head.positions.tolist() == list(range(len(real) - 8, len(real)))
            np.testing.assert_array_equal(head.k, real[-8:])


def test_recurrent_and_unknown_caches(tmp_path: Path) -> None:
    arrays = cache_module.ArraysCache(2)
    kv = cache_module.KVCache()
    feed(kv, [3])
    with roundtrip(tmp_path, [arrays, kv]) as snap:
        assert snap.head(0, 0) is None
        assert snap.layers[0].attributes["kind"] == "recurrent"
        assert snap.head(1, 0) is not None

    class Mystery:
        pass

    with pytest.raises(UnsupportedModelError, match="Mystery"):
        snapshot_kv([Mystery()])
    combined = cache_module.CacheList(cache_module.ArraysCache(1), cache_module.KVCache())
    feed(combined.caches[1], [4])
    with roundtrip(tmp_path, [combined]) as snap:
        attributes = snap.layers[0].attributes
        assert attributes["sub_caches"] == ["ArraysCache", "KVCache"] and "not_stored" not in attributes
        assert attributes["state"] == [None] and attributes["state_sub_cache"] == 0  # slot not set yet
        head = snap.head(0, 1)
        assert head is not None and head.positions.tolist() == [0, 1, 2, 3]
        (rebuilt,) = restore(snap)
    assert [type(c).__name__ for c in rebuilt.caches] == ["ArraysCache", "KVCache"]
    assert rebuilt.caches[0].cache == [None] and rebuilt.caches[1].offset == 4
    # Two K/V caches in one layer (a sparse-attention indexer's keys): the second is a file
    # layer of its own after the model's, and restore puts both back in their list.
    pair = cache_module.CacheList(cache_module.KVCache(), cache_module.KVCache())
    own, indexer = feed(pair.caches[0], [3, 1]), feed(pair.caches[1], [3, 1], seed=7, dim=8)
    with roundtrip(tmp_path, [cache_module.KVCache(), pair]) as snap:
        assert snap.num_layers == 3
        assert snap.layers[1].attributes["extra_layers"] == [[1, 2]]
        assert snap.layers[2].attributes["of_layer"] == 1 and snap.layers[2].attributes["sub_cache"] == 1
        head = snap.head(2, 1)
        assert head is not None and head.positions.tolist() == [0, 1, 2, 3]
        np.testing.assert_array_equal(head.k, indexer[0][1])
        rebuilt = restore(snap)
    assert len(rebuilt) == 2 and [type(c).__name__ for c in rebuilt[1].caches] == ["KVCache", "KVCache"]
    for restored, fed in zip(rebuilt[1].caches, (own, indexer), strict=True):
        np.testing.assert_array_equal(np.array(restored.keys[0, :, : restored.offset]), fed[0])
    with pytest.raises(UnsupportedModelError, match="Mystery"):
        snapshot_kv([cache_module.CacheList(cache_module.KVCache(), Mystery())])


def run(model: Any, tokenizer: Any, prompt: list[int], n: int, **kwargs: Any) -> list[int]:
    return [r.token for r in generate(model, tokenizer, prompt, max_tokens=n, **kwargs)]


def _tiny_tokenizer() -> Any:
    """A real byte-level tokenizer of 256 tokens (ids = bytes), wrapped as mlx-lm wraps HF ones."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=backend))


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("llama", {}),
        ("gemma3_text", {}),
        ("qwen3", {}),
        ("llama", {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}),
        ("lfm2", {}),
        ("nemotron_h", {}),
    ],
    ids=["llama", "gemma3-sliding", "qwen3", "llama-quantized", "lfm2-hybrid", "nemotron_h-hybrid"],
)
def test_tiny_series_and_resume(tmp_path: Path, arch: str, extra: dict[str, Any]) -> None:
    model = tiny_model(arch)
    tokenizer = _tiny_tokenizer()
    prompt = list(range(1, 12))
    path = tmp_path / "series.kv"
    reference = [
        r.token
        for r in stream_generate(
            model, tokenizer, mx.array(prompt), max_tokens=24, sampler=make_sampler(0.0), **extra
        )
    ]
    tokens = run(model, tokenizer, prompt, 24, output=path, every=5, **extra)
    assert tokens == reference  # capturing changes nothing
    with kvformat.open(path) as snap:
        snap.verify()
        assert snap.num_snapshots == 5  # after 5, 10, 15, 20 and the final 24
        assert snap.metadata["prompt_tokens"] == 11
        assert snap.metadata["generation"]["max_tokens"] == 24 and snap.metadata["generation"]["every"] == 5
        stored = 0  # token ids written into the index over the whole series
        for index in range(snap.num_snapshots):
            view = snap.select(index)
            metadata = view.snapshot_metadata
            assert ("tokens" in metadata) == (index == 0)  # later snapshots store only what is new
            stored += len((metadata.get("tokens") or metadata["tokens_appended"])[0])
            ids = tokens_of(view)[0]
            assert ids == prompt + reference[: metadata["generated"]]
            # The text as mlx-lm streamed it: decode(ids), less bytes of a character not yet
            # complete (random tiny models emit many).
            text, decoded = text_of(view)[0], tokenizer.decode(ids)
            assert decoded.startswith(text)
            if index == snap.num_snapshots - 1:
                assert text == decoded  # the stream is flushed at the end
            n_tokens = len(ids)
            assert view.seq_len == n_tokens == len(prompt) + view.snapshot_metadata["generated"]
            for layer, spec in enumerate(view.layers):
                if spec.attributes["kind"] == "recurrent":  # its state, a new copy every snapshot
                    assert not spec.present and spec.attributes["state"]
                    names = [n for n in view.array_names if n.startswith(f"state/{layer}/")]
                    assert names and all(view.array(n) is not None for n in names)
                    continue
                positions = view.positions(layer)
                assert positions is not None
                if spec.attributes["kind"] == "sliding":
                    assert positions[-1] == n_tokens - 1 and positions.size <= max(
                        spec.attributes["window"], 11
                    )
                else:
                    assert positions.tolist() == list(range(n_tokens))
            resumed = run(
                model, tokenizer, [], 24 - view.snapshot_metadata["generated"], resume=view, **extra
            )
            assert resumed == reference[len(reference) - len(resumed) :], f"snapshot {index}"
        assert stored == len(prompt) + len(reference)  # O(tokens), not O(tokens x snapshots)


def test_live_cache_equals_file_after_generation(tmp_path: Path) -> None:
    model = tiny_model("gemma3_text")
    tokenizer = _tiny_tokenizer()
    cache = cache_module.make_prompt_cache(model)
    for _ in stream_generate(
        model, tokenizer, mx.array(list(range(1, 15))), max_tokens=10, prompt_cache=cache
    ):
        pass
    with roundtrip(tmp_path, cache) as snap:
        for index, live in enumerate(cache):
            layer = read_layer(live)
            for head in range(layer.k[0].shape[0]):
                got = snap.head(index, head)
                assert got is not None
                np.testing.assert_array_equal(got.k, layer.k[0][head])
                np.testing.assert_array_equal(got.v, layer.v[0][head])
                np.testing.assert_array_equal(got.positions, layer.positions[0])
    restored = restore(snapshot_kv(cache))
    assert [type(c).__name__ for c in restored] == [type(c).__name__ for c in cache]


def test_hybrid_and_latent_models(tmp_path: Path) -> None:
    model = tiny_model("lfm2")
    tokens = run(model, _tiny_tokenizer(), list(range(1, 8)), 4, output=tmp_path / "h.kv")
    assert len(tokens) == 4
    with kvformat.open(tmp_path / "h.kv") as snap:
        assert [layer.present for layer in snap.layers] == [False, True, False, True]
        assert snap.head(0, 0) is None
    model = tiny_model("deepseek_v3")
    reference = run(model, _tiny_tokenizer(), [1, 2, 3], 6)
    assert run(model, _tiny_tokenizer(), [1, 2, 3], 6, output=tmp_path / "d.kv", at=[2]) == reference
    with kvformat.open(tmp_path / "d.kv") as snap:
        attributes = snap.layers[0].attributes
        assert (attributes["kind"], attributes["k_holds"], attributes["v_holds"]) == (
            "latent",
            "kv_latent",
            "k_rope",
        )
        assert (snap.layers[0].k_dim, snap.layers[0].v_dim, snap.layers[0].num_heads) == (16, 8, 1)
        assert run(model, _tiny_tokenizer(), [], 4, resume=snap.select(0)) == reference[2:]


def test_smollm2_keys_are_post_rope_projections(tmp_path: Path, smollm2_dir: Path) -> None:
    """Layer 0 K recomputed independently: rope(k_proj(rmsnorm(embed(x)))), half-split pairs
    (the checkpoint's order)."""
    model, tokenizer = load(str(smollm2_dir))
    prompt = tokenizer.encode("The capital of France is")
    path = tmp_path / "smol.kv"
    text = tokenizer.decode(run(model, tokenizer, prompt, 3, output=path))
    assert text.strip()
    with kvformat.open(path) as snap:
        rope = snap.metadata["rope"]
        assert rope["pairing"] == "half" and rope["dims"] == 64
        layer0 = model.model.layers[0]
        x = layer0.input_layernorm(model.model.embed_tokens(mx.array([prompt])))
        k = layer0.self_attn.k_proj(x).reshape(1, len(prompt), 3, 64).astype(mx.float32)
        positions = mx.arange(len(prompt)).astype(mx.float32)
        half = mx.arange(0, 64, 2).astype(mx.float32) / 64
        angles = positions[:, None] / (rope["base"] ** half)[None, :]
        cos, sin = mx.cos(angles)[None, :, None, :], mx.sin(angles)[None, :, None, :]
        first, second = k[..., :32], k[..., 32:]
        rotated = mx.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
        expected = np.array(rotated)[0]
        undo = Rope.from_metadata(snap.metadata, snap.layers[0].attributes, 64)
        pre_rope = np.array(k)[0]
        for head in range(3):
            got = snap.head(0, head, positions=(0, len(prompt)))
            assert got is not None
            np.testing.assert_allclose(got.k.astype(np.float32), expected[:, head], rtol=2e-2, atol=2e-2)
            # ...and analysis recovers the pre-RoPE projection from the file alone.
            recovered = undo.rotate(got.k, got.positions, inverse=True)
            np.testing.assert_allclose(recovered, pre_rope[:, head], rtol=2e-2, atol=2e-2)


@pytest.mark.network
@pytest.mark.parametrize("fixture", ["smollm2_dir", "gemma3_dir"])
def test_real_model_resume_equals_uninterrupted(
    tmp_path: Path, fixture: str, request: pytest.FixtureRequest
) -> None:
    directory = request.getfixturevalue(fixture)
    model, tokenizer = load(str(directory))
    prompt = tokenizer.encode("Once upon a time")
    total = 8 if fixture == "smollm2_dir" else 5
    path = tmp_path / "real.kv"
    reference = run(model, tokenizer, prompt, total, output=path, at=[2])
    with kvformat.open(path) as snap:
        early = snap.select(0)
        assert early.snapshot_metadata["generated"] == 2
        assert early.array("last_logits") is not None
        assert run(model, tokenizer, [], total - 2, resume=early) == reference[2:]
        # ...and streams the same text, leading spaces included
        texts = [r.text for r in generate(model, tokenizer, prompt, max_tokens=total)]
        resumed = [r.text for r in generate(model, tokenizer, [], max_tokens=total - 2, resume=early)]
        assert "".join(resumed) == "".join(texts[2:]), (resumed, texts)


@pytest.mark.parametrize("arch", sorted(__import__("kvsnap.capture.tiny", fromlist=["CONFIGS"]).CONFIGS))
def test_tiny_factory_builds_and_runs(arch: str) -> None:
    model = tiny_model(arch)
    cache = cache_module.make_prompt_cache(model)
    logits = model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    mx.eval(logits)
    assert logits.shape == (1, 5, 256) and bool(mx.all(mx.isfinite(logits)).item())
    kinds = {type(c).__name__ for c in cache}
    hybrid = {"ArraysCache", "KVCache"}  # recurrent state beside attention
    expected = {"gemma3_text": {"RotatingKVCache", "KVCache"}, "lfm2": hybrid, "nemotron_h": hybrid}
    assert kinds == expected.get(arch, {"KVCache"})


def test_capture_command(tmp_path: Path, smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvsnap.cli import main

    out = tmp_path / "cli.kv"
    args = [
        "capture",
        "--model",
        str(smollm2_dir),
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "3",
        "--every",
        "1",
        "--seed",
        "1",
        "-o",
        str(out),
    ]
    assert main(args) == 0
    assert "3 snapshot(s)" in capsys.readouterr().out
    with kvformat.open(out) as snap:
        assert snap.num_snapshots == 3
        assert snap.metadata["generation"]["temperature"] == 0.0
        assert snap.metadata["prompt"] == "The capital of France is"
        assert [snap.select(i).snapshot_metadata["generated"] for i in range(3)] == [1, 2, 3]


def _piece_bytes(piece: str) -> bytes:
    """A token piece back to bytes: its text as UTF-8, each ``<0xHH>`` as that byte."""
    import re

    parts = re.split(r"(<0x[0-9A-F]{2}>)", piece)
    return b"".join(bytes([int(p[3:5], 16)]) if p.startswith("<0x") else p.encode() for p in parts)


def test_a_token_holding_part_of_a_character_is_labelled_with_its_bytes(
    smollm2_dir: Path, gemma3_dir: Path
) -> None:
    """Byte-level BPE (SmolLM2) and SentencePiece's byte fallback (Gemma-3): a token that holds
    part of a UTF-8 character is labelled with its bytes, not U+FFFD; SmolLM2's labels joined
    are the text's own UTF-8 bytes, and Gemma-3's for U+1D518 the four bytes Python encodes it as."""
    from kvsnap.capture.generation import token_pieces

    fraktur = "\U0001d518"  # four bytes in UTF-8, none of them a character alone
    text = f"caf\u00e9 \u2013 \u65e5\u672c {fraktur}"
    _, tokenizer = load(str(smollm2_dir))
    ids = tokenizer.encode(text)
    pieces = token_pieces(tokenizer, ids)
    assert not any("\ufffd" in p for p in pieces) and any("<0x" in p for p in pieces)
    assert b"".join(_piece_bytes(p) for p in pieces) == text.encode()
    _, tokenizer = load(str(gemma3_dir))
    pieces = token_pieces(tokenizer, tokenizer.encode(text))
    assert not any("\ufffd" in p for p in pieces)
    assert b"".join(_piece_bytes(p) for p in pieces if p.startswith("<0x")) == fraktur.encode()


@pytest.mark.parametrize("arch", ["afm7", "lille-130m", "nemotron_h"])
def test_model_arguments_of_every_naming_capture(tmp_path: Path, arch: str) -> None:
    """mlx-lm's own classes whose arguments name the width ``hidden_dim`` (afm7) or ``n_embd``
    (lille-130m), or hold ``inf`` (nemotron_h's default ``time_step_limit``): the capture
    verifies; the RoPE description's dims are the head dim the model's attention modules hold;
    the config's infinite value is the string "Infinity" (SPEC 15.1), so the metadata is JSON."""
    import json

    model, tokenizer = tiny_model(arch), _tiny_tokenizer()
    path = tmp_path / f"{arch}.kv"
    tokens = [r.token for r in generate(model, tokenizer, list(range(1, 12)), max_tokens=4, output=path)]
    assert len(tokens) == 4
    with kvformat.open(path) as snap:
        snap.verify()
        json.dumps(snap.metadata, allow_nan=False)  # plain JSON throughout
        config = snap.metadata["model"]["config"]
        rope = snap.metadata.get("rope")
    dims = {m.head_dim for m in model.modules() if isinstance(getattr(m, "head_dim", None), int)}
    if arch == "nemotron_h":
        assert config["time_step_limit"] == [0.0, "Infinity"]
    else:
        assert rope is not None and dims == {rope["dims"]}


def test_queries_are_refused_where_attention_bypasses_the_hook(tmp_path: Path) -> None:
    """A model none of whose modules computes attention through mlx-lm's
    ``scaled_dot_product_attention`` or is an attention class kvsnap reads itself (RWKV-7):
    ``queries=`` is refused by name before anything is generated or written (never a file
    silently without queries); without queries it captures."""
    from kvsnap.capture.tiny import build

    model, tokenizer = build("rwkv7"), _tiny_tokenizer()
    path = tmp_path / "r.kv"
    with pytest.raises(UnsupportedModelError, match="rwkv7 computes attention without"):
        next(iter(generate(model, tokenizer, list(range(1, 9)), max_tokens=2, output=path, queries="all")))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert len(list(generate(model, tokenizer, list(range(1, 9)), max_tokens=2, output=path))) == 2
    with kvformat.open(path) as snap:
        assert all(layer.queries is None for layer in snap.layers) and snap.verify()


def test_an_attention_module_of_its_own_records_its_queries_and_softcap(tmp_path: Path) -> None:
    """Gemma 2 computes soft-capped attention itself: its queries are recorded through its own
    call, with its scale and soft-cap, and its class is left as it was afterwards (the
    architecture check holds the recomputed attention to the model's)."""
    from mlx_lm.models import gemma2

    original = gemma2.Attention.__call__
    model, tokenizer = tiny_model("gemma2"), _tiny_tokenizer()
    path = tmp_path / "g.kv"
    steps = generate(model, tokenizer, list(range(1, 9)), max_tokens=2, output=path, queries="all")
    assert len(list(steps)) == 2
    assert gemma2.Attention.__call__ is original
    attention = model.model.layers[0].self_attn
    with kvformat.open(path) as snap:
        for layer in snap.layers:
            assert layer.queries is not None
            assert layer.queries.softcap == attention.attn_logit_softcapping == 0.5
            assert layer.queries.scale == pytest.approx(attention.scale)
        found, keys = snap.queries(0, 0), snap.head(0, 0)
        assert found is not None and keys is not None
        assert found.positions.tolist() == keys.positions.tolist()  # a query at every position


def test_a_cache_that_held_nothing_is_recorded_empty_and_restores_as_one(tmp_path: Path) -> None:
    """A layer whose attention never filled its cache (nemotron-nas's no-op and linear layers):
    absent, ``empty``, its class's settings kept, restored as a new cache of that class."""
    caches = [
        cache_module.RotatingKVCache(max_size=8, keep=2),
        cache_module.KVCache(),
        cache_module.ChunkedKVCache(4),
    ]
    feed(caches[1], [3])
    with roundtrip(tmp_path, caches) as snap:
        attributes = [layer.attributes for layer in snap.layers]
        assert [a.get("empty", False) for a in attributes] == [True, False, True]
        assert (
            attributes[0]["window"] == 8 and attributes[0]["keep"] == 2 and attributes[2]["chunk_size"] == 4
        )
        assert not snap.layers[0].present and snap.layers[1].present
        rebuilt = restore(snap)
    assert [type(c).__name__ for c in rebuilt] == ["RotatingKVCache", "KVCache", "ChunkedKVCache"]
    assert [c.offset for c in rebuilt] == [0, 3, 0] and rebuilt[0].max_size == 8 and rebuilt[0].keep == 2
