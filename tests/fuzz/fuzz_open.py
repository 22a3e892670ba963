"""atheris (libFuzzer) target: open + full read + verify of arbitrary bytes must raise nothing but
`kvformat.KVFormatError`. Seed corpus: the conformance vectors.

    pip install atheris
    mkdir -p /tmp/kv-corpus && cp spec/vectors/*.kv spec/vectors/bad/*.kv /tmp/kv-corpus/
    python tests/fuzz/fuzz_open.py /tmp/kv-corpus -max_total_time=300 -rss_limit_mb=2048 -timeout=10

Any crash it finds goes into spec/vectors/bad/ (through generate.py) with the error to expect.
"""

from __future__ import annotations

import io
import sys

import atheris

with atheris.instrument_imports():
    import numpy as np

    import kvformat


def test_one_input(data: bytes) -> None:
    try:
        with kvformat.open(io.BytesIO(data), snapshot=0) as first:
            for index in range(first.num_snapshots):
                snap = first.select(index)
                for head in (h for seq in range(snap.num_seqs) for h in snap.heads(seq)):
                    np.asarray(head.k).sum()
                    np.asarray(head.v).sum()
                for name in snap.array_names:
                    snap.array(name)
            first.verify()
    except kvformat.KVFormatError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
