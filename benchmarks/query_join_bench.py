"""Why a snapshot with queries costs the generating thread ~5 ms more on CUDA: one
snapshot every 16 tokens of a 36-layer model joins 36 x 16 = 576 query pieces ``(1, heads, 1,
dim)``. Times, in the calling thread, building and launching (``async_eval``) the join of N
pieces with ``mx.concatenate`` (one copy kernel per piece) and with `capture.gather.join` (one
custom kernel launch per 64 pieces; its first call compiles, or loads mlx's on-disk cache), and
the wait for the result. Needs mlx's CUDA backend.

    python -m benchmarks.query_join_bench [--heads 32] [--dim 128] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from kvsnap.capture import gather


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    for count in (1, 72, 576):
        pieces = [mx.random.normal((1, args.heads, 1, args.dim)).astype(mx.bfloat16) for _ in range(count)]
        mx.eval(pieces)
        launch, wait = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            joined = mx.concatenate(pieces, axis=2)
            mx.async_eval(joined)
            middle = time.perf_counter()
            mx.eval(joined)
            launch.append(middle - start)
            wait.append(time.perf_counter() - middle)
        # The pieces as generation makes them: on mlx-lm's own stream, then joined on the default
        # stream (a cross-stream dependency per piece) or on that same stream.
        other = mx.new_stream(mx.default_device())
        with mx.stream(other):
            made = [piece * 1 for piece in pieces]
        mx.eval(made)
        cross = []
        for stream in (mx.default_stream(mx.default_device()), other):
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                with mx.stream(stream):
                    joined_there = mx.concatenate(made, axis=2)
                    mx.async_eval(joined_there)
                times.append(time.perf_counter() - start)
                mx.eval(joined_there)
            cross.append(statistics.median(times))
        line = (
            f"N={count:4d} pieces from another stream, joined on the default stream "
            f"{cross[0] * 1e3:.3f} ms, on theirs {cross[1] * 1e3:.3f} ms; "
            f"concatenate: build+launch {statistics.median(launch) * 1e3:.3f} ms "
            f"(per piece {statistics.median(launch) / count * 1e6:.1f} us), "
            f"wait {statistics.median(wait) * 1e3:.3f} ms"
        )
        times = []
        for round_ in range(args.rounds + 1):
            start = time.perf_counter()
            out = gather.join(pieces, gather=True)
            mx.async_eval(out)
            elapsed = time.perf_counter() - start
            mx.eval(out)
            if round_ == 0:
                first = elapsed
                assert mx.array_equal(out, joined).item(), "gather kernel differs from concatenate"
            else:
                times.append(elapsed)
        line += f"; gather.join: first {first * 1e3:.1f} ms, then {statistics.median(times) * 1e3:.3f} ms"
        print(line, flush=True)


if __name__ == "__main__":
    main()
