"""The shell examples of the README and the guide run as written: every ``kvsnap`` line of each
```sh block, README first, then the guide's pages in the site's order, in one fresh folder (each
page's files are there for the next, as for a reader following the pages), each in a fresh
process with default settings. Every one exits 0 with no traceback; a ``kvsnap view`` that
serves (no ``--html``) must print its URL, and is then stopped. Lines that are not ``kvsnap``
commands (``make``, ``pip install``) are the install steps CI itself runs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


@pytest.mark.network
def test_shell_examples_run_as_written(tmp_path: Path, smollm2_dir: Path, gemma3_dir: Path) -> None:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "BROWSER": "true",  # `kvsnap view` opens no browser here
        "COLUMNS": "100",
    }
    for page, line in shell_examples():
        argv = shlex.split(line, comments=True)
        if argv[1] == "view" and "--html" not in argv:
            code, out, err = _serve(argv, tmp_path, env)
        else:
            result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            code, out, err = result.returncode, result.stdout, result.stderr
        assert code == 0, f"{page}: {line}\n{out}\n{err}"
        assert "Traceback" not in err, f"{page}: {line}\n{err}"
        if "-o" in argv:
            output = tmp_path / argv[argv.index("-o") + 1]
            assert output.exists(), f"{page}: {line} wrote no {output.name}"
