"""GGUF -> mlx-lm conversion on the two real fixture models."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import generate, load
from mlx_lm.utils import load_model

from kvsnap.capture.convert import _ARCHITECTURES, _target_name, convert_gguf, dequantized_tensors
from kvsnap.capture.errors import UnsupportedModelError
from kvsnap.capture.fixtures import default_dtype, fetch_gguf
from tests.conftest import PROSE


def reverse_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """transformers' ``reverse_permute_weights`` (its GGUF loader): llama.cpp's q/k row order back
    to the checkpoint's, written out here independently of the converter."""
    dim = weights.shape[0] // heads // 2
    return weights.reshape(heads, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)


def perplexity(model: nn.Module, tokenizer: object, text: str) -> float:
    ids = mx.array([tokenizer.encode(text)])  # type: ignore[attr-defined]
    logits = model(ids[:, :-1]).astype(mx.float32)
    return float(mx.exp(nn.losses.cross_entropy(logits[0], ids[0, 1:]).mean()).item())


def test_smollm2_answers_paris_and_has_sane_perplexity(smollm2_dir: Path) -> None:
    model, tokenizer = load(str(smollm2_dir))
    text = generate(model, tokenizer, "The capital of France is", max_tokens=6, verbose=False)
    assert "Paris" in text
    ppl = perplexity(model, tokenizer, PROSE)
    assert 3 < ppl < 20, ppl  # measured 10.7


def test_smollm2_needs_the_checkpoints_half_split_rope(smollm2_dir: Path) -> None:
    """Negative control: the q/k rows are back in the checkpoint's order, so the
    model uses half-split RoPE; with llama.cpp's interleaved pairing it is wrong, and it shows."""
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["rope_traditional"] is False
    model, _config = load_model(smollm2_dir, model_config={"rope_traditional": True})
    _, tokenizer = load(str(smollm2_dir))
    assert perplexity(model, tokenizer, PROSE) > 40


def test_gemma3_has_sane_perplexity_and_adds_bos(gemma3_dir: Path) -> None:
    model, tokenizer = load(str(gemma3_dir))
    ids = tokenizer.encode(PROSE)
    assert ids[0] == 2  # <bos>: Gemma is lost without it
    ppl = perplexity(model, tokenizer, PROSE)
    assert 3 < ppl < 20, ppl  # measured 10.0 (float16)
    config = json.loads((gemma3_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert (config["rope_local_base_freq"], config["sliding_window_pattern"]) == (10000.0, 6)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_converted_weights_equal_dequantized_gguf(name: str, smollm2_dir: Path, gemma3_dir: Path) -> None:
    directory = smollm2_dir if name == "smollm2-135m" else gemma3_dir
    weights = mx.load(str(directory / "model.safetensors"))
    gemma = name.startswith("gemma")
    names = _ARCHITECTURES["gemma3" if gemma else "llama"][1]
    config = json.loads((directory / "config.json").read_text())
    seen = set()
    sample = slice(None, None, 97)  # the largest tensor: compare every 97th row
    for gguf_name, array in dequantized_tensors(fetch_gguf(name), {"token_embd.weight": sample}):
        key = _target_name(gguf_name, names)
        expected = array - 1 if gemma and gguf_name.endswith("norm.weight") else array
        if not gemma and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads" if "attn_q" in gguf_name else "num_key_value_heads"]
            expected = reverse_permute(expected, heads)
        if gguf_name == "token_embd.weight":
            got = np.array(weights[key][sample].astype(mx.float32))
        else:
            got = np.array(weights[key].astype(mx.float32))
        stored = {mx.float16: np.float16, mx.float32: np.float32}[weights[key].dtype]  # the fixture's
        np.testing.assert_array_equal(got, expected.astype(stored).astype(np.float32), err_msg=key)
        seen.add(key)
    assert seen == set(weights)


def test_conversion_is_deterministic(tmp_path: Path, smollm2_dir: Path) -> None:
    out = convert_gguf(fetch_gguf("smollm2-135m"), tmp_path / "again", default_dtype())  # smollm2_dir's
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        first = hashlib.sha256((smollm2_dir / name).read_bytes()).hexdigest()
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == first, name


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="mamba"):
        convert_gguf(path, tmp_path / "out")


@pytest.mark.network
def test_a_gguf_is_converted_once_staged_and_named_by_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A capture from a .gguf records the GGUF's own name and
    architecture (the hash stays as identity); the converted copy's place and size are said; a
    conversion that fails half-way leaves nothing that looks finished."""
    from kvsnap.capture import fixtures
    from kvsnap.capture.model_info import file_metadata

    gguf = fetch_gguf("smollm2-135m")  # before the cache moves
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    monkeypatch.setenv("KVSNAP_CACHE", str(tmp_path / "cache"))

    def broken(src: Path, out: Path, dtype: str = "float16") -> Path:
        Path(out).mkdir()
        (Path(out) / "config.json").write_text("{}")  # what used to pass for a finished conversion
        raise RuntimeError("disk full")

    monkeypatch.setattr(fixtures, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        fixtures.converted_gguf(gguf)
    converted = tmp_path / "cache" / "converted"
    assert list(converted.iterdir()) == []  # no staging folder, no half-made model
    monkeypatch.setattr(fixtures, "convert_gguf", convert_gguf)
    out = fixtures.converted_gguf(gguf)
    dtype = fixtures.default_dtype()
    assert out == converted / (digest[:16] if dtype == "float16" else f"{digest[:16]}-{dtype}")
    said = capsys.readouterr().err
    assert f"cached in {out}" in said and f" MB, {dtype})" in said
    assert fixtures.converted_gguf(gguf) == out and capsys.readouterr().err == ""  # reused, silently
    model, tokenizer = load(str(out))
    meta = file_metadata(model, str(out), tokenizer)["model"]
    assert meta["name"] == "Smollm2 135M 8k Lc100K Mix1 Ep2" and meta["architecture"] == "llama"
    assert meta["gguf"]["sha256"] == digest and meta["gguf"]["file"] == gguf.name
    assert meta["gguf"]["size_label"] == "135M" and meta["path"] == str(out)


def test_conversion_imports_transformers_without_its_torch_advice() -> None:
    """convert-gguf and fetch-models use transformers' tokenizer code only: its "PyTorch was not
    found" advice is not printed, and the environment is left as it was."""
    import subprocess
    import sys

    code = (
        "import os; from kvsnap.capture.convert import _gguf_tokenizer_mapping; "
        "mapping, convert = _gguf_tokenizer_mapping(); assert 'tokenizer' in mapping; "
        "print('TRANSFORMERS_NO_ADVISORY_WARNINGS' in os.environ)"
    )
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}  # mlx_lm sets it
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert "PyTorch was not found" not in run.stderr
    assert run.stdout.strip() == "False"
