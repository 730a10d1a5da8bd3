//! The CPU f32 reference forward pass: dequantized weights, grouped-query attention, GGUF RoPE,
//! a KV cache. Written to be read top to bottom; it is the oracle the GPU path is tested against.

use super::{ModelConfig, TensorNames};
use crate::error::{Error, Result};
use crate::gguf::{self, Gguf};

struct Layer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
}

pub struct CpuModel {
    pub config: ModelConfig,
    token_embd: Vec<f32>,
    output_norm: Vec<f32>,
    /// None when tied to `token_embd`.
    output: Option<Vec<f32>>,
    layers: Vec<Layer>,
    /// RoPE inverse frequency of each rotated pair.
    inv_freq: Vec<f64>,
}

/// Keys and values of every position seen so far, per layer, `[pos][kv_dim]`.
#[derive(Default, Clone)]
pub struct CpuKvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
}

impl CpuKvCache {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Forgets positions from `len` on (reuse of a shared prefix).
    pub fn truncate(&mut self, len: usize, kv_dim: usize) {
        self.len = self.len.min(len);
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.truncate(self.len * kv_dim);
        }
    }
}

/// Which positions of a forward pass produce logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    Last,
    All,
}

impl CpuModel {
    pub fn load(gguf: &Gguf, file: &[u8]) -> Result<Self> {
        let config = super::ModelConfig::from_gguf(gguf)?;
        let names = TensorNames::new(&config);
        names.validate(gguf, &config)?;
        let load = |name: &str| -> Result<Vec<f32>> {
            let info = gguf.require_tensor(name)?;
            Ok(gguf::dequantize(info, info.data(file))?)
        };
        let layers = names
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    attn_norm: load(&l.attn_norm)?,
                    wq: load(&l.wq)?,
                    wk: load(&l.wk)?,
                    wv: load(&l.wv)?,
                    wo: load(&l.wo)?,
                    ffn_norm: load(&l.ffn_norm)?,
                    w_gate: load(&l.w_gate)?,
                    w_up: load(&l.w_up)?,
                    w_down: load(&l.w_down)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let output = if config.tied_output { None } else { Some(load(&names.output)?) };
        let inv_freq = rope_inv_freq(&config);
        Ok(Self {
            token_embd: load(&names.token_embd)?,
            output_norm: load(&names.output_norm)?,
            output,
            layers,
            inv_freq,
            config,
        })
    }

    pub fn new_cache(&self) -> CpuKvCache {
        CpuKvCache { k: vec![Vec::new(); self.config.n_layers], v: vec![Vec::new(); self.config.n_layers], len: 0 }
    }

    /// Runs `tokens` at positions `cache.len()..`, appends their keys and values to the cache and
    /// returns the logits of the last position (`vocab` values) or of every position (`n * vocab`).
    pub fn forward(&self, cache: &mut CpuKvCache, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        if cache.len + tokens.len() > c.context_length {
            return Err(Error::ContextOverflow {
                prompt_tokens: cache.len + tokens.len(),
                max_tokens: 0,
                context_length: c.context_length,
            });
        }
        let (n, d, kv_dim) = (tokens.len(), c.d_model, c.kv_dim());
        let start = cache.len;

        let mut x = vec![0f32; n * d];
        for (t, &id) in tokens.iter().enumerate() {
            if id as usize >= c.vocab_size {
                return Err(Error::TokenOutOfRange { id, vocab_size: c.vocab_size });
            }
            x[t * d..(t + 1) * d].copy_from_slice(&self.token_embd[id as usize * d..(id as usize + 1) * d]);
        }

        let mut xn = vec![0f32; n * d];
        let mut q = vec![0f32; n * c.q_dim()];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        let mut attn = vec![0f32; n * c.q_dim()];
        let mut gate = vec![0f32; n * c.ffn_dim];
        let mut up = vec![0f32; n * c.ffn_dim];
        let mut proj = vec![0f32; n * d];

        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&mut xn, &x, &layer.attn_norm, c.rms_eps);
            matmul(&mut q, &xn, &layer.wq, d);
            matmul(&mut k, &xn, &layer.wk, d);
            matmul(&mut v, &xn, &layer.wv, d);
            for t in 0..n {
                let pos = start + t;
                rope(&mut q[t * c.q_dim()..(t + 1) * c.q_dim()], pos, c.head_dim, &self.inv_freq);
                rope(&mut k[t * kv_dim..(t + 1) * kv_dim], pos, c.head_dim, &self.inv_freq);
            }
            cache.k[li].extend_from_slice(&k);
            cache.v[li].extend_from_slice(&v);
            attention(c, &mut attn, &q, &cache.k[li], &cache.v[li], start);
            matmul(&mut proj, &attn, &layer.wo, c.q_dim());
            add_in_place(&mut x, &proj);

            rms_norm(&mut xn, &x, &layer.ffn_norm, c.rms_eps);
            matmul(&mut gate, &xn, &layer.w_gate, d);
            matmul(&mut up, &xn, &layer.w_up, d);
            for (g, u) in gate.iter_mut().zip(&up) {
                *g = silu(*g) * u;
            }
            matmul(&mut proj, &gate, &layer.w_down, c.ffn_dim);
            add_in_place(&mut x, &proj);
        }
        cache.len += n;

        let rows = match which {
            Logits::Last => &x[(n - 1) * d..],
            Logits::All => &x[..],
        };
        let mut normed = vec![0f32; rows.len()];
        rms_norm(&mut normed, rows, &self.output_norm, c.rms_eps);
        let mut logits = vec![0f32; rows.len() / d * c.vocab_size];
        matmul(&mut logits, &normed, self.output.as_deref().unwrap_or(&self.token_embd), d);
        Ok(logits)
    }
}

/// RoPE inverse frequency of each rotated pair: base^(-2i / rope_dim).
pub fn rope_inv_freq(c: &ModelConfig) -> Vec<f64> {
    (0..c.rope_dim / 2).map(|i| (c.rope_base as f64).powf(-2.0 * i as f64 / c.rope_dim as f64)).collect()
}

/// RoPE of every head of `x` at `pos`. GGUF stores llama's Q and K rows permuted so that the
/// rotation applies to adjacent pairs (x[2i], x[2i+1]).
pub fn rope(x: &mut [f32], pos: usize, head_dim: usize, inv_freq: &[f64]) {
    for (i, &f) in inv_freq.iter().enumerate() {
        let (sin, cos) = (pos as f64 * f).sin_cos();
        for head in x.chunks_exact_mut(head_dim) {
            let (a, b) = (head[2 * i] as f64, head[2 * i + 1] as f64);
            head[2 * i] = (a * cos - b * sin) as f32;
            head[2 * i + 1] = (a * sin + b * cos) as f32;
        }
    }
}

/// Causal grouped-query attention of queries at positions `start..` (rows of `q`, `q_dim`
/// wide) over the cache's keys and values (rows `kv_dim` wide, at least start + rows of q).
pub fn attention(c: &ModelConfig, out: &mut [f32], q: &[f32], k_cache: &[f32], v_cache: &[f32], start: usize) {
    let (hd, kv_dim, group) = (c.head_dim, c.kv_dim(), c.n_heads / c.n_kv_heads);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut scores = Vec::new();
    for (t, (q_t, out_t)) in q.chunks_exact(c.q_dim()).zip(out.chunks_exact_mut(c.q_dim())).enumerate() {
        let n_keys = start + t + 1;
        for h in 0..c.n_heads {
            let kv_off = (h / group) * hd;
            let qh = &q_t[h * hd..(h + 1) * hd];
            scores.clear();
            scores
                .extend((0..n_keys).map(|s| dot(qh, &k_cache[s * kv_dim + kv_off..s * kv_dim + kv_off + hd]) * scale));
            softmax(&mut scores);
            let oh = &mut out_t[h * hd..(h + 1) * hd];
            oh.fill(0.0);
            for (s, &p) in scores.iter().enumerate() {
                let vs = &v_cache[s * kv_dim + kv_off..s * kv_dim + kv_off + hd];
                for (o, &vv) in oh.iter_mut().zip(vs) {
                    *o += p * vv;
                }
            }
        }
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `out[t] = x[t] / rms(x[t]) * weight` for every row of `x`.
pub fn rms_norm(out: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for (o, xr) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
        let mean_sq = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        let inv = 1.0 / ((mean_sq as f32) + eps).sqrt();
        for ((o, &v), &w) in o.iter_mut().zip(xr).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out[t][j] = dot(x[t], w[j])` for rows `x[t]` of length `cols` and weight rows `w[j]`.
/// Splits the work over the machine's cores: over tokens when there are several, else over rows.
pub fn matmul(out: &mut [f32], x: &[f32], w: &[f32], cols: usize) {
    let (n, rows) = (x.len() / cols, w.len() / cols);
    let threads = worker_count();
    if threads <= 1 || rows * cols * n < 1 << 16 {
        matmul_block(out, x, w, cols, rows);
    } else if n >= threads {
        let per = n.div_ceil(threads);
        std::thread::scope(|s| {
            for (o, xs) in out.chunks_mut(per * rows).zip(x.chunks(per * cols)) {
                s.spawn(move || matmul_block(o, xs, w, cols, rows));
            }
        });
    } else {
        // One or few tokens: each thread takes a slice of the weight rows.
        let per = rows.div_ceil(threads);
        let mut parts: Vec<Vec<f32>> = Vec::new();
        std::thread::scope(|s| {
            let handles: Vec<_> = w
                .chunks(per * cols)
                .map(|ws| {
                    s.spawn(move || {
                        let r = ws.len() / cols;
                        let mut o = vec![0f32; n * r];
                        matmul_block(&mut o, x, ws, cols, r);
                        o
                    })
                })
                .collect();
            parts = handles.into_iter().map(|h| h.join().expect("matmul worker panicked")).collect();
        });
        let mut row0 = 0;
        for part in parts {
            let r = part.len() / n;
            for t in 0..n {
                out[t * rows + row0..t * rows + row0 + r].copy_from_slice(&part[t * r..(t + 1) * r]);
            }
            row0 += r;
        }
    }
}

fn matmul_block(out: &mut [f32], x: &[f32], w: &[f32], cols: usize, rows: usize) {
    const TOKENS_PER_TILE: usize = 16;
    let n = x.len() / cols;
    for t0 in (0..n).step_by(TOKENS_PER_TILE) {
        let t1 = (t0 + TOKENS_PER_TILE).min(n);
        for (j, wr) in w.chunks_exact(cols).enumerate() {
            for t in t0..t1 {
                out[t * rows + j] = dot(&x[t * cols..(t + 1) * cols], wr);
            }
        }
    }
}

fn worker_count() -> usize {
    if cfg!(target_arch = "wasm32") {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
    }
}
