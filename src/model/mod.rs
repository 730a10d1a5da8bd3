//! The model: its configuration from GGUF metadata and the CPU f32 reference forward pass, which
//! is the oracle every GPU kernel and the whole GPU model are tested against.

mod config;
mod cpu;
mod weights;

pub use config::ModelConfig;
pub use cpu::{CpuKvCache, CpuModel, Logits};

/// The CPU reference ops, one per GPU kernel family, for the kernels' tests.
pub mod reference {
    pub use super::cpu::{attention, dot, matmul, rms_norm, rope, rope_inv_freq, silu, softmax};
}
pub use weights::{LayerTensors, TensorNames};
