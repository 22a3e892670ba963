"""The format's own commands: ``info``, ``verify``, ``recover``, ``pack``, ``import`` (also named
``import-mlxkv``), ``describe``, ``conformance`` and ``dump`` (`register` declares them; each runs
through its options dataclass). They need kvformat and numpy only, never a stage."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvformat
from kvformat import KVFormatError, channel_order, codecs, dtypes
from kvformat import state as stored_state
from kvformat.errors import InvalidArgumentError
from kvformat.io import check_output, output_format, output_path
from kvsnap.arguments import non_negative_int, positive_int, remote_options, storage_options, typed
from kvsnap.errors import CommandError


@dataclass(frozen=True)
class FileOptions:
    """A command's file or URL and its ``--storage-option``s, typed (`kvsnap.arguments.typed`):
    the options of ``verify`` and ``describe``, and the first of ``info``'s and ``dump``'s."""

    file: str = ""
    storage_option: list[str] | None = None


@dataclass(frozen=True)
class InfoOptions(FileOptions):
    """``kvsnap info``'s options, typed."""

    snapshot: int = -1
    json: bool = False


@dataclass(frozen=True)
class RecoverOptions:
    """``kvsnap recover``'s options, typed."""

    file: str = ""
    output: str | None = None
    force: bool = False


@dataclass(frozen=True)
class PackOptions:
    """``kvsnap pack``'s options, typed."""

    input: str = ""
    output: str = ""
    codec: str = "raw"
    chunk_tokens: int | None = None
    dtype: str | None = None
    force: bool = False


@dataclass(frozen=True)
class ImportOptions:
    """``kvsnap import``'s options, typed."""

    source: str = ""
    output: str | None = None
    format: str | None = None
    bundle: str | None = None
    list: bool = False
    codec: str = "raw"
    force: bool = False


@dataclass(frozen=True)
class DescribeOptions:
    """``kvsnap describe``'s options, typed."""

    files: list[str] = field(default_factory=list)
    storage_option: list[str] | None = None


@dataclass(frozen=True)
class ConformanceOptions:
    """``kvsnap conformance``'s options, typed."""

    directory: str = ""
    reader: str | None = None
    batch: bool = False


@dataclass(frozen=True)
class DumpOptions(FileOptions):
    """``kvsnap dump``'s options, typed."""

    layer: int = 0
    head: int = 0
    seq: int = 0
    snapshot: int = -1
    output: str = ""
    force: bool = False


def _describe(snap: kvformat.Snapshot) -> dict[str, Any]:
    layers = []
    for i, spec in enumerate(snap.layers):
        entry: dict[str, Any] = {"layer": i, **spec.to_json()}
        if "state" in spec.attributes:
            entry["state_bytes"] = _state_bytes(snap, i)
        if spec.present:
            positions = snap.positions(i, 0, 0)
            assert positions is not None
            entry["tokens"] = int(positions.size)
            entry["first_position"] = int(positions[0]) if positions.size else None
            entry["last_position"] = int(positions[-1]) if positions.size else None
            if spec.queries is not None:
                held = snap.queries(i, 0, 0)
                assert held is not None
                entry["query_count"] = int(held.positions.size)
                entry["query_spans"] = _spans(held.positions)
                chosen = snap.selection(i, 0)
                if chosen is not None:  # sparse attention (1.7): positions whose keys an indexer chose
                    entry["selection_count"] = int(chosen.positions.size)
        layers.append(entry)
    return {
        "file": snap.name,
        "version": f"{snap.version[0]}.{snap.version[1]}",
        "snapshot": snap.index,
        "num_snapshots": snap.num_snapshots,
        "num_layers": snap.num_layers,
        "num_heads": snap.num_heads,
        "head_dim": snap.head_dim,
        "num_seqs": snap.num_seqs,
        "seq_len": snap.seq_len,
        "num_chunks": snap.num_chunks,
        "metadata": snap.metadata,
        "snapshot_metadata": snap.snapshot_metadata,
        "incomplete": snap.describe_incomplete() or None,
        "layers": layers,
    }


def _spans(positions: Any) -> list[list[int]]:
    """Increasing positions as ``[start, stop)`` runs."""
    runs: list[list[int]] = []
    for p in positions.tolist():
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return runs


def _open(options: FileOptions, snapshot: int = -1) -> kvformat.Snapshot:
    """The file or URL of a command, with its ``--storage-option``s."""
    return kvformat.open(options.file, snapshot, storage_options=storage_options(options.storage_option))


def _info(args: argparse.Namespace) -> int:
    options = typed(InfoOptions, args)
    with _open(options, options.snapshot) as snap:
        description = _describe(snap)
    if options.json:
        print(json.dumps(description, indent=2, ensure_ascii=False))
        return 0
    d = description
    count = d["num_snapshots"]
    print(f"{d['file']}: .kv v{d['version']}, snapshot {d['snapshot']} of {count} (numbered 0..{count - 1})")
    print(
        f"  {d['num_layers']} layers, {d['num_heads']} KV heads, head_dim {d['head_dim']}, "
        f"{d['num_seqs']} sequence(s), seq_len {d['seq_len']}, {d['num_chunks']} chunks"
    )
    if d["incomplete"]:
        print(f"  INCOMPLETE: {d['incomplete']} (its heads' rows are refused)")
    state = sum(layer.get("state_bytes", 0) for layer in d["layers"])
    if state:
        print(
            f"  recurrent state: {_size(state)} in this snapshot, stored whole in each (it changes every "
            "token, so snapshots do not share it)"
        )
    for line in _metadata_lines(d["metadata"]) + _snapshot_lines(d["snapshot_metadata"]):
        print(f"  {line}")
    for first, last, layer in _layer_runs(d["layers"]):
        which = f"layer {first:3d}" if first == last else f"layers {first}-{last}"
        print(f"  {which}: {_layer_line(layer)}")
    return 0


def _metadata_lines(meta: dict[str, Any]) -> list[str]:
    """`info`'s lines for the file's metadata: model, K channel order, import source, generation
    settings, prompt and generated text (each only when recorded)."""
    order = channel_order.describe(meta)
    found = (_model_line(meta), order and f"K channel order: {order}", _source_line(meta))
    lines = [line for line in found if line]
    generation = meta.get("generation")
    if isinstance(generation, dict):
        settings = ", ".join(f"{k} {v}" for k, v in generation.items() if v not in (None, [], ""))
        lines.append(f"generation: {settings}")
    for label, text in (("prompt", meta.get("prompt")), ("generated", meta.get("generated_text"))):
        if isinstance(text, str) and text:
            lines.append(f"{label}: {_shorten(text)}")
    return lines


def _model_line(meta: dict[str, Any]) -> str | None:
    """`info`'s model line: name, architecture, the GGUF file it came from."""
    model = meta.get("model", {})
    if not isinstance(model, dict) or not (model.get("name") or model.get("architecture")):
        return None
    source = model.get("gguf", {}) if isinstance(model.get("gguf"), dict) else {}
    origin = f", from GGUF {source['file']}" if source.get("file") else ""
    return f"model: {model.get('name', '(unnamed)')} ({model.get('architecture', '?')}{origin})"


def _source_line(meta: dict[str, Any]) -> str | None:
    """`info`'s line for an imported file: the foreign file, format, version, size and digest."""
    imported = meta.get("source")
    if not isinstance(imported, dict) or not imported.get("format"):
        return None
    parts = [f"{imported['format']}"]
    if "version" in imported:
        parts[0] += f" version {imported['version']}"
    if "bundles" in imported:
        version = imported.get("block_version", "?")
        parts.append(f"{len(imported['bundles'])} bundle(s), blocks of MLXKV001 version {version}")
    parts.append(f"{imported.get('bytes', '?')} bytes")
    if imported.get("sha256"):
        parts.append(f"sha256 {str(imported['sha256'])[:16]}...")
    return f"imported from: {imported.get('file', '?')} ({', '.join(parts)})"


def _snapshot_lines(meta: dict[str, Any]) -> list[str]:
    """`info`'s lines for the snapshot's own metadata (token id lists left out: `dump` has them)."""
    lines = []
    for key, value in meta.items():
        if key in ("tokens", "tokens_appended"):
            continue
        words = isinstance(value, list) and all(isinstance(v, str) for v in value)
        lines.append(f"this snapshot: {key} {_shorten(' '.join(value) if words else value)}")
    return lines


def _shorten(value: Any, width: int = 100) -> str:
    """One line of at most ``width`` characters (the middle elided), for text in `info`."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= width else f"{text[: width // 2 - 2]} ... {text[-(width // 2 - 3) :]}"


def _layer_line(layer: dict[str, Any]) -> str:
    """A layer's description in `info`: heads, dims, storage (quantization), tokens, kind."""
    attributes = layer.get("attributes") or {}
    state = _state_text(layer)
    if not layer["present"]:
        shown = {k: v for k, v in attributes.items() if k != "state"} if state else attributes
        return f"absent {json.dumps(shown) if shown else ''}{state}".rstrip()
    span = f"positions {layer['first_position']}..{layer['last_position']}" if layer["tokens"] else "empty"
    kind = attributes.get("kind")
    window = f", window {attributes['window']}" if attributes.get("window") else ""
    extra = f", {kind}{window}" if kind else ""
    return (
        f"{layer['num_heads']} heads, k_dim {layer['k_dim']}, v_dim {layer['v_dim']}, {_storage(layer)}, "
        f"{layer['tokens']} tokens ({span}){extra}{_queries_text(layer)}{state}"
    )


def _state_bytes(snap: kvformat.Snapshot, layer: int) -> int:
    """Bytes of recurrent state snapshot ``snap`` stores for ``layer`` (SPEC 15.4): a slot of
    fixed shape as described, a growing one (``null`` axis) as its array holds."""
    try:
        described = stored_state.checked(layer, snap.layers[layer].attributes["state"])
    except KVFormatError:
        return 0
    total = 0
    for slot, entry in enumerate(described):
        for array in stored_state.slot_arrays(layer, slot, entry) if entry is not None else []:
            if array.grows:
                held = snap.array(array.name)
                total += 0 if held is None else int(held.nbytes)
            elif snap.array_chunk(array.name) is not None:
                total += array.nbytes
    return total


def _state_text(layer: dict[str, Any]) -> str:
    """`info`'s words for a layer's recurrent state: each slot's role and shape (``n``: a length
    that grows; ``appended``: a snapshot stores the rows added since its parent), and the bytes
    this snapshot stores; empty for a layer without."""
    entries = (layer.get("attributes") or {}).get("state")
    if not isinstance(entries, list):
        return ""
    slots = [
        f"{e.get('role', 'slot')} {'x'.join('n' if n is None else str(n) for n in e.get('shape', []))}"
        + (f" {e['dtype']}" if e.get("dtype") else "")
        + (" appended" if e.get("append") else "")
        for e in entries
        if isinstance(e, dict)
    ]
    return f"; state {', '.join(slots)} ({_size(layer.get('state_bytes', 0))} in this snapshot)"


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return f"{nbytes:.1f} GiB"


def _storage(layer: dict[str, Any]) -> str:
    """How a layer's K/V are stored: the dtype, or its quantization."""
    quant = layer.get("quantization")
    if not isinstance(quant, dict):
        return str(layer["dtype"])
    groups = f"groups of {quant.get('group_size')}, {layer['dtype']} scales"
    return f"{quant.get('bits')}-bit {quant.get('mode', 'affine')} quantized ({groups})"


def _queries_text(layer: dict[str, Any]) -> str:
    """``; queries: ...`` for a layer holding queries (heads, positions, their first runs), else ""."""
    if not isinstance(layer.get("queries"), dict):
        return ""
    runs = layer.get("query_spans") or []
    where = ", ".join(f"{a}..{b - 1}" if b - a > 1 else f"{a}" for a, b in runs[:4])
    where += f" (+{len(runs) - 4} more runs)" if len(runs) > 4 else ""
    sparse = ""
    if layer["queries"].get("selection") is not None:
        sparse = (
            f"; sparse: {layer.get('selection_count', 0)} of them read {layer['queries']['selection']} "
            "keys an indexer chose"
        )
    return (
        f"; queries: {layer['queries'].get('num_heads')} heads, {layer.get('query_count', 0)} "
        f"positions ({where or 'none'}){sparse}"
    )


def _layer_runs(layers: list[dict[str, Any]]) -> list[tuple[int, int, dict[str, Any]]]:
    """Runs of consecutive layers that `info` would describe with the same line."""
    runs: list[tuple[int, int, dict[str, Any]]] = []
    for layer in layers:
        if runs and _layer_line(runs[-1][2]) == _layer_line(layer):
            runs[-1] = (runs[-1][0], layer["layer"], runs[-1][2])
        else:
            runs.append((layer["layer"], layer["layer"], layer))
    return runs


def _verify(args: argparse.Namespace) -> int:
    options = typed(FileOptions, args)
    with _open(options) as snap:
        report = snap.verify()
    print(
        f"{options.file}: OK — {report.records} records, {report.chunks} chunks, "
        f"{report.snapshots} snapshot(s), {report.bytes_checked} bytes checked"
    )
    return 0


def _recover(args: argparse.Namespace) -> int:
    options = typed(RecoverOptions, args)
    report = kvformat.recover(options.file, options.output, overwrite=options.force, force=options.force)
    if report.path is None:
        print(f"{options.file} is complete and valid: nothing to recover, nothing written")
        return 0
    extra = (
        ", the last rebuilt from chunks written after the last commit" if report.recovered_snapshot else ""
    )
    print(
        f"wrote {report.path}: {report.chunks} chunks, {report.snapshots} snapshot(s){extra}; "
        f"{report.bytes_dropped} incomplete bytes of {options.file} left out ({options.file} unchanged)"
    )
    if report.rows_left_out:
        print(f"note: {report.describe_cut()}")
    return 0


def _pack(args: argparse.Namespace) -> int:
    options = typed(PackOptions, args)
    check_output(options.output, inputs=[options.input], force=options.force)
    with _open_npz(options.input) as npz:
        names = set(npz.files)
        layer_ids = sorted({int(n[3:]) for n in names if n.startswith(("k_L", "v_L")) and n[3:].isdigit()})
        if not layer_ids:
            raise CommandError(f"{options.input}: no arrays named k_L<layer> / v_L<layer>")
        layers = [_npz_layer(npz, layer, options) for layer in range(layer_ids[-1] + 1)]
    row_bytes = max(max(l.k.shape[2], l.v.shape[2]) * l.k.dtype.itemsize for l in layers if l)
    chunk_bytes = options.chunk_tokens * row_bytes if options.chunk_tokens else kvformat.DEFAULT_CHUNK_BYTES
    kvformat.save(
        options.output,
        layers,
        codec=options.codec,
        chunk_bytes=chunk_bytes,
        metadata={"source": {"npz": str(options.input)}},
        overwrite=options.force,
    )
    print(f"wrote {options.output}")
    return 0


def _stored(array: np.ndarray, name: str, options: PackOptions) -> np.ndarray:
    """`pack`'s ``array`` in a dtype .kv stores: uint16 read as bfloat16 bits, ``--dtype`` converts,
    any other dtype is refused naming the array."""
    stored = {np.dtype(d.numpy) for d in dtypes.BY_NAME.values()} | {np.dtype(np.uint16)}
    if not options.dtype and array.dtype not in stored:
        raise CommandError(
            f"{options.input}: {name} is {array.dtype}, which .kv does not store: "
            f"pass --dtype {' or '.join(sorted(dtypes.BY_NAME))} to convert"
        )
    if array.dtype != np.uint16 and not options.dtype:
        return array
    target = dtypes.from_name(options.dtype or "bfloat16").numpy
    return array.view(target) if array.dtype == np.uint16 else array.astype(target)


def _open_npz(path: str) -> Any:
    """``path`` as an open `numpy.lib.npyio.NpzFile` (no pickles), or a ValueError naming it."""
    try:
        npz_file = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError):
        raise InvalidArgumentError(f"{path}: not an .npz file of arrays (k_L<i>/v_L<i>)") from None
    if not isinstance(npz_file, np.lib.npyio.NpzFile):
        raise InvalidArgumentError(f"{path}: a single array, not an .npz of k_L<i>/v_L<i> arrays")
    return npz_file


def _npz_layer(npz: Any, layer: int, options: PackOptions) -> kvformat.Layer | None:
    """Layer ``layer`` of `pack`'s input: ``k_L<i>``/``v_L<i>`` ``(heads, tokens, head_dim)``
    (uint16 read as bfloat16 bits, other dtypes only with ``--dtype``), ``positions_L<i>`` if
    present; None when neither array is there."""
    names = set(npz.files)
    if f"k_L{layer}" not in names and f"v_L{layer}" not in names:
        return None
    if f"k_L{layer}" not in names or f"v_L{layer}" not in names:
        raise CommandError(f"{options.input}: layer {layer} needs both k_L{layer} and v_L{layer}")
    k, v = (_stored(npz[f"{name}_L{layer}"], f"{name}_L{layer}", options) for name in ("k", "v"))
    if k.ndim != 3 or v.ndim != 3:
        raise CommandError(f"{options.input}: layer {layer} arrays must be (heads, tokens, head_dim)")
    positions = npz[f"positions_L{layer}"] if f"positions_L{layer}" in names else None
    return kvformat.Layer(k, v, positions)


def _import(args: argparse.Namespace) -> int:
    from kvformat.importers import for_source

    options = typed(ImportOptions, args)
    importer = for_source(options.source, options.format)
    if options.list:
        print("\n".join(importer.listing(options.source)))
        return 0
    if options.output is None:
        raise CommandError(
            f"{args.command}: give the output .kv file (or --list to see what the source holds)"
        )
    check_output(options.output, inputs=[options.source], force=options.force)
    done = importer.convert(
        options.source, options.output, codec=options.codec, overwrite=options.force, bundle=options.bundle
    )
    print(f"wrote {done.path}: {done.summary}")
    return 0


def _describe_command(args: argparse.Namespace) -> int:
    from kvsnap.cli.conformance import describe

    options = typed(DescribeOptions, args)
    storage = storage_options(options.storage_option)
    for file in options.files:  # a line each (the conformance runner's --batch)
        print(json.dumps(describe(file, storage_options=storage), ensure_ascii=False), flush=True)
    return 0


def _conformance(args: argparse.Namespace) -> int:
    from kvsnap.cli.conformance import run

    options = typed(ConformanceOptions, args)
    results = run(options.directory, options.reader, batch=options.batch)
    width = max(len(r.name) for r in results) if results else 4
    print(f"{'vector':{width}s}  result")
    for result in results:
        print(f"{result.name:{width}s}  {'pass' if result.passed else 'FAIL ' + result.detail}")
    passed = sum(r.passed for r in results)
    print(f"{passed}/{len(results)} passed ({options.reader or 'kvformat'})")
    return 0 if passed == len(results) else 1


def _dump(args: argparse.Namespace) -> int:
    options = typed(DumpOptions, args)
    check_output(options.output, inputs=[options.file], force=options.force)
    output_format(options.output, ("npz",))
    with _open(options, options.snapshot) as snap:
        head = snap.head(options.layer, options.head, options.seq)
        if head is None:
            raise CommandError(f"{options.file}: layer {options.layer} is absent from this snapshot")
        with (
            output_path(options.output, inputs=[options.file], force=options.force) as temporary,
            open(temporary, "xb") as f,
        ):  # a file object: numpy adds no ".npz" to the name given
            np.savez(f, k=head.k.astype(np.float32), v=head.v.astype(np.float32), positions=head.positions)
    print(f"wrote {options.output}: k {head.k.shape}, v {head.v.shape}, float32")
    return 0


def _info_parser(sub: Any) -> None:
    """``kvsnap info``'s arguments."""
    p = sub.add_parser("info", help="describe a .kv file (reads only its index)")
    p.add_argument("file")
    remote_options(p)
    p.add_argument("--snapshot", type=int, default=-1, help="which snapshot of a series (default: last)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_info)


def _verify_parser(sub: Any) -> None:
    """``kvsnap verify``'s arguments."""
    p = sub.add_parser("verify", help="check every checksum and rule of a .kv file")
    p.add_argument("file")
    remote_options(p)
    p.set_defaults(func=_verify)


def _recover_parser(sub: Any) -> None:
    """``kvsnap recover``'s arguments."""
    p = sub.add_parser(
        "recover", help="write a valid copy of FILE.kv.partial left by a crashed writer (FILE is only read)"
    )
    p.add_argument("file")
    p.add_argument(
        "-o", "--output", help="output path (default: X.partial -> X; any other X.kv -> X.recovered.kv)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output file; recover a .partial that a live writer still holds",
    )
    p.set_defaults(func=_recover)


def _pack_parser(sub: Any) -> None:
    """``kvsnap pack``'s arguments."""
    p = sub.add_parser("pack", help="convert an .npz of k_L<i>/v_L<i> (heads, tokens, dim) arrays")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--codec", default="raw", help=f"one of {', '.join(codecs.NAMES)} (zstd:LEVEL too)")
    p.add_argument("--chunk-tokens", type=positive_int, default=None, help="tokens per chunk")
    p.add_argument("--dtype", choices=sorted(dtypes.BY_NAME), help="convert arrays to this dtype")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.set_defaults(func=_pack)


def _import_parser(sub: Any) -> None:
    """``kvsnap import``'s arguments."""
    p = sub.add_parser(
        "import",
        aliases=["import-mlxkv"],
        help="convert a foreign KV-cache file to .kv (its format found by its first bytes): go-mlx's "
        "MLXKV001 snapshots (versions 1-6), State logs (.mvlog), KVST containers, bundle manifests",
    )
    p.add_argument(
        "source", help="the foreign file (MLXKV001, .mvlog State log, KVST container, manifest JSON)"
    )
    p.add_argument(
        "output", nargs="?", help="the .kv file to write (one snapshot per bundle, in write order)"
    )
    p.add_argument(
        "--format", metavar="NAME", help="the importer to use, not the one the file's first bytes name"
    )
    p.add_argument("--bundle", metavar="URI", help="import only this bundle (the last one with this URI)")
    p.add_argument(
        "--list", action="store_true", help="print the bundles (URI, tokens, blocks) and write nothing"
    )
    p.add_argument("--codec", default="raw", help=f"one of {', '.join(codecs.NAMES)} (zstd:LEVEL too)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.set_defaults(func=_import)


def _describe_parser(sub: Any) -> None:
    """``kvsnap describe``'s arguments."""
    p = sub.add_parser("describe", help="the conformance description of a file (JSON; see spec/vectors)")
    p.add_argument("files", nargs="+", metavar="file", help="one or more; a JSON line each")
    remote_options(p)
    p.set_defaults(func=_describe_command)


def _conformance_parser(sub: Any) -> None:
    """``kvsnap conformance``'s arguments."""
    p = sub.add_parser("conformance", help="check a reader against spec/vectors/manifest.json")
    p.add_argument("directory")
    p.add_argument("--reader", help="command; 'CMD FILE' prints the description JSON (default: kvformat)")
    p.add_argument(
        "--batch",
        action="store_true",
        help="run the reader once: 'CMD FILE...' prints one description a line, in order",
    )
    p.set_defaults(func=_conformance)


def _dump_parser(sub: Any) -> None:
    """``kvsnap dump``'s arguments."""
    p = sub.add_parser("dump", help="write one head's K, V (float32) and positions to .npz")
    p.add_argument("file")
    remote_options(p)
    p.add_argument("--layer", type=non_negative_int, required=True, help="layer index (0-based)")
    p.add_argument("--head", type=non_negative_int, required=True, help="KV head index within the layer")
    p.add_argument("--seq", type=non_negative_int, default=0, help="sequence of a batch (default 0)")
    p.add_argument(
        "--snapshot", type=int, default=-1, help="which snapshot of a series (default: -1, the last)"
    )
    p.add_argument("-o", "--output", required=True, help="the .npz file to write (the exact name given)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.set_defaults(func=_dump)


PARSERS = (
    _info_parser,
    _verify_parser,
    _recover_parser,
    _pack_parser,
    _import_parser,
    _describe_parser,
    _conformance_parser,
    _dump_parser,
)
"""The format commands' parser declarations, in the order ``kvsnap --help`` lists them."""


def register(sub: Any) -> None:
    """Add the format's commands (`PARSERS`) to the ``kvsnap`` subparsers ``sub``."""
    for declare in PARSERS:
        declare(sub)
