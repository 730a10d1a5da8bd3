//! Every GPU kernel against its CPU reference op on random inputs, on the forced-f32 path and
//! on the adapter's own path (f16 KV cache and subgroups where available), each with the GPU
//! and the CPU-adapter kernel variants. Tolerances are stated per test: f32 sums in another
//! order differ by a few ulps of the magnitudes summed. The same tests run natively (lavapipe
//! in CI) and in headless Chromium's WebGPU (wasm-bindgen-test).

#[cfg(target_arch = "wasm32")]
wasm_bindgen_test::wasm_bindgen_test_configure!(run_in_browser);

/// A test body that runs natively under pollster and in the browser as an async test.
macro_rules! gpu_test {
    (async fn $name:ident() $body:block) => {
        #[cfg(not(target_arch = "wasm32"))]
        #[test]
        fn $name() {
            pollster::block_on(async $body)
        }
        #[cfg(target_arch = "wasm32")]
        #[wasm_bindgen_test::wasm_bindgen_test]
        async fn $name() $body
    };
}

use half::f16;
use webgpu_llm::arch::{Activation, Experts, Rope, RopeStyle};
use webgpu_llm::gguf::{GgmlType, TensorInfo};
use webgpu_llm::gpu::kernels::{
    self, BatchLayout, Dispatch, Epilogue, Feed, GemvBatch, MoeGroups, NormIn, NormOut, Params, QkvExtras, SegmentRows,
    KV_BLOCK,
};
use webgpu_llm::gpu::shader::PipelineCache;
use webgpu_llm::gpu::weights::{Linear, Rows};
use webgpu_llm::gpu::{Gpu, GpuOptions, KernelStyle, KvStore};
use webgpu_llm::model::reference::{self, AttentionKind};
use webgpu_llm::model::ModelConfig;
use webgpu_llm::quant::dequantize;
use webgpu_llm::quant::FORMATS;
use webgpu_llm::sampling::{Rng, TAIL_REL_ERROR};

struct Harness {
    gpu: Gpu,
    /// The kernel style the adapter runs in the engine (`gpu.style` before a test sets another).
    own: KernelStyle,
    cache: PipelineCache,
    params: wgpu::Buffer,
    /// The rows' positions and block tables (`kernels::BatchLayout`).
    batch: wgpu::Buffer,
}

/// Block tables of the tests' caches: sequence s of a cache of `blocks` blocks holds its block
/// i in block (blocks - 1 - i + s * 7) % blocks — reversed and shifted, so that a kernel reading
/// positions instead of blocks fails (sequences do not share blocks when the test says so).
#[derive(Clone, Copy)]
struct Paging {
    blocks: usize,
}

impl Paging {
    fn for_keys(keys: usize) -> Self {
        Self { blocks: keys.div_ceil(KV_BLOCK) }
    }
    /// Cache rows the tests' buffers hold: whole blocks.
    fn rows(&self) -> usize {
        self.blocks * KV_BLOCK
    }
    fn block(&self, seq: usize, i: usize) -> usize {
        (self.blocks - 1 - i + seq * 7) % self.blocks
    }
    /// The cache row of position `pos` of sequence `seq`.
    fn row(&self, seq: usize, pos: usize) -> usize {
        self.block(seq, pos / KV_BLOCK) * KV_BLOCK + pos % KV_BLOCK
    }
    /// A cache's values (rows of `width`) in sequence `seq`'s position order.
    fn gather(&self, seq: usize, values: &[f32], width: usize, positions: usize) -> Vec<f32> {
        (0..positions).flat_map(|p| values[self.row(seq, p) * width..][..width].to_vec()).collect()
    }
}

const LAYOUT: BatchLayout = BatchLayout { rows: kernels::BASE_ROWS, max_blocks: 2048, max_seqs: 8 };

impl Harness {
    async fn new(force_f32: bool) -> Self {
        Self::with(GpuOptions { force_f32, ..Default::default() }).await
    }
    async fn with(options: GpuOptions) -> Self {
        Self::of(Gpu::new(options).await.expect("a GPU adapter (lavapipe in CI, WebGPU in the browser)"))
    }
    fn of(gpu: Gpu) -> Self {
        let params = gpu.uniform("params", 16);
        let batch = gpu.storage("batch", LAYOUT.words() as u64 * 4).unwrap();
        let own = gpu.style;
        let h = Self { gpu, own, cache: PipelineCache::default(), params, batch };
        h.set(1, 0, 16);
        h
    }
    /// The forced-f32 path and the adapter's own, each with both kernel styles; the adapter's
    /// own only where it has shader-f16 or subgroups (without either its kernels are the forced
    /// path's: SwiftShader; its packed KV cache is kv_paths' business). The forced path's CPU
    /// style takes the other form of the CPU-style gemv's rows (`Gpu::unroll_rows`), so that
    /// both run on either CPU adapter.
    async fn paths() -> Vec<Self> {
        let mut all = Vec::new();
        for force_f32 in [true, false] {
            for style in [KernelStyle::Gpu, KernelStyle::Cpu] {
                let mut h = Self::new(force_f32).await;
                if !force_f32 && !h.gpu.f16 && !h.gpu.subgroups {
                    return all;
                }
                h.gpu.style = style;
                h.gpu.unroll_rows = match (force_f32, style) {
                    (true, KernelStyle::Cpu) => !h.gpu.unroll_rows,
                    _ => h.gpu.unroll_rows,
                };
                all.push(h);
            }
        }
        all
    }
    /// A pass of `n_tokens` at positions `start..` of sequence 0 in a cache of `keys` positions
    /// (paged as `Paging::for_keys(keys)` says).
    fn set(&self, n_tokens: usize, start: usize, keys: usize) -> Paging {
        let rows: Vec<(usize, usize)> = (0..n_tokens).map(|t| (0, start + t)).collect();
        self.set_rows(&rows, 1, keys)
    }
    /// A pass whose row i is position `rows[i].1` of sequence `rows[i].0`; matrix-vector
    /// products take `gemv_rows` rows.
    fn set_rows(&self, rows: &[(usize, usize)], gemv_rows: usize, keys: usize) -> Paging {
        let paging = Paging::for_keys(keys);
        let p = Params::new(rows.len(), gemv_rows);
        self.gpu.queue.write_buffer(&self.params, 0, bytemuck::bytes_of(&p));
        let mut words: Vec<u32> = rows.iter().flat_map(|&(seq, pos)| [pos as u32, LAYOUT.table(seq) as u32]).collect();
        words.resize(LAYOUT.table(0), 0);
        for seq in 0..LAYOUT.max_seqs {
            words.extend(
                (0..LAYOUT.max_blocks).map(|i| if i < paging.blocks { paging.block(seq, i) as u32 } else { 0 }),
            );
        }
        self.gpu.queue.write_buffer(&self.batch, 0, bytemuck::cast_slice(&words));
        paging
    }
    fn buf(&self, values: &[f32]) -> wgpu::Buffer {
        self.gpu.storage_init("test", bytemuck::cast_slice(values)).unwrap()
    }
    fn u32_buf(&self, values: &[u32]) -> wgpu::Buffer {
        self.gpu.storage_init("test", bytemuck::cast_slice(values)).unwrap()
    }
    /// A KV-cache buffer holding `values` in the path's storage type; returns it with the values
    /// as the GPU sees them (rounded to f16 on the f16 path).
    fn kv_buf(&self, values: &[f32]) -> (wgpu::Buffer, Vec<f32>) {
        // f16 and packed f16 have the same bytes: value 2i in the low half of word i.
        if self.gpu.kv_bytes() == 2 {
            let h: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
            let bytes: Vec<u8> = h.iter().flat_map(|v| v.to_le_bytes()).collect();
            (self.gpu.storage_init("kv", &bytes).unwrap(), h.iter().map(|v| v.to_f32()).collect())
        } else {
            (self.buf(values), values.to_vec())
        }
    }
    async fn read_kv(&self, b: &wgpu::Buffer, n: usize) -> Vec<f32> {
        if self.gpu.kv_bytes() == 2 {
            let bytes = self.gpu.read_buffer(b, n as u64 * 2).await.unwrap();
            bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
        } else {
            self.read(b, n).await
        }
    }
    fn run(&self, ops: &[Dispatch], n_tokens: usize) {
        self.run_rows(ops, &SegmentRows::all(n_tokens as u32));
    }
    /// `run` with the rows' segments as a pass has them (decode attention at short contexts).
    fn run_rows(&self, ops: &[Dispatch], rows: &SegmentRows) {
        let mut enc = self.gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            ops.iter().for_each(|op| op.encode_rows(&mut pass, rows));
        }
        self.gpu.submit(enc);
    }
    /// Zeros `n` floats of `b`.
    fn clear(&self, b: &wgpu::Buffer, n: usize) {
        self.gpu.queue.write_buffer(b, 0, bytemuck::cast_slice(&vec![0f32; n]));
    }
    async fn read(&self, b: &wgpu::Buffer, n: usize) -> Vec<f32> {
        let v = self.gpu.read_f32(b, n).await.unwrap();
        self.gpu.check().unwrap();
        v
    }
    fn path(&self) -> String {
        let p = if self.gpu.f16 || self.gpu.subgroups { "f16/subgroup path" } else { "f32 path" };
        let rows = if self.gpu.style == KernelStyle::Cpu && self.gpu.unroll_rows { ", unrolled rows" } else { "" };
        format!("{p}, {:?} KV, {:?} kernels{rows}", self.gpu.kv, self.gpu.style)
    }
    /// The KV cache's storages: f32 (forced path), the adapter's (f16 on lavapipe), and f16 packed
    /// in words without shader-f16.
    async fn kv_paths() -> Vec<Self> {
        let mut all = vec![Self::new(true).await, Self::new(false).await];
        // Without shader-f16 or subgroups the adapter's own path is this one already (SwiftShader).
        if all[1].gpu.kv != KvStore::PackedF16 || all[1].gpu.subgroups {
            all.push(Self::with(GpuOptions { force_f32: true, packed_kv: true, ..Default::default() }).await);
        }
        all
    }
}

fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale).collect()
}

/// A random tensor of `rows` x `cols` in the given GGUF layout, and its bytes: random quants,
/// random finite f16 scales.
fn random_tensor(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> (TensorInfo, Vec<u8>) {
    let n = rows * cols;
    let mut bytes = Vec::new();
    let f16_bytes = |v: f32| f16::from_f32(v).to_le_bytes();
    match ty {
        GgmlType::F32 => random(rng, n, 1.0).iter().for_each(|v| bytes.extend(v.to_le_bytes())),
        GgmlType::F16 => random(rng, n, 1.0).iter().for_each(|&v| bytes.extend(f16_bytes(v))),
        GgmlType::BF16 => random(rng, n, 1.0).iter().for_each(|&v| bytes.extend(half::bf16::from_f32(v).to_le_bytes())),
        _ => {
            let f = webgpu_llm::quant::format(ty).expect("a format the engine runs");
            let (values, size) = f.block();
            for _ in 0..n / values {
                let mut block: Vec<u8> = (0..size).map(|_| rng.next_u64() as u8).collect();
                for &at in f.f16_fields {
                    let scale =
                        (0.002 + rng.next_f64() as f32 * 0.02) * if rng.next_u64() % 2 == 0 { 1.0 } else { -1.0 };
                    block[at..at + 2].copy_from_slice(&f16_bytes(scale));
                }
                for &at in f.e8m0_fields {
                    // Half scales 2^(e - 128) of 2^-9 .. 2^-6, as the f16 ones above.
                    block[at] = 119 + (rng.next_u64() % 4) as u8;
                }
                bytes.extend(block);
            }
        }
    }
    let info = TensorInfo {
        name: format!("{ty:?}"),
        shape: vec![cols as u64, rows as u64],
        ty,
        file_offset: 0,
        byte_size: bytes.len() as u64,
    };
    (info, bytes)
}

/// Every type the engine runs.
fn types() -> impl Iterator<Item = GgmlType> {
    FORMATS.iter().map(|f| f.ty)
}

async fn linear(h: &Harness, info: &TensorInfo, bytes: &[u8]) -> Linear {
    Linear::new(&h.gpu, "w", &[Rows::of(info).unwrap()], bytes).await.unwrap()
}

/// `b` placed after `a` in one file (the source weights are read from): b's new info, the file.
fn after(a: &TensorInfo, a_bytes: &[u8], b: &TensorInfo, b_bytes: &[u8]) -> (TensorInfo, Vec<u8>) {
    assert_eq!(a.file_offset, 0);
    (TensorInfo { file_offset: a_bytes.len() as u64, ..b.clone() }, [a_bytes, b_bytes].concat())
}

/// A gated pair of random `ty` tensors of `rows` x `cols` (gate, then up after it in one file) on
/// the GPU, and the gate's and up's dequantized values.
async fn random_pair(
    h: &Harness,
    rng: &mut Rng,
    ty: GgmlType,
    rows: usize,
    cols: usize,
) -> (Linear, Vec<f32>, Vec<f32>) {
    let (gi, gb) = random_tensor(rng, ty, rows, cols);
    let (ui, ub) = random_tensor(rng, ty, rows, cols);
    let (up_info, file) = after(&gi, &gb, &ui, &ub);
    let pair = Linear::gated_pair(&h.gpu, "gate_up", Rows::of(&gi).unwrap(), Rows::of(&up_info).unwrap(), &file[..])
        .await
        .unwrap()
        .expect("same types pair up");
    (pair, dequantize(&gi, &gb).unwrap(), dequantize(&ui, &ub).unwrap())
}

/// `reference_matmul` of a gated pair's gemm as it writes Y: each token's gate rows, then its up rows.
fn pair_matmul(gate: &[f32], up: &[f32], x: &[f32], cols: usize) -> (Vec<f64>, Vec<f64>) {
    let rows = gate.len() / cols;
    let (g, gs) = reference_matmul(gate, x, cols);
    let (u, us) = reference_matmul(up, x, cols);
    let (mut want, mut scale) = (Vec::new(), Vec::new());
    for t in 0..x.len() / cols {
        want.extend([&g[t * rows..][..rows], &u[t * rows..][..rows]].concat());
        scale.extend([&gs[t * rows..][..rows], &us[t * rows..][..rows]].concat());
    }
    (want, scale)
}

/// |got - want| <= rel * scale + 1e-5 where scale is the sum of |terms| of the dot product.
fn assert_close(what: &str, got: &[f32], want: &[f64], scale: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        let bound = rel * s + 1e-5;
        assert!((g as f64 - w).abs() <= bound, "{what}[{i}]: got {g}, want {w} (bound {bound:.2e})");
    }
}

/// Reference y[t][r] = sum_k w[r][k] x[t][k] in f64, and the sums of |terms|.
fn reference_matmul(w: &[f32], x: &[f32], cols: usize) -> (Vec<f64>, Vec<f64>) {
    let (rows, n) = (w.len() / cols, x.len() / cols);
    let mut y = Vec::with_capacity(n * rows);
    let mut s = Vec::with_capacity(n * rows);
    for xt in x.chunks_exact(cols) {
        for wr in w.chunks_exact(cols) {
            y.push(wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum());
            s.push(wr.iter().zip(xt).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum());
        }
    }
    (y, s)
}

const MATMUL_REL: f64 = 1e-5;

/// The gated FFN's activations in f64 (SiLU; GELU with PyTorch's tanh approximation).
fn act64(act: Activation, x: f64) -> f64 {
    match act {
        Activation::Silu => x / (1.0 + (-x).exp()),
        Activation::GeluTanh => {
            0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
        }
    }
}

gpu_test! {
    async fn gemv_matches_the_cpu_product_for_every_weight_type_and_epilogue() {
        let mut rng = Rng::new(1);
        let (rows, cols) = (203, 256);
        for mut h in Harness::paths().await {
            for ty in types() {
                let (info, bytes) = random_tensor(&mut rng, ty, rows, cols);
                let w = dequantize(&info, &bytes).unwrap();
                let lin = linear(&h, &info, &bytes).await;
                let x = random(&mut rng, cols, 1.0);
                let (want, scale) = reference_matmul(&w, &x, cols);
                let xb = h.buf(&x);
                let y0 = random(&mut rng, rows, 1.0);
                let yb = h.buf(&y0);
                let ops = kernels::gemv(&h.gpu, &mut h.cache, GemvBatch { params: &h.params, mb: 1, xq: None }, &lin, Activation::Silu, Epilogue::Store, None, &xb, &yb, rows);
                h.run(&ops, 1);
                assert_close(&format!("gemv {ty:?} store, {}", h.path()), &h.read(&yb, rows).await, &want, &scale, MATMUL_REL);
                let yb = h.buf(&y0);
                let ops = kernels::gemv(&h.gpu, &mut h.cache, GemvBatch { params: &h.params, mb: 1, xq: None }, &lin, Activation::Silu, Epilogue::Add, None, &xb, &yb, rows);
                h.run(&ops, 1);
                let added: Vec<f64> = want.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
                assert_close(&format!("gemv {ty:?} add, {}", h.path()), &h.read(&yb, rows).await, &added, &scale, MATMUL_REL);
            }
        }
    }
}

gpu_test! {
    async fn gated_gemv_computes_the_activation_of_gate_times_up() {
        let mut rng = Rng::new(2);
        let (rows, cols) = (150, 256);
        for mut h in Harness::paths().await {
            for (ty, act) in
                [(GgmlType::Q4_1, Activation::Silu), (GgmlType::Q8_0, Activation::GeluTanh), (GgmlType::Q4K, Activation::GeluTanh)]
            {
                let (gi, gb) = random_tensor(&mut rng, ty, rows, cols);
                let (ui, ub) = random_tensor(&mut rng, ty, rows, cols);
                let (up_info, file) = after(&gi, &gb, &ui, &ub);
                let (gate, up) = (Rows::of(&gi).unwrap(), Rows::of(&up_info).unwrap());
                let pair =
                    Linear::gated_pair(&h.gpu, "gate_up", gate, up, &file[..]).await.unwrap().expect("same types pair up");
                let x = random(&mut rng, cols, 1.0);
                let (g, gs) = reference_matmul(&dequantize(&gi, &gb).unwrap(), &x, cols);
                let (u, us) = reference_matmul(&dequantize(&ui, &ub).unwrap(), &x, cols);
                let want: Vec<f64> = g.iter().zip(&u).map(|(&a, &b)| act64(act, a) * b).collect();
                let scale: Vec<f64> =
                    gs.iter().zip(&us).zip(&u).zip(&g).map(|(((a, b), u), g)| a * u.abs() + b * g.abs() + a * b).collect();
                let (xb, yb) = (h.buf(&x), h.buf(&vec![0.0; rows]));
                let ops = kernels::gemv(&h.gpu, &mut h.cache, GemvBatch { params: &h.params, mb: 1, xq: None }, &pair, act, Epilogue::Store, None, &xb, &yb, rows);
                h.run(&ops, 1);
                let what = format!("gated gemv {ty:?} {act:?}, {}", h.path());
                assert_close(&what, &h.read(&yb, rows).await, &want, &scale, 1e-5);
            }
        }
    }
}

gpu_test! {
    async fn gemm_matches_the_cpu_product_for_every_weight_type() {
        let mut rng = Rng::new(3);
        let (n, rows) = (70, 130);
        // Every type on rows of 256 values; rows that end inside a K tile of 32 values; MXFP4
        // rows of 5 blocks (their exponents' head word ends in 3 padding bytes).
        let cases: Vec<(GgmlType, usize)> = types()
            .map(|t| (t, 256))
            .chain([(GgmlType::F16, 200), (GgmlType::F32, 40), (GgmlType::MXFP4, 160)])
            .collect();
        for mut h in Harness::paths().await {
            h.set(n, 0, 16);
            let taken: Vec<(GgmlType, usize)> = cases.iter().copied().filter(|&(ty, cols)| browser_twin_takes(&h, ty, cols)).collect();
            for &(ty, cols) in &taken {
                let (info, bytes) = random_tensor(&mut rng, ty, rows, cols);
                let w = dequantize(&info, &bytes).unwrap();
                let lin = linear(&h, &info, &bytes).await;
                let x = random(&mut rng, n * cols, 1.0);
                let (want, scale) = reference_matmul(&w, &x, cols);
                let y0 = random(&mut rng, n * rows, 1.0);
                let (xb, yb) = (h.buf(&x), h.buf(&y0));
                let ops = kernels::gemm(&h.gpu, &mut h.cache, &h.params, None, &lin, Epilogue::Add, &xb, &yb, rows);
                h.run(&ops, n);
                let added: Vec<f64> = want.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
                let what = format!("gemm {ty:?} {cols} columns, {}", h.path());
                assert_close(&what, &h.read(&yb, n * rows).await, &added, &scale, MATMUL_REL);
            }
        }
    }
}

// The prefill gemm on cooperative matrices (shaders/gemm_coop.wgsl, `Gpu::coop`, natively where
// the adapter lists square f16 products into f32): its tiles hold X and the dequantized W
// rounded to f16, whose products f32 holds exactly, so each output is the f64 product of those
// rounded values within the f32 bound of the other matrix products; and within 2^-10 of the
// sum of |terms| (two roundings of 2^-11) of the unrounded product. Past one tile of 64 tokens
// and of 64 rows, rows that end inside a K step of 32, added to the residual, a gated pair's
// columns, every weight type. On an adapter without them, asking for them is an error that
// says what is missing.
gpu_test! {
    async fn coop_gemm_sums_f16_rounded_tiles_in_f32() {
        let gpu = match Gpu::new(GpuOptions { coop: Some(true), ..Default::default() }).await {
            Ok(gpu) => gpu,
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.starts_with("invalid coop = true: off (0) on ") && msg.contains("cooperative"), "{msg}");
                eprintln!("no cooperative matrices on this adapter: {msg}");
                return;
            }
        };
        let side = gpu.coop.expect("coop asked for and granted");
        let mut h = Harness::of(gpu);
        h.gpu.style = KernelStyle::Gpu;
        eprintln!("cooperative matrices of {side}, subgroups of {}", h.gpu.adapter_info.subgroup_max_size);
        let mut rng = Rng::new(21);
        let (n, rows) = (70, 130);
        let round = |v: &[f32]| -> Vec<f32> { v.iter().map(|&v| f16::from_f32(v).to_f32()).collect() };
        h.set(n, 0, 16);
        let cases = types().map(|t| (t, 256)).chain([(GgmlType::F16, 200), (GgmlType::Q8_0, 96)]);
        for (ty, cols) in cases {
            let (info, bytes) = random_tensor(&mut rng, ty, rows, cols);
            let w = dequantize(&info, &bytes).unwrap();
            let lin = linear(&h, &info, &bytes).await;
            let x = random(&mut rng, n * cols, 3.0);
            let y0 = random(&mut rng, n * rows, 1.0);
            let (xb, yb) = (h.buf(&x), h.buf(&y0));
            let ops = kernels::gemm(&h.gpu, &mut h.cache, &h.params, None, &lin, Epilogue::Add, &xb, &yb, rows);
            h.run(&ops, n);
            let got = h.read(&yb, n * rows).await;
            let what = format!("coop gemm {ty:?} {cols} columns");
            let (want, scale) = reference_matmul(&round(&w), &round(&x), cols);
            let added: Vec<f64> = want.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
            assert_close(&what, &got, &added, &scale, MATMUL_REL);
            let (exact, scale) = reference_matmul(&w, &x, cols);
            let added: Vec<f64> = exact.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
            assert_close(&format!("{what}, against the unrounded product"), &got, &added, &scale, 1.0 / 1024.0 + MATMUL_REL);
        }
        let cols = 64;
        let (pair, gw, uw) = random_pair(&h, &mut rng, GgmlType::Q4_0, rows, cols).await;
        let x = random(&mut rng, n * cols, 1.0);
        let (xb, yb) = (h.buf(&x), h.buf(&vec![0.0; n * 2 * rows]));
        let ops = kernels::gemm(&h.gpu, &mut h.cache, &h.params, None, &pair, Epilogue::Store, &xb, &yb, 2 * rows);
        h.run(&ops, n);
        let xr = round(&x);
        let (want, scale) = pair_matmul(&round(&gw), &round(&uw), &xr, cols);
        assert_close("coop gemm, gated pair", &h.read(&yb, n * 2 * rows).await, &want, &scale, MATMUL_REL);
    }
}

/// Which of gemm's cases the browser twin takes: SwiftShader compiles a pipeline in about a
/// second, and each type is a pipeline of each kernel style. Every type on the kernels the
/// adapter runs in the engine; on the other style one type of each block family (floats,
/// 32-value blocks, K-quants) and the rows that end inside a K tile, whose decoding the gemv
/// twin runs for every type on both styles. Natively (lavapipe compiles in milliseconds), all.
fn browser_twin_takes(h: &Harness, ty: GgmlType, cols: usize) -> bool {
    !cfg!(target_arch = "wasm32")
        || h.gpu.style == h.own
        || cols != 256
        || matches!(ty, GgmlType::F16 | GgmlType::Q4_0 | GgmlType::Q4K)
}

gpu_test! {
    async fn gemm_of_a_gated_pair_writes_gate_then_up_columns_and_act_mul_combines_them() {
        let mut rng = Rng::new(4);
        let (n, rows, cols) = (9, 40, 64);
        for mut h in Harness::paths().await {
            h.set(n, 0, 16);
            let (gi, gb) = random_tensor(&mut rng, GgmlType::Q4_0, rows, cols);
            let (ui, ub) = random_tensor(&mut rng, GgmlType::Q4_0, rows, cols);
            let (up_info, file) = after(&gi, &gb, &ui, &ub);
            let (gate, up) = (Rows::of(&gi).unwrap(), Rows::of(&up_info).unwrap());
            let pair = Linear::gated_pair(&h.gpu, "gate_up", gate, up, &file[..]).await.unwrap().unwrap();
            let x = random(&mut rng, n * cols, 1.0);
            let (g, _) = reference_matmul(&dequantize(&gi, &gb).unwrap(), &x, cols);
            let (u, _) = reference_matmul(&dequantize(&ui, &ub).unwrap(), &x, cols);
            let (xb, gub, hb) = (h.buf(&x), h.buf(&vec![0.0; n * 2 * rows]), h.buf(&vec![0.0; n * rows]));
            let mut ops = kernels::gemm(&h.gpu, &mut h.cache, &h.params, None, &pair, Epilogue::Store, &xb, &gub, 2 * rows);
            let act = [Activation::Silu, Activation::GeluTanh][h.gpu.f16 as usize];
            ops.push(kernels::act_mul(&h.gpu, &mut h.cache, &h.params, act, rows, &gub, &hb));
            h.run(&ops, n);
            let gu = h.read(&gub, n * 2 * rows).await;
            let got = h.read(&hb, n * rows).await;
            for t in 0..n {
                for r in 0..rows {
                    let (gv, uv) = (g[t * rows + r], u[t * rows + r]);
                    assert!((gu[t * 2 * rows + r] as f64 - gv).abs() < 1e-4, "gate column {t},{r}");
                    assert!((gu[t * 2 * rows + rows + r] as f64 - uv).abs() < 1e-4, "up column {t},{r}");
                    let want = reference::activation(act, gu[t * 2 * rows + r]) * gu[t * 2 * rows + rows + r];
                    assert!((got[t * rows + r] - want).abs() <= 1e-5 * want.abs().max(1.0), "act_mul {act:?} {t},{r}");
                }
            }
        }
    }
}

gpu_test! {
    async fn embedding_lookup_matches_cpu_dequantization() {
        let mut rng = Rng::new(5);
        let (vocab, d, scale) = (300, 256, 2.5f32);
        let tokens = [0u32, 299, 17, 17, 150];
        for mut h in Harness::paths().await {
            h.set(tokens.len(), 0, 16);
            for ty in types() {
                let (info, bytes) = random_tensor(&mut rng, ty, vocab, d);
                let table = dequantize(&info, &bytes).unwrap();
                let lin = linear(&h, &info, &bytes).await;
                let (tb, xb) = (h.u32_buf(&tokens), h.buf(&vec![0.0; tokens.len() * d]));
                let ops = kernels::embed(&h.gpu, &mut h.cache, &h.params, &lin, scale, &tb, &xb);
                h.run(&ops, tokens.len());
                let want: Vec<f64> = tokens
                    .iter()
                    .flat_map(|&t| table[t as usize * d..(t as usize + 1) * d].iter().map(|&v| (v * scale) as f64))
                    .collect();
                let scale: Vec<f64> = want.iter().map(|v| v.abs()).collect();
                assert_close(&format!("embed {ty:?}, {}", h.path()), &h.read(&xb, tokens.len() * d).await, &want, &scale, 1e-6);
            }
        }
    }
}

gpu_test! {
    async fn mxfp4_decodes_every_exponent_and_code_exactly_as_the_cpu() {
        // 32 rows of 8 blocks: block b of the table has exponent b (0 .. 255) and every code in
        // both nibbles. The embedding (scale 1) returns the GPU's decoded values themselves.
        let (rows, d) = (32, 256);
        let mut bytes = Vec::new();
        for e in 0..=255u8 {
            bytes.push(e);
            bytes.extend((0..16u8).map(|j| j | (15 - j) << 4));
        }
        let info = TensorInfo {
            name: "mxfp4".into(),
            shape: vec![d as u64, rows as u64],
            ty: GgmlType::MXFP4,
            file_offset: 0,
            byte_size: bytes.len() as u64,
        };
        let want = dequantize(&info, &bytes).unwrap();
        let tokens: Vec<u32> = (0..rows as u32).collect();
        for mut h in Harness::paths().await {
            h.set(rows, 0, 16);
            let lin = linear(&h, &info, &bytes).await;
            let (tb, xb) = (h.u32_buf(&tokens), h.buf(&vec![0.0; rows * d]));
            let ops = kernels::embed(&h.gpu, &mut h.cache, &h.params, &lin, 1.0, &tb, &xb);
            h.run(&ops, rows);
            let got = h.read(&xb, rows * d).await;
            let mut flushed = 0;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // WGSL lets an implementation flush subnormal results (e < 2, |code| <= 3) to zero.
                if w.is_subnormal() && *g == 0.0 {
                    flushed += 1;
                    continue;
                }
                assert_eq!(g.to_bits(), w.to_bits(), "MXFP4 e {} value {}: got {g}, CPU {w}, {}", i / 32, i % 32, h.path());
            }
            eprintln!("MXFP4 exponents 0 ..= 255, {}: exact; {flushed} subnormal values flushed to zero", h.path());
        }
    }
}

gpu_test! {
    async fn rms_norm_matches_the_cpu_reference() {
        let mut rng = Rng::new(6);
        let (n, d, eps) = (5, 576, 1e-5);
        for mut h in Harness::paths().await {
            h.set(n, 0, 16);
            let x = random(&mut rng, n * d, 3.0);
            let w = random(&mut rng, d, 1.0);
            let mut want = vec![0f32; n * d];
            reference::rms_norm(&mut want, &x, &w, eps);
            let (xb, wb, ob) = (h.buf(&x), h.buf(&w), h.buf(&vec![0.0; n * d]));
            let all = kernels::rms_norm(&h.gpu, &mut h.cache, &h.params, d, eps, NormOut::Store, &xb, &wb, &ob);
            h.run(&[all], n);
            let got = h.read(&ob, n * d).await;
            let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
            let scale: Vec<f64> = want64.iter().map(|v| v.abs()).collect();
            assert_close(&format!("rms_norm, {}", h.path()), &got, &want64, &scale, 1e-5);
            let last = kernels::rms_norm(&h.gpu, &mut h.cache, &h.params, d, eps, NormOut::StoreLast, &xb, &wb, &ob);
            h.run(&[last], n);
            assert_close(
                &format!("rms_norm last row, {}", h.path()),
                &h.read(&ob, d).await,
                &want64[(n - 1) * d..],
                &scale[(n - 1) * d..],
                1e-5,
            );
            let base = random(&mut rng, n * d, 1.0);
            let ab = h.buf(&base);
            let add = kernels::rms_norm(&h.gpu, &mut h.cache, &h.params, d, eps, NormOut::Add, &xb, &wb, &ab);
            h.run(&[add], n);
            let added: Vec<f64> = want64.iter().zip(&base).map(|(w, &b)| w + b as f64).collect();
            assert_close(&format!("rms_norm added, {}", h.path()), &h.read(&ab, n * d).await, &added, &scale, 1e-5);
        }
    }
}

fn small_config() -> ModelConfig {
    ModelConfig {
        name: "test".into(),
        architecture: "llama".into(),
        n_layers: 1,
        d_model: 6 * 32,
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 32,
        ffn_dim: 64,
        vocab_size: 100,
        context_length: 256,
        rope_base: 10000.0,
        rope_dim: 32,
        rms_eps: 1e-5,
        tied_output: true,
        mtp_layers: 0,
    }
}

/// RoPE from its formula in f64, independent of the crate's tables and reference: pair i of each
/// head (adjacent: 2i and 2i + 1; NeoX: i and i + dim / 2) turns by pos base^(-2i / dim) / factor_i.
fn rope_f64(x: &mut [f32], pos: usize, head_dim: usize, rope: &Rope) {
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..rope.dim / 2 {
            let factor = rope.freq_factors.get(i).map_or(1.0, |&f| f as f64);
            let angle = pos as f64 * rope.base.powf(-2.0 * i as f64 / rope.dim as f64) / factor;
            let (a, b) = match rope.style {
                RopeStyle::NeoX => (i, i + rope.dim / 2),
                RopeStyle::Adjacent => (2 * i, 2 * i + 1),
            };
            let (x0, x1) = (head[a] as f64, head[b] as f64);
            head[a] = (x0 * angle.cos() - x1 * angle.sin()) as f32;
            head[b] = (x0 * angle.sin() + x1 * angle.cos()) as f32;
        }
    }
}

gpu_test! {
    async fn rope_kv_adds_bias_norms_heads_rotates_q_and_k_and_writes_the_kv_cache() {
        let mut rng = Rng::new(7);
        // Heads of 32, and of 512 (Gemma 4's full layers: two values an invocation).
        for c in [small_config(), ModelConfig { n_heads: 2, n_kv_heads: 1, head_dim: 512, d_model: 1024, ..small_config() }] {
            rope_kv_case(&c, &mut rng).await;
        }
    }
}

/// rope_kv on heads of `c`'s size against RoPE's formula and the CPU reference's norms.
async fn rope_kv_case(c: &ModelConfig, rng: &mut Rng) {
    let (n, start, ctx, eps) = (7, 100, 128, 1e-6);
    let (q, kv, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
    let row = q + 2 * kv;
    // llama (adjacent pairs, whole head), Qwen 2 (NeoX, biases), Qwen 3 / Gemma (NeoX, q/k
    // norms), Phi-3 (NeoX over half the head) with llama 3 style frequency factors.
    // (style, rotated dims, bias, q/k norm, frequency factors, Gemma 4's V norm, q alone).
    let cases = [
        (RopeStyle::Adjacent, hd, false, false, Vec::new(), false, false),
        (RopeStyle::NeoX, hd, true, false, Vec::new(), false, false),
        (RopeStyle::NeoX, hd, false, true, Vec::new(), false, false),
        (RopeStyle::NeoX, hd / 2, false, false, (0..hd / 4).map(|i| 1.0 + i as f32).collect(), false, false),
        (RopeStyle::NeoX, hd, false, true, Vec::new(), true, false),
        (RopeStyle::NeoX, hd, false, true, Vec::new(), false, true),
    ];
    for mut h in Harness::kv_paths().await {
        let paging = h.set(n, start, ctx);
        for (style, dim, with_bias, with_norm, freq_factors, v_norm, q_only) in cases.clone() {
            let rope = Rope { base: 10000.0, dim, style, freq_factors, mscale: 1.0 };
            let qkv = random(rng, n * row, 2.0);
            let bias = random(rng, row, 0.5);
            let norm = random(rng, 2 * hd, 1.5);
            let table = h.buf(&kernels::rope_table(&rope, ctx));
            let (kc, _) = h.kv_buf(&vec![0.0; paging.rows() * kv]);
            let (vc, _) = h.kv_buf(&vec![0.0; paging.rows() * kv]);
            let (qb, bb, nb) = (h.buf(&qkv), h.buf(&bias), h.buf(&norm));
            let extras = QkvExtras {
                bias: with_bias.then_some(&bb),
                qk_norm: with_norm.then_some((&nb, eps)),
                v_norm: v_norm.then_some(eps),
                q_only,
            };
            let op =
                kernels::rope_kv(&h.gpu, &mut h.cache, &h.params, c, &rope, extras, &qb, &table, &kc, &vc, &h.batch);
            h.run(&[op], n);
            let got_q = h.read(&qb, n * row).await;
            let rows = paging.rows() * kv;
            let (got_k, got_v) = (h.read_kv(&kc, rows).await, h.read_kv(&vc, rows).await);
            // f16 storage keeps 11 significant bits.
            let kv_tol = if h.gpu.kv_bytes() == 2 { 1e-3 } else { 1e-6 };
            let what = format!(
                "{style:?} dim {dim} bias {with_bias} norm {with_norm} v norm {v_norm} q alone {q_only}, {}",
                h.path()
            );
            for t in 0..n {
                let mut r = qkv[t * row..(t + 1) * row].to_vec();
                if with_bias {
                    r.iter_mut().zip(&bias).for_each(|(v, b)| *v += b);
                }
                let (mut wq, mut wk, mut wv) = (r[..q].to_vec(), r[q..q + kv].to_vec(), r[q + kv..].to_vec());
                if with_norm {
                    reference::rms_norm_in_place(&mut wq, &norm[..hd], eps);
                    reference::rms_norm_in_place(&mut wk, &norm[hd..], eps);
                }
                if v_norm {
                    reference::rms_norm_in_place(&mut wv, &vec![1.0; hd], eps);
                }
                if q_only {
                    // The layer reads another's keys and values: its cache is not written.
                    (wk, wv) = (vec![0.0; kv], vec![0.0; kv]);
                }
                rope_f64(&mut wq, start + t, hd, &rope);
                if !q_only {
                    rope_f64(&mut wk, start + t, hd, &rope);
                }
                for i in 0..q {
                    assert!((got_q[t * row + i] - wq[i]).abs() < 1e-5, "q[{t}][{i}], {what}");
                }
                // The position's row of its block.
                let p = paging.row(0, start + t) * kv;
                for i in 0..kv {
                    assert!((got_k[p + i] - wk[i]).abs() <= kv_tol * wk[i].abs().max(1.0), "k cache[{t}][{i}], {what}");
                    assert!((got_v[p + i] - wv[i]).abs() <= kv_tol * wv[i].abs().max(1.0), "v cache[{t}][{i}], {what}");
                }
            }
        }
    }
}

gpu_test! {
    async fn the_decode_qkv_projection_rotates_q_and_k_and_writes_the_cache_in_its_epilogue() {
        let mut rng = Rng::new(17);
        let c = small_config();
        let (start, ctx, cols) = (100, 128, 256);
        let (q, kv, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let rows = q + 2 * kv;
        let mut harnesses = Harness::paths().await;
        harnesses.push(Harness::with(GpuOptions { force_f32: true, packed_kv: true, ..Default::default() }).await);
        for mut h in harnesses {
            let paging = h.set(1, start, ctx);
            // llama (the whole head), and partial rotary with llama 3 style frequency factors; a
            // matrix in one binding and split into parts of 64 rows.
            for (ty, dim, factors, part_rows) in [
                (GgmlType::Q8_0, hd, Vec::new(), None),
                (GgmlType::Q4K, hd / 2, (0..hd / 4).map(|i| 1.0 + i as f32).collect(), Some(64)),
            ] {
                let rope = Rope { base: 10000.0, dim, style: RopeStyle::Adjacent, freq_factors: factors, mscale: 1.0 };
                let (info, bytes) = random_tensor(&mut rng, ty, rows, cols);
                let w = dequantize(&info, &bytes).unwrap();
                let row_bytes = Rows::of(&info).unwrap().gpu_row_bytes();
                if let Some(n) = part_rows {
                    h.gpu.limits.max_storage_buffer_binding_size = n as u64 * row_bytes;
                }
                let lin = linear(&h, &info, &bytes).await;
                h.gpu.limits.max_storage_buffer_binding_size = 1 << 27;
                assert_eq!(lin.parts.len(), part_rows.map_or(1, |n| rows.div_ceil(n)));
                let x = random(&mut rng, cols, 1.0);
                let (want, _) = reference_matmul(&w, &x, cols);
                let table = h.buf(&kernels::rope_table(&rope, ctx));
                let (kc, _) = h.kv_buf(&vec![0.0; paging.rows() * kv]);
                let (vc, _) = h.kv_buf(&vec![0.0; paging.rows() * kv]);
                let (xb, yb) = (h.buf(&x), h.buf(&vec![0.0; rows]));
                let fold = kernels::RopeKvFold { config: &c, rope: &rope, batch: &h.batch, table: &table, k_cache: &kc, v_cache: &vc };
                let none = QkvExtras { bias: None, qk_norm: None, v_norm: None, q_only: false };
                assert!(fold.applies(&none, &lin));
                let gb = GemvBatch { params: &h.params, mb: 1, xq: None };
                let ops = kernels::gemv_rope_kv(&h.gpu, &mut h.cache, gb, &lin, &fold, None, &xb, &yb, rows);
                h.run(&ops, 1);
                let got_q = h.read(&yb, q).await;
                let cache_rows = paging.rows() * kv;
                let (got_k, got_v) = (h.read_kv(&kc, cache_rows).await, h.read_kv(&vc, cache_rows).await);
                let want: Vec<f32> = want.iter().map(|&v| v as f32).collect();
                let (mut wq, mut wk, wv) = (want[..q].to_vec(), want[q..q + kv].to_vec(), want[q + kv..].to_vec());
                rope_f64(&mut wq, start, hd, &rope);
                rope_f64(&mut wk, start, hd, &rope);
                let kv_tol = if h.gpu.kv_bytes() == 2 { 1e-3 } else { 1e-5 };
                let what = format!("{ty:?} rope dim {dim}, {} parts, {}", lin.parts.len(), h.path());
                for i in 0..q {
                    assert!((got_q[i] - wq[i]).abs() <= 1e-4 * wq[i].abs().max(1.0), "q[{i}]: {} vs {}, {what}", got_q[i], wq[i]);
                }
                let p = paging.row(0, start) * kv;
                for i in 0..kv {
                    assert!((got_k[p + i] - wk[i]).abs() <= kv_tol * wk[i].abs().max(1.0), "k[{i}]: {} vs {}, {what}", got_k[p + i], wk[i]);
                    assert!((got_v[p + i] - wv[i]).abs() <= kv_tol * wv[i].abs().max(1.0), "v[{i}]: {} vs {}, {what}", got_v[p + i], wv[i]);
                }
                // Nothing else of the cache is touched.
                assert!(got_k[..p].iter().chain(&got_k[p + kv..]).all(|&v| v == 0.0), "{what}");
            }
            // What the epilogue cannot do: pairs split between parts, biases, q/k norms, NeoX.
            let rope = Rope { base: 10000.0, dim: hd, style: RopeStyle::Adjacent, freq_factors: Vec::new(), mscale: 1.0 };
            let (info, bytes) = random_tensor(&mut rng, GgmlType::Q8_0, rows, cols);
            h.gpu.limits.max_storage_buffer_binding_size = 63 * Rows::of(&info).unwrap().gpu_row_bytes();
            let odd = linear(&h, &info, &bytes).await;
            h.gpu.limits.max_storage_buffer_binding_size = 1 << 27;
            let whole = linear(&h, &info, &bytes).await;
            let b = h.buf(&[0.0; 4]);
            let fold = kernels::RopeKvFold { config: &c, rope: &rope, batch: &b, table: &b, k_cache: &b, v_cache: &b };
            let none = QkvExtras { bias: None, qk_norm: None, v_norm: None, q_only: false };
            assert!(!fold.applies(&none, &odd));
            assert!(!fold.applies(&QkvExtras { bias: Some(&b), ..none }, &whole));
            assert!(!fold.applies(&QkvExtras { qk_norm: Some((&b, 1e-6)), ..none }, &whole));
            assert!(!fold.applies(&QkvExtras { v_norm: Some(1e-6), ..none }, &whole));
            assert!(!fold.applies(&QkvExtras { q_only: true, ..none }, &whole));
            let neox = Rope { style: RopeStyle::NeoX, ..rope.clone() };
            assert!(!kernels::RopeKvFold { rope: &neox, ..fold }.applies(&none, &whole));
        }
    }
}

/// Runs decode (n = 1) or prefill attention for queries at `start..start + n` against a
/// random cache, and compares with the CPU reference on the values the GPU stores.
async fn check_attention(h: &mut Harness, n: usize, start: usize, window: Option<usize>, rng: &mut Rng) {
    let kind = AttentionKind { scale: 0.3, window, softcap: None };
    check_attention_with(h, &small_config(), None, 256, kind, false, n, start, rng).await;
}

/// A KV cache of random values (keys within 2, values within 1), `rows` rows of `width`, in the
/// harness's KV storage; `k_rows` and `v_rows` are the values as stored (f16 rounds them).
/// Cases of one width share one: the tests' block tables for `keys` keys use its first
/// `Paging::for_keys(keys).rows()` rows.
struct RandomKv {
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    k_rows: Vec<f32>,
    v_rows: Vec<f32>,
    rows: usize,
    width: usize,
}

impl RandomKv {
    fn new(h: &Harness, rows: usize, width: usize, rng: &mut Rng) -> Self {
        let (k, k_rows) = h.kv_buf(&random(rng, rows * width, 2.0));
        let (v, v_rows) = h.kv_buf(&random(rng, rows * width, 1.0));
        Self { k, v, k_rows, v_rows, rows, width }
    }
}

/// `check_attention` for a model shape `c`, a cache of `ctx` keys and a layer's attention
/// (scale, window, soft-capping) and, with `sinks`, a sink logit per head; on `shared` (of
/// `c.kv_dim()` values a row, at least as many rows as `ctx` keys take) or else a cache of its own.
#[allow(clippy::too_many_arguments)]
async fn check_attention_with(
    h: &mut Harness,
    c: &ModelConfig,
    shared: Option<&RandomKv>,
    ctx: usize,
    kind: AttentionKind,
    sinks: bool,
    n: usize,
    start: usize,
    rng: &mut Rng,
) {
    let own;
    let shared = match shared {
        Some(kvs) => kvs,
        None => {
            own = RandomKv::new(h, Paging::for_keys(ctx).rows(), c.kv_dim(), rng);
            &own
        }
    };
    let c = c.clone();
    let window = kind.window;
    let (q, kv) = (c.q_dim(), c.kv_dim());
    let row = q + 2 * kv;
    let paging = h.set(n, start, ctx);
    assert!(shared.width == kv && shared.rows >= paging.rows());
    let qkv = random(rng, n * row, 1.0);
    // The cache in blocks; the reference reads it in position order.
    let (kc, vc) = (&shared.k, &shared.v);
    let (k_seen, v_seen) = (paging.gather(0, &shared.k_rows, kv, ctx), paging.gather(0, &shared.v_rows, kv, ctx));
    let (qb, out) = (h.buf(&qkv), h.buf(&vec![0.0; n * q]));
    // gpt-oss's sinks: a logit per query head (from -2 to 3, the size of the scores).
    let sink_values: Vec<f32> = (0..c.n_heads).map(|i| -2.0 + 5.0 * i as f32 / c.n_heads as f32).collect();
    let sink_buf = h.buf(&sink_values);
    let sinks_gpu = sinks.then_some(&sink_buf);
    // Decode on CPU adapters also in one dispatch where the context is short enough.
    let short_keys = kernels::decode_short_keys(&h.gpu, &c);
    let partials_len = kernels::decode_partials_len(&h.gpu, &c, ctx);
    let partials = h.buf(&vec![0.0; partials_len]);
    let ops = if n == 1 {
        let (cache, batch) = (&mut h.cache, &h.batch);
        let short = short_keys > 0;
        kernels::attention_decode(&h.gpu, cache, &c, kind, ctx, short, &qb, kc, vc, &partials, &out, batch, sinks_gpu)
    } else {
        let (cache, params) = (&mut h.cache, &h.params);
        vec![kernels::attention_prefill(&h.gpu, cache, params, &c, kind, &qb, kc, vc, &out, &h.batch, sinks_gpu)]
    };
    h.run(&ops, n);
    let got = h.read(&out, n * q).await;
    if n == 1 && start < short_keys {
        // The same bits from the one dispatch, into a cleared output and cleared records.
        h.clear(&out, q);
        h.clear(&partials, partials_len);
        h.run_rows(&ops, &SegmentRows::at_keys(1, start + 1, short_keys));
        let one = h.read(&out, q).await;
        if let Some(i) = (0..q).find(|&i| one[i].to_bits() != got[i].to_bits()) {
            let what = format!("{} keys, heads {}/{}, {}", start + 1, c.n_heads, c.n_kv_heads, h.path());
            panic!("one-dispatch decode attention [{i}]: {} against the two passes' {}, {what}", one[i], got[i]);
        }
    }
    let queries: Vec<f32> = qkv.chunks_exact(row).flat_map(|r| r[..q].to_vec()).collect();
    let mut want = vec![0f32; n * q];
    let sinks_cpu = sinks.then_some(&sink_values[..]);
    reference::attention(&c, kind, sinks_cpu, &mut want, &queries, &k_seen, &v_seen, start);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() < 1e-4,
            "attention n={n} start={start} window {window:?} heads {}/{} head_dim {} [{i}]: got {g}, want {w}, {}",
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            h.path()
        );
    }
}

gpu_test! {
    async fn decode_attention_matches_the_cpu_reference_with_grouped_heads_and_windows() {
        let mut rng = Rng::new(8);
        for mut h in Harness::kv_paths().await {
            for (start, window) in [(0, None), (1, None), (57, None), (255, None), (255, Some(16)), (3, Some(16)), (16, Some(16))] {
                check_attention(&mut h, 1, start, window, &mut rng).await;
            }
        }
    }
}

// Gemma 2's soft-capped scores (cap 1.5 against scores of several units, so the cap bends most
// of them) and gpt-oss's sinks (a logit per head in every softmax's denominator) in decode and
// prefill attention, both kernel styles, with and without a window.
gpu_test! {
    async fn soft_capped_attention_and_sinks_match_the_cpu_reference() {
        let mut rng = Rng::new(12);
        for mut h in Harness::kv_paths().await {
            let own = h.gpu.style;
            for style in [own, other(own)] {
                h.gpu.style = style;
                for (n, start, window) in [(1, 100, None), (1, 40, Some(16)), (37, 20, None), (70, 0, Some(9))] {
                    let kind = AttentionKind { scale: 1.0, window, softcap: Some(1.5) };
                    check_attention_with(&mut h, &small_config(), None, 256, kind, false, n, start, &mut rng).await;
                    // gpt-oss's sinks (without soft-capping, as gpt-oss has them).
                    let kind = AttentionKind { scale: 0.3, window, softcap: None };
                    check_attention_with(&mut h, &small_config(), None, 256, kind, true, n, start, &mut rng).await;
                }
            }
            h.gpu.style = own;
        }
    }
}

fn other(style: KernelStyle) -> KernelStyle {
    match style {
        KernelStyle::Cpu => KernelStyle::Gpu,
        KernelStyle::Gpu => KernelStyle::Cpu,
    }
}

gpu_test! {
    async fn attention_matches_the_cpu_reference_at_every_length_group_ratio_and_head_size() {
        let mut rng = Rng::new(10);
        for mut h in Harness::kv_paths().await {
            let own = h.gpu.style;
            // The browser twin (SwiftShader, where each shape is pipelines of its own compiled in
            // about a second each) takes two opposite corners, the smallest head size without
            // grouping and the largest with 8 query heads a KV head; natively, every combination.
            // Heads of 512 (Gemma 4's full layers) take two values an invocation in the tiled
            // prefill, and fewer query heads a decode workgroup where its memory is short: also
            // at WebGPU's minimum 16 KiB (the adapters here have 32), which shrinks the prefill's
            // query tile too.
            let (shapes, lengths): (Vec<(usize, usize)>, &[usize]) = if cfg!(target_arch = "wasm32") {
                (vec![(64, 1), (256, 8), (512, 4)], &[1, 257, 4096])
            } else {
                // Every group ratio at the smallest and the largest common head size, one at 128.
                let all = [64, 128, 256].into_iter().flat_map(|d| [1, 3, 4, 8].map(|g| (d, g)));
                let all = all.filter(|&(d, g)| d != 128 || g == 3);
                (all.chain([(512, 2), (512, 8)]).collect(), &[1, 255, 256, 257, 1000, 4096, 32768])
            };
            let adapter_bytes = h.gpu.limits.max_compute_workgroup_storage_size;
            let memories = |head_dim: usize| if head_dim == 512 { vec![adapter_bytes, 16384] } else { vec![adapter_bytes] };
            // One random cache a head size (its width is 2 KV heads), as long as its longest case
            // (the block tables of shorter ones take its first rows): filling and uploading a
            // 32768-key cache for each case took longer than the case.
            let mut shared: Option<(usize, RandomKv)> = None;
            let all_lengths = lengths;
            for (head_dim, group, bytes) in shapes.iter().flat_map(|&(d, g)| memories(d).into_iter().map(move |b| (d, g, b))) {
                h.gpu.limits.max_compute_workgroup_storage_size = bytes;
                // Heads of 512 at lengths within and past a few chunks (the longest are the
                // narrower heads' business: chunking does not depend on the head size), and the
                // longest (splits walking many tiles: half this test's time on lavapipe) only at
                // the group ratios' corners, 1 and 8 (how a workgroup maps query heads is checked
                // at every other length).
                let corner = group == 1 || group == 8;
                let lengths = if head_dim == 512 || !corner { &lengths[..lengths.len().min(6)] } else { lengths };
                // Sliding windows that start inside a chunk, far from the first key.
                let windows = if head_dim == 512 { &[(1000, 300)][..] } else { &[(1000, 300), (16384, 4096)][..] };
                let n_kv_heads = 2;
                let c = ModelConfig {
                    n_heads: group * n_kv_heads,
                    n_kv_heads,
                    head_dim,
                    d_model: group * n_kv_heads * head_dim,
                    ..small_config()
                };
                if shared.as_ref().is_none_or(|(d, _)| *d != head_dim) {
                    drop(shared.take()); // the last head size's cache freed before the next is made
                    // Every length a narrower head takes at any ratio; 512's own (all its ratios
                    // take the same); the windows'.
                    let longest = if head_dim == 512 { lengths.last() } else { all_lengths.last() };
                    let most = windows.iter().map(|w| w.0).chain(longest.copied()).max().unwrap();
                    shared = Some((head_dim, RandomKv::new(&h, Paging::for_keys(most).rows(), c.kv_dim(), &mut rng)));
                }
                let kvs = &shared.as_ref().unwrap().1;
                let scale = 1.0 / (head_dim as f32).sqrt();
                // Decode: an invocation per key (CPU adapters) and several sharing each key and
                // each value dimension (GPUs), every KV storage. The second style takes the
                // lengths up to a few tiles, where each split is a tile, and the longest, where
                // each split walks several (on GPUs past 64 tiles; natively: the browser twin
                // keeps to its own).
                let decode_styles: &[KernelStyle] = if cfg!(target_arch = "wasm32") { &[own] } else { &[own, other(own)] };
                let longest = *lengths.last().unwrap();
                for &style in decode_styles {
                    h.gpu.style = style;
                    let short = |&&k: &&usize| style == own || k <= 1000 || k == longest;
                    for &keys in lengths.iter().filter(short) {
                        let kind = AttentionKind { scale, window: None, softcap: None };
                        check_attention_with(&mut h, &c, Some(kvs), keys, kind, false, 1, keys - 1, &mut rng).await;
                    }
                    for (keys, window) in windows.iter().filter(|(k, _)| short(&k)) {
                        let kind = AttentionKind { scale, window: Some(*window), softcap: None };
                        check_attention_with(&mut h, &c, Some(kvs), *keys, kind, false, 1, keys - 1, &mut rng).await;
                    }
                }
                // Prefill at this head size too, one query per invocation and (on one KV
                // storage: a pipeline each costs lavapipe seconds) tiled, whose key tile's rows
                // are padded.
                let styles: &[KernelStyle] =
                    if h.gpu.kv == KvStore::F32 { &[KernelStyle::Gpu, KernelStyle::Cpu] } else { &[own] };
                for &style in styles {
                    h.gpu.style = style;
                    let kind = AttentionKind { scale, window: None, softcap: None };
                    check_attention_with(&mut h, &c, Some(kvs), 256, kind, false, 40, 200, &mut rng).await;
                }
                h.gpu.style = own;
                h.gpu.limits.max_compute_workgroup_storage_size = adapter_bytes;
            }
        }
    }
}

gpu_test! {
    async fn batched_decode_attention_reads_each_sequence_through_its_own_block_table() {
        let mut rng = Rng::new(22);
        let c = small_config();
        let (q, kv) = (c.q_dim(), c.kv_dim());
        let row = q + 2 * kv;
        let ctx = 300;
        // (sequence, position): long and short sequences, one at its first key, in one step.
        let rows = [(0, 299), (1, 40), (2, 150), (3, 0), (5, 64)];
        let n = rows.len();
        for mut h in Harness::kv_paths().await {
            let own = h.gpu.style;
            for style in [own, other(own)] {
                h.gpu.style = style;
                for window in [None, Some(100)] {
                    let kind = AttentionKind { scale: 0.3, window, softcap: None };
                    let paging = h.set_rows(&rows, n, ctx);
                    let qkv = random(&mut rng, n * row, 1.0);
                    let (kc, k_rows) = h.kv_buf(&random(&mut rng, paging.rows() * kv, 2.0));
                    let (vc, v_rows) = h.kv_buf(&random(&mut rng, paging.rows() * kv, 1.0));
                    let (qb, out) = (h.buf(&qkv), h.buf(&vec![0.0; n * q]));
                    let partials_len = n * kernels::decode_partials_len(&h.gpu, &c, ctx);
                    let partials = h.buf(&vec![0.0; partials_len]);
                    let short_keys = kernels::decode_short_keys(&h.gpu, &c);
                    let (cache, batch) = (&mut h.cache, &h.batch);
                    let ops = kernels::attention_decode(
                        &h.gpu, cache, &c, kind, ctx, short_keys > 0, &qb, &kc, &vc, &partials, &out, batch, None,
                    );
                    h.run(&ops, n);
                    let got = h.read(&out, n * q).await;
                    // The rows' longest context (300 keys) is short on CPU adapters: the one
                    // dispatch gives the same bits.
                    if short_keys > 0 {
                        h.clear(&out, n * q);
                        h.clear(&partials, partials_len);
                        h.run_rows(&ops, &SegmentRows::at_keys(n as u32, ctx, short_keys));
                        let one = h.read(&out, n * q).await;
                        let differs = (0..n * q).find(|&i| one[i].to_bits() != got[i].to_bits());
                        assert_eq!(differs, None, "one dispatch against two, window {window:?}, {}", h.path());
                    }
                    for (i, &(seq, pos)) in rows.iter().enumerate() {
                        let (k_seen, v_seen) =
                            (paging.gather(seq, &k_rows, kv, pos + 1), paging.gather(seq, &v_rows, kv, pos + 1));
                        let mut want = vec![0f32; q];
                        reference::attention(&c, kind, None, &mut want, &qkv[i * row..][..q], &k_seen, &v_seen, pos);
                        for (d, (g, w)) in got[i * q..][..q].iter().zip(&want).enumerate() {
                            assert!(
                                (g - w).abs() < 1e-4,
                                "row {i} (sequence {seq} at {pos}) window {window:?} [{d}]: got {g}, want {w}, {}",
                                h.path()
                            );
                        }
                    }
                }
            }
            h.gpu.style = own;
        }
    }
}

gpu_test! {
    async fn prefill_attention_matches_the_cpu_reference_across_query_and_key_blocks_and_windows() {
        let mut rng = Rng::new(9);
        for mut h in Harness::kv_paths().await {
            // Tiled (GPUs), and one query per invocation (CPU adapters) with the lanes on the
            // workgroup's keys (lavapipe) and on their own (SwiftShader, `Gpu::unroll_rows`).
            let unrolled = h.gpu.unroll_rows;
            for (style, unroll) in [(KernelStyle::Gpu, unrolled), (KernelStyle::Cpu, false), (KernelStyle::Cpu, true)] {
                if cfg!(target_arch = "wasm32") && style == KernelStyle::Cpu && unroll != unrolled {
                    continue;
                }
                h.gpu.style = style;
                h.gpu.unroll_rows = unroll;
                let all: &[(usize, usize, Option<usize>)] = &[
                    (2, 0, None),
                    (70, 0, None),
                    (21, 37, None),
                    (9, 200, None),
                    (70, 0, Some(5)),
                    (40, 30, Some(33)),
                    (9, 200, Some(1)),
                    (130, 100, Some(70)),
                ];
                // The browser twin (SwiftShader, slow) takes blocks past the first, and windows.
                let cases = if cfg!(target_arch = "wasm32") { &all[4..] } else { all };
                for &(n, start, window) in cases {
                    check_attention(&mut h, n, start, window, &mut rng).await;
                }
            }
        }
    }
}

gpu_test! {
    async fn argmax_picks_the_largest_logit_and_the_lowest_index_on_ties_and_flags_non_finite_logits() {
        let mut rng = Rng::new(10);
        for mut h in Harness::paths().await {
            // (n, a value put at one index, expected): the largest, or u32::MAX for NaN/inf anywhere.
            let cases = [
                (1, None, 0),
                (255, None, 170),
                (49152, None, 32768),
                (49152, Some((40000, f32::NAN)), u32::MAX),
                (49152, Some((5, f32::INFINITY)), u32::MAX),
                (300, Some((299, f32::NEG_INFINITY)), u32::MAX),
                // The most negative finite value is a value like any other.
                (2, Some((1, f32::MIN)), 0),
                // A tie in one invocation's block of eight loads (3333 + 2 x 256 with the GPUs'
                // 256 invocations, 3333 + 2 x 8 with the CPU adapters' 8): the lower index.
                (5000, Some((3845, 50.0)), 3333),
                (5000, Some((3349, 50.0)), 3333),
            ];
            for (n, put, want) in cases {
                let mut logits = random(&mut rng, n, 10.0);
                let best = n * 2 / 3;
                logits[best] = 50.0;
                if n > 2 {
                    logits[n - 1] = 50.0;
                }
                if let Some((at, v)) = put {
                    logits[at] = v;
                }
                let (lb, ob) = (h.buf(&logits), h.u32_buf(&[7]));
                let op = kernels::argmax(&h.gpu, &mut h.cache, &h.params, n, &lb, &ob, kernels::MAX_BATCH);
                h.run(&[op], 1);
                let got = h.gpu.read_buffer(&ob, 4).await.unwrap();
                assert_eq!(u32::from_le_bytes(got[..4].try_into().unwrap()), want, "n = {n}, {put:?}, {}", h.path());
            }
        }
    }
}

gpu_test! {
    async fn top_k_selects_the_largest_logits_with_ties_to_the_lower_id() {
        let mut rng = Rng::new(12);
        let mut h = Harness::new(true).await;
        let words = kernels::TOP_K_WORDS;
        // (vocabulary, k, logits rounded to this step: coarse steps make many ties).
        for (n, k, step) in [
            (5, 1, 0.0),
            (5, 5, 0.0),
            (5, 9, 0.0),
            (1000, 40, 0.0),
            (1000, 40, 0.5),
            (49152, 1, 0.0),
            (49152, 40, 0.0),
            (49152, 256, 0.25),
            (128256, 1024, 0.0),
            (128256, 1024, 1.0),
        ] {
            // Three rows in one dispatch, as a batched decode step has them: the first without
            // a tail, the second skipped (k = 0: its words stay as they were), the third with a
            // tail at temperature 0.7.
            let temperature = 0.7f32;
            let mut logits = Vec::with_capacity(3 * n);
            for _ in 0..3 {
                let mut row = random(&mut rng, n, 20.0);
                if step > 0.0 {
                    row.iter_mut().for_each(|l| *l = (*l / step).round() * step);
                }
                // Signs, zero and negative zero side by side.
                row[0] = -0.0;
                if n > 3 {
                    row[1] = 0.0;
                    row[2] = -1e-30;
                }
                logits.extend(row);
            }
            let lb = h.buf(&logits);
            let want = h.u32_buf(&[k as u32, 0, 0, 0, k as u32, temperature.to_bits()]);
            let out = h.u32_buf(&vec![0xDEAD; 3 * words]);
            // No row masked (the masks' flags are zero).
            let masks = h.u32_buf(&vec![0; (kernels::masks_bytes(n, 3) / 4) as usize]);
            let masks = kernels::Masks { buffer: &masks, rows: 3 };
            let op = kernels::top_k(&h.gpu, &mut h.cache, n, &lb, &want, &out, masks);
            h.run(&[op], 3);
            let all_words: Vec<u32> =
                bytemuck::cast_slice(&h.gpu.read_buffer(&out, 4 * 3 * words as u64).await.unwrap()).to_vec();
            assert!(all_words[words..2 * words].iter().all(|&w| w == 0xDEAD), "n = {n}: a skipped row was written");
            for (r, tail) in [(0, false), (2, true)] {
                let row = &logits[r * n..(r + 1) * n];
                let words = &all_words[r * words..(r + 1) * words];
                // The CPU sampler's order: value descending (-0 below +0, as total_cmp has it), then id.
                let mut all: Vec<(u32, f32)> = row.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
                all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                let (top, rest) = all.split_at(k.min(n));
                let count = words[0] as usize;
                assert_eq!(count, k.min(n), "n = {n}, k = {k}: the count is k (or the vocabulary)");
                let mut got: Vec<(u32, f32)> =
                    words[3..3 + 2 * count].chunks_exact(2).map(|p| (p[0], f32::from_bits(p[1]))).collect();
                got.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                assert_eq!(got, top, "n = {n}, k = {k}, step {step}, tail {tail}");
                if tail {
                    // What the rest weigh, in f64 from the definition, within the error the
                    // sampler allows for (a third of it: the bound's own estimate).
                    let max = top[0].1 as f64 / temperature as f64;
                    let exact: f64 = rest.iter().map(|&(_, l)| (l as f64 / temperature as f64 - max).exp()).sum();
                    let sum = f32::from_bits(words[1]) as f64;
                    let bound = exact * TAIL_REL_ERROR / 3.0 + 1e-30;
                    assert!((sum - exact).abs() <= bound, "n = {n}, k = {k}, step {step}: tail {sum} vs {exact}");
                    let max_abs = row.iter().fold(0f32, |m, l| m.max(l.abs()));
                    assert_eq!(f32::from_bits(words[2]), max_abs, "n = {n}, k = {k}, step {step}");
                }
            }
        }
    }
}

gpu_test! {
    async fn masked_rows_take_the_argmax_and_the_top_k_of_their_allowed_tokens_alone() {
        // Four rows in one dispatch, as a step's decode rows: row 0 masked (about a third of the
        // tokens allowed, its largest logit not), row 1 free, row 2 masked to three tokens,
        // row 3 masked with a NaN at a token its mask refuses. The truth: the CPU's argmax and
        // sorted order over each row's allowed tokens.
        let mut rng = Rng::new(13);
        let mut h = Harness::new(true).await;
        let (rows, words_out) = (4usize, kernels::TOP_K_WORDS);
        for n in [300usize, 49152] {
            let words = kernels::mask_words(n);
            let logits = random(&mut rng, rows * n, 10.0);
            let mut logits = logits;
            let mut allowed = vec![vec![true; n]; rows];
            allowed[0] = (0..n).map(|_| rng.next_f64() < 1.0 / 3.0).collect();
            allowed[2] = (0..n).map(|i| [7, n / 2, n - 1].contains(&i)).collect();
            allowed[3] = (0..n).map(|i| i % 2 == 0).collect();
            let top0 = (0..n).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap();
            allowed[0][top0] = false;
            logits[3 * n + 1] = f32::NAN;
            let mut masks = vec![0u32; (kernels::masks_bytes(n, rows) / 4) as usize];
            for r in [0, 2, 3] {
                masks[r] = 1;
                for i in (0..n).filter(|&i| allowed[r][i]) {
                    masks[rows + r * words + i / 32] |= 1 << (i % 32);
                }
            }
            let (lb, mb) = (h.buf(&logits), h.u32_buf(&masks));
            // The forward pass's argmax (every row, every token), then the masked one.
            let ob = h.u32_buf(&[7; 4]);
            h.gpu.queue.write_buffer(&h.params, 0, bytemuck::bytes_of(&Params::new(rows, rows)));
            let free = kernels::argmax(&h.gpu, &mut h.cache, &h.params, n, &lb, &ob, rows);
            let mb = kernels::Masks { buffer: &mb, rows };
            let masked = kernels::argmax_masked(&h.gpu, &mut h.cache, &h.params, n, &lb, &ob, mb);
            h.run(&[free, masked], rows);
            let got: Vec<u32> = bytemuck::cast_slice(&h.gpu.read_buffer(&ob, 16).await.unwrap()).to_vec();
            let best = |r: usize| {
                let row = &logits[r * n..(r + 1) * n];
                (0..n).filter(|&i| allowed[r][i]).max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a))).unwrap() as u32
            };
            assert_eq!(&got[..3], &[best(0), best(1), best(2)], "n = {n}");
            assert_ne!(got[0], top0 as u32, "n = {n}: the largest logit is refused");
            assert_eq!(got[3], u32::MAX, "n = {n}: a NaN flags the row, allowed or not");
            // Top-k: 40 of row 0 (with a tail at temperature 0.7), all 3 of row 2.
            let temperature = 0.7f32;
            let want = h.u32_buf(&[40, temperature.to_bits(), 0, 0, 3, 0, 0, 0]);
            let out = h.u32_buf(&vec![0xDEAD; rows * words_out]);
            let op = kernels::top_k(&h.gpu, &mut h.cache, n, &lb, &want, &out, mb);
            h.run(&[op], 3);
            let all_words: Vec<u32> =
                bytemuck::cast_slice(&h.gpu.read_buffer(&out, 4 * 3 * words_out as u64).await.unwrap()).to_vec();
            for (r, k) in [(0usize, 40usize), (2, 3)] {
                let row = &logits[r * n..(r + 1) * n];
                let mut all: Vec<(u32, f32)> =
                    (0..n).filter(|&i| allowed[r][i]).map(|i| (i as u32, row[i])).collect();
                all.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                let (top, rest) = all.split_at(k);
                let w = &all_words[r * words_out..(r + 1) * words_out];
                assert_eq!(w[0] as usize, k, "n = {n}, row {r}");
                let mut got: Vec<(u32, f32)> =
                    w[3..3 + 2 * k].chunks_exact(2).map(|p| (p[0], f32::from_bits(p[1]))).collect();
                got.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                assert_eq!(got, top, "n = {n}, row {r}");
                if r == 0 {
                    let max = top[0].1 as f64 / temperature as f64;
                    let exact: f64 = rest.iter().map(|&(_, l)| (l as f64 / temperature as f64 - max).exp()).sum();
                    let sum = f32::from_bits(w[1]) as f64;
                    assert!((sum - exact).abs() <= exact * TAIL_REL_ERROR / 3.0, "n = {n}: tail {sum} vs {exact}");
                    let max_abs = all.iter().fold(0f32, |m, p| m.max(p.1.abs()));
                    assert_eq!(f32::from_bits(w[2]), max_abs, "n = {n}: the largest allowed |logit|");
                }
            }
        }
    }
}

gpu_test! {
    async fn matrices_larger_than_one_binding_are_split_into_parts_with_the_same_results() {
        let mut rng = Rng::new(11);
        let (n, rows, cols) = (5, 100, 64);
        for mut h in Harness::paths().await {
            h.set(n, 0, 16);
            let (a, ab) = random_tensor(&mut rng, GgmlType::Q8_0, rows, cols);
            let (b, bb) = random_tensor(&mut rng, GgmlType::Q4_1, 30, cols);
            // 1 KiB bindings: a's 100 rows of 72 bytes need 8 parts; b (another type) its own
            // parts. Each part is a pipeline of its own (its row count and offset are constants),
            // which SwiftShader compiles in about a second: the browser twin's 3 KiB bindings
            // give a three parts and b one.
            let binding = if cfg!(target_arch = "wasm32") { 3 << 10 } else { 1 << 10 };
            h.gpu.limits.max_storage_buffer_binding_size = binding;
            let (b_info, file) = after(&a, &ab, &b, &bb);
            let inputs = [Rows::of(&a).unwrap(), Rows::of(&b_info).unwrap()];
            let lin = Linear::new(&h.gpu, "split", &inputs, &file[..]).await.unwrap();
            assert!(lin.parts.len() >= if binding == 1024 { 9 } else { 4 }, "{} parts", lin.parts.len());
            h.gpu.limits.max_storage_buffer_binding_size = 1 << 27;
            let w: Vec<f32> = [dequantize(&a, &ab).unwrap(), dequantize(&b, &bb).unwrap()].concat();
            let x = random(&mut rng, n * cols, 1.0);
            let (want, scale) = reference_matmul(&w, &x, cols);
            let total = rows + 30;
            let (x1, y1) = (h.buf(&x[..cols]), h.buf(&vec![0.0; total]));
            let ops = kernels::gemv(&h.gpu, &mut h.cache, GemvBatch { params: &h.params, mb: 1, xq: None }, &lin, Activation::Silu, Epilogue::Store, None, &x1, &y1, total);
            h.run(&ops, 1);
            assert_close("split gemv", &h.read(&y1, total).await, &want[..total], &scale[..total], MATMUL_REL);
            let (xb, yb) = (h.buf(&x), h.buf(&vec![0.0; n * total]));
            let ops = kernels::gemm(&h.gpu, &mut h.cache, &h.params, None, &lin, Epilogue::Store, &xb, &yb, total);
            h.run(&ops, n);
            assert_close("split gemm", &h.read(&yb, n * total).await, &want, &scale, MATMUL_REL);
            let tokens = [0u32, 99, 100, 129, 42];
            let (tb, eb) = (h.u32_buf(&tokens), h.buf(&vec![0.0; tokens.len() * cols]));
            let ops = kernels::embed(&h.gpu, &mut h.cache, &h.params, &lin, 1.0, &tb, &eb);
            h.run(&ops, tokens.len());
            let want: Vec<f64> = tokens
                .iter()
                .flat_map(|&t| w[t as usize * cols..(t as usize + 1) * cols].iter().map(|&v| v as f64))
                .collect();
            let scale: Vec<f64> = want.iter().map(|v| v.abs()).collect();
            assert_close("split embedding", &h.read(&eb, tokens.len() * cols).await, &want, &scale, 1e-6);
        }
    }
}

gpu_test! {
    async fn batched_gemv_takes_every_row_of_x_with_its_own_norm_and_epilogue() {
        let mut rng = Rng::new(21);
        let (rows, cols, eps, batch) = (70, 256, 1e-5, 11);
        for mut h in Harness::paths().await {
            let (info, bytes) = random_tensor(&mut rng, GgmlType::Q4_1, rows, cols);
            let w = dequantize(&info, &bytes).unwrap();
            let lin = linear(&h, &info, &bytes).await;
            let (gi, gbytes) = random_tensor(&mut rng, GgmlType::Q8_0, rows, cols);
            let (ui, ubytes) = random_tensor(&mut rng, GgmlType::Q8_0, rows, cols);
            let (up_info, file) = after(&gi, &gbytes, &ui, &ubytes);
            let (gate, up) = (Rows::of(&gi).unwrap(), Rows::of(&up_info).unwrap());
            let pair = Linear::gated_pair(&h.gpu, "gate_up", gate, up, &file[..]).await.unwrap().expect("same types");
            let (wg, wu) = (dequantize(&gi, &gbytes).unwrap(), dequantize(&ui, &ubytes).unwrap());
            let x = random(&mut rng, batch * cols, 3.0);
            let nw = random(&mut rng, cols, 1.0);
            let y0 = random(&mut rng, batch * rows, 1.0);
            // Each row alone, in f64: the product, the product of the normalized row, the gated pair.
            let (mut plain, mut normed, mut gated, mut scale) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for r in 0..batch {
                let xr = &x[r * cols..][..cols];
                let (p, sc) = reference_matmul(&w, xr, cols);
                plain.extend(p.iter().zip(&y0[r * rows..]).map(|(a, &b)| a + b as f64));
                scale.extend(sc);
                let mut xn = vec![0f32; cols];
                reference::rms_norm(&mut xn, xr, &nw, eps);
                normed.extend(reference_matmul(&w, &xn, cols).0);
                let (g, u) = (reference_matmul(&wg, xr, cols).0, reference_matmul(&wu, xr, cols).0);
                gated.extend(g.iter().zip(&u).map(|(&a, &b)| act64(Activation::Silu, a) * b));
            }
            let loose: Vec<f64> = normed.iter().chain(&gated).map(|v| v.abs().max(1.0) * 8.0).collect();
            // A pass over the weights per row, per 8 rows, and per 4 (the last pass partial).
            for mb in [1, 4, 8] {
                let rows_at: Vec<(usize, usize)> = (0..batch).map(|r| (r % LAYOUT.max_seqs, r)).collect();
                h.set_rows(&rows_at, batch, 16);
                let gb = GemvBatch { params: &h.params, mb, xq: None };
                let what = format!("batched gemv, {batch} rows, MB {mb}, {}", h.path());
                let (xb, nb, yb) = (h.buf(&x), h.buf(&nw), h.buf(&y0));
                let ops = kernels::gemv(&h.gpu, &mut h.cache, gb, &lin, Activation::Silu, Epilogue::Add, None, &xb, &yb, rows);
                h.run(&ops, batch);
                assert_close(&format!("{what}, add"), &h.read(&yb, batch * rows).await, &plain, &scale, MATMUL_REL);
                let yb = h.buf(&vec![0.0; batch * rows]);
                let norm = Some(NormIn::Fused(&nb, eps));
                let ops = kernels::gemv(&h.gpu, &mut h.cache, gb, &lin, Activation::Silu, Epilogue::Store, norm, &xb, &yb, rows);
                h.run(&ops, batch);
                assert_close(&format!("{what}, fused norm"), &h.read(&yb, batch * rows).await, &normed, &loose, 1e-5);
                let yb = h.buf(&vec![0.0; batch * rows]);
                let ops = kernels::gemv(&h.gpu, &mut h.cache, gb, &pair, Activation::Silu, Epilogue::Store, None, &xb, &yb, rows);
                h.run(&ops, batch);
                assert_close(&format!("{what}, gated"), &h.read(&yb, batch * rows).await, &gated, &loose[normed.len()..], 1e-5);
            }
            h.set(1, 0, 16);
        }
    }
}

// The int8 decode gemv (GPU-style kernels over 32-value integer blocks): quantize_x's records
// are each block's values (RMS-normalized first when the norm is fused) in two int8 slices,
// checked against their definition (`int8_record_values`); the gemv's outputs are the products of the
// CPU's dequantized rows with those records' values, in f64 (the integer sums exact, the
// scales in f32: the f32 bound of the other gemvs), for every epilogue, 1 and 3 batch rows,
// MB 1 and 8.
gpu_test! {
    async fn int8_gemv_takes_x_as_int8_blocks_and_sums_their_products_exactly() {
        let mut rng = Rng::new(13);
        let (rows, cols, eps) = (77, 256, 1e-5);
        let mut h = Harness::new(false).await;
        h.gpu.style = KernelStyle::Gpu;
        h.gpu.int8 = true;
        let blocks = cols / 32;
        let xq = h.gpu.storage("xq", kernels::int8_scratch_bytes(h.gpu.max_batch.next_multiple_of(8), cols)).unwrap();
        for ty in types().filter(|&ty| webgpu_llm::quant::format(ty).unwrap().int8_fn().is_some()) {
            let (gi, gb) = random_tensor(&mut rng, ty, rows, cols);
            let (ui, ub) = random_tensor(&mut rng, ty, rows, cols);
            let (up_info, file) = after(&gi, &gb, &ui, &ub);
            let pair = Linear::gated_pair(&h.gpu, "gate_up", Rows::of(&gi).unwrap(), Rows::of(&up_info).unwrap(), &file[..])
                .await
                .unwrap()
                .expect("same types pair up");
            let lin = linear(&h, &gi, &gb).await;
            let (gw, uw) = (dequantize(&gi, &gb).unwrap(), dequantize(&ui, &ub).unwrap());
            for (n, mb, norm, epilogue) in
                [(1, 1, false, Epilogue::Store), (3, 8, true, Epilogue::Add), (3, 1, false, Epilogue::Store)]
            {
                let mut x = random(&mut rng, n * cols, 3.0);
                x[32..64].iter_mut().for_each(|v| *v = 0.0);
                let nw = random(&mut rng, cols, 1.0);
                let y0 = random(&mut rng, n * rows, 1.0);
                let (xb, nb) = (h.buf(&x), h.buf(&nw));
                h.set_rows(&(0..n).map(|i| (i, 0)).collect::<Vec<_>>(), n, 16);
                let batch = GemvBatch { params: &h.params, mb, xq: Some(&xq) };
                let norm = norm.then_some(NormIn::Fused(&nb, eps));
                for gated in [false, true] {
                    let yb = h.buf(&y0);
                    let (w, act) = if gated { (&pair, Activation::GeluTanh) } else { (&lin, Activation::Silu) };
                    let ops = kernels::gemv(&h.gpu, &mut h.cache, batch, w, act, epilogue, norm, &xb, &yb, rows);
                    assert_eq!(ops[0].label, "quantize_x", "{ty:?}: the int8 path");
                    h.run(&ops, n);
                    let words: Vec<u32> = bytemuck::cast_slice(&h.read(&xq, n * blocks * INT8_RECORD_WORDS).await).to_vec();
                    let what = format!("int8 gemv {ty:?}, {n} rows, MB {mb}, norm {}, {epilogue:?}, gated {gated}", norm.is_some());
                    let mut rows_in = Vec::new();
                    for row in x.chunks_exact(cols) {
                        let mut t = row.to_vec();
                        if norm.is_some() {
                            reference::rms_norm(&mut t, row, &nw, eps);
                        }
                        rows_in.extend(t);
                    }
                    let xv = int8_record_values(&what, &words, &rows_in);
                    let (g, gs) = reference_matmul(&gw, &xv, cols);
                    let (want, scale): (Vec<f64>, Vec<f64>) = if gated {
                        let (u, us) = reference_matmul(&uw, &xv, cols);
                        let want = g.iter().zip(&u).map(|(&a, &b)| act64(act, a) * b).collect();
                        (want, gs.iter().zip(&us).zip(&u).zip(&g).map(|(((a, b), u), g)| a * u.abs() + b * g.abs() + a * b).collect())
                    } else if epilogue == Epilogue::Add {
                        (g.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect(), gs)
                    } else {
                        (g, gs)
                    };
                    assert_close(&what, &h.read(&yb, n * rows).await, &want, &scale, MATMUL_REL);
                }
            }
        }
    }
}

/// u32 words of a quantize_x record.
const INT8_RECORD_WORDS: usize = (kernels::INT8_RECORD_BYTES / 4) as usize;

/// The values quantize_x's records (`words`, five vec4<u32> a block) stand for, checked
/// against their definition for the rows `x` they were made from: each block's values as
/// e (254 q_i + r_i), with dx = max |value| / 127, q_i the nearest integer to value / dx and r_i
/// the nearest to what is left over dx / 254 (each within float rounding; |r_i| <= 127), e =
/// dx / 254 (an all-zero block has 0), and sx = e sum(254 q_i + r_i); so each value is held
/// within dx / 508 (and float rounding), where one slice alone holds it within dx / 2.
fn int8_record_values(what: &str, words: &[u32], x: &[f32]) -> Vec<f32> {
    let record = INT8_RECORD_WORDS;
    let mut values = Vec::new();
    for (k, tb) in x.chunks_exact(32).enumerate() {
        let r = &words[k * record..][..record];
        let q: Vec<i8> = bytemuck::cast_slice::<u32, i8>(&r[..8]).to_vec();
        let rest: Vec<i8> = bytemuck::cast_slice::<u32, i8>(&r[8..16]).to_vec();
        let (e, sx) = (f32::from_bits(r[16]), f32::from_bits(r[17]));
        let amax = tb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let dx = amax as f64 / 127.0;
        assert!((e as f64 - dx / 254.0).abs() <= 1e-5 * dx / 254.0, "{what}: block {k} scale {e}, max {amax}");
        let mut sum = 0i64;
        for (i, ((&v, &qi), &ri)) in tb.iter().zip(&q).zip(&rest).enumerate() {
            let exact = if dx > 0.0 { v as f64 / dx } else { 0.0 };
            assert!((exact - qi as f64).abs() <= 0.5 + 1e-3, "{what}: value {k}.{i} {v} as {qi} x {dx}");
            assert!(
                ((exact - qi as f64) * 254.0 - ri as f64).abs() <= 0.5 + 1e-2 && ri != i8::MIN,
                "{what}: value {k}.{i} {v}: {qi} leaves {}, held as {ri}",
                (exact - qi as f64) * 254.0
            );
            let both = 254 * qi as i64 + ri as i64;
            let held = e as f64 * both as f64;
            assert!((held - v as f64).abs() <= dx / 508.0 * 1.03 + 1e-30, "{what}: value {k}.{i} {v} held as {held}");
            sum += both;
            values.push(held as f32);
        }
        assert!(
            (sx as f64 - e as f64 * sum as f64).abs() <= 1e-6 * (e as f64 * sum.abs() as f64) + 1e-12,
            "{what}: block {k} sum"
        );
    }
    values
}

// The int8 prefill gemm (GPU-style kernels over 32-value integer blocks, shaders/gemm_int8.wgsl):
// quantize_x's records of each token (checked against their definition), and each output the
// product of the CPU's dequantized row with those records' values in f64 (the integer sums
// exact, the scales in f32: the f32 bound of the other matrix products), past one tile of 64
// tokens and of 64 rows, with an even and an odd number of blocks a row (the last step of two
// blocks half past the row), added to the residual, and a gated pair's gate and up columns.
gpu_test! {
    async fn int8_gemm_takes_x_as_int8_blocks_and_sums_their_products_exactly() {
        let mut rng = Rng::new(14);
        let (n, rows) = (70, 130);
        let mut h = Harness::new(false).await;
        h.gpu.style = KernelStyle::Gpu;
        h.gpu.int8 = true;
        let xq = h.gpu.storage("xq", kernels::int8_scratch_bytes(kernels::BASE_ROWS, 288)).unwrap();
        h.set(n, 0, 16);
        for ty in types().filter(|&ty| webgpu_llm::quant::format(ty).unwrap().int8_fn().is_some()) {
            for cols in [256, 288] {
                let (info, bytes) = random_tensor(&mut rng, ty, rows, cols);
                let w = dequantize(&info, &bytes).unwrap();
                let lin = linear(&h, &info, &bytes).await;
                let mut x = random(&mut rng, n * cols, 3.0);
                x[32..64].iter_mut().for_each(|v| *v = 0.0);
                let y0 = random(&mut rng, n * rows, 1.0);
                let (xb, yb) = (h.buf(&x), h.buf(&y0));
                let ops = kernels::gemm(&h.gpu, &mut h.cache, &h.params, Some(kernels::Int8Scratch { buffer: &xq, rows: kernels::BASE_ROWS }), &lin, Epilogue::Add, &xb, &yb, rows);
                assert_eq!(ops[0].label, "quantize_x", "{ty:?}: the int8 path");
                h.run(&ops, n);
                let what = format!("int8 gemm {ty:?}, {cols} columns");
                let words: Vec<u32> = bytemuck::cast_slice(&h.read(&xq, n * cols / 32 * INT8_RECORD_WORDS).await).to_vec();
                let xv = int8_record_values(&what, &words, &x);
                let (want, scale) = reference_matmul(&w, &xv, cols);
                let added: Vec<f64> = want.iter().zip(&y0).map(|(a, &b)| a + b as f64).collect();
                assert_close(&what, &h.read(&yb, n * rows).await, &added, &scale, MATMUL_REL);
            }
        }
        let cols = 256;
        let (pair, gw, uw) = random_pair(&h, &mut rng, GgmlType::Q4_1, rows, cols).await;
        let x = random(&mut rng, n * cols, 3.0);
        let (xb, yb) = (h.buf(&x), h.buf(&vec![0.0; n * 2 * rows]));
        let ops = kernels::gemm(&h.gpu, &mut h.cache, &h.params, Some(kernels::Int8Scratch { buffer: &xq, rows: kernels::BASE_ROWS }), &pair, Epilogue::Store, &xb, &yb, 2 * rows);
        h.run(&ops, n);
        let words: Vec<u32> = bytemuck::cast_slice(&h.read(&xq, n * cols / 32 * INT8_RECORD_WORDS).await).to_vec();
        let xv = int8_record_values("int8 gemm, gated pair", &words, &x);
        let (want, scale) = pair_matmul(&gw, &uw, &xv, cols);
        let got = h.read(&yb, n * 2 * rows).await;
        assert_close("int8 gemm, gated pair", &got, &want, &scale, MATMUL_REL);
    }
}

gpu_test! {
    async fn gemv_with_a_fused_rms_norm_matches_norm_then_product() {
        let mut rng = Rng::new(12);
        let (rows, cols, eps) = (77, 576, 1e-5);
        for mut h in Harness::paths().await {
            let (info, bytes) = random_tensor(&mut rng, GgmlType::Q4_1, rows, cols);
            let w = dequantize(&info, &bytes).unwrap();
            let lin = linear(&h, &info, &bytes).await;
            let x = random(&mut rng, cols, 3.0);
            let nw = random(&mut rng, cols, 1.0);
            let mut normed = vec![0f32; cols];
            reference::rms_norm(&mut normed, &x, &nw, eps);
            let (want, scale) = reference_matmul(&w, &normed, cols);
            let (xb, nb, yb) = (h.buf(&x), h.buf(&nw), h.buf(&vec![0.0; rows]));
            let ops = kernels::gemv(&h.gpu, &mut h.cache, GemvBatch { params: &h.params, mb: 1, xq: None }, &lin, Activation::Silu, Epilogue::Store, Some(NormIn::Fused(&nb, eps)), &xb, &yb, rows);
            h.run(&ops, 1);
            assert_close(&format!("gemv + rms_norm, {}", h.path()), &h.read(&yb, rows).await, &want, &scale, 1e-5);
        }
    }
}

// A CPU-style residual gemv that feeds the next norm (shaders/gemv_feed.wgsl) adds W x to y as
// the plain one does, and the gemv after it (NORM_FED: x times the norm's weights, the scale from
// the sums of squares the first left) gives the CPU reference's rms_norm then product, for 1 and
// 3 batch rows (the unrolled single row and the batched loop), each form of the rows, and a
// residual split in two parts (the second starting at row 96); at 200 values a row, whose 25 sums
// are padded to 28. The norm's own FEED pass over the same y writes the same bits as the feeding
// gemv, and the gemm and a batch's gemv (MB 8) over them, with the scales it wrote, the fed
// gemv's: a row gets the same logits in a batch (tiled or not) as alone.
gpu_test! {
    async fn a_residual_gemv_feeding_the_next_norm_gives_add_norm_then_product() {
        let mut rng = Rng::new(14);
        let (d, cols, rows, eps) = (200, 256, 77, 1e-5);
        for mut h in Harness::paths().await.into_iter().filter(|h| h.gpu.style == KernelStyle::Cpu) {
            let (wi, wb) = random_tensor(&mut rng, GgmlType::Q4_1, d, cols);
            // A residual projection in two parts of 96 rows (as a split one would be).
            let (ai, ab) = random_tensor(&mut rng, GgmlType::Q4_1, 96, cols);
            let (bi, bb) = random_tensor(&mut rng, GgmlType::Q4_1, d - 96, cols);
            let (bi_after, file) = after(&ai, &ab, &bi, &bb);
            let split = Linear::new(&h.gpu, "w", &[Rows::of(&ai).unwrap(), Rows::of(&bi_after).unwrap()], &file[..])
                .await
                .unwrap();
            let split_w = [dequantize(&ai, &ab).unwrap(), dequantize(&bi, &bb).unwrap()].concat();
            let whole = linear(&h, &wi, &wb).await;
            let (vi, vb) = random_tensor(&mut rng, GgmlType::F16, rows, d);
            let v = dequantize(&vi, &vb).unwrap();
            let next = linear(&h, &vi, &vb).await;
            for n in [1, 3] {
                let x = random(&mut rng, n * cols, 3.0);
                let y0 = random(&mut rng, n * d, 2.0);
                let g = random(&mut rng, d, 1.0);
                h.set_rows(&(0..n).map(|i| (i, 0)).collect::<Vec<_>>(), n, 16);
                // A sequence's step (MB 1, the fed norm's) and a batch's (MB 8).
                let (gb, gb8) = (GemvBatch { params: &h.params, mb: 1, xq: None }, GemvBatch { params: &h.params, mb: 8, xq: None });
                for (parts, lin, w) in [("one part", &whole, dequantize(&wi, &wb).unwrap()), ("two parts", &split, split_w.clone())] {
                    let (mut added, mut add_scale, mut want, mut scale) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                    for r in 0..n {
                        let (p, sc) = reference_matmul(&w, &x[r * cols..][..cols], cols);
                        let yr: Vec<f32> = p.iter().zip(&y0[r * d..][..d]).map(|(a, &b)| (a + b as f64) as f32).collect();
                        added.extend(yr.iter().map(|&v| v as f64));
                        add_scale.extend(sc);
                        let mut normed = vec![0f32; d];
                        reference::rms_norm(&mut normed, &yr, &g, eps);
                        let (o, os) = reference_matmul(&v, &normed, d);
                        want.extend(o);
                        scale.extend(os);
                    }
                    let what = format!("feeding gemv, {n} rows, {parts}, {}", h.path());
                    let (xb, yb, gw) = (h.buf(&x), h.buf(&y0), h.buf(&g));
                    // The sums: NaN where written, the pads zero (as a new buffer's).
                    let stride = kernels::feed_sums_bytes(1, d) as usize / 4;
                    let unwritten: Vec<f32> = (0..n * stride).map(|i| if i % stride < d / 8 { f32::NAN } else { 0.0 }).collect();
                    let (xn, sums) = (h.buf(&vec![f32::NAN; n * d]), h.buf(&unwritten));
                    let feed = Feed { weights: &gw, x: &xn, sums: &sums };
                    let ops = kernels::gemv_feeding(&h.gpu, &mut h.cache, gb8, lin, feed, &xb, &yb, d);
                    h.run(&ops, n);
                    assert_close(&format!("{what}: y + W x"), &h.read(&yb, n * d).await, &added, &add_scale, MATMUL_REL);
                    let out = h.buf(&vec![0.0; n * rows]);
                    let norm = Some(NormIn::Fed { sums: &sums, eps });
                    let ops = kernels::gemv(&h.gpu, &mut h.cache, gb, &next, Activation::Silu, Epilogue::Store, norm, &xn, &out, rows);
                    h.run(&ops, n);
                    let got = h.read(&out, n * rows).await;
                    assert_close(&format!("{what}: the next product"), &got, &want, &scale, 1e-5);
                    // The norm's pass and the gemm: the same bits.
                    let (xn2, sums2) = (h.buf(&vec![f32::NAN; n * d]), h.buf(&unwritten));
                    let scales = h.buf(&vec![f32::NAN; n]);
                    let op = kernels::rms_norm_feed(&h.gpu, &mut h.cache, &h.params, d, eps, false, &yb, &gw, &xn2, &sums2, &scales);
                    h.run(&[op], n);
                    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                    assert_eq!(bits(h.read(&xn2, n * d).await), bits(h.read(&xn, n * d).await), "{what}: the norm pass's x");
                    assert_eq!(bits(h.read(&sums2, n * stride).await), bits(h.read(&sums, n * stride).await), "{what}: its sums");
                    let out2 = h.buf(&vec![0.0; n * rows]);
                    let ops = kernels::gemm_normed(&h.gpu, &mut h.cache, &h.params, None, &next, Epilogue::Store, Some(&scales), &xn2, &out2, rows);
                    h.run(&ops, n);
                    assert_eq!(bits(h.read(&out2, n * rows).await), bits(got.clone()), "{what}: the gemm's products");
                    // A batch's gemv over the pass's scales: the same bits.
                    let out3 = h.buf(&vec![0.0; n * rows]);
                    let norm = Some(NormIn::Scaled { scales: &scales });
                    let ops = kernels::gemv(&h.gpu, &mut h.cache, gb8, &next, Activation::Silu, Epilogue::Store, norm, &xn2, &out3, rows);
                    h.run(&ops, n);
                    assert_eq!(bits(h.read(&out3, n * rows).await), bits(got), "{what}: a batch's gemv over the scales");
                }
            }
            h.set(1, 0, 16);
        }
    }
}

// A top-k sampler's draw on the GPU (shaders/draw.wgsl, after the top-k selection) takes the
// token the host's sampler draws from the same logits with the same seed (`Sampler::sample` on
// all of them: top-k, temperature, top-p, min-p, the seeded draw), for samplers from k = 1 to
// MAX_TOP_K, peaked and flat temperatures, an overflowing one, ties, and a row whose logits were
// flagged non-finite (it stays flagged), with both kernel styles. The GPU's exp and f32 sums differ from the host's expf
// and f64 sums by up to 6e-5 of the mass (an f32 sum of 1024 terms): a draw whose uniform falls
// within 1e-4 of the mass of a boundary (of the draw, the top-p cut or the min-p cut, by an f64
// count of the same sampler) is not compared, and such draws must stay few.
gpu_test! {
    async fn the_gpu_draw_takes_the_token_the_host_sampler_draws_with_the_same_seed() {
        use webgpu_llm::sampling::{Sampler, SamplingParams};
        let mut rng = Rng::new(41);
        let mut h = Harness::new(false).await;
        let (rows, n) = (4usize, 3000usize);
        let cases: [(f32, usize, f32, f32); 9] = [
            (0.8, 40, 0.9, 0.05),
            (1.0, 1, 1.0, 0.0),
            (1.5, 1024, 1.0, 0.0),
            (0.3, 200, 0.95, 0.0),
            (1.0, 50, 1.0, 0.1),
            (4.0, 100, 1.0, 0.6),
            (2.0, 777, 0.5, 0.0),
            (1.0e-30, 40, 0.9, 0.0),
            (0.7, 1024, 0.9, 0.02),
        ];
        let (mut compared, mut skipped) = (0, 0);
        for (case, &(temperature, top_k, top_p, min_p)) in cases.iter().enumerate() {
            for round in 0..6u64 {
                // Both kernel styles (256 invocations sort on GPUs, 8 on CPU adapters).
                h.gpu.style = if round % 2 == 0 { KernelStyle::Gpu } else { KernelStyle::Cpu };
                let logits = logits_tied_at_the_top(&mut rng, rows, n);
                let params = |r: usize| SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    seed: 1000 * case as u64 + 10 * round + r as u64,
                    ..SamplingParams::default()
                };
                let mut want = Vec::new();
                let mut draws = Vec::new();
                let mut margins = Vec::new();
                for r in 0..rows {
                    let row = &logits[r * n..][..n];
                    let mut host = Sampler::new(params(r), n).unwrap();
                    want.push(host.sample(&mut row.to_vec()));
                    let mut gpu = Sampler::new(params(r), n).unwrap();
                    let u = gpu.gpu_uniform(false);
                    draws.extend(draw_words(u, temperature, top_p, min_p, false));
                    margins.push(draw_margin(row, temperature, top_k, top_p, min_p, u as f64).0);
                }
                let wants: Vec<u32> = (0..rows).flat_map(|_| [top_k.min(kernels::MAX_TOP_K) as u32, 0]).collect();
                let got = select_and_draw(&mut h, &logits, n, &wants, &draws).await;
                assert_eq!(got[3], u32::MAX, "case {case}: a flagged row stays flagged");
                for r in 0..3 {
                    if margins[r] < 1e-4 {
                        eprintln!("case {case}, round {round}, row {r}: margin {:.1e}, not compared", margins[r]);
                        skipped += 1;
                        continue;
                    }
                    compared += 1;
                    assert_eq!(got[r], want[r], "case {case} {:?}, round {round}, row {r} (margin {:.2e})", cases[case], margins[r]);
                }
            }
        }
        // Most draws are compared (the flat distributions over hundreds of candidates put a cut
        // within 1e-4 of the mass most often).
        assert!(compared >= 100 && skipped * 5 <= compared, "{skipped} draws too close to a boundary to compare, {compared} compared");
    }
}

/// `rows` rows of `n` random logits, row 1's largest at three ids (ties at the top).
fn logits_tied_at_the_top(rng: &mut Rng, rows: usize, n: usize) -> Vec<f32> {
    let mut logits = random(rng, rows * n, 6.0);
    let top1 = (0..n).max_by(|&a, &b| logits[n + a].total_cmp(&logits[n + b])).unwrap();
    for i in [5, 6, n - 2] {
        logits[n + i] = logits[n + top1];
    }
    logits
}

/// A draw row's words (shaders/draw.wgsl's `Draw`).
fn draw_words(u: f32, t: f32, top_p: f32, min_p: f32, nucleus: bool) -> [u32; kernels::DRAW_WORDS] {
    [u.to_bits(), t.to_bits(), top_p.to_bits(), min_p.to_bits(), nucleus as u32]
}

/// The top-k selection (`wants`: k and T's bits a row) then the draw (`draws`) over rows of `n`
/// logits, the last row flagged non-finite as the forward pass's argmax flags it: each row's id.
async fn select_and_draw(h: &mut Harness, logits: &[f32], n: usize, wants: &[u32], draws: &[u32]) -> Vec<u32> {
    let rows = logits.len() / n;
    let mut flags = vec![0u32; rows];
    flags[rows - 1] = u32::MAX;
    let (lb, wb, db, ob) = (h.buf(logits), h.u32_buf(wants), h.u32_buf(draws), h.u32_buf(&flags));
    let sel = h.gpu.storage("selection", (rows * kernels::TOP_K_WORDS * 4) as u64).unwrap();
    let mask_buffer = h.u32_buf(&vec![0; (kernels::masks_bytes(n, rows) / 4) as usize]);
    let masks = kernels::Masks { buffer: &mask_buffer, rows };
    let select = kernels::top_k(&h.gpu, &mut h.cache, n, &lb, &wb, &sel, masks);
    let draw = kernels::draw(&h.gpu, &mut h.cache, n, &sel, &db, &ob);
    h.run(&[select, draw], rows);
    bytemuck::cast_slice(&h.gpu.read_buffer(&ob, 4 * rows as u64).await.unwrap()).to_vec()
}

// A top-p/min-p sampler without top-k draws on the GPU from the NUCLEUS_K largest logits and
// the tail's sum (shaders/draw.wgsl's nucleus rows): the token the host's sampler draws from all
// the logits with the same seed, or UNDECIDED, never a token, when the tokens it keeps reach past
// the selection (counted in f64 over all the logits, apart from the code under test); peaked,
// flat and overflowing temperatures, top-p and min-p alone and together, ties, a flagged row,
// both kernel styles; a vocabulary the selection covers whole (800) always decides. Draws
// within 1e-4 of a boundary are not compared (as above), and an UNDECIDED where the tokens
// that decide fit the selection (a cut within the tail's error bound of a token) must be rare.
gpu_test! {
    async fn the_gpu_nucleus_draw_takes_the_host_samplers_token_or_leaves_it_to_the_host() {
        use webgpu_llm::sampling::{Sampler, SamplingParams};
        let mut rng = Rng::new(43);
        let mut h = Harness::new(false).await;
        let rows = 4usize;
        let cases: [(f32, f32, f32); 8] =
            [(0.8, 0.9, 0.0), (1.0, 0.95, 0.0), (0.7, 1.0, 0.05), (0.5, 0.5, 0.1), (4.0, 0.9, 0.0), (3.0, 1.0, 0.01), (1.0e-30, 0.9, 0.0), (2.0, 0.3, 0.0)];
        let (mut compared, mut skipped, mut left, mut fits_left) = (0, 0, 0, 0);
        for n in [3000usize, 800] {
            for (case, &(temperature, top_p, min_p)) in cases.iter().enumerate() {
                for round in 0..4u64 {
                    h.gpu.style = if round % 2 == 0 { KernelStyle::Gpu } else { KernelStyle::Cpu };
                    let logits = logits_tied_at_the_top(&mut rng, rows, n);
                    let params = |r: usize| SamplingParams {
                        temperature,
                        top_k: 0,
                        top_p,
                        min_p,
                        seed: 1000 * case as u64 + 10 * round + r as u64,
                        ..SamplingParams::default()
                    };
                    let (mut want, mut draws, mut checks) = (Vec::new(), Vec::new(), Vec::new());
                    for r in 0..rows {
                        let row = &logits[r * n..][..n];
                        let mut host = Sampler::new(params(r), n).unwrap();
                        assert!(host.nucleus_only());
                        want.push(host.sample(&mut row.to_vec()));
                        let u = Sampler::new(params(r), n).unwrap().gpu_uniform(false);
                        draws.extend(draw_words(u, temperature, top_p, min_p, true));
                        checks.push(draw_margin(row, temperature, n, top_p, min_p, u as f64));
                    }
                    let k = kernels::NUCLEUS_K.min(n) as u32;
                    let wants: Vec<u32> = (0..rows).flat_map(|_| [k, temperature.to_bits()]).collect();
                    let got = select_and_draw(&mut h, &logits, n, &wants, &draws).await;
                    let at = format!("n {n}, case {case} {:?}, round {round}", cases[case]);
                    assert_eq!(got[3], u32::MAX, "{at}: a flagged row stays flagged");
                    for r in 0..3 {
                        let (margin, kept) = checks[r];
                        if kept > kernels::NUCLEUS_K {
                            assert_eq!(got[r], kernels::UNDECIDED, "{at}, row {r}: {kept} tokens kept, past the selection");
                            left += 1;
                        } else if got[r] == kernels::UNDECIDED {
                            assert!(n > kernels::NUCLEUS_K, "{at}, row {r}: a whole vocabulary always decides");
                            fits_left += 1;
                        } else if margin < 1e-4 {
                            eprintln!("{at}, row {r}: margin {margin:.1e}, not compared");
                            skipped += 1;
                        } else {
                            compared += 1;
                            assert_eq!(got[r], want[r], "{at}, row {r} (margin {margin:.2e})");
                        }
                    }
                }
            }
        }
        eprintln!("{compared} compared, {skipped} near a boundary, {left} past the selection, {fits_left} left to the host that fit");
        assert!(left >= 12, "the flat cases reach past the selection: {left}");
        // A nucleus of hundreds of tokens has a weight within 1e-4 of a cut or of the draw in
        // about a quarter of the draws (the top-k test's k of 1 to 1024 in fewer).
        assert!(compared >= 100 && skipped * 2 <= compared && fits_left * 10 <= compared, "{compared} compared, {skipped} skipped, {fits_left} left");
    }
}

/// How far (as a fraction of the kept mass) the draw of a top-k/top-p/min-p sampler with
/// uniform `u` over `row` is from changing: the nearest boundary of the cumulative weights to
/// u times their sum, and how close the top-p and min-p cuts came to keeping one token more or
/// less; and how many of the largest it must see (up to the top-p cut, else those min-p keeps). An f64 count, apart from the code under test. An
/// overflowing temperature has no margin to lose (the largest logit takes it all): infinity.
fn draw_margin(row: &[f32], t: f32, top_k: usize, top_p: f32, min_p: f32, u: f64) -> (f64, usize) {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order.truncate(top_k.min(row.len()));
    if order.iter().any(|&i| !(row[i] / t).is_finite()) {
        return (f64::INFINITY, 1);
    }
    let top = row[order[0]] as f64 / t as f64;
    let w: Vec<f64> = order.iter().map(|&i| (row[i] as f64 / t as f64 - top).exp()).collect();
    let z: f64 = w.iter().sum();
    let mut margin = f64::INFINITY;
    let mut keep = w.len();
    if top_p < 1.0 {
        let goal = top_p as f64 * z;
        let mut mass = 0.0;
        for (i, &x) in w.iter().enumerate() {
            mass += x;
            margin = margin.min((mass - goal).abs() / z);
            if mass >= goal {
                keep = i + 1;
                break;
            }
        }
    }
    let kept: Vec<f64> = w[..keep].iter().copied().filter(|&x| x >= min_p as f64).collect();
    for &x in &w[..keep] {
        if min_p > 0.0 {
            margin = margin.min((x - min_p as f64).abs());
        }
    }
    let total: f64 = kept.iter().sum();
    let r = u * total;
    let mut mass = 0.0;
    for &x in &kept {
        mass += x;
        margin = margin.min((mass - r).abs() / total);
    }
    // The tokens that decide the draw: those up to the top-p cut, else those min-p keeps.
    (margin, if top_p < 1.0 { keep } else { kept.len() })
}

// The LM head's gemv doing the argmax's first pass (a record per group of rows) and the pass
// over those records: each batch row's id is the argmax of the logits the same gemv stored (the
// lowest id on ties, u32::MAX for a NaN or infinite logit anywhere), and those logits are the
// CPU's product; over several weight types, a matrix split into parts, MB 1 and 8, 3 rows.
gpu_test! {
    async fn the_lm_head_gemv_takes_the_argmax_first_pass_with_ties_to_the_lowest_id() {
        let mut rng = Rng::new(31);
        let (vocab, cols, batch) = (1000, 256, 3);
        for mut h in Harness::paths().await {
            for (ty, binding) in [(GgmlType::F32, None), (GgmlType::Q8_0, Some(64 << 10)), (GgmlType::Q4_1, None), (GgmlType::Q6K, None)] {
                let (info, bytes) = random_tensor(&mut rng, ty, vocab, cols);
                let row_bytes = bytes.len() / vocab;
                let x = random(&mut rng, batch * cols, 1.0);
                // Cases: random rows; batch row 0's best row copied to two lower ids (a tie
                // across groups and within one); a NaN in one row of an F32 matrix.
                for case in ["random", "tie", "nan"] {
                    if case == "nan" && ty != GgmlType::F32 {
                        continue;
                    }
                    let mut file = bytes.clone();
                    if case == "tie" {
                        let w = dequantize(&info, &file).unwrap();
                        let best = webgpu_llm::sampling::argmax(&reference_matmul(&w, &x[..cols], cols).0.iter().map(|&v| v as f32).collect::<Vec<_>>()) as usize;
                        let low = best / 2;
                        for to in [low, low + 1, low + 9] {
                            if to < best {
                                let src = file[best * row_bytes..][..row_bytes].to_vec();
                                file[to * row_bytes..][..row_bytes].copy_from_slice(&src);
                            }
                        }
                    }
                    if case == "nan" {
                        file[(vocab - 7) * row_bytes + 12..][..4].copy_from_slice(&f32::NAN.to_le_bytes());
                    }
                    if let Some(b) = binding {
                        h.gpu.limits.max_storage_buffer_binding_size = b;
                    }
                    let lin = linear(&h, &info, &file).await;
                    h.gpu.limits.max_storage_buffer_binding_size = 1 << 27;
                    assert!(binding.is_none() || lin.parts.len() > 1, "{ty:?}: {} parts", lin.parts.len());
                    let w = dequantize(&info, &file).unwrap();
                    let per_row = kernels::argmax_records_per_row(&h.gpu, &lin);
                    for mb in [1, 8] {
                        let rows_at: Vec<(usize, usize)> = (0..batch).map(|r| (r, r)).collect();
                        h.set_rows(&rows_at, batch, 16);
                        let what = format!("{ty:?} {case}, {} parts, MB {mb}, {}", lin.parts.len(), h.path());
                        let (xb, yb, ob) = (h.buf(&x), h.buf(&vec![0.0; batch * vocab]), h.u32_buf(&[7; 8]));
                        let rb = h.gpu.storage("records", (batch * per_row * 8) as u64).unwrap();
                        let records = kernels::ArgmaxRecords { buffer: &rb, per_row };
                        let gb = GemvBatch { params: &h.params, mb, xq: None };
                        let mut ops = kernels::gemv_argmax(&h.gpu, &mut h.cache, gb, &lin, records, None, &xb, &yb, vocab);
                        ops.push(kernels::argmax_records(&h.gpu, &mut h.cache, &h.params, records, &ob, kernels::MAX_BATCH));
                        h.run(&ops, batch);
                        let logits = h.read(&yb, batch * vocab).await;
                        let ids = h.gpu.read_buffer(&ob, 4 * batch as u64).await.unwrap();
                        for r in 0..batch {
                            let row = &logits[r * vocab..][..vocab];
                            let got = u32::from_le_bytes(ids[4 * r..][..4].try_into().unwrap());
                            let want = if row.iter().any(|v| !v.is_finite()) { u32::MAX } else { webgpu_llm::sampling::argmax(row) };
                            assert_eq!(got, want, "{what}, row {r}");
                            if case == "nan" {
                                assert_eq!(want, u32::MAX, "{what}: the NaN row reached the logits");
                                continue;
                            }
                            let (want, scale) = reference_matmul(&w, &x[r * cols..][..cols], cols);
                            assert_close(&format!("{what}, row {r}'s logits"), row, &want, &scale, MATMUL_REL);
                        }
                        if case == "tie" {
                            let best = ids[..4].try_into().map(u32::from_le_bytes).unwrap() as usize;
                            assert!(logits[..vocab].iter().filter(|&&v| v == logits[best]).count() >= 2, "{what}: no tie at the top");
                        }
                    }
                }
            }
        }
    }
}

// A mixture's expert products in a pass of several tokens, grouped by expert (each chosen
// expert's rows read once for all its tokens; two of the six experts chosen by none), are
// each token's own products bit for bit, and the CPU's from the dequantized rows: gate|up
// pairs from the tokens' rows, down from each assignment's own.
gpu_test! {
    async fn grouped_expert_products_are_each_tokens_own_bit_for_bit() {
        let mut rng = Rng::new(29);
        let (count, used, rows, cols, n) = (6usize, 2usize, 16usize, 64usize, 7usize);
        let e = Experts {
            router: String::new(),
            count,
            used,
            normalize: true,
            scale: 1.0,
            router_bias: None,
            biases: None,
            swiglu_oai: false,
            shared: None,
            sigmoid: false,
            selection_bias: None,
        };
        let ids: Vec<u32> = (0..n).flat_map(|t| [(t % 4) as u32, ((t + 1) % 4) as u32]).collect();
        for mut h in Harness::paths().await {
            h.set(n, 0, 16);
            for pair in [true, false] {
                let total = if pair { 2 * count * rows } else { count * rows };
                let (info, bytes) = random_tensor(&mut rng, GgmlType::Q8_0, total, cols);
                let w = linear(&h, &info, &bytes).await;
                let x = random(&mut rng, if pair { n } else { n * used } * cols, 1.0);
                let (xb, idb) = (h.buf(&x), h.u32_buf(&ids));
                let groups = MoeGroups { order: h.u32_buf(&vec![0; n * used]), starts: h.u32_buf(&vec![0; count + 1]) };
                let (alone, grouped) = (h.buf(&vec![0.0; n * used * rows]), h.buf(&vec![0.0; n * used * rows]));
                let act = Activation::Silu;
                let ops = [
                    kernels::moe_gemv(&h.gpu, &mut h.cache, &h.params, &e, &w, rows, pair, act, pair, None, &xb, &idb, &alone, None),
                    kernels::moe_group(&h.gpu, &mut h.cache, &h.params, &e, &idb, &groups),
                    kernels::moe_gemv(
                        &h.gpu, &mut h.cache, &h.params, &e, &w, rows, pair, act, pair, None, &xb, &idb, &grouped,
                        Some(&groups),
                    ),
                ];
                h.run(&ops, n);
                let (got_alone, got) = (h.read(&alone, n * used * rows).await, h.read(&grouped, n * used * rows).await);
                let what = format!("pair {pair}, {}", h.path());
                assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), got_alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{what}");
                let wd = dequantize(&info, &bytes).unwrap();
                for (a, &ex) in ids.iter().enumerate() {
                    let x0 = if pair { a / used } else { a };
                    let xr = &x[x0 * cols..(x0 + 1) * cols];
                    let row = |r: usize| reference::dot(&wd[r * cols..(r + 1) * cols], xr);
                    for r in 0..rows {
                        let ex = ex as usize;
                        let gate = row(ex * rows + r);
                        let want = if pair { reference::silu(gate) * row((count + ex) * rows + r) } else { gate };
                        let g = got[a * rows + r];
                        assert!((g - want).abs() <= 1e-3 * want.abs().max(1.0), "assignment {a} row {r}: {g} vs {want}, {what}");
                    }
                }
            }
        }
    }
}
