//! The GPU backend: device set-up, WGSL kernel wrappers, weight upload and the forward pass.

mod device;
pub mod kernels;
mod model;
pub mod shader;
#[cfg(not(target_arch = "wasm32"))]
pub mod spirv;
pub mod weights;

pub use device::{CounterSnapshot, Gpu, GpuOptions, KernelStyle, KvStore, FORCE_F32_ENV};
pub use model::{GpuModel, InFlight, Readback, RoundFlight, RowReadback, RowsReadback, ROUND_PASSES};
