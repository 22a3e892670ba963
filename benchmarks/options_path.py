"""The path a command's parsed options take to the pass: every call, from ``kvsnap stats FILE -o
OUT`` to the pass's first layer, that is handed the parsed arguments or an options object made
from them, by module; and how often that path goes back to a module it had already left.

    python -m benchmarks.options_path [--tree PATH]

Traced in this process (`sys.setprofile`) on a small file written for the purpose: the calls
into kvsnap's own modules whose arguments include the ``argparse.Namespace`` or an instance of a
class named ``...Options``, ``...Request``, ``Shared`` or ``Statistics``, until the pass begins
(``kvsnap.analysis.engine.streaming.layers`` or the worker processes' ``layers``). The one
helper that turns the namespace into an options object (``kvsnap.arguments.typed``, behind every
``from_args``) is how a step begins, not a step: it is not counted. ``--tree``
runs the same on another source tree's code (its folder first on ``sys.path``, as
`benchmarks.cli_bench` does).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

OPTION_CLASSES = ("Options", "Request", "Shared", "Statistics")
"""Class names (or their endings) of the objects that carry a command's options."""
PASS = ("kvsnap.analysis.engine.streaming.layers", "kvsnap.analysis.engine.processes.layers")

TRACE = r"""
import argparse, json, sys
from pathlib import Path
import numpy as np
import kvformat
from kvsnap.cli import main

folder = Path(sys.argv[1])
k = np.ones((2, 16, 8), np.float32)
kvformat.save(folder / "a.kv", [kvformat.Layer(k, k)] * 2)
ENDINGS = tuple(json.loads(sys.argv[2]))
PASS = tuple(json.loads(sys.argv[3]))
calls = []

def carries(value, inside=True):
    if isinstance(value, argparse.Namespace):
        return True
    if inside and isinstance(value, (list, tuple)):  # a task: (path, options)
        return any(carries(item, False) for item in value[:4])
    name = type(value).__name__
    return type(value).__module__.startswith("kvsnap") and name.endswith(ENDINGS)

def profile(frame, event, arg):
    if event != "call":
        return
    module = frame.f_globals.get("__name__", "")
    if not module.startswith(("kvsnap", "kvformat")):
        return
    qualified = f"{module}.{frame.f_code.co_name}"
    if qualified == "kvsnap.arguments.typed":
        return
    if qualified in PASS:
        calls.append([module, frame.f_code.co_name])
        sys.setprofile(None)
        raise KeyboardInterrupt  # the pass begins: the path ends here
    code = frame.f_code
    arguments = [frame.f_locals.get(n) for n in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]]
    if any(carries(a) for a in arguments):
        calls.append([module, code.co_name])

sys.setprofile(profile)
try:
    main(["stats", str(folder / "a.kv"), "-o", str(folder / "out.parquet")])
except KeyboardInterrupt:
    pass
sys.setprofile(None)
print(json.dumps(calls))
"""


def trace(tree: Path | None = None) -> list[tuple[str, str]]:
    """The calls (module, function) that carry the options, in order, ending with the pass's."""
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(
            [sys.executable, "-c", TRACE, folder, json.dumps(OPTION_CLASSES), json.dumps(PASS)],
            capture_output=True,
            text=True,
            check=True,
            cwd=tree,
            env=None,
        )
    return [tuple(call) for call in json.loads(done.stdout.strip().splitlines()[-1])]  # type: ignore[misc]


def returns(calls: list[tuple[str, str]]) -> tuple[list[str], int]:
    """The modules the path runs through (a module repeated only when the path left it between)
    and the number of times it comes back to a module it had left."""
    modules: list[str] = []
    for module, _ in calls:
        if not modules or modules[-1] != module:
            modules.append(module)
    left: set[str] = set()
    back = 0
    for previous, module in itertools.pairwise(modules):
        left.add(previous)
        back += module in left
    return modules, back


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, help="another source tree's code")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    calls = trace(args.tree)
    modules, back = returns(calls)
    report: dict[str, Any] = {"calls": len(calls), "modules": modules, "returns to a module left": back}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{len(calls)} calls carry the options, through {len(modules)} module visits:")
        print("  " + " -> ".join(m.removeprefix("kvsnap.") for m in modules))
        print(f"returns to a module already left: {back}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
