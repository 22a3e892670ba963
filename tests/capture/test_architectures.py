"""Every architecture of the installed mlx-lm, built tiny with random weights: captured as a
series, resumed from its middle snapshot, and held to the uninterrupted run (tokens and every
next-token log-probability, float32, relative <= 1e-5). The skipped ones are listed with their
reason, and the guide's table says what this test finds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvsnap.capture import architectures

NAMES = architectures.names()
CHECKED = [name for name in NAMES if name not in architectures.SKIPPED]
TABLE = Path(__file__).resolve().parents[2] / "docs" / "architectures.md"


def test_every_installed_architecture_is_checked_or_skipped_with_a_reason() -> None:
    assert len(NAMES) >= 120  # mlx-lm 0.32.2 ships 126 model modules
    assert set(architectures.SKIPPED) <= set(NAMES)
    assert all(len(reason) > 20 for reason in architectures.SKIPPED.values())
    assert len(architectures.SKIPPED) <= 6


def _table_rows() -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \|(.*)$", TABLE.read_text(), re.M)}


@pytest.mark.parametrize("name", CHECKED)
def test_the_architecture_resumes_exactly_from_a_snapshot(name: str, tmp_path: Path) -> None:
    result = architectures.check(name, tmp_path)
    assert result.error is None, result.error
    assert result.snapshots == 2  # after 4 and after 8 generated tokens
    assert result.tokens_equal
    assert result.max_logprob_error <= 1e-5
    if any(c in "".join(result.cache_classes) for c in ("ArraysCache", "LayerCache")):
        assert result.state_layers > 0  # its state travels in the file
    # Attention recomputed from the file equals the hooked attention function, call by call,
    # or --queries is refused by name before any file is written.
    assert result.attention == "equal" or result.attention.startswith("refused: queries:"), result.attention
    if result.attention == "equal":
        assert result.attention_calls > 0 and result.max_attention_error <= 1e-5
    # ... and as the guide's table says: an architecture it lists as equal never becomes refused.
    assert ("| equal (" in _table_rows()[name]) == (result.attention == "equal"), result.attention


def test_the_guide_lists_every_architecture_as_the_check_finds_it() -> None:
    rows = _table_rows()
    assert sorted(rows) == NAMES
    for name, row in rows.items():
        if name in architectures.SKIPPED:
            assert "not checked" in row
        else:
            assert "| yes |" in row, name  # the per-architecture test above holds it
            assert "| equal (" in row or "refused" in row, name
