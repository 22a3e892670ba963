"""``kvsnap simulate``'s eviction held to NVIDIA kvpress itself (``tests/reference/kvpress_kept.py``
in the reference Python: ``make reference``): the same SmolLM2 GGUF, the same token ids, the keys
each press keeps against the keys `compression.kept_mask` keeps from a kvsnap capture of the run
(mlx, float16 weights, against transformers in float32: the scores differ by rounding only).
Marked ``reference``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kvformat
from kvsnap.analysis.attention import compression
from tests.capture.test_reference import reference_python
from tests.conftest import PROSE, ROOT

TOKENS = 256
PRESSES = [
    {"name": "snapkv-64", "press": "snapkv", "compression_ratio": 0.5, "window_size": 64, "kernel_size": 5},
    {"name": "snapkv-32", "press": "snapkv", "compression_ratio": 0.75, "window_size": 32, "kernel_size": 7},
    {"name": "streaming-50", "press": "streaming", "compression_ratio": 0.5},
    {"name": "streaming-90", "press": "streaming", "compression_ratio": 0.9},
    {"name": "observed-50", "press": "observed", "compression_ratio": 0.5},
    {"name": "observed-80", "press": "observed", "compression_ratio": 0.8},
]


@pytest.mark.reference
def test_eviction_keeps_the_keys_kvpress_keeps(smollm2_dir: Path, tmp_path: Path) -> None:
    from mlx_lm import load

    import kvsnap
    from kvsnap.capture.fixtures import fetch_gguf

    model, tokenizer = load(str(smollm2_dir))
    ids = list(tokenizer.encode(PROSE * 3))[:TOKENS]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    (tmp_path / "presses.json").write_text(json.dumps(PRESSES))
    script = ROOT / "tests" / "reference" / "kvpress_kept.py"
    run = subprocess.Popen(
        [str(reference_python()), str(script), str(fetch_gguf("smollm2-135m")), str(tmp_path / "ids.json"),
         str(tmp_path / "presses.json"), str(tmp_path / "kept.npz")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    path = tmp_path / "run.kv"
    for _ in kvsnap.generate(model, tokenizer, ids, max_tokens=1, output=path, queries="all"):
        pass
    _, errors = run.communicate(timeout=600)
    assert run.returncode == 0, errors[-3000:]
    methods = {"snapkv": "snapkv", "streaming": "streaming", "observed": "observed"}
    with np.load(tmp_path / "kept.npz") as kept, kvformat.open(path) as snap:
        for press in PRESSES:
            count = max(1, int(TOKENS * (1 - press["compression_ratio"])))  # kvpress's compute_n_kept
            options = compression.Options(
                window=int(press.get("window_size", 64)), kernel=int(press.get("kernel_size", 5))
            )
            spec = snap.layers[0].queries
            assert spec is not None
            jaccard = []
            for layer in range(snap.num_layers):
                for kv_head in range(snap.layers[layer].num_heads):
                    head = spec.kv_heads.index(kv_head)
                    positions, keep = compression.kept_mask(
                        snap, layer, head, methods[str(press["press"])], count / TOKENS, options=options
                    )
                    mine = set(positions[keep & (positions < TOKENS)].tolist())
                    theirs = set(kept[f"{press['name']}/{layer}"][kv_head].tolist())
                    assert len(mine) == len(theirs) == count
                    jaccard.append(len(mine & theirs) / len(mine | theirs))
            mean, worst = float(np.mean(jaccard)), min(jaccard)
            print(f"{press['name']}: Jaccard with kvpress mean {mean:.4f}, worst KV head {worst:.4f}")
            if press["press"] == "streaming":
                assert worst == 1.0
            assert mean >= 0.95 and worst >= 0.85
