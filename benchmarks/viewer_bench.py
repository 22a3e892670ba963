"""`kvsnap view` in a real browser (Debian's Chromium through Playwright), timed in the page with
``performance.now()``: the first map on screen after the page starts loading; then, once the head
grid is there, switching heads (``switch_ms``: from the call to the new head's map and its last
query's row on screen; ``switch_all_panels_ms``: until its K/V view is drawn too), a zoom step,
and drawing the head's queries and keys in one plane (at most 32,768 keys, every n-th past that);
and the server's peak resident memory (the file's pages the grid's pass read count in it). The
server is a fresh ``kvsnap view FILE --no-browser`` process with default settings; the file a
synthetic capture with queries in
Qwen3-8B-like layers (8 KV heads, 32 query heads, head_dim 128, float16), queries of the last 64
positions as ``--queries window:64`` keeps them.

    python -m benchmarks.viewer_bench [--tokens 8192] [--layers 8] [--kv-heads 8] [--dtype float16]
        [--runs 3] [--dir DIR]

``--layers 32 --kv-heads 32 --dtype float32`` is the 8.6 GB seed-sized capture (an 8B model's
cache at 8192 tokens in float32).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHROMIUM = os.environ.get("KVSNAP_CHROMIUM", "/usr/bin/chromium")


def synthetic(path: Path, tokens: int, layers: int, kv_heads: int = 8, dtype: str = "float16") -> None:
    """A capture-shaped file: ``layers`` layers of ``kv_heads`` KV heads and 32 query heads,
    head_dim 128, in ``dtype``, queries at the last 64 positions."""
    import kvformat
    from kvformat import QuerySpec

    rng = np.random.default_rng(0)
    kind = {"float16": kvformat.FLOAT16, "float32": kvformat.FLOAT32}[dtype]
    spec = kvformat.LayerSpec(
        kv_heads, 128, 128, kind,
        queries=QuerySpec(num_heads=32, dim=128, dtype=kind, scale=128**-0.5,
                          kv_heads=tuple(h * kv_heads // 32 for h in range(32))),
    )  # fmt: skip
    metadata = {"prompt_tokens": tokens - 16}
    with kvformat.Writer(path, [spec] * layers, metadata=metadata) as writer:
        for layer in range(layers):
            k = rng.standard_normal((kv_heads, tokens, 128), dtype=np.float32).astype(dtype)
            k[:, 0] *= 8  # a sink key, as real caches have
            v = rng.standard_normal((kv_heads, tokens, 128), dtype=np.float32).astype(dtype)
            writer.append(layer, k, v)
            q = rng.standard_normal((32, 64, 128), dtype=np.float32).astype(dtype)
            writer.append_queries(layer, q, np.arange(tokens - 64, tokens))
        writer.snapshot({"generated": 16})


def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """``VmHWM`` (the peak) or ``VmRSS`` (now) of process ``pid``, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_once(path: Path) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    server = subprocess.Popen(
        [sys.executable, "-m", "kvsnap", "view", str(path), "--no-browser"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().split()[2]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
            )
            page = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True).new_page()
            page.goto(url)
            page.wait_for_function("window.kvsnap && window.kvsnap.mapsDrawn >= 1", timeout=600_000)
            first = page.evaluate("window.kvsnap.mapDrawnAt")  # from the page's navigation start
            at_first_map = rss_mib(server.pid, "VmRSS")
            page.wait_for_function("window.kvsnap.grid !== null", timeout=600_000)  # then steady state
            switch = page.evaluate(
                "async () => { const t = performance.now(); await window.kvsnap.select(3, 17); "
                "return [performance.now() - t, window.kvsnap.headShownAt - t]; }"
            )
            zoom = page.evaluate(
                "async () => { const m = window.kvsnap.map; const t = performance.now(); "
                "await window.kvsnap.zoom({q0: m.queries[0], q1: m.queries[0] + 16, k0: 0, k1: 512}); "
                "return performance.now() - t; }"
            )
            qk = page.evaluate(
                "async () => { const t = performance.now(); await window.kvsnap.showQk(); "
                "const v = window.kvsnap.qk; "
                "return [performance.now() - t, v.keys.x.length + v.queries.x.length]; }"
            )
            browser.close()
        time.sleep(0.2)
        return {
            "qk_plane_ms": qk[0],
            "qk_points": qk[1],
            "first_ms": first,
            "switch_ms": switch[1],
            "switch_all_panels_ms": switch[0],
            "zoom_ms": zoom,
            "server_rss_at_first_map_mib": at_first_map,
            "server_rss_after_mib": rss_mib(server.pid, "VmRSS"),
            "server_peak_mib": rss_mib(server.pid),
        }
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads per layer (32 query heads)")
    parser.add_argument("--dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--dir", default=None, help="folder for the synthetic file (default: a temporary one)"
    )
    args = parser.parse_args()
    folder = Path(args.dir or tempfile.mkdtemp(prefix="kvsnap-view-"))
    path = folder / f"view-{args.tokens}x{args.layers}x{args.kv_heads}-{args.dtype}.kv"
    if not path.exists():
        synthetic(path, args.tokens, args.layers, args.kv_heads, args.dtype)
    print(f"{path}: {path.stat().st_size / 1e6:.0f} MB, {args.tokens} tokens, {args.layers} layers")
    runs = [run_once(path) for _ in range(args.runs)]
    for name in runs[0]:
        values = [r[name] for r in runs]
        print(f"  {name}: median {statistics.median(values):.0f} (range {min(values):.0f}-{max(values):.0f})")


if __name__ == "__main__":
    main()
