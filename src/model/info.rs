//! What a model file is and what running it needs, from its header alone: shown before a
//! download (the page reads the header with a ranged request) and after a load.

use crate::arch::ModelConfig;
use crate::error::Result;
use crate::gguf::Gguf;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelInfo {
    pub name: String,
    pub architecture: String,
    /// Transformer layers: each keeps its K and V in buffers of their own.
    pub layers: usize,
    pub parameters: u64,
    /// Parameters one token's forward pass uses: all of them, but a mixture of experts' chosen
    /// share of its stacked expert tensors (`expert_used_count` of `expert_count`).
    pub active_parameters: u64,
    pub file_bytes: u64,
    /// Bytes of tensor data per block type (the quantization mix).
    pub type_bytes: BTreeMap<String, u64>,
    /// The context the model was trained for.
    pub max_context: usize,
    /// The context these figures assume.
    pub context: usize,
    /// GPU memory for the weights as uploaded (blocks padded to whole words).
    pub weight_bytes: u64,
    /// GPU memory of the KV cache at `context`, f16 and f32.
    pub kv_bytes_f16: u64,
    pub kv_bytes_f32: u64,
    /// GPU memory of a hybrid model's recurrent state at `context` (LFM2's short convolutions
    /// keep each position's B * x, f32, paged with the KV cache; Qwen3.5's Gated DeltaNets each
    /// position's convolution and delta-rule inputs, and one sequence's state matrices); 0 for
    /// other models.
    pub state_bytes: u64,
    /// The largest single tensor (it is split across bindings when larger than one).
    pub largest_tensor_bytes: u64,
}

impl ModelInfo {
    /// Facts of the model in `gguf` (of a `file_bytes`-byte file) at `context` tokens (None:
    /// the engine's default); an error when the engine cannot run its architecture or types.
    pub fn new(gguf: &Gguf, file_bytes: u64, context: Option<usize>) -> Result<Self> {
        let c = ModelConfig::from_gguf(gguf)?;
        let context = context.unwrap_or(crate::arch::DEFAULT_CONTEXT).min(c.context_length).max(1);
        let mut type_bytes = BTreeMap::new();
        let mut weight_bytes = 0u64;
        for t in &gguf.tensors {
            *type_bytes.entry(t.ty.name().to_string()).or_insert(0) += t.byte_size;
            let f = crate::quant::tensor_format(t)?;
            let (cols, rows) = t.rows();
            weight_bytes += f.gpu_row_words(cols).map_or(t.byte_size, |w| 4 * w as u64 * rows as u64);
        }
        // LFM2's short-convolution layers keep no K and V, but each position's B * x (f32).
        let conv_layers = crate::arch::kv_heads_per_layer(gguf, &c.architecture, c.n_layers)?
            .map_or(0, |per_layer| per_layer.iter().filter(|&&n| n == 0).count());
        let mut state_bytes = (conv_layers * c.d_model * 4) as u64 * context as u64;
        // Qwen3.5's Gated DeltaNet layers: per position q|k|v and k|v|g|beta (f32), and a
        // sequence's state (f32) per layer.
        let mut delta_layers = 0;
        if crate::arch::QWEN35.contains(&c.architecture.as_str()) {
            let s = crate::arch::delta_shape(gguf, &c.architecture)?;
            delta_layers =
                crate::arch::recurrent_layers(gguf, &c.architecture, c.n_layers)?.iter().filter(|&&r| r).count();
            let per_position = (s.conv_dim() + s.inputs()) as u64 * 4;
            let layers = (per_position.checked_mul(context as u64))
                .and_then(|b| b.checked_add(s.state_values() as u64 * 4))
                .and_then(|b| b.checked_mul(delta_layers as u64));
            state_bytes = layers.and_then(|b| b.checked_add(state_bytes)).ok_or_else(|| {
                crate::arch::invalid(
                    &format!("{}.context_length", c.architecture),
                    context,
                    "the state's size overflows",
                )
            })?;
        }
        // K and V of every attention layer at every position (Gemma 4: each layer that keeps its
        // own, at its size); checked, as the context may come from the caller.
        let per_position = match c.architecture.as_str() {
            "gemma4" => {
                let g = crate::arch::gemma4_header_layout(gguf, &c)?;
                let own = g.dims.iter().zip(&g.kv_source).filter(|(_, s)| s.is_none());
                own.map(|(d, _)| d.n_kv_heads * d.head_dim).sum()
            }
            _ => c.n_layers.saturating_sub(conv_layers + delta_layers) * c.kv_dim(),
        };
        let kv_values = [per_position, context, 2]
            .iter()
            .try_fold(1u64, |acc, &n| acc.checked_mul(n as u64))
            .filter(|&v| v.checked_mul(4).is_some())
            .ok_or_else(|| {
                let reason = format!("a KV cache of {} layers of {} values overflows", c.n_layers, c.kv_dim());
                crate::arch::invalid(&format!("{}.context_length", c.architecture), context, &reason)
            })?;
        Ok(Self {
            name: c.name.clone(),
            architecture: c.architecture.clone(),
            layers: c.n_layers,
            parameters: gguf.tensors.iter().map(|t| t.n_elements()).sum(),
            active_parameters: active_parameters(gguf, &c),
            file_bytes,
            type_bytes,
            max_context: c.context_length,
            context,
            weight_bytes,
            kv_bytes_f16: kv_values * 2,
            kv_bytes_f32: kv_values * 4,
            state_bytes,
            largest_tensor_bytes: gguf.tensors.iter().map(|t| t.byte_size).max().unwrap_or(0),
        })
    }
}

/// Every tensor's parameters, of a mixture of experts' stacked expert tensors (`*_exps`, one
/// matrix per expert along the last dimension) the `expert_used_count / expert_count` share;
/// not the multi-token-prediction layers' (a draft's, not the model's pass).
fn active_parameters(gguf: &Gguf, c: &ModelConfig) -> u64 {
    let arch = &c.architecture;
    let count = |k: &str| gguf.get_u64(&format!("{arch}.{k}")).ok().flatten().unwrap_or(0);
    let (experts, used) = (count("expert_count"), count("expert_used_count"));
    let mtp: Vec<String> = (c.n_layers..c.n_layers + c.mtp_layers).map(|i| format!("blk.{i}.")).collect();
    gguf.tensors
        .iter()
        .filter(|t| !mtp.iter().any(|m| t.name.starts_with(m.as_str())))
        .map(|t| match t.name.contains("_exps.") && experts > 0 {
            true => t.n_elements() / experts * used.min(experts),
            false => t.n_elements(),
        })
        .sum()
}
