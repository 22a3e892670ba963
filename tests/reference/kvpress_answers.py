"""NVIDIA kvpress's pipeline end to end on Hugging Face transformers: what the model answers after
each press compressed the context, the reference `tests/capture/test_compressed.py` holds
``kvsnap simulate --model`` to. Runs in the reference Python (``make reference``: torch,
transformers, kvpress), never imports kvsnap.

    python kvpress_answers.py MODEL.gguf INPUT.json OUT.json

With ``"samples": [{"context", "question", "answer_prefix"}]`` in ``INPUT.json`` instead (text, as
``kvsnap bench compression`` writes them), the pipeline itself runs on the text: ``pipe(context,
question=..., answer_prefix=..., press=..., max_new_tokens=N)`` for no press and each press, and
``OUT.json`` holds per sample the ids its ``preprocess`` formed and the answer of each.

``INPUT.json``: ``{"context": ids, "question": ids, "max_new_tokens": N, "presses": [{"name",
"press", "compression_ratio", ...}]}`` (presses as ``kvpress_kept.py`` names them). For no press
and then each press, as ``KVPressTextGenerationPipeline._forward`` does: the context is prefilled
under the press (``model.model``, the cache compressed at its end), the answer decoded greedily by
the pipeline's own ``generate_answer`` (the question at positions after the context's), the answer
removed from the cache (``_remove_answer_from_cache``); then the question and the uncompressed
run's answer are read teacher-forced at the same positions, and the log-probabilities compared
with the uncompressed run's. Writes per name: ``answer`` (text, special tokens skipped),
``kl_mean`` / ``kl_max`` (``KL(full || press)``, nats per answer token), ``top1_agreement``; and
``full_ids``, the uncompressed run's greedy answer ids.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline

sys.path.insert(0, str(Path(__file__).parent))
from kvpress_kept import _press
from transformers_kv import _read_once


def _greedy_ids(
    model: torch.nn.Module, question: torch.Tensor, cache: DynamicCache, start: int, n: int
) -> list[int]:
    """``generate_answer``'s loop, keeping the ids (the pipeline returns text)."""
    positions = torch.arange(start, start + question.shape[1]).unsqueeze(0)
    out = model(input_ids=question, past_key_values=cache, position_ids=positions, logits_to_keep=1)
    ids = [int(out.logits[0, -1].argmax())]
    stop = model.generation_config.eos_token_id
    stop = stop if isinstance(stop, list) else [stop]
    position = positions[:, -1:] + 1
    for i in range(n - 1):
        out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache, position_ids=position + i)
        ids.append(int(out.logits[0, -1].argmax()))
        if ids[-1] in stop:
            break
    return ids


def _forced(
    model: torch.nn.Module, question: torch.Tensor, answer: list[int], cache: DynamicCache, start: int
) -> torch.Tensor:
    """Log-probabilities ``(len(answer), vocab)`` of each answer token's prediction."""
    ids = torch.cat([question, torch.tensor([answer[:-1]], dtype=question.dtype)], dim=1)
    positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[question.shape[1] - 1 :]


def on_text(gguf: Path, spec: dict[str, object], out: str) -> None:
    """The pipeline on each sample's text (``"samples"``)."""
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    pipes = {
        attention: pipeline(
            "kv-press-text-generation",
            model=AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation=attention
            ).eval(),
            tokenizer=tokenizer,
        )
        for attention in ("eager", "sdpa")
    }
    results = []
    for sample in spec["samples"]:  # type: ignore[attr-defined]
        ids = pipes["eager"].preprocess(
            sample["context"], [sample["question"]], sample["answer_prefix"], 10**10
        )
        answers = {}
        for config in [None, *spec["presses"]]:  # type: ignore[attr-defined]
            pipe = pipes["sdpa" if config is not None and config["press"] == "adakv" else "eager"]
            answer = pipe(
                sample["context"],
                question=sample["question"],
                answer_prefix=sample["answer_prefix"],
                press=_press(config) if config is not None else None,
                max_new_tokens=int(spec["max_new_tokens"]),  # type: ignore[call-overload]
            )["answer"]
            answers["full" if config is None else str(config["name"])] = answer
        results.append(
            {
                "context_ids": ids["context_ids"][0].tolist(),
                "question_ids": ids["questions_ids"][0][0].tolist(),
                "answers": answers,
            }
        )
    Path(out).write_text(json.dumps({"samples": results}))


def main(gguf: str, input_path: str, out: str) -> None:
    path = Path(gguf)
    _read_once()
    spec = json.loads(Path(input_path).read_text())
    if "samples" in spec:
        with torch.no_grad():
            on_text(path, spec, out)
        return
    context = torch.tensor([spec["context"]])
    question = torch.tensor([spec["question"]])
    n = int(spec["max_new_tokens"])
    models: dict[str, torch.nn.Module] = {}

    def model_for(attention: str) -> torch.nn.Module:
        if attention not in models:
            models[attention] = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation=attention
            ).eval()
        return models[attention]

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    results: dict[str, object] = {}
    full_ids: list[int] = []
    full: torch.Tensor | None = None
    with torch.no_grad():
        for config in [None, *spec["presses"]]:
            # AdaKVPress masks keys under sdpa attention only; ObservedAttention needs eager
            model = model_for("sdpa" if config is not None and config["press"] == "adakv" else "eager")
            pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
            cache = DynamicCache()
            press = _press(config) if config is not None else None
            with press(model) if press is not None else torch.no_grad():  # type: ignore[operator]
                model.model(input_ids=context, past_key_values=cache)
            lengths = [cache.get_seq_length(layer) for layer in range(len(cache))]
            if config is None:
                full_ids = _greedy_ids(model, question, cache, context.shape[1], n)
                answer = tokenizer.decode(full_ids, skip_special_tokens=True)
            else:
                answer = pipe.generate_answer(question, cache, context.shape[1], n)
            pipe._remove_answer_from_cache(cache, lengths)
            forced = _forced(model, question, full_ids, cache, context.shape[1])
            if full is None:
                full = forced
            kl = (full.exp() * (full - forced)).sum(dim=-1)
            agree = (forced.argmax(dim=-1) == torch.tensor(full_ids)).float().mean()
            name = "full" if config is None else str(config["name"])
            results[name] = {
                "answer": answer,
                "kl_mean": float(kl.mean()),
                "kl_max": float(kl.max()),
                "top1_agreement": float(agree),
            }
    results["full_ids"] = full_ids
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:4])
