//! Wrappers of shaders/gemv.wgsl (decode, one token) and shaders/gemm.wgsl (prefill, tiled).

use super::norm::NORM_FED;
use super::{Dispatch, Groups, RopeKvFold, Traffic};
use crate::arch::Activation;
use crate::gpu::shader::{Needs, PipelineCache};
use crate::gpu::weights::{GemvShape, Linear};
use crate::gpu::{Gpu, KernelStyle};
use crate::quant::BlockFormat;

const GEMV: &str = include_str!("../../../shaders/gemv.wgsl");
const GEMV_ROPE_KV: &str = include_str!("../../../shaders/gemv_rope_kv.wgsl");
const QUANTIZE_X: &str = include_str!("../../../shaders/quantize_x.wgsl");
const GEMV_ARGMAX: &str = include_str!("../../../shaders/gemv_argmax.wgsl");
const GEMV_FEED: &str = include_str!("../../../shaders/gemv_feed.wgsl");
const GEMM: &str = include_str!("../../../shaders/gemm.wgsl");
const GEMM_F32: &str = include_str!("../../../shaders/gemm_f32.wgsl");
const GEMM_INT8: &str = include_str!("../../../shaders/gemm_int8.wgsl");
const GEMM_COOP: &str = include_str!("../../../shaders/gemm_coop.wgsl");

/// Adjacent rows one invocation of a CPU-style gemv takes (shaders/gemv.wgsl's CPU_ROWS).
const CPU_ROWS: u32 = 8;

/// Bytes of one int8 activation record (shaders/quantize_x.wgsl): two slices of 32 values as
/// bytes, then their scale and sum, padded to five vec4<u32>.
pub const INT8_RECORD_BYTES: u64 = 80;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Epilogue {
    Store,
    /// Adds to the output (residual connection).
    Add,
}

/// How a decode gemv's x is RMS-normalized on its way in (where it is not, x is read as it is).
#[derive(Clone, Copy)]
pub enum NormIn<'a> {
    /// x as its writer left it; the norm's weights and epsilon: every workgroup sums x's
    /// squares itself (GPU-style kernels).
    Fused(&'a wgpu::Buffer, f32),
    /// x is already times the norm's weights, written by a residual gemv that fed it (`Feed`)
    /// with the sums of its rows' squares (`sums`); epsilon (CPU-style kernels, a gemv of one
    /// batch row a pass: MB 1).
    Fed { sums: &'a wgpu::Buffer, eps: f32 },
    /// The same x, written by the norm's own pass (`kernels::rms_norm_feed`) with each row's RMS
    /// scale (`scales`) as a feeding gemv's reader works it out (CPU-style kernels).
    Scaled { scales: &'a wgpu::Buffer },
}

impl NormIn<'_> {
    fn eps(&self) -> f32 {
        match *self {
            NormIn::Fused(_, eps) | NormIn::Fed { eps, .. } => eps,
            NormIn::Scaled { .. } => 0.0,
        }
    }
}

/// What a CPU-style residual gemv writes for the gemv after the next RMSNorm (shaders/gemv_feed.wgsl;
/// that gemv takes `NormIn::Fed`): the norm's `weights`, x times them into `x`, and the sums of
/// each CPU_ROWS rows' squares into `sums` (`feed_sums_bytes`).
#[derive(Clone, Copy)]
pub struct Feed<'a> {
    pub weights: &'a wgpu::Buffer,
    pub x: &'a wgpu::Buffer,
    pub sums: &'a wgpu::Buffer,
}

/// Bytes of a `Feed`'s sums for `rows` rows of `cols` values: a sum of each 8 values, a row in
/// whole vec4s (shaders/norm_fed.wgsl's `sums_stride`).
pub fn feed_sums_bytes(rows: usize, cols: usize) -> u64 {
    (rows * cols.div_ceil(4 * CPU_ROWS as usize) * 4) as u64 * 4
}

/// The int8 records' scratch of a pass (`GpuModel`'s `xq`) and the rows it holds: a gemm over
/// `cols` columns takes int8 activations only where the rows' records fit it.
#[derive(Clone, Copy)]
pub struct Int8Scratch<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub rows: usize,
}

/// What a decode pass's matrix-vector products share: the pass's params (`rows` of x to take)
/// and MB, the batch rows taken per pass over the weights (1 for a single sequence's step), and
/// the int8 activations' scratch (`takes_int8`; None: f32 activations everywhere).
#[derive(Clone, Copy)]
pub struct GemvBatch<'a> {
    pub params: &'a wgpu::Buffer,
    pub mb: u32,
    pub xq: Option<&'a wgpu::Buffer>,
}

/// Whether a gemv or gemm over `format`'s weights takes int8 activations on `gpu`: GPU-style
/// kernels (`Gpu::int8`) over 32-value integer blocks.
pub fn takes_int8(gpu: &Gpu, format: &BlockFormat) -> bool {
    gpu.int8 && gpu.style == KernelStyle::Gpu && format.int8_fn().is_some()
}

/// Bytes of int8 activation records for `rows` rows of `cols` values.
pub fn int8_scratch_bytes(rows: usize, cols: usize) -> u64 {
    (rows * cols.div_ceil(32)) as u64 * INT8_RECORD_BYTES
}

/// y = W x for each of the pass's rows of x (rows of `y_stride` in y), or W rms_norm(x) with
/// `norm`. Gated-pair parts write act(gate) * up; others store or add.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    batch: GemvBatch,
    w: &Linear,
    act: Activation,
    epilogue: Epilogue,
    norm: Option<NormIn>,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    y_stride: usize,
) -> Vec<Dispatch> {
    gemv_with(gpu, cache, batch, w, act, epilogue, Extra::None, norm, x, y, y_stride)
}

/// A residual `gemv` (y += W x) on CPU-style kernels that also writes `feed` for the gemv after
/// the next RMSNorm, in place of the norm's pass. W's parts start at multiples of 8 rows.
#[allow(clippy::too_many_arguments)]
pub fn gemv_feeding(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    batch: GemvBatch,
    w: &Linear,
    feed: Feed,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    y_stride: usize,
) -> Vec<Dispatch> {
    assert!(gpu.style == KernelStyle::Cpu, "a gemv feeds the next norm on CPU-style kernels only");
    let (act, add) = (Activation::Silu, Epilogue::Add);
    gemv_with(gpu, cache, batch, w, act, add, Extra::Feed(feed), None, x, y, y_stride)
}

/// An lm_head's `gemv` (stored, `norm` as there) that also does the argmax's first pass into
/// `records` (`kernels::argmax_records` finishes it).
#[allow(clippy::too_many_arguments)]
pub fn gemv_argmax(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    batch: GemvBatch,
    w: &Linear,
    records: ArgmaxRecords,
    norm: Option<NormIn>,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    y_stride: usize,
) -> Vec<Dispatch> {
    let (act, store) = (Activation::Silu, Epilogue::Store);
    gemv_with(gpu, cache, batch, w, act, store, Extra::Argmax(records), norm, x, y, y_stride)
}

/// The decode step's q|k|v projection doing rope_kv's work in its epilogue (when
/// `fold.applies`): q rotated into y, k rotated and v into the cache.
#[allow(clippy::too_many_arguments)]
pub fn gemv_rope_kv(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    batch: GemvBatch,
    w: &Linear,
    fold: &RopeKvFold,
    norm: Option<NormIn>,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    y_stride: usize,
) -> Vec<Dispatch> {
    let (act, store) = (Activation::Silu, Epilogue::Store);
    gemv_with(gpu, cache, batch, w, act, store, Extra::RopeKv(fold), norm, x, y, y_stride)
}

/// What a gemv does besides its epilogue (each with its own bindings from 5 on).
#[derive(Clone, Copy)]
enum Extra<'a> {
    None,
    RopeKv(&'a RopeKvFold<'a>),
    Argmax(ArgmaxRecords<'a>),
    Feed(Feed<'a>),
}

/// The decode gemv's program for one part: the WGSL kernel, what it needs prepended, its
/// constants and its overrides (`gemv`'s pipelines; `gpu::spirv`'s instruction counts).
pub struct GemvProgram {
    pub kernel: String,
    pub needs: Needs,
    pub consts: Vec<(&'static str, u32)>,
    pub overrides: Vec<(&'static str, f64)>,
    /// The function the weight loop reads weights through, and the values one call returns.
    pub weight_fn: (&'static str, usize),
}

impl GemvProgram {
    /// `lanes` invocations a row (`Gpu::gemv_lanes`), `mb` batch rows a pass over the weights,
    /// `norm`: how x is normalized (`NormIn`), `feed`: the residual epilogue feeds the next
    /// norm (`gemv_feeding`), `int8`: x is int8 records (`takes_int8`; normalized already).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        p: GemvShape,
        lanes: u32,
        mb: u32,
        act: Activation,
        epilogue: Epilogue,
        fold: Option<&RopeKvFold>,
        norm: Option<NormIn>,
        feed: bool,
        y_stride: usize,
        int8: bool,
    ) -> Self {
        let nw = match (int8, norm) {
            (true, _) => NW_INT8,
            (false, Some(NormIn::Fed { .. })) => NW_FED,
            (false, Some(NormIn::Scaled { .. })) => NW_SCALED,
            (false, _) => NW_NORM,
        };
        let rope_kv = fold.map_or(NO_ROPE_KV, |_| GEMV_ROPE_KV);
        let kernel = [GEMV, NORM_FED, nw, rope_kv, NO_ARGMAX, if feed { GEMV_FEED } else { NO_FEED }].concat();
        let mut consts = vec![("MB", mb), ("CPU_ROWS", CPU_ROWS)];
        consts.extend(fold.map(|f| f.consts()).into_iter().flatten());
        let mode = match (p.pair, epilogue, fold) {
            (_, _, Some(_)) => 3,
            (true, ..) => 2,
            (false, Epilogue::Add, _) => 1,
            (false, Epilogue::Store, _) => 0,
        };
        let overrides = vec![
            ("COLS", p.cols as f64),
            ("ROW_WORDS", p.row_words as f64),
            ("ROW_COUNT", p.rows as f64),
            ("Y_STRIDE", y_stride as f64),
            ("OUT", p.out as f64),
            ("EPILOGUE", mode as f64),
            ("LANES", lanes as f64),
            ("NORM", (matches!(norm, Some(NormIn::Fused(..))) && !int8) as u32 as f64),
            ("NORM_FED", matches!(norm, Some(NormIn::Fed { .. })) as u32 as f64),
            ("NORM_SCALED", matches!(norm, Some(NormIn::Scaled { .. })) as u32 as f64),
            ("EPS", norm.map_or(0.0, |n| n.eps() as f64)),
            ("INT8", int8 as u32 as f64),
        ];
        let needs = Needs {
            weights: Some(p.format),
            reduce: true,
            act: Some(if p.pair { act } else { Activation::Silu }),
            kv_write: fold.is_some(),
            batch: fold.is_some(),
            rope: fold.is_some(),
            int8: true,
            ..Default::default()
        };
        let weight_fn = if int8 { ("q8w", 32) } else { ("dq8", 8) };
        Self { kernel, needs, consts, overrides, weight_fn }
    }

    /// The program that also writes the argmax's records (shaders/gemv_argmax.wgsl): `per_row`
    /// a batch row, this part's from `first` on.
    fn with_argmax(mut self, per_row: usize, first: usize) -> Self {
        self.kernel = self.kernel.replace(NO_ARGMAX, GEMV_ARGMAX);
        self.overrides.extend([("RECORDS", per_row as f64), ("RECORD_OUT", first as f64)]);
        self
    }
}

/// gemv.wgsl's bindings 1 and 3 as x and the fused norm's weights (vec4 bits; any buffer
/// without the norm).
const NW_NORM: &str = "@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;\n\
    @group(0) @binding(3) var<storage, read> nw: array<vec4<u32>>;\n\
    fn x_vec(i: u32) -> vec4<f32> { return x[i]; }\n\
    fn norm_weights(i: u32) -> vec4<f32> { return bitcast<vec4<f32>>(nw[i]); }\n\
    fn norm_sums4(i: u32) -> vec4<f32> { return vec4<f32>(); }\n\
    fn row_scale(m: u32) -> f32 { return 1.0; }\n\
    fn weight_vec(i: u32) -> vec4<u32> { return vec4<u32>(); }\n\
    fn x_record(i: u32) -> XRec { return XRec(); }\n";

/// gemv.wgsl's bindings 1 and 3 as x and a fed norm's sums (NORM_FED; as vec4s: a vector's
/// element picked at run time, or four loads, would cost a CPU adapter more).
const NW_FED: &str = "@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;\n\
    @group(0) @binding(3) var<storage, read> sums: array<vec4<f32>>;\n\
    fn x_vec(i: u32) -> vec4<f32> { return x[i]; }\n\
    fn norm_weights(i: u32) -> vec4<f32> { return vec4<f32>(1.0); }\n\
    fn norm_sums4(i: u32) -> vec4<f32> { return sums[i]; }\n\
    fn row_scale(m: u32) -> f32 { return 1.0; }\n\
    fn weight_vec(i: u32) -> vec4<u32> { return vec4<u32>(); }\n\
    fn x_record(i: u32) -> XRec { return XRec(); }\n";

/// gemv.wgsl's bindings 1 and 3 as x and its rows' scales (NORM_SCALED).
const NW_SCALED: &str = "@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;\n\
    @group(0) @binding(3) var<storage, read> scales: array<f32>;\n\
    fn x_vec(i: u32) -> vec4<f32> { return x[i]; }\n\
    fn norm_weights(i: u32) -> vec4<f32> { return vec4<f32>(1.0); }\n\
    fn norm_sums4(i: u32) -> vec4<f32> { return vec4<f32>(); }\n\
    fn row_scale(m: u32) -> f32 { return scales[m]; }\n\
    fn weight_vec(i: u32) -> vec4<u32> { return vec4<u32>(); }\n\
    fn x_record(i: u32) -> XRec { return XRec(); }\n";

/// gemv.wgsl's bindings 1 and 3 for INT8: the weights again as vec4s (shaders/quant/int8.wgsl's
/// `body4`) and the activation records (int8.wgsl's XRec), each loaded whole.
const NW_INT8: &str = "@group(0) @binding(1) var<storage, read> wv: array<vec4<u32>>;\n\
    @group(0) @binding(3) var<storage, read> nw: array<XRec>;\n\
    fn x_vec(i: u32) -> vec4<f32> { return vec4<f32>(); }\n\
    fn norm_weights(i: u32) -> vec4<f32> { return vec4<f32>(1.0); }\n\
    fn norm_sums4(i: u32) -> vec4<f32> { return vec4<f32>(); }\n\
    fn row_scale(m: u32) -> f32 { return 1.0; }\n\
    fn weight_vec(i: u32) -> vec4<u32> { return wv[i]; }\n\
    fn x_record(i: u32) -> XRec { return nw[i]; }\n";

/// Subgroups in a workgroup of shaders/gemm_coop.wgsl with matrices of `side` (`Gpu::coop`): one
/// for each 2 side x 2 side block of its 64 x 64 tile.
pub(crate) fn coop_subgroups(side: u32) -> u32 {
    (32 / side).pow(2)
}

/// shaders/gemm.wgsl and gemm_coop.wgsl with the matrices' side CT and types declared, for
/// `Gpu::coop`'s side (`gemm` sets the part's overrides and WG: `coop_subgroups` subgroups).
pub(crate) fn coop_gemm_kernel(side: u32) -> String {
    let types = format!(
        "const CT: u32 = {side}u;\n\
         alias CoopA = coop_mat{side}x{side}<f16, A>;\n\
         alias CoopB = coop_mat{side}x{side}<f16, B>;\n\
         alias CoopC = coop_mat{side}x{side}<f32, C>;\n"
    );
    [GEMM, &types, GEMM_COOP].concat()
}

/// gemm_f32.wgsl's NORM_FED scales (binding 5, a float a token).
const GEMM_SCALES: &str = "@group(0) @binding(5) var<storage, read> row_scales: array<f32>;\n\
    fn row_scale(t: u32) -> f32 { return row_scales[t]; }\n";

/// gemm_f32.wgsl without NORM_FED.
const NO_GEMM_SCALES: &str = "fn row_scale(t: u32) -> f32 { return 1.0; }\n";

/// gemv.wgsl without FEED: nothing written for a next norm.
const NO_FEED: &str = "const FEED: bool = false;\n\
    fn feed_row(m: u32, row: u32, v: f32) {}\n\
    fn feed_sum(m: u32, part: u32, ss: f32) {}\n";

/// gemv.wgsl without ARGMAX: the argmax's record functions do nothing.
const NO_ARGMAX: &str = "const ARGMAX: bool = false;\n\
    fn argmax_non_finite(v: f32) -> bool { return false; }\n\
    fn argmax_store(m: u32, group: u32, v: f32, row: u32) {}\n\
    fn argmax_rows(m: u32, store: bool, group: u32, lr: u32, has: bool, v: f32, r: u32, li: u32) {}\n";

/// Where an lm_head gemv writes the argmax's first pass (`gemv_argmax`; read by
/// `kernels::argmax_records`): the buffer, and the records a batch row takes.
#[derive(Clone, Copy)]
pub struct ArgmaxRecords<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub per_row: usize,
}

/// Weight rows one argmax record stands for: a GPU-style gemv workgroup's rows, a CPU-style
/// invocation's.
fn argmax_group_rows(gpu: &Gpu) -> usize {
    match gpu.gemv_lanes() {
        1 => CPU_ROWS as usize,
        lanes => 256 / lanes as usize,
    }
}

/// The argmax records a batch row of `w`'s gemv writes (each part's rows in whole groups).
pub fn argmax_records_per_row(gpu: &Gpu, w: &Linear) -> usize {
    let g = argmax_group_rows(gpu);
    w.parts.iter().map(|p| p.rows.div_ceil(g)).sum()
}

/// gemv.wgsl's epilogue 3 when not folding RoPE in: it calls nothing.
const NO_ROPE_KV: &str = "fn rope_kv_pair(m: u32, row: u32, a: f32, b: f32) {}\n";

#[allow(clippy::too_many_arguments)]
fn gemv_with(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    batch: GemvBatch,
    w: &Linear,
    act: Activation,
    epilogue: Epilogue,
    extra: Extra,
    norm: Option<NormIn>,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    y_stride: usize,
) -> Vec<Dispatch> {
    let cols = w.parts.first().map_or(0, |p| p.cols);
    // Rows the pass may take: those of a batch rounded up to MB (a GPU's gemv reads MB at once).
    let rows = gpu.max_batch.next_multiple_of(batch.mb as usize);
    // A fed x (CPU-style kernels) is never quantized: int8 activations are the GPU style's.
    let fed = matches!(norm, Some(NormIn::Fed { .. } | NormIn::Scaled { .. }));
    assert!(!matches!(norm, Some(NormIn::Fed { .. })) || batch.mb == 1, "a gemv adds a fed norm's sums for MB 1");
    let xq = batch.xq.filter(|xq| !fed && xq.size() >= int8_scratch_bytes(rows, cols) && cols % 32 == 0);
    let int8 = |p: &crate::gpu::weights::Part| xq.is_some() && takes_int8(gpu, p.format);
    let mut ops = Vec::new();
    if let Some(xq) = xq.filter(|_| w.parts.iter().any(int8)) {
        let fused = norm.and_then(|n| match n {
            NormIn::Fused(weights, eps) => Some((weights, eps)),
            NormIn::Fed { .. } | NormIn::Scaled { .. } => None,
        });
        ops.push(quantize_x(gpu, cache, batch.params, cols, Some(rows), fused, x, xq));
    }
    let (fold, argmax, feed) = match extra {
        Extra::None => (None, None, None),
        Extra::RopeKv(f) => (Some(f), None, None),
        Extra::Argmax(a) => (None, Some(a), None),
        Extra::Feed(f) => (None, None, Some(f)),
    };
    let group_rows = argmax_group_rows(gpu);
    let mut first_record = 0;
    for p in &w.parts {
        let shape = p.shape;
        let int8 = int8(p);
        assert!(feed.is_none() || p.out % CPU_ROWS as usize == 0, "a fed part starts at a multiple of CPU_ROWS");
        let (lanes, mb) = (gpu.gemv_lanes(), batch.mb);
        let mut program = GemvProgram::new(shape, lanes, mb, act, epilogue, fold, norm, feed.is_some(), y_stride, int8);
        program.overrides.push(("UNROLL_ROWS", gpu.unroll_rows as u32 as f64));
        let records = p.rows.div_ceil(group_rows);
        if let Some(a) = argmax {
            program = program.with_argmax(a.per_row, first_record);
            first_record += records;
        }
        let pipeline = cache.get(gpu, "gemv", &program.kernel, program.needs, &program.consts, &program.overrides);
        // INT8: binding 1 is the weights as vec4s (left out where q8w does not read them so),
        // binding 3 the records. Binding 3 is otherwise the norm's weights (fused, or those a
        // feed multiplies by) or a fed x's sums.
        let (x, nw) = match xq {
            Some(xq) if int8 => (p.format.int8_reads_vec4s().then_some(&p.buffer), xq),
            _ => (
                Some(x),
                match (norm, feed) {
                    (Some(NormIn::Fused(weights, _)), _) | (None, Some(Feed { weights, .. })) => weights,
                    (Some(NormIn::Fed { sums, .. }), _) => sums,
                    (Some(NormIn::Scaled { scales }), _) => scales,
                    (None, None) => x,
                },
            ),
        };
        let mut bindings = vec![(0, &p.buffer), (2, y), (3, nw), (4, batch.params)];
        bindings.extend(x.map(|x| (1, x)));
        match (fold, argmax, feed) {
            (Some(f), ..) => bindings.extend([(5, f.table), (6, f.k_cache), (7, f.v_cache), (8, f.batch)]),
            (_, Some(a), _) => bindings.push((5, a.buffer)),
            (.., Some(f)) => bindings.extend([(5, f.x), (6, f.sums)]),
            (None, None, None) => {}
        }
        let bind_group = gpu.bind_group_at("gemv", &pipeline, &bindings);
        let rows_per_group = 256 / gpu.gemv_lanes();
        let groups =
            Groups::spread((p.rows as u32).div_ceil(rows_per_group), gpu.limits.max_compute_workgroups_per_dimension);
        // The part's rows, x (or its int8 records; the norm weights, or a fed x's sums), y
        // written (and read first when added to); folded, what rope_kv would have moved instead
        // of y; feeding, the norm's weights read and x times them and its sums written.
        let out_rows = p.rows as u64 * 4 + argmax.map_or(0, |_| records as u64 * 8);
        let sums = |rows: usize| rows.div_ceil(CPU_ROWS as usize) as u64 * 4;
        // A fed norm's sums, or a row's scale, read.
        let norm_bytes = match norm {
            Some(NormIn::Fed { .. }) => feed_sums_bytes(1, p.cols),
            Some(NormIn::Scaled { .. }) => 4,
            _ => 0,
        };
        let outputs = match (fold, feed) {
            (Some(f), _) => f.traffic(p.out, p.rows, gpu.kv_bytes()),
            (None, Some(_)) => {
                Traffic { weights: 4 * p.rows as u64, activations: 3 * out_rows + sums(p.rows), ..Default::default() }
            }
            (None, None) => Traffic {
                activations: if epilogue == Epilogue::Add && !p.pair { 2 * out_rows } else { out_rows },
                ..Default::default()
            },
        };
        let traffic = match int8 {
            true => Traffic {
                weights: p.buffer.size(),
                activations: int8_scratch_bytes(1, p.cols) + outputs.activations,
                ..outputs
            },
            false => Traffic {
                weights: p.buffer.size()
                    + outputs.weights
                    + matches!(norm, Some(NormIn::Fused(..))) as u64 * 4 * p.cols as u64,
                activations: 4 * p.cols as u64 + norm_bytes + outputs.activations,
                ..outputs
            },
        };
        ops.push(Dispatch { label: "gemv", pipeline, bind_group, groups, traffic });
    }
    ops
}

/// x's rows as int8 records in `xq` (shaders/quantize_x.wgsl), RMS-normalized with `norm`: a
/// workgroup for each of `rows` rows (a decode pass's: those past its `rows` return), or with
/// None for each of the pass's tokens (a prefill gemm's).
#[allow(clippy::too_many_arguments)]
fn quantize_x(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    cols: usize,
    rows: Option<usize>,
    norm: Option<(&wgpu::Buffer, f32)>,
    x: &wgpu::Buffer,
    xq: &wgpu::Buffer,
) -> Dispatch {
    let overrides = [
        ("COLS", cols as f64),
        ("NORM", norm.is_some() as u32 as f64),
        ("EPS", norm.map_or(0.0, |n| n.1 as f64)),
        ("LANES", crate::gpu::device::GPU_LANES as f64),
        ("TOKENS", rows.is_none() as u32 as f64),
    ];
    let needs = Needs { reduce: true, ..Default::default() };
    let pipeline = cache.get(gpu, "quantize_x", QUANTIZE_X, needs, &[], &overrides);
    let nw = norm.map_or(x, |n| n.0);
    let bind_group = gpu.bind_group("quantize_x", &pipeline, &[x, nw, xq, params]);
    let groups = match rows {
        Some(rows) => Groups::spread(rows as u32, gpu.limits.max_compute_workgroups_per_dimension),
        None => Groups::per_token(1, 0, 1),
    };
    Dispatch {
        label: "quantize_x",
        pipeline,
        bind_group,
        groups,
        // A row's values (and the norm weights), its records.
        traffic: Traffic {
            weights: norm.map_or(0, |_| 4 * cols as u64),
            activations: 4 * cols as u64 + int8_scratch_bytes(1, cols),
            ..Default::default()
        },
    }
}

/// Y = X W^T for the pass's tokens; `y_stride` is Y's row length. Gated-pair parts write gate
/// values to columns [0, rows) and up values to [rows, 2 rows) (act_mul follows). With `xq`
/// (scratch for the pass's rows of X's records), parts that `takes_int8` read X quantized into it
/// (shaders/gemm_int8.wgsl), the others X itself (shaders/gemm_f32.wgsl).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    xq: Option<Int8Scratch<'_>>,
    w: &Linear,
    epilogue: Epilogue,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    y_stride: usize,
) -> Vec<Dispatch> {
    gemm_normed(gpu, cache, params, xq, w, epilogue, None, x, y, y_stride)
}

/// `gemm` of a fed x (CPU-style kernels: x times a norm's weights, written by
/// `kernels::rms_norm_feed` with each row's RMS scale into `scales`), or of x as it is with None.
#[allow(clippy::too_many_arguments)]
pub fn gemm_normed(
    gpu: &Gpu,
    cache: &mut PipelineCache,
    params: &wgpu::Buffer,
    xq: Option<Int8Scratch<'_>>,
    w: &Linear,
    epilogue: Epilogue,
    scales: Option<&wgpu::Buffer>,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    y_stride: usize,
) -> Vec<Dispatch> {
    assert!(scales.is_none() || gpu.style == KernelStyle::Cpu, "a gemm takes a fed norm on CPU-style kernels only");
    let cols = w.parts.first().map_or(0, |p| p.cols);
    let xq = xq.filter(|s| s.buffer.size() >= int8_scratch_bytes(s.rows, cols) && cols % 32 == 0).map(|s| s.buffer);
    let int8 = |p: &crate::gpu::weights::Part| xq.is_some() && takes_int8(gpu, p.format);
    let mut ops = Vec::new();
    if let Some(xq) = xq.filter(|_| w.parts.iter().any(int8)) {
        ops.push(quantize_x(gpu, cache, params, cols, None, None, x, xq));
    }
    for p in &w.parts {
        let rows = if p.pair { 2 * p.rows } else { p.rows };
        let int8 = int8(p);
        let cpu = gpu.style == KernelStyle::Cpu;
        let mut overrides = vec![
            ("COLS", p.cols as f64),
            ("ROW_WORDS", p.row_words as f64),
            ("ROW_COUNT", rows as f64),
            ("Y_STRIDE", y_stride as f64),
            ("OUT", p.out as f64),
            ("EPILOGUE", (epilogue == Epilogue::Add) as u32 as f64),
            ("PAIR", p.pair as u32 as f64),
            ("HALF", p.rows as f64),
            ("PAIR_OFFSET", w.rows as f64),
        ];
        // GPU-style f32-activation parts on cooperative matrices where the device has them.
        let coop = gpu.coop.filter(|_| !int8 && !cpu);
        if let Some(side) = coop {
            overrides.push(("WG", coop_subgroups(side) as f64 * gpu.adapter_info.subgroup_max_size as f64));
        } else if !int8 {
            overrides.extend([
                ("DIRECT", cpu as u32 as f64),
                ("WG", if cpu { 64.0 } else { 256.0 }),
                ("UNROLL_ROWS", gpu.unroll_rows as u32 as f64),
                ("NORM_FED", scales.is_some() as u32 as f64),
            ]);
        }
        let kernel = match (int8, coop) {
            (true, _) => [GEMM, GEMM_INT8].concat(),
            (false, Some(side)) => coop_gemm_kernel(side),
            (false, None) => [GEMM, GEMM_F32, if scales.is_some() { GEMM_SCALES } else { NO_GEMM_SCALES }].concat(),
        };
        let needs = Needs { weights: Some(p.format), int8, coop: coop.is_some(), ..Default::default() };
        let pipeline = cache.get(gpu, "gemm", &kernel, needs, &[], &overrides);
        let xb = match xq {
            Some(xq) if int8 => xq,
            _ => x,
        };
        let mut bindings = vec![(0, params), (1, &p.buffer), (2, xb), (3, y)];
        if int8 && p.format.int8_reads_vec4s() {
            bindings.push((4, &p.buffer));
        }
        bindings.extend(scales.map(|s| (5, s)));
        let bind_group = gpu.bind_group_at("gemm", &pipeline, &bindings);
        let x_bytes = if int8 { int8_scratch_bytes(1, p.cols) } else { 4 * p.cols as u64 };
        ops.push(Dispatch {
            label: "gemm",
            pipeline,
            bind_group,
            groups: Groups::per_token((rows as u32).div_ceil(64), 1, 64),
            traffic: Traffic { weights: p.buffer.size(), activations: x_bytes + 4 * rows as u64, ..Default::default() },
        });
    }
    ops
}
