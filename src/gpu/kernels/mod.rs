//! One typed wrapper per WGSL kernel family: each knows its bindings, its override constants and
//! its dispatch shape, and returns `Dispatch`es — pipeline + bind group + workgroup counts —
//! built once at load and encoded every step.

mod act_mul;
mod argmax;
mod attention;
mod embed;
mod matmul;
mod norm;
mod rope;

pub use act_mul::act_mul;
pub use argmax::argmax;
pub use attention::{attention_decode, attention_prefill};
pub use embed::embed;
pub use matmul::{gemm, gemv, Epilogue};
pub use norm::{rms_norm, NormOut};
pub use rope::{rope_kv, rope_table, QkvExtras};

/// The uniform every per-token kernel reads, written once per forward pass.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n_tokens: u32,
    pub start_pos: u32,
    /// start_pos + n_tokens: keys attention reads.
    pub seq_len: u32,
    pub pad: u32,
}

/// Workgroup counts; `tokens` scales one axis with the pass's token count.
#[derive(Debug, Clone, Copy)]
pub struct Groups {
    pub fixed: [u32; 3],
    /// (axis, tokens per workgroup): that axis gets ceil(n_tokens / per).
    pub tokens: Option<(usize, u32)>,
}

impl Groups {
    pub fn fixed(x: u32, y: u32) -> Self {
        Self { fixed: [x, y, 1], tokens: None }
    }
    pub fn per_token(x: u32, axis: usize, per: u32) -> Self {
        Self { fixed: [x, 1, 1], tokens: Some((axis, per)) }
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
}

impl Dispatch {
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, n_tokens: u32) {
        let [x, y, z] = self.groups.resolve(n_tokens);
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind_group, &[]);
        pass.dispatch_workgroups(x, y, z);
    }
}
