//! The forward pass on the GPU, read top to bottom as a list of named dispatches per layer.
//! The weights, KV cache, activations and the decode and prefill passes' pipelines and bind
//! groups are created at load; the batched decode pass, self-speculation's draft pass, the
//! all-logits pass and a copy-on-write scratch block on first use. A step sets a 16-byte
//! uniform (a decode step copies it from a table made at load) and the token ids, encodes the
//! recorded dispatches in one compute pass, submits once, and reads back 4 bytes (greedy), the
//! largest logits (sampling on the GPU's selection) or all of them; a batcher round
//! (`submit_round`) encodes its prefill chunks and its decode step in one submission.

use super::kernels::{
    self, BatchLayout, Dispatch, Epilogue, GemvBatch, Ledger, NormOut, Params, QkvExtras, RopeKvFold, KV_BLOCK,
    MAX_BATCH, MAX_ROWS,
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
use crate::sampling::{Sampler, Tail};

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

/// Tokens per prefill pass; longer prompts run in several passes.
pub const PREFILL_CHUNK: usize = kernels::MAX_ROWS;

/// Sequences the pool holds at once: a full batch, and as many again for beam search's forks
/// (made before the beams they replace are freed), and the engine's conversation.
pub const MAX_SEQS: usize = 2 * MAX_BATCH + 1;

/// Batch rows per pass over the weights in a batched decode step (gemv.wgsl's MB).
const BATCH_MB: u32 = 8;

/// Passes one round (`GpuModel::submit_round`) holds at most: prefill chunks and the decode step.
pub const ROUND_PASSES: usize = 8;

/// Words of a pass's region of the uploads buffer: its tokens, its rows' (position, table)
/// words, its params.
const UPLOAD_WORDS: usize = 3 * MAX_ROWS + 4;

/// What a step reads back.
#[derive(Debug, PartialEq)]
pub enum Readback<'a> {
    /// Nothing (an intermediate prefill chunk).
    None,
    /// The argmax of the last position's logits (4 bytes).
    Argmax,
    /// The last position's logits, into the given slice (vocab values).
    Logits(&'a mut [f32]),
}

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
}

struct Buffers {
    params: wgpu::Buffer,
    /// The rows' positions and block tables (`kernels::BatchLayout`).
    batch: wgpu::Buffer,
    /// Row 0's words for the conversation's sequence (the pool's first, slot 0) at every
    /// position, copied into `batch` by its single-row steps: a queue write would make a
    /// staging buffer every token.
    main_rows: wgpu::Buffer,
    tokens: wgpu::Buffer,
    x: wgpu::Buffer,
    xn: wgpu::Buffer,
    qkv: wgpu::Buffer,
    attn: wgpu::Buffer,
    gu: wgpu::Buffer,
    h: wgpu::Buffer,
    /// A projection's output before its post-norm (architectures with post-norms).
    proj: wgpu::Buffer,
    /// Decode attention's per-chunk records (see `kernels::decode_partials_len`).
    partials: wgpu::Buffer,
    /// A row of logits per batch row.
    logits: wgpu::Buffer,
    /// An argmax per batch row.
    argmax: wgpu::Buffer,
    /// A round's argmax, the tokens of the round chained to it (`submit_round`).
    chain: wgpu::Buffer,
    /// One cos/sin table per RoPE of the plan.
    rope: Vec<wgpu::Buffer>,
    k_cache: Vec<wgpu::Buffer>,
    v_cache: Vec<wgpu::Buffer>,
    /// Two, used in turn: pipelined greedy steps read one while the next step fills the other.
    staging_argmax: [wgpu::Buffer; 2],
    staging_logits: wgpu::Buffer,
    /// `submit_round`'s passes' inputs, a region each (`UPLOAD_WORDS`), copied into place between
    /// the passes.
    uploads: wgpu::Buffer,
    /// Top-k selection, per batch row: (k, temperature bits), the selection's words
    /// (`kernels::TOP_K_WORDS` a row), and their staging (the rows' argmax words first, then
    /// what each selecting row reads, one after another).
    top_k_want: wgpu::Buffer,
    top_k_out: wgpu::Buffer,
    staging_top_k: wgpu::Buffer,
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

/// `GpuModel::profile`'s answer: milliseconds per kernel family, in the order of first use.
#[cfg(not(target_arch = "wasm32"))]
pub struct Profile {
    pub families: Vec<(&'static str, f64)>,
    /// Timed by the GPU's timestamps (else by the host's clock around each submission).
    pub gpu_clock: bool,
}

/// What one row of a batched decode step reads back beside its argmax.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowReadback {
    /// The argmax alone (4 bytes: greedy decoding).
    Argmax,
    /// The `k` largest logits (at most `kernels::MAX_TOP_K`), 8 bytes each; with a temperature,
    /// also what a top-p/min-p sampler needs of the rest (8 bytes; see `RowReadback::Select`).
    Select { k: usize, tail: Option<f32> },
    /// The whole row of logits (a sampler with penalties, candidates or log-probabilities).
    Logits,
}

impl RowReadback {
    /// What choosing a token with `sampler` needs read back of its row: the argmax (greedy), a
    /// selection on the GPU (top-k alone, up to `MAX_TOP_K`; top-p/min-p without top-k: the
    /// `NUCLEUS_K` largest and the tail), else the whole row (penalties, a larger top-k, and
    /// every sampled row off the GPU).
    pub fn for_sampler(sampler: &Sampler, on_gpu: bool) -> Self {
        if !sampler.needs_logits() {
            Self::Argmax
        } else if !on_gpu {
            Self::Logits
        } else if let Some(k) = sampler.top_k_only().filter(|&k| k <= kernels::MAX_TOP_K) {
            Self::Select { k, tail: None }
        } else if sampler.nucleus_only() {
            Self::Select { k: kernels::NUCLEUS_K, tail: Some(sampler.params().temperature) }
        } else {
            Self::Logits
        }
    }

    /// The token `sampler` draws from what its row read back: the argmax, the selection (`top`,
    /// `tail`) or the logits (which it changes); None when a top-p/min-p selection cannot place
    /// the cut (then read the row's logits and draw from them).
    pub fn choose(
        self,
        sampler: &mut Sampler,
        argmax: u32,
        top: &[(u32, f32)],
        tail: Tail,
        logits: &mut [f32],
    ) -> Option<u32> {
        match self {
            Self::Argmax => Some(argmax),
            Self::Select { tail: None, .. } => Some(sampler.sample_top_k(top)),
            Self::Select { tail: Some(_), .. } => {
                let vocab = sampler.vocab_size();
                sampler.sample_nucleus(top, vocab, tail)
            }
            Self::Logits => Some(sampler.sample(logits)),
        }
    }
}

/// What a batcher round reads back (`GpuModel::read_round`): every row's argmax into `ids` (u32::MAX flags non-finite logits, and
/// is not an error here: that row's request fails, not the step); a `Select` row's pairs (in no
/// order) into `top[row]` and its tail into `tails[row]`; a `Logits` row's logits into
/// `logits[row * vocab..]`. The slices have a row's room for each of the step's rows.
pub struct RowsReadback<'a> {
    pub want: &'a [RowReadback],
    pub ids: &'a mut [u32],
    pub top: &'a mut [Vec<(u32, f32)>],
    pub tails: &'a mut [Tail],
    pub logits: &'a mut [f32],
}

/// Bytes of a row's selection read back: the tail's two words (with a temperature), then the
/// pairs (`TOP_K_WORDS`' count word is not read: it is k, or the vocabulary when smaller).
fn selection_bytes(k: usize, tail: bool) -> u64 {
    4 * (2 * tail as u64 + 2 * k as u64)
}

/// The selection words' first word read back (see `selection_bytes`).
fn selection_offset(tail: bool) -> u64 {
    4 * if tail { 1 } else { 3 }
}

/// The `k` pairs and (with a tail) the tail from a row's selection bytes as read back.
fn read_selection(bytes: &[u8], k: usize, tail: Option<&mut Tail>, out: &mut Vec<(u32, f32)>) {
    let words: &[u32] = bytemuck::cast_slice(bytes);
    let pairs = match tail {
        Some(t) => {
            *t = Tail { sum: f32::from_bits(words[0]), max_abs: f32::from_bits(words[1]) };
            &words[2..]
        }
        None => words,
    };
    out.clear();
    out.extend(pairs[..2 * k].chunks_exact(2).map(|p| (p[0], f32::from_bits(p[1]))));
}

/// A batcher round submitted and not yet read (`GpuModel::submit_round`).
pub struct RoundFlight {
    submission: wgpu::SubmissionIndex,
    /// The staging slot of a round that reads its rows' argmax alone.
    slot: Option<usize>,
    n: usize,
}

/// A greedy decode step submitted and not yet read (see `GpuModel::submit_greedy`).
pub struct InFlight {
    slot: usize,
    submission: wgpu::SubmissionIndex,
    position: usize,
}

pub struct GpuModel {
    pub gpu: Gpu,
    pub config: ModelConfig,
    pub plan: Plan,
    pub context: usize,
    embd: Linear,
    output_norm: wgpu::Buffer,
    lm_head: Option<Linear>,
    layers: Vec<LayerWeights>,
    buf: Buffers,
    /// A single sequence's decode step (MB 1).
    decode: Vec<Dispatch>,
    /// A batched decode step; made on first use.
    decode_batch: Option<Vec<Dispatch>>,
    /// Self-speculation's draft step (its layer count and dispatches); made on first use.
    draft: Option<(usize, Vec<Dispatch>)>,
    prefill: Vec<Dispatch>,
    /// The top-k selection that follows a pass for the rows whose sampler asks for it.
    select: Option<Dispatch>,
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
    /// Decode rows one step takes at most (decode attention's records fit one binding).
    max_batch: usize,
    /// One layer's K or V block on its way to another block (WebGPU copies nothing within a
    /// buffer): made at the first copy-on-write.
    block_scratch: Option<wgpu::Buffer>,
    pipelines: PipelineCache,
    /// Weight bytes of the file one decode token needs: every tensor once, one embedding row
    /// (the whole table when it is also the output).
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
        if c.head_dim > 256 || c.head_dim % 8 != 0 || c.d_model % 8 != 0 || c.ffn_dim % 8 != 0 {
            return Err(Error::InvalidMetadata {
                key: format!("{}.attention.head_count", c.architecture),
                value: format!("head_dim {}, d_model {}, ffn {}", c.head_dim, c.d_model, c.ffn_dim),
                reason: "the GPU kernels need head_dim <= 256 and a multiple of 8, d_model and ffn multiples of 8"
                    .into(),
            });
        }
        // Before the upload: a context whose buffers this GPU cannot bind is the caller's error.
        let fits = Self::max_context(&gpu, &plan);
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
        progress(1, total);
        let mut layers = Vec::with_capacity(c.n_layers);
        for (i, l) in plan.layers.iter().enumerate() {
            let qkv = match &l.qkv {
                Qkv::Separate([q, k, v]) => linear("qkv", &[q, k, v]).await?,
                Qkv::Fused(name) => linear("qkv", &[name]).await?,
            };
            let (gate, up) = match &l.gate_up {
                GateUp::Separate([gate, up]) => (Rows::of(g.require_tensor(gate)?)?, Rows::of(g.require_tensor(up)?)?),
                GateUp::Fused(name) => Rows::of(g.require_tensor(name)?)?.halves(),
            };
            let gate_up = match Linear::gated_pair(&gpu, "gate_up", gate, up, src).await? {
                Some(pair) => pair,
                None => Linear::new(&gpu, "gate_up", &[gate, up], src).await?,
            };
            layers.push(LayerWeights {
                attn_norm: f32_buffer("attn_norm", fetch(g, src, &[&l.attn_norm]).await?)?,
                qkv,
                qkv_bias: optional_f32("qkv_bias", l.qkv_bias.as_ref().map(|n| &n[..])).await?,
                qk_norm: optional_f32("qk_norm", l.qk_norm.as_ref().map(|n| &n[..])).await?,
                wo: linear("wo", &[&l.wo]).await?,
                post_attn_norm: optional_f32("post_attn_norm", l.post_attn_norm.as_ref().map(std::slice::from_ref))
                    .await?,
                ffn_norm: f32_buffer("ffn_norm", fetch(g, src, &[&l.ffn_norm]).await?)?,
                gate_up,
                w_down: linear("w_down", &[&l.down]).await?,
                post_ffn_norm: optional_f32("post_ffn_norm", l.post_ffn_norm.as_ref().map(std::slice::from_ref))
                    .await?,
            });
            progress(i + 2, total);
        }
        let output_norm = f32_buffer("output_norm", fetch(g, src, &[&plan.output_norm]).await?)?;
        let lm_head =
            if plan.output == plan.token_embd { None } else { Some(linear("output", &[&plan.output]).await?) };
        progress(total, total);

        let blocks = context.div_ceil(KV_BLOCK);
        let layout = BatchLayout { max_blocks: blocks, max_seqs: MAX_SEQS };
        let per_row = kernels::decode_partials_len(&c, blocks * KV_BLOCK) as u64 * 4;
        let max_batch = MAX_BATCH.min((gpu.max_binding() / per_row.max(1)) as usize).max(1);
        let buf = Self::buffers(&gpu, &plan, blocks * KV_BLOCK, layout, max_batch)?;
        let mut pool = KvPool::new(blocks * KV_BLOCK, KV_BLOCK, MAX_SEQS);
        let main = pool.create()?;
        debug_assert_eq!(main.0, 0, "main_rows holds slot 0's table");
        let all: u64 = gguf.tensors.iter().filter(|t| t.name != ROPE_FREQS).map(|t| t.byte_size).sum();
        let file_weight_bytes = if plan.output == plan.token_embd {
            all
        } else {
            let e = gguf.require_tensor(&plan.token_embd)?;
            all - e.byte_size + e.byte_size / e.rows().1.max(1) as u64
        };
        let mut model = Self {
            config: c,
            plan,
            context,
            embd,
            output_norm,
            lm_head,
            layers,
            buf,
            decode: Vec::new(),
            decode_batch: None,
            draft: None,
            prefill: Vec::new(),
            select: None,
            all_logits: None,
            pool,
            layout,
            main,
            dirty: vec![false; MAX_SEQS],
            copies: Vec::new(),
            row_words: Vec::with_capacity(2 * PREFILL_CHUNK),
            round_tokens: Vec::with_capacity(MAX_BATCH),
            params_now: Params::default(),
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
        model.select =
            Some(kernels::top_k(&model.gpu, &mut model.pipelines, vocab, &b.logits, &b.top_k_want, &b.top_k_out));
        model.gpu.memory_watched(watch).await?;
        model.gpu.check()?;
        Ok(model)
    }

    /// The longest context whose context-sized buffers (see `buffers`: a layer's K or V cache,
    /// a RoPE table, decode attention's chunk records) each fit one binding.
    fn max_context(gpu: &Gpu, plan: &Plan) -> usize {
        let c = &plan.config;
        let per_token = [c.kv_dim() * gpu.kv_bytes() as usize, c.rope_dim * 4];
        let max = gpu.max_binding() as usize;
        // The cache is whole blocks.
        let fits = per_token.iter().map(|&b| max / b.max(1)).min().unwrap_or(0) / KV_BLOCK * KV_BLOCK;
        // One chunk record per head per DECODE_CHUNK keys, one workgroup per chunk along x.
        let chunks = (max / (4 * c.n_heads * (c.head_dim + 2)).max(1))
            .min(gpu.limits.max_compute_workgroups_per_dimension as usize);
        fits.min(chunks.saturating_mul(kernels::DECODE_CHUNK))
    }

    /// `context`: the cache's positions (whole blocks).
    fn buffers(gpu: &Gpu, plan: &Plan, context: usize, layout: BatchLayout, max_batch: usize) -> Result<Buffers> {
        let c = &plan.config;
        let n = PREFILL_CHUNK as u64;
        let f = 4u64;
        let kv_bytes = (context * c.kv_dim()) as u64 * gpu.kv_bytes();
        let batch = MAX_BATCH as u64;
        Ok(Buffers {
            params: gpu.uniform("params", std::mem::size_of::<Params>() as u64),
            batch: gpu.storage("batch", layout.words() as u64 * 4)?,
            main_rows: {
                let words: Vec<u32> = (0..context).flat_map(|p| [p as u32, layout.table(0) as u32]).collect();
                gpu.storage_init("main_rows", bytemuck::cast_slice(&words))?
            },
            tokens: gpu.storage("tokens", n * 4)?,
            x: gpu.storage("x", n * c.d_model as u64 * f)?,
            xn: gpu.storage("xn", n * c.d_model as u64 * f)?,
            qkv: gpu.storage("qkv", n * (c.q_dim() + 2 * c.kv_dim()) as u64 * f)?,
            attn: gpu.storage("attn", n * c.q_dim() as u64 * f)?,
            gu: gpu.storage("gate_up", n * 2 * c.ffn_dim as u64 * f)?,
            h: gpu.storage("ffn_hidden", n * c.ffn_dim as u64 * f)?,
            proj: gpu.storage("proj", n * c.d_model as u64 * f)?,
            partials: gpu
                .storage("attention_partials", (max_batch * kernels::decode_partials_len(c, context)) as u64 * f)?,
            logits: gpu.storage("logits", batch * c.vocab_size as u64 * f)?,
            argmax: gpu.storage("argmax", batch * 4)?,
            chain: gpu.storage("chain", batch * 4)?,
            rope: plan
                .ropes
                .iter()
                .map(|r| gpu.storage_init("rope", bytemuck::cast_slice(&kernels::rope_table(r, context))))
                .collect::<Result<_>>()?,
            k_cache: (0..c.n_layers).map(|_| gpu.storage("k_cache", kv_bytes)).collect::<Result<_>>()?,
            v_cache: (0..c.n_layers).map(|_| gpu.storage("v_cache", kv_bytes)).collect::<Result<_>>()?,
            staging_argmax: [gpu.readback("staging_argmax", batch * 4), gpu.readback("staging_argmax", batch * 4)],
            staging_logits: gpu.readback("staging_logits", batch * c.vocab_size as u64 * f),
            uploads: gpu.storage("uploads", (ROUND_PASSES * UPLOAD_WORDS * 4) as u64)?,
            top_k_want: gpu.storage("top_k_want", batch * 8)?,
            top_k_out: gpu.storage("top_k_out", batch * kernels::TOP_K_WORDS as u64 * 4)?,
            staging_top_k: gpu.readback("staging_top_k", batch * (1 + kernels::TOP_K_WORDS) as u64 * 4),
        })
    }

    /// The whole forward pass as dispatches: prefill (tiled gemm, flash attention) or decode
    /// (gemv, single-query attention, fused gated activation).
    fn record(&mut self, pass: Pass<'_>) -> Vec<Dispatch> {
        let (mb, layers) = match pass {
            Pass::Decode { mb, layers } => (mb, layers),
            _ => (1, self.layers.len()),
        };
        let prefill = !matches!(pass, Pass::Decode { .. });
        let (gpu, c, plan, b, p) = (&self.gpu, &self.config, &self.plan, &self.buf, &mut self.pipelines);
        let (params, eps, act) = (&b.params, c.rms_eps, plan.activation);
        let gb = GemvBatch { params, mb };
        let embed_scale = plan.embed_scale.unwrap_or(1.0);
        let mut ops = kernels::embed(gpu, p, params, &self.embd, embed_scale, &b.tokens, &b.x);
        let qkv_stride = c.q_dim() + 2 * c.kv_dim();
        // GPUs fold each pre-norm into the matrix-vector product that reads it (one dispatch less
        // per norm); CPU adapters keep the separate pass, which is cheaper there.
        let fuse = !prefill && gpu.style == KernelStyle::Gpu;
        let input = if fuse { &b.x } else { &b.xn };
        for (i, (l, lp)) in self.layers.iter().zip(&plan.layers).enumerate().take(layers) {
            let (kc, vc) = (&b.k_cache[i], &b.v_cache[i]);
            let rope = &plan.ropes[lp.rope];
            let kind = AttentionKind { scale: plan.attn_scale, window: lp.window };
            let extras = QkvExtras { bias: l.qkv_bias.as_ref(), qk_norm: l.qk_norm.as_ref().map(|n| (n, eps)) };
            // A projection into the residual stream: added to x, or through its post-norm first.
            let residual = |ops: &mut Vec<Dispatch>,
                            p: &mut PipelineCache,
                            w: &Linear,
                            x: &wgpu::Buffer,
                            post: &Option<wgpu::Buffer>| {
                let (epilogue, out) = if post.is_some() { (Epilogue::Store, &b.proj) } else { (Epilogue::Add, &b.x) };
                if prefill {
                    ops.extend(kernels::gemm(gpu, p, params, w, epilogue, x, out, c.d_model));
                } else {
                    ops.extend(kernels::gemv(gpu, p, gb, w, act, epilogue, None, x, out, c.d_model));
                }
                if let Some(post) = post {
                    ops.push(kernels::rms_norm(gpu, p, params, c.d_model, eps, NormOut::Add, &b.proj, post, &b.x));
                }
            };

            if !fuse {
                ops.push(kernels::rms_norm(gpu, p, params, c.d_model, eps, NormOut::Store, &b.x, &l.attn_norm, &b.xn));
            }
            // Decode on GPUs hands RoPE and the cache write to the projection's epilogue where it
            // can; CPU adapters keep the separate pass (the epilogue's barrier costs them 13% of
            // a decode step on lavapipe: 4.1-4.4 against 5.0-5.1 tok/s).
            let fold =
                RopeKvFold { config: c, rope, batch: &b.batch, table: &b.rope[lp.rope], k_cache: kc, v_cache: vc };
            let folded = fuse && fold.applies(&extras, &l.qkv);
            let norm = fuse.then_some((&l.attn_norm, eps));
            if prefill {
                ops.extend(kernels::gemm(gpu, p, params, &l.qkv, Epilogue::Store, &b.xn, &b.qkv, qkv_stride));
            } else if folded {
                ops.extend(kernels::gemv_rope_kv(gpu, p, gb, &l.qkv, &fold, norm, input, &b.qkv, qkv_stride));
            } else {
                ops.extend(kernels::gemv(gpu, p, gb, &l.qkv, act, Epilogue::Store, norm, input, &b.qkv, qkv_stride));
            }
            if !folded {
                let table = &b.rope[lp.rope];
                ops.push(kernels::rope_kv(gpu, p, params, c, rope, extras, &b.qkv, table, kc, vc, &b.batch));
            }
            if prefill {
                ops.push(kernels::attention_prefill(gpu, p, params, c, kind, &b.qkv, kc, vc, &b.attn, &b.batch));
            } else {
                ops.extend(kernels::attention_decode(
                    gpu,
                    p,
                    c,
                    kind,
                    self.context,
                    &b.qkv,
                    kc,
                    vc,
                    &b.partials,
                    &b.attn,
                    &b.batch,
                ));
            }
            residual(&mut ops, p, &l.wo, &b.attn, &l.post_attn_norm);

            if !fuse {
                ops.push(kernels::rms_norm(gpu, p, params, c.d_model, eps, NormOut::Store, &b.x, &l.ffn_norm, &b.xn));
            }
            let pairs = l.gate_up.parts.iter().all(|part| part.pair);
            if prefill {
                ops.extend(kernels::gemm(gpu, p, params, &l.gate_up, Epilogue::Store, &b.xn, &b.gu, 2 * c.ffn_dim));
                ops.push(kernels::act_mul(gpu, p, params, act, c.ffn_dim, &b.gu, &b.h));
            } else {
                let norm = fuse.then_some((&l.ffn_norm, eps));
                let (out, stride) = if pairs { (&b.h, c.ffn_dim) } else { (&b.gu, 2 * c.ffn_dim) };
                ops.extend(kernels::gemv(gpu, p, gb, &l.gate_up, act, Epilogue::Store, norm, input, out, stride));
                if !pairs {
                    ops.push(kernels::act_mul(gpu, p, params, act, c.ffn_dim, &b.gu, &b.h));
                }
            }
            residual(&mut ops, p, &l.w_down, &b.h, &l.post_ffn_norm);
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embd);
        let output_norm = &self.output_norm;
        if let Pass::AllLogits(logits) = pass {
            ops.push(kernels::rms_norm(gpu, p, params, c.d_model, eps, NormOut::Store, &b.x, output_norm, &b.xn));
            ops.extend(kernels::gemm(gpu, p, params, head, Epilogue::Store, &b.xn, logits, c.vocab_size));
            return ops;
        }
        let vocab = c.vocab_size;
        if fuse {
            let norm = Some((output_norm, eps));
            ops.extend(kernels::gemv(gpu, p, gb, head, act, Epilogue::Store, norm, &b.x, &b.logits, vocab));
        } else {
            // Prefill takes the last token's row; decode every row of the batch.
            let out = if prefill { NormOut::StoreLast } else { NormOut::Store };
            ops.push(kernels::rms_norm(gpu, p, params, c.d_model, eps, out, &b.x, output_norm, &b.xn));
            ops.extend(kernels::gemv(gpu, p, gb, head, act, Epilogue::Store, None, &b.xn, &b.logits, vocab));
        }
        ops.push(kernels::argmax(gpu, p, params, vocab, &b.logits, &b.argmax));
        ops
    }

    /// Runs `tokens` at positions `start..` (at most `all_logits_chunk()` of them) and returns
    /// the logits of every position (`n * vocab`). For perplexity and tests, not the decode loop.
    pub async fn logits_all(&mut self, tokens: &[u32], start: usize) -> Result<Vec<f32>> {
        let n = tokens.len();
        if n == 0 || n > self.all_logits_chunk() || start + n > self.context {
            return Err(Error::ContextOverflow {
                prompt_tokens: start + n,
                max_tokens: 0,
                context_length: self.context,
            });
        }
        if self.all_logits.is_none() {
            let buffer =
                self.gpu.storage("all_logits", (self.all_logits_chunk() * self.config.vocab_size * 4) as u64)?;
            let ops = self.record(Pass::AllLogits(&buffer));
            self.all_logits = Some((ops, buffer));
        }
        self.gpu.queue.write_buffer(&self.buf.tokens, 0, bytemuck::cast_slice(tokens));
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        let main = self.main;
        self.prepare(&mut enc, (start..start + n).map(|p| (main, p)), Params::new(n, 1))?;
        let (ops, buffer) = self.all_logits.as_ref().expect("recorded above");
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            ops.iter().for_each(|op| op.encode(&mut pass, n as u32));
        }
        self.gpu.submit(enc);
        self.gpu.read_f32(buffer, n * self.config.vocab_size).await
    }

    /// Positions per `logits_all` call: a prefill chunk, fewer when its logits would not fit
    /// one binding.
    pub fn all_logits_chunk(&self) -> usize {
        let per_token = self.config.vocab_size as u64 * 4;
        let max = self.gpu.max_binding();
        PREFILL_CHUNK.min((max / per_token) as usize).max(1)
    }

    /// Time per kernel family for one pass of `n` tokens at `start`: where the time of a step
    /// goes. With timestamp queries each dispatch is timed on the GPU's clock in one submission
    /// (the sum is the GPU's busy time; a real step adds the gaps between dispatches); without,
    /// each dispatch is submitted and waited for alone, so the sum exceeds a real step.
    #[cfg(not(target_arch = "wasm32"))]
    pub async fn profile(&mut self, n: usize, start: usize) -> Result<Profile> {
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        let main = self.main;
        self.prepare(&mut enc, (start..start + n).map(|p| (main, p)), Params::new(n, 1))?;
        self.gpu.submit(enc);
        let ops = if n == 1 { &self.decode } else { &self.prefill };
        let mut times = Vec::with_capacity(ops.len());
        if self.gpu.timestamps {
            // One pass per dispatch, its start and end stamped, all in one submission.
            let count = 2 * ops.len() as u32;
            let set = self.gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count,
            });
            let resolved = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("profile"),
                size: 8 * count as u64,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let staging = self.gpu.readback("profile", 8 * count as u64);
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            for (i, op) in ops.iter().enumerate() {
                let writes = wgpu::ComputePassTimestampWrites {
                    query_set: &set,
                    beginning_of_pass_write_index: Some(2 * i as u32),
                    end_of_pass_write_index: Some(2 * i as u32 + 1),
                };
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some(op.label),
                    timestamp_writes: Some(writes),
                });
                op.encode(&mut pass, n as u32);
            }
            enc.resolve_query_set(&set, 0..count, &resolved, 0);
            enc.copy_buffer_to_buffer(&resolved, 0, &staging, 0, 8 * count as u64);
            self.gpu.submit(enc);
            let ticks: Vec<u64> =
                self.gpu.read_mapped(&staging, 8 * count as u64, bytemuck::pod_collect_to_vec).await?;
            let period_ms = self.gpu.queue.get_timestamp_period() as f64 / 1e6;
            for (op, t) in ops.iter().zip(ticks.chunks_exact(2)) {
                times.push((op.label, t[1].saturating_sub(t[0]) as f64 * period_ms));
            }
        } else {
            for op in ops {
                let mut enc = self.gpu.device.create_command_encoder(&Default::default());
                op.encode(&mut enc.begin_compute_pass(&Default::default()), n as u32);
                let t = web_time::Instant::now();
                self.gpu.submit(enc);
                self.gpu.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| Error::Gpu(e.to_string()))?;
                times.push((op.label, t.elapsed().as_secs_f64() * 1e3));
            }
        }
        self.gpu.check()?;
        let mut families: Vec<(&'static str, f64)> = Vec::new();
        for (label, ms) in times {
            match families.iter_mut().find(|(l, _)| *l == label) {
                Some(entry) => entry.1 += ms,
                None => families.push((label, ms)),
            }
        }
        Ok(Profile { families, gpu_clock: self.gpu.timestamps })
    }

    /// Dispatches in one decode step.
    pub fn decode_dispatches(&self) -> usize {
        self.decode.len()
    }

    /// The traffic ledger of a decode step at `seq` keys: what its dispatches declare they move.
    pub fn decode_traffic(&self, seq: usize) -> Ledger {
        self.decode.iter().map(|op| op.traffic.at(seq)).sum()
    }

    /// The least any decode step at `seq` keys moves: the file's weight bytes once, each layer's
    /// keys and values attended read once and the new token's written once, and the vectors a
    /// fully fused step still writes once (q, k, v, the attention output, each residual update,
    /// the gated FFN's hidden vector, the logits).
    pub fn min_decode_traffic(&self, seq: usize) -> Ledger {
        let c = &self.config;
        let kv_row = 2 * c.kv_dim() as u64 * self.gpu.kv_bytes();
        let kv_read = self.plan.layers.iter().map(|l| kv_row * l.window.map_or(seq, |w| seq.min(w)) as u64).sum();
        let per_layer = (c.q_dim() + 2 * c.kv_dim()) + c.q_dim() + 2 * c.d_model + c.ffn_dim;
        Ledger {
            weights: self.file_weight_bytes,
            activations: 4 * (c.n_layers * per_layer + c.vocab_size) as u64,
            kv_read,
            kv_written: kv_row * c.n_layers as u64,
        }
    }

    /// Readies a pass's rows, (sequence, position) each: reserves the positions in the pool
    /// (copying, in `enc`, a block shared with another sequence before it is written), uploads
    /// the block tables that changed, the rows' positions and tables, and `params` when they
    /// changed. Allocates nothing when no block is added (every decode step).
    fn prepare(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        rows: impl Iterator<Item = (SeqId, usize)> + Clone,
        params: Params,
    ) -> Result<()> {
        self.reserve(enc, rows.clone())?;
        let queue = &self.gpu.queue;
        let mut single = rows.clone();
        match (single.next(), single.next()) {
            (Some((seq, pos)), None) if seq == self.main => {
                enc.copy_buffer_to_buffer(&self.buf.main_rows, pos as u64 * 8, &self.buf.batch, 0, 8);
            }
            _ => {
                self.row_words.clear();
                for (seq, pos) in rows {
                    self.row_words.extend([pos as u32, self.layout.table(seq.0) as u32]);
                }
                queue.write_buffer(&self.buf.batch, 0, bytemuck::cast_slice(&self.row_words));
            }
        }
        if params != self.params_now {
            queue.write_buffer(&self.buf.params, 0, bytemuck::bytes_of(&params));
            self.params_now = params;
        }
        Ok(())
    }

    /// The pool's side of `prepare`: reserves the rows' positions, copies (in `enc`) shared
    /// blocks before they are written, and uploads the block tables that changed.
    fn reserve(
        &mut self,
        enc: &mut wgpu::CommandEncoder,
        rows: impl Iterator<Item = (SeqId, usize)> + Clone,
    ) -> Result<()> {
        self.copies.clear();
        if let Some((_, pos)) = rows.clone().find(|&(_, pos)| pos >= self.context) {
            return Err(Error::ContextOverflow { prompt_tokens: pos + 1, max_tokens: 0, context_length: self.context });
        }
        for (seq, pos) in rows.clone() {
            match self.pool.reserve(seq, pos + 1, &mut self.copies) {
                Ok(changed) => self.dirty[seq.0] |= changed,
                Err(e) => {
                    // Tables of earlier rows may already point at copy-on-write blocks: copy
                    // them now, or those sequences would read blocks never written.
                    if !self.copies.is_empty() {
                        let mut own = self.gpu.device.create_command_encoder(&Default::default());
                        self.copy_blocks(&mut own)?;
                        self.gpu.submit(own);
                    }
                    return Err(e);
                }
            }
        }
        if !self.copies.is_empty() {
            self.copy_blocks(enc)?;
        }
        let queue = &self.gpu.queue;
        for (seq, dirty) in self.dirty.iter_mut().enumerate() {
            let table = self.pool.table(SeqId(seq));
            if std::mem::take(dirty) && !table.is_empty() {
                let at = self.layout.table(seq) as u64 * 4;
                queue.write_buffer(&self.buf.batch, at, bytemuck::cast_slice(table));
            }
        }
        Ok(())
    }

    /// One pass of a round (`submit_round`), pass `k` of it: its tokens, its rows' (position,
    /// table) words and its params go into the k-th region of the uploads buffer and are copied
    /// into place in `enc` just before the pass, so that every pass of the round sees its own.
    fn upload_pass(&mut self, enc: &mut wgpu::CommandEncoder, k: usize, tokens: &[u32], params: Params) {
        let b = &self.buf;
        let region = (k * UPLOAD_WORDS * 4) as u64;
        let (rows_at, params_at) = (region + 4 * MAX_ROWS as u64, region + 12 * MAX_ROWS as u64);
        let queue = &self.gpu.queue;
        queue.write_buffer(&b.uploads, region, bytemuck::cast_slice(tokens));
        queue.write_buffer(&b.uploads, rows_at, bytemuck::cast_slice(&self.row_words));
        queue.write_buffer(&b.uploads, params_at, bytemuck::bytes_of(&params));
        enc.copy_buffer_to_buffer(&b.uploads, region, &b.tokens, 0, 4 * tokens.len() as u64);
        enc.copy_buffer_to_buffer(&b.uploads, rows_at, &b.batch, 0, 4 * self.row_words.len() as u64);
        enc.copy_buffer_to_buffer(&b.uploads, params_at, &b.params, 0, std::mem::size_of::<Params>() as u64);
        // What the params buffer holds after the round is the last pass's: written anew by the
        // next single pass.
        self.params_now = Params::default();
    }

    /// A round of the batcher as one submission, not waited for (read it with `read_round`,
    /// the same `want`): each of `prefills` (sequence, tokens, first position; at most
    /// PREFILL_CHUNK tokens) as a prefill pass that reads nothing back, then the decode `rows`
    /// as one pass whose rows read back what `want` says. Every pass's inputs are uploaded
    /// into regions of their own and copied into place between the passes (`upload_pass`), so
    /// the GPU runs them back to back and the host waits once. `chained`: the decode rows' tokens are the argmax of the same rows of the round
    /// submitted before (kept on the GPU), not `rows[i].1`, so that greedy round n + 1 can be
    /// submitted before round n's ids are read. A round whose rows all read their argmax alone
    /// reads it from one of two staging slots, in turn, so that two can be in flight.
    pub fn submit_round(
        &mut self,
        prefills: &[(SeqId, &[u32], usize)],
        rows: &[(SeqId, u32, usize)],
        want: &[RowReadback],
        chained: bool,
    ) -> Result<RoundFlight> {
        let n = rows.len();
        if n > self.max_batch || prefills.len() + 1 > ROUND_PASSES || want.len() != n {
            return Err(Error::InvalidOption {
                name: "round",
                value: format!("{} prefill passes and {n} decode rows", prefills.len()),
                expected: format!(
                    "at most {} prefill passes and {} decode rows a round on this GPU, a readback a row",
                    ROUND_PASSES - 1,
                    self.max_batch
                ),
            });
        }
        self.gpu.check()?;
        let host = HostClock::now();
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("round") });
        for (k, &(seq, tokens, start)) in prefills.iter().enumerate() {
            let len = tokens.len();
            if len == 0 || len > PREFILL_CHUNK || start + len > self.context {
                return Err(Error::ContextOverflow {
                    prompt_tokens: start + len,
                    max_tokens: 0,
                    context_length: self.context,
                });
            }
            self.reserve(&mut enc, (start..start + len).map(|p| (seq, p)))?;
            let table = self.layout.table(seq.0) as u32;
            self.row_words.clear();
            self.row_words.extend((start..start + len).flat_map(|p| [p as u32, table]));
            self.upload_pass(&mut enc, k, tokens, Params::new(len, 1));
            Self::encode_ops(&mut enc, if len == 1 { &self.decode } else { &self.prefill }, len);
        }
        let argmax_only = n > 0 && want.iter().all(|w| *w == RowReadback::Argmax);
        let slot = argmax_only.then(|| {
            let slot = self.next_slot;
            self.next_slot = 1 - slot;
            slot
        });
        if n > 0 {
            self.reserve(&mut enc, rows.iter().map(|r| (r.0, r.2)))?;
            self.row_words.clear();
            for &(seq, _, pos) in rows {
                self.row_words.extend([pos as u32, self.layout.table(seq.0) as u32]);
            }
            self.round_tokens.clear();
            self.round_tokens.extend(rows.iter().map(|r| r.1));
            let tokens = std::mem::take(&mut self.round_tokens);
            self.upload_pass(&mut enc, prefills.len(), &tokens, Params::new(n, n));
            self.round_tokens = tokens;
            let b = &self.buf;
            if chained {
                enc.copy_buffer_to_buffer(&b.chain, 0, &b.tokens, 0, 4 * n as u64);
            }
            if n > 1 && self.decode_batch.is_none() {
                self.decode_batch = Some(self.record(Pass::Decode { mb: BATCH_MB, layers: self.layers.len() }));
            }
            let ops = if n == 1 { &self.decode } else { self.decode_batch.as_ref().expect("recorded above") };
            Self::encode_ops(&mut enc, ops, n);
            let b = &self.buf;
            // The next round's tokens when it is chained to this one.
            enc.copy_buffer_to_buffer(&b.argmax, 0, &b.chain, 0, 4 * n as u64);
            match slot {
                Some(slot) => enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_argmax[slot], 0, 4 * n as u64),
                None => self.encode_rows(&mut enc, want)?,
            }
        }
        let submission = self.gpu.submit(enc);
        self.count_host_time(host);
        Ok(RoundFlight { submission, slot, n })
    }

    /// What a round submitted by `submit_round` reads back, waiting for it.
    pub async fn read_round(&self, flight: RoundFlight, readback: RowsReadback<'_>) -> Result<()> {
        match (flight.n, flight.slot) {
            (0, _) => self.gpu.check(),
            (n, Some(slot)) => {
                let ids = readback.ids;
                let staging = &self.buf.staging_argmax[slot];
                self.gpu
                    .read_mapped_after(staging, 4 * n as u64, Some(flight.submission), |bytes| {
                        ids[..n].copy_from_slice(bytemuck::cast_slice(bytes))
                    })
                    .await
            }
            (_, None) => self.read_rows(readback).await,
        }
    }

    /// The pool's copy-on-write copies (`self.copies`), every layer's K and V block, through a
    /// scratch block (WebGPU copies nothing within one buffer).
    fn copy_blocks(&mut self, enc: &mut wgpu::CommandEncoder) -> Result<()> {
        let bytes = (KV_BLOCK * self.config.kv_dim()) as u64 * self.gpu.kv_bytes();
        if self.block_scratch.is_none() {
            self.block_scratch = Some(self.gpu.storage("block_scratch", bytes)?);
        }
        let scratch = self.block_scratch.as_ref().expect("made above");
        for &(from, to) in &self.copies {
            for cache in self.buf.k_cache.iter().chain(&self.buf.v_cache) {
                enc.copy_buffer_to_buffer(cache, from as u64 * bytes, scratch, 0, bytes);
                enc.copy_buffer_to_buffer(scratch, 0, cache, to as u64 * bytes, bytes);
            }
        }
        Ok(())
    }

    /// Encodes `ops` for a pass of `n` rows.
    fn encode_ops(enc: &mut wgpu::CommandEncoder, ops: &[Dispatch], n: usize) {
        let mut pass =
            enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("forward"), timestamp_writes: None });
        for op in ops {
            op.encode(&mut pass, n as u32);
        }
    }

    fn count_host_time(&self, since: HostClock) {
        self.gpu.counters.host_ns.fetch_add(since.elapsed_ns(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Submits the greedy decode step at `position` for `token`, or, with None, for the argmax
    /// of the step submitted before it, which stays on the GPU: the step's own argmax is copied
    /// into the token buffer for the step after. So step n + 1 can be submitted before step n's
    /// id is read (`read_greedy`), and the GPU does not wait for the host between tokens.
    pub fn submit_greedy(&mut self, token: Option<u32>, position: usize) -> Result<InFlight> {
        if position >= self.context {
            return Err(Error::ContextOverflow {
                prompt_tokens: position + 1,
                max_tokens: 0,
                context_length: self.context,
            });
        }
        self.gpu.check()?;
        let host = HostClock::now();
        if let Some(token) = token {
            self.gpu.queue.write_buffer(&self.buf.tokens, 0, bytemuck::bytes_of(&token));
        }
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step") });
        let main = self.main;
        self.prepare(&mut enc, std::iter::once((main, position)), Params::new(1, 1))?;
        Self::encode_ops(&mut enc, &self.decode, 1);
        let (b, slot) = (&self.buf, self.next_slot);
        enc.copy_buffer_to_buffer(&b.argmax, 0, &b.tokens, 0, 4);
        enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_argmax[slot], 0, 4);
        let submission = self.gpu.submit(enc);
        self.count_host_time(host);
        self.next_slot = 1 - slot;
        Ok(InFlight { slot, submission, position: position + 1 })
    }

    /// The id a greedy step chose (waiting for it); non-finite logits are an error.
    pub async fn read_greedy(&mut self, step: InFlight) -> Result<u32> {
        let staging = &self.buf.staging_argmax[step.slot];
        let id = self
            .gpu
            .read_mapped_after(staging, 4, Some(step.submission), |bytes| {
                u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
            })
            .await?;
        // The argmax kernel flags NaN or infinite logits with u32::MAX.
        if id == u32::MAX {
            return Err(Error::NonFiniteLogits { position: step.position });
        }
        Ok(id)
    }

    /// Row `row`'s logits of the last step, still in GPU memory until the next step: for a
    /// sampler that the selection on the GPU could not serve (`Sampler::sample_nucleus` said
    /// None). A single sequence's step has its logits in row 0.
    pub async fn read_logits(&self, row: usize, out: &mut [f32]) -> Result<()> {
        let (b, bytes) = (&self.buf, self.config.vocab_size as u64 * 4);
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(&b.logits, row as u64 * bytes, &b.staging_logits, 0, bytes);
        self.gpu.submit(enc);
        self.gpu.read_mapped(&b.staging_logits, bytes, |v| out.copy_from_slice(bytemuck::cast_slice(v))).await
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

    /// Decode rows one step takes at most.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    pub fn new_sequence(&mut self) -> Result<SeqId> {
        let seq = self.pool.create()?;
        self.mark_dirty(seq);
        Ok(seq)
    }

    fn mark_dirty(&mut self, seq: SeqId) {
        if let Some(d) = self.dirty.get_mut(seq.0) {
            *d = true;
        }
    }

    /// A new sequence sharing the first `len` positions of `seq` (no copy until one writes).
    pub fn fork_sequence(&mut self, seq: SeqId, len: usize) -> Result<SeqId> {
        let fork = self.pool.fork(seq, len)?;
        self.mark_dirty(fork);
        Ok(fork)
    }

    /// A new sequence holding the longest prefix of `tokens` the pool's prefix cache has, in
    /// whole blocks (`KvPool::create_cached`): its id and length.
    pub fn new_sequence_cached(&mut self, tokens: &[u32]) -> Result<(SeqId, usize)> {
        let (seq, len) = self.pool.create_cached(tokens)?;
        self.mark_dirty(seq);
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
    }

    /// Self-speculation's draft: the decode step of `token` at `pos` of sequence `seq` through
    /// the first `layers` layers, then the final norm and the LM head; the argmax. It writes those
    /// layers' keys and values at `pos`, as the whole model would for the same token.
    pub async fn draft_step_in(&mut self, seq: SeqId, layers: usize, token: u32, pos: usize) -> Result<u32> {
        let n_layers = self.layers.len();
        if layers == 0 || layers >= n_layers {
            return Err(Error::InvalidOption {
                name: "speculate",
                value: format!("layers:{layers}"),
                expected: format!("layers:L with L from 1 to {} (the model has {n_layers} layers)", n_layers - 1),
            });
        }
        if self.draft.as_ref().is_none_or(|d| d.0 != layers) {
            let ops = self.record(Pass::Decode { mb: 1, layers });
            self.draft = Some((layers, ops));
        }
        self.gpu.check()?;
        self.gpu.queue.write_buffer(&self.buf.tokens, 0, bytemuck::bytes_of(&token));
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("draft") });
        self.prepare(&mut enc, std::iter::once((seq, pos)), Params::new(1, 1))?;
        Self::encode_ops(&mut enc, &self.draft.as_ref().expect("recorded above").1, 1);
        let b = &self.buf;
        enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_argmax[0], 0, 4);
        self.gpu.submit(enc);
        let id =
            self.gpu.read_mapped(&b.staging_argmax[0], 4, |bytes| bytemuck::cast_slice::<u8, u32>(bytes)[0]).await?;
        if id == u32::MAX {
            return Err(Error::NonFiniteLogits { position: pos + 1 });
        }
        Ok(id)
    }

    /// A round's readback work after its decode pass (rows that read more than their argmax): the selection for the rows that
    /// want one (their k and temperatures written first), then the copies of what each row
    /// reads, one after another in the staging buffers (so that only those bytes are mapped).
    fn encode_rows(&mut self, enc: &mut wgpu::CommandEncoder, want: &[RowReadback]) -> Result<()> {
        let n = want.len();
        let b = &self.buf;
        let vocab = self.config.vocab_size;
        let selects = want.iter().any(|w| matches!(w, RowReadback::Select { .. }));
        if selects {
            self.row_words.clear();
            for w in want {
                self.row_words.extend(match *w {
                    RowReadback::Select { k, tail } => {
                        let t = tail.unwrap_or(0.0);
                        debug_assert!(tail.is_none() || t > 0.0, "a tail needs a temperature");
                        [k.clamp(1, kernels::MAX_TOP_K.min(vocab)) as u32, t.to_bits()]
                    }
                    _ => [0, 0],
                });
            }
            self.gpu.queue.write_buffer(&b.top_k_want, 0, bytemuck::cast_slice(&self.row_words));
            Self::encode_ops(enc, self.select.as_slice(), n);
        }
        enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_top_k, 0, 4 * n as u64);
        let (mut at, mut logits_at) = (4 * n as u64, 0u64);
        let (row_words, row_logits) = (kernels::TOP_K_WORDS as u64 * 4, vocab as u64 * 4);
        for (r, w) in want.iter().enumerate() {
            match *w {
                RowReadback::Argmax => {}
                RowReadback::Select { k, tail } => {
                    let (from, len) = (selection_offset(tail.is_some()), selection_bytes(k.min(vocab), tail.is_some()));
                    enc.copy_buffer_to_buffer(&b.top_k_out, r as u64 * row_words + from, &b.staging_top_k, at, len);
                    at += len;
                }
                RowReadback::Logits => {
                    enc.copy_buffer_to_buffer(
                        &b.logits,
                        r as u64 * row_logits,
                        &b.staging_logits,
                        logits_at,
                        row_logits,
                    );
                    logits_at += row_logits;
                }
            }
        }
        Ok(())
    }

    /// Reads what `encode_rows` copied into `r`.
    async fn read_rows(&self, r: RowsReadback<'_>) -> Result<()> {
        let b = &self.buf;
        let (n, vocab) = (r.want.len(), self.config.vocab_size);
        let select_bytes: u64 = r
            .want
            .iter()
            .map(|w| match *w {
                RowReadback::Select { k, tail } => selection_bytes(k.min(vocab), tail.is_some()),
                _ => 0,
            })
            .sum();
        let (want, ids, top, tails) = (r.want, r.ids, r.top, r.tails);
        self.gpu
            .read_mapped(&b.staging_top_k, 4 * n as u64 + select_bytes, |bytes| {
                ids[..n].copy_from_slice(bytemuck::cast_slice(&bytes[..4 * n]));
                let mut at = 4 * n;
                for (row, w) in want.iter().enumerate() {
                    if let RowReadback::Select { k, tail } = *w {
                        let (k, len) = (k.min(vocab), selection_bytes(k.min(vocab), tail.is_some()) as usize);
                        read_selection(&bytes[at..at + len], k, tail.map(|_| &mut tails[row]), &mut top[row]);
                        at += len;
                    }
                }
            })
            .await?;
        let logit_rows = want.iter().filter(|w| **w == RowReadback::Logits).count();
        if logit_rows > 0 {
            let logits = r.logits;
            self.gpu
                .read_mapped(&b.staging_logits, (logit_rows * vocab * 4) as u64, |bytes| {
                    let mut values = bytemuck::cast_slice::<u8, f32>(bytes).chunks_exact(vocab);
                    for (row, _) in want.iter().enumerate().filter(|(_, w)| **w == RowReadback::Logits) {
                        let read = values.next().expect("a row read for each");
                        logits[row * vocab..][..vocab].copy_from_slice(read);
                    }
                })
                .await?;
        }
        Ok(())
    }

    /// Runs `tokens` at positions `start..` (one pass: at most PREFILL_CHUNK tokens) of the
    /// conversation's sequence, writing their keys and values into the cache. Returns the argmax
    /// when asked for it.
    pub async fn step(&mut self, tokens: &[u32], start: usize, readback: Readback<'_>) -> Result<Option<u32>> {
        self.step_in(self.main, tokens, start, readback).await
    }

    /// `step` in sequence `seq`.
    pub async fn step_in(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        start: usize,
        readback: Readback<'_>,
    ) -> Result<Option<u32>> {
        let n = tokens.len();
        if n == 0 || n > PREFILL_CHUNK || start + n > self.context {
            return Err(Error::ContextOverflow {
                prompt_tokens: start + n,
                max_tokens: 0,
                context_length: self.context,
            });
        }
        // A lost device (or an error left by an earlier call) fails here, before any work.
        self.gpu.check()?;
        let host = HostClock::now();
        self.gpu.queue.write_buffer(&self.buf.tokens, 0, bytemuck::cast_slice(tokens));
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step") });
        self.prepare(&mut enc, (start..start + n).map(|p| (seq, p)), Params::new(n, 1))?;
        Self::encode_ops(&mut enc, if n == 1 { &self.decode } else { &self.prefill }, n);
        let b = &self.buf;
        let logits_bytes = self.config.vocab_size as u64 * 4;
        let slot = self.next_slot;
        match &readback {
            Readback::None => {}
            Readback::Argmax => enc.copy_buffer_to_buffer(&b.argmax, 0, &b.staging_argmax[slot], 0, 4),
            Readback::Logits(_) => enc.copy_buffer_to_buffer(&b.logits, 0, &b.staging_logits, 0, logits_bytes),
        }
        let submission = self.gpu.submit(enc);
        if n == 1 {
            self.count_host_time(host);
        }
        match readback {
            Readback::None => self.gpu.check().map(|_| None),
            Readback::Argmax => {
                let flight = InFlight { slot, submission, position: start + n };
                self.read_greedy(flight).await.map(Some)
            }
            Readback::Logits(out) => {
                self.gpu
                    .read_mapped(&b.staging_logits, logits_bytes, |bytes| {
                        out.copy_from_slice(bytemuck::cast_slice(bytes))
                    })
                    .await?;
                Ok(None)
            }
        }
    }
}
