// A small GGUF header reader for the browser tests, written apart from the engine's, so that
// what Engine.inspect reports is checked against facts derived independently from the file.
import fs from "node:fs";

// ggml type id -> [name, values per block, bytes per block] (ggml.h / gguf-py constants).
const TYPES = {
  0: ["F32", 1, 4], 1: ["F16", 1, 2], 2: ["Q4_0", 32, 18], 3: ["Q4_1", 32, 20], 6: ["Q5_0", 32, 22],
  7: ["Q5_1", 32, 24], 8: ["Q8_0", 32, 34], 10: ["Q2_K", 256, 84], 11: ["Q3_K", 256, 110],
  12: ["Q4_K", 256, 144], 13: ["Q5_K", 256, 176], 14: ["Q6_K", 256, 210], 20: ["IQ4_NL", 32, 18],
  23: ["IQ4_XS", 256, 136], 30: ["BF16", 1, 2],
};

/** {metadata, tensors: [{name, dims, type, elements, bytes}], headerBytes} of a GGUF file. */
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
  for (let i = 0; i < nKv; i++) {
    const key = str();
    metadata[key] = value(u32());
  }
  const tensors = [];
  for (let i = 0; i < nTensors; i++) {
    const name = str();
    const dims = Array.from({ length: u32() }, u64);
    const [type, block, blockBytes] = TYPES[u32()];
    u64();
    const elements = dims.reduce((a, b) => a * b, 1);
    tensors.push({ name, dims, type, elements, bytes: (elements / block) * blockBytes });
  }
  if (at > got) throw new Error(`the header of ${file} is longer than the bytes read`);
  return { metadata, tensors, headerBytes: at };
}
