"""Synthetic long-context tasks in the manner of RULER (Hsieh et al. 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?"), generated locally from a seed: no download.

Four tasks, each a context, a question and the strings a right answer contains:

- ``niah_single``: one needle ("One of the special magic numbers for KEY is: VALUE.") in filler;
- ``niah_multikey``: four needles of different keys; the question asks for one;
- ``kv_retrieval``: a JSON object of random keys and values; the question asks for one value;
- ``variable_tracking``: ``VAR A = 12345`` then a chain of copies (``VAR B = VAR A``) among
  unrelated assignments; the question asks which variables hold the value.

The score of an answer is kvpress's RULER metric (``evaluation/benchmarks/ruler/calculate_metrics.py``,
``string_match_all``): the fraction of the expected strings the answer contains, case-insensitive.
Contexts are filled to about ``tokens`` tokens of the given tokenizer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import UnknownTaskError

if TYPE_CHECKING:
    import random

TASKS = ("niah_single", "niah_multikey", "kv_retrieval", "variable_tracking")

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
"""RULER's own haystack for its synthetic needles (its ``noise`` haystack)."""

WORDS = [
    "amber",
    "basin",
    "cedar",
    "delta",
    "ember",
    "falcon",
    "garnet",
    "harbor",
    "iris",
    "juniper",
    "kestrel",
    "lumen",
    "maple",
    "nectar",
    "onyx",
    "pepper",
    "quartz",
    "raven",
    "sable",
    "tundra",
    "umber",
    "violet",
    "willow",
    "xenon",
    "yarrow",
    "zephyr",
]


@dataclass(frozen=True)
class Sample:
    """One task instance: the ``context`` (compressed), the ``question`` (read after it,
    uncompressed), the ``answer_prefix`` the reply continues (RULER's) and the ``answers`` a
    right reply contains."""

    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: list[str]

    def to_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "index": self.index,
            "context": self.context,
            "question": self.question,
            "answer_prefix": self.answer_prefix,
            "answers": self.answers,
        }


def score(answer: str, expected: list[str]) -> float:
    """kvpress's ``string_match_all``: the fraction of ``expected`` that ``answer`` contains
    (case-insensitive)."""
    text = answer.lower()
    return sum(e.lower() in text for e in expected) / len(expected)


def samples(
    count_tokens: Callable[[str], int],
    tokens: int,
    per_task: int,
    seed: int = 0,
    tasks: tuple[str, ...] = TASKS,
) -> list[Sample]:
    """``per_task`` samples of each task, contexts of about ``tokens`` tokens (``count_tokens``
    counts a text's), the same for the same arguments."""
    import random  # (imports hashlib: loaded when samples are made, not with the parser)

    out = []
    for task in tasks:
        if task not in TASKS:
            raise UnknownTaskError(f"unknown task {task!r}: one of {', '.join(TASKS)}")
        for index in range(per_task):
            rng = random.Random(f"{seed}/{task}/{index}")
            out.append(_MAKERS[task](rng, count_tokens, tokens, index))
    return out


def _number(rng: random.Random) -> str:
    return str(rng.randrange(1_000_000, 10_000_000))


def _key(rng: random.Random) -> str:
    return "-".join(rng.sample(WORDS, 2))


def _haystack(count_tokens: Callable[[str], int], tokens: int, needles: list[str], rng: random.Random) -> str:
    """Filler of about ``tokens`` tokens with ``needles`` at random sentence boundaries."""
    per = max(1, count_tokens(FILLER))
    repeats = max(len(needles) + 1, tokens // per)
    parts = [FILLER] * repeats
    for needle in needles:
        parts.insert(rng.randrange(1, len(parts)), needle + " ")
    return "".join(parts).strip()


def _niah_single(rng: random.Random, count: Callable[[str], int], tokens: int, index: int) -> Sample:
    key, value = _key(rng), _number(rng)
    needle = f"One of the special magic numbers for {key} is: {value}."
    context = _haystack(count, tokens - count(needle), [needle], rng)
    question = f"What is the special magic number for {key} mentioned in the provided text?"
    prefix = f"The special magic number for {key} mentioned in the provided text is"
    return Sample("niah_single", index, context, question, prefix, [value])


def _niah_multikey(rng: random.Random, count: Callable[[str], int], tokens: int, index: int) -> Sample:
    keys: list[str] = []
    while len(keys) < 4:
        key = _key(rng)
        if key not in keys:
            keys.append(key)
    values = [_number(rng) for _ in keys]
    needles = [
        f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values, strict=True)
    ]
    context = _haystack(count, tokens - sum(count(n) for n in needles), needles, rng)
    asked = rng.randrange(len(keys))
    question = f"What is the special magic number for {keys[asked]} mentioned in the provided text?"
    prefix = f"The special magic number for {keys[asked]} mentioned in the provided text is"
    return Sample("niah_multikey", index, context, question, prefix, [values[asked]])


def _kv_retrieval(rng: random.Random, count: Callable[[str], int], tokens: int, index: int) -> Sample:
    import json

    pairs: dict[str, str] = {}

    def hex_id() -> str:
        return "".join(rng.choice("0123456789abcdef") for _ in range(8))

    text = ""
    while True:
        pairs[hex_id()] = hex_id()
        candidate = json.dumps(pairs)
        if count(candidate) > tokens:
            break
        text = candidate
    pairs = json.loads(text)
    key = rng.choice(list(pairs))
    context = f"JSON data:\n{text}"
    question = f'What is the value associated with the key "{key}" in the JSON object above?'
    prefix = f'The value associated with the key "{key}" is'
    return Sample("kv_retrieval", index, context, question, prefix, [pairs[key]])


def _variable_tracking(rng: random.Random, count: Callable[[str], int], tokens: int, index: int) -> Sample:
    value = str(rng.randrange(10_000, 100_000))
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(5)]
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    positions = sorted(rng.sample(range(1, 1000), len(chain)))
    base = _haystack(count, tokens - sum(count(c) for c in chain), [], rng)
    sentences = base.split(". ")
    for offset, (where, statement) in enumerate(zip(positions, chain, strict=True)):
        at = min(len(sentences), 1 + where * len(sentences) // 1000 + offset)
        sentences.insert(at, statement.rstrip("."))
    context = ". ".join(sentences)
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (
        f"According to the chain(s) of variable assignment in the text above, {len(names)} variables "
        f"are assigned the value {value}, they are:"
    )
    return Sample("variable_tracking", index, context, question, prefix, names)


_MAKERS: dict[str, Callable[[random.Random, Callable[[str], int], int, int], Sample]] = {
    "niah_single": _niah_single,
    "niah_multikey": _niah_multikey,
    "kv_retrieval": _kv_retrieval,
    "variable_tracking": _variable_tracking,
}
