"""Attention recomputed from a capture equal to what the model's own attention kernel returned
(hooked at every call while the file was written), for SmolLM2 (GQA 9:3), Gemma-3 (sliding and
global layers, its own query scale), a rotating cache (``max_kv_size``) and a quantized KV cache
(``kv_bits``); and with a windowed cache, every stored query held to the kernel or refused where
no snapshot holds a key it saw. Each run is made once and kept by content (`kept_capture`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvformat
from kvformat import attention
from tests.conftest import kept_arrays, kept_capture


def _by_position(calls: list[np.ndarray], layers: int, prompt: int) -> dict[tuple[int, int], np.ndarray]:
    """``(layer, position) -> (query heads, v_dim)`` from the kernel's outputs in call order: the
    prefill is one call per layer, then one call per layer per generated token."""
    found: dict[tuple[int, int], np.ndarray] = {}
    position = 0
    for call in range(0, len(calls), layers):
        step = calls[call : call + layers]
        count = step[0].shape[2]
        for layer, out in enumerate(step):
            for i in range(count):
                found[(layer, position + i)] = out[0, :, i]
        position += count
    assert position >= prompt
    return found


def _recorded(
    request: pytest.FixtureRequest, name: str, fixture: str, text: str, capture: dict[str, Any], plain: bool
) -> tuple[Path, dict[str, Any]]:
    """A capture of ``text`` with ``capture``'s options (`kvsnap.generate`), with what the model's
    attention kernel returned at every call meanwhile (`_Outputs`), and the tokens the same run
    generates without capturing (``plain``). Made once and kept by content (`kept_capture`):
    the file, and ``prompt``, ``layers``, ``tokens``, ``plain`` and the kernel's outputs by
    ``(layer, position)`` (``kernel``)."""
    model_dir = request.getfixturevalue(fixture)

    def make(path: Path) -> dict[str, np.ndarray]:
        from mlx_lm import load

        import kvsnap

        model, tokenizer = load(str(model_dir))
        prompt = tokenizer.encode(text)
        options = {k: v for k, v in capture.items() if k not in ("every", "queries")}
        arrays = {"prompt": np.array(prompt), "layers": np.array(len(model.layers))}
        if plain:
            arrays["plain"] = np.array(
                [r.token for r in kvsnap.generate(model, tokenizer, prompt, **options)]
            )
        with pytest.MonkeyPatch.context() as patch:
            outputs = _Outputs(patch)
            done = kvsnap.generate(model, tokenizer, prompt, output=path, **capture)
            arrays["tokens"] = np.array([r.token for r in done])
            calls = [np.array(out.astype(mx.float32)) for out in outputs.calls]
        arrays.update({f"call{i:05d}": call for i, call in enumerate(calls)})
        return arrays

    path = kept_capture(
        name, model_dir, repr((text, sorted(capture.items()), plain)), make, (Path(__file__),)
    )
    arrays = kept_arrays(path)
    calls = [arrays[key] for key in sorted(arrays) if key.startswith("call")]
    layers, prompt = int(arrays["layers"]), arrays["prompt"].tolist()
    found = {"prompt": prompt, "layers": layers, "tokens": arrays["tokens"].tolist(),
             "plain": arrays["plain"].tolist() if plain else None,
             "kernel": _by_position(calls, layers, len(prompt))}  # fmt: skip
    return path, found


class _Outputs:
    """What the attention kernel returned, per call: mx.fast's and the quantized kernel's outputs
    in call order (each forward calls layer 0, 1, ... in turn)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from mlx_lm.models import base

        self.calls: list[Any] = []
        fast, quantized = mx.fast.scaled_dot_product_attention, base.quantized_scaled_dot_product_attention

        def record(function: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                out = function(*args, **kwargs)
                # Kept as the output array itself (evaluated with the step; no copy that would
                # synchronise each layer) and read on the host after generation.
                self.calls.append(out)
                return out

            return wrapper

        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", record(fast))
        monkeypatch.setattr(base, "quantized_scaled_dot_product_attention", record(quantized))


CASES = {
    "smollm2": ("smollm2_dir", {}),
    "gemma3": ("gemma3_dir", {}),
    "rotating": ("smollm2_dir", {"max_kv_size": 24}),
    "quantized": ("smollm2_dir", {"kv_bits": 8, "quantized_kv_start": 0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_attention_from_the_file_equals_the_models(case: str, request: pytest.FixtureRequest) -> None:
    fixture, options = CASES[case]
    text = "The history of the city begins when a small settlement grew up by a bridge"
    capture = {"max_tokens": 14, "every": 1, "queries": "window:6", **options}
    path, run = _recorded(request, f"queries-{case}", fixture, text, capture, plain=True)
    assert run["tokens"] == run["plain"]  # capturing queries changes nothing
    layers, prompt, kernel = run["layers"], run["prompt"], run["kernel"]
    errors: list[float] = []
    with kvformat.open(path) as series:
        assert series.metadata["queries"] == "window:6"
        if case == "gemma3":
            windows = {series.layers[i].queries.window for i in range(layers)}  # type: ignore[union-attr]
            assert windows == {512, None}  # sliding and global layers
            assert series.layers[0].queries.scale == pytest.approx(256**-0.5)  # type: ignore[union-attr]
        done = 0
        for index in range(series.num_snapshots):
            snap = series.select(index)
            for layer in range(layers):
                spec = snap.layers[layer].queries
                assert spec is not None
                found = snap.queries(layer, 0)
                assert found is not None
                fresh = found.positions[found.positions >= done]  # the queries this snapshot added
                if not fresh.size:
                    continue
                for head in range(spec.num_heads):
                    output, positions = snap.attention_output(
                        layer, head, queries=(int(fresh[0]), int(fresh[-1]) + 1)
                    )
                    for row, position in enumerate(positions.tolist()):
                        expected = kernel[(layer, position)][head]
                        error = float(
                            np.linalg.norm(output[row] - expected) / max(np.linalg.norm(expected), 1e-6)
                        )
                        errors.append(error)
            done = int(snap.queries(0, 0).positions[-1]) + 1  # type: ignore[union-attr]
        assert done == len(prompt) + 14  # every query of the run, the last generated token's too
    worst, median = max(errors), float(np.median(errors))
    print(
        f"{case}: relative error of the recomputed attention output: median {median:.2e}, worst {worst:.2e}"
    )
    # float16 queries, keys and values against the kernel's float16 output; the quantized kernel
    # also rounds its scores to float16 before the softmax (mlx-lm's quantized attention)
    assert worst < (1e-1 if case == "quantized" else 2e-2) and median < (
        1e-2 if case == "quantized" else 2e-3
    )


WINDOWED = {
    "rotating-every-20": ("smollm2_dir", {"max_kv_size": 24}, 20, 56, 1),
    "rotating-every-8": ("smollm2_dir", {"max_kv_size": 24}, 8, 56, 1),
    "gemma3-sliding-512": ("gemma3_dir", {}, 3, 6, 34),
}


def _held_to_kernel(
    snap: kvformat.Snapshot, layer: int, heads: int, run: list[int], kernel: dict[tuple[int, int], np.ndarray]
) -> list[float]:
    """The relative error of each head's recomputed output against the kernel's, for the
    consecutive query positions ``run`` (one `attention_output` call per head)."""
    errors: list[float] = []
    if not run:
        return errors
    for head in range(heads):
        output, positions = snap.attention_output(layer, head, queries=(run[0], run[-1] + 1))
        assert positions.tolist() == run
        for row, position in enumerate(run):
            expected = kernel[(layer, position)][head]
            errors.append(float(np.linalg.norm(output[row] - expected) / max(np.linalg.norm(expected), 1e-6)))
    return errors


@pytest.mark.parametrize("case", list(WINDOWED))
def test_windowed_attention_is_the_models_at_every_stored_query(
    case: str, request: pytest.FixtureRequest
) -> None:
    """Every query every snapshot stores, recomputed over the keys it saw (those dropped since
    taken from earlier snapshots), against the kernel's output for it; a query whose keys no
    snapshot holds is refused, never renormalised over fewer keys."""
    fixture, options, every, max_tokens, repeat = WINDOWED[case]
    text = "The history of the city begins when a small settlement grew up by a bridge. "
    capture = {"max_tokens": max_tokens, "every": every, "queries": "window:16", **options}
    path, run = _recorded(request, f"windowed-{case}", fixture, (text * repeat).strip(), capture, plain=False)
    layers, prompt, kernel = run["layers"], run["prompt"], run["kernel"]
    if case.startswith("gemma3"):
        assert len(prompt) > 512  # past the sliding layers' window
    errors: list[float] = []
    refused = checked = lost = 0
    with kvformat.open(path) as series:
        assert series.num_snapshots >= 2
        ever = {  # every key position some snapshot holds, per layer (an oracle apart from the reader's)
            layer: set().union(
                *(series.select(i).positions(layer, 0).tolist() for i in range(series.num_snapshots))
            )  # type: ignore[union-attr]
            for layer in range(layers)
        }
        windowed = [i for i in range(layers) if series.layers[i].queries.window is not None]  # type: ignore[union-attr]
        assert windowed
        for index in range(series.num_snapshots):
            snap = series.select(index)
            for layer in windowed:
                spec = snap.layers[layer].queries
                assert spec is not None
                stored = snap.queries(layer, 0)
                assert stored is not None
                keys = attention.context_keys(snap, layer, spec.kv_heads[0], 0, stored.positions)
                run: list[int] = []  # consecutive complete queries: recomputed in one call per head
                for position, complete in zip(stored.positions.tolist(), keys.complete.tolist(), strict=True):
                    seen = attention.visible(spec, np.array([position]), np.arange(position + 1))[0]
                    lost += int(not set(np.flatnonzero(seen).tolist()) <= ever[layer])
                    if complete and (not run or position == run[-1] + 1):
                        run.append(position)
                        continue
                    checked += len(run)
                    errors += _held_to_kernel(snap, layer, spec.num_heads, run, kernel)
                    run = [position] if complete else []
                    if not complete:
                        with pytest.raises(kvformat.MissingKeysError, match=f"positions {position}"):
                            snap.attention_output(layer, 0, queries=(position, position + 1))
                        refused += 1
                checked += len(run)
                errors += _held_to_kernel(snap, layer, spec.num_heads, run, kernel)
    worst, median = max(errors), float(np.median(errors))
    print(
        f"{case}: {checked} queries held to the kernel, {refused} refused; "
        f"median {median:.2e}, worst {worst:.2e}"
    )
    assert refused == lost  # refused exactly where a key the query saw is in no snapshot
    if every == 20:  # the window (24 keys, 4 kept) moves 20 positions between snapshots: keys are lost
        assert refused > 0
    if every == 8:  # it moves 8: every key a query saw is in some snapshot
        assert refused == 0
    assert checked > 0 and median < 1e-3 and worst < 5e-3  # float16 kernel outputs against float32
