"""`tests.reference.runs.ReferenceRun`: a reference's output is kept by the content of what it
was given and reused only for exactly that; a failed run fails and keeps nothing. A stand-in
reference Python (a shell script counting its runs) plays the reference here."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.reference.runs import ReferenceRun


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    python = tmp_path / "python"
    runs = tmp_path / "runs.log"
    # argv: SCRIPT GGUF INPUT... OUTPUT; the output is the input's content upper-cased
    python.write_text(
        "#!/bin/sh\n"
        f'echo run >> "{runs}"\n'
        "for last; do :; done\n"
        'if grep -q fail "$3"; then echo "reference broke" >&2; exit 3; fi\n'
        'tr a-z A-Z < "$3" > "$last"\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("KVSNAP_REFERENCE_PYTHON", str(python))
    monkeypatch.setenv("KVSNAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVSNAP_REFERENCE_CACHE", raising=False)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" * 8)
    return {"runs": runs, "gguf": gguf, "tmp": tmp_path}


def _run(fake: dict[str, Path], text: str, name: str = "out.txt") -> ReferenceRun:
    given = fake["tmp"] / "input.txt"
    given.write_text(text)
    return ReferenceRun("kvpress_kept.py", fake["gguf"], [given], fake["tmp"] / name)


def _count(fake: dict[str, Path]) -> int:
    return len(fake["runs"].read_text().splitlines()) if fake["runs"].exists() else 0


def test_the_same_inputs_reuse_the_output_and_other_inputs_run_again(fake: dict[str, Path]) -> None:
    first = _run(fake, "abc", "one.txt")
    assert not first.cached and first.wait().read_text() == "ABC" and _count(fake) == 1
    again = _run(fake, "abc", "two.txt")
    assert again.cached and again.wait().read_text() == "ABC" and _count(fake) == 1
    other = _run(fake, "abd", "three.txt")
    assert not other.cached and other.wait().read_text() == "ABD" and _count(fake) == 2


def test_a_failed_run_fails_and_keeps_nothing(fake: dict[str, Path]) -> None:
    with pytest.raises(AssertionError, match="reference broke"):
        _run(fake, "fail").wait()
    with pytest.raises(AssertionError, match="reference broke"):
        _run(fake, "fail").wait()  # run again, not answered from a kept failure
    assert _count(fake) == 2
    assert not any((fake["tmp"] / "cache").rglob("*.partial"))


def test_keeping_can_be_turned_off(fake: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSNAP_REFERENCE_CACHE", "0")
    for name in ("one.txt", "two.txt"):
        run = _run(fake, "abc", name)
        assert not run.cached and run.wait().read_text() == "ABC"
    assert _count(fake) == 2 and not (fake["tmp"] / "cache").exists()
