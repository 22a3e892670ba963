"""The README's Python examples run as written (issue 46 item 1): each ```python block is taken
from README.md itself and run in a fresh folder, in one namespace. The capturing example runs
first: it writes the ``run.kv`` (SmolLM2, queries kept) that the reading and queries examples open.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text("utf-8"), flags=re.S)


@pytest.mark.network
def test_readme_python_blocks_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path
) -> None:
    blocks = python_blocks()
    capture = [b for b in blocks if "kvsnap.generate(" in b]
    assert len(capture) == 1 and len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "readme"}
    for block in capture + [b for b in blocks if b not in capture]:
        exec(compile(block, "README.md", "exec"), namespace)
    for written in ("run.kv", "out.kv", "series.kv", "now.kv"):
        assert (tmp_path / written).exists(), written
    import kvformat

    with kvformat.open(tmp_path / "series.kv") as series:
        assert series.num_snapshots == 2 and series.head(0, 0).positions.tolist() == [
            0,
            1,
            2,
            3,
            12,
            13,
            14,
            15,
        ]
