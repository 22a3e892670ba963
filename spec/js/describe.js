#!/usr/bin/env node
// An independent reader of the kvsnap .kv format, written from spec/SPEC.md: prints the
// conformance description of a file (SPEC section 17), or {"error": CATEGORY} when the file
// breaks a rule of section 13. The binary layout (header, footer, descriptors) is parsed by
// Kv.js, which the Kaitai Struct compiler generates from spec/kv.ksy; everything else (CRC-32C,
// the JSON text rules, codecs, dtypes, quantization, snapshots, the order of checks of section
// 13.1) is here. Dependencies: kaitai-struct (runtime of Kv.js) and fzstd (Zstandard decoder).
//
//   node spec/js/describe.js FILE
"use strict";

const fs = require("fs");
const crypto = require("crypto");
const KaitaiStream = require("kaitai-struct/KaitaiStream");
const { Kv } = require("./Kv.js");
const fzstd = require("fzstd");

const TRUNCATED = "TruncatedFileError";
const CORRUPT = "CorruptFileError";
const CHECKSUM = "ChecksumError";
const LIMIT = "LimitExceededError";
const VERSION = "UnsupportedVersionError";
const FEATURE = "UnsupportedFeatureError";

class KvError extends Error {
  constructor(category, message) {
    super(message);
    this.category = category;
  }
}
function fail(category, message) {
  throw new KvError(category, message);
}

// -- limits and codes (sections 4-10, 13) ------------------------------------------------------
const MINOR = 8;  // the version this reader implements
const LAST_STRICT_MINOR = 6;  // unknown record kinds are refused in files up to this minor (5.2)
const MAGIC = Buffer.from([0x89, 0x4b, 0x56, 0x53, 0x0d, 0x0a, 0x1a, 0x0a]);
const MAX_CHUNK_COUNT = 2 ** 28;
const MAX_JSON_SIZE = 256 * 1024 * 1024;
const MAX_CHUNK_DECODED = 2 ** 31;
const MAX_ROWS = 2 ** 31;
const MAX_WIDTH = 2 ** 20;
const MAX_LAYERS = 2 ** 16;
const MAX_HEADS = 2 ** 16;
const MAX_SEQS = 2 ** 20;
const MAX_HEAD_SEQUENCES = 2 ** 24;
const MAX_POSITION = 2 ** 53;
const K = 0, V = 1, ARRAY = 2, Q = 3, SELECTION = 4, MANIFEST = 16, SNAPSHOT = 17;
const DTYPES = { 1: ["float32", 4], 2: ["float16", 2], 3: ["bfloat16", 2], 4: ["int32", 4] };  // int32: selections only
const DTYPE_CODES = { float32: 1, float16: 2, bfloat16: 3 };
const CODECS = [0, 1, 2];
const FEATURES = new Set([
  "append-chunks", "queries", "chunked-attention", "latent-attention", "sparse-attention", "pooled-attention",
]);
const BITS = [2, 4, 8];
const GROUP_SIZES = [32, 64, 128];

// -- CRC-32C (section 2) ---------------------------------------------------------------------
const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0x82f63b78 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();
function crc32c(bytes, crc = 0) {
  let c = ~crc >>> 0;
  for (let i = 0; i < bytes.length; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return ~c >>> 0;
}

// -- JSON text (section 2): integers kept apart from other numbers, names unique ---------------
// Integers (no fraction, no exponent) parse to BigInt, other numbers to Number; so `1.0` is not
// an integer, as in the reference reader.
function parseJson(text, what) {
  let i = 0;
  const bad = (why) => fail(CORRUPT, `${what} is not valid JSON: ${why} at ${i}`);
  const space = () => {
    while (i < text.length && " \t\n\r".includes(text[i])) i++;
  };
  const value = (depth) => {
    if (depth > 900) bad("nested too deeply");
    space();
    const c = text[i];
    if (c === "{") return object(depth);
    if (c === "[") return array(depth);
    if (c === '"') return string();
    if (text.startsWith("true", i)) return (i += 4), true;
    if (text.startsWith("false", i)) return (i += 5), false;
    if (text.startsWith("null", i)) return (i += 4), null;
    return number();
  };
  const object = (depth) => {
    i++;
    const out = new Map();
    space();
    if (text[i] === "}") return i++, out;
    for (;;) {
      space();
      if (text[i] !== '"') bad("expected a name");
      const name = string();
      if (out.has(name)) fail(CORRUPT, `${what}: an object holds the name ${JSON.stringify(name)} twice`);
      space();
      if (text[i] !== ":") bad("expected ':'");
      i++;
      out.set(name, value(depth + 1));
      space();
      if (text[i] === ",") i++;
      else if (text[i] === "}") return i++, out;
      else bad("expected ',' or '}'");
    }
  };
  const array = (depth) => {
    i++;
    const out = [];
    space();
    if (text[i] === "]") return i++, out;
    for (;;) {
      out.push(value(depth + 1));
      space();
      if (text[i] === ",") i++;
      else if (text[i] === "]") return i++, out;
      else bad("expected ',' or ']'");
    }
  };
  const string = () => {
    i++;
    let out = "";
    for (;;) {
      if (i >= text.length) bad("unterminated string");
      const c = text[i];
      const code = text.charCodeAt(i);
      if (c === '"') return i++, out;
      if (code < 0x20) bad("control character in a string");
      if (c !== "\\") {
        out += c;
        i++;
        continue;
      }
      const e = text[i + 1];
      const simple = { '"': '"', "\\": "\\", "/": "/", b: "\b", f: "\f", n: "\n", r: "\r", t: "\t" };
      if (e in simple) {
        out += simple[e];
        i += 2;
        continue;
      }
      if (e !== "u") bad("bad escape");
      const hex = text.slice(i + 2, i + 6);
      if (!/^[0-9a-fA-F]{4}$/.test(hex)) bad("bad \\u escape");
      const unit = parseInt(hex, 16);
      i += 6;
      if (unit >= 0xd800 && unit <= 0xdbff && text[i] === "\\" && text[i + 1] === "u") {
        const low = parseInt(text.slice(i + 2, i + 6), 16);
        if (low >= 0xdc00 && low <= 0xdfff) {
          out += String.fromCharCode(unit, low);
          i += 6;
          continue;
        }
      }
      if (unit >= 0xd800 && unit <= 0xdfff) fail(CORRUPT, `${what} holds an unpaired UTF-16 surrogate escape`);
      out += String.fromCharCode(unit);
    }
  };
  const number = () => {
    const match = /^-?(?:0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?/.exec(text.slice(i, i + 400));
    if (!match) bad("unexpected character");
    i += match[0].length;
    if (match[1] === undefined && match[2] === undefined) return BigInt(match[0]);
    const n = Number(match[0]);
    if (!Number.isFinite(n)) fail(CORRUPT, `${what}: number ${match[0]} is out of the range of a double`);
    return n;
  };
  const result = value(0);
  space();
  if (i !== text.length) bad("extra data");
  return result;
}

function decodeText(bytes, what) {
  try {
    return new TextDecoder("utf-8", { fatal: true, ignoreBOM: true }).decode(bytes);
  } catch (e) {
    return fail(CORRUPT, `${what} is not valid UTF-8`);
  }
}

const isInt = (x) => typeof x === "bigint";
const isObject = (x) => x instanceof Map;
const isNumber = (x) => typeof x === "number" || typeof x === "bigint";
const get = (map, key, fallback) => (map.has(key) ? map.get(key) : fallback);

// A JSON value as plain data for the description (BigInt kept exact through `dump`).
function plain(x) {
  if (isObject(x)) {
    const out = {};
    for (const [k, v] of x) out[k] = plain(v);
    return out;
  }
  if (Array.isArray(x)) return x.map(plain);
  return x;
}
function dump(x) {
  if (typeof x === "bigint") return x.toString();
  if (Array.isArray(x)) return "[" + x.map(dump).join(",") + "]";
  if (x !== null && typeof x === "object") {
    return "{" + Object.entries(x).map(([k, v]) => JSON.stringify(k) + ":" + dump(v)).join(",") + "}";
  }
  return JSON.stringify(x);
}

// -- the manifest (sections 6.1, 10, 10.1) -----------------------------------------------------
function integer(obj, key, low, high, where, fallback) {
  const value = obj.has(key) ? obj.get(key) : fallback;
  if (!isInt(value)) fail(CORRUPT, `${where}: '${key}' must be an integer`);
  if (value < BigInt(low) || value > BigInt(high)) fail(LIMIT, `${where}: '${key}' = ${value} outside ${low}..${high}`);
  return Number(value);
}
function object(value, where) {
  if (!isObject(value)) fail(CORRUPT, `${where} must be a JSON object`);
  return value;
}
function strings(value, where) {
  if (!Array.isArray(value) || !value.every((v) => typeof v === "string")) fail(CORRUPT, `${where} must be a list of strings`);
  return value;
}
function dtypeOf(name) {
  if (!(name in DTYPE_CODES)) fail(FEATURE, `unknown dtype ${name}`);
  return DTYPE_CODES[name];
}

function parseQuantization(q, where) {
  if (q === undefined) return null;  // absent; null is no absence: the key is typed "object" (section 10)
  if (q === null) fail(CORRUPT, `${where}: 'quantization' must be an object`);
  if (!isObject(q)) fail(CORRUPT, "layer 'quantization' must be an object");
  const mode = get(q, "mode");
  if (typeof mode !== "string") fail(CORRUPT, `${where}: quantization mode must be a string`);
  if (mode !== "affine") fail(FEATURE, "unknown quantization mode");
  const bits = get(q, "bits"), group = get(q, "group_size");
  // outside the sets of section 6.1: corrupt (R6); only an unknown mode is a feature
  if (!isInt(bits) || !BITS.includes(Number(bits))) fail(CORRUPT, "quantized bits");
  if (!isInt(group) || !GROUP_SIZES.includes(Number(group))) fail(CORRUPT, "quantization group size");
  return { mode: "affine", bits: Number(bits), group_size: Number(group) };
}

function parseKeep(q, where) {
  if (!q.has("keep")) return 0;
  const keep = q.get("keep");
  if (!isInt(keep) || keep < 0n || keep > BigInt(MAX_POSITION)) fail(CORRUPT, `${where}: queries keep`);
  return Number(keep);
}

function parseQueries(q, where, kvHeads, dims) {
  if (q === undefined) return null;  // absent; null is no absence: the key is typed "object" (section 10)
  if (q === null) fail(CORRUPT, `${where}: 'queries' must be an object`);
  object(q, `${where} queries`);
  const name = get(q, "dtype");
  if (typeof name !== "string") fail(CORRUPT, "queries dtype must be a string");
  const number = (key, optional) => {
    const value = get(q, key, null);
    if (value === null && optional) return null;
    if (!isNumber(value)) fail(CORRUPT, `queries '${key}' must be a number`);
    return value;
  };
  const kv = get(q, "kv_heads"), sinks = get(q, "sinks", null), window = get(q, "window", null);
  if (!Array.isArray(kv) || (sinks !== null && !Array.isArray(sinks))) fail(CORRUPT, "queries kv_heads / sinks");
  if (window !== null && !isInt(window)) fail(CORRUPT, "queries window");
  if (sinks !== null && !sinks.every(isNumber)) fail(CORRUPT, "queries sinks");
  const scale = number("scale", false);
  const spec = {
    num_heads: integer(q, "num_heads", 1, MAX_HEADS, `${where} queries`),
    dim: integer(q, "dim", 1, MAX_WIDTH, `${where} queries`),
    dtype: name,
    code: dtypeOf(name),
    scale,
    kv_heads: kv,
    window,
    keep: parseKeep(q, where),
    softcap: number("softcap", true),
    sinks,
    chunk: get(q, "chunk", null),  // 1.6
    latent: get(q, "latent", false),  // 1.6
    selection: get(q, "selection", null),  // 1.7
    pooled: parsePooled(q, where),  // 1.8
  };
  const chunk = spec.chunk;
  if (chunk !== null && !isInt(chunk)) fail(CORRUPT, "queries chunk");
  if (typeof spec.latent !== "boolean") fail(CORRUPT, "queries latent");
  if (spec.selection !== null && !isInt(spec.selection)) fail(CORRUPT, "queries selection");
  const bad = (why) => fail(CORRUPT, `${where}: queries ${why}`);
  if (kv.length !== spec.num_heads || !kv.every((h) => isInt(h) && h >= 0n && h < BigInt(kvHeads))) bad("kv_heads");
  if (window !== null && (window < 1n || window > BigInt(MAX_POSITION))) bad("window");
  if (window !== null && BigInt(spec.keep) >= window) bad("keep");
  if (chunk !== null && (chunk < 1n || chunk > BigInt(MAX_POSITION))) bad("chunk");
  if (chunk !== null && window !== null) bad("chunk and window");
  if (!(Number(scale) > 0 && Number.isFinite(Number(scale)))) bad("scale");
  if (spec.softcap !== null && !(Number(spec.softcap) > 0 && Number.isFinite(Number(spec.softcap)))) bad("softcap");
  if (sinks !== null && (sinks.length !== spec.num_heads || !sinks.every((x) => Number.isFinite(Number(x))))) bad("sinks");
  if (spec.latent && dims && spec.dim !== dims[0] + dims[1]) bad("latent dim");
  if (spec.selection !== null && (spec.selection < 1n || spec.selection > BigInt(MAX_WIDTH))) bad("selection");
  if (spec.selection !== null) spec.selection = Number(spec.selection);
  const pooled = spec.pooled;
  if (pooled !== null && (pooled.layer < 0n || pooled.layer >= BigInt(MAX_LAYERS) || pooled.ratio < 1n
    || pooled.ratio > BigInt(MAX_POSITION))) bad("pooled");
  if (pooled !== null && spec.latent) bad("pooled and latent");
  if (pooled !== null) spec.pooled = { layer: Number(pooled.layer), ratio: Number(pooled.ratio) };
  return spec;
}

// 1.8: pooled keys another layer holds (an object of two integers; null is no absence)
function parsePooled(q, where) {
  if (!q.has("pooled")) return null;
  const p = q.get("pooled");
  if (!(p instanceof Map) || !isInt(get(p, "layer")) || !isInt(get(p, "ratio"))) {
    fail(CORRUPT, `${where}: queries 'pooled' must be an object of integers 'layer' and 'ratio'`);
  }
  return { layer: p.get("layer"), ratio: p.get("ratio") };
}

function parseLayer(obj, index) {
  const where = `layer ${index}`;
  object(obj, where);
  const attributes = object(get(obj, "attributes", new Map()), `${where} attributes`);
  const present = get(obj, "present", true);
  if (typeof present !== "boolean") fail(CORRUPT, `${where}: 'present' must be true or false`);
  if (!present) return { present: false, attributes };
  const name = get(obj, "dtype");
  if (typeof name !== "string") fail(CORRUPT, `${where}: 'dtype' must be a string`);
  const heads = integer(obj, "num_heads", 1, MAX_HEADS, where);
  const kDim = integer(obj, "k_dim", 1, MAX_WIDTH, where);
  const vDim = integer(obj, "v_dim", 1, MAX_WIDTH, where);
  const code = dtypeOf(name);
  const q = parseQuantization(get(obj, "quantization"), where);
  // the quantization's dims before queries (section 13.1)
  if (q && (kDim % q.group_size || vDim % q.group_size || (kDim * q.bits) % 32 || (vDim * q.bits) % 32)) {
    fail(CORRUPT, `${where}: dims not multiples of the group size`);
  }
  return {
    present: true,
    num_heads: heads,
    k_dim: kDim,
    v_dim: vDim,
    dtype: name,
    code,
    attributes,
    quantization: q,
    queries: parseQueries(get(obj, "queries"), where, heads, [kDim, vDim]),
  };
}

function rowBytes(layer, kind) {
  const dim = kind === K ? layer.k_dim : layer.v_dim;
  const q = layer.quantization;
  const itemsize = DTYPES[layer.code][1];
  if (!q) return dim * itemsize;
  return 4 * ((dim * q.bits) / 32) + 2 * (dim / q.group_size) * itemsize;
}

function parseManifest(obj) {
  object(obj, "manifest");
  const required = strings(get(obj, "required_features", []), "required_features");
  const unknown = required.filter((f) => !FEATURES.has(f));
  if (unknown.length) fail(FEATURE, `file requires features this reader lacks: ${unknown}`);
  const layersJson = get(obj, "layers");
  if (!Array.isArray(layersJson)) fail(CORRUPT, "manifest 'layers' must be a list");
  if (layersJson.length > MAX_LAYERS) fail(LIMIT, "too many layers");
  const layers = layersJson.map(parseLayer);
  const manifest = {
    layers,
    num_seqs: integer(obj, "num_seqs", 1, MAX_SEQS, "manifest"),
    metadata: object(get(obj, "metadata", new Map()), "metadata"),
    required,
    optional: strings(get(obj, "optional_features", []), "optional_features"),
  };
  // KV heads and query heads alike (1.4)
  const heads = (l) => (l.present ? l.num_heads + (l.queries ? l.queries.num_heads : 0) : 0);
  const triples = layers.reduce((n, l) => n + heads(l), 0) * manifest.num_seqs;
  if (triples > MAX_HEAD_SEQUENCES) fail(LIMIT, "too many (layer, head, sequence) triples");
  if (layers.some((l) => l.present && l.queries) && !required.includes("queries")) fail(CORRUPT, "queries not required");
  if (layers.some((l) => l.present && l.queries && l.queries.chunk !== null) && !required.includes("chunked-attention")) {
    fail(CORRUPT, "chunked attention not required");
  }
  if (layers.some((l) => l.present && l.queries && l.queries.latent) && !required.includes("latent-attention")) {
    fail(CORRUPT, "latent attention not required");
  }
  if (layers.some((l) => l.present && l.queries && l.queries.selection !== null) && !required.includes("sparse-attention")) {
    fail(CORRUPT, "sparse attention not required");
  }
  if (layers.some((l) => l.present && l.queries && l.queries.pooled !== null) && !required.includes("pooled-attention")) {
    fail(CORRUPT, "pooled attention not required");
  }
  // 1.8: the pooled layer is another present layer of as many KV heads and the same head dims
  layers.forEach((l, index) => {
    const pooled = l.present && l.queries ? l.queries.pooled : null;
    if (pooled === null) return;
    const source = layers[pooled.layer];
    if (pooled.layer === index || !source || !source.present || source.num_heads !== l.num_heads
      || source.k_dim !== l.k_dim || source.v_dim !== l.v_dim) fail(CORRUPT, `layer ${index}: queries 'pooled' layer`);
  });
  return manifest;
}

// -- snapshots (section 11) ---------------------------------------------------------------------
function ints(value, where) {
  if (!Array.isArray(value) || !value.every(isInt)) fail(CORRUPT, `${where} must be a list of integers`);
  if (value.some((x) => x < 0n || x > BigInt(MAX_POSITION))) fail(CORRUPT, `${where} holds an integer outside 0..2**53`);
  return value.map(Number);
}
function ranges(value, where) {
  const flat = ints(value, where);
  if (flat.length % 2) fail(CORRUPT, `${where} must hold pairs`);
  const out = [];
  for (let i = 0; i < flat.length; i += 2) {
    if (flat[i] >= flat[i + 1]) fail(CORRUPT, `${where}: an empty range`);
    out.push([flat[i], flat[i + 1]]);
  }
  return out;
}
function parseEntry(obj, index, manifest) {
  const where = `snapshot ${index}`;
  object(obj, where);
  const parent = get(obj, "parent", null);
  if (parent !== null && (!isInt(parent) || parent < 0n || parent >= BigInt(index))) fail(CORRUPT, `${where}: parent`);
  const dropsJson = get(obj, "drop", []);
  if (!Array.isArray(dropsJson)) fail(CORRUPT, `${where}: 'drop' must be a list`);
  const drops = dropsJson.map((item) => {
    const d = ints(item, `${where} drop`);
    if (d.length !== 4) fail(CORRUPT, `${where}: a drop is [layer, seq, start, stop]`);
    if (d[0] >= manifest.layers.length || d[1] >= manifest.num_seqs || d[2] > d[3]) fail(CORRUPT, `${where}: drop`);
    return d;
  });
  const append = ints(get(obj, "append", []), `${where} append`);
  if (append.length % 3) fail(CORRUPT, `${where}: 'append' must hold triples`);
  const metadata = get(obj, "metadata", new Map());
  if (!isObject(metadata)) fail(CORRUPT, `${where}: metadata must be an object`);
  const arrays = get(obj, "arrays", new Map());
  if (!isObject(arrays) || ![...arrays.values()].every((v) => isInt(v) && v >= 0n)) fail(CORRUPT, `${where}: arrays`);
  return {
    parent: parent === null ? null : Number(parent),
    drops,
    append,
    metadata,
    arrays,
    appendChunks: ranges(get(obj, "append_chunks", []), `${where} append_chunks`),
    queries: ranges(get(obj, "queries", []), `${where} queries`),
  };
}

// -- the file ---------------------------------------------------------------------------------
function kaitai(bytes, offset, Type) {
  return new Type(new KaitaiStream(bytes.subarray(offset, offset + 64)), null, null);
}

function openFile(data) {
  const size = data.length;
  // 13.1 step 1: the magic where the file has it, then the size, major, header CRC, header_size.
  if (size >= 8 && !data.subarray(0, 8).equals(MAGIC)) fail(CORRUPT, "not a .kv file");
  if (size < 128) fail(TRUNCATED, `${size} bytes is too short for a .kv file`);
  const header = kaitai(data, 0, Kv.Header);
  if (header.major !== 1) fail(VERSION, `major version ${header.major}`);
  if (crc32c(data.subarray(0, 60)) !== header.headerCrc) fail(CHECKSUM, "header CRC");
  if (header.headerSize !== 64) fail(CORRUPT, "header_size");
  // Step 2: footer.
  let footer;
  try {
    footer = kaitai(data, size - 64, Kv.Footer);
  } catch (e) {
    fail(TRUNCATED, "no footer (the writer did not finish)");
  }
  if (crc32c(data.subarray(size - 64, size - 4)) !== footer.footerCrc) fail(TRUNCATED, "footer CRC");
  if (footer.major !== 1) fail(VERSION, "footer major");
  if (footer.minor !== header.minor) fail(CORRUPT, "footer minor differs from the header's");
  // Step 3: sizes, then the index CRC.
  if (footer.chunkCount > MAX_CHUNK_COUNT) fail(LIMIT, "chunk count");
  if (footer.jsonSize > MAX_JSON_SIZE) fail(LIMIT, "index JSON size");
  if (footer.indexOffset % 64 || footer.indexOffset < 64) fail(CORRUPT, "index offset");
  const tableSize = footer.chunkCount * 64;
  if (footer.indexOffset + tableSize + footer.jsonSize + 64 !== size) fail(TRUNCATED, "index sizes do not end at the file size");
  const index = data.subarray(footer.indexOffset, size - 64);
  if (crc32c(index, crc32c(data.subarray(0, 64))) !== footer.indexCrc) fail(CHECKSUM, "index CRC");
  // Step 4: index JSON.
  const document = parseJson(decodeText(index.subarray(tableSize), "index JSON"), "index JSON");
  if (!isObject(document)) fail(CORRUPT, "index JSON must be an object");
  const manifest = parseManifest(get(document, "manifest"));
  const snapshots = get(document, "snapshots");
  if (!Array.isArray(snapshots) || snapshots.length === 0) fail(CORRUPT, "no snapshots");
  const table = [];
  for (let i = 0; i < footer.chunkCount; i++) table.push(descriptorAt(data, footer.indexOffset + 64 * i));
  checkTable(table, footer.indexOffset, manifest);
  // Step 6: snapshot JSON.
  const entries = snapshots.map((s, i) => parseEntry(s, i, manifest));
  if (!manifest.required.includes("append-chunks") && entries.some((e) => e.appendChunks.length)) {
    fail(CORRUPT, "append_chunks without the feature");
  }
  return { data, header, footer, manifest, table, entries, minor: header.minor };
}

function descriptorAt(data, offset) {
  const raw = data.subarray(offset, offset + 64);
  const d = { raw, magicOk: raw.subarray(0, 4).toString("latin1") === "KVCK" };
  // Kv.Descriptor refuses a wrong magic as it parses; R8 reports it in its turn (13.1), so the
  // fields are read from a copy that carries the right one.
  const fields = new Kv.Descriptor(new KaitaiStream(Buffer.concat([Buffer.from("KVCK"), raw.subarray(4)])), null, null);
  return Object.assign(d, fields);
}

// Step 5: the chunk table, one rule at a time over the whole table (SPEC 13.1).
function checkTable(table, indexOffset, manifest) {
  if (!table.length) return;
  const layers = manifest.layers;
  const located = (d) => d.kind !== ARRAY;
  const end = (d) => d.offset + 64 + d.storedSize;
  const rule = (category, test, message) => {
    if (table.some(test)) fail(category, message);
  };
  rule(CORRUPT, (d) => !d.magicOk, "descriptor magic");
  rule(CORRUPT, (d) => d.kind > SELECTION, "unknown kind");
  rule(CORRUPT, (d) => d.flags !== 0, "flags");
  rule(CORRUPT, (d) => d.storedSize > indexOffset || d.offset > indexOffset, "past the index");
  rule(CORRUPT, (d, i) => d.offset % 64 !== 0 || (i === 0 && d.offset < 64), "alignment");
  rule(CORRUPT, (d, i) => i > 0 && d.offset < end(table[i - 1]), "file order");
  if (end(table[table.length - 1]) > indexOffset) fail(CORRUPT, "last chunk runs into the index");
  rule(LIMIT, (d) => d.rows > MAX_ROWS || d.width > MAX_WIDTH, "rows or width");
  rule(CORRUPT, (d) => d.position < 0 || d.position + d.rows > MAX_POSITION, "positions");
  rule(FEATURE, (d) => !CODECS.includes(d.codec), "unknown codec");
  rule(FEATURE, (d) => !(d.dtype in DTYPES), "unknown dtype");
  rule(LIMIT, (d) => d.decodedSize > MAX_CHUNK_DECODED, "decoded size over the limit");
  rule(CORRUPT, (d) => located(d) && (d.layer >= layers.length || d.seq >= manifest.num_seqs), "undeclared layer or seq");
  const bytesPerRow = (d) => {
    const layer = layers[d.layer];
    if ((d.kind === K || d.kind === V) && layer && layer.present && layer.quantization) return rowBytes(layer, d.kind);
    return d.width * DTYPES[d.dtype][1];
  };
  rule(CORRUPT, (d) => d.rows * bytesPerRow(d) !== d.decodedSize, "decoded size");
  rule(CORRUPT, (d) => d.codec === 0 && d.storedSize !== d.decodedSize, "raw stored size");
  rule(CORRUPT, (d) => d.kind === ARRAY && (d.layer || d.head || d.seq || d.position), "array fields");
  rule(CORRUPT, (d) => located(d) && !layers[d.layer].present, "absent layer");
  rule(CORRUPT, (d) => {
    if (d.kind !== K && d.kind !== V) return false;
    const l = layers[d.layer];
    return d.head >= l.num_heads || d.width !== (d.kind === K ? l.k_dim : l.v_dim) || d.dtype !== l.code;
  }, "K/V disagrees with the layer");
  rule(CORRUPT, (d) => {
    if (d.kind !== Q) return false;
    const q = layers[d.layer].queries;
    return !q || d.head >= q.num_heads || d.width !== q.dim || d.dtype !== q.code;
  }, "Q disagrees with the layer's queries");
  rule(CORRUPT, (d) => {  // 1.7
    if (d.kind !== SELECTION) return false;
    const q = layers[d.layer].queries;
    return d.head !== 0 || !q || q.selection === null || d.width !== q.selection || d.dtype !== 4;
  }, "selection chunk disagrees with the layer's queries");
}

// -- codecs (section 7) ------------------------------------------------------------------------
// The frame's length and declared content size, read from its header and block headers.
function zstdFrame(frame, size) {
  if (frame.length < 6 || frame.readUInt32LE(0) !== 0xfd2fb528) fail(CORRUPT, "not a zstd frame");
  const fhd = frame[4];
  const fcsFlag = fhd >> 6, single = (fhd >> 5) & 1, checksum = (fhd >> 2) & 1, dictFlag = fhd & 3;
  if ((fhd >> 3) & 1) fail(CORRUPT, "zstd reserved bit");
  let at = 5 + (single ? 0 : 1) + [0, 1, 2, 4][dictFlag];
  const fcsSize = [single ? 1 : 0, 2, 4, 8][fcsFlag];
  if (fcsSize === 0) fail(CORRUPT, "zstd frame without a content size");
  if (at + fcsSize > frame.length) fail(CORRUPT, "zstd frame header cut");
  let declared;
  if (fcsSize === 1) declared = frame[at];
  else if (fcsSize === 2) declared = frame.readUInt16LE(at) + 256;
  else if (fcsSize === 4) declared = frame.readUInt32LE(at);
  else declared = frame.readUInt32LE(at) + 0x100000000 * frame.readUInt32LE(at + 4);
  if (declared !== size) fail(CORRUPT, `zstd frame declares ${declared} bytes, expected ${size}`);
  at += fcsSize;
  for (;;) {
    if (at + 3 > frame.length) fail(CORRUPT, "zstd block header cut");
    const h = frame[at] | (frame[at + 1] << 8) | (frame[at + 2] << 16);
    const last = h & 1, type = (h >> 1) & 3, blockSize = h >>> 3;
    if (type === 3) fail(CORRUPT, "zstd reserved block type");
    at += 3 + (type === 1 ? 1 : blockSize);
    if (at > frame.length) fail(CORRUPT, "zstd block cut");
    if (last) break;
  }
  if (checksum) at += 4;
  if (at !== frame.length) fail(CORRUPT, "bytes after the zstd frame");
}
function zstd(frame, size) {
  zstdFrame(frame, size);
  let out;
  try {
    out = fzstd.decompress(frame, new Uint8Array(size));
  } catch (e) {
    fail(CORRUPT, `zstd frame does not decode: ${e.message}`);
  }
  if (out.length !== size) fail(CORRUPT, "zstd frame decodes to another size");
  return Buffer.from(out.buffer, out.byteOffset, out.length);
}
function decode(payload, d) {
  const size = d.decodedSize;
  if (d.codec === 0) {
    if (payload.length !== size) fail(CORRUPT, "raw size");
    return payload;
  }
  if (d.codec === 1) return zstd(payload, size);
  const itemsize = DTYPES[d.dtype][1];
  if (payload.length < 8 * itemsize) fail(CORRUPT, "byteplane table");
  const lengths = [];
  for (let i = 0; i < itemsize; i++) lengths.push(payload.readUInt32LE(8 * i) + 0x100000000 * payload.readUInt32LE(8 * i + 4));
  if (8 * itemsize + lengths.reduce((a, b) => a + b, 0) !== payload.length) fail(CORRUPT, "byteplane lengths");
  const count = Math.floor(size / itemsize);
  const out = Buffer.alloc(count * itemsize);
  let start = 8 * itemsize;
  lengths.forEach((length, plane) => {
    const bytes = zstd(payload.subarray(start, start + length), count);
    for (let j = 0; j < count; j++) out[j * itemsize + plane] = bytes[j];
    start += length;
  });
  return out;
}

// -- verification: the record stream (13.1 step 7) ---------------------------------------------
function walk(file) {
  const { data, footer, table } = file;
  const indexOffset = footer.indexOffset;
  let cursor = 64, records = 0, chunk = 0;
  const decoded = new Array(table.length);
  while (cursor < indexOffset) {
    if (cursor + 64 > indexOffset) fail(CORRUPT, "record overruns the index");
    const raw = data.subarray(cursor, cursor + 64);
    if (raw.subarray(0, 4).toString("latin1") !== "KVCK") fail(CORRUPT, `no descriptor at ${cursor}`);
    if (crc32c(raw.subarray(0, 60)) !== raw.readUInt32LE(60)) fail(CHECKSUM, `descriptor CRC at ${cursor}`);
    const d = descriptorAt(data, cursor);
    if (d.offset !== cursor) fail(CORRUPT, "descriptor offset");
    const end = cursor + 64 + d.storedSize;
    if (end > indexOffset) fail(CORRUPT, "record runs into the index");
    const payload = data.subarray(cursor + 64, end);
    if (d.kind <= SELECTION && (chunk >= table.length || !raw.equals(table[chunk].raw))) fail(CORRUPT, "chunk differs from its index copy");
    if (crc32c(payload) !== d.payloadCrc) fail(CHECKSUM, "payload CRC");
    if (d.kind <= SELECTION) {
      decoded[chunk] = decode(payload, d);
      chunk++;
    } else if (d.kind === MANIFEST || d.kind === SNAPSHOT) {
      if (d.dtype || d.codec || d.flags || d.decodedSize !== d.storedSize) fail(CORRUPT, "JSON record fields");
      parseJson(decodeText(payload, "JSON record"), "JSON record");
    } else if (file.minor <= Math.min(MINOR, LAST_STRICT_MINOR)) {
      fail(CORRUPT, `unknown record kind ${d.kind}`);
    }
    if ((records === 0) !== (d.kind === MANIFEST)) fail(CORRUPT, "the manifest must be the first record, and only it");
    const next = Math.ceil(end / 64) * 64;
    if (data.subarray(end, Math.min(next, indexOffset)).some((b) => b !== 0)) fail(CORRUPT, "non-zero padding");
    cursor = next;
    records++;
  }
  if (chunk !== table.length) fail(CORRUPT, "chunk count");
  return decoded;
}

// -- materializing (section 11, 11.1; 13.1 step 8) ----------------------------------------------
function materialize(file) {
  const { entries, table } = file;
  const states = [];
  entries.forEach((entry, index) => {
    const where = `snapshot ${index}`;
    let runs = entry.parent === null ? [] : states[entry.parent].runs.map((r) => r.slice());
    const queries = entry.parent === null ? [] : states[entry.parent].queries.slice();
    for (const [layer, seq, start, stop] of entry.drops) {
      const kept = [];
      for (const r of runs) {
        const [l, s, , , chunk, row, count, position] = r;
        if (l !== layer || s !== seq) {
          kept.push(r);
          continue;
        }
        if (count === 0) {  // an empty run at p goes when start <= p < stop
          if (position < start || position >= stop) kept.push(r);
          continue;
        }
        const low = Math.min(position + count, start);
        if (low > position) kept.push([l, s, r[2], r[3], chunk, row, low - position, position]);
        const high = Math.max(position, stop);
        if (position + count > high) kept.push([l, s, r[2], r[3], chunk, row + (high - position), position + count - high, high]);
      }
      runs = kept;
    }
    const add = (chunk, row, count) => {
      const d = table[chunk];
      runs.push([d.layer, d.seq, d.head, d.kind, chunk, row, count, d.position + row]);
    };
    for (let i = 0; i < entry.append.length; i += 3) {
      const [chunk, row, count] = entry.append.slice(i, i + 3);
      if (chunk >= table.length || (table[chunk].kind !== K && table[chunk].kind !== V)) fail(CORRUPT, `${where}: append names no K/V chunk`);
      if (count < 1 || row + count > table[chunk].rows) fail(CORRUPT, `${where}: append rows`);
      add(chunk, row, count);
    }
    for (const [first, stop] of entry.appendChunks) {
      if (stop > table.length) fail(CORRUPT, `${where}: append_chunks past the table`);
      for (let c = first; c < stop; c++) {
        if (table[c].kind !== K && table[c].kind !== V) fail(CORRUPT, `${where}: append_chunks names no K/V chunk`);
        add(c, 0, table[c].rows);
      }
    }
    for (const [first, stop] of entry.queries) {
      if (stop > table.length) fail(CORRUPT, `${where}: queries past the table`);
      for (let c = first; c < stop; c++) {
        if (table[c].kind !== Q && table[c].kind !== SELECTION) fail(CORRUPT, `${where}: queries names no Q or selection chunk`);
        queries.push(c);
      }
    }
    for (const [, chunk] of entry.arrays) {
      const c = Number(chunk);
      if (c >= table.length || table[c].kind !== ARRAY) fail(CORRUPT, `${where}: arrays names no array chunk`);
    }
    states.push({ runs, queries, heads: checkRuns(runs, where), queryHeads: checkQueries(queries, table, where) });
  });
  return states;
}

const headKey = (r) => `${r[0]},${r[1]},${r[2]}`;
function byHead(runs) {
  const out = new Map();
  for (const r of runs) {
    const key = headKey(r);
    if (!out.has(key)) out.set(key, []);
    out.get(key).push(r);
  }
  // by position, then count: an empty run sorts before a run that starts where it is
  for (const list of out.values()) list.sort((a, b) => a[7] - b[7] || a[6] - b[6]);
  return out;
}
function checkRuns(runs, where) {
  const k = byHead(runs.filter((r) => r[3] === K));
  const v = byHead(runs.filter((r) => r[3] === V));
  const keys = new Set([...k.keys(), ...v.keys()]);
  for (const key of keys) {
    const a = k.get(key) || [], b = v.get(key) || [];
    if (a.length !== b.length || a.some((r, i) => r[7] !== b[i][7] || r[6] !== b[i][6])) fail(CORRUPT, `${where}: K and V of ${key} differ`);
    for (let i = 1; i < a.length; i++) if (a[i][7] < a[i - 1][7] + a[i - 1][6]) fail(CORRUPT, `${where}: a position twice`);
  }
  return { k, v };
}
function checkQueries(chunks, table, where) {
  const out = new Map();
  for (const c of chunks) {
    const d = table[c];
    const key = d.kind === SELECTION ? `${d.layer},${d.seq},selection` : `${d.layer},${d.seq},${d.head}`;
    if (!out.has(key)) out.set(key, []);
    out.get(key).push(c);
  }
  for (const list of out.values()) {
    list.sort((a, b) => table[a].position - table[b].position);
    const held = list.filter((c) => table[c].rows > 0);  // a Q chunk of 0 rows holds no position
    for (let i = 1; i < held.length; i++) {
      if (table[held[i]].position < table[held[i - 1]].position + table[held[i - 1]].rows) fail(CORRUPT, `${where}: a query position twice`);
    }
  }
  return out;
}

// -- element types and dequantization (section 6) ------------------------------------------------
const f32 = new Float32Array(1), u32 = new Uint32Array(f32.buffer);
function toFloat16Bits(x) {
  f32[0] = x;
  const bits = u32[0];
  const sign = (bits >>> 16) & 0x8000;
  const exponent = (bits >>> 23) & 0xff;
  let mantissa = bits & 0x7fffff;
  if (exponent === 0xff) return sign | 0x7c00 | (mantissa ? 0x200 : 0);
  let e = exponent - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mantissa |= 0x800000;
    const shift = 14 - e;
    let half = mantissa >>> shift;
    const rest = mantissa & ((1 << shift) - 1), halfway = 1 << (shift - 1);
    if (rest > halfway || (rest === halfway && half & 1)) half++;
    return sign | half;
  }
  let half = (e << 10) | (mantissa >>> 13);
  const rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && half & 1)) half++;
  return sign | half;
}
function fromFloat16Bits(h) {
  const sign = h & 0x8000 ? -1 : 1, e = (h >>> 10) & 0x1f, m = h & 0x3ff;
  if (e === 0) return sign * m * 2 ** -24;
  if (e === 0x1f) return m ? NaN : sign * Infinity;
  return sign * (1 + m / 1024) * 2 ** (e - 15);
}
function toBfloat16Bits(x) {
  f32[0] = x;
  const bits = u32[0];
  if ((bits & 0x7fffffff) > 0x7f800000) return ((bits >>> 16) | 0x40) & 0xffff;
  return ((bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16) & 0xffff;
}
function fromBfloat16Bits(b) {
  u32[0] = b << 16;
  return f32[0];
}
// An operation's result rounded as numpy / ml_dtypes do: in float32, then to the dtype.
const ROUND = {
  float32: (x) => Math.fround(x),
  float16: (x) => fromFloat16Bits(toFloat16Bits(Math.fround(x))),
  bfloat16: (x) => fromBfloat16Bits(toBfloat16Bits(Math.fround(x))),
};
const CANONICAL_NAN = { float32: 0x7fc00000, float16: 0x7e00, bfloat16: 0x7fc0 };
function writeValue(out, at, value, dtype) {
  if (dtype === "float32") {
    if (Number.isNaN(value)) out.writeUInt32LE(CANONICAL_NAN.float32, at);
    else out.writeFloatLE(value, at);
  } else if (dtype === "float16") out.writeUInt16LE(Number.isNaN(value) ? CANONICAL_NAN.float16 : toFloat16Bits(value), at);
  else out.writeUInt16LE(Number.isNaN(value) ? CANONICAL_NAN.bfloat16 : toBfloat16Bits(value), at);
}
function readValue(buffer, at, dtype) {
  if (dtype === "float32") return buffer.readFloatLE(at);
  if (dtype === "float16") return fromFloat16Bits(buffer.readUInt16LE(at));
  return fromBfloat16Bits(buffer.readUInt16LE(at));
}
function dequantize(rows, layer, kind) {
  const q = layer.quantization, dim = kind === K ? layer.k_dim : layer.v_dim;
  const itemsize = DTYPES[layer.code][1], words = (dim * q.bits) / 32, groups = dim / q.group_size;
  const perRow = rowBytes(layer, kind), n = rows.length / perRow, round = ROUND[layer.dtype];
  const out = Buffer.alloc(n * dim * itemsize), mask = (1 << q.bits) - 1, perWord = 32 / q.bits;
  for (let r = 0; r < n; r++) {
    const base = r * perRow;
    for (let i = 0; i < dim; i++) {
      const word = rows.readUInt32LE(base + 4 * Math.floor(i / perWord));
      const value = (word >>> ((i % perWord) * q.bits)) & mask;
      const g = Math.floor(i / q.group_size);
      const scale = readValue(rows, base + 4 * words + g * itemsize, layer.dtype);
      const bias = readValue(rows, base + 4 * words + (groups + g) * itemsize, layer.dtype);
      writeValue(out, (r * dim + i) * itemsize, round(round(scale * value) + bias), layer.dtype);
    }
  }
  return out;
}

// -- the description (section 17) ----------------------------------------------------------------
const sha = (buffer) => crypto.createHash("sha256").update(buffer).digest("hex");
function positionsHash(list) {
  const out = Buffer.alloc(8 * list.length);
  list.forEach((p, i) => out.writeBigInt64LE(BigInt(p), 8 * i));
  return sha(out);
}
function rowsOf(decoded, runs, bytesPerRow) {
  return Buffer.concat(runs.map((r) => decoded[r[4]].subarray(r[5] * bytesPerRow(r[4]), (r[5] + r[6]) * bytesPerRow(r[4]))));
}
function layerJson(layer) {
  if (!layer.present) return { present: false, attributes: plain(layer.attributes) };
  const out = {
    present: true,
    num_heads: layer.num_heads,
    k_dim: layer.k_dim,
    v_dim: layer.v_dim,
    dtype: layer.dtype,
    attributes: plain(layer.attributes),
  };
  if (layer.quantization) out.quantization = layer.quantization;
  if (layer.queries) {
    const q = layer.queries;
    out.queries = {
      num_heads: q.num_heads, dim: q.dim, dtype: q.dtype, scale: q.scale, kv_heads: q.kv_heads,
      window: q.window, keep: q.keep, softcap: q.softcap, sinks: q.sinks,
    };
    if (q.chunk !== null) out.queries.chunk = q.chunk;
    if (q.latent) out.queries.latent = true;
    if (q.selection !== null) out.queries.selection = q.selection;
    if (q.pooled !== null) out.queries.pooled = { layer: q.pooled.layer, ratio: q.pooled.ratio };
  }
  return out;
}
// At most this many head entries (`heads` and `queries`, over every snapshot) in a description
// (section 17): a valid file may describe to more, and is then refused before it is walked.
const MAX_DESCRIBED_HEADS = 2 ** 20;

function describe(data) {
  const file = openFile(data);
  const selects = (l) => l.present && l.queries && l.queries.selection !== null;
  const perSnapshot = file.manifest.layers.reduce(
    (sum, l) => sum + (l.present ? l.num_heads + (l.queries ? l.queries.num_heads : 0) + (selects(l) ? 1 : 0) : 0), 0);
  if (perSnapshot * file.manifest.num_seqs * file.entries.length > MAX_DESCRIBED_HEADS) {
    fail(LIMIT, "the description would list more than 2^20 head entries");
  }
  const decoded = walk(file);
  const states = materialize(file);
  const { manifest, table } = file;
  // 1.7: every selection row holds key positions >= 0 in increasing order (after the snapshots)
  table.forEach((d, c) => {
    if (d.kind !== SELECTION) return;
    const rows = decoded[c];
    for (let r = 0; r < d.rows; r++) {
      let last = -1;
      for (let i = 0; i < d.width; i++) {
        const value = rows.readInt32LE(4 * (r * d.width + i));
        if (value <= last) fail(CORRUPT, "a selection row is not increasing key positions");
        last = value;
      }
    }
  });
  const plainRow = (c) => table[c].width * DTYPES[table[c].dtype][1];
  const withQueries = manifest.layers.some((l) => l.present && l.queries);
  const snapshots = file.entries.map((entry, index) => {
    const state = states[index];
    const heads = [];
    manifest.layers.forEach((layer, l) => {
      if (!layer.present) return;
      for (let s = 0; s < manifest.num_seqs; s++) {
        for (let h = 0; h < layer.num_heads; h++) {
          const key = `${l},${s},${h}`;
          const kRuns = state.heads.k.get(key) || [], vRuns = state.heads.v.get(key) || [];
          const positions = [];
          for (const r of kRuns) for (let p = 0; p < r[6]; p++) positions.push(r[7] + p);
          let k, v;
          if (layer.quantization) {
            k = dequantize(rowsOf(decoded, kRuns, () => rowBytes(layer, K)), layer, K);
            v = dequantize(rowsOf(decoded, vRuns, () => rowBytes(layer, V)), layer, V);
          } else {
            k = rowsOf(decoded, kRuns, plainRow);
            v = rowsOf(decoded, vRuns, plainRow);
          }
          heads.push({ layer: l, head: h, seq: s, n_tokens: positions.length, positions: positionsHash(positions), k: sha(k), v: sha(v) });
        }
      }
    });
    const arrays = {};
    for (const [name, chunk] of entry.arrays) arrays[name] = sha(decoded[Number(chunk)]);
    const out = { metadata: plain(entry.metadata), arrays, heads };
    if (withQueries) {
      out.queries = [];
      manifest.layers.forEach((layer, l) => {
        if (!layer.present || !layer.queries) return;
        for (let s = 0; s < manifest.num_seqs; s++) {
          for (let h = 0; h < layer.queries.num_heads; h++) {
            const chunks = state.queryHeads.get(`${l},${s},${h}`) || [];
            const positions = [];
            for (const c of chunks) for (let p = 0; p < table[c].rows; p++) positions.push(table[c].position + p);
            const rows = Buffer.concat(chunks.map((c) => decoded[c]));
            out.queries.push({ layer: l, head: h, seq: s, n_queries: positions.length, positions: positionsHash(positions), q: sha(rows) });
          }
        }
      });
    }
    if (manifest.layers.some(selects)) {  // 1.7
      out.selections = [];
      manifest.layers.forEach((layer, l) => {
        if (!selects(layer)) return;
        for (let s = 0; s < manifest.num_seqs; s++) {
          const chunks = state.queryHeads.get(`${l},${s},selection`) || [];
          const positions = [];
          for (const c of chunks) for (let p = 0; p < table[c].rows; p++) positions.push(table[c].position + p);
          const rows = Buffer.concat(chunks.map((c) => decoded[c]));
          out.selections.push({ layer: l, seq: s, n_rows: positions.length, positions: positionsHash(positions), rows: sha(rows) });
        }
      });
    }
    return out;
  });
  return {
    version: [1, file.minor],
    num_seqs: manifest.num_seqs,
    num_snapshots: file.entries.length,
    layers: manifest.layers.map(layerJson),
    metadata: plain(manifest.metadata),
    snapshots,
  };
}

// One file: its description (or {"error": CATEGORY}) on stdout. Several files: one JSON line per
// file, in order (one process for a batch; a test runs 1,200 files through it).
function describeFile(path) {
  let data;
  try {
    data = fs.readFileSync(path);
  } catch (e) {
    process.stderr.write(`${path}: ${e.message}\n`);
    return null;
  }
  try {
    return dump(describe(data));
  } catch (e) {
    if (!(e instanceof KvError)) throw e;
    process.stderr.write(`${path}: ${e.category}: ${e.message}\n`);
    return JSON.stringify({ error: e.category });
  }
}

function main(argv) {
  if (argv.length === 0) {
    process.stderr.write("usage: node describe.js FILE [FILE...]\n");
    return 2;
  }
  let status = 0;
  for (const path of argv) {
    const line = describeFile(path);
    if (line === null) status = 2;
    else process.stdout.write(line + "\n");
  }
  return status;
}

module.exports = { describe, KvError };
if (require.main === module) process.exitCode = main(process.argv.slice(2));
