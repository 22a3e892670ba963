"""The Python examples of the README and the guide run as written: each ```python block is taken
from the page itself and run in a fresh folder, in one namespace, README first, then the guide's
pages in the site's order. The README's capture runs first: it writes the ``run.kv`` (SmolLM2,
queries kept) that the reading and queries examples open.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT


def guide_pages() -> list[Path]:
    """README.md, then the guide's pages in the order of mkdocs.yml's nav."""
    nav = re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text("utf-8"), flags=re.M)
    return [ROOT / "README.md", *(ROOT / "docs" / name for name in nav)]


def python_blocks() -> list[tuple[str, str]]:
    """Every ```python block of the README and the guide, with the page it is on."""
    return [
        (page.name, block)
        for page in guide_pages()
        for block in re.findall(r"```python\n(.*?)```", page.read_text("utf-8"), flags=re.S)
    ]


@pytest.mark.network
def test_readme_python_blocks_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path
) -> None:
    blocks = python_blocks()
    assert blocks[0][0] == "README.md" and "kvsnap.generate(" in blocks[0][1]  # writes run.kv first
    assert len(blocks) >= 7
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "readme"}
    for page, block in blocks:
        exec(compile(block, page, "exec"), namespace)
    for written in ("run.kv", "story.kv", "out.kv", "series.kv", "now.kv"):
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
