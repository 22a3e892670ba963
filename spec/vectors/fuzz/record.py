"""Add inputs that a fuzzer found to the committed fuzz corpus (spec/vectors/fuzz/).

    python spec/vectors/fuzz/record.py --covers "what it found" FILE [FILE...]

Each FILE is copied in under the first 16 hex digits of its SHA-256 and listed in
``manifest.json`` (the format of spec/vectors/manifest.json) with what the reference reader
describes: the error category it must produce, or its description. Entries are only ever
added: a corpus file is never regenerated, so `kvsnap conformance spec/vectors/fuzz [--reader
CMD]` replays every input any fuzzer has found, with every reader.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

from kvsnap.cli.conformance import describe

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument(
        "--covers", required=True, help="what the inputs found (a crash, a disagreement, ...)"
    )
    args = parser.parse_args()
    manifest_path = HERE / "manifest.json"
    manifest = json.loads(manifest_path.read_text("utf-8")) if manifest_path.exists() else {"vectors": []}
    listed = {entry["file"] for entry in manifest["vectors"]}
    for source in args.files:
        name = hashlib.sha256(source.read_bytes()).hexdigest()[:16] + ".kv"
        if name in listed:
            continue
        shutil.copyfile(source, HERE / name)
        manifest["vectors"].append({"file": name, "covers": args.covers, "expect": describe(HERE / name)})
        listed.add(name)
        print(f"added {name}: {manifest['vectors'][-1]['expect'].get('error', 'a valid file')}")
    manifest_path.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", "utf-8")


if __name__ == "__main__":
    main()
