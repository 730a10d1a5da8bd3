// Writes a random-weight GGUF with Llama 3 8B's shapes in Q4_0 (about 4.2 GB) for the
// big-model browser test, without holding it in memory: the default model's tokenizer metadata
// copied byte for byte, llama.* keys for 32 layers of d_model 4096, then the tensors streamed to
// disk from one repeated block of random Q4_0 data (small scales keep the activations finite).
import fs from "node:fs";

const LAYERS = 32, D = 4096, FFN = 14336, HEADS = 32, KV_HEADS = 8, ALIGN = 32;
const Q4_0 = 2, F32 = 0;

/** Raw bytes of every `tokenizer.*` key-value pair of a GGUF header, and their count. */
function tokenizerKvs(file) {
  const fd = fs.openSync(file, "r");
  const buf = Buffer.alloc(16 << 20);
  fs.readSync(fd, buf, 0, buf.length, 0);
  fs.closeSync(fd);
  let at = 16;
  const nKv = Number(buf.readBigUInt64LE(at));
  at += 8;
  const sizes = { 0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8 };
  const skip = (type) => {
    if (type === 8) at += 8 + Number(buf.readBigUInt64LE(at));
    else if (type === 9) {
      const item = buf.readUInt32LE(at);
      const n = Number(buf.readBigUInt64LE(at + 4));
      at += 12;
      for (let i = 0; i < n; i++) skip(item);
    } else at += sizes[type];
  };
  const kept = [];
  for (let i = 0; i < nKv; i++) {
    const start = at;
    const keyLen = Number(buf.readBigUInt64LE(at));
    const key = buf.toString("utf8", at + 8, at + 8 + keyLen);
    at += 8 + keyLen;
    const type = buf.readUInt32LE(at);
    at += 4;
    skip(type);
    if (key.startsWith("tokenizer.") && key !== "tokenizer.chat_template") kept.push(buf.subarray(start, at));
  }
  return kept;
}

const str = (s) => {
  const b = Buffer.from(s, "utf8");
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(b.length));
  return Buffer.concat([len, b]);
};
const kv = (key, type, value) => {
  const t = Buffer.alloc(4);
  t.writeUInt32LE(type);
  return Buffer.concat([str(key), t, value]);
};
const u32 = (v) => { const b = Buffer.alloc(4); b.writeUInt32LE(v); return b; };
const f32 = (v) => { const b = Buffer.alloc(4); b.writeFloatLE(v); return b; };

/** The tensors of the 8B shape: [name, dims (ggml order), type]. */
function tensors(vocab) {
  const out = [["token_embd.weight", [D, vocab], Q4_0], ["output_norm.weight", [D], F32], ["output.weight", [D, vocab], Q4_0]];
  for (let i = 0; i < LAYERS; i++) {
    const b = (n) => `blk.${i}.${n}.weight`;
    out.push(
      [b("attn_norm"), [D], F32], [b("attn_q"), [D, D], Q4_0], [b("attn_k"), [D, (D / HEADS) * KV_HEADS], Q4_0],
      [b("attn_v"), [D, (D / HEADS) * KV_HEADS], Q4_0], [b("attn_output"), [D, D], Q4_0], [b("ffn_norm"), [D], F32],
      [b("ffn_gate"), [D, FFN], Q4_0], [b("ffn_up"), [D, FFN], Q4_0], [b("ffn_down"), [FFN, D], Q4_0],
    );
  }
  return out;
}

const bytesOf = (dims, type) => {
  const n = dims.reduce((a, b) => a * b, 1);
  return type === F32 ? n * 4 : (n / 32) * 18;
};

/** Writes the model to `out` (skipped when a file of the right size is there); returns its size. */
export function writeBigModel(out, tokenizerFrom) {
  const toks = tokenizerKvs(tokenizerFrom);
  const vocabKv = toks.find((b) => b.includes(Buffer.from("tokenizer.ggml.tokens")));
  const vocab = Number(vocabKv.readBigUInt64LE(8 + "tokenizer.ggml.tokens".length + 8));
  const list = tensors(vocab);
  const meta = [
    kv("general.architecture", 8, str("llama")),
    kv("general.name", 8, str("random 8B-shaped Q4_0")),
    kv("llama.block_count", 4, u32(LAYERS)),
    kv("llama.context_length", 4, u32(8192)),
    kv("llama.embedding_length", 4, u32(D)),
    kv("llama.feed_forward_length", 4, u32(FFN)),
    kv("llama.attention.head_count", 4, u32(HEADS)),
    kv("llama.attention.head_count_kv", 4, u32(KV_HEADS)),
    kv("llama.rope.freq_base", 6, f32(500000)),
    kv("llama.attention.layer_norm_rms_epsilon", 6, f32(1e-5)),
    ...toks,
  ];
  const infos = [];
  let offset = 0;
  for (const [name, dims, type] of list) {
    const d = Buffer.alloc(4 + dims.length * 8 + 4 + 8);
    d.writeUInt32LE(dims.length, 0);
    dims.forEach((x, i) => d.writeBigUInt64LE(BigInt(x), 4 + i * 8));
    d.writeUInt32LE(type, 4 + dims.length * 8);
    d.writeBigUInt64LE(BigInt(offset), 8 + dims.length * 8);
    infos.push(Buffer.concat([str(name), d]));
    offset += Math.ceil(bytesOf(dims, type) / ALIGN) * ALIGN;
  }
  const head = Buffer.alloc(24);
  head.write("GGUF", 0, "latin1");
  head.writeUInt32LE(3, 4);
  head.writeBigUInt64LE(BigInt(list.length), 8);
  head.writeBigUInt64LE(BigInt(meta.length), 16);
  let header = Buffer.concat([head, ...meta, ...infos]);
  header = Buffer.concat([header, Buffer.alloc((ALIGN - (header.length % ALIGN)) % ALIGN)]);
  const total = header.length + offset;
  if (fs.existsSync(out) && fs.statSync(out).size === total) return total;

  // One 18 MiB run of random Q4_0 blocks (scale about 0.002, either sign), reused for every tensor.
  let seed = 12345;
  const rand = () => ((seed = (seed * 1103515245 + 12345) >>> 0) >>> 16) & 255;
  const block = Buffer.alloc(18 << 20);
  const scale = Buffer.alloc(2);
  for (let b = 0; b < block.length; b += 18) {
    scale.writeUInt16LE(rand() & 1 ? 0x1818 : 0x9818); // +-0.00214 in f16
    scale.copy(block, b);
    for (let i = 2; i < 18; i++) block[b + i] = rand();
  }
  const fd = fs.openSync(out, "w");
  fs.writeSync(fd, header);
  for (const [, dims, type] of list) {
    let left = bytesOf(dims, type);
    const padded = Math.ceil(left / ALIGN) * ALIGN;
    if (type === F32) fs.writeSync(fd, Buffer.alloc(left, 0).fill(f32(1)));
    else
      while (left > 0) {
        const n = Math.min(left, block.length);
        fs.writeSync(fd, block, 0, n);
        left -= n;
      }
    fs.writeSync(fd, Buffer.alloc(padded - bytesOf(dims, type)));
  }
  fs.closeSync(fd);
  return total;
}
