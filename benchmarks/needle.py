"""Head importance on a real capture: SmolLM2-135M reads a long context with a random
number hidden in it, then is asked for the number; its queries are saved (``queries="all"``), and
the file is analysed offline: which heads score highest on ``retrieval_score`` (over the number's
positions) and ``sink_mass``, and what each KV-compression method would have cost at budgets
0.1 / 0.25 / 0.5 (`kvsnap simulate`). Also times the ``attention`` group against the ``spectrum``
group on the same file, in the same run.

    python -m benchmarks.needle [--out DIR] [--filler N] [--queries all|window:W]

``--filler 116 --queries window:64`` gives the issue's 8192-token case (an 8,175-token prompt;
``--filler 110``: 7,755 tokens).

Writes DIR/needle.kv, DIR/attention.parquet, DIR/simulate.parquet and DIR/simulate.png.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

FILLER = (
    "The river town kept its records in a stone hall by the bridge. Merchants came in spring with "
    "wool and salt, and the clerks wrote down every cart that crossed. "
)


def _span(ids: list[int], needle: list[int]) -> tuple[int, int]:
    for start in range(len(ids) - len(needle) + 1):
        if ids[start : start + len(needle)] == needle:
            return start, start + len(needle)
    raise ValueError("the needle's tokens are not in the prompt as tokenized")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/needle", help="folder for the files written")
    parser.add_argument("--filler", type=int, default=12, help="filler paragraphs on each side of the needle")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--queries", default="all", help="queries to capture: all (default), decode or window:W"
    )
    args = parser.parse_args()

    from mlx_lm import load

    import kvsnap

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    number = str(random.Random(args.seed).randrange(10_000, 100_000))
    context = FILLER * args.filler + f"The secret number is {number}. " + FILLER * args.filler
    model, tokenizer = load(str(kvsnap.fetch_model("smollm2-135m")))
    messages = [
        {"role": "user", "content": context + "\nWhat is the secret number? Answer with the number only."}
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(prompt)
    digits = tokenizer.encode(f" {number}")
    try:
        needle = _span(ids, digits)
    except ValueError:
        needle = _span(ids, tokenizer.encode(number))
    path = out / "needle.kv"
    text = "".join(
        r.text
        for r in kvsnap.generate(
            model,
            tokenizer,
            ids,
            max_tokens=12,
            output=path,
            overwrite=True,
            queries=args.queries,
            final=True,
        )
    )
    print(f"prompt {len(ids)} tokens, the number {number} at positions {needle[0]}..{needle[1] - 1}")
    print(f"answer: {text.strip()!r}")

    started = time.perf_counter()
    heads = kvsnap.attention_stats(path, needle=needle)
    attention_seconds = time.perf_counter() - started
    started = time.perf_counter()
    kvsnap.head_stats([str(path)], stats="spectrum")
    spectrum_seconds = time.perf_counter() - started
    heads.write_parquet(out / "attention.parquet")
    for column in ("retrieval_score", "sink_mass"):
        ranked = heads.filter(heads[column].is_not_nan()).sort(column, descending=True).head(5)
        cells = ", ".join(
            f"layer {r['layer']} head {r['head']} {r[column]:.2f}" for r in ranked.iter_rows(named=True)
        )
        print(f"highest {column}: {cells}")
    events = int(heads["retrieval_events"].max())
    print(f"retrieval events (generated tokens copying the needle): {events}")
    print(
        f"attention group {attention_seconds:.2f} s, spectrum group {spectrum_seconds:.2f} s "
        "(same file, same run)"
    )

    table = kvsnap.simulate(path)
    table.write_parquet(out / "simulate.parquet")
    import polars as pl

    means = (
        table.group_by(["method", "budget"])
        .agg(pl.col("relative_error").mean().alias("error"), pl.col("top1_agreement").mean().alias("top1"))
        .sort(["method", "budget"])
    )
    print("| method | budget | mean relative error | top-1 agreement |")
    print("|---|---:|---:|---:|")
    for row in means.iter_rows(named=True):
        print(f"| {row['method']} | {row['budget']:.3f} | {row['error']:.4f} | {row['top1']:.3f} |")
    from kvsnap.cli import main as kvsnap_main

    kvsnap_main(
        [
            "simulate",
            str(path),
            "-o",
            str(out / "simulate-cli.parquet"),
            "--plot",
            str(out / "simulate.png"),
            "--force",
        ]
    )


if __name__ == "__main__":
    main()
