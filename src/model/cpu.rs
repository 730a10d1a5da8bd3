//! The CPU f32 reference forward pass: dequantized weights, grouped-query attention, GGUF RoPE,
//! a KV cache. Written to be read top to bottom; it is the oracle the GPU path is tested against.

use crate::arch::ModelConfig;
use crate::arch::{Activation, DeltaShape, Experts, GateUp, LayerPlan, Plan, Qkv, RopeStyle};
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
    /// LFM2-MoE's selection bias (`arch::Experts::selection_bias`).
    selection_bias: Option<Vec<f32>>,
    expert_biases: Option<[Vec<f32>; 3]>,
    /// A mixture's shared expert: gate, up, down and its gate's row (`arch::SharedExpert`).
    shared: Option<[Vec<f32>; 4]>,
    /// A logit per query head in every softmax (gpt-oss), the output projection's bias.
    sinks: Option<Vec<f32>>,
    wo_bias: Option<Vec<f32>>,
    /// A short convolution in place of attention (whose weights are then empty).
    conv: Option<ConvWeights>,
    /// A Gated DeltaNet in place of attention (whose weights are then empty).
    delta: Option<DeltaWeights>,
    /// Gated attention's gate projection (the q projection's second half of each head's rows).
    w_attn_gate: Option<Vec<f32>>,
    /// Gemma 4's per-layer embedding: inp_gate, proj, post_norm; its output scalar.
    ple: Option<[Vec<f32>; 3]>,
    out_scale: Option<f32>,
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

/// Qwen3.5's Gated DeltaNet (`arch::DeltaNet`).
struct DeltaWeights {
    qkv: Vec<f32>,
    /// z, the output gate's projection.
    gate: Vec<f32>,
    /// Channel c's taps at c * kernel .. (c + 1) * kernel, oldest position first.
    taps: Vec<f32>,
    dt_bias: Vec<f32>,
    /// -exp(A_log) of each value head (the file's `ssm_a`).
    a: Vec<f32>,
    beta: Vec<f32>,
    alpha: Vec<f32>,
    norm: Vec<f32>,
    out: Vec<f32>,
    shape: DeltaShape,
}

/// Qwen3.5's MTP head (`arch::Mtp`).
struct MtpWeights {
    layer: Layer,
    eh_proj: Vec<f32>,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    /// None: the model's `token_embd`, output norm, output projection.
    embed: Option<Vec<f32>>,
    head_norm: Option<Vec<f32>>,
    head: Option<Vec<f32>>,
}

pub struct CpuModel {
    pub config: ModelConfig,
    pub plan: Plan,
    token_embd: Vec<f32>,
    output_norm: Vec<f32>,
    /// None when tied to `token_embd`.
    output: Option<Vec<f32>>,
    layers: Vec<Layer>,
    mtp: Option<MtpWeights>,
    /// Gemma 4's per-layer embeddings: the token table, the model projection, its norm.
    ple: Option<[Vec<f32>; 3]>,
}

/// A Gated DeltaNet layer keeps its state (a head_k x head_v matrix per value head) after
/// every this many positions, so that going back to any length (rejected drafts) replays at
/// most this many positions' delta rule from the inputs the cache keeps.
pub const DELTA_SNAPSHOT_EVERY: usize = 64;

/// A Gated DeltaNet layer's recurrent state.
#[derive(Clone)]
struct DeltaState {
    shape: DeltaShape,
    /// The state after positions DELTA_SNAPSHOT_EVERY * (i + 1) - 1.
    snapshots: Vec<Vec<f32>>,
    /// The state after the cache's last position.
    live: Vec<f32>,
}

/// Keys and values of every position seen so far, per layer, `[pos][kv_dim]` (a short
/// convolution's layer: its B * x, `[pos][d_model]` in `k`; a Gated DeltaNet's: its
/// convolution's input q|k|v in `k`, the delta rule's inputs k|v|g|beta in `v`, and its state).
#[derive(Default, Clone)]
pub struct CpuKvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    len: usize,
    /// Each layer's values a position in `k` and in `v` (kv_dim for attention); empty: every
    /// layer's are the caller's kv_dim.
    widths: Vec<(usize, usize)>,
    /// Each Gated DeltaNet layer's recurrent state (None for the others).
    states: Vec<Option<DeltaState>>,
    /// With an MTP head: every position's final hidden state (after the output norm, d_model
    /// values a position), which the head reads, and the head's own layer's cache.
    hidden: Vec<f32>,
    hidden_width: usize,
    mtp: Option<Box<CpuKvCache>>,
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
            let (kw, vw) = self.widths.get(i).copied().unwrap_or((kv_dim, kv_dim));
            k.truncate(self.len * kw);
            v.truncate(self.len * vw);
            // A Gated DeltaNet's state: the last snapshot at or before the length, then the
            // delta rule over the positions after it, from the inputs kept in `v`.
            if let Some(Some(st)) = self.states.get_mut(i) {
                st.snapshots.truncate(self.len / DELTA_SNAPSHOT_EVERY);
                let from = st.snapshots.len() * DELTA_SNAPSHOT_EVERY;
                st.live = st.snapshots.last().cloned().unwrap_or_else(|| vec![0.0; st.shape.state_values()]);
                for inputs in v[from * vw..].chunks_exact(vw) {
                    delta_rule(&st.shape, &mut st.live, inputs, None);
                }
            }
        }
        self.hidden.truncate(self.len * self.hidden_width);
        let len = self.len;
        if let Some(m) = &mut self.mtp {
            m.truncate(len, kv_dim);
        }
    }

    /// Every position's final hidden state (after the output norm), kept when the model has an
    /// MTP head (empty otherwise).
    pub fn hidden(&self) -> &[f32] {
        &self.hidden
    }

    /// Positions the MTP head has read (0 without one).
    pub fn mtp_len(&self) -> usize {
        self.mtp.as_ref().map_or(0, |m| m.len)
    }
}

/// A layer's weights from its plan, dequantized (`load` reads a tensor by name).
fn load_layer(plan: &Plan, l: &LayerPlan, load: &dyn Fn(&str) -> Result<Vec<f32>>) -> Result<Layer> {
    let c = &plan.config.with_dims(&l.dims);
    // Rows [a, b) of a row-major matrix of `cols` columns.
    let rows = |m: &[f32], cols: usize, a: usize, b: usize| m[a * cols..b * cols].to_vec();
    let d = c.d_model;
    let attention = l.attends();
    let (wq, wk, wv) = match &l.qkv {
        _ if !attention => (Vec::new(), Vec::new(), Vec::new()),
        Qkv::Separate([q, k, v]) => (load(q)?, load(k)?, load(v)?),
        Qkv::Query(q) => (load(q)?, Vec::new(), Vec::new()),
        Qkv::Fused(name) => {
            let w = load(name)?;
            let (q, kv) = (c.q_dim(), c.kv_dim());
            (rows(&w, d, 0, q), rows(&w, d, q, q + kv), rows(&w, d, q + kv, q + 2 * kv))
        }
    };
    // Gated attention: each head's 2 * head_dim rows are its query's, then its gate's.
    let (wq, w_attn_gate) = match l.attn_gate {
        true => {
            let per_head = 2 * c.head_dim * d;
            let half = c.head_dim * d;
            let q = wq.chunks_exact(per_head).flat_map(|h| h[..half].to_vec()).collect();
            let g = wq.chunks_exact(per_head).flat_map(|h| h[half..].to_vec()).collect();
            (q, Some(g))
        }
        false => (wq, None),
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
    let delta = match &l.delta {
        Some(dn) => Some(DeltaWeights {
            qkv: load(&dn.qkv)?,
            gate: load(&dn.gate)?,
            taps: load(&dn.conv)?,
            dt_bias: load(&dn.dt_bias)?,
            a: load(&dn.a)?,
            beta: load(&dn.beta)?,
            alpha: load(&dn.alpha)?,
            norm: load(&dn.norm)?,
            out: load(&dn.out)?,
            shape: dn.shape,
        }),
        None => None,
    };
    Ok(Layer {
        conv,
        delta,
        w_attn_gate,
        ple: match &l.ple {
            Some(([g, p, n], _)) => Some([load(g)?, load(p)?, load(n)?]),
            None => None,
        },
        out_scale: match &l.out_scale {
            Some(name) => Some(load(name)?[0]),
            None => None,
        },
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
        qk_norm: l
            .qk_norm
            .as_ref()
            .map(|[q, k]| match &l.qkv {
                // A query alone has no key norm.
                Qkv::Query(_) => Ok::<_, Error>([load(q)?, Vec::new()]),
                _ => Ok([load(q)?, load(k)?]),
            })
            .transpose()?,
        wo: if attention { load(&l.wo)? } else { Vec::new() },
        post_attn_norm: optional(&l.post_attn_norm)?,
        ffn_norm: load(&l.ffn_norm)?,
        w_gate,
        w_up,
        w_down: load(&l.down)?,
        router: l.experts.as_ref().map(|e| load(&e.router)).transpose()?,
        router_bias: optional(&l.experts.as_ref().and_then(|e| e.router_bias.clone()))?,
        selection_bias: optional(&l.experts.as_ref().and_then(|e| e.selection_bias.clone()))?,
        expert_biases: match l.experts.as_ref().and_then(|e| e.biases.as_ref()) {
            Some([g, u, d]) => Some([load(g)?, load(u)?, load(d)?]),
            None => None,
        },
        shared: match l.experts.as_ref().and_then(|e| e.shared.as_ref()) {
            Some(sh) => Some([load(&sh.gate)?, load(&sh.up)?, load(&sh.down)?, load(&sh.gate_inp)?]),
            None => None,
        },
        sinks: optional(&l.attn_sinks)?,
        wo_bias: optional(&l.wo_bias)?,
        post_ffn_norm: optional(&l.post_ffn_norm)?,
        inv_freq: plan.ropes[l.rope].inv_freq(),
        mscale: plan.ropes[l.rope].mscale,
    })
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
        let layers = plan.layers.iter().map(|l| load_layer(&plan, l, &load)).collect::<Result<Vec<_>>>()?;
        let output = if plan.output == plan.token_embd { None } else { Some(load(&plan.output)?) };
        // The head's tensors that are the model's own are not loaded twice.
        let own = |name: &str, model: &str| if name == model { Ok(None) } else { load(name).map(Some) };
        let mtp = match &plan.mtp {
            Some(m) => Some(MtpWeights {
                layer: load_layer(&plan, &m.layer, &load)?,
                eh_proj: load(&m.eh_proj)?,
                enorm: load(&m.enorm)?,
                hnorm: load(&m.hnorm)?,
                embed: own(&m.embed, &plan.token_embd)?,
                head_norm: own(&m.head_norm, &plan.output_norm)?,
                head: own(&m.head, &plan.output)?,
            }),
            None => None,
        };
        let ple = match &plan.ple {
            Some(p) => Some([load(&p.token_embd)?, load(&p.model_proj)?, load(&p.proj_norm)?]),
            None => None,
        };
        Ok(Self {
            token_embd: load(&plan.token_embd)?,
            output_norm: load(&plan.output_norm)?,
            output,
            layers,
            mtp,
            ple,
            config: c,
            plan,
        })
    }

    pub fn new_cache(&self) -> CpuKvCache {
        let c = &self.config;
        let widths = self
            .plan
            .layers
            .iter()
            .map(|l| match (&l.conv, &l.delta) {
                (Some(_), _) => (c.d_model, c.d_model),
                (_, Some(dn)) => (dn.shape.conv_dim(), dn.shape.inputs()),
                _ => (c.with_dims(&l.dims).kv_dim(), c.with_dims(&l.dims).kv_dim()),
            })
            .collect();
        let states = self
            .plan
            .layers
            .iter()
            .map(|l| {
                l.delta.as_ref().map(|dn| DeltaState {
                    shape: dn.shape,
                    snapshots: Vec::new(),
                    live: vec![0.0; dn.shape.state_values()],
                })
            })
            .collect();
        let mtp = self.mtp.as_ref().map(|_| {
            let widths = vec![(c.kv_dim(), c.kv_dim())];
            Box::new(CpuKvCache { k: vec![Vec::new()], v: vec![Vec::new()], widths, ..Default::default() })
        });
        CpuKvCache {
            k: vec![Vec::new(); c.n_layers],
            v: vec![Vec::new(); c.n_layers],
            len: 0,
            widths,
            states,
            hidden: Vec::new(),
            hidden_width: if mtp.is_some() { c.d_model } else { 0 },
            mtp,
        }
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
        let (n, d) = (tokens.len(), c.d_model);
        let start = cache.len;
        let mut x = self.embed(tokens, &self.token_embd, plan.embed_scale.unwrap_or(1.0))?;
        let ple = self.per_layer_inputs(tokens, &x)?;
        for ((li, layer), lp) in self.layers.iter().enumerate().zip(&plan.layers).take(layers) {
            // The layer's own head size, KV heads and FFN width (Gemma 4's differ).
            let lc = &c.with_dims(&lp.dims);
            let mut s = Scratch::new(lc, n);
            rms_norm(&mut s.xn, &x, &layer.attn_norm, c.rms_eps);
            if let Some(cw) = &layer.conv {
                short_conv(d, cw, &s.xn, &mut cache.k[li], start, &mut s.proj);
            } else if let Some(dw) = &layer.delta {
                let state = cache.states[li].as_mut().expect("a state for each Gated DeltaNet layer");
                delta_net(c, dw, &s.xn, &mut cache.k[li], &mut cache.v[li], state, start, &mut s.proj);
            } else if let Some(src) = lp.kv_source {
                // Gemma 4's KV sharing: an earlier layer's keys and values (this pass's included).
                let (k, v) = (&cache.k[src], &cache.v[src]);
                self.attend(lc, lp, layer, Kv::Shared(k, v), start, &mut s);
            } else {
                let (k, v) = (&mut cache.k[li], &mut cache.v[li]);
                self.attend(lc, lp, layer, Kv::Own(k, v), start, &mut s);
            }
            add_in_place(&mut x, &s.proj);
            self.ffn(lc, lp, layer, &mut x, &mut s.xn, &mut s.gate, &mut s.up, &mut s.proj);
            if let (Some([gate, proj, norm]), Some((_, w))) = (&layer.ple, &lp.ple) {
                // Gemma 4's per-layer embedding: GELU(inp_gate x) times this layer's inputs,
                // through proj and its norm, added.
                let all = ple.as_deref().expect("per-layer inputs with per-layer weights");
                let (mut g, mut y) = (vec![0f32; n * w], vec![0f32; n * d]);
                matmul(&mut g, &x, gate, d);
                for (t, gt) in g.chunks_exact_mut(*w).enumerate() {
                    let inputs = &all[(t * c.n_layers + li) * w..][..*w];
                    gt.iter_mut().zip(inputs).for_each(|(g, &p)| *g = activation(plan.activation, *g) * p);
                }
                matmul(&mut y, &g, proj, *w);
                rms_norm_in_place(&mut y, norm, c.rms_eps);
                add_in_place(&mut x, &y);
            }
            if let Some(scale) = layer.out_scale {
                x.iter_mut().for_each(|v| *v *= scale);
            }
        }
        cache.len += n;

        // With an MTP head every position's final hidden state is kept for it.
        let keep_all = cache.hidden_width > 0 && layers == self.layers.len();
        let rows = match (which, keep_all) {
            (Logits::Last, false) => &x[(n - 1) * d..],
            _ => &x[..],
        };
        let mut normed = vec![0f32; rows.len()];
        rms_norm(&mut normed, rows, &self.output_norm, c.rms_eps);
        if keep_all {
            cache.hidden.extend_from_slice(&normed);
        }
        let normed = match which {
            Logits::Last => &normed[normed.len() - d..],
            Logits::All => &normed[..],
        };
        Ok(self.head(normed, self.output.as_deref().unwrap_or(&self.token_embd)))
    }

    /// Each token's embedding row times `scale`.
    fn embed(&self, tokens: &[u32], table: &[f32], scale: f32) -> Result<Vec<f32>> {
        let (d, vocab) = (self.config.d_model, self.config.vocab_size);
        let mut x = vec![0f32; tokens.len() * d];
        for (t, &id) in tokens.iter().enumerate() {
            if id as usize >= vocab {
                return Err(Error::TokenOutOfRange { id, vocab_size: vocab });
            }
            let row = &table[id as usize * d..(id as usize + 1) * d];
            x[t * d..(t + 1) * d].iter_mut().zip(row).for_each(|(o, &e)| *o = e * scale);
        }
        Ok(x)
    }

    /// The logits of normed hidden rows through `output` (soft-capped where the plan says).
    fn head(&self, normed: &[f32], output: &[f32]) -> Vec<f32> {
        let c = &self.config;
        let mut logits = vec![0f32; normed.len() / c.d_model * c.vocab_size];
        matmul(&mut logits, normed, output, c.d_model);
        if let Some(cap) = self.plan.final_softcap {
            logits.iter_mut().for_each(|l| *l = softcap(*l, cap));
        }
        logits
    }

    /// An attention layer over the rows of `s.xn` (positions `start..`): their keys and values
    /// appended to the layer's cache, the output projection in `s.proj`.
    fn attend(&self, c: &ModelConfig, lp: &LayerPlan, layer: &Layer, kv: Kv<'_>, start: usize, s: &mut Scratch) {
        let plan = &self.plan;
        let (n, d, kv_dim, hd) = (s.xn.len() / c.d_model, c.d_model, c.kv_dim(), c.head_dim);
        let style = plan.ropes[lp.rope].style;
        matmul(&mut s.q, &s.xn, &layer.wq, d);
        if let Some(b) = &layer.bias {
            add_rows(&mut s.q, &b[0]);
        }
        if let Some([qn, _]) = &layer.qk_norm {
            rms_norm_in_place(&mut s.q, qn, c.rms_eps);
        }
        for t in 0..n {
            rope(&mut s.q[t * c.q_dim()..(t + 1) * c.q_dim()], start + t, hd, &layer.inv_freq, layer.mscale, style);
        }
        let (k_cache, v_cache): (&[f32], &[f32]) = match kv {
            Kv::Own(k_cache, v_cache) => {
                matmul(&mut s.k, &s.xn, &layer.wk, d);
                matmul(&mut s.v, &s.xn, &layer.wv, d);
                if let Some([_, bk, bv]) = &layer.bias {
                    add_rows(&mut s.k, bk);
                    add_rows(&mut s.v, bv);
                }
                if let Some([_, kn]) = &layer.qk_norm {
                    rms_norm_in_place(&mut s.k, kn, c.rms_eps);
                }
                if lp.v_norm {
                    // Gemma 4: each head of V RMS-normed, no weights.
                    rms_norm_in_place(&mut s.v, &vec![1.0; hd], c.rms_eps);
                }
                for t in 0..n {
                    rope(&mut s.k[t * kv_dim..(t + 1) * kv_dim], start + t, hd, &layer.inv_freq, layer.mscale, style);
                }
                k_cache.extend_from_slice(&s.k);
                v_cache.extend_from_slice(&s.v);
                (k_cache, v_cache)
            }
            Kv::Shared(k_cache, v_cache) => (k_cache, v_cache),
        };
        let kind = AttentionKind::of(plan, lp);
        attention(c, kind, layer.sinks.as_deref(), &mut s.attn, &s.q, k_cache, v_cache, start);
        if let Some(wg) = &layer.w_attn_gate {
            // Gated attention: the output times sigmoid of the gate's projection.
            let mut g = vec![0f32; s.attn.len()];
            matmul(&mut g, &s.xn, wg, d);
            s.attn.iter_mut().zip(&g).for_each(|(a, &g)| *a *= sigmoid(g));
        }
        matmul(&mut s.proj, &s.attn, &layer.wo, c.q_dim());
        if let Some(b) = &layer.wo_bias {
            add_rows(&mut s.proj, b);
        }
        if let Some(w) = &layer.post_attn_norm {
            rms_norm_in_place(&mut s.proj, w, c.rms_eps);
        }
    }

    /// The model has a multi-token-prediction head.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// The MTP head at its next positions (`cache.mtp_len()..`): each row of `hidden` (a final
    /// hidden state, d_model values) with the token after its position. Returns the logits of
    /// every row and the head's own hidden states (after its norm; a chained draft reads them).
    pub fn mtp_forward(&self, cache: &mut CpuKvCache, hidden: &[f32], tokens: &[u32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let c = &self.config;
        let (m, lp) = match (&self.mtp, &self.plan.mtp) {
            (Some(m), Some(p)) => (m, &p.layer),
            _ => return Err(Error::Unsupported("multi-token prediction: the model has no MTP head".into())),
        };
        let cache = cache.mtp.as_deref_mut().expect("a model with an MTP head has its cache");
        let (n, d) = (tokens.len(), c.d_model);
        assert_eq!(hidden.len(), n * d, "a hidden state per token");
        if cache.len + n > c.context_length {
            return Err(Error::ContextOverflow {
                prompt_tokens: cache.len + n,
                max_tokens: 0,
                context_length: c.context_length,
            });
        }
        let e = self.embed(tokens, m.embed.as_deref().unwrap_or(&self.token_embd), 1.0)?;
        let (mut en, mut hn) = (vec![0f32; n * d], vec![0f32; n * d]);
        rms_norm(&mut en, &e, &m.enorm, c.rms_eps);
        rms_norm(&mut hn, hidden, &m.hnorm, c.rms_eps);
        let cat: Vec<f32> =
            en.chunks_exact(d).zip(hn.chunks_exact(d)).flat_map(|(e, h)| e.iter().chain(h)).copied().collect();
        let mut x = vec![0f32; n * d];
        matmul(&mut x, &cat, &m.eh_proj, 2 * d);
        let mut s = Scratch::new(c, n);
        let start = cache.len;
        rms_norm(&mut s.xn, &x, &m.layer.attn_norm, c.rms_eps);
        let (k, v) = (&mut cache.k[0], &mut cache.v[0]);
        self.attend(c, lp, &m.layer, Kv::Own(k, v), start, &mut s);
        add_in_place(&mut x, &s.proj);
        self.ffn(c, lp, &m.layer, &mut x, &mut s.xn, &mut s.gate, &mut s.up, &mut s.proj);
        cache.len += n;
        let mut normed = vec![0f32; n * d];
        rms_norm(&mut normed, &x, m.head_norm.as_deref().unwrap_or(&self.output_norm), c.rms_eps);
        let output = m.head.as_deref().or(self.output.as_deref()).unwrap_or(&self.token_embd);
        Ok((self.head(&normed, output), normed))
    }

    /// Up to `k` draft tokens from the MTP head (greedy) after `tokens` (the sequence: the
    /// cache's positions, then the token the model chose after them, not yet run). The head
    /// first reads the positions it has not (each with the token after it), then drafts one
    /// token a pass, each pass reading its own last hidden state; its cache keeps only the
    /// positions of the sequence (the drafts' are forgotten).
    pub fn mtp_draft(&self, cache: &mut CpuKvCache, tokens: &[u32], k: usize, out: &mut Vec<u32>) -> Result<()> {
        let (d, len) = (self.config.d_model, cache.len);
        assert_eq!(tokens.len(), len + 1, "the cache's tokens and the next one");
        out.clear();
        if k == 0 || len == 0 {
            return Ok(());
        }
        // The head's last position is read again when it has read them all (its logits are
        // the first draft's).
        let from = cache.mtp_len().min(len - 1);
        if let Some(m) = &mut cache.mtp {
            m.truncate(from, 0);
        }
        let hidden = cache.hidden[from * d..len * d].to_vec();
        let (mut logits, mut h) = self.mtp_forward(cache, &hidden, &tokens[from + 1..])?;
        let vocab = self.config.vocab_size;
        loop {
            let last = &logits[logits.len() - vocab..];
            if !last.iter().all(|v| v.is_finite()) {
                break;
            }
            let id = last.iter().enumerate().fold(0, |b, (i, &v)| if v > last[b] { i } else { b }) as u32;
            out.push(id);
            if out.len() == k || cache.mtp_len() >= self.config.context_length {
                break;
            }
            let prev = h[h.len() - d..].to_vec();
            (logits, h) = self.mtp_forward(cache, &prev, &[id])?;
        }
        if let Some(m) = &mut cache.mtp {
            m.truncate(len, 0);
        }
        Ok(())
    }
}

/// An attention layer's keys and values: its own (this pass's appended), or an earlier
/// layer's (Gemma 4's KV sharing).
enum Kv<'a> {
    Own(&'a mut Vec<f32>, &'a mut Vec<f32>),
    Shared(&'a [f32], &'a [f32]),
}

impl CpuModel {
    /// Gemma 4's per-layer inputs of each token (`arch::PerLayerEmbeddings`; `x`: the scaled
    /// embeddings): [token][layer][width], or None without them.
    fn per_layer_inputs(&self, tokens: &[u32], x: &[f32]) -> Result<Option<Vec<f32>>> {
        let (Some([table, model_proj, norm]), Some(p)) = (&self.ple, &self.plan.ple) else { return Ok(None) };
        let (c, w) = (&self.config, p.width);
        let all = w * c.n_layers;
        let mut proj = vec![0f32; tokens.len() * all];
        matmul(&mut proj, x, model_proj, c.d_model);
        let scale = 1.0 / (c.d_model as f32).sqrt();
        proj.iter_mut().for_each(|v| *v *= scale);
        rms_norm_in_place(&mut proj, norm, c.rms_eps);
        let (tok_scale, half) = ((w as f32).sqrt(), std::f32::consts::FRAC_1_SQRT_2);
        for (t, &id) in tokens.iter().enumerate() {
            let row = &table[id as usize * all..(id as usize + 1) * all];
            for (p, &e) in proj[t * all..(t + 1) * all].iter_mut().zip(row) {
                *p = (*p + e * tok_scale) * half;
            }
        }
        Ok(Some(proj))
    }
}

/// Per-pass work buffers of a forward pass over `n` rows.
struct Scratch {
    xn: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    proj: Vec<f32>,
}

impl Scratch {
    fn new(c: &ModelConfig, n: usize) -> Self {
        Self {
            xn: vec![0f32; n * c.d_model],
            q: vec![0f32; n * c.q_dim()],
            k: vec![0f32; n * c.kv_dim()],
            v: vec![0f32; n * c.kv_dim()],
            attn: vec![0f32; n * c.q_dim()],
            gate: vec![0f32; n * c.ffn_dim],
            up: vec![0f32; n * c.ffn_dim],
            proj: vec![0f32; n * c.d_model],
        }
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

/// The transformers eps of the Gated DeltaNet's L2 norm of q and k (`l2norm(x, eps=1e-6)`).
const L2_NORM_EPS: f32 = 1e-6;

/// Qwen3.5's Gated DeltaNet over the rows of `xn` (positions `start..`) into `out`
/// (`arch::DeltaNet`): each position's q|k|v projection appended to `conv_in` (the
/// convolution's input, kept per position as a short convolution's), its delta-rule inputs to
/// `inputs`, and the state advanced a position at a time.
#[allow(clippy::too_many_arguments)]
fn delta_net(
    c: &ModelConfig,
    w: &DeltaWeights,
    xn: &[f32],
    conv_in: &mut Vec<f32>,
    inputs: &mut Vec<f32>,
    state: &mut DeltaState,
    start: usize,
    out: &mut [f32],
) {
    let s = &w.shape;
    let (d, n) = (c.d_model, xn.len() / c.d_model);
    let (conv, kd, vd, heads) = (s.conv_dim(), s.key_dim(), s.value_dim(), s.v_heads);
    let mut qkv = vec![0f32; n * conv];
    let mut z = vec![0f32; n * vd];
    let mut b = vec![0f32; n * heads];
    let mut a = vec![0f32; n * heads];
    matmul(&mut qkv, xn, &w.qkv, d);
    matmul(&mut z, xn, &w.gate, d);
    matmul(&mut b, xn, &w.beta, d);
    matmul(&mut a, xn, &w.alpha, d);
    conv_in.extend_from_slice(&qkv);
    let mut y = vec![0f32; n * vd];
    let mut mixed = vec![0f32; conv];
    let mut row = vec![0f32; s.inputs()];
    for t in 0..n {
        let pos = start + t;
        // The causal depthwise convolution over the last `kernel` positions, then SiLU.
        for (ch, m) in mixed.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..s.kernel {
                if let Some(p) = (pos + j + 1).checked_sub(s.kernel) {
                    acc += w.taps[ch * s.kernel + j] * conv_in[p * conv + ch];
                }
            }
            *m = silu(acc);
        }
        let (q, rest) = mixed.split_at_mut(kd);
        let (k, v) = rest.split_at_mut(kd);
        for head in q.chunks_exact_mut(s.head_k).chain(k.chunks_exact_mut(s.head_k)) {
            l2_normalize(head);
        }
        let scale = 1.0 / (s.head_k as f32).sqrt();
        q.iter_mut().for_each(|x| *x *= scale);
        row[..kd].copy_from_slice(k);
        row[kd..kd + vd].copy_from_slice(v);
        for h in 0..heads {
            row[kd + vd + h] = w.a[h] * softplus(a[t * heads + h] + w.dt_bias[h]);
            row[kd + vd + heads + h] = sigmoid(b[t * heads + h]);
        }
        inputs.extend_from_slice(&row);
        let yt = &mut y[t * vd..(t + 1) * vd];
        delta_rule(s, &mut state.live, &row, Some((q, &mut *yt)));
        if (pos + 1) % DELTA_SNAPSHOT_EVERY == 0 {
            state.snapshots.push(state.live.clone());
        }
        // Each head's output: RMSNorm, times silu(z).
        for (yh, zh) in yt.chunks_exact_mut(s.head_v).zip(z[t * vd..(t + 1) * vd].chunks_exact(s.head_v)) {
            rms_norm_in_place(yh, &w.norm, c.rms_eps);
            yh.iter_mut().zip(zh).for_each(|(y, &z)| *y *= silu(z));
        }
    }
    matmul(out, &y, &w.out, vd);
}

/// One position's gated delta rule on `state` (a head_k x head_v matrix per value head,
/// row-major) from its inputs k|v|g|beta (`DeltaShape::inputs`): S = S exp(g), then
/// S += k (v - S^T k)^T beta; with `q`, also each head's output S^T q into `out`. Value head h
/// reads key head h % k_heads.
fn delta_rule(s: &DeltaShape, state: &mut [f32], inputs: &[f32], q: Option<(&[f32], &mut [f32])>) {
    let (kd, vd, heads, hk, hv) = (s.key_dim(), s.value_dim(), s.v_heads, s.head_k, s.head_v);
    let (k, v) = (&inputs[..kd], &inputs[kd..kd + vd]);
    let (g, beta) = (&inputs[kd + vd..kd + vd + heads], &inputs[kd + vd + heads..]);
    let mut q = q;
    let mut delta = vec![0f32; hv];
    for h in 0..heads {
        let kh = &k[(h % s.k_heads) * hk..][..hk];
        let vh = &v[h * hv..][..hv];
        let st = &mut state[h * hk * hv..(h + 1) * hk * hv];
        let decay = g[h].exp();
        st.iter_mut().for_each(|x| *x *= decay);
        // delta[j] = (v[j] - sum_i S[i][j] k[i]) * beta
        delta.copy_from_slice(vh);
        for (i, &ki) in kh.iter().enumerate() {
            for (dj, &sij) in delta.iter_mut().zip(&st[i * hv..(i + 1) * hv]) {
                *dj -= sij * ki;
            }
        }
        delta.iter_mut().for_each(|x| *x *= beta[h]);
        for (i, &ki) in kh.iter().enumerate() {
            for (sij, &dj) in st[i * hv..(i + 1) * hv].iter_mut().zip(&delta) {
                *sij += ki * dj;
            }
        }
        if let Some((q, out)) = q.as_mut() {
            let qh = &q[(h % s.k_heads) * hk..][..hk];
            let oh = &mut out[h * hv..(h + 1) * hv];
            oh.fill(0.0);
            for (i, &qi) in qh.iter().enumerate() {
                for (o, &sij) in oh.iter_mut().zip(&st[i * hv..(i + 1) * hv]) {
                    *o += sij * qi;
                }
            }
        }
    }
}

/// x / sqrt(sum x^2 + eps), as transformers' `l2norm`.
fn l2_normalize(x: &mut [f32]) {
    let sum: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (sum + L2_NORM_EPS).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// log(1 + e^x), x itself past 20 (PyTorch's threshold).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
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
        for (ex, w) in route(e, lt, layer.selection_bias.as_deref()) {
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
        // The shared expert, times sigmoid of its gate.
        if let (Some([g, u, dn, gi]), Some(sh)) = (&layer.shared, &e.shared) {
            let (mut sg, mut su) = (vec![0f32; sh.ffn], vec![0f32; sh.ffn]);
            matmul(&mut sg, xt, g, d);
            matmul(&mut su, xt, u, d);
            sg.iter_mut().zip(&su).for_each(|(g, u)| *g = activation(act, *g) * u);
            matmul(&mut y, &sg, dn, sh.ffn);
            let w = sigmoid(dot(xt, gi));
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

/// The experts a token's router logits choose and their weights: the softmax over all experts
/// (LFM2-MoE: each logit's sigmoid), the `used` largest (plus `selection`'s bias where the plan
/// has one; the lower index first among equals), renormalized to sum to 1 when the plan says
/// so, times its scale.
pub fn route(e: &Experts, logits: &[f32], selection: Option<&[f32]>) -> Vec<(usize, f32)> {
    let mut p = logits.to_vec();
    if e.sigmoid {
        p.iter_mut().for_each(|v| *v = sigmoid(*v));
    } else {
        softmax(&mut p);
    }
    let score = |i: usize| p[i] + selection.map_or(0.0, |b| b[i]);
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
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
