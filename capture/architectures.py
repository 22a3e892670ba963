"""Every architecture of the installed mlx-lm, built tiny, captured and resumed.

For each model module of ``mlx_lm.models`` (`names`), `check` builds a tiny random-weight model
(`tiny.build`), generates greedily while capturing a series, resumes from the middle snapshot and
compares every next-token log-probability with the uninterrupted run. The tests run it for every
architecture; ``python -m kvsnap.capture.architectures FILE`` writes the table of the guide.

    python -m kvsnap.capture.architectures docs/architectures.md
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
"""12 token ids (the tiny models have 256)."""
GENERATED = 8
EVERY = 4

SKIPPED: dict[str, str] = {
    "bitnet": "its BitLinear layers run a Metal-only kernel (no CPU or CUDA implementation in mlx-lm)",
    "muse_spark": "its fused QK-norm RoPE is a Metal-only kernel",
    "bailing_moe_linear": "mlx-lm 0.32.2 calls its cache's make_mask without the arguments it requires",
    "prism_hadamard_qwen35": (
        "its weights must be a 2-bit Hadamard-rotated pack (group size 128); no tiny model"
    ),
    "olmo": "needs the ai2-olmo package, not a dependency of mlx-lm",
    "phi3small": (
        "mlx-lm's own stream_generate of it is not deterministic on mlx's CPU build (one prompt, "
        "different tokens run to run) and corrupts the heap"
    ),
}
"""Architectures not checked, each with the reason (none of them kvsnap's)."""


def names() -> list[str]:
    """Every model module of the installed ``mlx_lm.models`` (those defining ``Model`` and
    ``ModelArgs``), sorted; skipped ones included."""
    import mlx_lm.models

    found = []
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        if info.name in SKIPPED:
            found.append(info.name)
            continue
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except ImportError:
            continue
        if hasattr(module, "Model") and hasattr(module, "ModelArgs"):
            found.append(info.name)
    return sorted(found)


@dataclass
class Result:
    """What `check` found for one architecture."""

    name: str
    cache_classes: list[str] = field(default_factory=list)
    layer_kinds: list[str] = field(default_factory=list)
    state_layers: int = 0
    tokens_equal: bool = False
    max_logprob_error: float = float("nan")
    """Largest |resumed - uninterrupted| log-probability over the resumed steps, relative to the
    largest |log-probability| (float32)."""
    snapshots: int = 0
    seconds: float = 0.0
    error: str | None = None

    @property
    def restores_exactly(self) -> bool:
        return self.error is None and self.tokens_equal and self.max_logprob_error <= 1e-5


def _cache_names(cache: Any) -> str:
    name = type(cache).__name__
    if name == "CacheList":
        return f"CacheList({', '.join(_cache_names(c) for c in cache.caches)})"
    return name


def check(name: str, folder: str | Path) -> Result:
    """Build ``name`` tiny, generate `GENERATED` tokens greedily capturing a series every `EVERY`,
    resume from the snapshot after `EVERY` tokens, and compare tokens and log-probabilities of
    the resumed steps with the uninterrupted run. Errors are recorded, not raised."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    import kvformat

    from .generation import generate
    from .tiny import build, byte_tokenizer

    result = Result(name)
    start = time.perf_counter()
    try:
        model = build(name)
        tokenizer = byte_tokenizer()
        result.cache_classes = sorted({_cache_names(c) for c in make_prompt_cache(model)})
        greedy = make_sampler(0.0)
        path = Path(folder) / f"{name}.kv"
        full = list(
            generate(model, tokenizer, PROMPT, max_tokens=GENERATED, output=path, every=EVERY, sampler=greedy)
        )
        with kvformat.open(path) as snap:
            result.snapshots = snap.num_snapshots
            result.layer_kinds = sorted({str(spec.attributes.get("kind")) for spec in snap.layers})
            result.state_layers = sum("state" in spec.attributes for spec in snap.layers)
            middle = next(
                i for i in range(snap.num_snapshots) if snap.select(i).snapshot_metadata["generated"] == EVERY
            )
            view = snap.select(middle)
            resumed = list(
                generate(model, tokenizer, [], max_tokens=GENERATED - EVERY, resume=view, sampler=greedy)
            )
        later = full[EVERY:]
        result.tokens_equal = [r.token for r in resumed] == [r.token for r in later]
        errors = []
        for a, b in zip(resumed, later, strict=False):
            x, y = np.array(a.logprobs.astype(mx.float32)), np.array(b.logprobs.astype(mx.float32))
            scale = max(float(np.abs(y[np.isfinite(y)]).max(initial=0.0)), 1e-30)
            errors.append(float(np.abs(x - y).max()) / scale)
        result.max_logprob_error = max(errors, default=float("nan"))
    except Exception as exc:  # recorded: the table says what failed and where
        result.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    result.seconds = time.perf_counter() - start
    return result


def markdown(results: list[Result]) -> str:
    """The guide's table of architectures."""
    ok = sum(r.restores_exactly for r in results)
    lines = [
        "# Supported architectures",
        "",
        "Every model module of mlx-lm 0.32.2 (`mlx_lm/models`), built tiny with random weights, "
        f"generating {GENERATED} tokens greedily after a {len(PROMPT)}-token prompt while capturing a "
        f"series every {EVERY} tokens; then resumed from the snapshot after {EVERY} tokens. "
        "*Restores exactly*: the resumed tokens and every next-token log-probability equal the "
        "uninterrupted run's (float32, relative error at most 1e-5). "
        f"**{ok} of {len(results) - len(SKIPPED)} checked architectures restore exactly**; "
        f"{len(SKIPPED)} are not checked, each for the reason given.",
        "",
        "Regenerate with `python -m kvsnap.capture.architectures docs/architectures.md` "
        "(`tests/capture/test_architectures.py` runs the same check for every architecture).",
        "",
        "| architecture | caches | layer kinds in the file | state layers | restores exactly "
        "| max relative error |",
        "|---|---|---|---:|---|---:|",
    ]
    for r in results:
        if r.name in SKIPPED:
            lines.append(f"| `{r.name}` | | | | not checked: {SKIPPED[r.name]} | |")
            continue
        status = "yes" if r.restores_exactly else f"**no**: {r.error or 'outputs differ'}"
        error = "" if r.error else f"{r.max_logprob_error:.1e}"
        caches = ", ".join(r.cache_classes)
        lines.append(
            f"| `{r.name}` | {caches} | {', '.join(r.layer_kinds)} | {r.state_layers} | {status} | {error} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for name in names():
            results.append(Result(name) if name in SKIPPED else check(name, folder))
            found = results[-1]
            status = (
                "not checked"
                if name in SKIPPED
                else "ok"
                if found.restores_exactly
                else found.error or "differs"
            )
            print(f"{name}: {status}")
    text = markdown(results)
    if argv:
        Path(argv[0]).write_text(text, encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
