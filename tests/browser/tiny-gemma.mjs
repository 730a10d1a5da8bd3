// Writes a tiny random-weight Gemma 3 for the package test, without the engine: the gemma3 plan
// (five sliding-window layers with a window of 4 tokens, then a global one; per-head q/k norms,
// post-attention and post-FFN norms, GELU, the embedding scale, the tied output), Gemma 3's own
// SentencePiece tokenizer (all 262,144 tokens, copied byte for byte from
// models/gemma-3-270m-q4_k_m.gguf) and the weight types of that Q4_K_M file: Q8_0 embedding and
// v, Q5_0 q/k/gate/up, Q4_K attn_output, Q6_K ffn_down. 18 MB, where Gemma 3 270M is 253 MB
// and decodes at about a token a second in SwiftShader.
import fs from "node:fs";
import { readGguf, ggufHeader, kv, str, u32, f32, GGUF_ALIGN as ALIGN } from "./gguf.mjs";

const D = 64, HEADS = 4, KV_HEADS = 1, HEAD_DIM = 64, FFN = 256, LAYERS = 6, WINDOW = 4;
// ggml type ids, values per block, bytes per block.
const T = { F32: [0, 1, 4], Q5_0: [6, 32, 22], Q8_0: [8, 32, 34], Q4_K: [12, 256, 144], Q6_K: [14, 256, 210] };

let seed = 20261202;
const rand = () => {
  seed ^= seed << 13;
  seed ^= seed >>> 17;
  seed ^= seed << 5;
  return (seed >>> 0) / 2 ** 32;
};

/** The f16 bits of a normal number (round to nearest). */
function f16(x) {
  const b = Buffer.alloc(4);
  b.writeFloatLE(x);
  const bits = b.readUInt32LE();
  const sign = (bits >>> 16) & 0x8000;
  const exp = ((bits >>> 23) & 0xff) - 127 + 15;
  const mant = Math.round((bits & 0x7fffff) / 8192);
  if (exp <= 0 || exp >= 31) throw new Error(`${x} is not a normal f16`);
  return sign | ((exp << 10) + mant);
}

/**
 * Random blocks of `type` for `n` values with block scale `d` (weights of a few hundredths, as
 * a trained model's; K-quants' sub-block scales and mins random too).
 */
function randomBlocks(type, n, d) {
  const [, per, bytes] = T[type];
  const out = Buffer.alloc((n / per) * bytes);
  for (let i = 0; i < out.length; i++) out[i] = Math.floor(rand() * 256);
  for (let at = 0; at < out.length; at += bytes) {
    if (type === "Q8_0" || type === "Q5_0") out.writeUInt16LE(f16(d), at);
    else if (type === "Q4_K") {
      // value = d * scale * q - dmin * min: dmin = 7.5 d centres it (q and both 6-bit numbers random).
      out.writeUInt16LE(f16(d), at);
      out.writeUInt16LE(f16(7.5 * d), at + 2);
    } else if (type === "Q6_K") {
      // value = d * scale * (q - 32), the 16 int8 scales small.
      for (let s = 0; s < 16; s++) out.writeInt8(Math.floor(rand() * 17) - 8, at + 192 + s);
      out.writeUInt16LE(f16(d), at + 208);
    }
  }
  return out;
}

/** Norm weights uniform in [lo, lo + 1). */
const norm = (n, lo = 0.5) => {
  const out = Buffer.alloc(4 * n);
  for (let i = 0; i < n; i++) out.writeFloatLE(lo + rand(), 4 * i);
  return out;
};

/** Writes the model to `out`; returns its size. `tokenizerFrom`: a Gemma 3 GGUF. */
export function writeTinyGemma(out, tokenizerFrom, { window = WINDOW } = {}) {
  seed = 20261202;
  const { metadata, kvs } = readGguf(tokenizerFrom);
  if (metadata["general.architecture"] !== "gemma3") throw new Error(`${tokenizerFrom} is not a Gemma 3 model`);
  const vocab = metadata["tokenizer.ggml.tokens"].length;
  const q = HEADS * HEAD_DIM;
  const kvd = KV_HEADS * HEAD_DIM;
  // [name, dims (ggml order: input first), type, data]
  const tensors = [
    ["token_embd.weight", [D, vocab], "Q8_0", randomBlocks("Q8_0", D * vocab, 0.1 / 74)],
    ["output_norm.weight", [D], "F32", norm(D, 1.5)],
  ];
  for (let i = 0; i < LAYERS; i++) {
    const b = (n) => `blk.${i}.${n}.weight`;
    tensors.push(
      [b("attn_norm"), [D], "F32", norm(D)],
      [b("attn_q"), [D, q], "Q5_0", randomBlocks("Q5_0", D * q, 0.08 / 9.2)],
      [b("attn_k"), [D, kvd], "Q5_0", randomBlocks("Q5_0", D * kvd, 0.08 / 9.2)],
      [b("attn_v"), [D, kvd], "Q8_0", randomBlocks("Q8_0", D * kvd, 0.08 / 74)],
      [b("attn_q_norm"), [HEAD_DIM], "F32", norm(HEAD_DIM)],
      [b("attn_k_norm"), [HEAD_DIM], "F32", norm(HEAD_DIM)],
      [b("attn_output"), [q, D], "Q4_K", randomBlocks("Q4_K", q * D, 0.3 / 250)],
      [b("post_attention_norm"), [D], "F32", norm(D)],
      [b("ffn_norm"), [D], "F32", norm(D)],
      [b("ffn_gate"), [D, FFN], "Q5_0", randomBlocks("Q5_0", D * FFN, 0.08 / 9.2)],
      [b("ffn_up"), [D, FFN], "Q5_0", randomBlocks("Q5_0", D * FFN, 0.08 / 9.2)],
      [b("ffn_down"), [FFN, D], "Q6_K", randomBlocks("Q6_K", FFN * D, 0.3 / 92)],
      [b("post_ffw_norm"), [D], "F32", norm(D)],
    );
  }
  const meta = [
    kv("general.architecture", 8, str("gemma3")),
    kv("general.name", 8, str("tiny random Gemma 3")),
    kv("gemma3.context_length", 4, u32(32768)),
    kv("gemma3.embedding_length", 4, u32(D)),
    kv("gemma3.block_count", 4, u32(LAYERS)),
    kv("gemma3.feed_forward_length", 4, u32(FFN)),
    kv("gemma3.attention.head_count", 4, u32(HEADS)),
    kv("gemma3.attention.head_count_kv", 4, u32(KV_HEADS)),
    kv("gemma3.attention.key_length", 4, u32(HEAD_DIM)),
    kv("gemma3.attention.value_length", 4, u32(HEAD_DIM)),
    kv("gemma3.attention.layer_norm_rms_epsilon", 6, f32(1e-6)),
    kv("gemma3.rope.freq_base", 6, f32(1e6)),
    kv("gemma3.attention.sliding_window", 4, u32(window)),
    // Gemma 3's tokenizer, byte for byte (SentencePiece: tokens, scores, types, BOS added).
    ...kvs.filter((k) => k.key.startsWith("tokenizer.")).map((k) => k.raw),
  ];
  let offset = 0;
  const infos = tensors.map(([name, dims, type, data]) => {
    const at = offset;
    offset += Math.ceil(data.length / ALIGN) * ALIGN;
    return { name, dims, typeId: T[type][0], offset: at };
  });
  const fd = fs.openSync(out, "w");
  const header = ggufHeader(meta, infos);
  fs.writeSync(fd, header);
  for (const [, , , data] of tensors) {
    fs.writeSync(fd, data);
    fs.writeSync(fd, Buffer.alloc(Math.ceil(data.length / ALIGN) * ALIGN - data.length));
  }
  fs.closeSync(fd);
  return header.length + offset;
}
