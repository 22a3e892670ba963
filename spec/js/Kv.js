// This is a generated file! Please edit source .ksy file and use kaitai-struct-compiler to rebuild

(function (root, factory) {
  if (typeof define === 'function' && define.amd) {
    define(['exports', 'kaitai-struct/KaitaiStream'], factory);
  } else if (typeof exports === 'object' && exports !== null && typeof exports.nodeType !== 'number') {
    factory(exports, require('kaitai-struct/KaitaiStream'));
  } else {
    factory(root.Kv || (root.Kv = {}), root.KaitaiStream);
  }
})(typeof self !== 'undefined' ? self : this, function (Kv_, KaitaiStream) {
/**
 * Formal grammar of the binary layout of spec/SPEC.md (sections 3-9). A file is a 64-byte header,
 * then records (64-byte descriptor + payload + zero padding to a multiple of 64), then the chunk
 * table (one descriptor per table chunk), the index JSON, and a 64-byte footer at the very end.
 * A reader starts from the footer. The grammar describes structure only: CRC-32C checks, codecs,
 * the JSON schema and the validation rules of section 13 are in the prose spec. Version 1.2
 * changed only the JSON (the snapshot key `append_chunks`, section 11); version 1.3 added record
 * kind 3 (Q chunk, queries) and JSON keys, version 1.7 record kind 4 (selection chunk, sparse
 * attention) and element type 4 (int32, selection chunks only): the layout below is that of
 * every 1.x version.
 */

var Kv = (function() {
  Kv.Codec = Object.freeze({
    RAW: 0,
    ZSTD: 1,
    BYTEPLANE_ZSTD: 2,

    0: "RAW",
    1: "ZSTD",
    2: "BYTEPLANE_ZSTD",
  });

  Kv.Dtype = Object.freeze({
    NONE: 0,
    FLOAT32: 1,
    FLOAT16: 2,
    BFLOAT16: 3,
    INT32: 4,

    0: "NONE",
    1: "FLOAT32",
    2: "FLOAT16",
    3: "BFLOAT16",
    4: "INT32",
  });

  Kv.Kind = Object.freeze({
    K: 0,
    V: 1,
    ARRAY: 2,
    Q: 3,
    SELECTION: 4,
    MANIFEST: 16,
    SNAPSHOT: 17,

    0: "K",
    1: "V",
    2: "ARRAY",
    3: "Q",
    4: "SELECTION",
    16: "MANIFEST",
    17: "SNAPSHOT",
  });

  function Kv(_io, _parent, _root) {
    this._io = _io;
    this._parent = _parent;
    this._root = _root || this;

    this._read();
  }
  Kv.prototype._read = function() {
    this.header = new Header(this._io, this, this._root);
  }

  /**
   * A record descriptor, found both before each record's payload (at `offset`) and, for table
   * chunks, as a copy in the chunk table.
   */

  var Descriptor = Kv.Descriptor = (function() {
    function Descriptor(_io, _parent, _root) {
      this._io = _io;
      this._parent = _parent;
      this._root = _root;

      this._read();
    }
    Descriptor.prototype._read = function() {
      this.magic = this._io.readBytes(4);
      if (!((KaitaiStream.byteArrayCompare(this.magic, new Uint8Array([75, 86, 67, 75])) == 0))) {
        throw new KaitaiStream.ValidationNotEqualError(new Uint8Array([75, 86, 67, 75]), this.magic, this._io, "/types/descriptor/seq/0");
      }
      this.kind = this._io.readU1();
      this.dtype = this._io.readU1();
      this.codec = this._io.readU1();
      this.flags = this._io.readU1();
      this.layer = this._io.readU2le();
      this.head = this._io.readU2le();
      this.seq = this._io.readU4le();
      this.position = this._io.readS8le();
      this.rows = this._io.readU4le();
      this.width = this._io.readU4le();
      this.offset = this._io.readU8le();
      this.storedSize = this._io.readU8le();
      this.decodedSize = this._io.readU8le();
      this.payloadCrc = this._io.readU4le();
      this.descriptorCrc = this._io.readU4le();
    }

    /**
     * encoded with `codec`; for raw, `rows` x `width` little-endian elements of `dtype`
     */
    Object.defineProperty(Descriptor.prototype, 'payload', {
      get: function() {
        if (this._m_payload !== undefined)
          return this._m_payload;
        var io = this._root._io;
        var _pos = io.pos;
        io.seek(this.offset + 64);
        this._m_payload = io.readBytes(this.storedSize);
        io.seek(_pos);
        return this._m_payload;
      }
    });

    /**
     * the same 64 bytes as this table entry
     */
    Object.defineProperty(Descriptor.prototype, 'recordDescriptor', {
      get: function() {
        if (this._m_recordDescriptor !== undefined)
          return this._m_recordDescriptor;
        var io = this._root._io;
        var _pos = io.pos;
        io.seek(this.offset);
        this._m_recordDescriptor = io.readBytes(64);
        io.seek(_pos);
        return this._m_recordDescriptor;
      }
    });

    /**
     * absolute token position of the first row
     */

    /**
     * elements per row (a quantized layer - section 6.1 - stores its joined row width)
     */

    /**
     * file offset of this record's own descriptor
     */

    /**
     * payload bytes in the file (after the codec)
     */

    /**
     * payload bytes after decoding
     */

    /**
     * CRC-32C of the 60 bytes before it
     */

    return Descriptor;
  })();

  var Footer = Kv.Footer = (function() {
    function Footer(_io, _parent, _root) {
      this._io = _io;
      this._parent = _parent;
      this._root = _root;

      this._read();
    }
    Footer.prototype._read = function() {
      this.magic = this._io.readBytes(8);
      if (!((KaitaiStream.byteArrayCompare(this.magic, new Uint8Array([75, 86, 83, 73, 78, 68, 69, 88])) == 0))) {
        throw new KaitaiStream.ValidationNotEqualError(new Uint8Array([75, 86, 83, 73, 78, 68, 69, 88]), this.magic, this._io, "/types/footer/seq/0");
      }
      this.indexOffset = this._io.readU8le();
      this.chunkCount = this._io.readU8le();
      this.jsonSize = this._io.readU8le();
      this.indexCrc = this._io.readU4le();
      this.major = this._io.readU2le();
      this.minor = this._io.readU2le();
      this.reserved = this._io.readBytes(20);
      this.footerCrc = this._io.readU4le();
    }

    /**
     * where the chunk table starts (just after the last record)
     */

    /**
     * CRC-32C of header bytes, chunk table and index JSON
     */

    return Footer;
  })();

  var Header = Kv.Header = (function() {
    function Header(_io, _parent, _root) {
      this._io = _io;
      this._parent = _parent;
      this._root = _root;

      this._read();
    }
    Header.prototype._read = function() {
      this.magic = this._io.readBytes(8);
      if (!((KaitaiStream.byteArrayCompare(this.magic, new Uint8Array([137, 75, 86, 83, 13, 10, 26, 10])) == 0))) {
        throw new KaitaiStream.ValidationNotEqualError(new Uint8Array([137, 75, 86, 83, 13, 10, 26, 10]), this.magic, this._io, "/types/header/seq/0");
      }
      this.major = this._io.readU2le();
      this.minor = this._io.readU2le();
      this.headerSize = this._io.readU4le();
      this.reserved = this._io.readBytes(44);
      this.headerCrc = this._io.readU4le();
    }

    /**
     * 64 in version 1
     */

    /**
     * zero
     */

    /**
     * CRC-32C of the 60 bytes before it
     */

    return Header;
  })();
  Object.defineProperty(Kv.prototype, 'chunkTable', {
    get: function() {
      if (this._m_chunkTable !== undefined)
        return this._m_chunkTable;
      var _pos = this._io.pos;
      this._io.seek(this.footer.indexOffset);
      this._m_chunkTable = [];
      for (var i = 0; i < this.footer.chunkCount; i++) {
        this._m_chunkTable.push(new Descriptor(this._io, this, this._root));
      }
      this._io.seek(_pos);
      return this._m_chunkTable;
    }
  });
  Object.defineProperty(Kv.prototype, 'footer', {
    get: function() {
      if (this._m_footer !== undefined)
        return this._m_footer;
      var _pos = this._io.pos;
      this._io.seek(this._io.size - 64);
      this._m_footer = new Footer(this._io, this, this._root);
      this._io.seek(_pos);
      return this._m_footer;
    }
  });
  Object.defineProperty(Kv.prototype, 'indexJson', {
    get: function() {
      if (this._m_indexJson !== undefined)
        return this._m_indexJson;
      var _pos = this._io.pos;
      this._io.seek(this.footer.indexOffset + this.footer.chunkCount * 64);
      this._m_indexJson = KaitaiStream.bytesToStr(this._io.readBytes(this.footer.jsonSize), "UTF-8");
      this._io.seek(_pos);
      return this._m_indexJson;
    }
  });

  return Kv;
})();
Kv_.Kv = Kv;
});
