//! The model on the GPU: its weights, KV cache and activations, made at load, and the forward
//! pass (`record`), read top to bottom as a list of named dispatches per layer; the sequences
//! of its KV pool. The batched decode pass, self-speculation's draft pass, the all-logits pass
//! and a copy-on-write scratch block are made on first use. How passes are submitted and read:
//! `round.rs`, the one submit path the runtime uses (a batcher round: prefill chunks and a
//! decode step in one submission, each row reading back what its sampler needs); `single.rs`,
//! the single-sequence entry points the kernel and golden tests, the draft passes and `bench`
//! drive by hand.

use super::kernels::{
    self, BatchLayout, Dispatch, Epilogue, Feed, GemvBatch, Ledger, NormIn, NormOut, Params, QkvExtras, RopeKvFold,
    Segment, SegmentRows, KV_BLOCK,
};
use super::shader::PipelineCache;
use super::weights::{Linear, Rows};
use super::{Gpu, KernelStyle};
use crate::arch::{GateUp, Plan, Qkv, ROPE_FREQS};
use crate::error::{Error, Result};
use crate::gguf::{ByteSource, Gguf, TensorInfo};
use crate::kv_pool::{KvPool, SeqId};
use crate::model::reference::AttentionKind;
use crate::model::ModelConfig;

mod round;
mod single;

pub use round::{RoundFlight, RowReadback, RowsReadback};
pub use single::{InFlight, Readback};

/// The named tensors' infos and bytes, read one after another from the source.
async fn fetch<'g>(
    gguf: &'g Gguf,
    source: &(impl ByteSource + ?Sized),
    names: &[impl AsRef<str>],
) -> Result<Vec<(&'g TensorInfo, Vec<u8>)>> {
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        let info = gguf.require_tensor(name.as_ref())?;
        out.push((info, Gguf::tensor_data(source, info).await?));
    }
    Ok(out)
}

/// Floats a pass row takes in the activation buffers (`GpuModel::widths`).
struct Widths {
    qkv: usize,
    attn: usize,
    ffn: usize,
    /// The widest of every buffer's row, these three included.
    widest: usize,
}

/// Batch rows per pass over the weights in a batched decode step (gemv.wgsl's MB).
const BATCH_MB: u32 = 8;

/// Segments one round's pass (`GpuModel::submit_round`) holds at most: its decode rows and up to
/// ROUND_PASSES - 1 prompt chunks (each chunk's attention is a dispatch of its own).
pub const ROUND_PASSES: usize = 8;

#[derive(Clone, Copy, PartialEq)]
enum Pass<'a> {
    /// One token for each of the step's rows (sequences), MB rows per pass over the weights,
    /// through the first `layers` layers (all but for self-speculation's drafts).
    Decode {
        mb: u32,
        layers: usize,
    },
    Prefill,
    /// Prefill that writes every position's logits into the given buffer.
    AllLogits(&'a wgpu::Buffer),
    /// Qwen3.5's MTP head over a chunk of one sequence's positions (prefill-style): its input
    /// rows from the tokens and the kept hidden states (`chained`: the hidden state in `mtp_h`'s
    /// first row, the head's own last output), its layer, the last row's logits and argmax.
    Mtp {
        chained: bool,
    },
    /// A decode step of more than WIDE_ROWS rows: the prefill's tiled matrix products for the
    /// projections and the LM head (each weight read once per 64 rows), decode attention (each
    /// row its own sequence's blocks).
    WideDecode,
    /// A batcher round as one pass: its decode rows, then its prompt chunks' tokens. Every
    /// projection, norm and cache write takes all the rows (each weight read once for all, by
    /// tiled matrix products when `tiled`, else matrix-vector products); attention is decode
    /// attention for the decode rows and flash attention for each chunk (`Segment`); the final
    /// norm, LM head and argmax take the decode rows alone.
    Round {
        tiled: bool,
    },
}

struct LayerWeights {
    attn_norm: wgpu::Buffer,
    qkv: Linear,
    /// q|k|v biases.
    qkv_bias: Option<wgpu::Buffer>,
    /// q_norm then k_norm.
    qk_norm: Option<wgpu::Buffer>,
    wo: Linear,
    post_attn_norm: Option<wgpu::Buffer>,
    ffn_norm: wgpu::Buffer,
    /// Gated pairs when gate and up share a type; else gate rows then up rows.
    gate_up: Linear,
    w_down: Linear,
    post_ffn_norm: Option<wgpu::Buffer>,
    /// A mixture of experts' router (`gate_up` and `w_down` then stack the experts: gate
    /// experts' rows, then up experts').
    router: Option<Linear>,
    /// A short convolution's taps (d x kernel, f32); `qkv` is then its in_proj, `wo` its
    /// out_proj.
    conv_taps: Option<wgpu::Buffer>,
    /// A Gated DeltaNet's own weights (`qkv` is then its q|k|v, z, b and alpha projections,
    /// `wo` its output projection).
    delta: Option<DeltaWeights>,
    /// Gated attention's gate projection (`qkv`'s q rows are then each head's query half).
    attn_gate: Option<Linear>,
    /// A logit per query head in every softmax (gpt-oss); the output projection's bias.
    sinks: Option<wgpu::Buffer>,
    wo_bias: Option<wgpu::Buffer>,
    /// A mixture's router bias, and its experts' biases: gate then up ([count][ffn] each, one
    /// buffer, as the gate|up rows), and down ([count][d]).
    router_bias: Option<wgpu::Buffer>,
    expert_biases: Option<(wgpu::Buffer, wgpu::Buffer)>,
    /// A mixture's shared expert (`arch::SharedExpert`): gate|up, down, and its gate's row.
    shared: Option<[Linear; 3]>,
    /// Gemma 4's per-layer embedding (inp_gate, proj, post_norm) and output scalar.
    ple: Option<(Linear, Linear, wgpu::Buffer)>,
    out_scale: Option<wgpu::Buffer>,
}

/// Qwen3.5's MTP head (`arch::Mtp`): its layer, eh_proj, the norms, and its own embedding
/// table and output where the file has them (else the model's).
struct MtpWeights {
    layer: LayerWeights,
    eh_proj: Linear,
    enorm: wgpu::Buffer,
    hnorm: wgpu::Buffer,
    head_norm: wgpu::Buffer,
    embed: Option<Linear>,
    head: Option<Linear>,
}

/// A Gated DeltaNet layer's vectors (f32): the convolution's taps, dt_bias, a (-exp(A_log))
/// and the output norm's weights.
struct DeltaWeights {
    taps: wgpu::Buffer,
    dt_bias: wgpu::Buffer,
    a: wgpu::Buffer,
    norm: wgpu::Buffer,
}

/// A Gated DeltaNet layer's memory: each position's q|k|v projection (the convolution's input)
/// and delta-rule inputs (k, v, g, beta), paged like the KV cache; each sequence slot's state
/// (a head_k x head_v matrix per value head) and the positions it holds (a count per head).
struct DeltaBuffers {
    conv_in: wgpu::Buffer,
    inputs: wgpu::Buffer,
    state: wgpu::Buffer,
    ckpt: wgpu::Buffer,
}

/// A mixture of experts' activations, for a pass's rows: the router's logits, each token's
/// chosen experts and their weights, each (token, expert)'s hidden vector and output.
struct MoeBuffers {
    /// A shared expert's gate logit, a value a row.
    shared_gate: wgpu::Buffer,
    /// A pass's assignments grouped by expert.
    groups: kernels::MoeGroups,
    logits: wgpu::Buffer,
    ids: wgpu::Buffer,
    weights: wgpu::Buffer,
    h: wgpu::Buffer,
    y: wgpu::Buffer,
}

struct Buffers {
    params: wgpu::Buffer,
    /// A round pass's params for its decode rows (their logits), and for each of its prompt
    /// chunks (their attention: `Params::first` their first row).
    params_decode: wgpu::Buffer,
    params_chunks: Vec<wgpu::Buffer>,
    /// The rows' positions and block tables (`kernels::BatchLayout`).
    batch: wgpu::Buffer,
    /// Every position, 0 to the context's last: a single-row step copies its row's into `batch`
    /// (a queue write would make a staging buffer every token).
    positions: wgpu::Buffer,
    tokens: wgpu::Buffer,
    x: wgpu::Buffer,
    xn: wgpu::Buffer,
    /// The sums of squares of x's rows, 8 values a sum, that a CPU-style residual gemv writes
    /// with xn for the next gemv's norm (`kernels::Feed`), or a fed norm's pass.
    norm_sums: wgpu::Buffer,
    /// A fed norm pass's RMS scale of each row, for the gemms after it (`kernels::rms_norm_feed`).
    norm_scales: wgpu::Buffer,
    qkv: wgpu::Buffer,
    attn: wgpu::Buffer,
    gu: wgpu::Buffer,
    h: wgpu::Buffer,
    /// A projection's output before its post-norm (architectures with post-norms).
    proj: wgpu::Buffer,
    /// The int8 gemvs' and gemms' activation records (`kernels::takes_int8`; 16 bytes when none
    /// runs).
    xq: wgpu::Buffer,
    moe: Option<MoeBuffers>,
    /// Decode attention's per-split records (see `kernels::decode_partials_len`).
    partials: wgpu::Buffer,
    /// A row of logits per batch row.
    logits: wgpu::Buffer,
    /// An argmax per batch row.
    argmax: wgpu::Buffer,
    /// The argmax's first pass, done by the lm_head's gemv (`kernels::gemv_argmax`):
    /// `head_records` records a batch row.
    argmax_records: wgpu::Buffer,
    head_records: usize,
    /// A round's argmax, the tokens of the round chained to it (`submit_round`).
    chain: wgpu::Buffer,
    /// One cos/sin table per RoPE of the plan.
    rope: Vec<wgpu::Buffer>,
    /// Each attention layer's keys and values (a short-convolution layer's are 16 unused bytes).
    k_cache: Vec<wgpu::Buffer>,
    v_cache: Vec<wgpu::Buffer>,
    /// Each short-convolution layer's B * x at every position (f32, d_model a position), paged
    /// like the KV cache.
    conv_state: Vec<Option<wgpu::Buffer>>,
    /// Each Gated DeltaNet layer's memory; the rows' q (rows of key_dim) and gated attention's
    /// gate (rows of q_dim), for a pass's rows; params of no decode rows (a prefill pass's, for
    /// the delta rule's commits).
    delta: Vec<Option<DeltaBuffers>>,
    delta_q: Option<wgpu::Buffer>,
    gate: Option<wgpu::Buffer>,
    params_none: wgpu::Buffer,
    /// Gemma 4's per-layer inputs (rows of layers x width), the model projection's rows, and a
    /// layer's gate (rows of width).
    ple: Option<[wgpu::Buffer; 3]>,
    /// With an MTP head: every position's final hidden state (after the output norm, paged like
    /// the KV cache), the head's layer's keys and values, and its rows: hidden states in,
    /// embedding|hidden, its normed output.
    hidden: Option<wgpu::Buffer>,
    mtp_kv: Option<[wgpu::Buffer; 2]>,
    mtp_rows: Option<[wgpu::Buffer; 3]>,
    /// Two, used in turn: pipelined greedy steps read one while the next step fills the other.
    staging_argmax: [wgpu::Buffer; 2],
    staging_logits: wgpu::Buffer,
    /// Top-k selection, per batch row: (k, temperature bits), the selection's words
    /// (`kernels::TOP_K_WORDS` a row), and their staging (the rows' argmax words first, then
    /// what each selecting row reads, one after another).
    top_k_want: wgpu::Buffer,
    top_k_out: wgpu::Buffer,
    /// Per row, what a drawing row's sampler draws with (`kernels::DRAW_WORDS`: shaders/draw.wgsl).
    draws: wgpu::Buffer,
    staging_top_k: wgpu::Buffer,
    /// Structured output's masks for a round's decode rows (`kernels::masks_bytes`).
    masks: wgpu::Buffer,
}

/// The host's cost of encoding and submitting: the thread's CPU time where the OS tells it
/// (unix), else wall time (the browser, where submitting does not wait for the GPU).
struct HostClock(u64);

impl HostClock {
    fn now() -> Self {
        Self(Self::read())
    }

    fn elapsed_ns(&self) -> u64 {
        Self::read().saturating_sub(self.0)
    }

    #[cfg(unix)]
    fn read() -> u64 {
        let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes one timespec through a valid pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
    }

    #[cfg(not(unix))]
    fn read() -> u64 {
        thread_local!(static START: web_time::Instant = web_time::Instant::now());
        START.with(|s| s.elapsed().as_nanos() as u64)
    }
}

pub struct GpuModel {
    pub gpu: Gpu,
    pub config: ModelConfig,
    pub plan: Plan,
    pub context: usize,
    embd: Linear,
    /// Gemma 4's per-layer embeddings: the token table, the model projection, its norm.
    ple: Option<(Linear, Linear, wgpu::Buffer)>,
    output_norm: wgpu::Buffer,
    lm_head: Option<Linear>,
    layers: Vec<LayerWeights>,
    buf: Buffers,
    /// A single sequence's decode step (MB 1).
    decode: Vec<Dispatch>,
    /// The longest context at which decode attention takes one dispatch a layer, not two
    /// (`kernels::decode_short_keys`, the least over the layers; 0: never). The decode passes
    /// hold both, each on its segment (`SegmentRows::at_keys`).
    short_keys: usize,
    /// A batched decode step; made on first use.
    decode_batch: Option<Vec<Dispatch>>,
    /// A decode step of more than WIDE_ROWS rows (`Pass::WideDecode`); made on first use.
    decode_wide: Option<Vec<Dispatch>>,
    /// A round with prompt chunks (`Pass::Round`), up to WIDE_ROWS rows and past them; made on
    /// first use.
    round_narrow: Option<Vec<Dispatch>>,
    round_wide: Option<Vec<Dispatch>>,
    /// Self-speculation's draft step (its layer count and dispatches); made on first use.
    draft: Option<(usize, Vec<Dispatch>)>,
    /// Qwen3.5's MTP head, its passes (the hidden states gathered, chained; made on first use)
    /// and the positions each sequence slot's head has read.
    mtp: Option<MtpWeights>,
    mtp_passes: Option<[Vec<Dispatch>; 2]>,
    mtp_len: Vec<usize>,
    prefill: Vec<Dispatch>,
    /// The top-k selection that follows a pass for the rows whose sampler asks for it, and the
    /// argmax again for rows with a constraint mask (`finish_round`).
    select: Option<Dispatch>,
    /// The seeded draw of the rows whose sampler draws on the GPU (`RowReadback::Draw`), after
    /// the selection.
    draw: Option<Dispatch>,
    argmax_masked: Option<Dispatch>,
    /// The decode rows' mask flags as the next round writes them (`set_mask`), and whether
    /// those on the GPU flag any row (they are cleared before a round that selects).
    mask_flags: Vec<u32>,
    masks_flagged: bool,
    /// Prefill that keeps every position's logits (perplexity, tests); made on first use.
    all_logits: Option<(Vec<Dispatch>, wgpu::Buffer)>,
    /// The KV cache's blocks and the sequences' block tables.
    pool: KvPool,
    layout: BatchLayout,
    /// The sequence `step` and `submit_greedy` run (the engine's conversation).
    main: SeqId,
    /// Sequences whose block tables changed since they were last uploaded.
    dirty: Vec<bool>,
    /// Reused per step: the pool's copy-on-write block copies, the rows' batch words.
    copies: Vec<(u32, u32)>,
    row_words: Vec<u32>,
    round_tokens: Vec<u32>,
    /// The params last written (a step writes them only when they change).
    params_now: Params,
    /// The block table word of `batch`'s row 0 as last written (None: not yet).
    row0_table: Option<u32>,
    /// Decode rows one step takes at most (decode attention's records fit one binding).
    max_batch: usize,
    /// One layer's K or V block on its way to another block (WebGPU copies nothing within a
    /// buffer): made at the first copy-on-write.
    block_scratch: Option<wgpu::Buffer>,
    pipelines: PipelineCache,
    /// Weight bytes of the file one decode token needs: every tensor once (of a mixture of
    /// experts, its chosen experts' share), one embedding row (the whole table when it is also
    /// the output).
    file_weight_bytes: u64,
    /// The staging slot the next greedy step's argmax goes to.
    next_slot: usize,
}

impl GpuModel {
    /// Uploads the model and records the decode and prefill passes. `progress(done, total)`
    /// counts the embedding, the layers and the output as they are uploaded.
    pub async fn load(
        gpu: Gpu,
        gguf: &Gguf,
        source: &(impl ByteSource + ?Sized),
        context: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let rope_freqs = match gguf.tensor(ROPE_FREQS) {
            Some(t) => Some(Gguf::tensor_data(source, t).await?),
            None => None,
        };
        let plan = Plan::from_gguf(gguf, rope_freqs.as_deref())?;
        let c = plan.config.clone();
        // Every layer's sizes (Gemma 4's differ by layer), and Gemma 4's per-layer embeddings'.
        let ple_width = plan.ple.as_ref().map_or(8, |p| p.width);
        for d in plan.layers.iter().map(|l| l.dims) {
            if d.head_dim > kernels::MAX_HEAD_DIM
                || d.head_dim % 8 != 0
                || c.d_model % 8 != 0
                || d.ffn_dim % 8 != 0
                || ple_width % 8 != 0
            {
                return Err(Error::InvalidMetadata {
                    key: format!("{}.attention.head_count", c.architecture),
                    value: format!("head_dim {}, d_model {}, ffn {}, per-layer embedding {ple_width}", d.head_dim, c.d_model, d.ffn_dim),
                    reason: format!(
                        "the GPU kernels need head_dim <= {} and a multiple of 8, d_model, ffn and per-layer embedding widths multiples of 8",
                        kernels::MAX_HEAD_DIM
                    ),
                });
            }
        }
        // Before the upload: a context (or a pool) whose buffers this GPU cannot bind is the
        // caller's error.
        let fits = Self::max_context(&gpu, &plan);
        let pool_tokens = gpu.kv_tokens.unwrap_or(context).max(context).next_multiple_of(KV_BLOCK);
        if pool_tokens > fits && context <= fits {
            return Err(Error::InvalidOption {
                name: "KV pool tokens",
                value: pool_tokens.to_string(),
                expected: format!(
                    "at most {fits} tokens on this GPU (each layer's KV cache is one buffer, at most maxStorageBufferBindingSize = {} bytes)",
                    gpu.max_binding()
                ),
            });
        }
        if context == 0 || context > fits {
            return Err(Error::InvalidOption {
                name: "context length",
                value: context.to_string(),
                expected: format!(
                    "must be from 1 to {fits} tokens on this GPU (each layer's KV cache is one buffer, at most maxStorageBufferBindingSize = {} bytes)",
                    gpu.max_binding()
                ),
            });
        }
        let watch = gpu.watch_memory();
        // Progress counts the embedding, each layer and the output.
        let total = c.n_layers + 2;
        progress(0, total);
        let (g, src) = (gguf, source);
        let linear = async |label: &'static str, names: &[&String]| -> Result<Linear> {
            let rows = names.iter().map(|n| Rows::of(g.require_tensor(n)?)).collect::<Result<Vec<_>>>()?;
            Linear::new(&gpu, label, &rows, src).await
        };
        let f32_buffer = |label: &str, tensors: Vec<(&TensorInfo, Vec<u8>)>| -> Result<wgpu::Buffer> {
            let mut values = Vec::new();
            for (info, data) in &tensors {
                values.extend(crate::quant::dequantize(info, data)?);
            }
            gpu.storage_init(label, bytemuck::cast_slice(&values))
        };
        // The biases and norms only some plans have.
        let optional_f32 = async |label: &str, names: Option<&[String]>| -> Result<Option<wgpu::Buffer>> {
            Ok(match names {
                Some(names) => Some(f32_buffer(label, fetch(g, src, names).await?)?),
                None => None,
            })
        };

        let embd = linear("token_embd", &[&plan.token_embd]).await?;
        let ple = match &plan.ple {
            Some(pe) => Some((
                linear("per_layer_token_embd", &[&pe.token_embd]).await?,
                linear("per_layer_model_proj", &[&pe.model_proj]).await?,
                f32_buffer("per_layer_proj_norm", fetch(g, src, &[&pe.proj_norm]).await?)?,
            )),
            None => None,
        };
        progress(1, total);
        let mut layers = Vec::with_capacity(c.n_layers);
        // One layer's weights from its plan (the model's layers, the MTP head's).
        let load_layer = async |l: &crate::arch::LayerPlan| -> Result<LayerWeights> {
            // Gated attention: each head's query rows, then its gate rows, in the q tensor.
            let head_halves = |name: &str, second: bool| -> Result<Vec<Rows<'_>>> {
                let rows = Rows::of(g.require_tensor(name)?)?;
                let hd = c.head_dim;
                Ok((0..c.n_heads).map(|h| rows.slice(2 * h * hd + if second { hd } else { 0 }, hd)).collect())
            };
            let qkv = match &l.qkv {
                _ if l.conv.is_some() => linear("in_proj", &[&l.conv.as_ref().expect("checked").in_proj]).await?,
                _ if l.delta.is_some() => {
                    let dn = l.delta.as_ref().expect("checked");
                    linear("delta_in", &[&dn.qkv, &dn.gate, &dn.beta, &dn.alpha]).await?
                }
                Qkv::Separate([q, k, v]) if l.attn_gate => {
                    let mut rows = head_halves(q, false)?;
                    rows.extend([Rows::of(g.require_tensor(k)?)?, Rows::of(g.require_tensor(v)?)?]);
                    Linear::new(&gpu, "qkv", &rows, src).await?
                }
                Qkv::Separate([q, k, v]) => linear("qkv", &[q, k, v]).await?,
                Qkv::Fused(name) | Qkv::Query(name) => linear("qkv", &[name]).await?,
            };
            let attn_gate = match &l.qkv {
                Qkv::Separate([q, _, _]) if l.attn_gate => {
                    Some(Linear::new(&gpu, "attn_gate", &head_halves(q, true)?, src).await?)
                }
                _ => None,
            };
            let delta = match &l.delta {
                Some(dn) => Some(DeltaWeights {
                    taps: f32_buffer("delta_taps", fetch(g, src, &[&dn.conv]).await?)?,
                    dt_bias: f32_buffer("delta_dt_bias", fetch(g, src, &[&dn.dt_bias]).await?)?,
                    a: f32_buffer("delta_a", fetch(g, src, &[&dn.a]).await?)?,
                    norm: f32_buffer("delta_norm", fetch(g, src, &[&dn.norm]).await?)?,
                }),
                None => None,
            };
            let (gate, up) = match &l.gate_up {
                GateUp::Separate([gate, up]) => (Rows::of(g.require_tensor(gate)?)?, Rows::of(g.require_tensor(up)?)?),
                GateUp::Fused(name) => Rows::of(g.require_tensor(name)?)?.halves(),
            };
            let gate_up = if l.experts.is_some() {
                Linear::new(&gpu, "gate_up_exps", &[gate, up], src).await?
            } else {
                match Linear::gated_pair(&gpu, "gate_up", gate, up, src).await? {
                    Some(pair) => pair,
                    None => Linear::new(&gpu, "gate_up", &[gate, up], src).await?,
                }
            };
            let w_down = linear("w_down", &[&l.down]).await?;
            let router = match &l.experts {
                Some(e) => {
                    let gate_name = match &l.gate_up {
                        GateUp::Separate([gate, _]) => gate,
                        GateUp::Fused(gate_up) => gate_up,
                    };
                    kernels::check_experts(&gate_up, gate_name)?;
                    kernels::check_experts(&w_down, &l.down)?;
                    Some(linear("router", &[&e.router]).await?)
                }
                None => None,
            };
            Ok::<_, Error>(LayerWeights {
                attn_norm: f32_buffer("attn_norm", fetch(g, src, &[&l.attn_norm]).await?)?,
                qkv,
                qkv_bias: optional_f32("qkv_bias", l.qkv_bias.as_ref().map(|n| &n[..])).await?,
                // A query alone (Gemma 4's KV sharing) has no key norm.
                qk_norm: optional_f32(
                    "qk_norm",
                    l.qk_norm.as_ref().map(|n| if matches!(l.qkv, Qkv::Query(_)) { &n[..1] } else { &n[..] }),
                )
                .await?,
                ple: match &l.ple {
                    Some(([gate, proj, post], _)) => Some((
                        linear("ple_gate", &[gate]).await?,
                        linear("ple_proj", &[proj]).await?,
                        f32_buffer("ple_post_norm", fetch(g, src, &[post]).await?)?,
                    )),
                    None => None,
                },
                out_scale: optional_f32("layer_output_scale", l.out_scale.as_ref().map(std::slice::from_ref)).await?,
                wo: match (&l.conv, &l.delta) {
                    (Some(sc), _) => linear("out_proj", &[&sc.out_proj]).await?,
                    (_, Some(dn)) => linear("ssm_out", &[&dn.out]).await?,
                    _ => linear("wo", &[&l.wo]).await?,
                },
                delta,
                attn_gate,
                sinks: optional_f32("attn_sinks", l.attn_sinks.as_ref().map(std::slice::from_ref)).await?,
                wo_bias: optional_f32("wo_bias", l.wo_bias.as_ref().map(std::slice::from_ref)).await?,
                // The router's bias, or LFM2-MoE's selection bias (a plan has one or the other).
                router_bias: optional_f32(
                    "router_bias",
                    l.experts
                        .as_ref()
                        .and_then(|e| e.router_bias.as_ref().or(e.selection_bias.as_ref()))
                        .map(std::slice::from_ref),
                )
                .await?,
                expert_biases: match l.experts.as_ref().and_then(|e| e.biases.as_ref()) {
                    Some([gb, ub, db]) => Some((
                        f32_buffer("expert_gate_up_bias", fetch(g, src, &[gb, ub]).await?)?,
                        f32_buffer("expert_down_bias", fetch(g, src, &[db]).await?)?,
                    )),
                    None => None,
                },
                shared: match l.experts.as_ref().and_then(|e| e.shared.as_ref()) {
                    Some(sh) => {
                        let (gate, up) = (Rows::of(g.require_tensor(&sh.gate)?)?, Rows::of(g.require_tensor(&sh.up)?)?);
                        let gate_up = match Linear::gated_pair(&gpu, "shexp_gate_up", gate, up, src).await? {
                            Some(pair) => pair,
                            None => Linear::new(&gpu, "shexp_gate_up", &[gate, up], src).await?,
                        };
                        Some([
                            gate_up,
                            linear("shexp_down", &[&sh.down]).await?,
                            linear("shexp_gate", &[&sh.gate_inp]).await?,
                        ])
                    }
                    None => None,
                },
                conv_taps: match &l.conv {
                    Some(sc) => Some(f32_buffer("conv_taps", fetch(g, src, &[&sc.conv]).await?)?),
                    None => None,
                },
                post_attn_norm: optional_f32("post_attn_norm", l.post_attn_norm.as_ref().map(std::slice::from_ref))
                    .await?,
                ffn_norm: f32_buffer("ffn_norm", fetch(g, src, &[&l.ffn_norm]).await?)?,
                gate_up,
                w_down,
                router,
                post_ffn_norm: optional_f32("post_ffn_norm", l.post_ffn_norm.as_ref().map(std::slice::from_ref))
                    .await?,
            })
        };
        for (i, l) in plan.layers.iter().enumerate() {
            layers.push(load_layer(l).await?);
            progress(i + 2, total);
        }
        let mtp = match &plan.mtp {
            Some(m) => Some(MtpWeights {
                layer: load_layer(&m.layer).await?,
                eh_proj: linear("mtp_eh_proj", &[&m.eh_proj]).await?,
                enorm: f32_buffer("mtp_enorm", fetch(g, src, &[&m.enorm]).await?)?,
                hnorm: f32_buffer("mtp_hnorm", fetch(g, src, &[&m.hnorm]).await?)?,
                head_norm: f32_buffer("mtp_head_norm", fetch(g, src, &[&m.head_norm]).await?)?,
                embed: match m.embed == plan.token_embd {
                    true => None,
                    false => Some(linear("mtp_embed", &[&m.embed]).await?),
                },
                head: match m.head == plan.output {
                    true => None,
                    false => Some(linear("mtp_head", &[&m.head]).await?),
                },
            }),
            None => None,
        };
        let output_norm = f32_buffer("output_norm", fetch(g, src, &[&plan.output_norm]).await?)?;
        let lm_head =
            if plan.output == plan.token_embd { None } else { Some(linear("output", &[&plan.output]).await?) };
        progress(total, total);

        let blocks = context.div_ceil(KV_BLOCK);
        // The rows asked for, as many as one binding holds of a row's attention records and
        // of its logits.
        let per_row = kernels::decode_partials_len(&gpu, &c, blocks * KV_BLOCK).max(c.vocab_size) as u64 * 4;
        let max_batch = gpu.max_batch.min((gpu.max_binding() / per_row.max(1)) as usize).max(1);
        // Sequences the pool holds at once: a full batch, as many again for beam search's forks
        // (made before the beams they replace are freed), a beam search's prompt, and `main`.
        let max_seqs = 2 * max_batch + 2;
        // A pass's rows (a prefill chunk): the GPU's, fewer where the widest activation row
        // would not fit one binding.
        let rows = kernels::fit_rows(gpu.pass_rows, Self::widths(&plan).widest as u64 * 4, gpu.max_binding());
        let layout = BatchLayout { rows, max_blocks: blocks, max_seqs };
        let head_records = kernels::argmax_records_per_row(&gpu, lm_head.as_ref().unwrap_or(&embd));
        let buf = Self::buffers(&gpu, &plan, blocks * KV_BLOCK, pool_tokens, layout, max_batch, head_records)?;
        let mut pool = KvPool::new(pool_tokens, KV_BLOCK, max_seqs);
        let main = pool.create()?;
        // A mixture of experts reads its `used` experts of `count` for a token.
        let expert_share = |name: &str| {
            plan.layers
                .iter()
                .find(|l| l.down == name || matches!(&l.gate_up, GateUp::Separate(gu) if gu.iter().any(|n| n == name)))
                .and_then(|l| l.experts.as_ref())
                .map_or((1, 1), |e| (e.used as u64, e.count as u64))
        };
        // The MTP head's layer is no part of a token's pass (it drafts).
        let mtp_layer = format!("blk.{}.", plan.config.n_layers);
        let all: u64 = gguf
            .tensors
            .iter()
            .filter(|t| t.name != ROPE_FREQS && !(plan.mtp.is_some() && t.name.starts_with(&mtp_layer)))
            .map(|t| {
                let (used, count) = expert_share(&t.name);
                t.byte_size / count * used
            })
            .sum();
        // An embedding table is read a row a token (the token embedding's whole table when it is
        // also the output; Gemma 4's per-layer table always a row).
        let one_row = |name: &str| -> Result<u64> {
            let e = gguf.require_tensor(name)?;
            Ok(e.byte_size - e.byte_size / e.rows().1.max(1) as u64)
        };
        let mut file_weight_bytes = all;
        if plan.output != plan.token_embd {
            file_weight_bytes -= one_row(&plan.token_embd)?;
        }
        if let Some(pe) = &plan.ple {
            file_weight_bytes -= one_row(&pe.token_embd)?;
        }
        let short_keys = plan
            .layers
            .iter()
            .filter(|l| l.attends())
            .map(|l| kernels::decode_short_keys(&gpu, &c.with_dims(&l.dims)))
            .min()
            .unwrap_or(0);
        let mut model = Self {
            config: c,
            plan,
            context,
            short_keys,
            embd,
            ple,
            output_norm,
            lm_head,
            layers,
            buf,
            decode: Vec::new(),
            decode_batch: None,
            decode_wide: None,
            round_narrow: None,
            round_wide: None,
            draft: None,
            mtp,
            mtp_passes: None,
            mtp_len: vec![0; max_seqs],
            prefill: Vec::new(),
            select: None,
            draw: None,
            argmax_masked: None,
            mask_flags: vec![0; max_batch],
            masks_flagged: false,
            all_logits: None,
            pool,
            layout,
            main,
            dirty: vec![false; max_seqs],
            copies: Vec::new(),
            row_words: Vec::with_capacity(kernels::DRAW_WORDS * rows),
            round_tokens: Vec::with_capacity(max_batch),
            params_now: Params::default(),
            row0_table: None,
            max_batch,
            block_scratch: None,
            file_weight_bytes,
            next_slot: 0,
            pipelines: PipelineCache::default(),
            gpu,
        };
        model.decode = model.record(Pass::Decode { mb: 1, layers: model.layers.len() });
        model.prefill = model.record(Pass::Prefill);
        let b = &model.buf;
        let vocab = model.config.vocab_size;
        let p = &mut model.pipelines;
        let masks = kernels::Masks { buffer: &b.masks, rows: model.max_batch };
        model.select = Some(kernels::top_k(&model.gpu, p, vocab, &b.logits, &b.top_k_want, &b.top_k_out, masks));
        model.draw = Some(kernels::draw(&model.gpu, p, vocab, &b.top_k_out, &b.draws, &b.argmax));
        model.argmax_masked =
            Some(kernels::argmax_masked(&model.gpu, p, &b.params, vocab, &b.logits, &b.argmax, masks));
        model.gpu.memory_watched(watch).await?;
        model.gpu.check()?;
        Ok(model)
    }

    /// The longest context whose context-sized buffers (see `buffers`: a layer's K or V cache,
    /// a RoPE table, decode attention's chunk records) each fit one binding.
    fn max_context(gpu: &Gpu, plan: &Plan) -> usize {
        let c = &plan.config;
        // A Gated DeltaNet layer's per-position buffers (its convolution input, its delta-rule
        // inputs) are positions of their own, each in one binding too.
        let delta = plan.layers.iter().find_map(|l| l.delta.as_ref()).map_or(0, |dn| {
            let s = &dn.shape;
            s.conv_dim().max(s.inputs()) * 4
        });
        let per_token = [c.kv_dim() * gpu.kv_bytes() as usize, c.rope_dim * 4, c.d_model * 4, delta];
        let max = gpu.max_binding() as usize;
        // The cache is whole blocks.
        let fits = per_token.iter().map(|&b| max / b.max(1)).min().unwrap_or(0) / KV_BLOCK * KV_BLOCK;
        fits.min(kernels::decode_max_context(gpu, c, max))
    }

    /// The floats of a pass row in each activation buffer `buffers` makes `rows` of.
    fn widths(plan: &Plan) -> Widths {
        let c = &plan.config;
        // A short convolution's in_proj (3 d a row) and output (d), a Gated DeltaNet's input
        // projection and output (its value heads) share q|k|v's and attention's.
        let conv = plan.layers.iter().any(|l| l.conv.is_some());
        let (mut qkv, mut attn) = match conv {
            true => ((c.q_dim() + 2 * c.kv_dim()).max(3 * c.d_model), c.q_dim().max(c.d_model)),
            false => (c.q_dim() + 2 * c.kv_dim(), c.q_dim()),
        };
        let delta = plan.layers.iter().find_map(|l| l.delta.as_ref()).map(|dn| dn.shape);
        if let Some(s) = &delta {
            qkv = qkv.max(kernels::delta_proj(s));
            attn = attn.max(s.value_dim());
        }
        // The gated FFN's width: the layers', or a mixture's shared expert's when wider.
        let shared = plan.layers.iter().filter_map(|l| l.experts.as_ref()?.shared.as_ref()).map(|sh| sh.ffn);
        let ffn = shared.fold(c.ffn_dim, usize::max);
        // The rest: a mixture's per-expert rows, the per-layer embeddings' inputs, MTP's concat.
        let experts = plan
            .layers
            .iter()
            .filter_map(|l| l.experts.as_ref())
            .map(|e| (e.used * c.ffn_dim.max(c.d_model)).max(e.count));
        let ple = plan.ple.as_ref().map_or(0, |pe| pe.width * c.n_layers);
        let others = [2 * ffn, 2 * c.d_model, ple, delta.map_or(0, |s| s.key_dim())];
        Widths { qkv, attn, ffn, widest: experts.chain(others).fold(qkv.max(attn), usize::max) }
    }

    /// `context`: a sequence's positions (whole blocks); `pool_tokens`: the KV pool's.
    fn buffers(
        gpu: &Gpu,
        plan: &Plan,
        context: usize,
        pool_tokens: usize,
        layout: BatchLayout,
        max_batch: usize,
        head_records: usize,
    ) -> Result<Buffers> {
        let c = &plan.config;
        let n = layout.rows as u64;
        let f = 4u64;
        let kv_bytes = (pool_tokens * c.kv_dim()) as u64 * gpu.kv_bytes();
        // Each attention layer's keys and values at its own size (Gemma 4's differ by layer; its
        // KV-shared layers keep none).
        let cache_per_layer = |label: &str| -> Result<Vec<wgpu::Buffer>> {
            plan.layers
                .iter()
                .map(|l| {
                    let bytes = (pool_tokens * c.with_dims(&l.dims).kv_dim()) as u64 * gpu.kv_bytes();
                    gpu.storage(label, if l.attends() && l.kv_source.is_none() { bytes } else { 16 })
                })
                .collect()
        };
        let Widths { qkv: qkv_row, attn: attn_row, ffn, .. } = Self::widths(plan);
        let delta_shape = plan.layers.iter().find_map(|l| l.delta.as_ref()).map(|dn| dn.shape);
        let slots = layout.max_seqs as u64;
        let batch = max_batch as u64;
        Ok(Buffers {
            params: gpu.uniform("params", std::mem::size_of::<Params>() as u64),
            params_decode: gpu.uniform("params_decode", std::mem::size_of::<Params>() as u64),
            params_chunks: (0..ROUND_PASSES)
                .map(|_| gpu.uniform("params_chunk", std::mem::size_of::<Params>() as u64))
                .collect(),
            batch: gpu.storage("batch", layout.words() as u64 * 4)?,
            positions: {
                let words: Vec<u32> = (0..context as u32).collect();
                gpu.storage_init("positions", bytemuck::cast_slice(&words))?
            },
            tokens: gpu.storage("tokens", n * 4)?,
            x: gpu.storage("x", n * c.d_model as u64 * f)?,
            xn: gpu.storage("xn", n * c.d_model as u64 * f)?,
            norm_sums: gpu.storage("norm_sums", kernels::feed_sums_bytes(n as usize, c.d_model))?,
            norm_scales: gpu.storage("norm_scales", n * 4)?,
            qkv: gpu.storage("qkv", n * qkv_row as u64 * f)?,
            attn: gpu.storage("attn", n * attn_row as u64 * f)?,
            gu: gpu.storage("gate_up", n * 2 * ffn as u64 * f)?,
            h: gpu.storage("ffn_hidden", n * ffn as u64 * f)?,
            proj: gpu.storage("proj", n * c.d_model as u64 * f)?,
            xq: {
                let int8 = gpu.int8 && gpu.style == KernelStyle::Gpu;
                // A decode batch's rows (rounded up to the gemv's MB), or a prefill pass's.
                let rows = max_batch.next_multiple_of(BATCH_MB as usize).max(layout.rows);
                let cols = qkv_row.max(attn_row).max(ffn);
                gpu.storage("xq", if int8 { kernels::int8_scratch_bytes(rows, cols.max(c.d_model)) } else { 16 })?
            },
            moe: match plan.layers.iter().find_map(|l| l.experts.as_ref()) {
                Some(e) => {
                    let (count, used) = (e.count as u64, e.used as u64);
                    Some(MoeBuffers {
                        shared_gate: gpu.storage("shexp_gate", n * f)?,
                        groups: kernels::MoeGroups {
                            order: gpu.storage("moe_order", n * used * 4)?,
                            starts: gpu.storage("moe_starts", (count + 1) * 4)?,
                        },
                        logits: gpu.storage("moe_logits", n * count * f)?,
                        ids: gpu.storage("moe_ids", n * used * 4)?,
                        weights: gpu.storage("moe_weights", n * used * f)?,
                        h: gpu.storage("moe_hidden", n * used * c.ffn_dim as u64 * f)?,
                        y: gpu.storage("moe_out", n * used * c.d_model as u64 * f)?,
                    })
                }
                None => None,
            },
            partials: gpu.storage(
                "attention_partials",
                (max_batch * kernels::decode_partials_len(gpu, c, context)) as u64 * f,
            )?,
            logits: gpu.storage("logits", batch * c.vocab_size as u64 * f)?,
            argmax: gpu.storage("argmax", batch * 4)?,
            argmax_records: gpu.storage("argmax_records", batch * head_records as u64 * 8)?,
            head_records,
            chain: gpu.storage("chain", batch * 4)?,
            rope: plan
                .ropes
                .iter()
                .map(|r| gpu.storage_init("rope", bytemuck::cast_slice(&kernels::rope_table(r, context))))
                .collect::<Result<_>>()?,
            k_cache: cache_per_layer("k_cache")?,
            v_cache: cache_per_layer("v_cache")?,
            conv_state: plan
                .layers
                .iter()
                .map(|l| {
                    l.conv.as_ref().map(|_| gpu.storage("conv_state", (pool_tokens * c.d_model) as u64 * f)).transpose()
                })
                .collect::<Result<_>>()?,
            delta: plan
                .layers
                .iter()
                .map(|l| {
                    l.delta
                        .as_ref()
                        .map(|dn| {
                            let s = &dn.shape;
                            let positions = pool_tokens as u64;
                            Ok::<_, Error>(DeltaBuffers {
                                conv_in: gpu.storage("delta_conv_in", positions * s.conv_dim() as u64 * f)?,
                                inputs: gpu.storage("delta_inputs", positions * s.inputs() as u64 * f)?,
                                state: gpu.storage("delta_state", slots * s.state_values() as u64 * f)?,
                                ckpt: gpu.storage("delta_ckpt", slots * s.v_heads as u64 * 4)?,
                            })
                        })
                        .transpose()
                })
                .collect::<Result<_>>()?,
            delta_q: delta_shape.map(|s| gpu.storage("delta_q", n * s.key_dim() as u64 * f)).transpose()?,
            gate: match plan.layers.iter().any(|l| l.attn_gate) {
                true => Some(gpu.storage("attn_gate", n * c.q_dim() as u64 * f)?),
                false => None,
            },
            params_none: gpu.uniform("params_none", std::mem::size_of::<Params>() as u64),
            hidden: match plan.mtp.is_some() {
                true => Some(gpu.storage("mtp_hidden", (pool_tokens * c.d_model) as u64 * f)?),
                false => None,
            },
            mtp_kv: match plan.mtp.is_some() {
                true => Some([gpu.storage("mtp_k_cache", kv_bytes)?, gpu.storage("mtp_v_cache", kv_bytes)?]),
                false => None,
            },
            mtp_rows: match plan.mtp.is_some() {
                true => Some([
                    gpu.storage("mtp_h", n * c.d_model as u64 * f)?,
                    gpu.storage("mtp_cat", n * 2 * c.d_model as u64 * f)?,
                    gpu.storage("mtp_out", n * c.d_model as u64 * f)?,
                ]),
                false => None,
            },
            ple: match &plan.ple {
                Some(pe) => {
                    let all = (pe.width * c.n_layers) as u64;
                    Some([
                        gpu.storage("ple_inputs", n * all * f)?,
                        gpu.storage("ple_proj", n * all * f)?,
                        gpu.storage("ple_gate", n * pe.width as u64 * f)?,
                    ])
                }
                None => None,
            },
            staging_argmax: [gpu.readback("staging_argmax", batch * 4), gpu.readback("staging_argmax", batch * 4)],
            staging_logits: gpu.readback("staging_logits", batch * c.vocab_size as u64 * f),
            top_k_want: gpu.storage("top_k_want", batch * 8)?,
            top_k_out: gpu.storage("top_k_out", batch * kernels::TOP_K_WORDS as u64 * 4)?,
            draws: gpu.storage("draws", batch * kernels::DRAW_WORDS as u64 * 4)?,
            staging_top_k: gpu.readback("staging_top_k", batch * (1 + kernels::TOP_K_WORDS) as u64 * 4),
            masks: gpu.storage("masks", kernels::masks_bytes(c.vocab_size, max_batch))?,
        })
    }

    /// The whole forward pass as dispatches: prefill (tiled gemm, flash attention) or decode
    /// (gemv, single-query attention, fused gated activation).
    fn record(&mut self, pass: Pass<'_>) -> Vec<Dispatch> {
        let (mb, layers) = match pass {
            Pass::Decode { mb, layers } => (mb, layers),
            Pass::Round { tiled: false } => (BATCH_MB, self.layers.len()),
            _ => (1, self.layers.len()),
        };
        // Attention over a prompt chunk (and its last row's logits), or each row's own.
        let prefill = matches!(pass, Pass::Prefill | Pass::AllLogits(_) | Pass::Mtp { .. });
        let mtp_pass = matches!(pass, Pass::Mtp { .. });
        let round = matches!(pass, Pass::Round { .. });
        // Tiled matrix products for every projection, or matrix-vector products.
        let tiled = !matches!(pass, Pass::Decode { .. } | Pass::Round { tiled: false });
        let max_rows = self.max_batch;
        let layout = self.layout;
        // Self-speculation's draft pass (its first layers): a Gated DeltaNet's state keeps none of it.
        let commit = layers == self.layers.len();
        let (gpu, c, plan, b, p) = (&self.gpu, &self.config, &self.plan, &self.buf, &mut self.pipelines);
        // The params whose row count is a pass's decode rows (a Gated DeltaNet commits their
        // first row of each run, and a prompt chunk's last row).
        let decode_rows = match pass {
            Pass::Round { .. } => &b.params_decode,
            Pass::Prefill | Pass::AllLogits(_) | Pass::Mtp { .. } => &b.params_none,
            Pass::Decode { .. } | Pass::WideDecode => &b.params,
        };
        let (params, eps, act) = (&b.params, c.rms_eps, plan.activation);
        let xq = Some(&b.xq);
        let gb = GemvBatch { params, mb, xq };
        // The gemms' int8 scratch: a pass's rows (`buffers` sizes it for them).
        let xs = Some(kernels::Int8Scratch { buffer: &b.xq, rows: layout.rows });
        let embed_scale = plan.embed_scale.unwrap_or(1.0);
        let mut ops = Vec::new();
        // The MTP head's input rows: eh_proj(enorm(embedding) | hnorm(hidden state)) into x.
        let mtp = match (pass, &self.mtp, &plan.mtp, &b.hidden, &b.mtp_rows) {
            (Pass::Mtp { chained }, Some(m), Some(pm), Some(hidden), Some([h, cat, _])) => {
                let d = c.d_model;
                ops.extend(kernels::embed(
                    gpu,
                    p,
                    params,
                    m.embed.as_ref().unwrap_or(&self.embd),
                    1.0,
                    &b.tokens,
                    &b.x,
                ));
                ops.push(kernels::rms_norm(gpu, p, params, d, eps, NormOut::Store, &b.x, &m.enorm, &b.xn));
                if !chained {
                    ops.push(kernels::hidden(gpu, p, params, d, eps, true, &b.x, &m.hnorm, hidden, h, &b.batch));
                }
                ops.push(kernels::rms_norm(gpu, p, params, d, eps, NormOut::Store, h, &m.hnorm, &b.proj));
                ops.push(kernels::concat_rows(gpu, p, params, d, &b.xn, &b.proj, cat));
                ops.extend(kernels::gemm(gpu, p, params, xs, &m.eh_proj, Epilogue::Store, cat, &b.x, d));
                Some((m, pm))
            }
            _ => None,
        };
        if mtp.is_none() {
            ops.extend(kernels::embed(gpu, p, params, &self.embd, embed_scale, &b.tokens, &b.x));
        }
        // Gemma 4's per-layer inputs, from the tokens and the scaled embeddings.
        let ple = match (&self.ple, &b.ple, &plan.ple) {
            _ if mtp_pass => None,
            (Some((table, model_proj, norm)), Some([inputs, proj, _]), Some(pe)) => {
                let all = pe.width * c.n_layers;
                ops.extend(kernels::embed(gpu, p, params, table, (pe.width as f32).sqrt(), &b.tokens, inputs));
                if tiled {
                    ops.extend(kernels::gemm(gpu, p, params, xs, model_proj, Epilogue::Store, &b.x, proj, all));
                } else {
                    ops.extend(kernels::gemv(gpu, p, gb, model_proj, act, Epilogue::Store, None, &b.x, proj, all));
                }
                ops.push(kernels::ple_inputs(gpu, p, params, c.n_layers, pe.width, c.d_model, eps, proj, inputs, norm));
                Some(pe.width)
            }
            _ => None,
        };
        // A decode pass folds each pre-norm's pass into the matrix-vector products around it (a
        // dispatch less a norm). On GPUs each workgroup of the product that reads it sums x's
        // squares itself (`NormIn::Fused`). On CPU adapters, where that costs a tenth of the
        // decode speed, the residual product that wrote x writes the next product's input and
        // its sums of squares as well (`kernels::Feed`, `NormIn::Fed`), wherever x comes straight
        // from one: not into the first layer, nor past a bias, a post-norm, Gemma 4's per-layer
        // input, a layer's output scale or a mixture of experts.
        let fuse = !tiled && gpu.style == KernelStyle::Gpu;
        // (A gemv adds a fed norm's sums for one batch row a pass: MB 1, a sequence's step.)
        let feeds = !tiled && gpu.style == KernelStyle::Cpu && mb == 1;
        let input = if fuse { &b.x } else { &b.xn };
        let output_norm = &self.output_norm;
        // Whether the product before fed the next norm (`feeds`).
        let mut fed = false;
        // The RMSNorm (its `weights`) ahead of the products that read it, with the pass's `params`
        // (its last token's row alone with `last_only`): fused into them; fed, by the residual
        // product before (`fed`) or by a pass of its own (CPU-style kernels, tiled or not, so
        // that a row gets the same bits in a gemv and in a gemm, alone or in a batch); or a plain
        // pass of its own into xn.
        let cpu = gpu.style == KernelStyle::Cpu;
        let norm_ahead = |ops: &mut Vec<Dispatch>, p: &mut PipelineCache, params, last_only, weights, fed: bool| {
            if fuse {
                return Some(NormIn::Fused(weights, eps));
            }
            let d = c.d_model;
            if cpu && fed {
                return Some(NormIn::Fed { sums: &b.norm_sums, eps });
            }
            if cpu {
                let (sums, scales) = (&b.norm_sums, &b.norm_scales);
                ops.push(kernels::rms_norm_feed(gpu, p, params, d, eps, last_only, &b.x, weights, &b.xn, sums, scales));
                return Some(NormIn::Scaled { scales });
            }
            let out = if last_only { NormOut::StoreLast } else { NormOut::Store };
            ops.push(kernels::rms_norm(gpu, p, params, d, eps, out, &b.x, weights, &b.xn));
            None
        };
        let model_config = c;
        // The pass's layers: the model's first `layers`, or the MTP head's (numbered after them).
        let list: Vec<(usize, &LayerWeights, &crate::arch::LayerPlan)> = match mtp {
            Some((m, pm)) => vec![(plan.layers.len(), &m.layer, &pm.layer)],
            None => {
                self.layers.iter().zip(&plan.layers).enumerate().take(layers).map(|(i, (l, lp))| (i, l, lp)).collect()
            }
        };
        for (k, &(i, l, lp)) in list.iter().enumerate() {
            // The layer's own head size, KV heads and FFN width (Gemma 4's differ by layer).
            let layer_config = model_config.with_dims(&lp.dims);
            let c = &layer_config;
            let qkv_stride = c.q_dim() + 2 * c.kv_dim();
            // Gemma 4's KV-shared layers read an earlier layer's cache; the MTP head its own.
            let source = lp.kv_source.unwrap_or(i);
            let (kc, vc) = match (&b.mtp_kv, mtp_pass) {
                (Some([k, v]), true) => (k, v),
                _ => (&b.k_cache[source], &b.v_cache[source]),
            };
            let rope = &plan.ropes[lp.rope];
            let kind = AttentionKind::of(plan, lp);
            let sinks = l.sinks.as_ref();
            let extras = QkvExtras {
                bias: l.qkv_bias.as_ref(),
                qk_norm: l.qk_norm.as_ref().map(|n| (n, eps)),
                v_norm: lp.v_norm.then_some(eps),
                q_only: lp.kv_source.is_some(),
            };
            // A projection into the residual stream (plus its bias, where it has one): added to
            // x, or through its post-norm first; or added and feeding the norm with weights
            // `feed` (none of the others).
            let residual = |ops: &mut Vec<Dispatch>,
                            p: &mut PipelineCache,
                            w: &Linear,
                            bias: Option<&wgpu::Buffer>,
                            x: &wgpu::Buffer,
                            post: &Option<wgpu::Buffer>,
                            feed: Option<&wgpu::Buffer>| {
                let (epilogue, out) = if post.is_some() { (Epilogue::Store, &b.proj) } else { (Epilogue::Add, &b.x) };
                if tiled {
                    ops.extend(kernels::gemm(gpu, p, params, xs, w, epilogue, x, out, c.d_model));
                } else if let Some(weights) = feed {
                    let feed = Feed { weights, x: &b.xn, sums: &b.norm_sums };
                    ops.extend(kernels::gemv_feeding(gpu, p, gb, w, feed, x, out, c.d_model));
                } else {
                    ops.extend(kernels::gemv(gpu, p, gb, w, act, epilogue, None, x, out, c.d_model));
                }
                if let Some(bias) = bias {
                    ops.push(kernels::bias_add(gpu, p, params, c.d_model, out, bias));
                }
                if let Some(post) = post {
                    ops.push(kernels::rms_norm(gpu, p, params, c.d_model, eps, NormOut::Add, &b.proj, post, &b.x));
                }
            };
            // The norms ahead of the attention and the FFN, and whether the projection before
            // each feeds it: o, into a dense FFN; down, into the next layer (or the LM head).
            let pre_norm = |ops: &mut Vec<Dispatch>, p: &mut PipelineCache, weights, fed| {
                norm_ahead(ops, p, params, false, weights, fed)
            };
            let attn_norm = pre_norm(&mut ops, p, &l.attn_norm, std::mem::take(&mut fed));
            // A product of the normed input (`norm`: the norm ahead's) into `y`, rows of `stride`.
            let normed = |ops: &mut Vec<Dispatch>, p: &mut PipelineCache, w, norm, y, stride| {
                let store = Epilogue::Store;
                if tiled {
                    ops.extend(kernels::gemm_normed(gpu, p, params, xs, w, store, gemm_scales(norm), &b.xn, y, stride));
                } else {
                    ops.extend(kernels::gemv(gpu, p, gb, w, act, store, norm, input, y, stride));
                }
            };
            let o_feeds = feeds && l.wo_bias.is_none() && l.post_attn_norm.is_none() && lp.experts.is_none();
            let o_feed = o_feeds.then_some(&l.ffn_norm);
            let down_feed = match list.get(k + 1) {
                Some((_, next, _)) => Some(&next.attn_norm),
                None => matches!(pass, Pass::Decode { .. }).then_some(output_norm),
            }
            .filter(|_| feeds && l.post_ffn_norm.is_none() && l.ple.is_none() && l.out_scale.is_none());
            let (delta_buffers, conv_state) =
                (b.delta.get(i).and_then(Option::as_ref), b.conv_state.get(i).and_then(Option::as_ref));
            if let (Some(dn), Some(dw), Some(db), Some(dq)) = (&lp.delta, &l.delta, delta_buffers, &b.delta_q) {
                // Qwen3.5's Gated DeltaNet: q|k|v, z, b and alpha in one projection (in `qkv`);
                // the convolution and norms; the delta rule over each run of a sequence's rows;
                // the gated norm; the output projection.
                let s = &dn.shape;
                normed(&mut ops, p, &l.qkv, attn_norm, &b.qkv, kernels::delta_proj(s));
                let (conv_in, inputs) = (&db.conv_in, &db.inputs);
                let prep = kernels::delta_prep(
                    gpu,
                    p,
                    params,
                    s,
                    &b.qkv,
                    conv_in,
                    &dw.taps,
                    inputs,
                    dq,
                    &dw.dt_bias,
                    &dw.a,
                    &b.batch,
                );
                ops.extend(prep);
                let (state, ckpt) = (&db.state, &db.ckpt);
                // A round: its prompt chunks' runs, then its decode rows' (a prompt's last token
                // may be a decode row beside the rest of it in a chunk).
                let phases: &[u32] = if round { &[1, 2] } else { &[0] };
                for &phase in phases {
                    ops.push(kernels::delta_scan(
                        gpu,
                        p,
                        params,
                        decode_rows,
                        s,
                        layout,
                        commit,
                        phase,
                        inputs,
                        dq,
                        &b.attn,
                        state,
                        ckpt,
                        &b.batch,
                    ));
                }
                ops.push(kernels::delta_out(gpu, p, params, s, eps, &b.attn, &b.qkv, &dw.norm));
                residual(&mut ops, p, &l.wo, None, &b.attn, &l.post_attn_norm, o_feed);
            } else if let (Some(sc), Some(state), Some(taps)) = (&lp.conv, conv_state, &l.conv_taps) {
                // LFM2's short convolution: in_proj (in `qkv`) to B, C, x; B * x into the
                // layer's state at each row's position; C * its convolution into `attn`.
                let d = c.d_model;
                normed(&mut ops, p, &l.qkv, attn_norm, &b.qkv, 3 * d);
                ops.extend(kernels::short_conv(gpu, p, params, d, sc.kernel, &b.qkv, state, taps, &b.attn, &b.batch));
                residual(&mut ops, p, &l.wo, None, &b.attn, &l.post_attn_norm, o_feed);
            } else {
                // Decode hands RoPE and the cache write to the projection's epilogue where it can:
                // one dispatch less a layer. A CPU adapter's invocation holds both rows of a pair
                // (gemv.wgsl's cpu_rows), so its epilogue needs no barrier (lavapipe, 2026-12-06:
                // the same decode speed, 5% less host time a step).
                let fold =
                    RopeKvFold { config: c, rope, batch: &b.batch, table: &b.rope[lp.rope], k_cache: kc, v_cache: vc };
                let folded = !tiled && fold.applies(&extras, &l.qkv);
                if folded {
                    ops.extend(kernels::gemv_rope_kv(gpu, p, gb, &l.qkv, &fold, attn_norm, input, &b.qkv, qkv_stride));
                } else {
                    normed(&mut ops, p, &l.qkv, attn_norm, &b.qkv, qkv_stride);
                }
                if let (Some(w), Some(gate)) = (&l.attn_gate, &b.gate) {
                    // Gated attention's gate, from the same input as q.
                    normed(&mut ops, p, w, attn_norm, gate, c.q_dim());
                }
                if !folded {
                    let table = &b.rope[lp.rope];
                    ops.push(kernels::rope_kv(gpu, p, params, c, rope, extras, &b.qkv, table, kc, vc, &b.batch));
                }
                if prefill {
                    let op =
                        kernels::attention_prefill(gpu, p, params, c, kind, &b.qkv, kc, vc, &b.attn, &b.batch, sinks);
                    ops.push(op);
                } else {
                    // Each decode row its own sequence's keys (a round's decode rows; every row of a
                    // decode step, where the decode segment is all of them).
                    let decode = kernels::attention_decode(
                        gpu,
                        p,
                        c,
                        kind,
                        self.context,
                        self.short_keys > 0,
                        &b.qkv,
                        kc,
                        vc,
                        &b.partials,
                        &b.attn,
                        &b.batch,
                        sinks,
                    );
                    ops.extend(decode);
                    // A round's prompt chunks: flash attention over each chunk's own rows.
                    for (k, chunk) in b.params_chunks.iter().enumerate().take(if round { ROUND_PASSES - 1 } else { 0 })
                    {
                        let op = kernels::attention_prefill(
                            gpu, p, chunk, c, kind, &b.qkv, kc, vc, &b.attn, &b.batch, sinks,
                        );
                        ops.push(op.on(Segment::Chunk(k as u8)));
                    }
                }
                if let Some(gate) = b.gate.as_ref().filter(|_| l.attn_gate.is_some()) {
                    ops.push(kernels::gate_mul(gpu, p, params, c.q_dim(), &b.attn, gate));
                }
                residual(&mut ops, p, &l.wo, l.wo_bias.as_ref(), &b.attn, &l.post_attn_norm, o_feed);
            }

            if let (Some(e), Some(m), Some(router)) = (&lp.experts, &b.moe, &l.router) {
                // A mixture of experts: the router's logits, each token's choice, the chosen
                // experts' gated FFNs (their rows alone read), their weighted sum.
                ops.push(kernels::rms_norm(gpu, p, params, c.d_model, eps, NormOut::Store, &b.x, &l.ffn_norm, &b.xn));
                if tiled {
                    ops.extend(kernels::gemm(gpu, p, params, xs, router, Epilogue::Store, &b.xn, &m.logits, e.count));
                } else {
                    ops.extend(kernels::gemv(
                        gpu,
                        p,
                        gb,
                        router,
                        act,
                        Epilogue::Store,
                        None,
                        &b.xn,
                        &m.logits,
                        e.count,
                    ));
                }
                let rb = l.router_bias.as_ref();
                ops.push(kernels::moe_route(gpu, p, params, e, &m.logits, rb, &m.ids, &m.weights));
                let (f, d) = (c.ffn_dim, c.d_model);
                let (gub, db) = (l.expert_biases.as_ref().map(|b| &b.0), l.expert_biases.as_ref().map(|b| &b.1));
                // A pass of several tokens reads each chosen expert's rows once for all of them.
                let grouped = (!matches!(pass, Pass::Decode { mb: 1, .. })).then_some(&m.groups);
                if let Some(g) = grouped {
                    ops.push(kernels::moe_group(gpu, p, params, e, &m.ids, g));
                }
                let gu = &l.gate_up;
                let up_gemv =
                    kernels::moe_gemv(gpu, p, params, e, gu, f, true, act, true, gub, &b.xn, &m.ids, &m.h, grouped);
                ops.push(up_gemv);
                let dn = &l.w_down;
                ops.push(kernels::moe_gemv(
                    gpu, p, params, e, dn, d, false, act, false, db, &m.h, &m.ids, &m.y, grouped,
                ));
                let post = &l.post_ffn_norm;
                let out = if post.is_some() { &b.proj } else { &b.x };
                ops.push(kernels::moe_combine(gpu, p, params, e, d, post.is_none(), &m.y, &m.weights, out));
                if let Some(post) = post {
                    ops.push(kernels::rms_norm(gpu, p, params, d, eps, NormOut::Add, &b.proj, post, &b.x));
                }
                if let (Some(sh), Some([gate_up, down, gate])) = (&e.shared, &l.shared) {
                    // The shared expert: its gated FFN into `proj`, added times sigmoid(gate . x).
                    let f = sh.ffn;
                    let pairs = gate_up.parts.iter().all(|part| part.pair);
                    if tiled {
                        ops.extend(kernels::gemm(gpu, p, params, xs, gate_up, Epilogue::Store, &b.xn, &b.gu, 2 * f));
                        ops.push(kernels::act_mul(gpu, p, params, act, f, &b.gu, &b.h));
                        ops.extend(kernels::gemm(gpu, p, params, xs, down, Epilogue::Store, &b.h, &b.proj, d));
                        ops.extend(kernels::gemm(gpu, p, params, xs, gate, Epilogue::Store, &b.xn, &m.shared_gate, 1));
                    } else {
                        let (out, stride) = if pairs { (&b.h, f) } else { (&b.gu, 2 * f) };
                        ops.extend(kernels::gemv(gpu, p, gb, gate_up, act, Epilogue::Store, None, &b.xn, out, stride));
                        if !pairs {
                            ops.push(kernels::act_mul(gpu, p, params, act, f, &b.gu, &b.h));
                        }
                        ops.extend(kernels::gemv(gpu, p, gb, down, act, Epilogue::Store, None, &b.h, &b.proj, d));
                        ops.extend(kernels::gemv(
                            gpu,
                            p,
                            gb,
                            gate,
                            act,
                            Epilogue::Store,
                            None,
                            &b.xn,
                            &m.shared_gate,
                            1,
                        ));
                    }
                    ops.push(kernels::sigmoid_add(gpu, p, params, d, &b.x, &b.proj, &m.shared_gate));
                }
                continue;
            }
            let ffn_norm = pre_norm(&mut ops, p, &l.ffn_norm, o_feed.is_some());
            // A gemv of gated pairs writes act(gate) * up; a gemm, or parts not paired, gate and up.
            let pairs = !tiled && l.gate_up.parts.iter().all(|part| part.pair);
            let (out, stride) = if pairs { (&b.h, c.ffn_dim) } else { (&b.gu, 2 * c.ffn_dim) };
            normed(&mut ops, p, &l.gate_up, ffn_norm, out, stride);
            if !pairs {
                ops.push(kernels::act_mul(gpu, p, params, act, c.ffn_dim, &b.gu, &b.h));
            }
            residual(&mut ops, p, &l.w_down, None, &b.h, &l.post_ffn_norm, down_feed);
            fed = down_feed.is_some();
            if let (Some((gate, proj, post)), Some(width), Some([inputs, _, g])) = (&l.ple, ple, &b.ple) {
                // Gemma 4's per-layer embedding: GELU(inp_gate x) times the layer's inputs,
                // through proj and its norm, added to x.
                let d = c.d_model;
                if tiled {
                    ops.extend(kernels::gemm(gpu, p, params, xs, gate, Epilogue::Store, &b.x, g, width));
                } else {
                    ops.extend(kernels::gemv(gpu, p, gb, gate, act, Epilogue::Store, None, &b.x, g, width));
                }
                ops.push(kernels::ple_gate(gpu, p, params, act, c.n_layers, width, i, g, inputs));
                if tiled {
                    ops.extend(kernels::gemm(gpu, p, params, xs, proj, Epilogue::Store, g, &b.proj, d));
                } else {
                    ops.extend(kernels::gemv(gpu, p, gb, proj, act, Epilogue::Store, None, g, &b.proj, d));
                }
                ops.push(kernels::rms_norm(gpu, p, params, d, eps, NormOut::Add, &b.proj, post, &b.x));
            }
            if let Some(scale) = &l.out_scale {
                ops.push(kernels::scale_rows(gpu, p, params, c.d_model, &b.x, scale));
            }
        }
        let c = model_config;
        let head = self.lm_head.as_ref().unwrap_or(&self.embd);
        let vocab = c.vocab_size;
        if let (Some((m, _)), Some([_, _, out])) = (mtp, &b.mtp_rows) {
            // The MTP head's output: every row's normed hidden state (a chained draft reads the
            // last), the last row's logits and argmax.
            let d = c.d_model;
            ops.push(kernels::rms_norm(gpu, p, params, d, eps, NormOut::Store, &b.x, &m.head_norm, out));
            ops.push(kernels::rms_norm(gpu, p, params, d, eps, NormOut::StoreLast, &b.x, &m.head_norm, &b.xn));
            let head = m.head.as_ref().unwrap_or(head);
            ops.extend(kernels::gemv(gpu, p, gb, head, act, Epilogue::Store, None, &b.xn, &b.logits, vocab));
            ops.extend(
                plan.final_softcap
                    .map(|cap| kernels::softcap_rows(gpu, p, params, vocab, cap, false, &b.logits, max_rows)),
            );
            ops.push(kernels::argmax(gpu, p, params, vocab, &b.logits, &b.argmax, max_rows));
            return ops;
        }
        if let (Some(hidden), Some([h, _, _]), true) = (&b.hidden, &b.mtp_rows, commit) {
            // With an MTP head: every row's final hidden state kept at its position.
            let d = c.d_model;
            ops.push(kernels::hidden(gpu, p, params, d, eps, false, &b.x, &self.output_norm, hidden, h, &b.batch));
        }
        let vocab = c.vocab_size;
        // Final-logit soft-capping (Gemma 2) of the rows the LM head wrote.
        let cap = |p: &mut PipelineCache, params: &wgpu::Buffer, all: bool, logits: &wgpu::Buffer, rows: usize| {
            plan.final_softcap.map(|cap| kernels::softcap_rows(gpu, p, params, vocab, cap, all, logits, rows))
        };
        // The LM head's logits of the pass's rows (normed with `norm`, or normed already) and
        // their argmax: its first pass in the gemv's epilogue and a pass over the records, or,
        // with soft-capped logits, a pass over them all after the cap.
        let lm_head_argmax = |p: &mut PipelineCache, gb: GemvBatch, norm, x| {
            let params = gb.params;
            let mut ops = Vec::new();
            if plan.final_softcap.is_some() {
                ops.extend(kernels::gemv(gpu, p, gb, head, act, Epilogue::Store, norm, x, &b.logits, vocab));
                ops.extend(cap(p, params, false, &b.logits, max_rows));
                ops.push(kernels::argmax(gpu, p, params, vocab, &b.logits, &b.argmax, max_rows));
            } else {
                let records = kernels::ArgmaxRecords { buffer: &b.argmax_records, per_row: b.head_records };
                ops.extend(kernels::gemv_argmax(gpu, p, gb, head, records, norm, x, &b.logits, vocab));
                ops.push(kernels::argmax_records(gpu, p, params, records, &b.argmax, max_rows));
            }
            ops
        };
        // The LM head as a tiled product of the normed rows (`norm`: the norm ahead's) into `logits`.
        let head_gemm = |p: &mut PipelineCache, params, norm, logits| {
            kernels::gemm_normed(gpu, p, params, xs, head, Epilogue::Store, gemm_scales(norm), &b.xn, logits, vocab)
        };
        if let Pass::AllLogits(logits) = pass {
            let norm = norm_ahead(&mut ops, p, params, false, output_norm, fed);
            ops.extend(head_gemm(p, params, norm, logits));
            ops.extend(cap(p, params, true, logits, layout.rows));
            return ops;
        }
        if round {
            // The decode rows alone (the first ones): their norm, logits and argmax.
            let pd = &b.params_decode;
            let on = |ops: Vec<Dispatch>| ops.into_iter().map(|op| op.on(Segment::Decode));
            let mut norm_ops = Vec::new();
            let norm = norm_ahead(&mut norm_ops, p, pd, false, output_norm, fed);
            ops.extend(on(norm_ops));
            if tiled {
                ops.extend(on(head_gemm(p, pd, norm, &b.logits)));
                ops.extend(cap(p, pd, false, &b.logits, max_rows).map(|op| op.on(Segment::Decode)));
                ops.push(kernels::argmax(gpu, p, pd, vocab, &b.logits, &b.argmax, max_rows).on(Segment::Decode));
            } else {
                let gd = GemvBatch { params: pd, mb, xq: Some(&b.xq) };
                ops.extend(on(lm_head_argmax(p, gd, norm, input)));
            }
            return ops;
        }
        if matches!(pass, Pass::WideDecode) {
            let norm = norm_ahead(&mut ops, p, params, false, output_norm, fed);
            ops.extend(head_gemm(p, params, norm, &b.logits));
            ops.extend(cap(p, params, false, &b.logits, max_rows));
            ops.push(kernels::argmax(gpu, p, params, vocab, &b.logits, &b.argmax, max_rows));
            return ops;
        }
        // Prefill takes the last token's row; decode every row of the batch.
        let norm = norm_ahead(&mut ops, p, params, prefill, output_norm, fed);
        ops.extend(lm_head_argmax(p, gb, norm, input));
        ops
    }

    /// The dispatches of a decode step at `seq` keys.
    fn decode_ops(&self, seq: usize) -> impl Iterator<Item = &Dispatch> {
        let rows = SegmentRows::at_keys(1, seq, self.short_keys);
        self.decode.iter().filter(move |op| rows.of(op.groups.segment) > 0)
    }

    /// Dispatches in one decode step at `seq` keys.
    pub fn decode_dispatches(&self, seq: usize) -> usize {
        self.decode_ops(seq).count()
    }

    /// The traffic ledger of a decode step at `seq` keys: what its dispatches declare they move.
    pub fn decode_traffic(&self, seq: usize) -> Ledger {
        self.decode_ops(seq).map(|op| op.traffic.at(seq)).sum()
    }

    /// The least any decode step at `seq` keys moves: the file's weight bytes once, each layer's
    /// keys and values attended read once and the new token's written once, and the vectors a
    /// fully fused step still writes once (q, k, v, the attention output, each residual update,
    /// the gated FFN's hidden vector, the logits).
    pub fn min_decode_traffic(&self, seq: usize) -> Ledger {
        let c = &self.config;
        // Each attention layer at its own size (Gemma 4's differ): its keys and values read (a
        // KV-shared layer's from its source), written (its own alone), and its vectors.
        let kv_row = |l: &crate::arch::LayerPlan| 2 * c.with_dims(&l.dims).kv_dim() as u64 * self.gpu.kv_bytes();
        let attention = self.plan.layers.iter().filter(|l| l.attends());
        let kv_read = attention.clone().map(|l| kv_row(l) * l.window.map_or(seq, |w| seq.min(w)) as u64).sum();
        let kv_written = attention.clone().filter(|l| l.kv_source.is_none()).map(kv_row).sum();
        let attention_vectors: usize = attention
            .map(|l| {
                let lc = c.with_dims(&l.dims);
                let kv = if l.kv_source.is_some() { 0 } else { 2 * lc.kv_dim() };
                (lc.q_dim() + kv) + lc.q_dim() + 2 * c.d_model + lc.ffn_dim
            })
            .sum();
        // A short convolution's layer: in_proj's 3 d, the state written and the last `kernel`
        // positions' read, C times the convolution, and the rest as an attention layer's.
        let conv_layers: usize = self
            .plan
            .layers
            .iter()
            .filter_map(|l| l.conv.as_ref())
            .map(|sc| 3 * c.d_model + (1 + sc.kernel) * c.d_model + c.d_model + 2 * c.d_model + c.ffn_dim)
            .sum();
        // A Gated DeltaNet's layer: its projection, the convolution input written and the last
        // `kernel` positions' read, the delta-rule inputs written and read, the state read and
        // written, q and its output, the gated norm's, and the rest as an attention layer's.
        let delta_layers: usize = self
            .plan
            .layers
            .iter()
            .filter_map(|l| l.delta.as_ref().map(|dn| dn.shape))
            .map(|s| {
                kernels::delta_proj(&s)
                    + (1 + s.kernel) * s.conv_dim()
                    + 2 * s.inputs()
                    + 2 * s.state_values()
                    + s.key_dim()
                    + 2 * s.value_dim()
                    + 2 * c.d_model
                    + c.ffn_dim
            })
            .sum();
        Ledger {
            weights: self.file_weight_bytes,
            activations: 4 * (attention_vectors + conv_layers + delta_layers + c.vocab_size) as u64,
            kv_read,
            kv_written,
        }
    }

    /// The sequence `step` and `submit_greedy` run in (a single sequence driven by hand: the
    /// kernel and golden tests, `bench --profile`); the batch runtime makes, forks and frees
    /// its own.
    pub fn main_sequence(&self) -> SeqId {
        self.main
    }

    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// GPU memory of the KV cache (every attention layer's K and V) and of a hybrid's
    /// recurrent state (LFM2's short convolutions' B * x; a Gated DeltaNet's convolution and
    /// delta-rule inputs per position and its sequence slots' states), for the whole pool.
    pub fn cache_bytes(&self) -> (u64, u64) {
        let b = &self.buf;
        let layers = self.plan.layers.iter().enumerate();
        let kv = layers.clone().filter(|(_, l)| l.attends()).map(|(i, _)| b.k_cache[i].size() + b.v_cache[i].size());
        let delta = b.delta.iter().flatten().map(|d| d.conv_in.size() + d.inputs.size() + d.state.size());
        let state = b.conv_state.iter().flatten().map(|s| s.size()).chain(delta);
        (kv.sum(), state.sum())
    }

    /// The model has a multi-token-prediction head (Qwen3.5's) to draft with.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Decode rows one step takes at most.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Rows a pass takes at most: the longest prompt chunk a step runs (`Gpu::pass_rows`, fewer
    /// where this model's activations would not fit a binding).
    pub fn pass_rows(&self) -> usize {
        self.layout.rows
    }

    pub fn new_sequence(&mut self) -> Result<SeqId> {
        let seq = self.pool.create()?;
        self.mark_dirty(seq);
        self.reset_state(seq);
        Ok(seq)
    }

    /// A sequence slot changed hands (or was made): its table is uploaded before its next pass,
    /// and a Gated DeltaNet's state in the slot counts no position (the next pass replays its
    /// positions from the inputs its blocks keep: a fork's, a cached prefix's).
    fn mark_dirty(&mut self, seq: SeqId) {
        if let Some(d) = self.dirty.get_mut(seq.0) {
            *d = true;
        }
    }

    fn reset_state(&mut self, seq: SeqId) {
        if let Some(n) = self.mtp_len.get_mut(seq.0) {
            *n = 0;
        }
        for (db, l) in self.buf.delta.iter().zip(&self.plan.layers) {
            if let (Some(db), Some(dn)) = (db, &l.delta) {
                let heads = dn.shape.v_heads;
                let zeros = vec![0u32; heads];
                self.gpu.queue.write_buffer(&db.ckpt, (seq.0 * heads * 4) as u64, bytemuck::cast_slice(&zeros));
            }
        }
    }

    /// A new sequence sharing the first `len` positions of `seq` (no copy until one writes).
    pub fn fork_sequence(&mut self, seq: SeqId, len: usize) -> Result<SeqId> {
        let fork = self.pool.fork(seq, len)?;
        self.mark_dirty(fork);
        self.reset_state(fork);
        Ok(fork)
    }

    /// A new sequence holding the longest prefix of `tokens` the pool's prefix cache has, in
    /// whole blocks (`KvPool::create_cached`): its id and length.
    pub fn new_sequence_cached(&mut self, tokens: &[u32]) -> Result<(SeqId, usize)> {
        let (seq, len) = self.pool.create_cached(tokens)?;
        self.mark_dirty(seq);
        self.reset_state(seq);
        Ok((seq, len))
    }

    /// Registers `seq`'s full blocks among its first `tokens.len()` positions (whose keys and
    /// values it holds) in the prefix cache (`KvPool::commit`).
    pub fn commit_sequence(&mut self, seq: SeqId, tokens: &[u32]) {
        self.pool.commit(seq, tokens);
    }

    /// Frees the prefix cache's blocks that no sequence holds.
    pub fn forget_cached(&mut self) {
        self.pool.evict_cached();
    }

    pub fn free_sequence(&mut self, seq: SeqId) {
        self.pool.free(seq);
    }

    /// Keeps the first `len` positions of `seq` (the rest of its blocks go back to the pool).
    pub fn truncate_sequence(&mut self, seq: SeqId, len: usize) {
        self.pool.truncate(seq, len);
        self.mark_dirty(seq);
        if let Some(n) = self.mtp_len.get_mut(seq.0) {
            *n = (*n).min(len);
        }
    }
}

/// A tiled product's fed norm: the scales its pass wrote (a tiled pass's norms are passes of
/// their own, `kernels::rms_norm_feed`; None where x is read as it is).
fn gemm_scales(norm: Option<NormIn<'_>>) -> Option<&wgpu::Buffer> {
    norm.map(|n| match n {
        NormIn::Scaled { scales } => scales,
        _ => unreachable!("a gemm's norm is a pass of its own"),
    })
}
