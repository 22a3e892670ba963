"""``kvsnap`` subcommands of the capture stage (registered through the ``kvsnap.commands``
entry point): convert-gguf, fetch-models, capture."""

from __future__ import annotations

import argparse
from typing import Any

from kvsnap.cli.options import fraction, non_negative_float, positive_int


def _convert(args: argparse.Namespace) -> int:
    from .convert import convert_gguf

    out = convert_gguf(args.gguf, args.out_dir, args.dtype, overwrite=args.force)
    print(f"wrote mlx-lm model directory {out}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from .fixtures import MODELS, cache_dir, fetch_model

    for name in args.names or list(MODELS):
        path = fetch_model(name, args.dtype)
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
    p.add_argument("--dtype", choices=DTYPES, default="float16")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=_convert)

    p = sub.add_parser("fetch-models", help="download, verify and convert the fixture models (cached)")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(MODELS)} (default: all)")
    p.add_argument("--dtype", choices=DTYPES, default="float16")
    p.set_defaults(func=_fetch)

    register_capture(sub)


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
    raise ValueError(
        f"--model {spec!r}: not a fixture name ({', '.join(MODELS)}), .gguf file or model directory"
    )


def _capture(args: argparse.Namespace) -> int:
    import sys
    import time

    from mlx_lm import load

    from .generate import SnapshotEvent, generate

    model_path = _resolve_model(args.model)
    loaded = load(model_path)
    model, tokenizer = loaded[0], loaded[1]
    prompt = _prompt(args, tokenizer)
    at = _positions(args.at)
    extra, sampling = _sampling(args)
    events: list[SnapshotEvent] = []
    report = _reporter(args, events)
    start = time.perf_counter()
    count = 0
    progress = _progress_bar(args)
    stream = generate(
        model,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        output=args.output,
        every=args.every,
        at=at,
        separate_files=args.separate_files,
        codec=args.codec,
        model_path=model_path,
        max_kv_size=args.max_kv_size,
        on_snapshot=report,
        metadata={"prompt": prompt, "generation": sampling},
        overwrite=args.force,
        queries=args.queries,
        **extra,
    )
    try:
        for response in stream:
            count += 1
            if args.echo:
                print(response.text, end="", flush=True)
            elif progress is not None:
                progress.update(1)
    except KeyboardInterrupt:
        stream.close()  # the capture's writer finishes what it has (or removes its partial file)
        if progress is not None:
            progress.close()
        print(file=sys.stderr)
        print(f"kvsnap: interrupted: {_written(args, events, count)}", file=sys.stderr)
        return 130
    if progress is not None:
        progress.close()
    _summary(args, len(events), count, time.perf_counter() - start)
    return 0


def _positions(text: str | None) -> list[int]:
    """``--at 12,40``: the generated-token counts to snapshot at (none without the option)."""
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def _progress_bar(args: argparse.Namespace) -> Any:
    """A tqdm bar of generated tokens on stderr, gone once the capture ends; None with ``--echo``
    (the answer streams to the terminal instead)."""
    import sys

    from tqdm import tqdm

    return None if args.echo else tqdm(total=args.max_tokens, unit="tok", file=sys.stderr, leave=False)


def _reporter(args: argparse.Namespace, events: list[Any]) -> Any:
    """The capture's ``on_snapshot``: each snapshot appended to ``events`` and told on stderr (a
    line between the streamed answer's words with ``--echo``, else above the progress bar)."""
    import sys

    def report(event: Any) -> None:
        events.append(event)
        message = (
            f"snapshot {len(events) - 1} after {event.generated} generated tokens "
            f"({event.cached_tokens} in cache) -> {event.path} ({event.size / 1e6:.2f} MB)"
        )
        if args.echo:
            print(f"\n[{message}]", file=sys.stderr, flush=True)
        else:
            from tqdm import tqdm

            tqdm.write(message, file=sys.stderr)

    return report


def _prompt(args: argparse.Namespace, tokenizer: Any) -> str:
    """``--prompt`` (or ``--prompt-file``'s text), in the model's chat template with ``--chat``."""
    from pathlib import Path

    prompt = args.prompt if args.prompt is not None else Path(args.prompt_file).read_text(encoding="utf-8")
    if not args.chat:
        return str(prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"--chat: {args.model} has no chat template (its tokenizer config, or the GGUF's "
            "tokenizer.chat_template, holds none); give the prompt as the model expects it, without --chat"
        )
    return str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    )


def _sampling(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """mlx-lm's generation arguments from the sampling options (the sampler, KV quantization; the
    seed set), and the sampling settings as the file's metadata records them."""
    from mlx_lm.sample_utils import make_sampler

    extra: dict[str, Any] = {"sampler": make_sampler(args.temp, top_p=args.top_p)}
    if args.seed is not None:
        import mlx.core as mx

        mx.random.seed(args.seed)
    if args.kv_bits:
        extra.update(kv_bits=args.kv_bits, quantized_kv_start=0)
    return extra, {"temperature": args.temp, "top_p": args.top_p, "seed": args.seed}


def _summary(args: argparse.Namespace, snapshots: int, count: int, elapsed: float) -> None:
    """The line a finished capture prints (after the streamed answer's newline with ``--echo``)."""
    from pathlib import Path

    if args.echo:
        print()
    if count and not args.separate_files:
        size = Path(args.output).stat().st_size
        print(
            f"wrote {args.output}: {snapshots} snapshot(s), {size / 1e6:.2f} MB, {count} tokens generated "
            f"({count / elapsed:.1f} tok/s)"
        )


def _written(args: argparse.Namespace, events: list[Any], count: int) -> str:
    """What an interrupted capture left: the file and what it holds, or that nothing was written."""
    from pathlib import Path

    if args.separate_files:
        return f"{len(events)} snapshot file(s) written, {count} tokens generated"
    if Path(args.output).exists() and events:
        return f"wrote {args.output}: {len(events)} snapshot(s), {count} tokens generated"
    if Path(args.output + ".partial").exists():
        return f"{args.output}.partial left unfinished ({count} tokens generated): kvsnap recover it"
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


def _check_output(parser: argparse.ArgumentParser, output: str, force: bool, inputs: list[str]) -> None:
    """The output is allowed (`kvformat.io.outputs`: not existing unless ``force``, not an input),
    its folder exists and is writable, and no unfinished write sits there."""
    import os
    from pathlib import Path

    from kvformat.io.outputs import check_output

    folder = Path(output).resolve().parent
    if not folder.is_dir():
        parser.error(f"-o {output}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"-o {output}: folder {folder} is not writable")
    try:
        check_output(output, inputs=inputs, force=force)
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
    if args.queries != "none" and args.separate_files:
        parser.error("--queries stores queries in one series file: drop --separate-files")
    inputs = [name for name in (args.model, args.prompt_file) if name]
    _check_output(parser, args.output, args.force, inputs)
    if args.at:
        _check_at(parser, args.at)
    if args.prompt_file is not None:
        from pathlib import Path

        if not Path(args.prompt_file).is_file():
            parser.error(f"--prompt-file {args.prompt_file}: no such file")
