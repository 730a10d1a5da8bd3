//! The GPU device: adapter choice, features (shader-f16, subgroups), limits, and the few helpers
//! every kernel wrapper uses. Buffers, bind groups and pipelines are made through `Gpu` so that
//! their creation is counted (the decode loop must create none).

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use wgpu::util::DeviceExt;

/// Environment variable that forces the portable path (no shader-f16, no subgroups), so tests
/// and users can check it on hardware that has both.
pub const FORCE_F32_ENV: &str = "WEBGPU_LLM_FORCE_F32";

/// Environment variable choosing the kernel variants (`gpu` or `cpu`) instead of the adapter's
/// type, for A/B measurements of one style on the other kind of adapter.
pub const KERNELS_ENV: &str = "WEBGPU_LLM_KERNELS";

/// Lanes per row of the matrix-vector kernel on GPUs.
pub(crate) const GPU_LANES: u32 = 32;

/// Environment variable overriding GPU_LANES (32, 64 or 128), for A/B measurements.
pub const GEMV_LANES_ENV: &str = "WEBGPU_LLM_GEMV_LANES";

/// Environment variable: `1` gives GPU-style decode gemvs int8 activations (`Gpu::int8`), for
/// A/B measurements of the int8 dot-product path (off by default: see `Gpu::int8`).
pub const INT8_ENV: &str = "WEBGPU_LLM_INT8";

/// Environment variable: `1` gives GPU-style prefill gemms cooperative matrices (`Gpu::coop`;
/// an error where the adapter has none of the shape they take), `0` or unset leaves them off.
pub const COOP_ENV: &str = "WEBGPU_LLM_COOP";

/// Workgroup memory of the cooperative-matrix gemm (shaders/gemm_coop.wgsl: two f16 X tiles and
/// two f16 W tiles of 64 x 40 halves, and 1024 f32 for the subgroups' accumulator tiles).
const COOP_WORKGROUP_BYTES: u32 = 4 * 64 * 40 * 2 + 4 * 256 * 4;

/// Environment variable: `1` or `0` sets `Gpu::unroll_rows`, for A/B measurements of CPU-style
/// gemvs and gemms on either CPU adapter.
pub const UNROLL_ROWS_ENV: &str = "WEBGPU_LLM_UNROLL_ROWS";

/// Environment variable setting the rows of a pass (a prefill chunk) on any adapter, for A/B
/// measurements of `kernels::default_pass_rows` (`kernels::valid_pass_rows` says which).
pub const PASS_ROWS_ENV: &str = "WEBGPU_LLM_PASS_ROWS";

/// Environment variable: `1` keeps naga's runtime checks in the kernels natively (loop bounding,
/// index clamps on private and workgroup arrays, division guards), which `Gpu::pipeline` leaves
/// out by default. (In the browser the browser decides.)
pub const SHADER_CHECKS_ENV: &str = "WEBGPU_LLM_SHADER_CHECKS";

/// How kernels spread work: GPUs want many invocations cooperating through workgroup memory;
/// CPU adapters (lavapipe, SwiftShader) run faster with one invocation per output block and no
/// barriers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelStyle {
    Gpu,
    Cpu,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuOptions {
    /// Use neither shader-f16 nor subgroups even when the adapter has them; the KV cache is f32
    /// (the exact path the golden tests hold to tight bounds) unless `packed_kv` is set.
    pub force_f32: bool,
    /// Store the KV cache as f16 pairs packed in u32 words, as adapters without shader-f16 do,
    /// even with `force_f32` (tests of that path on any adapter).
    pub packed_kv: bool,
    /// In the browser, milliseconds the adapter and device request may take before it is made
    /// once more, then fails as stalled (default `DEVICE_REQUEST_DEADLINE_MS`).
    pub request_deadline_ms: Option<u32>,
    /// Rows a decode step takes at most (default `kernels::MAX_BATCH`, at most
    /// `kernels::BASE_ROWS`; the GPU's binding size may allow fewer): its logits, selection and
    /// attention buffers are sized for them. A server asks for its `--max-batch`.
    pub max_batch: Option<usize>,
    /// Rows a pass takes at most, a prefill chunk (default `kernels::default_pass_rows`, or
    /// PASS_ROWS_ENV's; `kernels::valid_pass_rows` says which are taken).
    pub pass_rows: Option<usize>,
    /// Tokens the KV pool holds, every sequence together (default, and at least, the context
    /// length: one sequence at its longest). A server sized for many streams asks for more.
    pub kv_tokens: Option<usize>,
    /// The kernel variants to run (default: KERNELS_ENV's, else by the adapter's type: CPU-style
    /// on CPU adapters), so that either style can be run, and tested, on any adapter.
    pub kernels: Option<KernelStyle>,
    /// Cooperative matrices for GPU-style prefill gemms (`Gpu::coop`; default: COOP_ENV's, else
    /// off). Asked for on an adapter without them, the device request fails saying what is missing.
    pub coop: Option<bool>,
}

impl GpuOptions {
    pub fn from_env() -> Self {
        let force = std::env::var(FORCE_F32_ENV).is_ok_and(|v| !v.is_empty() && v != "0");
        // Empty is unset; a value that is no number is 0 here, refused in words by `Gpu::new`.
        let pass_rows =
            std::env::var(PASS_ROWS_ENV).ok().filter(|v| !v.trim().is_empty()).map(|v| v.trim().parse().unwrap_or(0));
        Self { force_f32: force, pass_rows, ..Default::default() }
    }
}

/// How the KV cache stores its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvStore {
    F32,
    /// f16 values (shader-f16).
    F16,
    /// f16 pairs packed in u32 words (`pack2x16float`): half the bytes of f32 without shader-f16.
    PackedF16,
}

/// Objects created and bytes read back, for the "nothing per token" checks and the benchmark.
#[derive(Debug, Default)]
pub struct Counters {
    pub buffers: AtomicU64,
    /// Bytes of all buffers created: what the device was asked to hold.
    pub buffer_bytes: AtomicU64,
    pub bind_groups: AtomicU64,
    pub pipelines: AtomicU64,
    pub submissions: AtomicU64,
    pub bytes_read_back: AtomicU64,
    /// Host time spent encoding and submitting decode steps, in nanoseconds.
    pub host_ns: AtomicU64,
    /// Rounds with constraint masks, and those whose forward pass had finished before the masks
    /// were written (the GPU waited for the host's masks; counted natively, where the queue can
    /// be polled without waiting).
    pub mask_rounds: AtomicU64,
    pub mask_waits: AtomicU64,
    /// Tokens the GPU's draw left to the host (a top-p/min-p cut its selection could not place:
    /// `kernels::UNDECIDED`), and of those, the steps run again because a round chained to
    /// theirs had already run over their logits.
    pub redraws: AtomicU64,
    pub reruns: AtomicU64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    pub buffers: u64,
    pub buffer_bytes: u64,
    pub bind_groups: u64,
    pub pipelines: u64,
    pub submissions: u64,
    pub bytes_read_back: u64,
    pub host_ns: u64,
    pub mask_rounds: u64,
    pub mask_waits: u64,
    pub redraws: u64,
    pub reruns: u64,
}

impl std::ops::Sub for CounterSnapshot {
    type Output = Self;
    fn sub(self, o: Self) -> Self {
        Self {
            buffers: self.buffers - o.buffers,
            buffer_bytes: self.buffer_bytes - o.buffer_bytes,
            bind_groups: self.bind_groups - o.bind_groups,
            pipelines: self.pipelines - o.pipelines,
            submissions: self.submissions - o.submissions,
            bytes_read_back: self.bytes_read_back - o.bytes_read_back,
            host_ns: self.host_ns - o.host_ns,
            mask_rounds: self.mask_rounds - o.mask_rounds,
            mask_waits: self.mask_waits - o.mask_waits,
            redraws: self.redraws - o.redraws,
            reruns: self.reruns - o.reruns,
        }
    }
}

pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub adapter_info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// shader-f16 is enabled (the KV cache is f16).
    pub f16: bool,
    /// How the KV cache stores its values: f16 where it can, in any case but the forced f32 path.
    pub kv: KvStore,
    /// Subgroup operations are enabled (their width is at most GPU_LANES, as the reductions need).
    pub subgroups: bool,
    /// Timestamp queries are enabled (natively, where the adapter has them): `bench --profile`
    /// then times each dispatch on the GPU's clock.
    pub timestamps: bool,
    pub counters: Counters,
    /// Chosen from the adapter's type; tests set it to check both variants on one adapter.
    pub style: KernelStyle,
    /// GPU-style decode gemvs and prefill gemms over 32-value integer blocks (Q4_0, Q4_1, Q5_0,
    /// Q5_1, Q8_0) take their activations quantized to int8 blocks and sum integer dot products
    /// (`kernels::takes_int8`): with INT8_ENV `1`, never on the forced f32 path. Two int8 slices
    /// a value (shaders/quantize_x.wgsl) hold the golden models to the f16 path's bounds
    /// (tests/golden/gpu.rs), where one (llama.cpp's q8_1) moved SmolLM2's logits by 0.9. Off by
    /// default until a GPU with native dot4I8Packed shows it pays (`scripts/device-bench`'s A/B):
    /// on lavapipe it does (prefill 1.25x, decode 1.26x), but that is a CPU.
    pub int8: bool,
    /// GPU-style prefill gemms multiply f16 tiles into f32 on cooperative matrices of this
    /// side (shaders/gemm_coop.wgsl: 16, tensor cores on NVIDIA; 8 on lavapipe), with their X
    /// and W tiles rounded to f16 (relative error 2^-11 a value, products and sums in f32).
    /// Natively, where the adapter lists that square shape at subgroup scope, with one subgroup
    /// size, shader-f16 and subgroups (`GpuOptions::coop`, COOP_ENV; `coop_side`). Off by
    /// default until a GPU shows it pays and holds the golden bounds (`scripts/device-bench`).
    pub coop: Option<u32>,
    /// CPU-style gemvs (a single batch row) and prefill gemms take their 8 weight rows in
    /// straight-line code (gemv.wgsl's and gemm_f32.wgsl's UNROLL_ROWS): SwiftShader's Subzero
    /// keeps a loop over those rows and their private arrays in memory, and without them takes
    /// ~20% less time on the gemv and half on the gemm, while lavapipe's LLVM unrolls the loops
    /// itself and runs the straight-line forms ~5% slower (2026-12-06, README). On for
    /// SwiftShader: natively by its name, in the browser for any CPU adapter (Chrome's software
    /// adapter is SwiftShader); UNROLL_ROWS_ENV sets it. It also keeps the CPU-style prefill
    /// attention's lanes to their own keys (attention_prefill_direct.wgsl's UNIFORM_KEYS off):
    /// Subzero gathers every load whether the lanes share its address or not.
    pub unroll_rows: bool,
    /// The browser settles buffer maps only when it polls the device (Firefox: on a 100 ms timer
    /// or a submit), so read-backs submit nothing every few ms while they wait.
    pub kick_maps: bool,
    /// Rows a decode step should take at most (`GpuOptions::max_batch`).
    pub max_batch: usize,
    /// Rows a pass should take at most (a prefill chunk: `kernels::default_pass_rows`, or
    /// PASS_ROWS_ENV); a model takes fewer where its activations would not fit a binding.
    pub pass_rows: usize,
    /// Tokens the KV pool should hold (`GpuOptions::kv_tokens`).
    pub kv_tokens: Option<usize>,
    /// The first error the device reported asynchronously (validation, out of memory, lost).
    failure: Arc<Mutex<Option<Error>>>,
    /// Why the device was lost, once it is: every later call fails with it (sticky, unlike `failure`).
    lost: Arc<Mutex<Option<String>>>,
}

/// The device goes with its owner: destroying it frees every buffer now. In the browser a
/// dropped buffer's memory otherwise waits for JavaScript's garbage collector, which knows
/// nothing of GPU memory, so a model loaded after another could run out of it.
impl Drop for Gpu {
    fn drop(&mut self) {
        self.device.destroy();
    }
}

/// How long the browser may take to answer the adapter and device request before it counts as
/// stalled: a load must never wait forever on another process (headless Chromium has been seen,
/// rarely and under load, to leave a load waiting between its download and its upload).
pub const DEVICE_REQUEST_DEADLINE_MS: u32 = 60_000;

/// An on/off environment switch `var` (the option `name`): `1` on, `0` off, None where it is unset
/// or empty; any other value refused in words (`expected`).
fn env_switch(var: &str, name: &'static str, expected: &str) -> Result<Option<bool>> {
    match std::env::var(var).as_deref() {
        Ok("1") => Ok(Some(true)),
        Ok("0") => Ok(Some(false)),
        Ok(v) if !v.is_empty() => {
            Err(Error::InvalidOption { name, value: format!("{var}={v:?}"), expected: expected.into() })
        }
        _ => Ok(None),
    }
}

/// The side of the cooperative matrices shaders/gemm_coop.wgsl takes on `adapter` (16, else 8),
/// or why it cannot run there: it needs square products of f16 matrices into f32 at subgroup
/// scope, shader-f16 and subgroups (`f16_subgroups`), one subgroup size (its workgroup is a
/// fixed number of subgroups) and the workgroup memory of its tiles.
fn coop_side(
    adapter: &wgpu::Adapter,
    info: &wgpu::AdapterInfo,
    f16_subgroups: bool,
) -> std::result::Result<u32, String> {
    use wgpu::CooperativeScalarType::{F16, F32};
    if !adapter.features().contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        return Err("the adapter offers no cooperative matrices (natively: Vulkan's VK_KHR_cooperative_matrix)".into());
    }
    let shapes = adapter.cooperative_matrix_properties();
    let square = |side: u32| {
        shapes.iter().any(|p| (p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type) == (side, side, side, F16, F32))
    };
    let Some(side) = [16, 8].into_iter().find(|&side| square(side)) else {
        let listed: Vec<String> = shapes
            .iter()
            .map(|p| format!("{}x{}x{} {:?}->{:?}", p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type))
            .collect();
        return Err(format!("it lists no 16x16x16 or 8x8x8 F16->F32 product (it lists {})", listed.join(", ")));
    };
    if !f16_subgroups {
        return Err("it needs shader-f16 and subgroups (left out or absent)".into());
    }
    if info.subgroup_min_size != info.subgroup_max_size {
        return Err(format!(
            "its subgroups are {} to {} wide, and the kernel's workgroup needs one width",
            info.subgroup_min_size, info.subgroup_max_size
        ));
    }
    if adapter.limits().max_compute_workgroup_storage_size < COOP_WORKGROUP_BYTES {
        return Err(format!("its workgroups hold under the {COOP_WORKGROUP_BYTES} bytes the tiles take"));
    }
    Ok(side)
}

impl Gpu {
    /// Picks the high-performance adapter and creates a device with the features and limits the
    /// engine can use. In the browser a request that has not answered in a minute is made once
    /// more, then ends in `Error::Stalled`: a load never waits forever.
    pub async fn new(options: GpuOptions) -> Result<Self> {
        let ms = options.request_deadline_ms.unwrap_or(DEVICE_REQUEST_DEADLINE_MS);
        for attempt in 1..=2 {
            match crate::deadline::within(Self::open(options), ms).await {
                #[cfg(target_arch = "wasm32")]
                Some(Ok(mut gpu)) => {
                    gpu.kick_maps = gpu.maps_wait_for_a_poll().await;
                    return Ok(gpu);
                }
                Some(gpu) => return gpu,
                None => crate::deadline::warn(&format!(
                    "the GPU adapter and device request did not answer in {} s (attempt {attempt} of 2)",
                    ms as f64 / 1000.0
                )),
            }
        }
        Err(Error::Stalled { what: "the GPU adapter and device request", ms })
    }

    async fn open(options: GpuOptions) -> Result<Self> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends =
            if cfg!(target_arch = "wasm32") { wgpu::Backends::BROWSER_WEBGPU } else { wgpu::Backends::all() };
        let instance = wgpu::Instance::new(desc);
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
            .map_err(|e| Error::NoAdapter(e.to_string()))?;
        let adapter_info = adapter.get_info();
        let available = adapter.features();
        let f16 = !options.force_f32 && available.contains(wgpu::Features::SHADER_F16);
        let subgroups = !options.force_f32
            && available.contains(wgpu::Features::SUBGROUP)
            && adapter_info.subgroup_max_size <= GPU_LANES
            && adapter_info.subgroup_min_size >= 1;
        let mut features = wgpu::Features::empty();
        if f16 {
            features |= wgpu::Features::SHADER_F16;
        }
        if subgroups {
            features |= wgpu::Features::SUBGROUP;
        }
        let coop = match options.coop {
            Some(c) => c,
            None => env_switch(COOP_ENV, "coop", "1 (cooperative matrices for prefill gemms) or 0")?.unwrap_or(false),
        };
        let coop = match coop {
            true => Some(coop_side(&adapter, &adapter_info, f16 && subgroups).map_err(|why| Error::InvalidOption {
                name: "coop",
                value: match options.coop {
                    Some(_) => "true".into(),
                    None => format!("{COOP_ENV}=1"),
                },
                expected: format!(
                    "off (0) on {}, which cannot run the cooperative-matrix gemm: {why}",
                    adapter_info.name
                ),
            })?),
            false => None,
        };
        if coop.is_some() {
            features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        let timestamps = cfg!(not(target_arch = "wasm32")) && available.contains(wgpu::Features::TIMESTAMP_QUERY);
        if timestamps {
            features |= wgpu::Features::TIMESTAMP_QUERY;
        }
        // WebGPU's defaults, raised to the adapter's where a model needs more (big weight
        // bindings, workgroup memory for the attention tiles, many rows per dispatch).
        let a = adapter.limits();
        let limits = wgpu::Limits {
            max_storage_buffer_binding_size: a.max_storage_buffer_binding_size,
            max_buffer_size: a.max_buffer_size,
            max_storage_buffers_per_shader_stage: a.max_storage_buffers_per_shader_stage,
            max_compute_workgroup_storage_size: a.max_compute_workgroup_storage_size,
            max_compute_workgroups_per_dimension: a.max_compute_workgroups_per_dimension,
            ..wgpu::Limits::default()
        };
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("webgpu-llm"),
                required_features: features,
                required_limits: limits.clone(),
                // SAFETY: the one experimental feature requested is the cooperative matrices of
                // `coop_side`'s shape, used by shaders/gemm_coop.wgsl only.
                experimental_features: if coop.is_some() {
                    unsafe { wgpu::ExperimentalFeatures::enabled() }
                } else {
                    wgpu::ExperimentalFeatures::disabled()
                },
                ..Default::default()
            })
            .await
            .map_err(|e| Error::DeviceRequest(e.to_string()))?;
        // wgpu's default for an uncaught device error is a panic; keep it as a typed error instead.
        let failure = Arc::new(Mutex::new(None));
        let sink = failure.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let err = match e {
                wgpu::Error::OutOfMemory { .. } => Error::OutOfGpuMemory { buffer_bytes: None },
                wgpu::Error::Validation { source, .. } => Error::Gpu(error_chain(&*source)),
                wgpu::Error::Internal { description, .. } => Error::Gpu(description),
            };
            sink.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(err);
        }));
        let lost = Arc::new(Mutex::new(None));
        let sink = lost.clone();
        device.set_device_lost_callback(move |reason, message| {
            sink.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(format!("{reason:?}: {message}"));
        });
        let style = match (options.kernels, std::env::var(KERNELS_ENV).as_deref()) {
            (Some(style), _) => style,
            (None, Ok("gpu")) => KernelStyle::Gpu,
            (None, Ok("cpu")) => KernelStyle::Cpu,
            (None, Ok(v)) if !v.is_empty() => {
                return Err(Error::InvalidOption {
                    name: "kernels",
                    value: format!("{KERNELS_ENV}={v:?}"),
                    expected: "gpu (workgroups cooperating) or cpu (an invocation per output block)".into(),
                });
            }
            _ if adapter_info.device_type == wgpu::DeviceType::Cpu => KernelStyle::Cpu,
            _ => KernelStyle::Gpu,
        };
        let max_buffer_size = limits.max_buffer_size;
        let int8 =
            env_switch(INT8_ENV, "int8", "1 (int8 activations for GPU-style gemvs and gemms) or 0")?.unwrap_or(false);
        let unroll_rows = env_switch(
            UNROLL_ROWS_ENV,
            "unroll_rows",
            "1 (write a CPU-style matmul's rows out) or 0 (keep their loop)",
        )?
        .unwrap_or(
            style == KernelStyle::Cpu
                && (cfg!(target_arch = "wasm32") || adapter_info.name.to_lowercase().contains("swiftshader")),
        );
        Ok(Self {
            device,
            queue,
            adapter_info,
            limits,
            f16,
            kv: if f16 {
                KvStore::F16
            } else if options.force_f32 && !options.packed_kv {
                KvStore::F32
            } else {
                KvStore::PackedF16
            },
            subgroups,
            timestamps,
            max_batch: options.max_batch.unwrap_or(super::kernels::MAX_BATCH).clamp(1, super::kernels::BASE_ROWS),
            pass_rows: match options.pass_rows {
                Some(r) if super::kernels::valid_pass_rows(r) => r,
                Some(r) => {
                    // The environment's text where the value came from there.
                    let value = match std::env::var(PASS_ROWS_ENV) {
                        Ok(v) if v.trim().parse::<usize>().ok() != Some(r) => format!("{PASS_ROWS_ENV}={v:?}"),
                        _ => r.to_string(),
                    };
                    return Err(Error::InvalidOption {
                        name: "pass_rows",
                        value,
                        expected: format!(
                            "a multiple of 64 from {} to {} (also {PASS_ROWS_ENV})",
                            super::kernels::BASE_ROWS,
                            super::kernels::MAX_PASS_ROWS
                        ),
                    });
                }
                None => super::kernels::default_pass_rows(style, max_buffer_size),
            },
            kv_tokens: options.kv_tokens,
            counters: Counters::default(),
            style,
            int8: !options.force_f32 && int8,
            coop,
            unroll_rows,
            kick_maps: false,
            failure,
            lost,
        })
    }

    /// Firefox settles `mapAsync` only when its GPU process polls the device: on a 100 ms timer,
    /// or at once on a queue submit (Chromium settles it at once). Two maps of a small buffer
    /// with no work pending tell which: the second taking over 20 ms means read-backs wait for
    /// a poll, and `read_mapped_after` then submits nothing every few ms while one waits.
    #[cfg(target_arch = "wasm32")]
    async fn maps_wait_for_a_poll(&self) -> bool {
        let probe = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("map probe"),
            size: 4,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut slow = false;
        for _ in 0..2 {
            let start = js_sys::Date::now();
            let (tx, rx) = futures_channel::oneshot::channel();
            probe.slice(..).map_async(wgpu::MapMode::Read, move |r| {
                let _ = tx.send(r);
            });
            let mapped = crate::deadline::within(rx, 1000).await;
            slow = !matches!(mapped, Some(Ok(Ok(())))) || js_sys::Date::now() - start > 20.0;
            probe.unmap();
        }
        probe.destroy();
        slow
    }

    /// Lanes that share one row in the matrix-vector kernel: a warp's worth on GPUs; one on CPU
    /// adapters, where a workgroup barrier costs more than it saves.
    pub fn gemv_lanes(&self) -> u32 {
        match self.style {
            KernelStyle::Cpu => 1,
            KernelStyle::Gpu => match std::env::var(GEMV_LANES_ENV).ok().and_then(|v| v.parse().ok()) {
                Some(n @ (32 | 64 | 128)) => n,
                _ => GPU_LANES,
            },
        }
    }

    /// Starts watching for the device running out of memory (while buffers are created and
    /// filled); `memory_watched` ends the watch. WebGPU reports running out asynchronously: the
    /// error scope makes the report arrive there, named, rather than at some later call.
    pub fn watch_memory(&self) -> wgpu::ErrorScopeGuard {
        self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory)
    }

    /// Ends a `watch_memory`: `OutOfGpuMemory`, with the bytes asked for, if the device ran out.
    pub async fn memory_watched(&self, watch: wgpu::ErrorScopeGuard) -> Result<()> {
        match watch.pop().await {
            Some(_) => Err(Error::OutOfGpuMemory { buffer_bytes: Some(self.counters().buffer_bytes) }),
            None => Ok(()),
        }
    }

    /// Returns the first error the device reported since the last check.
    pub fn check(&self) -> Result<()> {
        if let Some(why) = self.lost.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            return Err(Error::DeviceLost(why.clone()));
        }
        match self.failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// "name (backend, type)" for logs and `info()`.
    pub fn adapter_name(&self) -> String {
        let i = &self.adapter_info;
        let name = if i.name.is_empty() { "WebGPU adapter" } else { &i.name };
        format!("{name} ({:?}, {:?})", i.backend, i.device_type)
    }

    pub fn counters(&self) -> CounterSnapshot {
        let c = &self.counters;
        CounterSnapshot {
            buffers: c.buffers.load(Ordering::Relaxed),
            buffer_bytes: c.buffer_bytes.load(Ordering::Relaxed),
            bind_groups: c.bind_groups.load(Ordering::Relaxed),
            pipelines: c.pipelines.load(Ordering::Relaxed),
            submissions: c.submissions.load(Ordering::Relaxed),
            bytes_read_back: c.bytes_read_back.load(Ordering::Relaxed),
            host_ns: c.host_ns.load(Ordering::Relaxed),
            mask_rounds: c.mask_rounds.load(Ordering::Relaxed),
            mask_waits: c.mask_waits.load(Ordering::Relaxed),
            redraws: c.redraws.load(Ordering::Relaxed),
            reruns: c.reruns.load(Ordering::Relaxed),
        }
    }

    /// Bytes of one KV-cache value: 2 in f16 (native or packed), 4 on the forced f32 path.
    pub fn kv_bytes(&self) -> u64 {
        match self.kv {
            KvStore::F32 => 4,
            KvStore::F16 | KvStore::PackedF16 => 2,
        }
    }

    /// The largest buffer that can be bound as one storage binding.
    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size)
    }

    /// Fails with a typed error when a buffer of `size` bytes cannot be bound as one storage binding.
    pub fn check_binding(&self, size: u64) -> Result<()> {
        let max = self.max_binding();
        if size > max {
            return Err(Error::LimitExceeded { limit: "maxStorageBufferBindingSize", needed: size, available: max });
        }
        Ok(())
    }

    fn count_buffer(&self, size: u64) -> u64 {
        self.counters.buffers.fetch_add(1, Ordering::Relaxed);
        self.counters.buffer_bytes.fetch_add(size, Ordering::Relaxed);
        size
    }

    pub fn storage(&self, label: &str, size: u64) -> Result<wgpu::Buffer> {
        self.check_binding(size)?;
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: self.count_buffer(size.max(4).next_multiple_of(4)),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    pub fn storage_init(&self, label: &str, bytes: &[u8]) -> Result<wgpu::Buffer> {
        self.check_binding(bytes.len() as u64)?;
        let padded;
        let contents = if bytes.len() % 4 == 0 && !bytes.is_empty() {
            bytes
        } else {
            padded = [bytes, &[0u8; 4][..(4 - bytes.len() % 4)]].concat();
            &padded
        };
        self.count_buffer(contents.len() as u64);
        Ok(self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        }))
    }

    pub fn uniform(&self, label: &str, size: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: self.count_buffer(size),
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    pub fn readback(&self, label: &str, size: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: self.count_buffer(size.next_multiple_of(4)),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    pub fn bind_group(
        &self,
        label: &str,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[&wgpu::Buffer],
    ) -> wgpu::BindGroup {
        let numbered: Vec<(u32, &wgpu::Buffer)> = buffers.iter().enumerate().map(|(i, &b)| (i as u32, b)).collect();
        self.bind_group_at(label, pipeline, &numbered)
    }

    /// `bind_group` with each buffer's binding named (for a kernel that leaves a binding out:
    /// one its code does not use for these weights is not in the pipeline's layout).
    pub fn bind_group_at(
        &self,
        label: &str,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer)],
    ) -> wgpu::BindGroup {
        self.counters.bind_groups.fetch_add(1, Ordering::Relaxed);
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .map(|&(i, b)| wgpu::BindGroupEntry { binding: i, resource: b.as_entire_binding() })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        })
    }

    /// Compiles `source` (already assembled with its preludes) with override constants.
    pub fn pipeline(&self, label: &str, source: &str, constants: &[(&str, f64)]) -> wgpu::ComputePipeline {
        self.counters.pipelines.fetch_add(1, Ordering::Relaxed);
        let desc = wgpu::ShaderModuleDescriptor { label: Some(label), source: wgpu::ShaderSource::Wgsl(source.into()) };
        // naga's runtime checks cost more than the work in these kernels on a GPU (H200, Vulkan:
        // decode 1.44x, prefill 1.8x faster without; README "Figures"). Buffer accesses stay
        // bounds-checked where the driver does it itself (Vulkan's robustBufferAccess2).
        let module = if cfg!(not(target_arch = "wasm32")) && std::env::var(SHADER_CHECKS_ENV).as_deref() != Ok("1") {
            // SAFETY: only the engine's own kernels come here, each tested against a CPU
            // reference (tests/gpu_kernels.rs): every loop is bounded by override constants or
            // the pass's sizes, no divisor can be zero, and every index into a private or
            // workgroup array is below its length by construction.
            unsafe { self.device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) }
        } else {
            self.device.create_shader_module(desc)
        };
        self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(label),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        })
    }

    /// Submits the writes queued so far and, natively, waits for them, so that their staging
    /// memory is freed: an upload holds about one tensor's staging, not the model's. In the
    /// browser the writes are already on their way (the wait is a no-op there).
    pub fn flush_writes(&self) -> Result<()> {
        self.queue.submit([]);
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| Error::Gpu(e.to_string()))?;
        Ok(())
    }

    pub fn submit(&self, encoder: wgpu::CommandEncoder) -> wgpu::SubmissionIndex {
        self.counters.submissions.fetch_add(1, Ordering::Relaxed);
        self.queue.submit([encoder.finish()])
    }

    /// Waits for the copy into `staging` (MAP_READ) and hands its first `len` bytes to `read`.
    /// Natively this polls the device; in the browser it awaits the mapping callback.
    pub async fn read_mapped<T>(&self, staging: &wgpu::Buffer, len: u64, read: impl FnOnce(&[u8]) -> T) -> Result<T> {
        self.read_mapped_after(staging, len, None, read).await
    }

    /// `read_mapped` when the copy was in submission `after`: natively the wait ends with that
    /// submission, not with work submitted since (the next decode step, already queued).
    pub async fn read_mapped_after<T>(
        &self,
        staging: &wgpu::Buffer,
        len: u64,
        after: Option<wgpu::SubmissionIndex>,
        read: impl FnOnce(&[u8]) -> T,
    ) -> Result<T> {
        let slice = staging.slice(..len.next_multiple_of(4));
        let (tx, rx) = futures_channel::oneshot::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::Wait { submission_index: after, timeout: None })
            .map_err(|e| Error::Gpu(e.to_string()))?;
        #[cfg(target_arch = "wasm32")]
        let _ = after;
        // A mapping that fails is most often a lost device: report that when it is the cause.
        let failed = |e: String| self.check().err().unwrap_or(Error::Gpu(e));
        // Where maps wait for the device's poll (Firefox: `kick_maps`), an empty submit every few
        // ms makes it poll: a read-back there takes ~4 ms instead of up to 100.
        #[cfg(target_arch = "wasm32")]
        let mapped = if self.kick_maps {
            let mut rx = std::pin::pin!(rx);
            loop {
                match crate::deadline::within(rx.as_mut(), 2).await {
                    Some(r) => break r,
                    None => self.queue.submit([]),
                };
            }
        } else {
            rx.await
        };
        #[cfg(not(target_arch = "wasm32"))]
        let mapped = rx.await;
        mapped.map_err(|_| failed("the buffer mapping was dropped".into()))?.map_err(|e| failed(e.to_string()))?;
        // Unmapped on every path from here: a buffer left mapped would fail every later step
        // that copies into it.
        let out = self.check().and_then(|_| {
            let view = slice.get_mapped_range().map_err(|e| Error::Gpu(e.to_string()))?;
            Ok(read(&view[..len as usize]))
        });
        staging.unmap();
        self.counters.bytes_read_back.fetch_add(len, Ordering::Relaxed);
        out
    }

    /// Reads a whole storage buffer back (tests and one-off reads; allocates a staging buffer).
    pub async fn read_buffer(&self, buffer: &wgpu::Buffer, len: u64) -> Result<Vec<u8>> {
        let staging = self.readback("read_buffer", len);
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(buffer, 0, &staging, 0, len.next_multiple_of(4));
        self.submit(enc);
        self.read_mapped(&staging, len, |b| b.to_vec()).await
    }

    pub async fn read_f32(&self, buffer: &wgpu::Buffer, n: usize) -> Result<Vec<f32>> {
        let bytes = self.read_buffer(buffer, n as u64 * 4).await?;
        Ok(bytemuck::cast_slice(&bytes).to_vec())
    }
}

/// An error and its sources on one line: wgpu keeps the useful part (which shader line, which
/// limit) in the sources.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(&format!(": {s}"));
        source = s.source();
    }
    msg
}
