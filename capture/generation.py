"""Generation with snapshots taken at the moments that matter, and resuming from a snapshot.

`generate` streams `mlx_lm.generate.GenerationResponse` objects exactly like
`mlx_lm.stream_generate` (it drives it), while a pass-through logits processor keeps the logits of
the latest step. At each yield the cache already holds the K/V of the token just returned, and those
logits predict the next one; a snapshot records both, so a resumed run continues token for token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import sys
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import kvformat
from kvformat.errors import ConflictingArgumentsError, InvalidArgumentError
from kvformat.io.outputs import check_output, refuse_inside
from kvformat.writer_process import WriterProcess

from . import state as recurrent
from .background import DEFAULT_MAX_PENDING, BackgroundWriter, Transfer
from .caches import file_caches, link_extra_layers
from .deltas import CacheTracker, layer_specs
from .errors import CaptureError
from .model_info import annotate_layers, file_metadata
from .queries import QueryRecorder, QuerySelection, check_hookable
from .resume import last_logits, restore, tokens_of
from .series import SeriesWriter
from .snapshot import KVSnapshot, snapshot_kv
from .triggers import Triggers


def token_pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token decoded alone (SPEC 15.3 ``token_pieces``): the text a researcher labels a
    position with. A token holding part of a UTF-8 character (which decodes alone to U+FFFD) is
    written as its bytes, ``<0xE2><0x80>``, where the tokenizer tells them (`byte_label`)."""
    if not ids:
        return []
    batch = getattr(tokenizer, "batch_decode", None) or getattr(
        getattr(tokenizer, "_tokenizer", None), "batch_decode", None
    )
    if batch is not None:
        pieces = [str(piece) for piece in batch([[int(t)] for t in ids])]
    else:
        pieces = [str(tokenizer.decode([int(t)])) for t in ids]
    return [
        (byte_label(tokenizer, int(t)) or piece) if "\ufffd" in piece else piece
        for t, piece in zip(ids, pieces, strict=True)
    ]


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: the character a byte-level BPE vocabulary
    writes for each byte, back to the byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(kept)
    extra = 0
    for byte in range(256):
        if byte not in kept:
            kept.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(kept, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()
_BYTE_TOKEN = re.compile(r"(?:<0x[0-9A-Fa-f]{2}>)+")


def byte_label(tokenizer: Any, token: int) -> str | None:
    """A token that holds part of a UTF-8 character as text and ``<0xHH>`` bytes (``" <0xE6>"``),
    from its vocabulary entry (SentencePiece's byte fallback writes ``<0xE6>``; a byte-level BPE
    one character per byte); None where the entry is neither."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None) or getattr(
        getattr(tokenizer, "_tokenizer", None), "convert_ids_to_tokens", None
    )
    if convert is None:
        return None
    data = _entry_bytes(convert(token))
    if data is None:
        return None
    # whole characters as text, the bytes of a part of one as <0xHH>
    text = data.decode("utf-8", errors="surrogateescape")
    return "".join(f"<0x{ord(c) - 0xDC00:02X}>" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in text)


def _entry_bytes(entry: Any) -> bytes | None:
    """The bytes a vocabulary entry stands for: SentencePiece's byte fallback (``<0xE6>``) or a
    byte-level BPE entry (a character a byte); None for any other entry."""
    if not isinstance(entry, str) or not entry:
        return None
    if _BYTE_TOKEN.fullmatch(entry):
        return bytes(int(entry[i + 3 : i + 5], 16) for i in range(0, len(entry), 6))
    if all(c in _BYTE_DECODER for c in entry):
        return bytes(_BYTE_DECODER[c] for c in entry)
    return None


def _split_host(
    host: list[np.ndarray], queries: int, states: list[str], with_logits: bool
) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, np.ndarray], np.ndarray | None]:
    """A snapshot's host copies in the order `_Snapshots.take` handed them over (K/V, then
    ``queries`` query arrays, then the named ``states``, then the logits if any), apart:
    ``(K/V, queries, {state name: array}, logits or None)``."""
    last = host.pop() if with_logits else None
    kept = len(host) - len(states)
    state = dict(zip(states, host[kept:], strict=True))
    host = host[:kept]
    kept -= queries
    return host[:kept], host[kept:], state, last


def text_in_context(tokenizer: Any, context: Sequence[int], token: int) -> str:
    """The text ``token`` adds after ``context`` (its last 8 ids): what a streaming detokenizer
    running since the start prints for it, leading space included (decoding a token alone drops
    the space of SentencePiece and byte-level tokenizers)."""
    tail = [int(t) for t in context[-8:]]
    before, after = tokenizer.decode(tail), tokenizer.decode([*tail, int(token)])
    return after[len(before) :] if after.startswith(before) else str(tokenizer.decode([int(token)]))


@dataclass(frozen=True)
class SnapshotEvent:
    """A snapshot that was written: ``generated`` tokens generated so far, ``cached_tokens``
    tokens in the cache, ``path`` the file it belongs to (a series: the output file, which appears under that
    name when generation ends; until then its bytes are in ``writing``), ``index`` its snapshot
    index there, ``size`` the bytes written so far."""

    generated: int
    cached_tokens: int
    path: str
    index: int
    size: int
    writing: str

    @property
    def tokens(self) -> int:
        """The former name of ``cached_tokens`` (deprecated)."""
        warnings.warn("SnapshotEvent.tokens is now cached_tokens", DeprecationWarning, stacklevel=2)
        return self.cached_tokens


class _LogitsRecorder:
    """A logits processor that changes nothing and remembers the latest logits."""

    def __init__(self) -> None:
        self.logits: mx.array | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.logits = logits
        return logits


class _Snapshots:
    """Takes the snapshots of one generation: deltas sliced on the device in the generating
    thread, written by a background thread (`capture.background`), one series file or one file
    per snapshot."""

    @classmethod
    def of(
        cls,
        prompt_cache: list[Any],
        model: nn.Module,
        tokenizer: Any,
        options: Capture,
        file_metadata: dict[str, Any],
        recorder: QueryRecorder | None,
    ) -> _Snapshots:
        """The snapshots a `Capture`'s ``options`` ask for, the file's metadata ``file_metadata``."""
        return cls(
            prompt_cache,
            model,
            tokenizer,
            output=options.output,
            separate_files=options.separate_files,
            codec=options.codec,
            model_path=options.model_path,
            file_metadata=file_metadata,
            on_snapshot=options.on_snapshot,
            max_pending=options.max_pending,
            durable=options.durable,
            overwrite=options.overwrite,
            recorder=recorder,
            write_in_process=options.write_in_process,
        )

    def __init__(
        self,
        prompt_cache: list[Any],
        model: nn.Module,
        tokenizer: Any,
        *,
        output: str | os.PathLike[str] | None,
        separate_files: bool,
        codec: str,
        model_path: str | None,
        file_metadata: dict[str, Any],
        on_snapshot: Callable[[SnapshotEvent], None] | None,
        max_pending: int,
        durable: bool = True,
        overwrite: bool = False,
        recorder: QueryRecorder | None = None,
        write_in_process: bool = False,
    ) -> None:
        self.durable = durable
        self.overwrite = overwrite
        self.recorder = recorder
        self.prompt_cache = prompt_cache
        self.model = model
        self.tokenizer = tokenizer
        self.output = output
        self.separate_files = separate_files
        self.codec = codec
        self.model_path = model_path
        self.file_metadata = file_metadata
        self.on_snapshot = on_snapshot
        self.tracker = CacheTracker()
        self.background = BackgroundWriter(max_pending) if output is not None else None
        self.series: SeriesWriter | None = None
        # Started now, so that it has imported what it needs by the first snapshot.
        self.process = (
            _writer_process() if write_in_process and output is not None and not separate_files else None
        )
        self.taken = 0
        self._tokens_written = 0  # token ids already recorded in the series' metadata
        self._text_written = 0  # streamed text pieces already recorded
        self.failed = False
        self._state_layers: list[tuple[int, list[Any]]] = []
        self._appended: dict[int, dict[int, int]] = {}  # per layer, appended slot -> rows stored

    def check(self) -> None:
        """Raise a writer-thread error in the generating thread."""
        if self.background is not None:
            try:
                self.background.check()
            except CaptureError as exc:
                self.failed = True
                partial = os.fspath(self.output or "") + ".partial"
                raise CaptureError(
                    f"{exc}; {partial} keeps every snapshot written before it: run 'kvsnap recover {partial}'"
                ) from exc.__cause__

    def take(self, generated: int, tokens: list[int], pieces: list[str], base_text: str, logits: Any) -> None:
        """One snapshot after ``generated`` tokens; ``tokens`` every id the cache holds, ``pieces``
        the streamed text so far after ``base_text`` (the prompt's)."""
        self.check()
        if self.output is None:
            return
        if self.separate_files:
            self._take_file(generated, tokens, pieces, base_text, logits)
            return
        metadata, new_tokens, pieces_key = self._token_metadata(generated, tokens, pieces, base_text)
        placed = file_caches(self.prompt_cache, self.model)
        caches = [cache for cache, _ in placed]
        deltas = self._deltas(caches, len(tokens))
        queries, layout = self.recorder.take() if self.recorder is not None else ([], [])
        series = self.series or self._open_series(placed)
        states = self._states()
        arrays = [array for delta in deltas for array in (*delta.keys, *delta.values)]
        fresh = list(range(len(arrays), len(arrays) + len(queries)))  # the recorder's joins
        arrays += [*queries, *states.values()]
        if logits is not None:
            fresh.append(len(arrays))
            arrays.append(mx.array(logits).astype(mx.float32).reshape(-1, logits.shape[-1]))
        transfer = Transfer(arrays, fresh)
        # The transfer's copies from here on: the write job keeps no device array, so the caches'
        # buffers stay the caches' own (updated in place, not copied, at the next steps).
        deltas = [delta.without_arrays() for delta in deltas]
        query_count, state_names = len(queries), list(states)
        index, count = self.taken, len(tokens)
        output = os.fspath(self.output)
        event_path = output + ".partial"
        with_logits = logits is not None

        def write() -> None:
            metadata[pieces_key] = [token_pieces(self.tokenizer, new_tokens)]
            host = transfer.to_host()
            host, found, state, last = _split_host(host, query_count, state_names, with_logits)
            if found:
                series.add_queries(QueryRecorder.on_host(found, layout))
            series.add(deltas, host, metadata, last, state)
            if self.on_snapshot is not None:
                size = os.path.getsize(event_path) if os.path.exists(event_path) else 0
                self.on_snapshot(SnapshotEvent(generated, count, output, index, size, event_path))

        assert self.background is not None
        self.background.submit(write)
        self.taken += 1

    def _deltas(self, caches: list[Any], tokens: int) -> list[Any]:
        """What the caches gained since the last snapshot (`deltas.DeltaTracker.read`), checked
        against the ``tokens`` processed."""
        deltas = self.tracker.read(caches)
        if self.tracker.end() not in (0, tokens):
            raise CaptureError(
                f"cache holds {self.tracker.end()} positions but {tokens} tokens were processed"
            )
        return deltas

    def _token_metadata(
        self, generated: int, tokens: list[int], pieces: list[str], base_text: str
    ) -> tuple[dict[str, Any], list[int], str]:
        """A series snapshot's metadata (its token ids and text: in full in the first, what was
        added since the previous one after it, SPEC 15.3), the ids whose pieces the writer
        thread decodes, and the key they go under."""
        metadata: dict[str, Any] = {"generated": generated}
        # Token ids are copied here; their pieces are decoded on the writer thread.
        if self.series is None and self.taken == 0:
            new_tokens, pieces_key = list(tokens), "token_pieces"
            metadata["tokens"] = [new_tokens]
            metadata["text"] = [base_text + "".join(pieces)]
        else:
            new_tokens, pieces_key = tokens[self._tokens_written :], "token_pieces_appended"
            metadata["tokens_appended"] = [new_tokens]
            metadata["text_appended"] = ["".join(pieces[self._text_written :])]
        self._tokens_written, self._text_written = len(tokens), len(pieces)
        return metadata, new_tokens, pieces_key

    def _open_series(self, placed: list[tuple[Any, dict[str, Any]]]) -> SeriesWriter:
        """The series file, opened at the first snapshot (header and manifest: small, once): the
        layers described from the caches (`caches.file_caches`), what the model says of them, their
        queries; which layers hold state is kept for every snapshot (`_states`)."""
        specs, num_seqs = layer_specs([cache for cache, _ in placed])
        link_extra_layers([spec.attributes for spec in specs], [place for _, place in placed])
        annotate_layers(
            [spec.attributes for spec in specs],
            [spec.present for spec in specs],
            self.model,
            [(spec.k_dim, spec.v_dim) if spec.present else None for spec in specs],
        )
        if self.recorder is not None:
            specs = self._with_queries(specs)
        self._state_layers = [
            (index, described)
            for index, spec in enumerate(specs)
            if isinstance(described := spec.attributes.get("state"), list)
        ]
        assert self.output is not None
        self.series = SeriesWriter(
            self.output,
            self.codec,
            self.file_metadata,
            specs,
            num_seqs,
            durable=self.durable,
            overwrite=self.overwrite,
            process=self.process,
        )
        return self.series

    def _states(self) -> dict[str, mx.array]:
        """Every layer's recurrent state as device arrays named as the file stores them (SPEC
        15.4), for the layers `_open_series` found holding state."""
        out: dict[str, mx.array] = {}
        for index, described in self._state_layers:
            arrays_cache, _ = recurrent.of(self.prompt_cache[index])
            stored = self._appended.setdefault(index, {})  # each snapshot's parent is the one before
            for local, array in recurrent.device_arrays(index, arrays_cache, described, stored).items():
                out[recurrent.name(index, local)] = array
        return out

    def _with_queries(self, specs: list[kvformat.LayerSpec]) -> list[kvformat.LayerSpec]:
        """The layer specs with what the query recorder saw each layer's attention do."""
        assert self.recorder is not None
        if not self.recorder.layers:
            raise CaptureError(
                "queries: none of this model's layers computed attention through mlx-lm's "
                "scaled_dot_product_attention, so there are no queries to capture"
            )
        recorder = self.recorder
        out = []
        for i, spec in enumerate(specs):
            if spec.present:
                attributes = spec.attributes
                if recorder.readers(i) > 1:  # SPEC 15.2: query_readers
                    attributes = {**attributes, "query_readers": recorder.readers(i)}
                spec = dataclasses.replace(
                    spec, attributes=attributes, queries=recorder.spec(i, spec.num_heads, spec.attributes)
                )
            out.append(spec)
        return out

    def _take_file(
        self, generated: int, tokens: list[int], pieces: list[str], base_text: str, logits: Any
    ) -> None:
        snap = snapshot_kv(self.prompt_cache, self.model, model_path=self.model_path, last_logits=logits)
        if snap.seq_len and snap.seq_len != len(tokens):
            raise CaptureError(
                f"cache holds {snap.seq_len} positions but {len(tokens)} tokens were processed"
            )
        snap.metadata = {**self.file_metadata}
        snap.snapshot_metadata = {
            "tokens": [list(tokens)],
            "token_pieces": [token_pieces(self.tokenizer, tokens)],
            "text": [base_text + "".join(pieces)],
            "generated": generated,
        }
        assert self.output is not None
        base = Path(self.output)
        # Numbered like snapshots everywhere else: from 0, in the order they are taken.
        path = base.with_name(f"{base.stem}-{self.taken:04d}{base.suffix or '.kv'}")
        codec, count = self.codec, len(tokens)

        def write() -> None:
            snap.save(path, codec, durable=self.durable, overwrite=self.overwrite)
            if self.on_snapshot is not None:
                self.on_snapshot(
                    SnapshotEvent(generated, count, os.fspath(path), 0, path.stat().st_size, os.fspath(path))
                )

        assert self.background is not None
        self.background.submit(write)
        self.taken += 1

    def close(self, generated_text: str) -> None:
        """Write the index (or, after a writer error, leave the ``.partial`` file) and stop."""
        if self.background is None:
            return
        series, process = self.series, self.process
        if series is not None and not self.failed:
            self.background.submit(lambda: series.close({"generated_text": generated_text}))
        elif series is None and process is not None:  # no snapshot was taken: the child just exits
            self.background.submit(process.leave_partial)
        try:
            self.background.close()
        except CaptureError:
            self.failed = True
            raise
        finally:
            if self.failed and series is not None:
                series.leave_partial()  # the file closed (its lock released) for `kvsnap recover`
            elif process is not None and series is None:
                process.leave_partial()


def _writer_process() -> WriterProcess | None:
    """A started writer process, or None where one cannot be started (then the series is
    written by the writer thread itself)."""
    if not hasattr(os, "writev") or not hasattr(os, "readv") or not sys.executable:
        return None
    try:
        return WriterProcess()
    except OSError as exc:
        warnings.warn(
            f"snapshots are written by a thread: no writer process ({exc})", RuntimeWarning, stacklevel=3
        )
        return None


def make_cache(model: nn.Module, max_kv_size: int | None = None) -> list[Any]:
    """The model's prompt cache; with ``max_kv_size``, every plain `KVCache` layer becomes a
    `RotatingKVCache` of that many tokens (keeping the first 4), also for models that build their
    own cache, where mlx-lm ignores ``max_kv_size``. Raises if no layer could be limited."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    if max_kv_size is None:
        return cache
    if not isinstance(max_kv_size, int) or max_kv_size < 1:
        raise InvalidArgumentError(f"max_kv_size must be a positive number of tokens, got {max_kv_size!r}")
    limited = [RotatingKVCache(max_size=max_kv_size, keep=4) if type(c) is KVCache else c for c in cache]
    if not any(type(c).__name__ == "RotatingKVCache" and c.max_size == max_kv_size for c in limited):
        names = sorted({type(c).__name__ for c in cache})
        raise CaptureError(f"max_kv_size cannot be applied: this model's cache layers are {names}")
    return limited


@dataclass(frozen=True)
class Capture:
    """What `generate` captures, and where: kvsnap's options, apart from mlx-lm's own.

    Snapshots are taken after ``every`` generated tokens, at the generated-token counts in ``at``,
    whenever ``when(response)`` is true, and at the end (``final``). With ``output`` they are
    appended to one `.kv` series file (shared chunks stored once), or, with ``separate_files``,
    written to ``output`` with ``-NNNN`` (the snapshot's number, from 0) before the suffix, in
    ``codec``. ``save_logits`` stores the last logits with each snapshot (to resume from it).
    ``model_path`` and ``metadata`` go to the file's metadata; ``on_snapshot`` is called with
    each `SnapshotEvent`. At most ``max_pending`` snapshots wait for the disk before generation
    does; ``durable=False`` skips the fsyncs (each snapshot's and the file's at close): for
    scratch captures. An existing ``output`` is refused before generation starts unless
    ``overwrite``. ``queries`` (`QuerySelection`: ``"none"``, ``"decode"``, ``"window:W"``,
    ``"all"``) also stores the post-RoPE queries of those positions, and how each layer's
    attention used them (format 1.3), in a series file; generation is unchanged. ``write_in_process``
    writes a series file from a child process instead of a thread of this one, so that the
    writing's Python never holds the interpreter lock the generating thread needs; handing it
    the bytes costs more than that saves, on 2 cores and on a 16-core GPU host alike
    (``python -m benchmarks.capture_gil_bench``; docs/capturing.md has the figures)."""

    output: str | os.PathLike[str] | None = None
    every: int | None = None
    at: Sequence[int] = ()
    when: Callable[[Any], bool] | None = None
    final: bool = True
    separate_files: bool = False
    codec: str = "raw"
    save_logits: bool = True
    model_path: str | None = None
    on_snapshot: Callable[[SnapshotEvent], None] | None = None
    metadata: dict[str, Any] | None = None
    max_pending: int = DEFAULT_MAX_PENDING
    durable: bool = True
    overwrite: bool = False
    queries: str | QuerySelection = "none"
    write_in_process: bool = False

    @classmethod
    def split(cls, capture: Capture | None, kwargs: dict[str, Any]) -> tuple[Capture, dict[str, Any]]:
        """``capture`` with the `Capture` fields among ``kwargs`` (the keyword form), and the
        remaining keyword arguments, mlx-lm's. TypeError for a field given both ways."""
        names = {f.name for f in dataclasses.fields(cls)}
        given = {name: kwargs[name] for name in kwargs if name in names}
        rest = {name: value for name, value in kwargs.items() if name not in names}
        if capture is None:
            return cls(**given), rest
        if given:
            raise ConflictingArgumentsError(
                f"give {', '.join(sorted(given))} in capture=Capture(...) or as keywords, not both"
            )
        return capture, rest


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | Sequence[int] | None = None,
    capture: Capture | None = None,
    *,
    max_tokens: int = 256,
    resume: KVSnapshot | kvformat.Snapshot | None = None,
    max_kv_size: int | None = None,
    **kwargs: Any,
) -> Generator[Any, None, None]:
    """Stream generation like `mlx_lm.stream_generate`, taking K/V snapshots along the way.

    ``capture`` (`Capture`) says what is captured and where; its fields may also be given as
    keywords (``generate(model, tokenizer, prompt, output="run.kv", every=16)``). ``resume``
    continues from a snapshot (in memory or read back) instead of a prompt; ``max_tokens`` and
    ``max_kv_size`` (a rotating cache of that many positions) are mlx-lm's, as are the other
    keyword arguments (``sampler``, ``kv_bits``, ``prefill_step_size``, ...).
    """
    options, generate_kwargs = Capture.split(capture, kwargs)
    from mlx_lm.sample_utils import make_sampler

    triggers = Triggers.of(options.every, options.at, options.when, options.final)
    if max_tokens <= 0:
        return
    selection = _check_arguments(
        options.codec,
        options.queries,
        options.output,
        options.separate_files,
        options.overwrite,
        options.model_path,
    )
    if selection.enabled:
        check_hookable(model)
    sampler = generate_kwargs.pop("sampler", None) or make_sampler(0.0)
    start = _start(model, tokenizer, prompt, resume, sampler, (max_tokens, max_kv_size))
    query_recorder = _query_recorder(selection, start, resume is not None, model)
    recorder = _LogitsRecorder()
    generate_kwargs["logits_processors"] = [*generate_kwargs.pop("logits_processors", []), recorder]
    prompt_tokens = len(start.prompt_ids) if resume is None else 0
    info = _file_info(
        model, options.model_path, tokenizer, options.metadata, prompt_tokens, len(start.history)
    )
    if selection.enabled:
        info["queries"] = selection.to_json()
    info.setdefault("generation", {}).update(
        {
            "max_tokens": max_tokens,
            "every": options.every,
            "at": sorted(triggers.at),
            "max_kv_size": max_kv_size,
        }
        | {k: v for k, v in generate_kwargs.items() if isinstance(v, int | float | str | None)}
    )
    snapshots = _Snapshots.of(start.cache, model, tokenizer, options, info, query_recorder)
    logits = recorder if options.save_logits else None
    run = _Run(model, tokenizer, start, snapshots, triggers, logits, resume is not None)
    yield from run.stream(query_recorder, max_tokens, sampler, options.output is not None, generate_kwargs)


def _query_recorder(selection: Any, start: _Start, resumed: bool, model: nn.Module) -> QueryRecorder | None:
    """The recorder of the queries ``selection`` asks for (None: no queries), from the first
    position it keeps: past the history a resumed run starts from."""
    if not selection.enabled:
        return None
    first = len(start.history) if resumed else selection.first_position(len(start.prompt_ids))
    return QueryRecorder(start.cache, first, model)


def _start(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | Sequence[int] | None,
    resume: KVSnapshot | kvformat.Snapshot | None,
    sampler: Any,
    limits: tuple[int, int | None],
) -> _Start:
    """Where `generate` starts: the snapshot ``resume`` continues from, else the prompt's
    (``limits``: ``max_tokens`` and ``max_kv_size``)."""
    max_tokens, max_kv_size = limits
    if resume is not None:
        return _resume_start(resume, tokenizer, sampler, max_tokens)
    if prompt is None:
        raise InvalidArgumentError("give a prompt or a snapshot to resume from")
    return _prompt_start(model, tokenizer, prompt, max_kv_size)


def _check_arguments(
    codec: str,
    queries: str | QuerySelection,
    output: Any,
    separate_files: bool,
    overwrite: bool,
    model_path: str | None = None,
) -> QuerySelection:
    """`generate`'s checks that must fail before the model runs: the codec, the query selection
    (stored in a series file only), an existing output, an output inside the model's folder
    (every file there is an input, even with ``overwrite``). The parsed selection."""
    kvformat.codecs.parse(codec)  # an unknown codec fails now, not at the first snapshot
    selection = QuerySelection.parse(queries)
    if selection.enabled and (output is None or separate_files):
        raise CaptureError("queries are stored in a series file: give output= (not separate_files)")
    folders = [model_path] if model_path and os.path.isdir(model_path) else []
    if output is not None and not separate_files:
        check_output(output, force=overwrite, input_folders=folders)  # now, not at the first snapshot
    elif output is not None:  # OUT-0000.kv, ...: none of them inside the model's folder
        refuse_inside(output, folders)
    return selection


@dataclasses.dataclass
class _Run:
    """One generation's streaming loop: mlx-lm's responses, the resumed first token, snapshots
    when the triggers say, and the series closed however the loop ends."""

    model: nn.Module
    tokenizer: Any
    start: _Start
    snapshots: _Snapshots
    triggers: Triggers
    logits: _LogitsRecorder | None  # None: snapshots without the last logits
    resumed: bool

    def stream(
        self, hooks: Any, max_tokens: int, sampler: Any, record_text: bool, generate_kwargs: dict[str, Any]
    ) -> Iterator[Any]:
        """Yield mlx-lm's responses (the resumed token first), taking snapshots; ``hooks`` (the
        query recorder, or None) are installed for the run."""
        from mlx_lm import stream_generate

        first_response, processed = self.start.first_response, self.start.processed
        base_text = self.tokenizer.decode(processed) if record_text else ""
        pieces: list[str] = []  # streamed text of the generated tokens
        generated_tokens: list[int] = []
        finished = False
        hooks = hooks if hooks is not None else contextlib.nullcontext()
        try:
            hooks.__enter__()
            responses: Iterator[Any] = stream_generate(
                self.model,
                self.tokenizer,
                mx.array(self.start.prompt_ids),
                max_tokens=max_tokens - (first_response is not None),
                sampler=sampler,
                prompt_cache=self.start.cache,
                **generate_kwargs,
            )
            if first_response is not None:
                # The resumed token is yielded first; its K/V enter the cache with the next step.
                pieces.append(first_response.text)
                generated_tokens.append(first_response.token)
                processed.append(first_response.token)
                yield first_response
                if first_response.finish_reason is not None or max_tokens == 1:
                    finished = True
                    return
            for response in self._responses(responses, processed):
                self.snapshots.check()
                generated_tokens.append(int(response.token))
                pieces.append(response.text)
                processed.append(int(response.token))
                generated = len(generated_tokens)
                if self.triggers.due(generated, response, response.finish_reason is not None):
                    latest = self.logits.logits if self.logits is not None else None
                    self.snapshots.take(generated, processed, pieces, base_text, latest)
                yield response
            finished = True
        finally:
            hooks.__exit__(None, None, None)
            text = self.tokenizer.decode(generated_tokens) if record_text else ""
            if finished:
                self.snapshots.close(text)
            else:  # an error, or the caller stopped early: still finish what was written
                with contextlib.suppress(CaptureError):
                    self.snapshots.close(text)

    def _responses(self, responses: Iterator[Any], processed: list[int]) -> Iterator[Any]:
        """mlx-lm's responses; after a resume the first one's text is decoded in context (mlx-lm's
        detokenizer starts fresh and trims the first token's space)."""
        first = self.resumed
        for response in responses:
            if first:
                first = False
                text = text_in_context(self.tokenizer, processed, int(response.token))
                response = dataclasses.replace(response, text=text)
            yield response


@dataclasses.dataclass
class _Start:
    """Where generation starts: the tokens already in the cache (``history``, a resumed
    snapshot's), the cache, the first response (a resumed snapshot's next token, sampled from its
    saved logits), the ids mlx-lm is handed, and every token processed so far."""

    history: list[int]
    cache: list[Any]
    first_response: Any
    prompt_ids: list[int]
    processed: list[int]


def _prompt_start(
    model: nn.Module, tokenizer: Any, prompt: str | Sequence[int], max_kv_size: int | None
) -> _Start:
    ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else [int(t) for t in prompt]
    return _Start([], make_cache(model, max_kv_size), None, ids, list(ids))


def _resume_start(
    resume: KVSnapshot | kvformat.Snapshot, tokenizer: Any, sampler: Callable[..., Any], max_tokens: int
) -> _Start:
    from mlx_lm.generate import GenerationResponse

    history = (tokens_of(resume) or [[]])[0]
    logits = last_logits(resume)
    if logits is None:
        raise CaptureError("the snapshot has no last logits; capture with save_logits=True to resume")
    if resume.seq_len and resume.seq_len != len(history):
        raise CaptureError("snapshot tokens and K/V disagree; cannot resume")
    cache = restore(resume)
    logprobs = mx.array(logits[0])
    logprobs = logprobs - mx.logsumexp(logprobs, keepdims=True)
    token = int(np.array(sampler(logprobs[None])).reshape(-1)[0])
    first = GenerationResponse(
        text=text_in_context(tokenizer, history, token),
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
        first.finish_reason = "stop"
    return _Start(history, cache, first, [token], list(history))


def _file_info(
    model: nn.Module,
    model_path: str | None,
    tokenizer: Any,
    metadata: dict[str, Any] | None,
    prompt_tokens: int,
    resumed_from: int,
) -> dict[str, Any]:
    """The file metadata of a capture: the model's, the time, the caller's, the token counts."""
    info = file_metadata(model, model_path, tokenizer)
    info["created"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    info.update(metadata or {})
    info["prompt_tokens"] = prompt_tokens
    info["resumed_from_tokens"] = resumed_from
    return info
