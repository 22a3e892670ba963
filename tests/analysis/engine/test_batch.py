"""Many files: glob patterns and URLs, per-file failures, --fail-fast, merging across files, and the
Ray engine (local mode, 2 CPUs) giving the same table as local processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

import kvformat
from kvsnap.analysis.engine.batch import expand_paths, head_stats, merged_stats, run_stats
from kvsnap.cli import main
from tests.factories import random_file
from tests.servers import moto_s3, nginx

LAYERS, HEADS, DIM = 3, 2, 16


def write_run(path: Path, seed: int, tokens: int, seqs: int = 1) -> list[np.ndarray]:
    """A snapshot of ``seqs`` sequences; returns K per (layer, head) with all sequences stacked."""
    made = random_file(
        path,
        layers=LAYERS,
        heads=HEADS,
        tokens=tokens,
        dim=DIM,
        seqs=seqs,
        seed=seed,
        layer_scale=True,
        metadata={"seed": seed},
        chunk_bytes=700,
    )
    return made.keys_by_head()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for i, tokens in enumerate((40, 57, 33)):
        write_run(root / f"run{i}.kv", seed=i, tokens=tokens)
    good = (root / "run1.kv").read_bytes()
    (root / "run3-broken.kv").write_bytes(good[: len(good) - 10])
    return root


def good_files(runs: Path) -> list[str]:
    return [str(runs / f"run{i}.kv") for i in range(3)]


def test_patterns_expand_in_order_and_unmatched_ones_are_errors(runs: Path) -> None:
    assert expand_paths([str(runs / "run[12].kv"), str(runs / "run0.kv")]) == [
        str(runs / "run1.kv"),
        str(runs / "run2.kv"),
        str(runs / "run0.kv"),
    ]
    with pytest.raises(FileNotFoundError, match="no file matches"):
        expand_paths([str(runs / "*.nothing")])


def test_local_engine_collects_failures_by_file(runs: Path) -> None:
    result = run_stats(str(runs / "*.kv"))
    assert result.files == 4
    assert [f.file for f in result.failures] == [str(runs / "run3-broken.kv")]
    assert result.failures[0].error.startswith("TruncatedFileError: ")
    assert result.table.equals(head_stats(good_files(runs)))
    assert result.table.height == 3 * LAYERS * HEADS * 2
    with pytest.raises(kvformat.TruncatedFileError):
        run_stats(str(runs / "*.kv"), fail_fast=True)


def test_processes_give_the_same_table(runs: Path) -> None:
    serial = run_stats(str(runs / "*.kv"))
    parallel = run_stats(str(runs / "*.kv"), jobs=2)
    assert parallel.table.equals(serial.table)
    assert parallel.failures == serial.failures


def test_files_split_into_parts_of_their_layers_give_the_whole_files_table(runs: Path) -> None:
    """With a file or more per core, a CPU batch hands each file out as parts (contiguous shares
    of its layers, `PassOptions.part`) so the last files end together on every core: the table
    is the one of whole files, row for row, and a broken file is one failure however many parts
    it was split into."""
    from kvsnap.analysis.engine.batch import BatchOptions
    from kvsnap.analysis.engine.plan import PassOptions, file_parts, layers_of_part
    from kvsnap.analysis.engine.tables import file_table

    one = BatchOptions(jobs=2).plan(["f"] * 4).options
    assert one.workers == 1 and file_parts(4, 2, one) == 4  # 8 tasks per process, 2 processes
    assert file_parts(50, 16, one) == 3 and file_parts(500, 16, one) == 1 and file_parts(4, 16, one) == 8
    assert file_parts(4, 1, one) == 1  # one core: nothing to balance
    two = BatchOptions(jobs=16).plan(["f"] * 2).options
    assert file_parts(2, 16, two) == 1  # each file on 8 workers already
    layers = {layer: None for layer in (0, 1, 2, 4, 5, 7, 9)}  # present layers, with gaps
    for count in (1, 2, 3, 7, 9):
        shares = [list(layers_of_part(layers, (i, count))) for i in range(count)]
        assert [layer for share in shares for layer in share] == list(layers)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    for wrong in ((2, 2), (-1, 2), (0,), 3, (0.0, 1)):
        with pytest.raises(ValueError, match="part must be"):
            PassOptions(part=wrong)  # type: ignore[arg-type]
    assert head_stats(good_files(runs), jobs=2).equals(head_stats(good_files(runs), jobs=1))  # the API too
    merged = merged_stats(good_files(runs), jobs=2).table  # --merge: parts' accumulators joined
    assert merged.equals(merged_stats(good_files(runs), jobs=1).table)
    split = run_stats(str(runs / "*.kv"), jobs=2)  # 4 files on 2 cores: 4 parts each
    whole = run_stats(str(runs / "*.kv"), jobs=1)
    assert split.table.equals(whole.table)
    assert split.failures == whole.failures and len(split.failures) == 1
    path = good_files(runs)[1]  # one part's rows are its layers' rows of the whole file
    halves = [pl.from_arrow(file_table(path, PassOptions(part=(index, 2)))) for index in range(2)]
    assert [sorted(set(half["layer"].to_list())) for half in halves] == [[0], [1, 2]]
    assert pl.concat(halves).equals(head_stats([path], jobs=1))


def test_one_options_object_or_its_fields_as_keywords(runs: Path) -> None:
    from kvsnap.analysis.engine.batch import BatchOptions

    options = BatchOptions(jobs=2, stats="norms", snapshot=-1)
    assert options.stats == frozenset({"norms"})
    by_object = run_stats(str(runs / "*.kv"), options)
    by_keywords = run_stats(str(runs / "*.kv"), jobs=2, stats=["norms"])
    assert by_object.table.equals(by_keywords.table)
    assert "norm_mean" in by_object.table.columns and "eigenvalues" not in by_object.table.columns
    merged_norms = merged_stats(good_files(runs), options).table  # no Gram matrix held or merged
    assert set(merged_norms["n_files"].to_list()) == {3} and "eigenvalues" not in merged_norms.columns
    overridden = merged_stats(good_files(runs), options, stats="spectrum").table
    assert "eigenvalues" in overridden.columns and "norm_mean" not in overridden.columns
    with pytest.raises(TypeError, match="unknown batch option 'job'; known: engine, jobs"):
        run_stats(str(runs / "*.kv"), job=2)
    with pytest.raises(ValueError, match="engine must be 'local' or 'ray', not 'spark'"):
        merged_stats(str(runs / "*.kv"), engine="spark")
    with pytest.raises(ValueError, match="jobs must be a positive integer, not 0"):
        BatchOptions(jobs=0)
    with pytest.raises(ValueError, match="unknown statistic group 'norm'"):
        BatchOptions(stats="norm")
    plan = BatchOptions(jobs=4, keys="pre_rope").plan(["a", "b"])
    per_file = plan.options
    assert (plan.workers, per_file.workers, per_file.keys, per_file.progress) == (2, 2, "pre_rope", False)


def test_mlx_batches_give_each_device_process_whole_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """On mlx, a batch with at least as many files as device processes runs files in parallel, a
    whole file in each process, its pass's copy and row threads a share of the machine's; with
    fewer files, one file after another, each on every worker."""
    from kvsnap.analysis.engine.batch import BatchOptions
    from kvsnap.analysis.kernels import mlx_sizing

    monkeypatch.setattr(mlx_sizing, "processes", lambda workers: workers * 3 // 4)
    plan = BatchOptions(jobs=16, backend="mlx").plan(["f"] * 50)
    assert (plan.workers, plan.options.workers, plan.options.device_share, plan.parts) == (12, 1, 12, 1)
    plan = BatchOptions(jobs=16, backend="mlx").plan(["f"] * 11)
    assert (plan.workers, plan.options.workers, plan.options.device_share) == (1, 16, 1)
    plan = BatchOptions(jobs=1, backend="mlx").plan(["f"] * 50)  # one device process
    assert (plan.workers, plan.options.workers, plan.options.device_share) == (1, 1, 1)
    assert mlx_sizing.copy_threads(12) == 1 and mlx_sizing.row_threads(12) == 1
    from kvsnap.analysis.engine.plan import PassOptions

    with pytest.raises(ValueError, match="device_share must be a positive integer, not 0"):
        PassOptions(backend="mlx", device_share=0)


def test_mlx_batch_in_device_processes_gives_the_one_process_table(
    runs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three files over three processes that each drive mlx with whole files: the table of the
    same batch in one process, file for file."""
    pytest.importorskip("mlx.core")
    from kvsnap.analysis.kernels import mlx_sizing

    monkeypatch.setattr(mlx_sizing, "processes", lambda workers: min(workers, 3))
    serial = run_stats(good_files(runs), jobs=1, backend="mlx")
    spread = run_stats(good_files(runs), jobs=3, backend="mlx")
    assert not serial.failures and not spread.failures
    assert spread.table.equals(serial.table)


SCALARS = ("n_tokens", "norm_mean", "norm_std", "norm_max", "norm_sq_mean", "anisotropy", "effective_rank")


def test_merging_equals_statistics_of_the_pooled_tokens(runs: Path, tmp_path: Path) -> None:
    merged = merged_stats(good_files(runs)).table
    assert merged.height == LAYERS * HEADS * 2 and set(merged["n_files"].to_list()) == {3}
    # The same tokens as one file of three sequences (equal lengths), merged over its sequences.
    pooled_keys = write_run(tmp_path / "pooled.kv", seed=9, tokens=20, seqs=3)
    pooled = merged_stats([str(tmp_path / "pooled.kv")]).table
    # Reference: numpy on the pooled K of layer 2 head 1 (all three sequences).
    k = pooled_keys[2 * HEADS + 1].astype(np.float64)
    row = pooled.filter((pl.col("layer") == 2) & (pl.col("head") == 1) & (pl.col("tensor") == "k")).row(
        0, named=True
    )
    norms = np.linalg.norm(k, axis=1)
    assert row["n_tokens"] == 60
    assert row["norm_mean"] == pytest.approx(norms.mean(), rel=1e-9)
    assert row["norm_max"] == pytest.approx(norms.max(), rel=1e-6)
    np.testing.assert_allclose(row["channel_var"], k.var(axis=0), rtol=1e-7, atol=1e-9)
    # Merging files equals merging the per-file rows' underlying sums: n_tokens add up.
    separate = head_stats(good_files(runs)).filter(pl.col("tensor") == "k")
    totals = separate.group_by("layer", "head").agg(pl.col("n_tokens").sum()).sort("layer", "head")
    ks = merged.filter(pl.col("tensor") == "k").sort("layer", "head")
    assert ks["n_tokens"].to_list() == totals["n_tokens"].to_list() == [130] * (LAYERS * HEADS)
    weighted = separate.group_by("layer", "head").agg(
        (pl.col("norm_mean") * pl.col("n_tokens")).sum() / pl.col("n_tokens").sum()
    )
    joined = ks.join(weighted, on=["layer", "head"], suffix="_expected")
    np.testing.assert_allclose(joined["norm_mean"], joined["norm_mean_expected"], rtol=1e-12)


def test_merging_reports_files_of_another_layout(runs: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.kv"
    rng = np.random.default_rng(0)
    narrow = rng.standard_normal((HEADS, 5, 8), np.float32)
    kvformat.save(other, [kvformat.Layer(narrow, narrow)] * LAYERS)
    result = merged_stats([*good_files(runs), str(other), str(runs / "run3-broken.kv")])
    assert [f.file for f in result.failures] == [str(other), str(runs / "run3-broken.kv")]
    assert "8 channels" in result.failures[0].error
    assert set(result.table["n_files"].to_list()) == {3}


@pytest.mark.ray
def test_ray(runs: Path, tmp_path: Path) -> None:
    """Every Ray check on one local cluster: starting one costs this machine more than all the
    checks together, so they share it (one test: test workers never split it)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        _the_ray_executor_gives_the_results_in_order_and_the_tasks_own_errors(tmp_path)
        _the_ray_engine_gives_the_local_table(runs)
        _read_kv_is_a_ray_dataset_of_statistic_rows(runs)
    finally:
        ray.shutdown()


def _the_ray_executor_gives_the_results_in_order_and_the_tasks_own_errors(tmp_path: Path) -> None:
    from kvsnap.analysis.engine import executors
    from tests.analysis.engine.test_executors import fail_on_three, square

    executor = executors.make("ray", 2)
    assert isinstance(executor, executors.Ray) and executor.workers == 2
    assert list(executor.map(square, range(10))) == [x * x for x in range(10)]
    with pytest.raises(KeyError, match="item 3"):  # not Ray's wrapper
        list(executor.map(fail_on_three, range(6)))
    random_file(tmp_path / "a.kv", layers=2, heads=2, tokens=40, dim=8)
    random_file(tmp_path / "b.kv", layers=3, heads=2, tokens=30, dim=8)
    tables: list[Any] = []
    on_ray = run_stats(str(tmp_path / "*.kv"), engine="ray", sink=tables.append)
    assert on_ray.table.equals(run_stats(str(tmp_path / "*.kv"), jobs=1).table)
    assert len(tables) == 2  # one per file, as each finishes


def _the_ray_engine_gives_the_local_table(runs: Path) -> None:
    local = run_stats(str(runs / "*.kv"), jobs=2)
    on_ray = run_stats(str(runs / "*.kv"), engine="ray")
    assert on_ray.table.equals(local.table)
    assert on_ray.failures == local.failures
    with pytest.raises(kvformat.TruncatedFileError, match=r"run3-broken\.kv") as failed:
        run_stats(str(runs / "*.kv"), engine="ray", fail_fast=True)
    assert "ray" not in type(failed.value).__module__  # the file's error, not Ray's wrapper
    merged_local = merged_stats(good_files(runs))
    merged_ray = merged_stats(good_files(runs), engine="ray")
    assert merged_ray.table.equals(merged_local.table)


def _read_kv_is_a_ray_dataset_of_statistic_rows(runs: Path) -> None:
    import ray

    from kvsnap.analysis.engine.ray import read_kv

    dataset = read_kv(good_files(runs))
    assert dataset.count() == 3 * LAYERS * HEADS * 2
    assert {"file", "layer", "head", "tensor", "norm_mean", "eigenvalues"} <= set(dataset.columns())
    with pytest.raises(ray.exceptions.RayError, match=r"run3-broken\.kv"):
        read_kv([str(runs / "run3-broken.kv")]).materialize()


def test_cli_reports_failures_and_writes_the_rest(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "stats.parquet"
    assert main(["stats", str(runs / "*.kv"), "-o", str(out), "--jobs", "2"]) == 1
    captured = capsys.readouterr()
    assert "failed: " + str(runs / "run3-broken.kv") + ": TruncatedFileError" in captured.err
    assert "1 of 4 files failed" in captured.err
    assert pl.read_parquet(out).height == 3 * LAYERS * HEADS * 2
    assert main(["stats", str(runs / "*.kv"), "--fail-fast"]) == 2
    assert "TruncatedFileError: " + str(runs / "run3-broken.kv") in capsys.readouterr().err
    assert main(["stats", *good_files(runs), "--merge", "-o", str(out)]) == 2  # exists
    assert "exists; replace it with --force" in capsys.readouterr().err
    assert main(["stats", *good_files(runs), "--merge", "-o", str(out), "--force"]) == 0
    assert "over 3 files" in capsys.readouterr().out
    assert pl.read_parquet(out).height == LAYERS * HEADS * 2


def test_cli_writes_the_rows_as_files_finish_and_exactly_the_rows(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvsnap stats FILES -o out.parquet`` writes each file's rows as it finishes (a row group
    each, in file order), and the file holds exactly the rows of the files that worked: in one
    process a file that fails in its last layer has written its first layers already; those are
    not left in the output."""
    import pyarrow.parquet as pq

    expected = run_stats(good_files(runs), jobs=1).table
    for jobs in ("1", "2"):
        out = tmp_path / f"stats-{jobs}.parquet"
        assert main(["stats", *good_files(runs), "-o", str(out), "--jobs", jobs]) == 0
        assert pl.read_parquet(out).equals(expected)
        assert pq.ParquetFile(out).metadata.num_row_groups > 1  # written a table at a time
    late = tmp_path / "late.kv"
    shutil.copy(runs / "run2.kv", late)
    with kvformat.open(late) as snap:  # a byte of the last layer's last chunk flipped
        last = max((s for s in snap.segments() if s.layer == LAYERS - 1), key=lambda s: s.v_chunk)
        offset = snap._file.chunk(last.v_chunk).payload_offset + 1
    data = bytearray(late.read_bytes())
    data[offset] ^= 0xFF
    late.write_bytes(bytes(data))
    out = tmp_path / "partial.parquet"
    assert main(["stats", *good_files(runs)[:2], str(late), "-o", str(out), "--jobs", "1"]) == 1
    assert "ChecksumError" in capsys.readouterr().err
    assert pl.read_parquet(out).equals(run_stats(good_files(runs)[:2], jobs=1).table)
    assert main(["stats", str(late), "-o", str(tmp_path / "none.parquet")]) == 1  # nothing worked
    err = capsys.readouterr().err.strip().splitlines()  # the one file's failure: one line
    assert len(err) == 1 and err[0].startswith("kvsnap: error: ChecksumError: ") and str(late) in err[0]
    assert not (tmp_path / "none.parquet").exists()
    assert not (tmp_path / "none.parquet").exists() and not list(tmp_path.glob(".tmp-*"))


def test_parquet_sink_rewrites_what_it_cannot_stream(tmp_path: Path) -> None:
    """`ParquetSink`: tables of one schema are streamed; tables of another schema (files of other
    layouts), or rows that do not add up to what was streamed, make `finish` write the rows whole."""
    import pyarrow as pa

    from kvsnap.analysis.commands.common import ParquetSink

    a = pa.table({"x": [1, 2], "y": [0.5, 1.5]})
    b = pa.table({"x": [3], "z": ["c"]})
    cases = [
        ([a, a], pa.concat_tables([a, a])),
        ([a, b], pa.concat_tables([a, b], promote_options="default")),
    ]
    cases.append(([a, a], a))  # the second table's file failed later: not in the rows
    for i, (tables, rows) in enumerate(cases):
        sink = ParquetSink(str(tmp_path / f"{i}.parquet"))
        for table in tables:
            sink.add(table)
        sink.finish(rows)
        assert pl.read_parquet(tmp_path / f"{i}.parquet").equals(pl.from_arrow(rows))


@pytest.mark.nginx
def test_cli_over_http_and_s3_equals_local(runs: Path, tmp_path: Path) -> None:
    local = tmp_path / "local.parquet"
    assert main(["stats", *good_files(runs), "-o", str(local)]) == 0
    expected = pl.read_parquet(local).drop("file")
    www = tmp_path / "www"
    www.mkdir()
    for name in ("run0.kv", "run1.kv", "run2.kv"):
        shutil.copy(runs / name, www / name)
    with nginx(www, tmp_path / "nginx") as server:
        out = tmp_path / "http.parquet"
        urls = [server.url(f"run{i}.kv") for i in range(3)]
        assert main(["stats", *urls, "-o", str(out), "--jobs", "2"]) == 0
        table = pl.read_parquet(out)
        assert table["file"].unique(maintain_order=True).to_list() == urls
        assert table.drop("file").equals(expected)
    with moto_s3() as s3:
        for name in ("run0.kv", "run1.kv", "run2.kv"):
            s3.upload(runs / name, f"runs/{name}")
        out = tmp_path / "s3.parquet"
        options = [f"--storage-option={k}={json.dumps(v)}" for k, v in s3.storage_options.items()]
        assert main(["stats", f"s3://{s3.bucket}/runs/*.kv", "-o", str(out), *options]) == 0
        table = pl.read_parquet(out)
        assert table["file"].unique().sort().to_list() == [
            f"s3://{s3.bucket}/runs/run{i}.kv" for i in range(3)
        ]
        assert table.drop("file").equals(expected)


def test_stats_over_several_files_prints_one_line_each(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A per-layer grid for each of 50 files would be 1,850 lines: several files get one line
    each (tokens, median mean ||K||, heads above the factor, the largest), agreeing with the
    table; one file keeps its grid."""
    assert main(["stats", *good_files(runs), "-o", str(runs / "several.parquet")]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = pl.read_parquet(runs / "several.parquet")
    assert lines[0].startswith("wrote ") and len(lines) == 1 + 3
    for line, path, tokens in zip(lines[1:], good_files(runs), (40, 57, 33), strict=True):
        keys = table.filter((pl.col("file") == path) & (pl.col("tensor") == "k"))
        assert line.startswith(
            f"{path}: {tokens} tokens, mean ||K|| median {keys['norm_mean'].median():.2f}, "
        )
    assert main(["stats", good_files(runs)[0]]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1 + LAYERS + 1  # title, layers, largest


def test_a_batch_whose_files_each_get_worker_processes_ends(tmp_path: Path) -> None:
    """Fewer files than cores, each big enough for worker processes of its own (here: 384
    heads on 2 of 4 cores): each of the batch's processes keeps a pool for its file's pass, and
    stops it as it exits, so the batch ends (it used to wait for those idle workers forever)
    with the table of one process."""
    import subprocess
    import sys

    paths = [tmp_path / "a.kv", tmp_path / "b.kv"]
    for seed, path in enumerate(paths):
        random_file(path, layers=48, heads=8, tokens=12, dim=8, seed=seed)
    code = (
        "import sys\n"
        "from kvsnap.analysis.engine import batch, plan\n"
        "paths = sys.argv[1:]\n"
        "options = batch.BatchOptions(jobs=4)\n"
        "assert options.plan(paths).workers == 2 and options.plan(paths).options.workers == 2\n"
        "nested = batch.run_stats(paths, options).rows\n"
        "print(nested.equals(batch.run_stats(paths, jobs=1).rows), nested.num_rows)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", str(2 * 48 * 8 * 2)]
