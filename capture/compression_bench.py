"""``kvsnap bench compression``: every eviction method at several compression ratios on synthetic
long-context tasks (`capture.ruler`), end to end (`capture.compressed`), as kvpress's leaderboard
runs RULER (``evaluation/leaderboard.sh``) but on a model this machine can run and with nothing
downloaded.

Each sample is tokenized as kvpress's pipeline does (``pipeline.py``,
``KVPressTextGenerationPipeline.preprocess``: the context in the chat template's user turn, cut
where the question goes; the question, the template's rest and the answer prefix after it), captured
once with every query (``--queries all``), then decoded from the full cache and from each method's
compressed one. A ratio ``r`` keeps ``int(n * (1 - r))`` of the context's ``n`` keys (kvpress's
``compression_ratio``). The score is RULER's ``string_match_all`` (`ruler.score`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import ruler

# The command's parser reads the defaults below: the model, kvformat and the analysis stage are
# imported when the benchmark runs, not with the parser.

RATIOS = (0.25, 0.5, 0.75, 0.875)
"""kvpress's leaderboard ratios: the fraction of the context's keys evicted."""
METHODS = (
    "random",
    "knorm",
    "snapkv",
    "expected_attention",
    "streaming",
    "tova",
    "observed",
    "pyramidkv",
    "lagkv",
    "keydiff",
    "adakv",
    "cur",
)
"""kvpress's leaderboard methods that a capture can run (``qfilter`` and ``kvzip`` cannot)."""


@dataclass(frozen=True)
class Tokenized:
    """A sample's ids as kvpress's pipeline forms them."""

    context: list[int]
    question: list[int]


def tokenize(tokenizer: Any, sample: ruler.Sample) -> Tokenized:
    """``KVPressTextGenerationPipeline.preprocess`` for one question: with a chat template the
    context goes in the user turn and the template's rest follows the question; without one, the
    BOS token starts the context and a newline follows the question."""
    context = sample.context
    if getattr(tokenizer, "chat_template", None) is None:
        context = (getattr(tokenizer, "bos_token", None) or "") + context
        suffix = "\n"
    else:
        separator = "#" * (len(context) + 10)
        templated = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + separator}], add_generation_prompt=True, tokenize=False
        )
        context, suffix = templated.split(separator)
    question = sample.question + suffix + sample.answer_prefix
    return Tokenized(
        list(tokenizer.encode(context, add_special_tokens=False)),
        list(tokenizer.encode(question, add_special_tokens=False)),
    )


def run(
    model: Any,
    tokenizer: Any,
    samples: Sequence[ruler.Sample],
    methods: Sequence[str] = METHODS,
    ratios: Sequence[float] = RATIOS,
    max_tokens: int = 16,
    folder: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per (sample, method, ratio), and one per sample for the full cache (ratio 0):
    ``task``, ``sample``, ``method``, ``ratio``, ``score``, ``kl_mean``, ``top1_agreement``,
    ``answer``. Captures go to ``folder`` (a temporary one by default)."""
    import kvformat

    # mypy checks the stage as the top-level package `analysis`, so it cannot resolve this name.
    from kvsnap.analysis.attention import compression  # type: ignore[import-not-found]

    from .compressed import compressed_answers
    from .generation import generate

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        where = Path(folder or scratch)
        for sample in samples:
            ids = tokenize(tokenizer, sample)
            path = where / f"{sample.task}-{sample.index}.kv"
            for _ in generate(
                model,
                tokenizer,
                ids.context + ids.question,
                max_tokens=1,
                output=path,
                queries="all",
                final=True,
                overwrite=True,
            ):
                pass
            n = len(ids.context)
            budgets = [max(1, int(n * (1 - r))) / n for r in ratios]
            with kvformat.open(path) as snap:
                answers = compressed_answers(
                    model,
                    tokenizer,
                    snap,
                    methods,
                    budgets,
                    max_tokens=max_tokens,
                    options=compression.Options(compress="context", question_start=n),
                    progress=_labelled(progress, f"{sample.task} {sample.index}"),
                )
            rows.append(_row(sample, "full", 0.0, answers[0], tokenizer))
            runs = iter(answers[1:])
            for method in methods:
                for ratio in ratios:
                    rows.append(_row(sample, method, ratio, next(runs), tokenizer))
    return rows


def _labelled(progress: Callable[[str], None] | None, prefix: str) -> Callable[[str], None] | None:
    """``progress`` with each label after ``prefix``."""
    if progress is None:
        return None
    report = progress
    return lambda label: report(f"{prefix}: {label}")


def _row(sample: ruler.Sample, method: str, ratio: float, answer: Any, tokenizer: Any) -> dict[str, Any]:
    text = tokenizer.decode(answer.tokens, skip_special_tokens=True)
    return {
        "task": sample.task,
        "sample": sample.index,
        "method": method,
        "ratio": ratio,
        "score": ruler.score(text, sample.answers),
        "kl_mean": answer.kl_mean,
        "top1_agreement": answer.top1_agreement,
        "answer": text,
    }


def outputs(folder: str) -> dict[str, str]:
    """The files the benchmark writes in ``folder``: the rows, the plot, the samples."""
    return {
        name: os.path.join(folder, name) for name in ("accuracy.parquet", "accuracy.png", "samples.jsonl")
    }


def save(
    rows: list[dict[str, Any]],
    samples: Sequence[ruler.Sample],
    paths: dict[str, str],
    force: bool,
    title: str,
) -> list[str]:
    """Write the rows (Parquet), the mean score per method and ratio (a plot) and the samples
    (JSON lines) to `outputs`' paths, each through a temporary name; returns the table as lines."""
    import json

    from kvformat.io import output_path

    # mypy checks the stage as the top-level package `analysis`, so it cannot resolve this name.
    from kvsnap.analysis.dependencies import matplotlib, pl, plt  # type: ignore[import-not-found]

    table = pl.DataFrame(rows)
    with (
        output_path(paths["samples.jsonl"], force=force) as temporary,
        open(temporary, "w", encoding="utf-8") as f,
    ):
        f.writelines(json.dumps(sample.to_json()) + "\n" for sample in samples)
    with output_path(paths["accuracy.parquet"], force=force) as temporary:
        table.write_parquet(temporary)
    accuracy = table.group_by(["method", "ratio"], maintain_order=True).agg(pl.col("score").mean())
    full = float(accuracy.filter(pl.col("method") == "full")["score"][0])
    methods = [m for m in accuracy["method"].unique(maintain_order=True).to_list() if m != "full"]
    matplotlib.use("Agg")
    figure, axis = plt.subplots(figsize=(7.6, 4.4))
    axis.axhline(full, color="black", linestyle=":", label="full cache")
    palette = plt.get_cmap("tab20")
    lines = [f"full cache: {full:.3f}", "method, then the mean score at each ratio"]
    for i, method in enumerate(methods):
        of = accuracy.filter(pl.col("method") == method).sort("ratio")
        ratios, scores = of["ratio"].to_list(), of["score"].to_list()
        axis.plot(ratios, scores, marker="osD^v<>"[i % 7], color=palette(i % 20), label=method)
        lines.append(
            f"{method:>20}" + "".join(f"  {r:g}: {s:.3f}" for r, s in zip(ratios, scores, strict=True))
        )
    axis.set_xlabel("compression ratio (fraction of the context's keys evicted)")
    axis.set_ylabel("score (RULER string_match_all)")
    axis.set_ylim(-0.02, 1.02)
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    figure.tight_layout()
    with output_path(paths["accuracy.png"], force=force) as temporary:
        figure.savefig(temporary, dpi=110, format="png")
    plt.close(figure)
    return [*lines, f"wrote {', '.join(paths.values())}"]
