"""The shell examples of the README and the guide run as written: every ``kvsnap`` line of each
```sh block, README first, then the guide's pages in the site's order, in one fresh folder (each
page's files are there for the next, as for a reader following the pages), each in a fresh
process with default settings. Every one exits 0 with no traceback; a ``kvsnap view`` that
serves (no ``--html``) must print its URL, and is then stopped. A ``kvsnap capture`` line's file
is kept by content (`tests.conftest.kept_capture`): it runs again whenever the model, mlx or a
source it runs changes. Lines that are not ``kvsnap``
commands (``make``, ``pip install``) are the install steps CI itself runs.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, kept_capture
from tests.test_readme import guide_pages


def shell_examples() -> list[tuple[str, str]]:
    """``(page, command line)`` for every ``kvsnap`` line of every ```sh block, continuation
    lines joined."""
    found = []
    for page in guide_pages():
        for block in re.findall(r"```sh\n(.*?)```", page.read_text("utf-8"), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if line.strip().startswith("kvsnap "):
                    found.append((page.name, line.strip()))
    return found


def _serve(argv: list[str], folder: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """A serving ``kvsnap view``: started, its URL awaited (60 s at most), then stopped."""
    process = subprocess.Popen(
        argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    printed = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        printed.append(line)
        if "http://127.0.0.1:" in line:
            break
    process.terminate()
    _, err = process.communicate(timeout=30)
    served = any("http://127.0.0.1:" in line for line in printed)
    return (0 if served else 1), "".join(printed), err


def test_shell_examples_cover_the_tours() -> None:
    lines = shell_examples()
    pages = {page for page, _ in lines}
    assert {"README.md", "getting-started.md", "capturing.md", "viewer.md"} <= pages
    assert any("simulate run.kv" in line for _, line in lines)  # the README tour's what-if
    assert any("--queries window:16" in line for page, line in lines if page == "README.md")


def _run(argv: list[str], folder: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """``argv`` run in ``folder``: its exit status, standard output and standard error."""
    result = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout, result.stderr


def _capture(
    argv: list[str], line: str, folder: Path, env: dict[str, str], model_dir: Path
) -> tuple[int, str, str]:
    """A ``kvsnap capture`` line, run as written once and its file kept by content
    (`kept_capture`: the line, the model's files, mlx, and every source of kvformat, the capture
    stage and the command line, so that any change to what it runs runs it again), then copied
    where the line writes it. A failing run keeps nothing and is reported as it ran."""
    output = argv[argv.index("-o") + 1]
    ran: list[tuple[int, str, str]] = []

    def make(path: Path) -> None:
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            ran.append(_run(argv, Path(scratch), env))
            written = Path(scratch) / output
            if ran[-1][0] == 0 and "Traceback" not in ran[-1][2] and written.exists():
                os.replace(written, path)
                return
        raise _CaptureFailed

    sources = tuple(sorted((ROOT / "kvsnap").rglob("*.py")))
    try:
        kept = kept_capture(f"example-{output}", model_dir, f"example\0{line}", make, sources)
    except _CaptureFailed:
        return ran[-1] if ran[-1][0] else (1, *ran[-1][1:])
    shutil.copyfile(kept, folder / output)
    return ran[-1] if ran else (0, "", "")


class _CaptureFailed(Exception):
    """A capture line that exited non-zero, printed a traceback or wrote no file."""


@pytest.mark.network
def test_shell_examples_run_as_written(tmp_path: Path, smollm2_dir: Path, gemma3_dir: Path) -> None:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "BROWSER": "true",  # `kvsnap view` opens no browser here
        "COLUMNS": "100",
    }
    models = {"smollm2-135m": smollm2_dir, "gemma3-270m": gemma3_dir}
    for page, line in shell_examples():
        argv = shlex.split(line, comments=True)
        if argv[1] == "view" and "--html" not in argv:
            code, out, err = _serve(argv, tmp_path, env)
        elif argv[1] == "capture":
            code, out, err = _capture(argv, line, tmp_path, env, models[argv[argv.index("--model") + 1]])
        else:
            code, out, err = _run(argv, tmp_path, env)
        assert code == 0, f"{page}: {line}\n{out}\n{err}"
        assert "Traceback" not in err, f"{page}: {line}\n{err}"
        if "-o" in argv:
            output = tmp_path / argv[argv.index("-o") + 1]
            assert output.exists(), f"{page}: {line} wrote no {output.name}"
