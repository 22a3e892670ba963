"""Import names and stage independence: the stages install as `kvsnap.capture`
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
        [sys.executable, "-m", "kvsnap.cli", "stats", "--help"],
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
        "import kvformat, kvsnap.cli, kvformat.importers.mlxkv, kvformat.importers.bundles; b = top()\n"
        "import kvsnap.analysis, kvsnap.analysis.cli; c = top()\n"
        "capture = sorted(m for m in sys.modules if m.startswith('kvsnap.capture'))\n"
        "print(json.dumps([a, loaded, b, c, capture]))"
    )
    plain, loaded, after_format, after_analysis, capture = json.loads(run_python(code, tmp_path))
    assert plain == [] and sorted(loaded) == [
        "kvsnap.blas",
        "kvsnap.exports",
    ]  # `import kvsnap` loads no stage (its BLAS choice and its exports' helper)
    assert after_format == []  # kvformat: numpy, zstandard, ml-dtypes only
    assert "mlx" not in after_analysis and "mlx_lm" not in after_analysis
    assert capture == []  # analysis reads files; it never imports capture


def test_stage_packages_export_lazily_and_completely() -> None:
    """`kvsnap`, `kvsnap.capture` and `kvsnap.analysis` export what their ``TYPE_CHECKING``
    imports name (`kvsnap.exports`), each name resolves, and importing a stage's CLI module
    loads no mlx, pyarrow or polars (CLI start-up stays fast)."""
    import kvformat
    import kvsnap.analysis
    import kvsnap.capture
    from kvsnap.exports import typing_imports

    for package in (kvsnap, kvsnap.capture, kvsnap.analysis):
        assert package.__file__ is not None
        declared = typing_imports(package.__name__, Path(package.__file__).read_text())
        assert sorted(declared) == sorted(package.__all__) == sorted(set(package.__all__))
        for name in package.__all__:
            assert getattr(package, name) is not None
    assert kvsnap.Error is kvformat.KVSnapError and kvsnap.analysis.__name__ == "kvsnap.analysis"
    code = (
        "import sys, kvsnap.capture.cli, kvsnap.analysis.cli, kvsnap.cli; "
        "heavy = ('mlx.core', 'pyarrow', 'polars', 'ml_dtypes'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_an_export_missing_from_all_or_from_the_typing_imports_fails_the_import(tmp_path: Path) -> None:
    """`kvsnap.exports.exports`: a package whose ``__all__`` and ``TYPE_CHECKING`` imports differ
    is an ImportError naming the names; otherwise each name loads on first use, a submodule as a
    module, an alias under its own name."""
    package = tmp_path / "lazypkg"
    package.mkdir()
    (package / "one.py").write_text("VALUE = 1\nloaded = True\n")
    (package / "two.py").write_text("")
    init = (
        "from typing import TYPE_CHECKING\n"
        "from kvsnap.exports import exports\n"
        "if TYPE_CHECKING:\n"
        "    from .one import VALUE as value\n"
        "    from . import two\n"
        "__all__ = {names}\n"
        "__getattr__, __dir__ = exports(__name__, __file__, __all__)\n"
    )
    (package / "__init__.py").write_text(init.format(names=["two", "value"]))
    code = (
        "import sys, lazypkg\n"
        "assert 'lazypkg.one' not in sys.modules\n"
        "assert lazypkg.value == 1 and 'lazypkg.one' in sys.modules\n"
        "assert lazypkg.two.__name__ == 'lazypkg.two' and 'value' in dir(lazypkg)\n"
        "try:\n    lazypkg.other\nexcept AttributeError as e:\n    print(e)\n"
    )
    assert "has no attribute 'other'" in run_python(code, tmp_path)
    (package / "__init__.py").write_text(init.format(names=["two", "value", "three"]))
    failed = subprocess.run(
        [sys.executable, "-c", "import lazypkg"], cwd=tmp_path, capture_output=True, text=True
    )
    assert failed.returncode == 1 and "differ in ['three']" in failed.stderr


def test_exported_names_are_the_functions_whatever_was_imported_first() -> None:
    """``kvsnap.generate`` and ``kvsnap.capture.restore`` are the functions after every module of
    the stage was imported, in a fresh interpreter (no submodule shares an exported name, so an
    import cannot put a module where the function was)."""
    code = (
        "import pkgutil, importlib, kvsnap.capture, kvsnap.analysis\n"
        "for package in (kvsnap.capture, kvsnap.analysis):\n"
        "    for info in pkgutil.iter_modules(package.__path__):\n"
        "        importlib.import_module(f'{package.__name__}.{info.name}')\n"
        "    for name in package.__all__:\n"
        "        value = getattr(package, name)\n"
        "        assert not isinstance(value, type(pkgutil)), (package.__name__, name)\n"
        "import kvsnap\n"
        "assert callable(kvsnap.generate) and kvsnap.generate.__name__ == 'generate'\n"
        "assert callable(kvsnap.capture.restore) and callable(kvsnap.capture.generate)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


REPOSITORY = Path(__file__).resolve().parents[1]


def test_the_editable_install_maps_the_stage_folders_without_links() -> None:
    """``capture/`` and ``analysis/`` are ``kvsnap.capture`` / ``kvsnap.analysis`` through the build's
    package-directory mapping: no link in the tree, and the modules load from the folders."""
    import kvsnap.analysis
    import kvsnap.capture

    assert not any(path.is_symlink() for path in (REPOSITORY / "kvsnap").iterdir())
    assert Path(kvsnap.analysis.__file__).parent == REPOSITORY / "analysis"
    assert Path(kvsnap.capture.__file__).parent == REPOSITORY / "capture"


def test_no_module_is_importable_under_two_names() -> None:
    """From the repository's root, where ``analysis/`` is on the path as a folder, importing it as
    ``analysis`` fails with a message naming the right name, so no file runs as two modules."""
    for stage in ("analysis", "capture"):
        done = subprocess.run(
            [sys.executable, "-c", f"import {stage}"], cwd=REPOSITORY, capture_output=True, text=True
        )
        assert done.returncode != 0
        assert f"import it as kvsnap.{stage}" in done.stderr.splitlines()[-1]
    code = (
        "import sys, pkgutil, importlib, kvsnap.analysis, kvsnap.capture, kvformat\n"
        "for package in (kvsnap.analysis, kvsnap.capture, kvformat):\n"
        "    for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        if not info.name.endswith(('.ray', '.cuda_gram', '.unified_memory')):\n"
        "            importlib.import_module(info.name)\n"
        "files = [m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)]\n"
        "ours = [f for f in files if f.startswith(sys.argv[1]) and 'site-packages' not in f]\n"
        "print(len(ours), len(set(ours)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(REPOSITORY)], cwd=REPOSITORY, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    loaded, distinct = map(int, done.stdout.split())
    assert loaded > 60 and loaded == distinct


def test_the_wheel_installs_the_stages_under_kvsnap(tmp_path: Path) -> None:
    """A wheel built from the tree holds ``kvsnap/analysis`` and ``kvsnap/capture`` (and no top-level
    ``analysis`` or ``capture``), and, unpacked alone on the path, imports from there."""
    import shutil
    import zipfile

    # From a copy of the files git knows (tracked, or new and not ignored): a build in the tree
    # would leave build/ there, and reuse a stale one (modules since deleted) in the wheel.
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPOSITORY,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    source = tmp_path / "source"
    for name in filter(None, (entry.decode() for entry in listed)):
        if (REPOSITORY / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPOSITORY / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("kvsnap-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {"kvsnap", "kvformat"} <= tops and not {"analysis", "capture"} & tops
    assert "kvsnap/analysis/engine/accumulator.py" in names and "kvsnap/capture/generation.py" in names
    # Every module of the stages, subpackages included: a package missing from pyproject's list
    # would install from the checkout and be absent from the wheel.
    for stage in ("analysis", "capture"):
        for module in (REPOSITORY / stage).rglob("*.py"):
            assert f"kvsnap/{module.relative_to(REPOSITORY).as_posix()}" in names, module
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    out = run_python(
        f"import sys; sys.path.insert(0, {str(site)!r})\n"
        "import kvsnap.analysis.stats, kvsnap.capture.cli, kvformat\n"
        "from kvsnap.analysis.kernels import native\n"
        "print(kvsnap.analysis.stats.__file__); print(kvsnap.capture.cli.__file__)\n"
        "print(native.LIBRARY._name)",  # the wheel's C kernels, built from the source it ships
        tmp_path,
    )
    for line in out.split():
        assert line.startswith(str(site)), out
    assert "_native" in out.split()[-1], out
