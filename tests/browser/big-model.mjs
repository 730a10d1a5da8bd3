// A random-weight GGUF with Llama 3 8B's shapes in Q4_0 (about 4.2 GB) for the big-model
// browser test, served from memory as it is read: the default model's tokenizer metadata copied
// byte for byte, llama.* keys for 32 layers of d_model 4096, then the tensors from one repeated
// block of random Q4_0 data (small scales keep the activations finite).
import { readGguf, ggufHeader, kv, str, u32, f32, GGUF_ALIGN as ALIGN } from "./gguf.mjs";

const LAYERS = 32, D = 4096, FFN = 14336, HEADS = 32, KV_HEADS = 8;
const Q4_0 = 2, F32 = 0;

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

/**
 * The model as a virtual file for lib.mjs's `serve` ({size, chunks(start, end)}): its bytes
 * made as they are sent, never written to disk (4.2 GB) or held in memory (one 18 MiB run of
 * random Q4_0 blocks, scale about 0.002 of either sign so the activations stay finite, is the
 * data of every quantized tensor from its start; the norms are ones; padding is zeros).
 */
export function bigModel(tokenizerFrom) {
  const { metadata, kvs } = readGguf(tokenizerFrom);
  const vocab = metadata["tokenizer.ggml.tokens"].length;
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
    // The default model's tokenizer, byte for byte (its chat template left out).
    ...kvs.filter((k) => k.key.startsWith("tokenizer.") && k.key !== "tokenizer.chat_template").map((k) => k.raw),
  ];
  let offset = 0;
  const infos = list.map(([name, dims, typeId]) => {
    const at = offset;
    offset += Math.ceil(bytesOf(dims, typeId) / ALIGN) * ALIGN;
    return { name, dims, typeId, offset: at };
  });
  const header = ggufHeader(meta, infos);

  let seed = 12345;
  const rand = () => ((seed = (seed * 1103515245 + 12345) >>> 0) >>> 16) & 255;
  const block = Buffer.alloc(18 << 20);
  const scale = Buffer.alloc(2);
  for (let b = 0; b < block.length; b += 18) {
    scale.writeUInt16LE(rand() & 1 ? 0x1818 : 0x9818); // +-0.00214 in f16
    scale.copy(block, b);
    for (let i = 2; i < 18; i++) block[b + i] = rand();
  }
  const ones = Buffer.alloc(4 * D).fill(f32(1));
  const zeros = Buffer.alloc(ALIGN);
  // The file as segments [start, length, repeating source]: a byte at `o` into a segment is
  // its source's byte o % source.length.
  const segments = [];
  let at = 0;
  const push = (length, source) => {
    if (length > 0) segments.push([at, length, source]);
    at += length;
  };
  push(header.length, header);
  for (const [, dims, type] of list) {
    const n = bytesOf(dims, type);
    push(n, type === F32 ? ones : block);
    push(Math.ceil(n / ALIGN) * ALIGN - n, zeros);
  }
  return {
    size: at,
    /** The bytes start..=end, in pieces of at most 1 MiB that are views of the sources. */
    *chunks(start, end) {
      for (const [s, length, source] of segments) {
        let o = Math.max(start, s);
        const last = Math.min(end, s + length - 1);
        while (o <= last) {
          const k = (o - s) % source.length;
          const n = Math.min(last - o + 1, source.length - k, 1 << 20);
          yield source.subarray(k, k + n);
          o += n;
        }
      }
    },
  };
}
