"""Which queries a capture stores (`capture.queries.QuerySelection`) and how capture joins them
(`capture.gather`: the gather kernel where it runs, ``mx.concatenate`` where it cannot)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvsnap.capture.queries import QuerySelection


def test_query_selection_parses_the_cli_forms() -> None:
    assert QuerySelection.parse("none").enabled is False
    assert QuerySelection.parse("window:64").first_position(100) == 36
    assert QuerySelection.parse("decode").first_position(100) == 100
    assert QuerySelection.parse("all").first_position(100) == 0
    for bad in ("window", "window:0", "some", "all:3"):
        with pytest.raises(ValueError, match="--queries"):
            QuerySelection.parse(bad)


def test_query_join_falls_back_where_the_gather_kernel_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`capture.gather.join` with the kernel asked for where it cannot run (this CPU build has no
    CUDA): each shape is tried once, found unusable, and joined by ``mx.concatenate``, so a capture
    never fails on it; runs longer than one launch and other pieces between them keep their order."""
    from kvsnap.capture import gather

    monkeypatch.setattr(gather, "_WORKS", {})
    window = mx.random.normal((1, 3, 5, 8))
    singles = [mx.random.normal((1, 3, 1, 8)) for _ in range(150)]
    for parts in ([window, *singles], singles[:3], [*singles[:70], window, *singles[70:]]):
        joined = gather.join(parts, gather=True)
        assert bool(mx.array_equal(joined, mx.concatenate(parts, axis=2)).item())
    assert dict(gather._WORKS) == {(mx.float32, 3, 8): False}
    assert gather.join([window]) is window
