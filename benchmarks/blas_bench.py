"""Which OpenBLAS kernels numpy runs here, and what the other kernels this CPU can run would give
on the analysis' own BLAS calls, each in a fresh process, one thread (as the passes run BLAS).

numpy's OpenBLAS (``DYNAMIC_ARCH``) picks its kernels from the CPU's family and model; on a CPU
its table does not know (a new AMD EPYC, a virtual "Intel Xeon Processor") it falls back to an
older core's kernels even where the CPU has AVX-512. ``OPENBLAS_CORETYPE`` overrides the choice.

    python -m benchmarks.blas_bench [--cores Haswell,SkylakeX,Cooperlake] [--repeats 30]

Rows: the Gram product of one head's rows ``(8192, 128)`` float32 (``spectrum``, ``channels``),
its eigenvalues (``eigvalsh`` of ``(128, 128)``), and the attention group's two products for 64
queries over 7,755 keys of head_dim 64 (``q k^T``, ``w v``). GFLOP/s counts ``2 m n k``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, sys, time
import numpy as np
try:
    from threadpoolctl import threadpool_info, threadpool_limits
    core = ",".join(str(i.get("architecture")) for i in threadpool_info() if i.get("user_api") == "blas")
    threadpool_limits(1, user_api="blas")
except ImportError:
    core = "unknown (no threadpoolctl)"
repeats = int(sys.argv[1])
rng = np.random.default_rng(0)
rows = rng.standard_normal((8192, 128), dtype=np.float32)
gram = rows.T @ rows
q = rng.standard_normal((64, 64), dtype=np.float32)
k = rng.standard_normal((7755, 64), dtype=np.float32)
w = rng.standard_normal((64, 7755), dtype=np.float32)
cases = {
    "gram (8192,128)": (lambda: rows.T @ rows, 2 * 8192 * 128 * 128),
    "eigvalsh (128,128)": (lambda: np.linalg.eigvalsh(gram), 0),
    "q k^T (64,64)x(64,7755)": (lambda: q @ k.T, 2 * 64 * 7755 * 64),
    "w v (64,7755)x(7755,64)": (lambda: w @ k, 2 * 64 * 7755 * 64),
}
out = {"core": core, "rows": {}}
for name, (call, flops) in cases.items():
    call()
    best = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best.append(time.perf_counter() - start)
    best.sort()
    out["rows"][name] = [best[len(best) // 2], flops]
print(json.dumps(out))
"""


def measure(core: str | None, repeats: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env["OPENBLAS_NUM_THREADS"] = "1"
    if core:
        env["OPENBLAS_CORETYPE"] = core
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(repeats)], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return {"core": f"{core}: failed ({done.returncode}) {done.stderr.strip()[-200:]}", "rows": {}}
    return json.loads(done.stdout)


def cpu_line() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            text = info.read()
    except OSError:
        return "cpu: unknown"
    fields = dict(line.split(":", 1) for line in text.splitlines()[:30] if ":" in line)
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []
    )
    wide = " ".join(f for f in flags if f.startswith("avx512") or f in ("avx2", "amx_bf16"))
    name = fields.get("model name\t", "?").strip()
    family = fields.get("cpu family\t", "?").strip()
    model = fields.get("model\t\t", "?").strip()
    return f"cpu: {name} (family {family}, model {model}), {os.cpu_count()} cores; {wide}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", default="Haswell,SkylakeX,Cooperlake")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(cpu_line())
    default = measure(None, args.repeats)
    runs = [("default", default)] + [(core, measure(core, args.repeats)) for core in args.cores.split(",")]
    print(f"default kernels: {default['core']}")
    print("| call | " + " | ".join(f"{name} ({run['core']})" for name, run in runs) + " |")
    print("|---|" + "---:|" * len(runs))
    for call, (base, flops) in default["rows"].items():
        cells = []
        for _, run in runs:
            if call not in run["rows"]:
                cells.append("-")
                continue
            seconds = run["rows"][call][0]
            rate = f", {flops / seconds / 1e9:.0f} GFLOP/s" if flops else ""
            cells.append(f"{seconds * 1e3:.3f} ms ({base / seconds:.2f}x{rate})")
        print(f"| {call} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
