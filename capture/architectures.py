"""Every architecture of the installed mlx-lm, built tiny, captured and resumed.

For each model module of ``mlx_lm.models`` (`names`), `check` builds a tiny random-weight model
(`tiny.build`), generates greedily while capturing a series, resumes from the middle snapshot and
compares every next-token log-probability with the uninterrupted run. The tests run it for every
architecture; ``python -m kvsnap.capture.architectures FILE`` writes the table of the guide.

    python -m kvsnap.capture.architectures docs/architectures.md --force
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .queries import OWN_ATTENTION, CallTap

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
    attention: str = "not compared"
    """``"equal"`` (every call of the model's attention function equals attention recomputed from
    the file, relative <= 1e-5), ``"refused"`` (``--queries`` refused by name: the model computes
    attention without mlx-lm's function), or what differed."""
    max_attention_error: float = float("nan")
    attention_calls: int = 0

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
        result.max_logprob_error = _logprob_error(resumed, later)
    except Exception as exc:  # recorded: the table says what failed and where
        result.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    if result.error is None:
        _check_attention(model, name, folder, result)
    result.seconds = time.perf_counter() - start
    return result


def _logprob_error(resumed: list[Any], later: list[Any]) -> float:
    """The largest difference of next-token log-probabilities between two runs' steps, relative
    to the largest finite |log-probability| of the uninterrupted one."""
    import mlx.core as mx

    errors = []
    for a, b in zip(resumed, later, strict=False):
        x, y = np.array(a.logprobs.astype(mx.float32)), np.array(b.logprobs.astype(mx.float32))
        scale = max(float(np.abs(y[np.isfinite(y)]).max(initial=0.0)), 1e-30)
        errors.append(float(np.abs(x - y).max()) / scale)
    return max(errors, default=float("nan"))


class _Kernel:
    """Records every call of mlx-lm's ``scaled_dot_product_attention`` while installed (the
    queries it received and the output it returned), in every model module that uses it, and
    every call of an attention module that computes attention itself (`OWN_ATTENTION`)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, Any]] = []
        self._saved: list[tuple[Any, str, Any]] = []  # (module, attribute, original)
        self._own: list[tuple[type, Any]] = []

    def __enter__(self) -> _Kernel:
        from mlx_lm.models import base

        original = base.scaled_dot_product_attention

        def recorded(queries: Any, keys: Any, values: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(queries, keys, values, *args, **kwargs)
            self.calls.append((queries, keys, out))  # read on the host after generation
            return out

        for module in [m for n, m in sys.modules.items() if n.startswith("mlx_lm.models")]:
            if getattr(module, "scaled_dot_product_attention", None) is original:
                self._saved.append((module, "scaled_dot_product_attention", original))
                setattr(module, "scaled_dot_product_attention", recorded)  # noqa: B010
        compressed = sys.modules.get("mlx_lm.models.deepseek_v41")
        if compressed is not None:  # DeepSeek-V4.1's own sparse attention: (B, S, H, D) in and out
            sparse = getattr(compressed, "_sparse_attention")  # noqa: B009 - a model module

            def recorded_sparse(q: Any, kvs: Any, indices: Any, **kwargs: Any) -> Any:
                out = sparse(q, kvs, indices, **kwargs)
                self.calls.append((q.transpose(0, 2, 1, 3), kvs[0], out.transpose(0, 2, 1, 3)))
                return out

            self._saved.append((compressed, "_sparse_attention", sparse))
            setattr(compressed, "_sparse_attention", recorded_sparse)  # noqa: B010 - a model module
        for name in OWN_ATTENTION:
            where, _, qualname = name.rpartition(".")
            kind = getattr(sys.modules.get(where), qualname, None)
            if isinstance(kind, type):
                self._own.append((kind, kind.__call__))
                kind.__call__ = self._recorded_own(kind.__call__)  # type: ignore[method-assign]
        return self

    def _recorded_own(self, call: Any) -> Any:
        """``call``, an `OWN_ATTENTION` class's ``__call__``, recording the queries its ``rope``
        returns first and the attention output its ``o_proj`` receives, as ``(batch, heads, L,
        dim)``."""

        @functools.wraps(call)
        def attention(module: Any, *args: Any, **kwargs: Any) -> Any:
            ropes: list[Any] = []
            projected: list[Any] = []
            rope, o_proj = module.rope, module.o_proj
            module.rope, module.o_proj = CallTap(rope, ropes), CallTap(o_proj, [], projected)
            try:
                out = call(module, *args, **kwargs)
            finally:
                module.rope, module.o_proj = rope, o_proj
            queries = ropes[0]
            batch, heads, length, _ = queries.shape
            output = projected[0].reshape(batch, length, heads, -1).transpose(0, 2, 1, 3)
            self.calls.append((queries, ropes[1], output))
            return out

        return attention

    def __exit__(self, *exc: object) -> None:
        for module, name, original in self._saved:
            setattr(module, name, original)
        for kind, call in reversed(self._own):
            kind.__call__ = call


def _check_attention(model: Any, name: str, folder: str | Path, result: Result) -> None:
    """Capture every query and hold attention recomputed from the file (`Snapshot.attention_output`)
    to what the model's attention function returned, call by call: each call is found in the
    file by its queries (the layer and positions whose stored queries equal them bit for bit)."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from .errors import CaptureError, UnsupportedModelError
    from .generation import generate
    from .tiny import byte_tokenizer

    path = Path(folder) / f"{name}-queries.kv"
    try:
        with _Kernel() as kernel:
            list(
                generate(
                    model,
                    byte_tokenizer(),
                    PROMPT[:6],
                    max_tokens=GENERATED,
                    output=path,
                    every=1,
                    queries="all",
                    sampler=make_sampler(0.0),
                )
            )
    except (UnsupportedModelError, CaptureError) as exc:
        refused = str(exc).startswith("queries:")
        result.attention = f"refused: {exc}" if refused else f"capture failed: {exc}"
        if refused and (path.exists() or path.with_name(path.name + ".partial").exists()):
            result.attention = f"refused after writing a file: {exc}"
        return
    except Exception as exc:
        result.attention = f"capture failed: {type(exc).__name__}: {exc}".splitlines()[0][:200]
        return
    calls = [tuple(np.array(a.astype(mx.float32)) for a in call) for call in kernel.calls]
    try:
        _compare(path, calls, result)
    except Exception as exc:
        result.attention = f"recomputing failed: {type(exc).__name__}: {exc}".splitlines()[0][:200]


def _compare(path: Path, calls: list[tuple[np.ndarray, ...]], result: Result) -> None:
    import kvformat

    worst, compared, missing, prefill = 0.0, 0, 0, 0
    with kvformat.open(path) as snap:
        stored = _stored_queries(snap)
        latent_layers = {
            layer: snap.head(layer, 0)
            for layer, spec in enumerate(snap.layers)
            if spec.queries is not None and spec.queries.latent
        }
        for queries, keys, output in calls:
            places = _places(stored, latent_layers, queries, keys)
            if isinstance(places, str):  # an absorbed prompt call
                prefill += 1
            elif not places:
                missing += 1
            else:
                # One set of queries may read two layers' K/V (iQuest's second loop reads the
                # first loop's keys and its own window): the call is the place whose attention
                # it equals.
                worst = max(worst, min(_call_error(snap, place, queries.shape, output) for place in places))
                compared += queries.shape[1]
    result.attention_calls = len(calls) - prefill
    result.max_attention_error = worst
    result.attention = _verdict(missing, len(calls), compared, worst)


def _verdict(missing: int, calls: int, compared: int, worst: float) -> str:
    if missing:
        return f"{missing} of {calls} attention calls have no queries in the file"
    if not compared:
        return "no attention call was compared"
    return "equal" if worst <= 1e-5 else f"differs (relative {worst:.1e})"


def _stored_queries(snap: Any) -> dict[tuple[int, int], dict[int, np.ndarray]]:
    """``(layer, first query head of a reader) -> {position: query of that head}`` of a file."""
    stored = {}
    for layer, spec in enumerate(snap.layers):
        if spec.queries is None:
            continue
        per_reader = spec.queries.num_heads // int(spec.attributes.get("query_readers", 1))
        for head in range(0, spec.queries.num_heads, per_reader):
            found = snap.queries(layer, head)
            if found is not None:
                stored[(layer, head)] = {int(p): row for p, row in zip(found.positions, found.q, strict=True)}
    return stored


def _places(
    stored: dict[tuple[int, int], dict[int, np.ndarray]],
    latent_layers: dict[int, Any],
    queries: np.ndarray,
    keys: np.ndarray,
) -> list[tuple[int, int, int]] | str:
    """Where in the file a call's queries are: ``(layer, first query head, first position)``
    each, or ``"prefill"`` for an absorbed MLA prompt's call (compared through its decode calls)."""
    places = [(layer, offset, first) for (layer, offset), first in _find(stored, queries[0, 0, 0])]
    if places or not latent_layers:
        return places
    # Absorbed MLA: the file's queries are [q_c; q_r]; a decode call is found by its keys (the
    # latents, whose newest row is the file's at that position), or where it read a selection of
    # them (sparse attention), by its queries' q_c, the first columns of the file's.
    chosen = _find_by_latent_query(stored, latent_layers, queries, keys)
    if chosen:
        return chosen
    latent_place = _find_latent(latent_layers, keys, queries.shape[2])
    if isinstance(latent_place, str):
        return latent_place
    return [] if latent_place is None else [(latent_place[0], 0, latent_place[1])]


def _find_by_latent_query(
    stored: dict[tuple[int, int], dict[int, np.ndarray]],
    latent_layers: dict[int, Any],
    queries: np.ndarray,
    keys: np.ndarray,
) -> list[tuple[int, int, int]]:
    """The places of an absorbed MLA decode call whose query ``q_c`` (the call's queries) is the
    first columns of a latent layer's stored ``[q_c; q_r]``: a sparse call, whose keys are the
    ones its indexer gathered, is found so."""
    width = queries.shape[-1]
    if keys.shape[1] != 1:
        return []
    return [
        (layer, offset, position)
        for (layer, offset), rows in stored.items()
        if layer in latent_layers
        for position, row in rows.items()
        if row.shape[-1] > width and np.array_equal(row[:width].astype(np.float32), queries[0, 0, 0])
    ]


def _find_latent(latent_layers: dict[int, Any], keys: np.ndarray, count: int) -> tuple[int, int] | str | None:
    """The (layer, position) of an absorbed MLA decode call, by its keys (the layer's latents
    ``(1, 1, n, k_dim)``: their last row is the file's K row at position ``n - 1``); ``"prefill"``
    for a prompt's call (per-head keys, compared through the decode calls only); None if no
    latent layer holds them."""
    if keys.shape[1] != 1:
        return "prefill"
    n = keys.shape[2]
    for layer, head in latent_layers.items():
        fits = head is not None and head.positions.size >= n and head.k.shape[1] == keys.shape[3]
        if fits and count == 1 and np.array_equal(head.k[n - 1].astype(np.float32), keys[0, 0, -1]):
            return layer, n - 1
    return None


def _call_error(snap: Any, place: tuple[int, int, int], shape: tuple[int, ...], output: np.ndarray) -> float:
    """The largest relative difference between a call's ``output`` ``(1, heads, n, dim)`` and
    attention recomputed from the file at ``place`` (layer, first query head of its reader,
    first position), over the call's heads."""
    layer, offset, first = place
    worst = 0.0
    for head in range(shape[1]):  # this call's heads: its reader's in the file
        recomputed, positions = snap.attention_output(layer, offset + head, queries=(first, first + shape[2]))
        expected = output[0, head, : positions.size]
        scale = max(float(np.abs(expected).max()), 1e-30)
        worst = max(worst, float(np.abs(recomputed - expected).max()) / scale)
    return worst


def _find(
    stored: dict[tuple[int, int], dict[int, np.ndarray]], first_query: np.ndarray
) -> list[tuple[tuple[int, int], int]]:
    """Every ``((layer, first head of the reader), position)`` whose stored query equals
    ``first_query`` (a call's head 0, first position) bit for bit."""
    return [
        (place, position)
        for place, rows in stored.items()
        for position, row in rows.items()
        if row.shape == first_query.shape and np.array_equal(row.astype(np.float32), first_query)
    ]


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
        "uninterrupted run's (float32, relative error at most 1e-5). *Attention from the file*: "
        f"the same model run on the first {len(PROMPT) // 2} prompt tokens with every query "
        'captured (`queries="all"`, a snapshot every token), each call of mlx-lm\'s attention '
        "function (hooked; for a module that computes attention itself, Gemma 2's and PLaMo 2's, "
        "what reaches its output projection; DeepSeek-V4.1's sparse attention over its window and "
        "the pooled groups its indexer chose, format 1.8) compared with attention recomputed from the file "
        "(`Snapshot.attention_output`), relative error at most 1e-5 (absorbed latent attention: "
        "its decode calls, which attend the latents the file holds, or with sparse attention "
        "(DeepSeek-V3.2, GLM-5) the keys its indexer selected, which the file records; the "
        "prompt's calls expand them per head first); where the queries cannot be recorded "
        "faithfully, `--queries` is refused by name before any file is written. "
        f"**{ok} of {len(results) - len(SKIPPED)} checked architectures restore exactly**; "
        f"{len(SKIPPED)} are not checked, each for the reason given.",
        "",
        "Regenerate with `python -m kvsnap.capture.architectures docs/architectures.md --force` "
        "(`tests/capture/test_architectures.py` runs the same check for every architecture).",
        "",
        "| architecture | caches | layer kinds in the file | state layers | restores exactly "
        "| max relative error | attention from the file |",
        "|---|---|---|---:|---|---:|---|",
    ]
    for r in results:
        if r.name in SKIPPED:
            lines.append(f"| `{r.name}` | | | | not checked: {SKIPPED[r.name]} | | |")
            continue
        status = "yes" if r.restores_exactly else f"**no**: {r.error or 'outputs differ'}"
        error = "" if r.error else f"{r.max_logprob_error:.1e}"
        caches = ", ".join(r.cache_classes)
        lines.append(
            f"| `{r.name}` | {caches} | {', '.join(r.layer_kinds)} | {r.state_layers} | {status} | {error} "
            f"| {_attention_text(r)} |"
        )
    return "\n".join(lines) + "\n"


def _attention_text(result: Result) -> str:
    if result.attention == "equal":
        return f"equal ({result.attention_calls} calls, max {result.max_attention_error:.1e})"
    if result.attention.startswith("refused: "):
        reason = result.attention.removeprefix("refused: queries: ").split(";")[0]
        return f"`--queries` refused: {reason}"
    return f"**{result.attention}**"


def main(argv: list[str]) -> int:
    import argparse

    from kvformat.io import check_output, output_path

    parser = argparse.ArgumentParser(prog="python -m kvsnap.capture.architectures")
    parser.add_argument("output", nargs="?", help="the Markdown table to write (default: print it)")
    parser.add_argument("--force", action="store_true", help="replace an existing output")
    options = parser.parse_args(argv)
    if options.output:
        check_output(options.output, force=options.force)  # before the minute of checks
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
    if not options.output:
        print(text)
        return 0
    with output_path(options.output, force=options.force) as temporary:
        Path(temporary).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    from kvformat import KVSnapError

    try:
        sys.exit(main(sys.argv[1:]))
    except KVSnapError as exc:  # a refused output: one line
        print(f"python -m kvsnap.capture.architectures: error: {exc}", file=sys.stderr)
        sys.exit(2)
