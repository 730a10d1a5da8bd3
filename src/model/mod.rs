//! The model: its configuration from GGUF metadata and the CPU f32 reference forward pass, which
//! is the oracle every GPU kernel and the whole GPU model are tested against.

mod config;
mod cpu;
mod info;

pub(crate) use config::invalid;
pub use config::ModelConfig;
pub use cpu::{CpuKvCache, CpuModel, Logits};
pub use info::ModelInfo;

/// The CPU reference ops, one per GPU kernel family, for the kernels' tests.
pub mod reference {
    pub use super::cpu::{
        activation, attention, dot, gelu_tanh, matmul, rms_norm, rms_norm_in_place, rope, silu, softmax, AttentionKind,
    };
}
