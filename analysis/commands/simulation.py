"""`kvsnap simulate`: attention-output error per head had the cache been compressed, table and plot."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from typing import Any

from kvsnap.errors import OptionsConflictError

from ..attention.compression import CompressionWarning, Options, simulate
from ..dependencies import matplotlib, pl, plt
from .common import FromArgs, save_figure, save_table, url_options, warnings_printed


@dataclass(frozen=True)
class SimulateOptions(FromArgs):
    """``kvsnap simulate``'s options, typed (`from_args`)."""

    file: str = ""
    method: list[str] | None = None
    budget: list[float] = field(default_factory=lambda: [0.1, 0.25, 0.5])
    snapshot: int = -1
    window: int | None = None
    kernel: int = 5
    pooling: str = "avg"
    compress: str = "prompt"
    question_start: int | None = None
    seed: int = 0
    lag: int = 128
    adakv_scorer: str = "snapkv"
    output: str = ""
    plot: str | None = None
    jobs: int | None = None
    force: bool = False

    def compression(self) -> Options:
        """How the keys are chosen, as `compression.Options`."""
        return Options(
            window=self.window,
            kernel=self.kernel,
            pooling=self.pooling,
            compress=self.compress,
            question_start=self.question_start,
            seed=self.seed,
            lag=self.lag,
            adakv_scorer=self.adakv_scorer,
        )


def simulate_command(args: argparse.Namespace) -> int:
    """``simulate``: attention-output error per (method, budget, layer, head) under compression."""
    options = SimulateOptions.from_args(args)
    if options.compress == "context" and options.question_start is None:
        raise OptionsConflictError(
            "--compress context needs --question-start P: the position where the question begins"
        )

    with warnings_printed(CompressionWarning):
        table = simulate(
            options.file,
            options.method,
            options.budget,
            options.snapshot,
            **asdict(options.compression()),
            progress=True,
            storage_options=url_options(args),
            workers=options.jobs,
        )
    save_table(table, options.output, args)

    means = (
        table.group_by(["method", "budget"], maintain_order=True)
        .agg(
            pl.col("relative_error").mean().alias("error"),
            pl.col("top1_agreement").mean().alias("top1"),
            pl.col("keys_evicted").max().alias("evicted"),
        )
        .sort(["method", "budget"])
    )
    print("mean over heads: method, budget -> relative error of the attention output, top-1 agreement")
    for row in means.iter_rows(named=True):
        trivial = "  (nothing evicted: exact by construction)" if row["evicted"] == 0 else ""
        print(f"  {row['method']:>9} {row['budget']:5.3f} -> {row['error']:.4f}  {row['top1']:.3f}{trivial}")
    if options.plot:
        _simulate_plot(means, options, args)
        print(f"wrote {options.plot}")
    return 0


def _simulate_plot(means: Any, options: SimulateOptions, args: argparse.Namespace) -> None:

    matplotlib.use("Agg")

    figure, axis = plt.subplots(figsize=(7.6, 4.4))
    methods = means["method"].unique(maintain_order=True).to_list()
    palette = plt.get_cmap("tab20")
    colours = [palette(i) for i in range(20)]  # 20 distinct colours; markers tell the rest apart
    for i, method in enumerate(methods):
        rows = means.filter(means["method"] == method).sort("budget")
        axis.plot(
            rows["budget"].to_list(),
            rows["error"].to_list(),
            marker="osD^v<>"[i % 7],
            color=colours[(2 * i) % 20 + (i // 10) % 2],
            label=method,
        )
    axis.set_xlabel("budget (fraction of prompt keys kept; bits/16 for quantization)")
    axis.set_ylabel("relative error of the attention output")
    axis.set_yscale("log")
    axis.set_title(f"{options.file}: KV compression what-ifs (mean over heads)", fontsize=9)
    axis.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    figure.tight_layout()
    assert options.plot is not None  # (drawn for --plot only)
    save_figure(figure, options.plot, args)
    plt.close(figure)
