"""Import names (issue 15, item 5) and stage independence: the stages install as `kvsnap.capture`
and `kvsnap.analysis`, so a researcher's own ``analysis.py`` / ``capture.py`` shadows nothing;
`kvformat` never loads mlx, pyarrow or polars, and analysis never loads capture or mlx."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_python(code: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_local_modules_named_like_the_stages_shadow_nothing(tmp_path: Path) -> None:
    for name in ("analysis", "capture"):
        (tmp_path / f"{name}.py").write_text(
            f"raise ImportError('the user\\'s own {name}.py was imported')\n"
        )
    out = run_python(
        "import kvsnap, kvsnap.analysis, kvsnap.capture\n"
        "print(kvsnap.head_stats is kvsnap.analysis.head_stats, kvsnap.generate is kvsnap.capture.generate)\n"
        "print(kvsnap.analysis.__name__, kvsnap.open.__module__)",
        tmp_path,
    )
    assert out.split() == ["True", "True", "kvsnap.analysis", "kvformat.reader"]
    done = subprocess.run(
        [sys.executable, "-m", "kvformat.cli", "stats", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "--stats" in done.stdout, done.stderr


def test_stages_import_only_what_they_need(tmp_path: Path) -> None:
    code = (
        "import sys, json\n"
        "heavy = {'mlx', 'mlx_lm', 'pyarrow', 'polars'}\n"
        "def top(): return sorted({m.split('.')[0] for m in sys.modules} & heavy)\n"
        "import kvsnap; a = top(); loaded = [m for m in sys.modules if m.startswith('kvsnap.')]\n"
        "import kvformat, kvformat.cli, kvformat.mlxkv; b = top()\n"
        "import kvsnap.analysis, kvsnap.analysis.cli; c = top()\n"
        "capture = sorted(m for m in sys.modules if m.startswith('kvsnap.capture'))\n"
        "print(json.dumps([a, loaded, b, c, capture]))"
    )
    plain, loaded, after_format, after_analysis, capture = json.loads(run_python(code, tmp_path))
    assert plain == [] and loaded == []  # `import kvsnap` loads no stage
    assert after_format == []  # kvformat: numpy, zstandard, ml-dtypes only
    assert "mlx" not in after_analysis and "mlx_lm" not in after_analysis
    assert capture == []  # analysis reads files; it never imports capture


def test_stage_packages_export_lazily_and_completely() -> None:
    """`kvsnap.capture` and `kvsnap.analysis` list the same names as they export, each resolves,
    and importing a stage's CLI module loads neither mlx nor numba (CLI start-up stays fast)."""
    import kvsnap.analysis
    import kvsnap.capture

    for package in (kvsnap.capture, kvsnap.analysis):
        assert sorted(package._EXPORTS) == package.__all__
        for name in package.__all__:
            assert getattr(package, name) is not None
    code = (
        "import sys, kvsnap.capture.cli, kvsnap.analysis.cli, kvformat.cli; "
        "heavy = ('mlx.core', 'numba', 'pyarrow', 'polars', 'ml_dtypes'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_top_level_names_are_the_functions_whatever_was_imported_first() -> None:
    """``kvsnap.generate`` is the function even after ``kvsnap.capture.generate`` (the module of
    the same name) was imported, in a fresh interpreter."""
    code = (
        "import kvsnap.capture.generate, kvsnap.capture.snapshot, kvsnap\n"
        "assert callable(kvsnap.generate) and kvsnap.generate.__name__ == 'generate'\n"
        "assert callable(kvsnap.snapshot_kv) and callable(kvsnap.restore)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
