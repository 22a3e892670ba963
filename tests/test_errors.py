"""One error root: every exception class kvformat, the capture stage and the analysis stage define
derives from `kvformat.KVSnapError` (``kvsnap.Error``), and stays the built-in exception its
meaning is, so existing ``except ValueError`` / ``except OSError`` code keeps working."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import numpy as np
import pytest

import kvformat
import kvsnap

PACKAGES = ("kvformat", "kvsnap.capture", "kvsnap.analysis")
OPTIONAL = ("cuda_driver", "cuda_gram", "unified_memory", "mlx")  # modules that need a GPU build


def _error_classes() -> list[type[BaseException]]:
    found = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        modules = [package]
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            try:
                modules.append(importlib.import_module(info.name))
            except ImportError:
                assert info.name.rsplit(".", 1)[-1] in OPTIONAL or "mlx" in info.name, info.name
        for module in modules:
            for _, value in inspect.getmembers(module, inspect.isclass):
                if (
                    issubclass(value, BaseException)
                    and not issubclass(value, Warning)
                    and value.__module__.startswith(PACKAGES)
                ):
                    found.append(value)
    return sorted(set(found), key=lambda c: c.__qualname__)


def test_every_error_derives_from_the_root() -> None:
    classes = _error_classes()
    assert len(classes) >= 20
    strays = [c.__qualname__ for c in classes if not issubclass(c, kvformat.KVSnapError)]
    assert not strays, strays
    assert kvsnap.Error is kvformat.KVSnapError


def test_the_root_keeps_each_errors_builtin_meaning() -> None:
    from kvsnap.analysis.attention.head_importance import NoQueriesError
    from kvsnap.capture.errors import CaptureError

    assert issubclass(kvformat.KVFormatError, ValueError)
    assert issubclass(kvformat.OutOfRangeError, IndexError)
    assert issubclass(kvformat.io.outputs.OutputExistsError, FileExistsError)
    assert issubclass(CaptureError, RuntimeError)
    assert issubclass(NoQueriesError, ValueError)
    error = kvformat.io.outputs.OutputExistsError(17, "out.kv exists")
    assert error.errno == 17 and str(error) == "out.kv exists"  # the message alone: no "[Errno 17]"


ROOT = Path(__file__).resolve().parents[1]
BUILT_IN = {"ValueError", "TypeError", "RuntimeError", "Exception", "KeyError", "IndexError"}


def bare_raises(source: str) -> list[int]:
    """Lines that raise a built-in exception (``raise ValueError(...)``) in ``source``, unless the
    line above says why it never reaches a user (``# internal: ...``)."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        called = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        marked = lines[node.lineno - 2].strip().startswith("# internal:")
        if isinstance(called, ast.Name) and called.id in BUILT_IN and not marked:
            found.append(node.lineno)
    return found


def test_the_check_for_bare_raises_can_fail() -> None:
    source = (
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError('no')\n"
        "    # internal: the caller's bug\n"
        "    raise TypeError('never')\n"
        "    raise UsageError('named')\n"
    )
    assert bare_raises(source) == [3]


def test_every_error_raised_on_purpose_is_named() -> None:
    """No module of kvformat, kvsnap, capture or analysis raises a bare built-in exception: what
    a user asked wrongly is a `UsageError` (or another `KVSnapError`) that names the problem; an
    internal check is marked as one."""
    found = {
        str(path.relative_to(ROOT)): lines
        for folder in ("kvformat", "kvsnap", "capture", "analysis")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (lines := bare_raises(path.read_text("utf-8")))
    }
    assert found == {}


def test_usage_errors_are_value_errors_and_type_errors_where_python_says_so() -> None:
    from kvformat import errors

    assert issubclass(errors.UsageError, kvformat.KVSnapError) and issubclass(errors.UsageError, ValueError)
    for name in ("InvalidArgumentError", "UnknownNameError", "InvalidLayoutError", "WriterClosedError"):
        assert issubclass(getattr(errors, name), errors.UsageError)
    for name in ("ConflictingArgumentsError", "InvalidArrayError", "InvalidTypeError"):
        assert issubclass(getattr(errors, name), errors.UsageError) and issubclass(
            getattr(errors, name), TypeError
        )
    from kvsnap.analysis.attention.head_importance import NoQueriesError

    assert issubclass(NoQueriesError, errors.NoQueriesError)


def test_a_closed_writer_and_a_wrong_array_name_their_error(tmp_path: Path) -> None:
    from kvformat import errors

    spec = kvformat.LayerSpec(1, 4, 4, kvformat.FLOAT32)
    writer = kvformat.Writer(tmp_path / "a.kv", [spec])
    with pytest.raises(errors.InvalidArrayError, match="shape"):
        writer.append(0, np.ones((2, 3, 4), np.float32), np.ones((2, 3, 4), np.float32), np.arange(3))
    writer.close()
    with pytest.raises(errors.WriterClosedError, match="closed"):
        writer.append(0, np.ones((1, 3, 4), np.float32), np.ones((1, 3, 4), np.float32), np.arange(3))
    with pytest.raises(errors.UnknownNameError, match="unknown codec"):
        kvformat.codecs.parse("lz4")


def test_a_bug_shows_its_traceback_and_where_to_report_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refused request prints one line (exit 2); an exception kvsnap did not raise on purpose,
    deep inside a command, prints its traceback and the line that says it is a bug (exit 1)."""
    from kvsnap.analysis.engine import tables
    from kvsnap.cli import main

    k = np.ones((2, 8, 4), np.float32)
    path = tmp_path / "a.kv"
    kvformat.save(path, [kvformat.Layer(k, k)])
    assert main(["stats", str(path), "--snapshot", "7"]) == 2
    refused = capsys.readouterr().err
    assert "Traceback" not in refused and len(refused.strip().splitlines()) == 1

    def broken(*args: object, **kwargs: object) -> None:
        return 1 / 0  # type: ignore[return-value]

    monkeypatch.setattr(tables, "arrow_table", broken)
    assert main(["stats", str(path)]) == 1
    printed = capsys.readouterr().err
    assert "Traceback (most recent call last)" in printed and "ZeroDivisionError" in printed
    assert printed.strip().splitlines()[-1].startswith("kvsnap: this is a bug in kvsnap")
