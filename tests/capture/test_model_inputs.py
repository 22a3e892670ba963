"""The model a capture reads is an input: no output lands in its folder or in kvsnap's model
cache, even with ``--force``; a folder that no longer loads is named with the file that fails; a
cached fixture model damaged by hand is converted again, never used."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from kvsnap.capture import fixtures
from kvsnap.capture.model_folder import broken_file
from kvsnap.cli import main


def _safetensors(path: Path) -> None:
    header = json.dumps({"__metadata__": {"format": "mlx"}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def _model_folder(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    (folder / "tokenizer_config.json").write_text("{}")
    _safetensors(folder / "model.safetensors")
    return folder


def _digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "name", ["model.safetensors", "tokenizer.json", "config.json", "new.kv", "sub/../config.json"]
)
def test_no_output_lands_in_the_model_folder_even_with_force(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSNAP_CACHE", str(tmp_path / "cache"))
    model = _model_folder(tmp_path / "model")
    (model / "sub").mkdir()
    before = _digests(model)
    args = ["capture", "--model", str(model), "--prompt", "hi", "--max-tokens", "2", "--force"]
    code, err = _run([*args, "-o", str(model / name)], capsys)
    assert code == 2 and "a folder this command reads; write the output elsewhere" in err
    assert "Traceback" not in err and _digests(model) == before
    # through a symbolic link to the folder too
    (tmp_path / "link").symlink_to(model)
    code, err = _run([*args, "-o", str(tmp_path / "link" / "config.json")], capsys)
    assert code == 2 and "a folder this command reads" in err and _digests(model) == before


def test_no_output_lands_in_the_model_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model smollm2-135m`` reads kvsnap's cache: its converted files are refused as outputs
    before anything is fetched."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSNAP_CACHE", str(cache))
    converted = cache / "models" / "smollm2-135m-float16"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    args = ["capture", "--model", "smollm2-135m", "--prompt", "hi", "--force"]
    code, err = _run([*args, "-o", str(converted / "config.json")], capsys)
    assert code == 2 and f"inside {cache}" in err
    assert (converted / "config.json").read_text() == "{}"
    assert sorted(p.name for p in cache.rglob("*")) == ["config.json", "models", "smollm2-135m-float16"]


def test_the_python_api_refuses_an_output_in_the_model_folder(tmp_path: Path) -> None:
    from kvformat.io.outputs import SameAsInputError
    from kvsnap.capture.generation import _check_arguments

    model = _model_folder(tmp_path / "model")
    with pytest.raises(SameAsInputError, match="a folder this command reads"):
        _check_arguments("raw", "none", model / "tokenizer.json", False, True, str(model))
    with pytest.raises(SameAsInputError):
        _check_arguments("raw", "none", model / "run", True, True, str(model))  # separate files
    _check_arguments("raw", "none", tmp_path / "run.kv", False, False, str(model))


def test_the_broken_file_of_a_model_folder_is_named(tmp_path: Path) -> None:
    model = _model_folder(tmp_path / "model")
    assert broken_file(model) is None
    (model / "tokenizer.json").write_bytes(b"\x89PNG\r\n\x1a\n")
    assert (
        broken_file(model)
        == f"{model / 'tokenizer.json'}: not UTF-8 text (byte 0x89 at offset 0): not a JSON file"
    )
    (model / "tokenizer.json").write_text("{}")
    (model / "config.json").write_text('{"model_type": ')
    assert "config.json: not valid JSON" in str(broken_file(model))
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"KVSNAP\x00\x01" + bytes(300))  # a .kv-like file
    assert "model.safetensors: not a safetensors file" in str(broken_file(model))
    (model / "config.json").unlink()
    assert "config.json: missing" in str(broken_file(model))


def test_capture_names_the_file_of_a_model_folder_that_does_not_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSNAP_CACHE", str(tmp_path / "cache"))
    model = _model_folder(tmp_path / "model")
    (model / "tokenizer.json").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    code, err = _run(
        ["capture", "--model", str(model), "--prompt", "hi", "-o", str(tmp_path / "x.kv")], capsys
    )
    assert code == 2, err
    assert err.strip().splitlines() == [
        f"kvsnap: error: --model {model}: the model does not load: {model / 'tokenizer.json'}: "
        "not UTF-8 text (byte 0x89 at offset 0): not a JSON file"
    ]


def test_a_damaged_cached_model_is_converted_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker records each file's size and SHA-256: a file replaced by hand (another size)
    is noticed on every use; one of the same size by ``fetch-models`` (``check_hashes``)."""
    out = _model_folder(tmp_path / "converted")
    digest = "ab" * 32
    (out / fixtures.COMPLETE).write_text(
        "\n".join([fixtures._stamp(digest), *fixtures._file_lines(out)]) + "\n"
    )
    assert fixtures._finished(out, digest) and fixtures._finished(out, digest, check_hashes=True)
    assert not fixtures._finished(out, "cd" * 32)
    (out / "tokenizer.json").write_text(json.dumps({"version": "2.0"}))  # the same size
    assert fixtures._finished(out, digest) and not fixtures._finished(out, digest, check_hashes=True)
    (out / "model.safetensors").write_bytes(b"a .kv file written over the weights")
    assert not fixtures._finished(out, digest)
    (out / fixtures.COMPLETE).write_text(fixtures._stamp(digest) + "\n")  # a marker without file lines
    assert not fixtures._finished(out, digest)


@pytest.mark.network
def test_chat_without_a_template_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g.kv"
    code = main(
        ["capture", "--model", "gemma3-270m", "--chat", "--prompt", "Hi", "--max-tokens", "2", "-o", str(out)]
    )
    assert code == 2
    assert "has no chat template" in capsys.readouterr().err
    assert not out.exists()
