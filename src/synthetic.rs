//! Random-weight models with the shapes of real ones (Llama 3.2 1B, Llama 3 8B) in Q4_0, made on
//! the fly as a `ByteSource`: a benchmark of a large model needs no download and no disk. The
//! weights repeat one run of random blocks with small scales, so activations stay finite; the
//! tokenizer is byte-level (one token per byte of text) padded with reserved tokens to the real
//! vocabulary size, so the embedding and output matrices have their real sizes.

use crate::error::{Error, Result};
use crate::gguf::{Array, ByteSource, GgmlType, GgufError, GgufWriter, Value};

/// A Llama-family shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub name: &'static str,
    pub layers: u64,
    pub d_model: u64,
    pub ffn: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub vocab: u64,
    pub context: u32,
    /// The output matrix is the embedding table.
    pub tied: bool,
}

pub const LLAMA_3_2_1B: Shape = Shape {
    name: "1b",
    layers: 16,
    d_model: 2048,
    ffn: 8192,
    heads: 32,
    kv_heads: 8,
    vocab: 128256,
    context: 131072,
    tied: true,
};

pub const LLAMA_3_8B: Shape = Shape {
    name: "8b",
    layers: 32,
    d_model: 4096,
    ffn: 14336,
    heads: 32,
    kv_heads: 8,
    vocab: 128256,
    context: 8192,
    tied: false,
};

pub const SHAPES: [Shape; 2] = [LLAMA_3_2_1B, LLAMA_3_8B];

impl Shape {
    /// "1b" or "8b".
    pub fn named(name: &str) -> Result<Shape> {
        SHAPES.into_iter().find(|s| s.name.eq_ignore_ascii_case(name)).ok_or_else(|| Error::InvalidOption {
            name: "--synthetic",
            value: name.into(),
            expected: "1b (Llama 3.2 1B's shape) or 8b (Llama 3 8B's)".into(),
        })
    }
}

/// Bytes of Q4_0 blocks the weights repeat: a multiple of the block size (18).
const RUN_BYTES: usize = 18 * 4096;

enum Fill {
    Ones,
    Blocks,
}

struct Region {
    start: u64,
    len: u64,
    fill: Fill,
}

/// The model's file, made as it is read.
pub struct SyntheticSource {
    header: Vec<u8>,
    regions: Vec<Region>,
    run: Vec<u8>,
    len: u64,
}

/// The 256 byte tokens of a byte-level BPE vocabulary (GPT-2's byte-to-character map).
pub fn byte_tokens() -> Vec<String> {
    let direct = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            let c = if direct(b) {
                b
            } else {
                extra += 1;
                255 + extra
            };
            char::from_u32(c).expect("below the surrogates").to_string()
        })
        .collect()
}

impl SyntheticSource {
    pub fn new(shape: Shape) -> Self {
        let s = shape;
        let head_dim = s.d_model / s.heads;
        let mut w = GgufWriter::new(3);
        w.metadata("general.architecture", Value::String("llama".into()))
            .metadata("general.name", Value::String(format!("random {}-shaped Q4_0", s.name.to_uppercase())))
            .metadata("llama.block_count", Value::U32(s.layers as u32))
            .metadata("llama.context_length", Value::U32(s.context))
            .metadata("llama.embedding_length", Value::U32(s.d_model as u32))
            .metadata("llama.feed_forward_length", Value::U32(s.ffn as u32))
            .metadata("llama.attention.head_count", Value::U32(s.heads as u32))
            .metadata("llama.attention.head_count_kv", Value::U32(s.kv_heads as u32))
            .metadata("llama.rope.freq_base", Value::F32(500000.0))
            .metadata("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
        let mut tokens = byte_tokens();
        tokens.push("<|begin_of_text|>".into());
        tokens.push("<|end_of_text|>".into());
        let named = tokens.len();
        tokens.extend((named as u64..s.vocab).map(|i| format!("<|reserved_special_token_{i}|>")));
        let types: Vec<i32> = (0..s.vocab).map(|i| if i < 256 { 1 } else { 3 }).collect();
        w.metadata("tokenizer.ggml.model", Value::String("gpt2".into()))
            .metadata("tokenizer.ggml.pre", Value::String("default".into()))
            .metadata("tokenizer.ggml.tokens", Value::List(Array::from(tokens)))
            .metadata("tokenizer.ggml.token_type", Value::List(Array::I32(types)))
            .metadata("tokenizer.ggml.merges", Value::List(Array::from(Vec::<String>::new())))
            .metadata("tokenizer.ggml.bos_token_id", Value::U32(256))
            .metadata("tokenizer.ggml.eos_token_id", Value::U32(257));

        let mut fills = Vec::new();
        let mut add = |w: &mut GgufWriter, name: String, dims: &[u64]| {
            let n: u64 = dims.iter().product();
            let (ty, len, fill) = if dims.len() == 1 {
                (GgmlType::F32, 4 * n, Fill::Ones)
            } else {
                (GgmlType::Q4_0, n / 32 * 18, Fill::Blocks)
            };
            w.tensor_sized(&name, dims, ty, len);
            fills.push((len, fill));
        };
        let (d, kv) = (s.d_model, head_dim * s.kv_heads);
        add(&mut w, "token_embd.weight".into(), &[d, s.vocab]);
        add(&mut w, "output_norm.weight".into(), &[d]);
        if !s.tied {
            add(&mut w, "output.weight".into(), &[d, s.vocab]);
        }
        for i in 0..s.layers {
            let b = |n: &str| format!("blk.{i}.{n}.weight");
            add(&mut w, b("attn_norm"), &[d]);
            add(&mut w, b("attn_q"), &[d, d]);
            add(&mut w, b("attn_k"), &[d, kv]);
            add(&mut w, b("attn_v"), &[d, kv]);
            add(&mut w, b("attn_output"), &[d, d]);
            add(&mut w, b("ffn_norm"), &[d]);
            add(&mut w, b("ffn_gate"), &[d, s.ffn]);
            add(&mut w, b("ffn_up"), &[d, s.ffn]);
            add(&mut w, b("ffn_down"), &[s.ffn, d]);
        }
        let (header, offsets) = w.header();
        let base = header.len() as u64;
        let regions: Vec<Region> = offsets
            .iter()
            .zip(fills)
            .map(|(&offset, (len, fill))| Region { start: base + offset, len, fill })
            .collect();
        let len = regions.last().map_or(base, |r| r.start + r.len);

        // Q4_0 blocks: an f16 scale of about 0.002 (either sign), then 32 random 4-bit quants.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut run = Vec::with_capacity(RUN_BYTES);
        while run.len() < RUN_BYTES {
            let r = next();
            let scale = (0.001 + 0.002 * (r % 1000) as f32 / 1000.0) * if r >> 63 == 1 { -1.0 } else { 1.0 };
            run.extend_from_slice(&half::f16::from_f32(scale).to_le_bytes());
            let (a, b) = (next().to_le_bytes(), next().to_le_bytes());
            run.extend_from_slice(&a);
            run.extend_from_slice(&b);
        }
        Self { header, regions, run, len }
    }

    /// Writes the whole file to `out` in 16 MiB pieces (so other engines can run the same model).
    pub fn write_to(&self, out: &mut impl std::io::Write) -> std::io::Result<()> {
        let mut piece = vec![0; 16 << 20];
        let mut offset = 0;
        while offset < self.len {
            let n = (self.len - offset).min(piece.len() as u64) as usize;
            self.fill(offset, &mut piece[..n]);
            out.write_all(&piece[..n])?;
            offset += n as u64;
        }
        Ok(())
    }

    /// Writes the file's bytes from `offset` into `out`.
    fn fill(&self, mut offset: u64, mut out: &mut [u8]) {
        const ONE: [u8; 4] = 1f32.to_le_bytes();
        while !out.is_empty() {
            let n;
            if offset < self.header.len() as u64 {
                let h = &self.header[offset as usize..];
                n = h.len().min(out.len());
                out[..n].copy_from_slice(&h[..n]);
            } else {
                let i = self.regions.partition_point(|r| r.start <= offset);
                let next_start = self.regions.get(i).map_or(u64::MAX, |r| r.start);
                match i.checked_sub(1).map(|j| &self.regions[j]) {
                    Some(r) if offset < r.start + r.len => {
                        let at = offset - r.start;
                        let left = (r.start + r.len - offset).min(out.len() as u64) as usize;
                        match r.fill {
                            Fill::Ones => {
                                n = left;
                                for (k, byte) in out[..n].iter_mut().enumerate() {
                                    *byte = ONE[(at as usize + k) % 4];
                                }
                            }
                            Fill::Blocks => {
                                let from = (at % self.run.len() as u64) as usize;
                                n = left.min(self.run.len() - from);
                                out[..n].copy_from_slice(&self.run[from..from + n]);
                            }
                        }
                    }
                    // Alignment padding before the next tensor (or past the last one).
                    _ => {
                        n = (next_start - offset).min(out.len() as u64) as usize;
                        out[..n].fill(0);
                    }
                }
            }
            offset += n as u64;
            out = &mut out[n..];
        }
    }
}

impl ByteSource for SyntheticSource {
    fn len(&self) -> u64 {
        self.len
    }

    async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, GgufError> {
        let mut out = vec![0; len as usize];
        self.fill(offset, &mut out);
        Ok(out)
    }
}
