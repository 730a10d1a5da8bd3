// A small GGUF header reader and writer for the browser tests, written apart from the engine's,
// so that what Engine.inspect reports is checked against facts derived independently from the
// file, and test models (split parts, an 8B-shaped model) are made without the engine.
import fs from "node:fs";

// ggml type id -> [name, values per block, bytes per block] (ggml.h / gguf-py constants).
const TYPES = {
  0: ["F32", 1, 4], 1: ["F16", 1, 2], 2: ["Q4_0", 32, 18], 3: ["Q4_1", 32, 20], 6: ["Q5_0", 32, 22],
  7: ["Q5_1", 32, 24], 8: ["Q8_0", 32, 34], 10: ["Q2_K", 256, 84], 11: ["Q3_K", 256, 110],
  12: ["Q4_K", 256, 144], 13: ["Q5_K", 256, 176], 14: ["Q6_K", 256, 210], 20: ["IQ4_NL", 32, 18],
  23: ["IQ4_XS", 256, 136], 30: ["BF16", 1, 2],
};

/**
 * {metadata, kvs: [{key, raw}], tensors: [{name, dims, type, typeId, offset, elements, bytes}],
 * headerBytes, dataStart} of a GGUF file: `raw` is a key-value pair's bytes as in the file,
 * `offset` a tensor's within the data section.
 */
export function readGguf(file) {
  const fd = fs.openSync(file, "r");
  const buf = Buffer.alloc(16 << 20);
  const got = fs.readSync(fd, buf, 0, buf.length, 0);
  fs.closeSync(fd);
  let at = 0;
  const u32 = () => ((at += 4), buf.readUInt32LE(at - 4));
  const u64 = () => ((at += 8), Number(buf.readBigUInt64LE(at - 8)));
  const str = () => {
    const n = u64();
    return ((at += n), buf.toString("utf8", at - n, at));
  };
  const scalar = {
    0: () => buf.readUInt8(at++), 1: () => buf.readInt8(at++), 2: () => ((at += 2), buf.readUInt16LE(at - 2)),
    3: () => ((at += 2), buf.readInt16LE(at - 2)), 4: u32, 5: () => ((at += 4), buf.readInt32LE(at - 4)),
    6: () => ((at += 4), buf.readFloatLE(at - 4)), 7: () => buf.readUInt8(at++) !== 0, 8: str,
    10: u64, 11: () => ((at += 8), Number(buf.readBigInt64LE(at - 8))), 12: () => ((at += 8), buf.readDoubleLE(at - 8)),
  };
  const value = (type) => {
    if (type !== 9) return scalar[type]();
    const itemType = u32();
    const n = u64();
    return Array.from({ length: n }, () => value(itemType));
  };
  if (buf.toString("latin1", 0, 4) !== "GGUF") throw new Error(`${file} is not a GGUF file`);
  at = 4;
  u32();
  const nTensors = u64();
  const nKv = u64();
  const metadata = {};
  const kvs = [];
  for (let i = 0; i < nKv; i++) {
    const start = at;
    const key = str();
    metadata[key] = value(u32());
    kvs.push({ key, raw: Buffer.from(buf.subarray(start, at)) });
  }
  const tensors = [];
  for (let i = 0; i < nTensors; i++) {
    const name = str();
    const dims = Array.from({ length: u32() }, u64);
    const typeId = u32();
    const [type, block, blockBytes] = TYPES[typeId];
    const offset = u64();
    const elements = dims.reduce((a, b) => a * b, 1);
    tensors.push({ name, dims, type, typeId, offset, elements, bytes: (elements / block) * blockBytes });
  }
  if (at > got) throw new Error(`the header of ${file} is longer than the bytes read`);
  const alignment = metadata["general.alignment"] ?? 32;
  return { metadata, kvs, tensors, headerBytes: at, dataStart: Math.ceil(at / alignment) * alignment };
}

// Writing: GGUF v3 values as bytes.
export const str = (s) => {
  const b = Buffer.from(s, "utf8");
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(b.length));
  return Buffer.concat([len, b]);
};
export const u16 = (v) => { const b = Buffer.alloc(2); b.writeUInt16LE(v); return b; };
export const u32 = (v) => { const b = Buffer.alloc(4); b.writeUInt32LE(v); return b; };
export const f32 = (v) => { const b = Buffer.alloc(4); b.writeFloatLE(v); return b; };
/** A key-value pair's bytes: `type` is the GGUF value type id (4 u32, 6 f32, 8 string...). */
export const kv = (key, type, value) => Buffer.concat([str(key), u32(type), value]);
export const GGUF_ALIGN = 32;

/**
 * A GGUF header: the key-value pairs' bytes and tensor infos ({name, dims, typeId, offset}),
 * padded to the 32-byte alignment where the data section starts.
 */
export function ggufHeader(kvs, tensors) {
  const head = Buffer.alloc(24);
  head.write("GGUF", 0, "latin1");
  head.writeUInt32LE(3, 4);
  head.writeBigUInt64LE(BigInt(tensors.length), 8);
  head.writeBigUInt64LE(BigInt(kvs.length), 16);
  const infos = tensors.map(({ name, dims, typeId, offset }) => {
    const d = Buffer.alloc(4 + dims.length * 8 + 4 + 8);
    d.writeUInt32LE(dims.length, 0);
    dims.forEach((x, i) => d.writeBigUInt64LE(BigInt(x), 4 + i * 8));
    d.writeUInt32LE(typeId, 4 + dims.length * 8);
    d.writeBigUInt64LE(BigInt(offset), 8 + dims.length * 8);
    return Buffer.concat([str(name), d]);
  });
  const header = Buffer.concat([head, ...kvs, ...infos]);
  return Buffer.concat([header, Buffer.alloc((GGUF_ALIGN - (header.length % GGUF_ALIGN)) % GGUF_ALIGN)]);
}

/**
 * Splits a GGUF file the way llama.cpp's gguf-split does: `name-0000i-of-0000n.gguf` beside
 * `out` (a path ending in .gguf), the metadata in part 1 with split.tensors.count, split.no and
 * split.count in every part, the tensors dealt out in order. Returns the parts' paths.
 */
export function splitGguf(file, out, n) {
  const { kvs, tensors, dataStart } = readGguf(file);
  if (kvs.some((k) => k.key.startsWith("split."))) throw new Error(`${file} is already split`);
  const bytes = fs.readFileSync(file);
  const per = Math.ceil(tensors.length / n);
  const paths = [];
  for (let p = 0; p < n; p++) {
    const mine = tensors.slice(p * per, (p + 1) * per);
    const split = [kv("split.no", 2, u16(p)), kv("split.count", 2, u16(n))];
    const meta = p === 0 ? [...kvs.map((k) => k.raw), kv("split.tensors.count", 5, u32(tensors.length)), ...split] : split;
    let offset = 0;
    const placed = mine.map((t) => {
      const at = offset;
      offset += Math.ceil(t.bytes / GGUF_ALIGN) * GGUF_ALIGN;
      return { ...t, offset: at };
    });
    const data = Buffer.alloc(offset);
    mine.forEach((t, i) => bytes.copy(data, placed[i].offset, dataStart + t.offset, dataStart + t.offset + t.bytes));
    const name = out.replace(/\.gguf$/, `-${String(p + 1).padStart(5, "0")}-of-${String(n).padStart(5, "0")}.gguf`);
    fs.writeFileSync(name, Buffer.concat([ggufHeader(meta, placed), data]));
    paths.push(name);
  }
  return paths;
}
