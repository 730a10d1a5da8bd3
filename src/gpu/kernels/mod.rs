//! One typed wrapper per WGSL kernel family: each knows its bindings, its override constants and
//! its dispatch shape, and returns `Dispatch`es — pipeline + bind group + workgroup counts —
//! built once at load and encoded every step.

mod act_mul;
mod argmax;
mod attention;
mod delta;
mod embed;
mod gemma4;
mod matmul;
mod moe;
mod mtp;
mod norm;
mod rope;
mod short_conv;
mod softcap;
mod top_k;

pub use act_mul::{act_mul, bias_add};
pub use argmax::{argmax, argmax_masked, argmax_records, mask_wgsl, mask_words, masks_bytes, Masks};
pub use attention::{
    attention_decode, attention_prefill, decode_max_context, decode_partials_len, decode_short_keys,
    decode_splits_used, DECODE_CHUNK,
};
pub use delta::{delta_out, delta_prep, delta_proj, delta_scan, gate_mul, sigmoid_add};
pub use embed::embed;
pub use gemma4::{ple_gate, ple_inputs, scale_rows};
pub use matmul::{
    argmax_records_per_row, feed_sums_bytes, gemm, gemm_normed, gemv, gemv_argmax, gemv_feeding, gemv_rope_kv,
    int8_scratch_bytes, takes_int8, ArgmaxRecords, Epilogue, Feed, GemvBatch, GemvProgram, Int8Scratch, NormIn,
    INT8_RECORD_BYTES,
};
#[cfg(test)]
pub(crate) use matmul::{coop_gemm_kernel, coop_subgroups};
pub use moe::{check_experts, moe_combine, moe_gemv, moe_group, moe_route, MoeGroups};
pub use mtp::{concat_rows, hidden};
pub use norm::{rms_norm, rms_norm_feed, NormOut};
pub use rope::{rope_kv, rope_table, QkvExtras, RopeKvFold};
pub use short_conv::short_conv;
pub use softcap::softcap_rows;
pub use top_k::{draw, top_k, DRAW_WORDS, MAX_TOP_K, NUCLEUS_K, TOP_K_WORDS, UNDECIDED};

use crate::gpu::{Gpu, KernelStyle};

/// `Params` in WGSL, field for field: `shader::assemble` prepends it to every kernel.
pub const PARAMS_WGSL: &str = "struct Params { n_tokens: u32, rows: u32, first: u32, pad1: u32 }\n";

/// The uniform every per-token kernel reads, written when a pass's shape changes (declared for
/// the kernels by PARAMS_WGSL). Where each token is — its position and its sequence's block
/// table — is in the batch buffer (`BatchLayout`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    /// Tokens in the pass: a prefill chunk's, or a decode step's batch rows.
    pub n_tokens: u32,
    /// Rows the matrix-vector products take: a decode step's batch, or 1 (the last prefill
    /// token's normalized row, for its logits).
    pub rows: u32,
    /// The first row of the pass a dispatch takes (a chunk of a round's pass: its attention).
    pub first: u32,
    pub pad1: u32,
}

impl Params {
    pub fn new(n_tokens: usize, rows: usize) -> Self {
        Self { n_tokens: n_tokens as u32, rows: rows as u32, first: 0, pad1: 0 }
    }
}

/// Tokens per KV-cache block (page): a sequence's cache is a list of blocks of the pool
/// (`crate::kv_pool`), its block table in the batch buffer.
pub const KV_BLOCK: usize = 16;
/// Rows a decode step takes by default (`GpuOptions::max_batch`; a server asks for more, up to
/// BASE_ROWS): up to WIDE_ROWS rows the matrix-vector kernels read each weight once for every
/// MB rows, past them a decode step's projections are the prefill's tiled matrix products.
pub const MAX_BATCH: usize = 32;
/// Rows past which a decode step's projections and LM head are tiled matrix products (each
/// weight read once per 64 rows) rather than batched matrix-vector products (once per 8).
pub const WIDE_ROWS: usize = 32;
/// Rows a pass holds at least on any adapter (a prefill chunk), and a decode batch at most.
pub const BASE_ROWS: usize = 256;

/// Rows a pass takes by default (`Gpu::pass_rows`): 512 (llama.cpp's default micro-batch),
/// 1024 on GPU-style adapters whose buffers may be 8 GiB or more (a discrete GPU natively);
/// `PASS_ROWS_ENV` sets it for A/B measurements. A larger chunk dequantizes each weight tile
/// for more rows: on lavapipe a 1024-token prompt prefills at 35.7 tok/s in chunks of 256, 40.1
/// in chunks of 512 and 39.7 in one (README "Prefill chunks").
pub fn default_pass_rows(style: KernelStyle, max_buffer_size: u64) -> usize {
    match style {
        KernelStyle::Gpu if max_buffer_size >= 8 << 30 => 1024,
        _ => 512,
    }
}

/// The most rows a pass may be asked to take (`GpuOptions::pass_rows`, PASS_ROWS_ENV).
pub const MAX_PASS_ROWS: usize = 4096;

/// Rows a pass may be asked to take: a multiple of 64 from BASE_ROWS to MAX_PASS_ROWS.
pub fn valid_pass_rows(rows: usize) -> bool {
    (BASE_ROWS..=MAX_PASS_ROWS).contains(&rows) && rows % 64 == 0
}

/// The most rows of `row_bytes` each, up to `rows` and at least `BASE_ROWS`, one binding of
/// `max_binding` bytes holds (halving from `rows`): a pass's rows for a model's widest
/// activation row.
pub fn fit_rows(rows: usize, row_bytes: u64, max_binding: u64) -> usize {
    let mut r = rows.max(BASE_ROWS);
    while r > BASE_ROWS && r as u64 * row_bytes > max_binding {
        r = (r / 2).max(BASE_ROWS);
    }
    r
}

/// The widest attention head the kernels take (Gemma 4's full-attention layers: 512).
pub const MAX_HEAD_DIM: usize = 512;

/// How a kernel with an invocation per value of a head (rope_kv, the tiled prefill attention)
/// spreads a head of `hd` values (a multiple of 8, at most MAX_HEAD_DIM) over WebGPU's default
/// 256 invocations: (values per invocation, invocations). The invocations are even, so that an
/// invocation's values are all even or all odd indices (f16 K/V are stored a pair per word).
pub fn head_invocations(hd: u32) -> (u32, u32) {
    let per = hd.div_ceil(256);
    (per, hd / per)
}

/// Invocations of a kernel that reduces a row in one workgroup (argmax, rms_norm). GPUs: 256,
/// a tree of barriers. CPU adapters run a workgroup's SIMD groups as coroutines and switch
/// between all of them at each barrier (lavapipe 32 of 8 lanes, SwiftShader 64 of 4): there 8
/// invocations scan the row, one or two SIMD groups, three barriers. Which index or sum
/// comes out does not depend on it (argmax keeps the lowest index of the largest value; a norm's
/// sum is rounded in another order, within the kernel tests' bound).
pub(crate) fn reduce_width(gpu: &Gpu) -> u32 {
    match gpu.style {
        KernelStyle::Gpu => 256,
        KernelStyle::Cpu => 8,
    }
}

/// The batch buffer, u32 words: row r's (position, word where its sequence's block table starts)
/// at 2r and 2r + 1 for the pass's `rows`, then one block table of `max_blocks` words per
/// sequence slot (`kernels` read them through `row_pos`, `row_table`, `kv_slot`).
#[derive(Debug, Clone, Copy)]
pub struct BatchLayout {
    /// Rows a pass holds at most (`GpuModel::pass_rows`).
    pub rows: usize,
    pub max_blocks: usize,
    pub max_seqs: usize,
}

impl BatchLayout {
    /// The word where sequence slot `seq`'s block table starts.
    pub fn table(&self, seq: usize) -> usize {
        2 * self.rows + seq * self.max_blocks
    }
    pub fn words(&self) -> usize {
        self.table(self.max_seqs)
    }
}

/// Which of a pass's rows a dispatch works on, in a round's pass (`GpuModel::submit_round`):
/// all of them, its decode rows (the first ones: their attention, logits and argmax), or one of
/// its prompt chunks (that chunk's attention).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Segment {
    #[default]
    All,
    Decode,
    /// The decode rows while each attends over at most the model's short context
    /// (`kernels::decode_short_keys`): decode attention's one-dispatch kernel.
    ShortDecode,
    /// The decode rows otherwise: the two-pass kernels that the one-dispatch kernel stands for.
    LongDecode,
    Chunk(u8),
}

/// A round pass's row counts, per `Segment`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SegmentRows {
    pub all: u32,
    pub decode: u32,
    pub chunks: [u32; 8],
    /// Every decode row attends over at most the model's short context.
    pub short: bool,
}

impl SegmentRows {
    /// Every dispatch works on all `n` rows (any pass but a round's), at any context.
    pub fn all(n: u32) -> Self {
        Self { all: n, decode: n, chunks: [0; 8], short: false }
    }

    /// The same, each of the rows attending over at most `keys` keys, where decode attention
    /// takes one dispatch up to `short_keys` (0: never).
    pub fn at_keys(n: u32, keys: usize, short_keys: usize) -> Self {
        Self { short: keys <= short_keys, ..Self::all(n) }
    }

    pub fn of(&self, segment: Segment) -> u32 {
        match segment {
            Segment::All => self.all,
            Segment::Decode => self.decode,
            Segment::ShortDecode => self.decode * u32::from(self.short),
            Segment::LongDecode => self.decode * u32::from(!self.short),
            Segment::Chunk(k) => self.chunks[k as usize],
        }
    }
}

/// Workgroup counts; `tokens` scales one axis with the token count of the dispatch's segment.
#[derive(Debug, Clone, Copy)]
pub struct Groups {
    pub fixed: [u32; 3],
    /// (axis, tokens per workgroup): that axis gets ceil(n_tokens / per).
    pub tokens: Option<(usize, u32)>,
    pub segment: Segment,
}

impl Groups {
    pub fn fixed(x: u32, y: u32) -> Self {
        Self { fixed: [x, y, 1], tokens: None, segment: Segment::All }
    }
    pub fn per_token(x: u32, axis: usize, per: u32) -> Self {
        Self { fixed: [x, 1, 1], tokens: Some((axis, per)), segment: Segment::All }
    }
    /// `n` workgroups laid out in 2D when one axis cannot hold them.
    pub fn spread(n: u32, max_per_dim: u32) -> Self {
        let x = n.min(max_per_dim).max(1);
        Self::fixed(x, n.div_ceil(x))
    }
    pub fn resolve(&self, n_tokens: u32) -> [u32; 3] {
        let mut g = self.fixed;
        if let Some((axis, per)) = self.tokens {
            g[axis] = n_tokens.div_ceil(per);
        }
        g
    }
}

pub struct Dispatch {
    pub label: &'static str,
    pub pipeline: wgpu::ComputePipeline,
    pub bind_group: wgpu::BindGroup,
    pub groups: Groups,
    /// The bytes it must move: its entry in the traffic ledger.
    pub traffic: Traffic,
}

/// The least a dispatch must read and write for one decode token (the traffic ledger's entry):
/// each weight byte, activation and cache entry it touches counted once, as a kernel that reads
/// nothing twice from memory would. Summed over a step it is the step's bytes-time at a GPU's
/// bandwidth; set against `GpuModel::min_decode_traffic` it shows what a kernel wastes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Traffic {
    /// Weight bytes (matrices as stored on the GPU, norm and bias vectors, an embedding row).
    pub weights: u64,
    /// Activation bytes read and written.
    pub activations: u64,
    /// KV-cache bytes written.
    pub kv_written: u64,
    /// KV-cache bytes read per key attended.
    pub kv_per_key: u64,
    /// Bytes of decode attention's split records per split holding keys (written, then read).
    pub records_per_split: u64,
    /// The splits decode attention spreads the keys over at most (0 for every other dispatch).
    pub splits: usize,
    /// A sliding-window layer's window: the keys attended are the last `window`.
    pub window: Option<usize>,
}

impl Traffic {
    /// The ledger of a decode step at `seq` keys (the new token's included).
    pub fn at(&self, seq: usize) -> Ledger {
        let first = self.window.map_or(0, |w| seq.saturating_sub(w));
        let keys = (seq - first) as u64;
        // Only decode attention writes split records (its `splits` is never 0).
        let splits = if self.splits == 0 { 0 } else { decode_splits_used(seq - first, self.splits) as u64 };
        Ledger {
            weights: self.weights,
            activations: self.activations + self.records_per_split * splits,
            kv_read: self.kv_per_key * keys,
            kv_written: self.kv_written,
        }
    }
}

/// Bytes of a decode step by kind (see `Traffic`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Ledger {
    pub weights: u64,
    pub activations: u64,
    pub kv_read: u64,
    pub kv_written: u64,
}

impl Ledger {
    pub fn total(&self) -> u64 {
        self.weights + self.activations + self.kv_read + self.kv_written
    }
}

impl std::iter::Sum for Ledger {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Ledger::default(), |a, b| Ledger {
            weights: a.weights + b.weights,
            activations: a.activations + b.activations,
            kv_read: a.kv_read + b.kv_read,
            kv_written: a.kv_written + b.kv_written,
        })
    }
}

impl Dispatch {
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, n_tokens: u32) {
        self.encode_rows(pass, &SegmentRows::all(n_tokens));
    }

    /// Encodes it for its segment's rows; nothing when its segment has none.
    pub fn encode_rows(&self, pass: &mut wgpu::ComputePass<'_>, rows: &SegmentRows) {
        let n = rows.of(self.groups.segment);
        if n == 0 {
            return;
        }
        let [x, y, z] = self.groups.resolve(n);
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind_group, &[]);
        pass.dispatch_workgroups(x, y, z);
    }

    /// The same dispatch on `segment`'s rows.
    pub fn on(mut self, segment: Segment) -> Self {
        self.groups.segment = segment;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_takes_the_rows_asked_for_halved_until_its_widest_row_fits_a_binding() {
        // 1024 rows of 100,000 bytes are 102.4 MB, over 64 MiB (67.1 MB); 512 rows are 51.2 MB.
        assert_eq!(fit_rows(1024, 100_000, 64 << 20), 512);
        assert_eq!(fit_rows(1024, 65_536, 64 << 20), 1024);
        assert_eq!(fit_rows(768, 100_000, 64 << 20), 384);
        // Never fewer than BASE_ROWS: a model that does not fit then fails where its buffers are made.
        assert_eq!(fit_rows(1024, 1 << 20, 128 << 20), BASE_ROWS);
        assert_eq!(fit_rows(100, 4, 1 << 30), BASE_ROWS);
        assert_eq!(default_pass_rows(KernelStyle::Cpu, 16 << 30), 512);
        assert_eq!(default_pass_rows(KernelStyle::Gpu, 4 << 30), 512);
        assert_eq!(default_pass_rows(KernelStyle::Gpu, 8 << 30), 1024);
    }
}
