"""The shape of the import graph (`benchmarks.structure`): no circle, counting every import (inside
functions and ``if TYPE_CHECKING:`` blocks too: a circle hidden by either is still one); `kvformat`
imports nothing of `kvsnap`, `kvsnap.capture` or `kvsnap.analysis`; the other packages reach
`kvformat` only through its public names and `kvformat.PUBLIC_MODULES`; `kvsnap.analysis` never
imports `kvsnap.capture`."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.structure import (
    ANALYSIS_LAYERS,
    analysis_folder_loops,
    analysis_upward,
    build,
    circles,
    kvformat_reached,
    public_modules,
    stage_imports,
)

REPOSITORY = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def modules() -> dict:
    return build(REPOSITORY)


def test_the_graph_sees_imports_inside_functions_and_type_checking_blocks(tmp_path: Path) -> None:
    """The check can fail: a circle closed by a function-level import and one closed by a
    TYPE_CHECKING import are both found, and a package re-exporting its own submodule is none."""
    package = tmp_path / "kvformat"
    package.mkdir()
    (package / "__init__.py").write_text("from kvformat.a import f\n")
    (package / "a.py").write_text("def f():\n    from kvformat import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvformat.a import f\n"
    )
    (package / "c.py").write_text("from kvformat import d\n")
    (package / "d.py").write_text("import kvformat.c\n")
    assert circles(build(tmp_path)) == [["kvformat.a", "kvformat.b"], ["kvformat.c", "kvformat.d"]]


def test_no_import_circle_anywhere(modules: dict) -> None:
    assert circles(modules) == []


def test_kvformat_imports_no_other_package_and_is_reached_through_its_public_api(modules: dict) -> None:
    outside = {t for m in modules.values() if m.name.startswith("kvformat") for t, _ in m.imports}
    assert {t for t in outside if not t.startswith("kvformat")} == set()
    assert dict(kvformat_reached(modules, public_modules(REPOSITORY))) == {}


def test_analysis_never_imports_capture(modules: dict) -> None:
    reached = {
        (m.name, t)
        for m in modules.values()
        if m.name.startswith("kvsnap.analysis")
        for t, _ in m.imports
        if t.startswith("kvsnap.capture")
    }
    assert reached == set()


def test_analysis_imports_only_down_its_layers(modules: dict) -> None:
    """stats, then kernels, then engine, then attention and tools, then viewer and commands
    (`benchmarks.structure.ANALYSIS_LAYERS`): no import runs back up, none reaches the shell
    (``kvsnap.cli``), every folder is in a layer, and no two folders import each other, even
    through others."""
    top = REPOSITORY / "analysis"
    folders = {p.name for p in top.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules_at_top = {p.stem for p in top.glob("*.py")} - {"__init__"}
    assert folders | modules_at_top == set(ANALYSIS_LAYERS)
    assert analysis_upward(modules) == []
    assert analysis_folder_loops(modules) == []


def test_the_layer_check_can_fail(tmp_path: Path) -> None:
    """A statistic importing a kernel, a kernel importing the engine through a function, an
    import of the shell and two same-layer folders importing each other are all found."""
    top = tmp_path / "analysis"
    for folder in ("stats", "kernels", "engine", "attention", "tools", "commands"):
        (top / folder).mkdir(parents=True)
        (top / folder / "__init__.py").write_text("")
    (top / "__init__.py").write_text("")
    (tmp_path / "kvsnap" / "cli").mkdir(parents=True)
    for init in ("kvsnap/__init__.py", "kvsnap/cli/__init__.py", "kvsnap/cli/options.py"):
        (tmp_path / init).write_text("")
    (top / "stats" / "sums.py").write_text("from ..kernels import fill\n")
    (top / "kernels" / "fill.py").write_text("def f():\n    from ..engine import plan\n")
    (top / "commands" / "run.py").write_text("from kvsnap.cli import options\n")
    (top / "attention" / "maps.py").write_text("from ..tools import table\n")
    (top / "tools" / "table.py").write_text("from ..attention import maps\n")
    graph = build(tmp_path)
    assert analysis_upward(graph) == [
        ("kvsnap.analysis.commands.run", "kvsnap.cli"),
        ("kvsnap.analysis.commands.run", "kvsnap.cli.options"),
        ("kvsnap.analysis.kernels.fill", "kvsnap.analysis.engine"),
        ("kvsnap.analysis.stats.sums", "kvsnap.analysis.kernels"),
        ("kvsnap.analysis.stats.sums", "kvsnap.analysis.kernels.fill"),
    ]
    assert analysis_folder_loops(graph) == [["attention", "tools"]]


def test_analysis_names_its_heavy_modules_at_the_top(modules: dict) -> None:
    """Imports inside functions in `kvsnap.analysis` are the few that must not run with their
    module (Ray, IPython, a browser, the fork server's start, the kernels' light package), at
    most 15: pyarrow, polars, matplotlib, mlx and the process pool come from
    `analysis.dependencies`, named at each module's top and loaded on first use."""
    inside, _ = stage_imports(REPOSITORY, modules, "analysis")
    assert inside <= 15


def test_a_dependency_loads_on_first_use_and_a_missing_one_fails_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`OnFirstUse`: nothing is imported until an attribute is read; then the real module's
    attribute (a patch on it is seen); a module made missing raises `ModuleNotFoundError` naming
    it at that use, as an ``import`` statement would."""
    import sys

    from kvsnap.analysis.dependencies import OnFirstUse

    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    lazy = OnFirstUse("colorsys")
    assert "colorsys" not in sys.modules
    assert lazy.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
    assert "colorsys" in sys.modules
    monkeypatch.setattr(sys.modules["colorsys"], "ONE_THIRD", 0.5)
    assert lazy.ONE_THIRD == 0.5
    with pytest.raises(AttributeError):
        lazy.__wrapped__  # noqa: B018  (probes for dunders import nothing)
    monkeypatch.setitem(sys.modules, "colorsys", None)
    with pytest.raises(ModuleNotFoundError, match="colorsys"):
        lazy.rgb_to_hsv(1.0, 0.0, 0.0)


def test_the_stats_options_reach_the_pass_going_back_at_most_three_times() -> None:
    """`benchmarks.options_path`: the calls that carry ``kvsnap stats``'s parsed options, from the
    shell to the pass, come back to a module they had left at most 3 times (the count can fail:
    a path a -> b -> a -> b comes back twice)."""
    from benchmarks.options_path import returns, trace

    assert returns([("a", "f"), ("b", "g"), ("a", "h"), ("a", "i"), ("b", "j")]) == (["a", "b", "a", "b"], 2)
    calls = trace()
    modules, back = returns(calls)
    assert modules[0] == "kvsnap.cli.shell" and modules[-1] == "kvsnap.analysis.engine.streaming"
    assert back <= 3, modules
