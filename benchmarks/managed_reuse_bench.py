"""What a snapshot's host copy costs the device's next kernels on mlx's CUDA backend.

A capture copies each snapshot's new K/V (a few MB) to the host from a writer thread. mlx gives a
buffer the host reads CUDA managed memory (its device buffer is copied into a managed one, which
the host then reads, so its pages move to the host); once released, mlx's buffer cache hands that
buffer to a later kernel, which faults its pages back to the device one at a time. This times a
device kernel that writes a buffer of the snapshot's size, in three settings, interleaved:

- ``device``: the buffer it gets was last written by the device (no host copy in between);
- ``host-read``: the buffer was copied to the host just before (the capture's case);
- ``prefetched``: as ``host-read``, then moved back to the device in one transfer
  (`kvsnap.analysis.kernels.unified_memory`, ``cuMemPrefetchAsync``) before release.

    python -m benchmarks.managed_reuse_bench [--mib 2.4] [--rounds 200]

Prints the median and quartiles of each setting's kernel time (ms) and of the host copy itself.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np


def _address(array: mx.array) -> int:
    """The address of an evaluated array's memory (after `np.asarray`: managed on CUDA)."""
    view = np.asarray(array.view(mx.uint8) if array.dtype == mx.bfloat16 else array)
    return int(view.ctypes.data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=2.4)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    from kvsnap.analysis.kernels.unified_memory import UnifiedMemory

    memory = UnifiedMemory.load()
    count = int(args.mib * (1 << 20)) // 2
    source = mx.random.normal((count,)).astype(mx.bfloat16)
    weights = mx.random.normal((4096, 4096)).astype(mx.bfloat16)
    vector = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    mx.eval(source, weights, vector)
    times: dict[str, list[float]] = {"device": [], "host-read": [], "prefetched": []}
    copies: list[float] = []
    for round_ in range(args.rounds):
        for setting in times:
            made = source * 1.0001  # a new device buffer of the snapshot's size
            mx.eval(made)
            if setting != "device":
                start = time.perf_counter()
                host = np.array(np.asarray(made.view(mx.uint16)), copy=True)
                copies.append(time.perf_counter() - start)
                if setting == "prefetched" and memory is not None:
                    memory.prefetch(_address(made), made.nbytes)
                del host
            del made
            mx.synchronize()
            # a decode-sized matrix-vector product beside a kernel that takes the freed buffer
            start = time.perf_counter()
            out = source * 0.9999
            product = vector @ weights
            mx.eval(out, product)
            elapsed = time.perf_counter() - start
            if round_ >= 5:
                times[setting].append(elapsed)
            del out, product
    hints = memory is not None
    print(f"device {mx.default_device()}, {args.mib} MiB buffers, {args.rounds} rounds, hints: {hints}")
    for setting, values in times.items():
        q = np.percentile(np.array(values) * 1e3, [25, 50, 75])
        print(f"{setting:>11}: kernel {q[1]:.3f} ms (quartiles {q[0]:.3f}..{q[2]:.3f})")
    q = np.percentile(np.array(copies) * 1e3, [25, 50, 75])
    print(f"  host copy: {q[1]:.3f} ms (quartiles {q[0]:.3f}..{q[2]:.3f})")


if __name__ == "__main__":
    main()
