"""Generation with snapshots taken at the moments that matter, and resuming from a snapshot.

`generate` streams `mlx_lm.generate.GenerationResponse` objects exactly like
`mlx_lm.stream_generate` (it drives it), while a pass-through logits processor keeps the logits of
the latest step. At each yield the cache already holds the K/V of the token just returned, and those
logits predict the next one; a snapshot records both, so a resumed run continues token for token.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import kvformat
from capture.errors import CaptureError
from capture.restore import last_logits, restore, tokens_of
from capture.snapshot import KVSnapshot, snapshot_kv


@dataclass(frozen=True)
class SnapshotEvent:
    """A snapshot that was taken: generated-token count, total tokens, where it went."""

    generated: int
    tokens: int
    path: str
    index: int
    size: int


class _LogitsRecorder:
    """A logits processor that changes nothing and remembers the latest logits."""

    def __init__(self) -> None:
        self.logits: mx.array | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.logits = logits
        return logits


class SeriesWriter:
    """Appends snapshots of a live cache to one `.kv` file, writing only what changed."""

    def __init__(self, path: str | os.PathLike[str], codec: str, metadata: dict[str, Any]) -> None:
        self.path = os.fspath(path)
        self.codec = codec
        self.metadata = metadata
        self.writer: kvformat.Writer | None = None
        self._held: list[list[np.ndarray]] = []
        self._tokens: list[list[int]] | None = None  # the previous snapshot's, for deltas
        self._text: list[str] | None = None

    def add(self, snapshot: KVSnapshot) -> int:
        """Write the difference between ``snapshot`` and the previous one; return its index."""
        if self.writer is None:
            self.writer = kvformat.Writer(
                self.path,
                snapshot.layer_specs(),
                num_seqs=snapshot.num_seqs,
                metadata=self.metadata,
                codec=self.codec,
            )
            self._held = [[np.empty(0, np.int64)] * snapshot.num_seqs for _ in snapshot.layers]
        writer = self.writer
        appends = []
        for index, layer in enumerate(snapshot.layers):
            if not layer.present or not layer.k:
                continue
            for seq, positions in enumerate(layer.positions):
                held = self._held[index][seq]
                if positions.size >= held.size and np.array_equal(positions[: held.size], held):
                    first_new = held.size  # the usual case: the cache only grew
                else:
                    last = int(held[-1]) if held.size else -1
                    for start, stop in _ranges(held[~np.isin(held, positions)]):
                        writer.drop(index, start, stop, seq=seq)
                    new = positions > last
                    if not np.array_equal(positions[~new], held[np.isin(held, positions)]):
                        raise CaptureError(f"layer {index}: cache positions are not append-only")
                    first_new = int(np.argmax(new)) if new.any() else positions.size
                k, v = layer.tokens_from(seq, first_new)
                appends.append((index, k, v, positions[first_new:], seq))
                self._held[index][seq] = positions
        writer.append_many(appends)  # one call: large first snapshots are pipelined
        arrays = {"last_logits": snapshot.last_logits} if snapshot.last_logits is not None else None
        return writer.snapshot(self._delta_metadata(snapshot.snapshot_metadata), arrays=arrays)

    def _delta_metadata(self, metadata: dict[str, Any]) -> dict[str, Any]:
        """``metadata`` with ``tokens`` / ``text`` replaced by what was appended since the previous
        snapshot (``tokens_appended`` / ``text_appended``, SPEC 15.3) when the previous ones are a
        prefix, so a series' index grows with the tokens, not with tokens x snapshots."""
        out = dict(metadata)
        tokens: Any = metadata.get("tokens")
        text: Any = metadata.get("text")
        previous_tokens: Any = self._tokens
        previous_text: Any = self._text
        self._tokens, self._text = tokens, text
        if _extends(tokens, previous_tokens):
            del out["tokens"]
            out["tokens_appended"] = [
                new[len(old) :] for new, old in zip(tokens, previous_tokens, strict=True)
            ]
            if _extends(text, previous_text):
                del out["text"]
                out["text_appended"] = [new[len(old) :] for new, old in zip(text, previous_text, strict=True)]
        return out

    def close(self, metadata: dict[str, Any] | None = None) -> None:
        if self.writer is not None:
            self.writer.close(metadata)


def _extends(new: Any, old: Any) -> bool:
    """Whether each sequence of ``new`` starts with the same sequence of ``old``."""
    return (
        new is not None
        and old is not None
        and len(new) == len(old)
        and all(n[: len(o)] == o for n, o in zip(new, old, strict=True))
    )


def _ranges(positions: np.ndarray) -> list[tuple[int, int]]:
    """Sorted positions as half-open runs ``[start, stop)``."""
    if positions.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [positions.size]])
    return [(int(positions[a]), int(positions[b - 1]) + 1) for a, b in zip(starts, stops, strict=True)]


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | Sequence[int] | None = None,
    *,
    max_tokens: int = 256,
    output: str | os.PathLike[str] | None = None,
    every: int | None = None,
    at: Sequence[int] = (),
    when: Callable[[Any], bool] | None = None,
    final: bool = True,
    separate_files: bool = False,
    codec: str = "raw",
    save_logits: bool = True,
    resume: KVSnapshot | kvformat.Snapshot | None = None,
    model_path: str | None = None,
    max_kv_size: int | None = None,
    on_snapshot: Callable[[SnapshotEvent], None] | None = None,
    metadata: dict[str, Any] | None = None,
    **generate_kwargs: Any,
) -> Iterator[Any]:
    """Stream generation like `mlx_lm.stream_generate`, taking K/V snapshots along the way.

    Snapshots are taken after ``every`` generated tokens, at the generated-token counts in ``at``,
    whenever ``when(response)`` is true, and at the end (``final``). With ``output`` they are
    appended to one `.kv` series file (shared chunks stored once), or, with ``separate_files``,
    written to ``output`` with ``-NNNN`` before the suffix. ``resume`` continues from a snapshot
    (in memory or read back) instead of a prompt. Other keyword arguments (``sampler``,
    ``kv_bits``, ``prefill_step_size``, ...) go to mlx-lm.
    """
    from mlx_lm import stream_generate
    from mlx_lm.generate import GenerationResponse
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    if max_tokens <= 0:
        return
    sampler = generate_kwargs.pop("sampler", None) or make_sampler(0.0)
    history: list[int]
    first_response: Any = None
    if resume is not None:
        history = (tokens_of(resume) or [[]])[0]
        logits = last_logits(resume)
        if logits is None:
            raise CaptureError("the snapshot has no last logits; capture with save_logits=True to resume")
        if resume.seq_len and resume.seq_len != len(history):
            raise CaptureError("snapshot tokens and K/V disagree; cannot resume")
        prompt_cache = restore(resume)
        logprobs = mx.array(logits[0])
        logprobs = logprobs - mx.logsumexp(logprobs, keepdims=True)
        token = int(np.array(sampler(logprobs[None])).reshape(-1)[0])
        first_response = GenerationResponse(
            text=tokenizer.decode([token]),
            token=token,
            logprobs=logprobs,
            from_draft=False,
            prompt_tokens=0,
            prompt_tps=0.0,
            generation_tokens=1,
            generation_tps=0.0,
            peak_memory=0.0,
            finish_reason="length" if max_tokens == 1 else None,
        )
        if token in getattr(tokenizer, "eos_token_ids", ()):
            first_response.finish_reason = "stop"
        prompt_ids = [token]
    else:
        if prompt is None:
            raise ValueError("give a prompt or a snapshot to resume from")
        prompt_ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
        history = []
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    recorder = _LogitsRecorder()
    processors = [*generate_kwargs.pop("logits_processors", []), recorder]
    series: SeriesWriter | None = None
    file_metadata: dict[str, Any] | None = None
    taken = 0
    at_set = {int(n) for n in at}

    def take(response: Any, generated: int, tokens: list[int]) -> None:
        nonlocal series, file_metadata, taken
        logits = recorder.logits if save_logits else None
        snap = snapshot_kv(
            prompt_cache,
            model,
            model_path=model_path,
            tokenizer=tokenizer,
            tokens=tokens,
            last_logits=logits,
            metadata=metadata,
        )
        if snap.seq_len and snap.seq_len != len(tokens):
            raise CaptureError(
                f"cache holds {snap.seq_len} positions but {len(tokens)} tokens were processed"
            )
        snap.snapshot_metadata["generated"] = generated
        if file_metadata is None:
            file_metadata = snap.metadata
            file_metadata["prompt_tokens"] = len(prompt_ids) if resume is None else 0
            file_metadata["resumed_from_tokens"] = len(history)
            file_metadata.setdefault("generation", {}).update(
                {
                    "max_tokens": max_tokens,
                    "every": every,
                    "at": sorted(at_set),
                    "max_kv_size": max_kv_size,
                    **{k: v for k, v in generate_kwargs.items() if isinstance(v, int | float | str | None)},
                }
            )
        if output is None:
            return
        if separate_files:
            base = Path(output)
            path = base.with_name(f"{base.stem}-{generated:04d}{base.suffix or '.kv'}")
            snap.save(path, codec)
            index = 0
        else:
            if series is None:
                series = SeriesWriter(output, codec, file_metadata)
            index = series.add(snap)
            path = Path(output).with_name(Path(output).name + ".partial")
        taken += 1
        if on_snapshot is not None:
            size = path.stat().st_size if path.exists() else 0
            on_snapshot(SnapshotEvent(generated, len(tokens), os.fspath(path), index, size))

    generated_tokens: list[int] = []
    try:
        if first_response is not None:
            generated_tokens.append(first_response.token)
            yield first_response
            if first_response.finish_reason is not None:
                return
        remaining = max_tokens - len(generated_tokens)
        if remaining <= 0:
            return
        for response in stream_generate(
            model,
            tokenizer,
            mx.array(prompt_ids),
            max_tokens=remaining,
            sampler=sampler,
            logits_processors=processors,
            prompt_cache=prompt_cache,
            **generate_kwargs,
        ):
            generated_tokens.append(int(response.token))
            generated = len(generated_tokens)
            tokens = history + (prompt_ids if resume is None else []) + generated_tokens
            is_final = response.finish_reason is not None
            if (
                (every and generated % every == 0)
                or generated in at_set
                or (when is not None and when(response))
                or (final and is_final)
            ):
                take(response, generated, tokens)
            yield response
    finally:
        if series is not None:
            text = tokenizer.decode(generated_tokens)
            series.close({"generated_text": text} if not separate_files else None)
