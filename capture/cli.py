"""``kvsnap`` subcommands of the capture stage (registered through the ``kvsnap.commands``
entry point): convert-gguf, fetch-models, capture."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from kvformat.errors import InvalidArgumentError
from kvsnap.arguments import fraction, non_negative_float, positive_int, typed
from kvsnap.errors import CommandError


@dataclass(frozen=True)
class CaptureOptions:
    """``kvsnap capture``'s options, typed (`kvsnap.arguments.typed`)."""

    model: str = ""
    prompt: str | None = None
    prompt_file: str | None = None
    max_tokens: int = 64
    output: str = ""
    every: int | None = None
    at: str | None = None
    separate_files: bool = False
    codec: str = "raw"
    kv_bits: int | None = None
    max_kv_size: int | None = None
    temp: float = 0.0
    top_p: float = 0.0
    seed: int | None = None
    chat: bool = False
    echo: bool = False
    force: bool = False
    queries: str = "none"


@dataclass(frozen=True)
class ConvertOptions:
    """``kvsnap convert-gguf``'s options, typed."""

    gguf: str = ""
    out_dir: str = ""
    dtype: str | None = None  # None: fixtures.default_dtype()
    force: bool = False


DTYPE_HELP = "the weights' dtype (default: float16 where mlx has a GPU, float32 on its CPU build)"


@dataclass(frozen=True)
class FetchOptions:
    """``kvsnap fetch-models``' options, typed."""

    names: list[str] = field(default_factory=list)
    dtype: str | None = None  # None: fixtures.default_dtype()


def _convert(args: argparse.Namespace) -> int:
    from .convert import convert_gguf
    from .fixtures import default_dtype

    options = typed(ConvertOptions, args)
    dtype = options.dtype or default_dtype()
    out = convert_gguf(options.gguf, options.out_dir, dtype, overwrite=options.force)
    print(f"wrote mlx-lm model directory {out}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from .fixtures import MODELS, cache_dir, fetch_model

    options = typed(FetchOptions, args)
    for name in options.names or list(MODELS):
        path = fetch_model(name, options.dtype, check_hashes=True)
        print(f"{name}: {path}")
    print(f"cache: {cache_dir()}")
    return 0


def register(sub: Any) -> None:
    """Add the capture commands to the ``kvsnap`` argument parser."""
    from .convert import DTYPES
    from .fixtures import MODELS

    p = sub.add_parser("convert-gguf", help="convert a GGUF model (llama, gemma3) to an mlx-lm directory")
    p.add_argument("gguf")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=DTYPES, help=DTYPE_HELP)
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=_convert)

    p = sub.add_parser("fetch-models", help="download, verify and convert the fixture models (cached)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(MODELS)} (default: all)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help=DTYPE_HELP,
    )
    p.set_defaults(func=_fetch)

    register_capture(sub)
    extend_simulate(sub)
    register_bench(sub)


def register_bench(sub: Any) -> None:
    """``kvsnap bench compression``: every eviction method at kvpress's ratios on synthetic
    RULER-style tasks, end to end (`capture.compression_bench`)."""
    from .compression_bench import METHODS, RATIOS
    from .ruler import TASKS

    p = sub.add_parser("bench", help="benchmarks a researcher can cite: 'kvsnap bench compression'")
    p.add_argument(
        "suite", choices=["compression"], help="compression: KV-compression accuracy (RULER-style)"
    )
    p.add_argument("--model", default="smollm2-135m", help="mlx-lm model (default smollm2-135m, a fixture)")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="default: all four")
    p.add_argument("--samples", type=positive_int, default=2, help="samples per task (default 2)")
    p.add_argument("--tokens", type=positive_int, default=512, help="context tokens (default 512)")
    p.add_argument("--method", nargs="+", default=list(METHODS), help="default: kvpress's leaderboard's 12")
    p.add_argument(
        "--ratio",
        type=fraction,
        nargs="+",
        default=list(RATIOS),
        help="fractions evicted (default kvpress's)",
    )
    p.add_argument("--max-tokens", type=positive_int, default=16, help="answer tokens (default 16)")
    p.add_argument("--seed", type=int, default=0, help="the samples' seed (default 0)")
    p.add_argument(
        "-o", "--output", required=True, help="folder for accuracy.parquet, accuracy.png, samples.jsonl"
    )
    p.add_argument("--force", action="store_true", help="replace those three files if they exist")
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    import os
    import sys

    from mlx_lm import load

    from kvformat.io.outputs import check_output

    # mypy checks the analysis stage as the top-level package `analysis`: it cannot resolve this name.
    from kvsnap.analysis.attention.compression import EVICTION  # type: ignore[import-not-found]

    from . import compression_bench, ruler

    unknown = [m for m in args.method if m not in EVICTION]
    if unknown:
        raise CommandError(
            f"--method {unknown[0]}: end to end runs the eviction methods: {', '.join(EVICTION)}"
        )
    paths = compression_bench.outputs(args.output)
    if os.path.isdir(args.output):
        for path in paths.values():
            check_output(path, force=args.force)
    elif os.path.exists(args.output):
        raise CommandError(f"-o {args.output}: not a folder")
    elif not os.access(os.path.dirname(os.path.abspath(args.output)), os.W_OK | os.X_OK):
        raise CommandError(f"-o {args.output}: its parent folder is not writable")
    model_path = _resolve_model(args.model)
    model, tokenizer = _load(load, args.model, model_path)[:2]

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    samples = ruler.samples(count, args.tokens, args.samples, args.seed, tuple(args.tasks))
    runs = len(samples) * len(args.method) * len(args.ratio)
    done = [0]

    def progress(label: str) -> None:
        done[0] += 1
        print(f"bench compression: [{done[0]}/{runs}] {label}", file=sys.stderr, flush=True)

    rows = compression_bench.run(
        model, tokenizer, samples, args.method, args.ratio, args.max_tokens, progress=progress
    )
    os.makedirs(args.output, exist_ok=True)  # made only once there is something to put in it
    title = f"{args.model}: {len(samples)} samples of about {args.tokens} tokens"
    for line in compression_bench.save(rows, samples, paths, args.force, title):
        print(line)
    return 0


def extend_simulate(sub: Any) -> None:
    """``kvsnap simulate FILE --model M``: the end-to-end what-if (`capture.compressed`: what the
    model answers from the compressed cache) beside analysis's per-head one, which declares the
    command and its method options; without the analysis stage there is no ``simulate``."""
    parser = sub.choices.get("simulate")
    if parser is None:
        return
    group = parser.add_argument_group("end to end: decode from the compressed cache (with --model)")
    group.add_argument(
        "--model", help="the mlx-lm model the file was captured from (directory, .gguf or fixture name)"
    )
    group.add_argument("--question", default="", help="text read after the compressed span (uncompressed)")
    group.add_argument("--answer", help="the known answer: report whether each run's text contains it")
    group.add_argument(
        "--max-tokens", type=positive_int, default=32, help="answer tokens decoded greedily (default 32)"
    )
    per_head = parser.get_default("func")

    def simulate(args: argparse.Namespace) -> int:
        if args.model:
            return _simulate_model(args)
        given = [f"--{name}" for name in ("question", "answer") if getattr(args, name)]
        if given:
            raise CommandError(f"{given[0]} is for the end-to-end what-if: give --model too")
        return int(per_head(args))

    simulate.__name__ = simulate.__qualname__ = "simulate_command"
    parser.set_defaults(func=simulate)


def _simulate_model(args: argparse.Namespace) -> int:
    """``simulate --model``: one row per (method, budget), the full cache's first."""
    import sys
    import warnings

    import kvformat

    # mypy checks the analysis stage as the top-level package `analysis`: these names it cannot resolve.
    from kvsnap.analysis.attention import compression  # type: ignore[import-not-found]
    from kvsnap.analysis.commands.common import save_table  # type: ignore[import-not-found]
    from kvsnap.analysis.commands.simulation import SimulateOptions  # type: ignore[import-not-found]
    from kvsnap.analysis.dependencies import pl  # type: ignore[import-not-found]

    from .compressed import compressed_answers

    if args.plot:
        raise CommandError("--plot draws the per-head what-if: drop it with --model")
    options = SimulateOptions.from_args(args).compression()
    from mlx_lm import load

    model_path = _resolve_model(args.model)
    model, tokenizer = _load(load, args.model, model_path)[:2]
    with kvformat.open(args.file, args.snapshot) as snap, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", compression.CompressionWarning)
        end = options.span_end(snap)
        methods = args.method or [m for m in compression.available(snap, end) if m in compression.EVICTION]
        runs = len(methods) * len(args.budget)
        done = [0]

        def progress(label: str) -> None:
            done[0] += 1
            print(f"simulate: [{done[0]}/{runs}] {label}", file=sys.stderr, flush=True)

        answers = compressed_answers(
            model,
            tokenizer,
            snap,
            methods,
            args.budget,
            question=args.question,
            answer=args.answer,
            max_tokens=args.max_tokens,
            options=options,
            progress=progress,
        )
    for warning in caught:
        print(f"kvsnap: {warning.message}", file=sys.stderr)
    table = pl.DataFrame([answer.row() for answer in answers])
    save_table(table, args.output, args)
    print("method, budget -> KL(full || compressed) mean, top-1 agreement, greedy agreement, answer found")
    for a in answers:
        found = "" if a.answer_found is None else ("  found" if a.answer_found else "  missed")
        print(
            f"  {a.method:>18} {a.budget:5.3f} -> {a.kl_mean:8.4f} {a.top1_agreement:6.3f} "
            f"{a.greedy_agreement:6.3f}{found}  {a.text!r}"
        )
    return 0


def _resolve_model(spec: str) -> str:
    """A fixture name, a GGUF file (converted once into the cache) or an mlx-lm directory."""
    from pathlib import Path

    from .fixtures import MODELS, converted_gguf, fetch_model

    if spec in MODELS:
        return str(fetch_model(spec))
    path = Path(spec)
    if path.suffix == ".gguf" and path.is_file():
        return str(converted_gguf(path))
    if (path / "config.json").exists():
        return str(path)
    raise InvalidArgumentError(
        f"--model {spec!r}: not a fixture name ({', '.join(MODELS)}), .gguf file or model directory"
    )


def _load(load: Any, spec: str, model_path: str) -> Any:
    """``mlx_lm.load(model_path)``; a folder that does not load is named with its failing file
    (`ModelFolderError`) when one is found, else mlx-lm's own error stands."""
    from .errors import ModelFolderError
    from .model_folder import broken_file

    try:
        return load(model_path)
    except Exception:
        problem = broken_file(model_path)
        if problem is None:
            raise
        raise ModelFolderError(f"--model {spec}: the model does not load: {problem}") from None


def _capture(args: argparse.Namespace) -> int:
    import sys
    import time

    from mlx_lm import load

    from .generation import Capture, SnapshotEvent, generate

    options = typed(CaptureOptions, args)

    model_path = _resolve_model(options.model)
    loaded = _load(load, options.model, model_path)
    model, tokenizer = loaded[0], loaded[1]
    prompt = _prompt(options, tokenizer)
    at = _positions(options.at)
    extra, sampling = _sampling(options)
    events: list[SnapshotEvent] = []
    report = _reporter(options, events)
    start = time.perf_counter()
    count = 0
    progress = _progress_bar(options)
    capture = Capture(
        output=options.output,
        every=options.every,
        at=at,
        separate_files=options.separate_files,
        codec=options.codec,
        model_path=model_path,
        on_snapshot=report,
        metadata={"prompt": prompt, "generation": sampling},
        overwrite=options.force,
        queries=options.queries,
    )
    stream = generate(
        model,
        tokenizer,
        prompt,
        capture,
        max_tokens=options.max_tokens,
        max_kv_size=options.max_kv_size,
        **extra,
    )
    try:
        for response in stream:
            count += 1
            if options.echo:
                print(response.text, end="", flush=True)
            elif progress is not None:
                progress.update(1)
    except KeyboardInterrupt:
        stream.close()  # the capture's writer finishes what it has (or removes its partial file)
        if progress is not None:
            progress.close()
        print(file=sys.stderr)
        print(f"kvsnap: interrupted: {_written(options, events, count)}", file=sys.stderr)
        return 130
    if progress is not None:
        progress.close()
    _summary(options, len(events), count, time.perf_counter() - start)
    return 0


def _positions(text: str | None) -> list[int]:
    """``--at 12,40``: the generated-token counts to snapshot at (none without the option)."""
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def _progress_bar(options: CaptureOptions) -> Any:
    """A tqdm bar of generated tokens on stderr, gone once the capture ends; None with ``--echo``
    (the answer streams to the terminal instead)."""
    import sys

    from tqdm import tqdm

    return None if options.echo else tqdm(total=options.max_tokens, unit="tok", file=sys.stderr, leave=False)


def _reporter(options: CaptureOptions, events: list[Any]) -> Any:
    """The capture's ``on_snapshot``: each snapshot appended to ``events`` and told on stderr (a
    line between the streamed answer's words with ``--echo``, else above the progress bar)."""
    import sys

    def report(event: Any) -> None:
        events.append(event)
        message = (
            f"snapshot {len(events) - 1} after {event.generated} generated tokens "
            f"({event.cached_tokens} in cache) -> {event.path} ({event.size / 1e6:.2f} MB)"
        )
        if options.echo:
            print(f"\n[{message}]", file=sys.stderr, flush=True)
        else:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stderr)

    return report


def _prompt(options: CaptureOptions, tokenizer: Any) -> str:
    """``--prompt`` (or ``--prompt-file``'s text), in the model's chat template with ``--chat``."""
    from pathlib import Path

    if options.prompt is not None:
        prompt = options.prompt
    else:
        assert options.prompt_file is not None  # (the parser asks for one of the two)
        prompt = Path(options.prompt_file).read_text(encoding="utf-8")
    if not options.chat:
        return str(prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgumentError(
            f"--chat: {options.model} has no chat template (its tokenizer config, or the GGUF's "
            "tokenizer.chat_template, holds none); give the prompt as the model expects it, without --chat"
        )
    return str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    )


def _sampling(options: CaptureOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """mlx-lm's generation arguments from the sampling options (the sampler, KV quantization; the
    seed set), and the sampling settings as the file's metadata records them."""
    from mlx_lm.sample_utils import make_sampler

    extra: dict[str, Any] = {"sampler": make_sampler(options.temp, top_p=options.top_p)}
    if options.seed is not None:
        import mlx.core as mx

        mx.random.seed(options.seed)
    if options.kv_bits:
        extra.update(kv_bits=options.kv_bits, quantized_kv_start=0)
    return extra, {"temperature": options.temp, "top_p": options.top_p, "seed": options.seed}


def _summary(options: CaptureOptions, snapshots: int, count: int, elapsed: float) -> None:
    """The line a finished capture prints (after the streamed answer's newline with ``--echo``)."""
    from pathlib import Path

    if options.echo:
        print()
    if count and not options.separate_files:
        size = Path(options.output).stat().st_size
        print(
            f"wrote {options.output}: {snapshots} snapshot(s), {size / 1e6:.2f} MB, {count} tokens generated "
            f"({count / elapsed:.1f} tok/s)"
        )


def _written(options: CaptureOptions, events: list[Any], count: int) -> str:
    """What an interrupted capture left: the file and what it holds, or that nothing was written."""
    from pathlib import Path

    if options.separate_files:
        return f"{len(events)} snapshot file(s) written, {count} tokens generated"
    if Path(options.output).exists() and events:
        return f"wrote {options.output}: {len(events)} snapshot(s), {count} tokens generated"
    if Path(options.output + ".partial").exists():
        return f"{options.output}.partial left unfinished ({count} tokens generated): kvsnap recover it"
    return f"nothing written ({count} tokens generated, no snapshot taken)"


def codec_name(text: str) -> str:
    """argparse type: a codec the format knows."""
    from kvformat import codecs

    try:
        codecs.parse(text)
    except Exception as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def query_selection(text: str) -> str:
    """argparse type: a ``--queries`` selection (checked without importing mlx)."""
    name, _, value = text.partition(":")
    if name in ("none", "decode", "all") and not value:
        return text
    if name == "window" and value.isdigit() and int(value) >= 1:
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: choose none, decode, window:W (W >= 1) or all")


def model_folders(spec: str) -> list[str]:
    """The folders ``--model`` reads, found without loading or fetching anything: a model
    directory itself, and kvsnap's model cache (fixture models and converted GGUF files live
    there). Every file in them is an input of ``capture``."""
    import os

    from .fixtures import cache_dir

    folders = [str(cache_dir())]
    if os.path.isdir(spec):
        folders.append(spec)
    return folders


def _check_output(
    parser: argparse.ArgumentParser, output: str, force: bool, inputs: list[str], folders: list[str]
) -> None:
    """The output is allowed (`kvformat.io.outputs`: not existing unless ``force``, not an input,
    not inside a folder the command reads), its folder exists and is writable, and no unfinished
    write sits there."""
    import os
    from pathlib import Path

    from kvformat.io.outputs import check_output

    folder = Path(output).resolve().parent
    if not folder.is_dir():
        parser.error(f"-o {output}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"-o {output}: folder {folder} is not writable")
    try:
        check_output(output, inputs=inputs, force=force, input_folders=folders)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if Path(output + ".partial").exists():
        parser.error(f"-o {output}: {output}.partial exists (an unfinished capture): recover or delete it")


def register_capture(sub: Any) -> None:
    p = sub.add_parser("capture", help="generate with an mlx-lm model and save KV snapshots to .kv")
    p.add_argument("--model", required=True, help="mlx-lm model dir, a .gguf file, or a fixture name")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument("--prompt-file", help="a UTF-8 file holding the prompt")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens to generate (default 64)")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--every", type=positive_int, help="snapshot every N generated tokens")
    p.add_argument("--at", help="snapshot at these generated-token counts, e.g. 1,8,32")
    p.add_argument(
        "--separate-files",
        action="store_true",
        help="one file per snapshot (OUT-0000.kv, OUT-0001.kv, ...: numbered from 0)",
    )
    p.add_argument("--codec", type=codec_name, default="raw", help="raw, zstd or byteplane-zstd")
    p.add_argument(
        "--kv-bits", type=int, choices=(2, 4, 8), help="quantize the KV cache (mlx-lm QuantizedKVCache)"
    )
    p.add_argument(
        "--max-kv-size",
        type=positive_int,
        help="keep only the last N tokens (and the first 4) in every full-attention layer",
    )
    p.add_argument("--temp", type=non_negative_float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=fraction, default=0.0, help="nucleus sampling (0: off)")
    p.add_argument("--seed", type=int, help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--echo", action="store_true", help="print the generated text instead of a progress bar")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.add_argument(
        "--queries",
        type=query_selection,
        default="none",
        metavar="none|decode|window:W|all",
        help="also store post-RoPE queries (format 1.3): none (default), decode (generated positions), "
        "window:W (the last W prompt positions and every generated one), all",
    )
    p.set_defaults(func=_capture, check=_check_capture)


def _check_at(parser: argparse.ArgumentParser, at: str) -> None:
    """``--at``: comma-separated generated-token counts, each at least 1."""
    try:
        counts = [int(x) for x in at.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--at {at!r}: give generated-token counts like 1,8,32")
    if any(n < 1 for n in counts):
        parser.error(f"--at {at!r}: counts must be at least 1")


def _check_capture(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Checks that need no model: run before any weights are read."""
    options = typed(CaptureOptions, args)
    if options.queries != "none" and options.separate_files:
        parser.error("--queries stores queries in one series file: drop --separate-files")
    inputs = [name for name in (options.model, options.prompt_file) if name]
    _check_output(parser, options.output, options.force, inputs, model_folders(options.model))
    if options.at:
        _check_at(parser, options.at)
    if options.prompt_file is not None:
        from pathlib import Path

        if not Path(options.prompt_file).is_file():
            parser.error(f"--prompt-file {options.prompt_file}: no such file")
        data = Path(options.prompt_file).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            parser.error(
                f"--prompt-file {options.prompt_file}: not UTF-8 text (byte 0x{data[exc.start]:02x} at "
                f"offset {exc.start}); save it as UTF-8 (iconv -f latin1 -t utf-8, say)"
            )
