//! The CPU f32 reference forward pass: dequantized weights, grouped-query attention, GGUF RoPE,
//! a KV cache. Written to be read top to bottom; it is the oracle the GPU path is tested against.

use crate::arch::ModelConfig;
use crate::arch::{Activation, Experts, GateUp, Plan, Qkv, RopeStyle};
use crate::error::{Error, Result};
use crate::gguf::Gguf;

/// One layer's weights, dequantized; fused tensors are split at load, so the pass below has one
/// form for every architecture.
struct Layer {
    attn_norm: Vec<f32>,
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    bias: Option<[Vec<f32>; 3]>,
    qk_norm: Option<[Vec<f32>; 2]>,
    wo: Vec<f32>,
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    /// A mixture of experts' stacked matrices: expert e's rows are e * ffn .. (e + 1) * ffn
    /// of gate and up, e * d .. (e + 1) * d of down.
    w_gate: Vec<f32>,
    w_up: Vec<f32>,
    w_down: Vec<f32>,
    /// The router of a mixture of experts (`count` rows), its bias, and the experts' gate, up
    /// and down biases (stacked as their matrices' rows).
    router: Option<Vec<f32>>,
    router_bias: Option<Vec<f32>>,
    expert_biases: Option<[Vec<f32>; 3]>,
    /// A logit per query head in every softmax (gpt-oss), the output projection's bias.
    sinks: Option<Vec<f32>>,
    wo_bias: Option<Vec<f32>>,
    /// A short convolution in place of attention (whose weights are then empty).
    conv: Option<ConvWeights>,
    post_ffn_norm: Option<Vec<f32>>,
    /// RoPE inverse frequency of each rotated pair, and the factor on cos and sin.
    inv_freq: Vec<f64>,
    mscale: f64,
}

/// LFM2's short convolution (`arch::ShortConv`).
struct ConvWeights {
    in_proj: Vec<f32>,
    /// Channel c's taps at c * kernel .. (c + 1) * kernel, oldest position first.
    taps: Vec<f32>,
    out_proj: Vec<f32>,
    kernel: usize,
}

pub struct CpuModel {
    pub config: ModelConfig,
    pub plan: Plan,
    token_embd: Vec<f32>,
    output_norm: Vec<f32>,
    /// None when tied to `token_embd`.
    output: Option<Vec<f32>>,
    layers: Vec<Layer>,
}

/// Keys and values of every position seen so far, per layer, `[pos][kv_dim]` (a short
/// convolution's layer: its B * x, `[pos][d_model]` in `k`).
#[derive(Default, Clone)]
pub struct CpuKvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    /// Each layer's values a position (kv_dim, or d_model for a short convolution's B * x);
    /// empty: every layer's are the caller's kv_dim.
    widths: Vec<usize>,
}

impl CpuKvCache {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Forgets positions from `len` on (reuse of a shared prefix). Each layer's rows are as
    /// wide as it keeps (`kv_dim` for attention, d_model for a short convolution's B * x).
    pub fn truncate(&mut self, len: usize, kv_dim: usize) {
        self.len = self.len.min(len);
        for (i, (k, v)) in self.k.iter_mut().zip(self.v.iter_mut()).enumerate() {
            let width = self.widths.get(i).copied().unwrap_or(kv_dim);
            k.truncate(self.len * width);
            v.truncate(self.len * width);
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
        let plan = Plan::from_gguf(gguf, gguf.tensor(crate::arch::ROPE_FREQS).map(|t| t.data(file)))?;
        let c = plan.config.clone();
        let load = |name: &str| -> Result<Vec<f32>> {
            let info = gguf.require_tensor(name)?;
            crate::quant::dequantize(info, info.data(file))
        };
        // Rows [a, b) of a row-major matrix of `cols` columns.
        let rows = |m: &[f32], cols: usize, a: usize, b: usize| m[a * cols..b * cols].to_vec();
        let d = c.d_model;
        let layers = plan
            .layers
            .iter()
            .map(|l| {
                let (wq, wk, wv) = match &l.qkv {
                    _ if l.conv.is_some() => (Vec::new(), Vec::new(), Vec::new()),
                    Qkv::Separate([q, k, v]) => (load(q)?, load(k)?, load(v)?),
                    Qkv::Fused(name) => {
                        let w = load(name)?;
                        let (q, kv) = (c.q_dim(), c.kv_dim());
                        (rows(&w, d, 0, q), rows(&w, d, q, q + kv), rows(&w, d, q + kv, q + 2 * kv))
                    }
                };
                let (w_gate, w_up) = match &l.gate_up {
                    GateUp::Separate([g, u]) => (load(g)?, load(u)?),
                    GateUp::Fused(name) => {
                        let w = load(name)?;
                        (rows(&w, d, 0, c.ffn_dim), rows(&w, d, c.ffn_dim, 2 * c.ffn_dim))
                    }
                };
                let optional = |name: &Option<String>| name.as_deref().map(load).transpose();
                let conv = match &l.conv {
                    Some(sc) => Some(ConvWeights {
                        in_proj: load(&sc.in_proj)?,
                        taps: load(&sc.conv)?,
                        out_proj: load(&sc.out_proj)?,
                        kernel: sc.kernel,
                    }),
                    None => None,
                };
                let attention = l.conv.is_none();
                Ok(Layer {
                    conv,
                    attn_norm: load(&l.attn_norm)?,
                    wq,
                    wk,
                    wv,
                    bias: l
                        .qkv_bias
                        .as_ref()
                        .filter(|_| attention)
                        .map(|[q, k, v]| Ok::<_, Error>([load(q)?, load(k)?, load(v)?]))
                        .transpose()?,
                    qk_norm: l.qk_norm.as_ref().map(|[q, k]| Ok::<_, Error>([load(q)?, load(k)?])).transpose()?,
                    wo: if attention { load(&l.wo)? } else { Vec::new() },
                    post_attn_norm: optional(&l.post_attn_norm)?,
                    ffn_norm: load(&l.ffn_norm)?,
                    w_gate,
                    w_up,
                    w_down: load(&l.down)?,
                    router: l.experts.as_ref().map(|e| load(&e.router)).transpose()?,
                    router_bias: optional(&l.experts.as_ref().and_then(|e| e.router_bias.clone()))?,
                    expert_biases: match l.experts.as_ref().and_then(|e| e.biases.as_ref()) {
                        Some([g, u, d]) => Some([load(g)?, load(u)?, load(d)?]),
                        None => None,
                    },
                    sinks: optional(&l.attn_sinks)?,
                    wo_bias: optional(&l.wo_bias)?,
                    post_ffn_norm: optional(&l.post_ffn_norm)?,
                    inv_freq: plan.ropes[l.rope].inv_freq(),
                    mscale: plan.ropes[l.rope].mscale,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let output = if plan.output == plan.token_embd { None } else { Some(load(&plan.output)?) };
        Ok(Self {
            token_embd: load(&plan.token_embd)?,
            output_norm: load(&plan.output_norm)?,
            output,
            layers,
            config: c,
            plan,
        })
    }

    pub fn new_cache(&self) -> CpuKvCache {
        let c = &self.config;
        let widths = self.plan.layers.iter().map(|l| if l.conv.is_some() { c.d_model } else { c.kv_dim() }).collect();
        CpuKvCache { k: vec![Vec::new(); c.n_layers], v: vec![Vec::new(); c.n_layers], len: 0, widths }
    }

    /// Runs `tokens` at positions `cache.len()..`, appends their keys and values to the cache and
    /// returns the logits of the last position (`vocab` values) or of every position (`n * vocab`).
    pub fn forward(&self, cache: &mut CpuKvCache, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        self.forward_layers(cache, tokens, which, self.layers.len())
    }

    /// `forward` through the first `layers` layers, then the final norm and the LM head
    /// (self-speculation's draft). Only those layers' caches grow: truncate the cache back to
    /// its length before, before any whole forward pass.
    pub fn forward_layers(
        &self,
        cache: &mut CpuKvCache,
        tokens: &[u32],
        which: Logits,
        layers: usize,
    ) -> Result<Vec<f32>> {
        let (c, plan) = (&self.config, &self.plan);
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
        let (n, d, kv_dim, hd) = (tokens.len(), c.d_model, c.kv_dim(), c.head_dim);
        let start = cache.len;

        let mut x = vec![0f32; n * d];
        for (t, &id) in tokens.iter().enumerate() {
            if id as usize >= c.vocab_size {
                return Err(Error::TokenOutOfRange { id, vocab_size: c.vocab_size });
            }
            let row = &self.token_embd[id as usize * d..(id as usize + 1) * d];
            let scale = plan.embed_scale.unwrap_or(1.0);
            x[t * d..(t + 1) * d].iter_mut().zip(row).for_each(|(o, &e)| *o = e * scale);
        }

        let mut xn = vec![0f32; n * d];
        let mut q = vec![0f32; n * c.q_dim()];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        let mut attn = vec![0f32; n * c.q_dim()];
        let mut gate = vec![0f32; n * c.ffn_dim];
        let mut up = vec![0f32; n * c.ffn_dim];
        let mut proj = vec![0f32; n * d];

        for ((li, layer), lp) in self.layers.iter().enumerate().zip(&plan.layers).take(layers) {
            rms_norm(&mut xn, &x, &layer.attn_norm, c.rms_eps);
            if let Some(cw) = &layer.conv {
                short_conv(d, cw, &xn, &mut cache.k[li], start, &mut proj);
                add_in_place(&mut x, &proj);
                self.ffn(c, lp, layer, &mut x, &mut xn, &mut gate, &mut up, &mut proj);
                continue;
            }
            matmul(&mut q, &xn, &layer.wq, d);
            matmul(&mut k, &xn, &layer.wk, d);
            matmul(&mut v, &xn, &layer.wv, d);
            if let Some([bq, bk, bv]) = &layer.bias {
                add_rows(&mut q, bq);
                add_rows(&mut k, bk);
                add_rows(&mut v, bv);
            }
            if let Some([qn, kn]) = &layer.qk_norm {
                rms_norm_in_place(&mut q, qn, c.rms_eps);
                rms_norm_in_place(&mut k, kn, c.rms_eps);
            }
            let style = plan.ropes[lp.rope].style;
            for t in 0..n {
                let pos = start + t;
                rope(&mut q[t * c.q_dim()..(t + 1) * c.q_dim()], pos, hd, &layer.inv_freq, layer.mscale, style);
                rope(&mut k[t * kv_dim..(t + 1) * kv_dim], pos, hd, &layer.inv_freq, layer.mscale, style);
            }
            cache.k[li].extend_from_slice(&k);
            cache.v[li].extend_from_slice(&v);
            let kind = AttentionKind::of(plan, lp);
            attention(c, kind, layer.sinks.as_deref(), &mut attn, &q, &cache.k[li], &cache.v[li], start);
            matmul(&mut proj, &attn, &layer.wo, c.q_dim());
            if let Some(b) = &layer.wo_bias {
                add_rows(&mut proj, b);
            }
            if let Some(w) = &layer.post_attn_norm {
                rms_norm_in_place(&mut proj, w, c.rms_eps);
            }
            add_in_place(&mut x, &proj);
            self.ffn(c, lp, layer, &mut x, &mut xn, &mut gate, &mut up, &mut proj);
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
        if let Some(cap) = plan.final_softcap {
            logits.iter_mut().for_each(|l| *l = softcap(*l, cap));
        }
        Ok(logits)
    }
}

impl CpuModel {
    /// A layer's FFN (dense or a mixture of experts) and its residual add.
    #[allow(clippy::too_many_arguments)]
    fn ffn(
        &self,
        c: &ModelConfig,
        lp: &crate::arch::LayerPlan,
        layer: &Layer,
        x: &mut [f32],
        xn: &mut [f32],
        gate: &mut [f32],
        up: &mut [f32],
        proj: &mut [f32],
    ) {
        let (d, act) = (c.d_model, self.plan.activation);
        rms_norm(xn, x, &layer.ffn_norm, c.rms_eps);
        if let (Some(e), Some(router)) = (&lp.experts, &layer.router) {
            mixture(c, act, e, layer, router, xn, proj);
        } else {
            matmul(gate, xn, &layer.w_gate, d);
            matmul(up, xn, &layer.w_up, d);
            for (g, u) in gate.iter_mut().zip(up.iter()) {
                *g = activation(act, *g) * u;
            }
            matmul(proj, gate, &layer.w_down, c.ffn_dim);
        }
        if let Some(w) = &layer.post_ffn_norm {
            rms_norm_in_place(proj, w, c.rms_eps);
        }
        add_in_place(x, proj);
    }
}

/// LFM2's short convolution of the rows of `xn` (positions `start..`) into `out`: each
/// position's B * x appended to `state` (the layer's cache, d values a position), then
/// C * (the causal convolution of B * x over the last `kernel` positions, zeros before 0),
/// through out_proj.
fn short_conv(d: usize, cw: &ConvWeights, xn: &[f32], state: &mut Vec<f32>, start: usize, out: &mut [f32]) {
    let n = xn.len() / d;
    let mut bcx = vec![0f32; n * 3 * d];
    matmul(&mut bcx, xn, &cw.in_proj, d);
    for row in bcx.chunks_exact(3 * d) {
        state.extend(row[..d].iter().zip(&row[2 * d..]).map(|(b, x)| b * x));
    }
    let mut y = vec![0f32; n * d];
    for (t, (yt, row)) in y.chunks_exact_mut(d).zip(bcx.chunks_exact(3 * d)).enumerate() {
        let pos = start + t;
        for (ch, yc) in yt.iter_mut().enumerate() {
            let mut s = 0f32;
            for j in 0..cw.kernel {
                // Tap j reads position pos - (kernel - 1) + j.
                if let Some(p) = (pos + j + 1).checked_sub(cw.kernel) {
                    s += cw.taps[ch * cw.kernel + j] * state[p * d + ch];
                }
            }
            *yc = row[d + ch] * s;
        }
    }
    matmul(out, &y, &cw.out_proj, d);
}

/// A mixture of experts' FFN for each row of `xn` into `out`: each token's chosen experts'
/// gated FFNs, weighted by `route`.
fn mixture(c: &ModelConfig, act: Activation, e: &Experts, layer: &Layer, router: &[f32], xn: &[f32], out: &mut [f32]) {
    let (d, f) = (c.d_model, c.ffn_dim);
    let mut logits = vec![0f32; xn.len() / d * e.count];
    matmul(&mut logits, xn, router, d);
    if let Some(b) = &layer.router_bias {
        add_rows(&mut logits, b);
    }
    let (mut gate, mut up, mut y) = (vec![0f32; f], vec![0f32; f], vec![0f32; d]);
    for ((xt, lt), ot) in xn.chunks_exact(d).zip(logits.chunks_exact(e.count)).zip(out.chunks_exact_mut(d)) {
        ot.fill(0.0);
        for (ex, w) in route(e, lt) {
            matmul(&mut gate, xt, &layer.w_gate[ex * f * d..(ex + 1) * f * d], d);
            matmul(&mut up, xt, &layer.w_up[ex * f * d..(ex + 1) * f * d], d);
            if let Some([bg, bu, _]) = &layer.expert_biases {
                add_in_place(&mut gate, &bg[ex * f..(ex + 1) * f]);
                add_in_place(&mut up, &bu[ex * f..(ex + 1) * f]);
            }
            for (g, u) in gate.iter_mut().zip(&up) {
                *g = if e.swiglu_oai { swiglu_oai(*g, *u) } else { activation(act, *g) * u };
            }
            matmul(&mut y, &gate, &layer.w_down[ex * d * f..(ex + 1) * d * f], f);
            if let Some([_, _, bd]) = &layer.expert_biases {
                add_in_place(&mut y, &bd[ex * d..(ex + 1) * d]);
            }
            ot.iter_mut().zip(&y).for_each(|(o, v)| *o += w * v);
        }
    }
}

/// gpt-oss's clamped SwiGLU of a gate and an up value (`arch::SWIGLU_OAI`).
pub fn swiglu_oai(gate: f32, up: f32) -> f32 {
    let (alpha, limit) = crate::arch::SWIGLU_OAI;
    let g = gate.min(limit);
    let u = up.clamp(-limit, limit);
    (u + 1.0) * g / (1.0 + (-alpha * g).exp())
}

/// The experts a token's router logits choose and their weights: the softmax over all experts,
/// the `used` largest (the lower index first among equals), renormalized to sum to 1 when the
/// plan says so, times its scale.
pub fn route(e: &Experts, logits: &[f32]) -> Vec<(usize, f32)> {
    let mut p = logits.to_vec();
    softmax(&mut p);
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    order.truncate(e.used);
    let sum: f32 = order.iter().map(|&i| p[i]).sum();
    let norm = if e.normalize { sum } else { 1.0 };
    order.into_iter().map(|i| (i, p[i] / norm * e.scale)).collect()
}

/// RoPE of every head of `x` at `pos`, rotating the first 2 inv_freq.len() values of each head:
/// adjacent pairs (x[2i], x[2i+1]) or NeoX halves (x[i], x[i + dim/2]); cos and sin times
/// `mscale` (YaRN's attention factor, else 1).
pub fn rope(x: &mut [f32], pos: usize, head_dim: usize, inv_freq: &[f64], mscale: f64, style: RopeStyle) {
    let half = inv_freq.len();
    for (i, &f) in inv_freq.iter().enumerate() {
        let (sin, cos) = (pos as f64 * f).sin_cos();
        let (sin, cos) = (sin * mscale, cos * mscale);
        let (ia, ib) = match style {
            RopeStyle::Adjacent => (2 * i, 2 * i + 1),
            RopeStyle::NeoX => (i, i + half),
        };
        for head in x.chunks_exact_mut(head_dim) {
            let (a, b) = (head[ia] as f64, head[ib] as f64);
            head[ia] = (a * cos - b * sin) as f32;
            head[ib] = (a * sin + b * cos) as f32;
        }
    }
}

/// How a layer's attention weighs keys.
#[derive(Debug, Clone, Copy)]
pub struct AttentionKind {
    /// Multiplies q . k.
    pub scale: f32,
    /// A query sees the last `window` positions (itself included), or all before it.
    pub window: Option<usize>,
    /// Scores (after the scale) become cap * tanh(score / cap).
    pub softcap: Option<f32>,
}

impl AttentionKind {
    /// A layer's attention as its plan says.
    pub fn of(plan: &Plan, layer: &crate::arch::LayerPlan) -> Self {
        Self { scale: plan.attn_scale, window: layer.window, softcap: plan.attn_softcap }
    }
}

/// cap * tanh(x / cap): Gemma 2's soft-capping of scores and logits.
pub fn softcap(x: f32, cap: f32) -> f32 {
    cap * (x / cap).tanh()
}

/// Causal grouped-query attention of queries at positions `start..` (rows of `q`, `q_dim`
/// wide) over the cache's keys and values (rows `kv_dim` wide, at least start + rows of q).
/// `sinks`: a logit per query head that joins the softmax's denominator with no value (gpt-oss).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    c: &ModelConfig,
    kind: AttentionKind,
    sinks: Option<&[f32]>,
    out: &mut [f32],
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    start: usize,
) {
    let (hd, kv_dim, group) = (c.head_dim, c.kv_dim(), c.n_heads / c.n_kv_heads);
    let scale = kind.scale;
    let mut scores = Vec::new();
    for (t, (q_t, out_t)) in q.chunks_exact(c.q_dim()).zip(out.chunks_exact_mut(c.q_dim())).enumerate() {
        let n_keys = start + t + 1;
        let first = kind.window.map_or(0, |w| n_keys.saturating_sub(w));
        for h in 0..c.n_heads {
            let kv_off = (h / group) * hd;
            let qh = &q_t[h * hd..(h + 1) * hd];
            scores.clear();
            scores.extend(
                (first..n_keys).map(|s| dot(qh, &k_cache[s * kv_dim + kv_off..s * kv_dim + kv_off + hd]) * scale),
            );
            if let Some(cap) = kind.softcap {
                scores.iter_mut().for_each(|s| *s = softcap(*s, cap));
            }
            match sinks {
                // The sink as one more score, dropped after the softmax.
                Some(sinks) => {
                    scores.push(sinks[h]);
                    softmax(&mut scores);
                    scores.pop();
                }
                None => softmax(&mut scores),
            }
            let oh = &mut out_t[h * hd..(h + 1) * hd];
            oh.fill(0.0);
            for (s, &p) in (first..n_keys).zip(scores.iter()) {
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

/// GELU, tanh approximation, as PyTorch's `gelu(approximate="tanh")`.
pub fn gelu_tanh(x: f32) -> f32 {
    let inner = (2.0 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

pub fn activation(a: Activation, x: f32) -> f32 {
    match a {
        Activation::Silu => silu(x),
        Activation::GeluTanh => gelu_tanh(x),
    }
}

/// RMSNorm of each `weight.len()`-wide chunk of `x`, in place (per-head q/k norms, post-norms).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let src = x.to_vec();
    rms_norm(x, &src, weight, eps);
}

/// Adds `bias` to every row of `x`.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_in_place(row, bias);
    }
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
    dot_inline(a, b)
}

/// `dot`, inlined into its callers so that `matmul_block_avx2` compiles it with AVX2: 16 lanes
/// of products summed lane by lane, then the lanes in order. Without FMA the 256-bit build does
/// the same roundings in the same order as the 128-bit one: every build gives the same bits.
#[inline(always)]
fn dot_inline(a: &[f32], b: &[f32]) -> f32 {
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
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { matmul_block_avx2(out, x, w, cols, rows) };
    }
    matmul_block_inline(out, x, w, cols, rows)
}

/// The CPU reference's time is almost all in these products (the golden tests, the CLI's CPU
/// backend, the browser tests' oracle): AVX2 does them in about half the time of the x86-64
/// baseline (SSE2), with the same bits (see `dot_inline`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn matmul_block_avx2(out: &mut [f32], x: &[f32], w: &[f32], cols: usize, rows: usize) {
    matmul_block_inline(out, x, w, cols, rows)
}

#[inline(always)]
fn matmul_block_inline(out: &mut [f32], x: &[f32], w: &[f32], cols: usize, rows: usize) {
    const TOKENS_PER_TILE: usize = 16;
    let n = x.len() / cols;
    for t0 in (0..n).step_by(TOKENS_PER_TILE) {
        let t1 = (t0 + TOKENS_PER_TILE).min(n);
        for (j, wr) in w.chunks_exact(cols).enumerate() {
            let mut t = t0;
            while t + 4 <= t1 {
                let xs = [0, 1, 2, 3].map(|i| &x[(t + i) * cols..(t + i + 1) * cols]);
                for (i, v) in dot4_inline(xs, wr).into_iter().enumerate() {
                    out[(t + i) * rows + j] = v;
                }
                t += 4;
            }
            for t in t..t1 {
                out[t * rows + j] = dot_inline(&x[t * cols..(t + 1) * cols], wr);
            }
        }
    }
}

/// `dot_inline` of four rows with one weight row, each the same bits as alone: four
/// independent chains of additions keep the adder busy where one waits on itself, and each
/// weight value is loaded once for the four.
#[inline(always)]
fn dot4_inline(xs: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    let (mut a0, mut a1, mut a2, mut a3) = ([0f32; 16], [0f32; 16], [0f32; 16], [0f32; 16]);
    fn chunks(v: &[f32]) -> impl Iterator<Item = &[f32; 16]> {
        v.chunks_exact(16).map(|c| c.try_into().unwrap())
    }
    let rows = chunks(w).zip(chunks(xs[0])).zip(chunks(xs[1])).zip(chunks(xs[2])).zip(chunks(xs[3]));
    for ((((wc, x0), x1), x2), x3) in rows {
        for i in 0..16 {
            a0[i] += x0[i] * wc[i];
            a1[i] += x1[i] * wc[i];
            a2[i] += x2[i] * wc[i];
            a3[i] += x3[i] * wc[i];
        }
    }
    let full = w.len() - w.len() % 16;
    let tail = |x: &[f32]| -> f32 { x[full..].iter().zip(&w[full..]).map(|(x, y)| x * y).sum() };
    [
        a0.iter().sum::<f32>() + tail(xs[0]),
        a1.iter().sum::<f32>() + tail(xs[1]),
        a2.iter().sum::<f32>() + tail(xs[2]),
        a3.iter().sum::<f32>() + tail(xs[3]),
    ]
}

fn worker_count() -> usize {
    if cfg!(target_arch = "wasm32") {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The product's tiles (four tokens at once, AVX2 where the CPU has it, threads) give each
    /// output the bits of `dot` of its row, the definition, whatever the shape.
    #[test]
    fn matmul_gives_the_bits_of_dot_for_every_output() {
        let mut seed = 7u32;
        let mut rand = || {
            seed = seed.wrapping_mul(1103515245).wrapping_add(12345);
            (seed >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
        };
        for (n, rows, cols) in [(1, 7, 16), (3, 5, 33), (4, 9, 64), (7, 300, 250), (21, 40, 96), (70, 130, 256)] {
            let x: Vec<f32> = (0..n * cols).map(|_| rand()).collect();
            let w: Vec<f32> = (0..rows * cols).map(|_| rand()).collect();
            let mut out = vec![0f32; n * rows];
            matmul(&mut out, &x, &w, cols);
            for t in 0..n {
                for j in 0..rows {
                    let want = dot(&x[t * cols..][..cols], &w[j * cols..][..cols]);
                    assert_eq!(out[t * rows + j].to_bits(), want.to_bits(), "{n}x{rows}x{cols} at ({t}, {j})");
                }
            }
            let mut portable = vec![0f32; n * rows];
            matmul_block_inline(&mut portable, &x, &w, cols, rows);
            assert_eq!(portable, out, "{n}x{rows}x{cols}: the baseline build");
        }
    }
}
