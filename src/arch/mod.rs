//! The layer plan of each architecture: which norms, projections, biases, activation, RoPE and
//! attention window every layer has, built once from GGUF metadata and tensor names. The CPU
//! reference and the GPU forward pass both walk this plan (each writes the order of the ops
//! itself: the architecture references and the golden tests hold them together), and a new
//! architecture starts as a new arm in `Plan::from_gguf`. A tensor or metadata key that would change
//! the math but that no plan implements is an error naming it, never silently ignored.

use crate::error::{Error, Result};
use crate::gguf::{Gguf, GgufError, TensorInfo};
mod config;

pub use config::ModelConfig;
pub(crate) use config::{invalid, kv_heads_per_layer};

/// Context used when the caller does not choose one: the model's, capped to keep the cache small.
pub const DEFAULT_CONTEXT: usize = 4096;
use std::collections::HashSet;

/// The tensor of per-pair RoPE frequency divisors (llama 3).
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// Architectures whose plan has a mixture of experts.
pub const MOE_ARCHITECTURES: &[&str] = &["qwen3moe", "gpt-oss", "qwen35moe", "lfm2moe"];

/// Qwen3.5's architectures: Gated DeltaNet layers beside gated attention, an MTP head.
pub const QWEN35: &[&str] = &["qwen35", "qwen35moe"];

/// Architectures (`general.architecture`) with a plan.
pub const ARCHITECTURES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3",
    "smollm3",
    "qwen3moe",
    "lfm2",
    "lfm2moe",
    "gpt-oss",
    "qwen35",
    "qwen35moe",
    "gemma4",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotates adjacent pairs (x[2i], x[2i+1]): llama.cpp's converter permutes llama's Q/K rows for it.
    Adjacent,
    /// Rotates (x[i], x[i + dim/2]), GPT-NeoX's half split (Qwen, Phi-3, Gemma).
    NeoX,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (Gemma).
    GeluTanh,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub base: f64,
    /// Rotated values per head (the first `dim` of each head; the rest pass through).
    pub dim: usize,
    pub style: RopeStyle,
    /// Divisor of each pair's frequency (llama 3's `rope_freqs.weight`, linear scaling, YaRN's
    /// mix of interpolation and extrapolation), or empty.
    pub freq_factors: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub mscale: f64,
}

impl Rope {
    /// No rotation at all (SmolLM3's NoPE layers): no pair is rotated.
    pub fn none(style: RopeStyle) -> Self {
        Self { base: 10000.0, dim: 0, style, freq_factors: Vec::new(), mscale: 1.0 }
    }
}

impl Rope {
    /// Inverse frequency of each rotated pair, base^(-2i/dim) / factor_i, in f64.
    pub fn inv_freq(&self) -> Vec<f64> {
        (0..self.dim / 2)
            .map(|i| {
                let f = self.base.powf(-2.0 * i as f64 / self.dim as f64);
                f / self.freq_factors.get(i).map_or(1.0, |&x| x as f64)
            })
            .collect()
    }
}

/// Where q, k and v come from: three matrices, or one fused q|k|v matrix (Phi-3).
#[derive(Debug, Clone, PartialEq)]
pub enum Qkv {
    Separate([String; 3]),
    Fused(String),
    /// A query alone: the layer reads an earlier layer's keys and values (Gemma 4's KV sharing).
    Query(String),
}

/// Where the gate and up projections come from: two matrices, or one fused gate|up (Phi-3).
#[derive(Debug, Clone, PartialEq)]
pub enum GateUp {
    Separate([String; 2]),
    Fused(String),
}

/// A mixture of experts in place of the dense FFN (Qwen3-MoE): the router picks `used` of
/// `count` experts per token (softmax over the router's logits, the top `used`, their weights
/// renormalized to sum to 1 when `normalize`, then times `scale`), and the FFN's output is the
/// weighted sum of the chosen experts' gated FFNs. The layer's `gate_up` and `down` name the
/// stacked expert tensors (ggml shapes [d, ffn, count] and [ffn, d, count]: expert e's rows
/// are e * ffn .. (e + 1) * ffn of gate and up, e * d .. (e + 1) * d of down).
#[derive(Debug, Clone, PartialEq)]
pub struct Experts {
    pub router: String,
    pub count: usize,
    pub used: usize,
    pub normalize: bool,
    pub scale: f32,
    /// The router's bias (gpt-oss).
    pub router_bias: Option<String>,
    /// Each expert's gate, up and down biases, stacked (gpt-oss: [ffn, count], [ffn, count],
    /// [d, count]).
    pub biases: Option<[String; 3]>,
    /// gpt-oss's clamped SwiGLU in place of the plan's activation: (min(up, L) clamped to
    /// [-L, L] + 1) * g * sigmoid(ALPHA g), g = min(gate, L) (`SWIGLU_OAI`).
    pub swiglu_oai: bool,
    /// A shared expert every token goes through beside the chosen ones (Qwen3.5-MoE).
    pub shared: Option<SharedExpert>,
    /// Sigmoid scores in place of the softmax (LFM2-MoE: `expert_gating_func` 2): the chosen
    /// experts' scores, renormalized when `normalize`, are their weights.
    pub sigmoid: bool,
    /// A bias added to the scores to choose the experts, not to their weights (LFM2-MoE's
    /// `exp_probs_b`).
    pub selection_bias: Option<String>,
}

/// Qwen3.5-MoE's shared expert: a gated FFN `ffn` wide (`expert_shared_feed_forward_length`)
/// whose output is scaled by sigmoid(gate_inp . x), added to the chosen experts' (llama.cpp's
/// qwen35moe `build_layer_ffn`, transformers' `shared_expert_gate`).
#[derive(Debug, Clone, PartialEq)]
pub struct SharedExpert {
    pub gate: String,
    pub up: String,
    pub down: String,
    pub gate_inp: String,
    pub ffn: usize,
}

/// gpt-oss's SwiGLU constants (alpha, limit): transformers' config defaults, which llama.cpp
/// hard-codes.
pub const SWIGLU_OAI: (f32, f32) = (1.702, 7.0);

/// LFM2's gated short convolution in place of attention: in_proj gives B, C and x (each
/// d_model wide), B * x goes through a causal depthwise convolution over the last `kernel`
/// positions (weights [kernel, d] in ggml order: channel c's taps, oldest first), C times that
/// through out_proj. Its state is the last kernel - 1 positions' B * x, which the engine keeps
/// per position in the layer's cache, as it keeps keys: forks, rollback and the prefix cache
/// need nothing more.
#[derive(Debug, Clone, PartialEq)]
pub struct ShortConv {
    pub in_proj: String,
    pub conv: String,
    pub out_proj: String,
    pub kernel: usize,
}

/// The sizes of Qwen3.5's Gated DeltaNet layers (`ssm.*` metadata, as llama.cpp reads them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    /// Positions of the causal depthwise convolution over the q|k|v projection.
    pub kernel: usize,
    /// Key heads (`ssm.group_count`) and value heads (`ssm.time_step_rank`); value head h reads
    /// key head h % k_heads (llama.cpp tiles the keys; the converter orders the value heads so).
    pub k_heads: usize,
    pub v_heads: usize,
    /// Each key head's and value head's size (`ssm.state_size`, `ssm.inner_size` / v_heads).
    pub head_k: usize,
    pub head_v: usize,
}

impl DeltaShape {
    pub fn key_dim(&self) -> usize {
        self.k_heads * self.head_k
    }
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.head_v
    }
    /// Channels of the convolution: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Values of one layer's recurrent state: a head_k x head_v matrix per value head.
    pub fn state_values(&self) -> usize {
        self.v_heads * self.head_k * self.head_v
    }
    /// Values a position keeps for the recurrence: k (every key head), v, g and beta.
    pub fn inputs(&self) -> usize {
        self.key_dim() + self.value_dim() + 2 * self.v_heads
    }
}

/// Qwen3.5's Gated DeltaNet in place of attention (llama.cpp's `build_layer_attn_linear`,
/// transformers' `Qwen3_5GatedDeltaNet`): `qkv` projects q|k|v, which go through a causal
/// depthwise convolution over the last `kernel` positions (taps in ggml order [kernel, conv_dim],
/// oldest first) and SiLU; q and k are L2-normalized per head (q then divided by sqrt(head_k));
/// each value head's state S (head_k x head_v) decays by exp(g), g = a * softplus(alpha + dt_bias),
/// and learns v at rate beta = sigmoid(beta's projection) by the delta rule
/// S += k (v - S^T k)^T beta; its output S^T q goes through an RMSNorm (weights of head_v) times
/// silu(z) (`gate`'s projection) and `out`. The engine keeps each position's convolution input
/// and the delta rule's inputs, and the state at block boundaries (see the CPU cache).
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaNet {
    pub qkv: String,
    pub gate: String,
    pub conv: String,
    pub dt_bias: String,
    pub a: String,
    pub beta: String,
    pub alpha: String,
    pub norm: String,
    pub out: String,
    pub shape: DeltaShape,
}

/// Qwen3.5's multi-token-prediction head (the converter's `nextn` layer after the others,
/// llama.cpp's `graph_mtp`, DeepSeek-V3's MTP module): at position j it reads the main model's
/// final hidden state h_j (after the output norm) and the embedding of the token after j:
/// `eh_proj`(enorm(embed) | hnorm(h_j)) goes through one gated full-attention layer (a KV cache
/// of its own), `head_norm` and `head`, and its logits guess the token after that one.
#[derive(Debug, Clone, PartialEq)]
pub struct Mtp {
    pub layer: LayerPlan,
    pub eh_proj: String,
    pub enorm: String,
    pub hnorm: String,
    /// `nextn.embed_tokens`, else the model's `token_embd`.
    pub embed: String,
    /// `nextn.shared_head_norm`, else the model's output norm.
    pub head_norm: String,
    /// `nextn.shared_head_head`, else the model's output projection.
    pub head: String,
}

/// A layer's head size, KV heads and FFN width: the model's, but Gemma 4's differ by layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerDims {
    pub head_dim: usize,
    pub n_kv_heads: usize,
    pub ffn_dim: usize,
}

/// Gemma 4's per-layer embeddings: each token's `width` values for every layer, from
/// `token_embd` (times sqrt(width)) plus `model_proj` of the scaled embedding (divided by
/// sqrt(d_model), RMS-normed per layer with `proj_norm`), the sum divided by sqrt(2); a layer
/// adds post_norm(proj(GELU(inp_gate x) * its values)) after its FFN.
#[derive(Debug, Clone, PartialEq)]
pub struct PerLayerEmbeddings {
    pub token_embd: String,
    pub model_proj: String,
    pub proj_norm: String,
    pub width: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    pub attn_norm: String,
    pub qkv: Qkv,
    /// Biases of q, k and v (Qwen 2).
    pub qkv_bias: Option<[String; 3]>,
    /// RMSNorm of each head of q and of k before RoPE, weights of head_dim (Qwen 3, Gemma 3).
    pub qk_norm: Option<[String; 2]>,
    pub wo: String,
    /// RMSNorm of the attention output before the residual add (Gemma 3).
    pub post_attn_norm: Option<String>,
    pub ffn_norm: String,
    pub gate_up: GateUp,
    pub down: String,
    /// The FFN is a mixture of these experts (`gate_up` and `down` are theirs, stacked).
    pub experts: Option<Experts>,
    /// A short convolution instead of attention (LFM2): the attention fields are unused.
    pub conv: Option<ShortConv>,
    /// A Gated DeltaNet instead of attention (Qwen3.5): the attention fields are unused.
    pub delta: Option<DeltaNet>,
    /// The q projection gives each head's query then as many gate values, and the attention
    /// output is multiplied by sigmoid(gate) before `wo` (Qwen3.5's gated attention).
    pub attn_gate: bool,
    /// A logit per query head that joins every softmax's denominator with no value (gpt-oss).
    pub attn_sinks: Option<String>,
    /// The attention output projection's bias (gpt-oss).
    pub wo_bias: Option<String>,
    /// RMSNorm of the FFN output before the residual add (Gemma 3).
    pub post_ffn_norm: Option<String>,
    /// Its head size, KV heads and FFN width.
    pub dims: LayerDims,
    /// Reads this earlier layer's keys and values (Gemma 4's KV sharing; `qkv` is a query).
    pub kv_source: Option<usize>,
    /// V is RMS-normed per head, without weights, before the cache (Gemma 4).
    pub v_norm: bool,
    /// Multiplies the layer's output (Gemma 4's `layer_output_scale`, one value).
    pub out_scale: Option<String>,
    /// Gemma 4's per-layer embedding tensors (inp_gate, proj, post_norm) and its width.
    pub ple: Option<([String; 3], usize)>,
    /// Index into `Plan::ropes`.
    pub rope: usize,
    /// A query sees the last `window` positions, itself included; None: all before it.
    pub window: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub config: ModelConfig,
    /// Embeddings are multiplied by this (Gemma: sqrt(d_model)).
    pub embed_scale: Option<f32>,
    pub activation: Activation,
    /// Multiplies q . k before the softmax.
    pub attn_scale: f32,
    /// Attention scores become cap * tanh(score / cap) after the scale (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// The logits become cap * tanh(logit / cap) (Gemma 2).
    pub final_softcap: Option<f32>,
    pub ropes: Vec<Rope>,
    pub layers: Vec<LayerPlan>,
    pub token_embd: String,
    pub output_norm: String,
    /// The output projection: `token_embd.weight` when tied.
    pub output: String,
    /// A multi-token-prediction head (Qwen3.5's `nextn` layer).
    pub mtp: Option<Mtp>,
    /// Gemma 4's per-layer embeddings.
    pub ple: Option<PerLayerEmbeddings>,
}

impl LayerPlan {
    /// The layer attends (keeps keys and values), rather than a short convolution or a Gated
    /// DeltaNet.
    pub fn attends(&self) -> bool {
        self.conv.is_none() && self.delta.is_none()
    }
}

impl Plan {
    /// The plan for a GGUF file. `rope_freqs` is the data of the `ROPE_FREQS` tensor when the
    /// file has one (its numbers change the plan's RoPE).
    pub fn from_gguf(gguf: &Gguf, rope_freqs: Option<&[u8]>) -> Result<Self> {
        let c = ModelConfig::from_gguf(gguf)?;
        let arch = c.architecture.clone();
        let key = |k: &str| format!("{arch}.{k}");
        reject_unimplemented_keys(gguf, &arch)?;
        for name in ["rope_factors_long.weight", "rope_factors_short.weight"] {
            if gguf.tensor(name).is_some() {
                return Err(Error::Unsupported(format!("LongRoPE scaling (tensor {name:?})")));
            }
        }

        // llama.cpp's converter permutes the Q/K rows of the llama-derived models (SmolLM3's
        // converter is llama's) for rotation of adjacent pairs.
        let style = match arch.as_str() {
            "llama" | "mistral" | "smollm3" => RopeStyle::Adjacent,
            _ => RopeStyle::NeoX,
        };
        let mut freq_factors = match (gguf.tensor(ROPE_FREQS), rope_freqs) {
            (Some(t), Some(data)) => {
                check_shape(t, &[c.rope_dim as u64 / 2])?;
                crate::quant::dequantize(t, data)?
            }
            (Some(_), None) => return Err(Error::Unsupported(format!("{ROPE_FREQS} without its data"))),
            (None, _) => Vec::new(),
        };
        let mut mscale = 1.0;
        match gguf.get_str(&key("rope.scaling.type"))? {
            None | Some("none") => {}
            Some("yarn") => {
                if !freq_factors.is_empty() {
                    return Err(Error::Unsupported(format!("YaRN with {ROPE_FREQS}")));
                }
                (freq_factors, mscale) = yarn(gguf, &arch, &c)?;
            }
            Some("linear") => {
                let factor = gguf.get_f32(&key("rope.scaling.factor"))?.unwrap_or(1.0);
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(invalid(&key("rope.scaling.factor"), factor, "must be a positive number"));
                }
                // Positions divided by the factor: each pair's frequency divisor grows by it.
                if freq_factors.is_empty() {
                    freq_factors = vec![1.0; c.rope_dim / 2];
                }
                freq_factors.iter_mut().for_each(|f| *f *= factor);
            }
            Some(other) => {
                return Err(Error::Unsupported(format!("RoPE scaling {other:?} ({})", key("rope.scaling.type"))))
            }
        }
        let global = Rope { base: c.rope_base as f64, dim: c.rope_dim, style, freq_factors, mscale };
        let mut ropes = vec![global];

        // 0 means no window (llama.cpp's converter writes it for Phi-3 without one).
        let window = gguf.get_u64(&key("attention.sliding_window"))?.filter(|&w| w > 0).map(|w| w as usize);
        // Gemma 4: the file's per-layer flags, and its sliding layers' RoPE (base and size).
        let pattern: Vec<bool> = match arch.as_str() {
            "gemma4" => {
                let flags = gemma4_sliding(gguf, &c)?;
                let base = gguf.get_f32(&key("rope.freq_base_swa"))?.unwrap_or(10000.0) as f64;
                let dim = gguf.get_u64(&key("rope.dimension_count_swa"))?.unwrap_or(c.rope_dim as u64) as usize;
                if dim == 0 || dim % 2 != 0 || dim > c.head_dim {
                    return Err(invalid(
                        &key("rope.dimension_count_swa"),
                        dim,
                        "must be even and at most the head size",
                    ));
                }
                ropes.push(Rope { base, dim, style, freq_factors: Vec::new(), mscale: 1.0 });
                flags
            }
            _ => Vec::new(),
        };
        let slides: fn(usize) -> bool = match (arch.as_str(), window) {
            (_, None) => |_| false,
            ("gemma4", Some(_)) => |_| false,
            ("gemma3", Some(_)) => {
                // Gemma 3: five sliding layers, then one global; the sliding ones use RoPE base
                // 10000 without scaling (not in the metadata; llama.cpp and transformers agree).
                ropes.push(Rope { base: 10000.0, dim: c.rope_dim, style, freq_factors: Vec::new(), mscale: 1.0 });
                |l| l % 6 != 5
            }
            // Gemma 2 and gpt-oss: sliding and global layers alternate, the first one sliding,
            // one RoPE for both (llama.cpp's swa pattern 2; transformers' layer_types).
            ("gemma2" | "gpt-oss", Some(_)) => |l| l % 2 == 0,
            ("phi3" | "mistral", Some(_)) => |_| true,
            (_, Some(w)) if w >= c.context_length => |_| false,
            (_, Some(w)) => {
                return Err(Error::Unsupported(format!(
                    "sliding-window attention ({} = {w}) for architecture {arch:?}",
                    key("attention.sliding_window")
                )))
            }
        };
        let slides = |l: usize| if arch == "gemma4" { window.is_some() && pattern[l] } else { slides(l) };
        // Gemma's sliding layers have a RoPE of their own; the others share the global one.
        let sliding_rope = ropes.len() - 1;
        // SmolLM3: every fourth layer has no RoPE (NoPE). The file does not say so: llama.cpp
        // hard-codes the interval (n_no_rope_layer_step = 4), as transformers' default
        // no_rope_layer_interval does.
        let no_rope: fn(usize) -> bool = match arch.as_str() {
            "smollm3" => |l| (l + 1) % 4 == 0,
            _ => |_| false,
        };
        if (0..c.n_layers).any(no_rope) {
            ropes.push(Rope::none(style));
        }
        let none_rope = ropes.len() - 1;

        let experts = match gguf.get_u64(&key("expert_count"))?.filter(|&n| n > 0) {
            None => None,
            Some(count) => Some(experts(gguf, &arch, count)?),
        };
        // LFM2's short-convolution layers: those with no KV heads (llama.cpp marks them so).
        let kv_per_layer = config::kv_heads_per_layer(gguf, &arch, c.n_layers)?;
        let conv_kernel = match (arch.as_str(), &kv_per_layer) {
            ("lfm2" | "lfm2moe", _) => {
                let k = key("shortconv.l_cache");
                let l = gguf.get_u64(&k)?.ok_or_else(|| Error::MissingMetadata(k.clone()))?;
                if !(2..=16).contains(&l) {
                    return Err(invalid(&k, l, "must be from 2 to 16"));
                }
                l as usize
            }
            ("gemma4", _) => 0,
            (_, Some(_)) => {
                return Err(Error::Unsupported(format!(
                    "a KV head count per layer ({}) for architecture {arch:?}",
                    key("attention.head_count_kv")
                )))
            }
            _ => 0,
        };
        let is_conv = |i: usize| arch != "gemma4" && kv_per_layer.as_ref().is_some_and(|k| k[i] == 0);
        let gemma4 = match arch.as_str() {
            "gemma4" => Some(gemma4_layout(gguf, &c, &pattern, kv_per_layer.as_deref())?),
            _ => None,
        };
        // Qwen3.5: Gated DeltaNet layers, with full attention every `full_attention_interval`.
        let delta = match arch.as_str() {
            a if QWEN35.contains(&a) => Some((delta_shape(gguf, &arch)?, recurrent_layers(gguf, &arch, c.n_layers)?)),
            _ => None,
        };
        let is_delta = |i: usize| delta.as_ref().is_some_and(|(_, r)| r[i]);
        if QWEN35.contains(&arch.as_str()) {
            check_rope_sections(gguf, &arch, c.rope_dim)?;
        }
        // Each layer's tensors are checked as it is planned, so a block count larger than the
        // file's layers stops at the first missing one, before more is allocated.
        let has = |name: &str| gguf.tensor(name).is_some();
        let mut layers = Vec::new();
        for i in 0..c.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let b = |s: &str| format!("blk.{i}.{s}.bias");
            let kv_source = gemma4.as_ref().and_then(|g| g.kv_source[i]);
            let qkv = if kv_source.is_some() {
                Qkv::Query(n("attn_q"))
            } else if has(&n("attn_qkv")) {
                Qkv::Fused(n("attn_qkv"))
            } else if gemma4.is_some() && !has(&n("attn_v")) {
                // Gemma 4's key-equals-value layers: V is the K projection (before its norms).
                Qkv::Separate([n("attn_q"), n("attn_k"), n("attn_k")])
            } else {
                Qkv::Separate([n("attn_q"), n("attn_k"), n("attn_v")])
            };
            let (gate_up, down, experts) = ffn_plan(gguf, i, experts.as_ref())?;
            let dims = match (&gemma4, arch.as_str()) {
                (Some(g), _) => g.dims[i],
                // LFM2-MoE: its leading dense layers' FFN (feed_forward_length) and its experts'
                // (expert_feed_forward_length) differ.
                (_, "lfm2moe") => LayerDims {
                    head_dim: c.head_dim,
                    n_kv_heads: c.n_kv_heads,
                    ffn_dim: match experts.is_some() {
                        true => required_u64(gguf, &key("expert_feed_forward_length"))?,
                        false => required_u64(gguf, &key("feed_forward_length"))?,
                    },
                },
                _ => LayerDims { head_dim: c.head_dim, n_kv_heads: c.n_kv_heads, ffn_dim: c.ffn_dim },
            };
            let optional = |name: String| has(&name).then_some(name);
            let layer = LayerPlan {
                attn_norm: n("attn_norm"),
                qkv,
                qkv_bias: has(&b("attn_q")).then(|| [b("attn_q"), b("attn_k"), b("attn_v")]),
                qk_norm: has(&n("attn_q_norm")).then(|| [n("attn_q_norm"), n("attn_k_norm")]),
                wo: n("attn_output"),
                // gpt-oss and Qwen3.5 name their pre-FFN norm post_attention_norm.
                post_attn_norm: optional(n("post_attention_norm"))
                    .filter(|_| !PRE_FFN_POST_ATTENTION.contains(&&*arch)),
                ffn_norm: match PRE_FFN_POST_ATTENTION.contains(&&*arch) {
                    true => n("post_attention_norm"),
                    false => n("ffn_norm"),
                },
                attn_sinks: optional(n("attn_sinks")),
                wo_bias: optional(b("attn_output")),
                gate_up,
                down,
                experts,
                conv: is_conv(i).then(|| ShortConv {
                    in_proj: format!("blk.{i}.shortconv.in_proj.weight"),
                    conv: format!("blk.{i}.shortconv.conv.weight"),
                    out_proj: format!("blk.{i}.shortconv.out_proj.weight"),
                    kernel: conv_kernel,
                }),
                delta: delta.as_ref().filter(|_| is_delta(i)).map(|(shape, _)| DeltaNet {
                    qkv: n("attn_qkv"),
                    gate: n("attn_gate"),
                    conv: n("ssm_conv1d"),
                    dt_bias: b("ssm_dt"),
                    a: format!("blk.{i}.ssm_a"),
                    beta: n("ssm_beta"),
                    alpha: n("ssm_alpha"),
                    norm: n("ssm_norm"),
                    out: n("ssm_out"),
                    shape: *shape,
                }),
                attn_gate: QWEN35.contains(&arch.as_str()) && !is_delta(i),
                dims,
                kv_source,
                v_norm: gemma4.is_some(),
                out_scale: optional(n("layer_output_scale")),
                ple: gemma4.as_ref().and_then(|g| g.ple_width).map(|w| ([n("inp_gate"), n("proj"), n("post_norm")], w)),
                post_ffn_norm: optional(n("post_ffw_norm")),
                rope: if no_rope(i) {
                    none_rope
                } else if slides(i) {
                    sliding_rope
                } else {
                    0
                },
                window: window.filter(|_| slides(i)),
            };
            check_tensors(gguf, &layer.expected_shapes(&c))?;
            layers.push(layer);
        }

        check_sliding_layout(gguf, &arch, &layers, &ropes[sliding_rope])?;
        let gemma = arch == "gemma3" || arch == "gemma2" || arch == "gemma4";
        // Gemma 2 27B (46 layers) and Gemma 3 27B (62) scale by d_model / heads, the others by
        // the head size: transformers' query_pre_attn_scalar, which the file does not carry
        // (llama.cpp decides by the layer count too).
        let big = (arch == "gemma2" && c.n_layers == 46) || (arch == "gemma3" && c.n_layers == 62);
        let scale_dim = if big { c.d_model / c.n_heads } else { c.head_dim };
        // Gemma 2's soft-capping; llama.cpp's defaults (50, 30) where the file leaves them out.
        let (attn_softcap, final_softcap) = match arch.as_str() {
            "gemma2" => (
                Some(softcap(gguf, &key("attn_logit_softcapping"), 50.0)?),
                Some(softcap(gguf, &key("final_logit_softcapping"), 30.0)?),
            ),
            // Gemma 4: the final logits only, when the file says so.
            "gemma4" if gguf.get_f32(&key("final_logit_softcapping"))?.is_some_and(|v| v != 0.0) => {
                (None, Some(softcap(gguf, &key("final_logit_softcapping"), 30.0)?))
            }
            _ => (None, None),
        };
        let plan = Self {
            embed_scale: gemma.then(|| (c.d_model as f32).sqrt()),
            activation: if gemma { Activation::GeluTanh } else { Activation::Silu },
            // Gemma 4 scales by 1 (its q and k are RMS-normed; llama.cpp and transformers).
            attn_scale: if arch == "gemma4" { 1.0 } else { 1.0 / (scale_dim as f32).sqrt() },
            attn_softcap,
            final_softcap,
            ropes,
            layers,
            token_embd: "token_embd.weight".into(),
            // LFM2's final norm is its "embedding norm" (applied after the last layer).
            output_norm: match arch.as_str() {
                "lfm2" | "lfm2moe" => "token_embd_norm.weight",
                _ => "output_norm.weight",
            }
            .into(),
            output: if c.tied_output { "token_embd.weight" } else { "output.weight" }.into(),
            mtp: None,
            ple: gemma4.as_ref().and_then(|g| g.ple_width).map(|width| PerLayerEmbeddings {
                token_embd: "per_layer_token_embd.weight".into(),
                model_proj: "per_layer_model_proj.weight".into(),
                proj_norm: "per_layer_proj_norm.weight".into(),
                width,
            }),
            config: c,
        };
        let plan = Self { mtp: (plan.config.mtp_layers > 0).then(|| mtp(gguf, &plan)).transpose()?, ..plan };
        plan.validate(gguf)?;
        Ok(plan)
    }

    /// Every tensor the plan reads, with the shape (ggml order) it must have.
    pub fn expected_shapes(&self) -> Vec<(&str, Vec<u64>)> {
        let c = &self.config;
        let (d, v) = (c.d_model as u64, c.vocab_size as u64);
        let mut out = vec![(self.token_embd.as_str(), vec![d, v]), (self.output_norm.as_str(), vec![d])];
        if self.output != self.token_embd {
            out.push((self.output.as_str(), vec![d, v]));
        }
        out.extend(self.layers.iter().flat_map(|l| l.expected_shapes(c)));
        if let Some(p) = &self.ple {
            let all = (p.width * c.n_layers) as u64;
            out.extend([
                (p.token_embd.as_str(), vec![all, v]),
                (p.model_proj.as_str(), vec![d, all]),
                (p.proj_norm.as_str(), vec![p.width as u64]),
            ]);
        }
        if let Some(m) = &self.mtp {
            out.extend(m.layer.expected_shapes(c));
            out.extend([
                (m.eh_proj.as_str(), vec![2 * d, d]),
                (m.enorm.as_str(), vec![d]),
                (m.hnorm.as_str(), vec![d]),
                (m.embed.as_str(), vec![d, v]),
                (m.head_norm.as_str(), vec![d]),
                (m.head.as_str(), vec![d, v]),
            ]);
        }
        out
    }

    /// Every tensor the plan reads exists with the expected shape and a type the engine runs,
    /// and every tensor in the file is one the plan reads.
    fn validate(&self, gguf: &Gguf) -> Result<()> {
        let expected = self.expected_shapes();
        check_tensors(gguf, &expected)?;
        let mut used: HashSet<&str> = expected.iter().map(|(n, _)| *n).collect();
        used.insert(ROPE_FREQS);
        if let Some(t) = gguf.tensors.iter().find(|t| !used.contains(t.name.as_str())) {
            return Err(Error::Unsupported(format!(
                "tensor {:?}, which the {} plan does not use",
                t.name, self.config.architecture
            )));
        }
        Ok(())
    }
}

impl LayerPlan {
    /// Every tensor of the layer, with the shape (ggml order) it must have.
    pub fn expected_shapes(&self, c: &ModelConfig) -> Vec<(&str, Vec<u64>)> {
        let c = &c.with_dims(&self.dims);
        let (d, q, kv, hd) = (c.d_model as u64, c.q_dim() as u64, c.kv_dim() as u64, c.head_dim as u64);
        let mut out = vec![(self.attn_norm.as_str(), vec![d])];
        if let Some(sc) = &self.conv {
            out.extend([
                (sc.in_proj.as_str(), vec![d, 3 * d]),
                (sc.conv.as_str(), vec![sc.kernel as u64, d]),
                (sc.out_proj.as_str(), vec![d, d]),
            ]);
            out.extend(self.ffn_shapes(c));
            return out;
        }
        if let Some(dn) = &self.delta {
            let s = dn.shape;
            let (conv, value, heads) = (s.conv_dim() as u64, s.value_dim() as u64, s.v_heads as u64);
            out.extend([
                (dn.qkv.as_str(), vec![d, conv]),
                (dn.gate.as_str(), vec![d, value]),
                (dn.conv.as_str(), vec![s.kernel as u64, conv]),
                (dn.dt_bias.as_str(), vec![heads]),
                (dn.a.as_str(), vec![heads]),
                (dn.beta.as_str(), vec![d, heads]),
                (dn.alpha.as_str(), vec![d, heads]),
                (dn.norm.as_str(), vec![s.head_v as u64]),
                (dn.out.as_str(), vec![value, d]),
            ]);
            out.extend(self.ffn_shapes(c));
            return out;
        }
        // Gated attention's q projection gives each head's query and gate.
        let q_out = if self.attn_gate { 2 * q } else { q };
        match &self.qkv {
            Qkv::Separate([wq, wk, wv]) => {
                out.extend([(wq.as_str(), vec![d, q_out]), (wk, vec![d, kv]), (wv, vec![d, kv])])
            }
            Qkv::Fused(w) => out.push((w, vec![d, q + 2 * kv])),
            Qkv::Query(w) => out.push((w, vec![d, q_out])),
        }
        if let Some([bq, bk, bv]) = &self.qkv_bias {
            out.extend([(bq.as_str(), vec![q]), (bk, vec![kv]), (bv, vec![kv])]);
        }
        match (&self.qk_norm, &self.qkv) {
            (Some([qn, _]), Qkv::Query(_)) => out.push((qn.as_str(), vec![hd])),
            (Some([qn, kn]), _) => out.extend([(qn.as_str(), vec![hd]), (kn, vec![hd])]),
            (None, _) => {}
        }
        out.extend(self.out_scale.iter().map(|n| (n.as_str(), vec![1])));
        if let Some(([gate, proj, post], w)) = &self.ple {
            out.extend([(gate.as_str(), vec![d, *w as u64]), (proj, vec![*w as u64, d]), (post, vec![d])]);
        }
        out.push((&self.wo, vec![q, d]));
        out.extend(self.wo_bias.iter().map(|n| (n.as_str(), vec![d])));
        out.extend(self.attn_sinks.iter().map(|n| (n.as_str(), vec![c.n_heads as u64])));
        out.extend(self.post_attn_norm.iter().map(|n| (n.as_str(), vec![d])));
        out.extend(self.ffn_shapes(c));
        out
    }

    /// The FFN's tensors, with their shapes (ggml order).
    fn ffn_shapes(&self, c: &ModelConfig) -> Vec<(&str, Vec<u64>)> {
        let (d, f) = (c.d_model as u64, c.ffn_dim as u64);
        let mut out = vec![(self.ffn_norm.as_str(), vec![d])];
        // Experts' tensors stack `count` matrices along a third dimension.
        let stack = |mut shape: Vec<u64>| {
            shape.extend(self.experts.as_ref().map(|e| e.count as u64));
            shape
        };
        match &self.gate_up {
            GateUp::Separate([g, u]) => out.extend([(g.as_str(), stack(vec![d, f])), (u, stack(vec![d, f]))]),
            GateUp::Fused(w) => out.push((w, vec![d, 2 * f])),
        }
        out.push((&self.down, stack(vec![f, d])));
        if let Some(e) = &self.experts {
            let count = e.count as u64;
            out.push((&e.router, vec![d, count]));
            out.extend(e.router_bias.iter().map(|n| (n.as_str(), vec![count])));
            out.extend(e.selection_bias.iter().map(|n| (n.as_str(), vec![count])));
            if let Some([g, u, dn]) = &e.biases {
                out.extend([(g.as_str(), vec![f, count]), (u, vec![f, count]), (dn, vec![d, count])]);
            }
            if let Some(sh) = &e.shared {
                let fs = sh.ffn as u64;
                out.extend([
                    (sh.gate.as_str(), vec![d, fs]),
                    (sh.up.as_str(), vec![d, fs]),
                    (sh.down.as_str(), vec![fs, d]),
                    (sh.gate_inp.as_str(), vec![d]),
                ]);
            }
        }
        out.extend(self.post_ffn_norm.iter().map(|n| (n.as_str(), vec![d])));
        out
    }
}

/// Each tensor exists with its expected shape and a type the engine runs.
fn check_tensors(gguf: &Gguf, expected: &[(&str, Vec<u64>)]) -> Result<()> {
    for (name, shape) in expected {
        let info = gguf.require_tensor(name)?;
        check_shape(info, shape)?;
        crate::quant::tensor_format(info)?;
    }
    Ok(())
}

/// Layer `i`'s FFN: its gate and up projections, its down projection, and, in a mixture of
/// experts (`experts`: the file's routing), the layer's experts (their tensors, biases, a
/// shared expert).
fn ffn_plan(gguf: &Gguf, i: usize, experts: Option<&Experts>) -> Result<(GateUp, String, Option<Experts>)> {
    let n = |s: &str| format!("blk.{i}.{s}.weight");
    let b = |s: &str| format!("blk.{i}.{s}.bias");
    let has = |name: &str| gguf.tensor(name).is_some();
    // LFM2-MoE: its first `leading_dense_block_count` layers have a dense FFN.
    let arch = gguf.get_str("general.architecture")?.unwrap_or_default();
    let dense_first = gguf.get_u64(&format!("{arch}.leading_dense_block_count"))?.unwrap_or(0) as usize;
    let experts = experts.filter(|_| i >= dense_first);
    Ok(match experts {
        Some(e) => {
            let arch = gguf.get_str("general.architecture")?.unwrap_or_default();
            // Only Qwen3.5-MoE's plan has one (another file's shared-expert tensors are unused
            // tensors: an error naming them).
            let shared = match arch == "qwen35moe" && has(&n("ffn_up_shexp")) {
                true => {
                    let key = format!("{arch}.expert_shared_feed_forward_length");
                    let ffn = gguf.get_u64(&key)?.ok_or_else(|| Error::MissingMetadata(key.clone()))?;
                    if ffn == 0 || ffn > 1 << 20 {
                        return Err(invalid(&key, ffn, "must be from 1 to 2^20"));
                    }
                    Some(SharedExpert {
                        gate: n("ffn_gate_shexp"),
                        up: n("ffn_up_shexp"),
                        down: n("ffn_down_shexp"),
                        gate_inp: n("ffn_gate_inp_shexp"),
                        ffn: ffn as usize,
                    })
                }
                false => None,
            };
            let e = Experts {
                router: n("ffn_gate_inp"),
                router_bias: has(&b("ffn_gate_inp")).then(|| b("ffn_gate_inp")),
                selection_bias: (arch == "lfm2moe").then(|| b("exp_probs_b")),
                biases: has(&b("ffn_gate_exps")).then(|| [b("ffn_gate_exps"), b("ffn_up_exps"), b("ffn_down_exps")]),
                shared,
                ..e.clone()
            };
            (GateUp::Separate([n("ffn_gate_exps"), n("ffn_up_exps")]), n("ffn_down_exps"), Some(e))
        }
        None if has(&n("ffn_gate")) => (GateUp::Separate([n("ffn_gate"), n("ffn_up")]), n("ffn_down"), None),
        None => (GateUp::Fused(n("ffn_up")), n("ffn_down"), None),
    })
}

/// Gemma 4's layers from its metadata: each one's head size (`attention.key_length_swa` on
/// sliding layers, `attention.key_length` on full ones), KV heads and FFN width (per-layer
/// arrays), which layer's keys and values the last `attention.shared_kv_layers` read (as
/// llama.cpp hard-codes it: a sliding one the second-last layer that keeps its own, a full one
/// the last; each must be of its kind), and the per-layer embeddings' width.
pub(crate) struct Gemma4Layout {
    pub dims: Vec<LayerDims>,
    pub kv_source: Vec<Option<usize>>,
    pub ple_width: Option<usize>,
}

/// `gemma4_layout` from the header alone (`ModelInfo`).
pub(crate) fn gemma4_header_layout(gguf: &Gguf, c: &ModelConfig) -> Result<Gemma4Layout> {
    let sliding = gemma4_sliding(gguf, c)?;
    gemma4_layout(gguf, c, &sliding, config::kv_heads_per_layer(gguf, "gemma4", c.n_layers)?.as_deref())
}

/// Which of Gemma 4's layers slide: `attention.sliding_window_pattern`, a flag per layer.
fn gemma4_sliding(gguf: &Gguf, c: &ModelConfig) -> Result<Vec<bool>> {
    let k = "gemma4.attention.sliding_window_pattern";
    let flags = gguf.get_array(k)?.ok_or_else(|| Error::MissingMetadata(k.into()))?;
    if flags.len() != c.n_layers {
        return Err(invalid(k, format!("{} values", flags.len()), "must have one per layer"));
    }
    Ok((0..c.n_layers).map(|i| matches!(flags.get(i), Some(crate::gguf::ValueRef::Bool(true)))).collect())
}

fn gemma4_layout(gguf: &Gguf, c: &ModelConfig, sliding: &[bool], kv: Option<&[usize]>) -> Result<Gemma4Layout> {
    let key = |k: &str| format!("gemma4.{k}");
    let n = c.n_layers;
    let swa_head = gguf.get_u64(&key("attention.key_length_swa"))?.map_or(c.head_dim, |v| v as usize);
    if gguf.get_u64(&key("attention.value_length_swa"))?.is_some_and(|v| v as usize != swa_head) {
        return Err(invalid(&key("attention.value_length_swa"), swa_head, "must equal attention.key_length_swa"));
    }
    if swa_head == 0 || swa_head > c.head_dim {
        return Err(invalid(&key("attention.key_length_swa"), swa_head, "must be from 1 to attention.key_length"));
    }
    let ffn = config::per_layer(gguf, &key("feed_forward_length"), n)?;
    let dims = (0..n)
        .map(|i| LayerDims {
            head_dim: if sliding[i] { swa_head } else { c.head_dim },
            n_kv_heads: kv.map_or(c.n_kv_heads, |k| k[i]),
            ffn_dim: ffn.as_ref().map_or(c.ffn_dim, |f| f[i]),
        })
        .collect::<Vec<_>>();
    for (i, d) in dims.iter().enumerate() {
        if d.n_kv_heads == 0 || c.n_heads % d.n_kv_heads != 0 || d.ffn_dim == 0 {
            return Err(invalid(
                &key("attention.head_count_kv"),
                format!("layer {i}"),
                "each layer needs KV heads dividing the heads and an FFN",
            ));
        }
    }
    let shared = gguf.get_u64(&key("attention.shared_kv_layers"))?.unwrap_or(0) as usize;
    if shared >= n.saturating_sub(1) && shared > 0 {
        return Err(invalid(&key("attention.shared_kv_layers"), shared, "must leave two layers their own keys"));
    }
    let own = n - shared;
    let kv_source = (0..n)
        .map(|i| {
            if i < own {
                return Ok(None);
            }
            let source = if sliding[i] { own - 2 } else { own - 1 };
            if sliding[source] != sliding[i] || dims[source].head_dim != dims[i].head_dim {
                let reason =
                    format!("layer {i} would read layer {source}'s keys, of another kind (llama.cpp's layout)");
                return Err(invalid(&key("attention.shared_kv_layers"), shared, &reason));
            }
            Ok(Some(source))
        })
        .collect::<Result<Vec<_>>>()?;
    let ple_width = match gguf.get_u64(&key("embedding_length_per_layer_input"))? {
        Some(0) | None => None,
        Some(w) if w > 1 << 16 => {
            return Err(invalid(&key("embedding_length_per_layer_input"), w, "must be at most 65536"))
        }
        Some(w) => Some(w as usize),
    };
    Ok(Gemma4Layout { dims, kv_source, ple_width })
}

/// A positive size the file must have.
fn required_u64(gguf: &Gguf, key: &str) -> Result<usize> {
    match gguf.get_u64(key)? {
        Some(v) if v > 0 && v <= 1 << 24 => Ok(v as usize),
        Some(v) => Err(invalid(key, v, "must be from 1 to 2^24")),
        None => Err(Error::MissingMetadata(key.into())),
    }
}

/// gpt-oss and Qwen3.5 name the norm before the FFN `post_attention_norm`.
const PRE_FFN_POST_ATTENTION: &[&str] = &["gpt-oss", "qwen35", "qwen35moe"];

/// Qwen3.5's Gated DeltaNet sizes, from `ssm.*` (llama.cpp's names: the state size is each key
/// head's size, the group count the key heads, the time-step rank the value heads).
pub(crate) fn delta_shape(gguf: &Gguf, arch: &str) -> Result<DeltaShape> {
    let key = |k: &str| format!("{arch}.ssm.{k}");
    let get = |k: &str| -> Result<usize> {
        let v = gguf.get_u64(&key(k))?.ok_or_else(|| Error::MissingMetadata(key(k)))?;
        if v == 0 || v > 1 << 16 {
            return Err(invalid(&key(k), v, "must be from 1 to 65536"));
        }
        Ok(v as usize)
    };
    let (kernel, head_k, k_heads, v_heads, inner) =
        (get("conv_kernel")?, get("state_size")?, get("group_count")?, get("time_step_rank")?, get("inner_size")?);
    if !(2..=16).contains(&kernel) {
        return Err(invalid(&key("conv_kernel"), kernel, "must be from 2 to 16"));
    }
    // The GPU's delta rule takes an invocation per state column (at most 256) and a column of
    // head_k values in registers; the state of a layer stays at most 2^24 values (64 MiB).
    for (k, v, most) in [("state_size", head_k, 512), ("time_step_rank", v_heads, 1024)] {
        if v > most {
            return Err(invalid(&key(k), v, &format!("at most {most} are supported")));
        }
    }
    if v_heads % k_heads != 0 {
        return Err(invalid(&key("time_step_rank"), v_heads, "the value heads must be a multiple of the key heads"));
    }
    if inner % v_heads != 0 {
        return Err(invalid(&key("inner_size"), inner, "must be a multiple of the value heads"));
    }
    let shape = DeltaShape { kernel, k_heads, v_heads, head_k, head_v: inner / v_heads };
    if shape.head_v > 256 {
        return Err(invalid(&key("inner_size"), inner, "value heads of at most 256 values are supported"));
    }
    if shape.state_values() > 1 << 24 {
        return Err(invalid(&key("inner_size"), inner, "a layer's state of at most 2^24 values is supported"));
    }
    Ok(shape)
}

/// Which of Qwen3.5's layers are Gated DeltaNets: `attention.recurrent_layers` (a flag per
/// layer, the MTP layer's included) where the file has it, else all but every
/// `full_attention_interval`-th (4 when absent), as llama.cpp reads them.
pub(crate) fn recurrent_layers(gguf: &Gguf, arch: &str, n_layers: usize) -> Result<Vec<bool>> {
    let key = format!("{arch}.attention.recurrent_layers");
    if let Some(flags) = gguf.get_array(&key)? {
        if flags.len() < n_layers {
            return Err(invalid(
                &key,
                format!("{} values", flags.len()),
                &format!("must have one per layer ({n_layers})"),
            ));
        }
        return (0..n_layers)
            .map(|i| match flags.get(i) {
                Some(crate::gguf::ValueRef::Bool(b)) => Ok(b),
                _ => Err(invalid(&key, format!("element {i}"), "must be a boolean")),
            })
            .collect();
    }
    let key = format!("{arch}.full_attention_interval");
    let every = gguf.get_u64(&key)?.unwrap_or(4);
    if every == 0 || every > n_layers as u64 + 1 {
        return Err(invalid(&key, every, "must be from 1 to the layer count"));
    }
    Ok((0..n_layers).map(|i| (i as u64 + 1) % every != 0).collect())
}

/// Qwen3.5's interleaved M-RoPE: a text position is the same in each section, so it is the
/// NeoX rotation of every pair, provided the sections cover every pair (a pair past them
/// would take the fourth, extra position, which text does not have): refused otherwise.
fn check_rope_sections(gguf: &Gguf, arch: &str, rope_dim: usize) -> Result<()> {
    let key = format!("{arch}.rope.dimension_sections");
    let Some(list) = gguf.get_array(&key)? else { return Ok(()) };
    let sum: u64 = (0..list.len()).filter_map(|i| list.get(i).and_then(|v| v.as_u64())).take(3).sum();
    if sum as usize != rope_dim / 2 {
        return Err(Error::Unsupported(format!(
            "M-RoPE sections that do not cover the {} rotated pairs ({key})",
            rope_dim / 2
        )));
    }
    Ok(())
}

/// Qwen3.5's MTP head: a gated full-attention layer numbered after the model's layers, and the
/// `nextn` tensors beside it.
fn mtp(gguf: &Gguf, plan: &Plan) -> Result<Mtp> {
    let c = &plan.config;
    if c.mtp_layers != 1 {
        let key = format!("{}.nextn_predict_layers", c.architecture);
        return Err(Error::Unsupported(format!("{} multi-token-prediction layers ({key}); one is", c.mtp_layers)));
    }
    let i = c.n_layers;
    let n = |s: &str| format!("blk.{i}.{s}.weight");
    let has = |name: &str| gguf.tensor(name).is_some();
    // Its FFN is the model's kind (Qwen3.5-MoE's a mixture with the layers' routing).
    let routing = plan.layers.iter().find_map(|l| l.experts.as_ref());
    let (gate_up, down, experts) = ffn_plan(gguf, i, routing)?;
    let layer = LayerPlan {
        attn_norm: n("attn_norm"),
        qkv: Qkv::Separate([n("attn_q"), n("attn_k"), n("attn_v")]),
        qkv_bias: None,
        qk_norm: Some([n("attn_q_norm"), n("attn_k_norm")]),
        wo: n("attn_output"),
        post_attn_norm: None,
        ffn_norm: n("post_attention_norm"),
        gate_up,
        down,
        experts,
        conv: None,
        delta: None,
        attn_gate: true,
        attn_sinks: None,
        wo_bias: None,
        post_ffn_norm: None,
        dims: LayerDims { head_dim: c.head_dim, n_kv_heads: c.n_kv_heads, ffn_dim: c.ffn_dim },
        kv_source: None,
        v_norm: false,
        out_scale: None,
        ple: None,
        rope: 0,
        window: None,
    };
    check_tensors(gguf, &layer.expected_shapes(c))?;
    let or = |name: String, default: &str| if has(&name) { name } else { default.to_string() };
    Ok(Mtp {
        layer,
        eh_proj: n("nextn.eh_proj"),
        enorm: n("nextn.enorm"),
        hnorm: n("nextn.hnorm"),
        embed: or(n("nextn.embed_tokens"), &plan.token_embd),
        head_norm: or(n("nextn.shared_head_norm"), &plan.output_norm),
        head: or(n("nextn.shared_head_head"), &plan.output),
    })
}

/// A mixture of experts' routing, from the metadata (the router's tensor name is per layer).
/// Qwen3-MoE renormalizes the chosen experts' weights: its files do not say so, llama.cpp
/// hard-codes it (`build_moe_ffn(..., norm_w = true, ...)` in src/models/qwen3moe.cpp), as the
/// released checkpoints' `norm_topk_prob: true` does.
fn experts(gguf: &Gguf, arch: &str, count: u64) -> Result<Experts> {
    let key = |k: &str| format!("{arch}.{k}");
    const MAX_EXPERTS: u64 = 1024;
    if count > MAX_EXPERTS {
        return Err(invalid(&key("expert_count"), count, &format!("at most {MAX_EXPERTS} experts are supported")));
    }
    let used =
        gguf.get_u64(&key("expert_used_count"))?.ok_or_else(|| Error::MissingMetadata(key("expert_used_count")))?;
    if used == 0 || used > count.min(16) {
        let reason = format!("must be from 1 to {} (the expert count, at most 16)", count.min(16));
        return Err(invalid(&key("expert_used_count"), used, &reason));
    }
    // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX is 1, _SIGMOID 2 (LFM2-MoE's).
    let sigmoid = match gguf.get_u64(&key("expert_gating_func"))? {
        None | Some(1) => false,
        Some(2) if arch == "lfm2moe" => true,
        Some(g) => {
            return Err(Error::Unsupported(format!("expert gating function {g} ({})", key("expert_gating_func"))))
        }
    };
    if gguf.get_u64(&key("expert_shared_count"))?.is_some_and(|n| n > 0) {
        return Err(Error::Unsupported(format!("shared experts ({})", key("expert_shared_count"))));
    }
    // llama.cpp scales only when the value is neither 0 (absent) nor 1.
    let scale = gguf.get_f32(&key("expert_weights_scale"))?.filter(|&s| s != 0.0).unwrap_or(1.0);
    if !scale.is_finite() {
        return Err(invalid(&key("expert_weights_scale"), scale, "must be a finite number"));
    }
    // gpt-oss: a softmax over the chosen experts' logits, the same weights as the renormalized
    // softmax over all of them; its clamped SwiGLU (llama.cpp: LLM_FFN_SWIGLU_OAI_MOE).
    Ok(Experts {
        router: String::new(),
        count: count as usize,
        used: used as usize,
        normalize: true,
        scale,
        router_bias: None,
        biases: None,
        swiglu_oai: arch == "gpt-oss",
        shared: None,
        sigmoid,
        selection_bias: None,
    })
}

/// YaRN (transformers' `_compute_yarn_parameters`, llama.cpp's `rope_yarn`): each pair's
/// frequency a mix of the original (extrapolation) and divided by the factor (interpolation),
/// by a linear ramp between the pairs whose wavelengths fit beta_fast and beta_slow turns in
/// the original context; cos and sin times the attention factor (0.1 ln(factor) + 1 unless the
/// file gives `yarn_attn_factor`, times `rope.scaling.attn_factor`). Returns each pair's
/// frequency divisor and that factor. The betas default to 32 and 1, as in both; DeepSeek's
/// log multiplier and other extrapolation factors are refused.
fn yarn(gguf: &Gguf, arch: &str, c: &ModelConfig) -> Result<(Vec<f32>, f64)> {
    let key = |k: &str| format!("{arch}.rope.scaling.{k}");
    let number = |k: &str, default: f32| -> Result<f64> {
        let v = gguf.get_f32(&key(k))?.unwrap_or(default);
        if !(v.is_finite() && v > 0.0) {
            return Err(invalid(&key(k), v, "must be a positive number"));
        }
        Ok(v as f64)
    };
    let factor = number("factor", 1.0)?;
    if factor < 1.0 {
        return Err(invalid(&key("factor"), factor, "YaRN needs a factor of at least 1"));
    }
    if gguf.get_f32(&key("yarn_log_multiplier"))?.is_some_and(|v| v != 0.0) {
        return Err(Error::Unsupported(format!("YaRN's log multiplier ({})", key("yarn_log_multiplier"))));
    }
    if gguf.get_f32(&key("yarn_ext_factor"))?.is_some_and(|v| v != 1.0) {
        return Err(Error::Unsupported(format!(
            "a YaRN extrapolation factor other than 1 ({})",
            key("yarn_ext_factor")
        )));
    }
    let orig = match gguf.get_u64(&key("original_context_length"))? {
        Some(n) if n > 0 => n as f64,
        Some(n) => return Err(invalid(&key("original_context_length"), n, "must be positive")),
        None => c.context_length as f64,
    };
    let (beta_fast, beta_slow) = (number("yarn_beta_fast", 32.0)?, number("yarn_beta_slow", 1.0)?);
    let (dim, base) = (c.rope_dim as f64, c.rope_base as f64);
    // The pair index whose wavelength turns `rotations` times in the original context.
    let corr = |rotations: f64| dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
    // gpt-oss's checkpoints say truncate: false (transformers keeps the fractional correction
    // dims; llama.cpp rounds them for every architecture, which moves gpt-oss's logits).
    let truncate = arch != "gpt-oss";
    let (low, high) = (corr(beta_fast), corr(beta_slow));
    let (low, high) = if truncate { (low.floor(), high.ceil()) } else { (low, high) };
    let (low, high) = (low.max(0.0), high.min(dim - 1.0));
    let divisors = (0..c.rope_dim / 2)
        .map(|i| {
            let ramp = ((i as f64 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
            // The share of extrapolation (the original frequency) in the mix.
            let extrapolation = 1.0 - ramp;
            (1.0 / ((1.0 - extrapolation) / factor + extrapolation)) as f32
        })
        .collect();
    let attention = match gguf.get_f32(&key("yarn_attn_factor"))? {
        Some(v) if v.is_finite() && v > 0.0 => v as f64,
        Some(v) => return Err(invalid(&key("yarn_attn_factor"), v, "must be a positive number")),
        None => 0.1 * factor.ln() + 1.0,
    };
    Ok((divisors, attention * number("attn_factor", 1.0)?))
}

/// Which layers slide and their RoPE base come from the architecture here (as llama.cpp
/// hard-codes them); a file that says otherwise (`attention.sliding_window_pattern`, a period
/// or one flag per layer, read as llama.cpp reads it; `rope.freq_base_swa`) must agree, or it
/// is an error naming the key, never a silently different model.
fn check_sliding_layout(gguf: &Gguf, arch: &str, layers: &[LayerPlan], sliding: &Rope) -> Result<()> {
    let key = format!("{arch}.attention.sliding_window_pattern");
    let planned = |i: usize| layers[i].window.is_some();
    let agrees = match gguf.get(&key) {
        None => true,
        Some(crate::gguf::Value::List(_)) => {
            let flags = gguf.get_array(&key)?.expect("a list");
            flags.len() == layers.len()
                && flags.iter().enumerate().all(|(i, v)| v == crate::gguf::ValueRef::Bool(planned(i)))
        }
        Some(_) => {
            // llama.cpp's set_swa_pattern: layer i slides when i % n < n - 1 (every layer for 0).
            let n = gguf.get_u64(&key)?.unwrap_or(0) as usize;
            (0..layers.len()).all(|i| planned(i) == (n == 0 || i % n < n - 1))
        }
    };
    if !agrees {
        return Err(Error::Unsupported(format!("a sliding-window layer layout other than {arch}'s ({key})")));
    }
    let key = format!("{arch}.rope.freq_base_swa");
    match gguf.get_f32(&key)? {
        Some(base) if layers.iter().any(|l| l.window.is_some()) && base as f64 != sliding.base => {
            Err(Error::Unsupported(format!("a RoPE base of {base} for the sliding layers ({key})")))
        }
        _ => Ok(()),
    }
}

/// A soft-capping value from `key`, `default` when absent.
fn softcap(gguf: &Gguf, key: &str, default: f32) -> Result<f32> {
    let v = gguf.get_f32(key)?.unwrap_or(default);
    if !(v.is_finite() && v > 0.0) {
        return Err(invalid(key, v, "must be a positive number"));
    }
    Ok(v)
}

/// Metadata keys that change the math in ways no plan implements.
fn reject_unimplemented_keys(gguf: &Gguf, arch: &str) -> Result<()> {
    // Gemma 2's plan soft-caps; no other does.
    let capped: &[&str] = match arch {
        "gemma2" => &[],
        "gemma4" => &["attn_logit_softcapping"],
        _ => &["attn_logit_softcapping", "final_logit_softcapping"],
    };
    for k in capped.iter().chain(&["attention.max_alibi_bias"]) {
        let full = format!("{arch}.{k}");
        if gguf.get_f32(&full).ok().flatten().is_some_and(|v| v != 0.0) {
            return Err(Error::Unsupported(format!("metadata {full:?} (logit soft-capping / ALiBi)")));
        }
    }
    if matches!(gguf.get(&format!("{arch}.attention.causal")), Some(crate::gguf::Value::Bool(false))) {
        return Err(Error::Unsupported(format!("non-causal attention ({arch}.attention.causal = false)")));
    }
    Ok(())
}

pub fn check_shape(info: &TensorInfo, expected: &[u64]) -> Result<()> {
    // GGUF writers may keep trailing dimensions of size 1.
    let mut trimmed = info.shape.clone();
    while trimmed.len() > expected.len() && trimmed.last() == Some(&1) {
        trimmed.pop();
    }
    if trimmed != expected {
        return Err(GgufError::UnexpectedShape {
            name: info.name.clone(),
            expected: expected.to_vec(),
            found: info.shape.clone(),
        }
        .into());
    }
    Ok(())
}
