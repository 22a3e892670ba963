meta:
  id: kv
  title: kvsnap .kv KV-cache snapshot file, format version 1.x
  file-extension: kv
  license: CC0-1.0
  endian: le
doc: |
  Formal grammar of the binary layout of spec/SPEC.md (sections 3-9). A file is a 64-byte header,
  then records (64-byte descriptor + payload + zero padding to a multiple of 64), then the chunk
  table (one descriptor per table chunk), the index JSON, and a 64-byte footer at the very end.
  A reader starts from the footer. The grammar describes structure only: CRC-32C checks, codecs,
  the JSON schema and the validation rules of section 13 are in the prose spec. Version 1.2
  changed only the JSON (the snapshot key `append_chunks`, section 11); version 1.3 added record
  kind 3 (Q chunk, queries) and JSON keys, version 1.7 record kind 4 (selection chunk, sparse
  attention) and element type 4 (int32, selection chunks only): the layout below is that of
  every 1.x version.
seq:
  - id: header
    type: header
instances:
  footer:
    pos: _io.size - 64
    type: footer
  chunk_table:
    pos: footer.index_offset
    type: descriptor
    repeat: expr
    repeat-expr: footer.chunk_count
  index_json:
    pos: footer.index_offset + footer.chunk_count * 64
    size: footer.json_size
    type: str
    encoding: UTF-8
types:
  header:
    seq:
      - id: magic
        contents: [0x89, "KVS", 0x0d, 0x0a, 0x1a, 0x0a]
      - id: major
        type: u2
      - id: minor
        type: u2
      - id: header_size
        type: u4
        doc: 64 in version 1
      - id: reserved
        size: 44
        doc: zero
      - id: header_crc
        type: u4
        doc: CRC-32C of the 60 bytes before it
  descriptor:
    doc: |
      A record descriptor, found both before each record's payload (at `offset`) and, for table
      chunks, as a copy in the chunk table.
    seq:
      - id: magic
        contents: "KVCK"
      - id: kind
        type: u1
        enum: kind
      - id: dtype
        type: u1
        enum: dtype
      - id: codec
        type: u1
        enum: codec
      - id: flags
        type: u1
      - id: layer
        type: u2
      - id: head
        type: u2
      - id: seq
        type: u4
      - id: position
        type: s8
        doc: absolute token position of the first row
      - id: rows
        type: u4
      - id: width
        type: u4
        doc: elements per row (a quantized layer - section 6.1 - stores its joined row width)
      - id: offset
        type: u8
        doc: file offset of this record's own descriptor
      - id: stored_size
        type: u8
        doc: payload bytes in the file (after the codec)
      - id: decoded_size
        type: u8
        doc: payload bytes after decoding
      - id: payload_crc
        type: u4
      - id: descriptor_crc
        type: u4
        doc: CRC-32C of the 60 bytes before it
    instances:
      record_descriptor:
        io: _root._io
        pos: offset
        size: 64
        doc: the same 64 bytes as this table entry
      payload:
        io: _root._io
        pos: offset + 64
        size: stored_size
        doc: encoded with `codec`; for raw, `rows` x `width` little-endian elements of `dtype`
  footer:
    seq:
      - id: magic
        contents: "KVSINDEX"
      - id: index_offset
        type: u8
        doc: where the chunk table starts (just after the last record)
      - id: chunk_count
        type: u8
      - id: json_size
        type: u8
      - id: index_crc
        type: u4
        doc: CRC-32C of header bytes, chunk table and index JSON
      - id: major
        type: u2
      - id: minor
        type: u2
      - id: reserved
        size: 20
      - id: footer_crc
        type: u4
enums:
  kind:
    0: k
    1: v
    2: array
    3: q
    4: selection
    16: manifest
    17: snapshot
  dtype:
    0: none
    1: float32
    2: float16
    3: bfloat16
    4: int32
  codec:
    0: raw
    1: zstd
    2: byteplane_zstd
