"""Which file of an mlx-lm model folder keeps it from loading.

mlx-lm and the tokenizer libraries report a damaged folder with their own messages, which often
name no file (``'utf-8' codec can't decode byte 0x89``). `broken_file` reads the folder's JSON
files and the headers of its safetensors files, the ones a load reads first, and names the first
that is not what it claims to be.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one


def broken_file(folder: str | Path) -> str | None:
    """``"<file>: <what is wrong>"`` for the first JSON or safetensors file of ``folder`` that
    does not parse, a missing ``config.json``, or None when every one does."""
    root = Path(folder)
    if not (root / "config.json").is_file():
        return f"{root / 'config.json'}: missing (not an mlx-lm model folder)"
    for path in sorted(root.glob("*.json")):
        problem = _json_problem(path)
        if problem:
            return f"{path}: {problem}"
    for path in sorted(root.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            return f"{path}: {problem}"
    return None


def _json_problem(path: Path) -> str | None:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): not a JSON file"
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc.msg}, line {exc.lineno})"
    return None


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    with path.open("rb") as f:
        start = f.read(8)
        if len(start) < 8:
            return f"{size} bytes: too short for a safetensors file"
        (length,) = struct.unpack("<Q", start)
        if length > min(size - 8, _MAX_HEADER):
            return "not a safetensors file (its first 8 bytes give no header that fits the file)"
        header = f.read(length)
    try:
        parsed = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "not a safetensors file (its header is not JSON)"
    if not isinstance(parsed, dict):
        return "not a safetensors file (its header is not a JSON object)"
    return None
