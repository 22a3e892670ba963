"""One error root: every exception class kvformat, the capture stage and the analysis stage define
derives from `kvformat.KVSnapError` (``kvsnap.Error``), and stays the built-in exception its
meaning is, so existing ``except ValueError`` / ``except OSError`` code keeps working."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

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
