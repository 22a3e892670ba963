"""``kvsnap simulate FILE --model M``: what the model answers from a compressed cache
(`capture.compressed`), held to NVIDIA kvpress's pipeline (``tests/reference/kvpress_answers.py``,
marked ``reference``) on the same SmolLM2 weights in float32 and the same token ids, and to
mlx-lm's own generation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvformat
from kvsnap.analysis.attention import compression
from tests.conftest import PROSE, kept_arrays, kept_capture
from tests.reference.runs import ReferenceRun

NUMBER = "72931"
CONTEXT = PROSE + f" The secret number is {NUMBER}. " + PROSE
QUESTION = "\nQuestion: what is the secret number?\nAnswer: The secret number is"
MAX_TOKENS = 6
PRESSES = [  # kvpress's name and arguments, the method kvsnap runs for it
    ({"name": "streaming-50", "press": "streaming", "compression_ratio": 0.5}, "streaming"),
    ({"name": "snapkv-50", "press": "snapkv", "compression_ratio": 0.5, "window_size": 32}, "snapkv"),
    ({"name": "snapkv-80", "press": "snapkv", "compression_ratio": 0.8, "window_size": 32}, "snapkv"),
    ({"name": "knorm-50", "press": "knorm", "compression_ratio": 0.5}, "knorm"),
    ({"name": "tova-80", "press": "tova", "compression_ratio": 0.8}, "tova"),
    ({"name": "keydiff-50", "press": "keydiff", "compression_ratio": 0.5}, "keydiff"),
    ({"name": "expected_attention-50", "press": "expected_attention", "compression_ratio": 0.5},
     "expected_attention"),
    ({"name": "adakv-50", "press": "adakv", "scorer": "snapkv", "compression_ratio": 0.5, "window_size": 32},
     "adakv"),
]  # fmt: skip


@pytest.fixture(scope="module")
def needle() -> dict[str, Any]:
    """SmolLM2 in float32, a capture of context + question with every query (made once and kept
    by content, `kept_capture`), the ids and the tokens mlx-lm generated while it was written."""
    from mlx_lm import load

    import kvsnap
    from kvsnap.capture.fixtures import fetch_model

    model_dir = fetch_model("smollm2-135m", "float32")
    model, tokenizer = load(str(model_dir))
    context = list(tokenizer.encode(CONTEXT))
    question = list(tokenizer.encode(QUESTION, add_special_tokens=False))

    def make(path: Path) -> dict[str, np.ndarray]:
        run = kvsnap.generate(
            model,
            tokenizer,
            context + question,
            max_tokens=MAX_TOKENS,
            output=path,
            queries="all",
            final=True,
        )
        return {"generated": np.array([int(r.token) for r in run])}

    path = kept_capture("needle", model_dir, repr((CONTEXT, QUESTION, MAX_TOKENS)), make)
    generated = kept_arrays(path)["generated"].tolist()
    return {"model": model, "tokenizer": tokenizer, "context": context, "question": question,
            "path": path, "generated": generated}  # fmt: skip


def _answers(needle: dict[str, Any], methods: list[str], budgets: list[float], **options: Any) -> list[Any]:
    from kvsnap.capture.compressed import compressed_answers

    with kvformat.open(needle["path"]) as snap:
        return compressed_answers(
            needle["model"],
            needle["tokenizer"],
            snap,
            methods,
            budgets,
            answer=NUMBER,
            max_tokens=MAX_TOKENS,
            options=compression.Options(compress="context", question_start=len(needle["context"]), **options),
        )


def test_the_full_cache_answers_as_mlx_lm_generated(needle: dict[str, Any]) -> None:
    """The uncompressed run (the mask hook installed, nothing masked) decodes the tokens mlx-lm's
    own `stream_generate` produced while the file was captured; a budget keeping every key is the
    same run again (KL 0, every token agreed)."""
    full, kept_all = _answers(needle, ["snapkv"], [1.0])
    assert full.method == "full" and full.tokens == needle["generated"][: len(full.tokens)]
    assert full.answer_found and NUMBER in full.text
    assert kept_all.kept == 1.0 and kept_all.tokens == full.tokens
    assert kept_all.kl_mean == 0.0 and kept_all.top1_agreement == 1.0 and kept_all.greedy_agreement == 1.0


def test_refusals(needle: dict[str, Any]) -> None:
    with pytest.raises(compression.CompressionError, match="eviction methods"):
        _answers(needle, ["kivi4"], [0.5])
    from kvsnap.capture.compressed import compressed_answers

    with (
        kvformat.open(needle["path"]) as snap,
        pytest.raises(compression.CompressionError, match="--question"),
    ):
        compressed_answers(needle["model"], needle["tokenizer"], snap, ["snapkv"], [0.5])


@pytest.mark.reference
def test_answers_as_kvpress_pipeline(needle: dict[str, Any], tmp_path: Path) -> None:
    """Each press's answer, KL and top-1 agreement against kvpress's pipeline on transformers:
    the same float32 weights (both from the SmolLM2 GGUF), the same context and question ids,
    the same budget (kvpress's ``int(n * (1 - ratio))`` keys)."""
    from kvsnap.capture.fixtures import fetch_gguf

    spec = {"context": needle["context"], "question": needle["question"], "max_new_tokens": MAX_TOKENS,
            "presses": [press for press, _ in PRESSES]}  # fmt: skip
    (tmp_path / "input.json").write_text(json.dumps(spec))
    run = ReferenceRun("kvpress_answers.py", fetch_gguf("smollm2-135m"), [tmp_path / "input.json"],
                       tmp_path / "out.json")  # fmt: skip
    n = len(needle["context"])
    mine = {}
    for ratio in sorted({float(press["compression_ratio"]) for press, _ in PRESSES}):  # while kvpress runs
        chosen = [(press, method) for press, method in PRESSES if press["compression_ratio"] == ratio]
        # window 32 as the SnapKV presses ask (no other method here reads it)
        full, *runs = _answers(needle, [m for _, m in chosen], [int(n * (1 - ratio)) / n], window=32)
        for (press, _), answer in zip(chosen, runs, strict=True):
            mine[str(press["name"])] = (full, answer)
    theirs = json.loads(run.wait().read_text())
    tokenizer = needle["tokenizer"]
    rows = []
    for press, _ in PRESSES:
        full, ours = mine[str(press["name"])]
        if not rows:
            assert full.tokens == theirs["full_ids"]  # mlx and transformers decode the same answer
            assert tokenizer.decode(full.tokens, skip_special_tokens=True) == theirs["full"]["answer"]
        other = theirs[str(press["name"])]
        rows.append((press["name"], ours.kl_mean, other["kl_mean"]))
        print(
            f"{press['name']}: KL {ours.kl_mean:.5f} (kvpress {other['kl_mean']:.5f}), top-1 "
            f"{ours.top1_agreement:.3f} ({other['top1_agreement']:.3f}), {ours.text!r} / {other['answer']!r}"
        )
        assert tokenizer.decode(ours.tokens, skip_special_tokens=True) == other["answer"], press["name"]
        assert ours.top1_agreement == pytest.approx(other["top1_agreement"], abs=1e-6), press["name"]
        assert abs(ours.kl_mean - other["kl_mean"]) <= 5e-4 + 1e-3 * other["kl_mean"], press["name"]
    assert any(kl > 1e-3 for _, kl, _ in rows)  # some press changed what the model says
    assert np.isfinite([r[1] for r in rows]).all()
