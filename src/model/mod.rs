//! The model: its configuration from GGUF metadata and the CPU f32 reference forward pass, which
//! is the oracle every GPU kernel and the whole GPU model are tested against.

mod cpu;
mod info;

/// The model's shape, parsed with its layer plan (`arch`).
pub use crate::arch::ModelConfig;
pub use cpu::{CpuKvCache, CpuModel, Logits};
pub use info::ModelInfo;

/// The CPU reference ops, one per GPU kernel family, for the kernels' tests.
pub mod reference {
    pub use super::cpu::{
        activation, attention, dot, gelu_tanh, matmul, rms_norm, rms_norm_in_place, rope, silu, softmax, AttentionKind,
    };
}
