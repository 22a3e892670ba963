"""The reference scripts of this folder, run in the reference Python (torch, transformers, kvpress:
``make reference``), with their outputs kept by content.

A reference run takes 20 s to 2 min on a laptop-class CPU, and its answer depends only on what it
is given: the script (and this folder's other scripts), the pinned packages
(``requirements.txt``), the GGUF file and the input files. `ReferenceRun` hashes exactly those; a
run with the same hash as an earlier finished one copies that run's output instead of starting
Python again, so each reference runs once per change of its inputs, not once per test session.
The kvsnap side of every test runs each time and is held to that output.

``KVSNAP_REFERENCE_CACHE=0`` runs every reference afresh (and keeps nothing). The outputs live in
``$KVSNAP_CACHE/reference/`` (``~/.cache/kvsnap/reference/``), one file per hash.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
ROOT = FOLDER.parent.parent


def reference_python() -> Path:
    """The Python with torch and transformers (`make reference`), or $KVSNAP_REFERENCE_PYTHON."""
    return Path(os.environ.get("KVSNAP_REFERENCE_PYTHON") or ROOT / ".cache" / "reference" / "bin" / "python")


def _cache_folder() -> Path | None:
    if os.environ.get("KVSNAP_REFERENCE_CACHE", "1") == "0":
        return None
    from kvsnap.capture.fixtures import cache_dir

    return cache_dir() / "reference"


def _feed(digest: hashlib._Hash, path: Path) -> None:
    """The content of a file, or of every file under a folder (names relative to it)."""
    if path.is_dir():
        for item in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(str(item.relative_to(path)).encode() + b"\0")
            digest.update(item.read_bytes() + b"\0")
    else:
        digest.update(path.read_bytes() + b"\0")


def content_key(script: str, gguf: Path, inputs: Sequence[Path]) -> str:
    """The SHA-256 (hex) of what a run's output depends on: every script of this folder, the
    pinned requirements, the script's name, the GGUF (name and size: the fixtures check its
    SHA-256 when fetched) and the content of each input file or folder, in order."""
    digest = hashlib.sha256()
    for source in [*sorted(FOLDER.glob("*.py")), FOLDER / "requirements.txt"]:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    digest.update(f"{script}\0{gguf.name}\0{gguf.stat().st_size}\0".encode())
    for path in inputs:
        _feed(digest, path)
    return digest.hexdigest()


class ReferenceRun:
    """``reference_python() tests/reference/SCRIPT GGUF INPUT... OUTPUT``, started at once (the
    test computes kvsnap's side meanwhile) or answered from the outputs kept by content.

    `wait` returns once ``output`` holds the reference's answer; a failed run fails the test
    with the script's last error lines, and nothing is kept.
    """

    def __init__(self, script: str, gguf: Path, inputs: Sequence[Path], output: Path) -> None:
        self.output = output
        folder = _cache_folder()
        self.kept = None if folder is None else folder / content_key(script, gguf, inputs)
        self.process: subprocess.Popen[str] | None = None
        if self.kept is not None and self.kept.exists():
            shutil.copyfile(self.kept, output)
            return
        argv = [str(reference_python()), str(FOLDER / script), str(gguf), *map(str, inputs), str(output)]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    @property
    def cached(self) -> bool:
        """Whether the output came from an earlier run with the same inputs."""
        return self.process is None

    def wait(self, timeout: float = 900) -> Path:
        """The output file, once the reference has written it (at most ``timeout`` seconds)."""
        if self.process is None:
            return self.output
        try:
            _, errors = self.process.communicate(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        if self.process.returncode != 0:
            raise AssertionError(f"the reference failed ({self.process.returncode}):\n{errors[-3000:]}")
        if self.kept is not None:
            self.kept.parent.mkdir(parents=True, exist_ok=True)
            partial = self.kept.with_name(f"{self.kept.name}.{os.getpid()}.partial")
            shutil.copyfile(self.output, partial)
            os.replace(partial, self.kept)
        return self.output
