"""``kvsnap bench compression``: the synthetic RULER-style tasks (`capture.ruler`) checked by
reading each context directly, and the accuracy table held to NVIDIA kvpress's pipeline run on the
same text (``tests/reference/kvpress_answers.py``, marked ``reference``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvsnap.capture import ruler
from tests.reference.runs import ReferenceRun


def _words(text: str) -> int:
    return len(text.split())


def test_tasks_hold_their_answers_and_repeat() -> None:
    """Every sample's context states its answer (read back with a regular expression, or for
    variable tracking by following the assignments), the same seed gives the same samples, and
    contexts grow with the token count asked for."""
    made = ruler.samples(_words, 300, 3, seed=5)
    assert [s.to_json() for s in made] == [s.to_json() for s in ruler.samples(_words, 300, 3, seed=5)]
    assert [s.to_json() for s in made] != [s.to_json() for s in ruler.samples(_words, 300, 3, seed=6)]
    assert {s.task for s in made} == set(ruler.TASKS) and len(made) == 12
    for sample in made:
        assert sample.answers and 150 <= _words(sample.context) <= 450, (sample.task, _words(sample.context))
        if sample.task.startswith("niah"):
            key = re.search(r"number for (\S+) mentioned", sample.question)
            assert key is not None
            stated = re.findall(rf"magic numbers for {re.escape(key.group(1))} is: (\d+)\.", sample.context)
            assert stated == sample.answers
            assert len(re.findall("magic numbers for", sample.context)) == (
                4 if "multikey" in sample.task else 1
            )
        elif sample.task == "kv_retrieval":
            key = re.search(r'key "(\w+)"', sample.question)
            assert key is not None
            pairs = json.loads(sample.context.removeprefix("JSON data:\n"))
            assert [pairs[key.group(1)]] == sample.answers
        else:
            value = re.search(r"value (\d+)", sample.question)
            assert value is not None
            held: dict[str, str] = {}
            for name, source in re.findall(r"VAR (\w+) = (VAR \w+|\d+)", sample.context):
                held[name] = held[source[4:]] if source.startswith("VAR ") else source
            assert sorted(n for n, v in held.items() if v == value.group(1)) == sorted(sample.answers)
    assert len(ruler.samples(_words, 900, 1)[0].context) > 2 * len(ruler.samples(_words, 300, 1)[0].context)
    with pytest.raises(ValueError, match="unknown task"):
        ruler.samples(_words, 100, 1, tasks=("needle",))


def test_score_is_string_match_all() -> None:
    assert ruler.score(" The number is 1234567.", ["1234567"]) == 1.0
    assert ruler.score("abc", ["ABC", "def"]) == 0.5
    assert ruler.score("", ["x"]) == 0.0


@pytest.mark.reference
def test_accuracy_as_kvpress_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command's answers and scores against kvpress's pipeline given the same text: the same
    ids from its ``preprocess`` (the chat template cut where the question goes), the same answer
    for every (sample, method, ratio), so the accuracy table is kvpress's."""
    import polars as pl

    from kvsnap.capture.compression_bench import tokenize
    from kvsnap.capture.fixtures import fetch_gguf, fetch_model
    from kvsnap.cli import main

    presses = [
        {"name": "snapkv/0.5", "press": "snapkv", "compression_ratio": 0.5},
        {"name": "snapkv/0.7", "press": "snapkv", "compression_ratio": 0.7},
        {"name": "knorm/0.5", "press": "knorm", "compression_ratio": 0.5},
        {"name": "knorm/0.7", "press": "knorm", "compression_ratio": 0.7},
    ]  # at 0.7 SnapKV still keeps more than its 64-query window (below it, kvpress's choice is a tie)
    from mlx_lm import load

    model = str(fetch_model("smollm2-135m", "float32"))  # kvpress runs the GGUF in float32
    _, tokenizer = load(model)
    made = ruler.samples(lambda t: len(tokenizer.encode(t, add_special_tokens=False)), 240, 1,
                         tasks=("kv_retrieval",))  # fmt: skip
    samples = [sample.to_json() for sample in made]
    (tmp_path / "input.json").write_text(
        json.dumps({"samples": samples, "presses": presses, "max_new_tokens": 10})
    )
    run = ReferenceRun("kvpress_answers.py", fetch_gguf("smollm2-135m"), [tmp_path / "input.json"],
                       tmp_path / "out.json")  # fmt: skip
    out = tmp_path / "bench"
    args = ["bench", "compression", "--model", model, "--tasks", "kv_retrieval", "--samples", "1",
            "--tokens", "240", "--method", "snapkv", "knorm", "--ratio", "0.5", "0.7", "--max-tokens", "10",
            "-o", str(out)]  # fmt: skip
    assert main(args) == 0  # while kvpress runs
    printed = capsys.readouterr().out
    assert "full cache:" in printed and "snapkv" in printed
    assert [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()] == samples
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    theirs = json.loads(run.wait().read_text())["samples"]
    table = pl.read_parquet(out / "accuracy.parquet")
    for sample, other in zip(samples, theirs, strict=True):
        ids = tokenize(tokenizer, ruler.Sample(**sample))
        assert (ids.context, ids.question) == (other["context_ids"], other["question_ids"])
        mine = table.filter((pl.col("task") == sample["task"]) & (pl.col("sample") == sample["index"]))
        for name, answer in other["answers"].items():
            method, _, ratio = name.partition("/")
            row = mine.filter((pl.col("method") == method) & (pl.col("ratio") == float(ratio or 0)))
            assert row.height == 1, name
            print(f"{sample['task']} {name}: {row['answer'][0]!r} / kvpress {answer!r}")
            assert row["answer"][0] == answer, (sample["task"], name)
            assert row["score"][0] == ruler.score(answer, sample["answers"])
