//! Which tensors a llama model has and the shape each must have; shared by the CPU reference and
//! the GPU upload so both check the file the same way.

use super::ModelConfig;
use crate::error::{Error, Result};
use crate::gguf::{Gguf, GgufError, TensorInfo};

/// Names of one transformer block's tensors.
#[derive(Debug, Clone)]
pub struct LayerTensors {
    pub attn_norm: String,
    pub wq: String,
    pub wk: String,
    pub wv: String,
    pub wo: String,
    pub ffn_norm: String,
    pub w_gate: String,
    pub w_up: String,
    pub w_down: String,
}

#[derive(Debug, Clone)]
pub struct TensorNames {
    pub token_embd: String,
    pub output_norm: String,
    /// `token_embd.weight` when the output projection is tied to the embedding.
    pub output: String,
    pub layers: Vec<LayerTensors>,
}

impl TensorNames {
    pub fn new(config: &ModelConfig) -> Self {
        let layers = (0..config.n_layers)
            .map(|i| {
                let n = |s: &str| format!("blk.{i}.{s}.weight");
                LayerTensors {
                    attn_norm: n("attn_norm"),
                    wq: n("attn_q"),
                    wk: n("attn_k"),
                    wv: n("attn_v"),
                    wo: n("attn_output"),
                    ffn_norm: n("ffn_norm"),
                    w_gate: n("ffn_gate"),
                    w_up: n("ffn_up"),
                    w_down: n("ffn_down"),
                }
            })
            .collect();
        let output = if config.tied_output { "token_embd.weight" } else { "output.weight" };
        Self {
            token_embd: "token_embd.weight".into(),
            output_norm: "output_norm.weight".into(),
            output: output.into(),
            layers,
        }
    }

    /// Every tensor the forward pass reads, with the shape (ggml order) it must have.
    pub fn expected_shapes(&self, c: &ModelConfig) -> Vec<(&str, Vec<u64>)> {
        let (d, q, kv, f, v) =
            (c.d_model as u64, c.q_dim() as u64, c.kv_dim() as u64, c.ffn_dim as u64, c.vocab_size as u64);
        let mut out = vec![(self.token_embd.as_str(), vec![d, v]), (self.output_norm.as_str(), vec![d])];
        if !c.tied_output {
            out.push((self.output.as_str(), vec![d, v]));
        }
        for l in &self.layers {
            out.extend([
                (l.attn_norm.as_str(), vec![d]),
                (l.wq.as_str(), vec![d, q]),
                (l.wk.as_str(), vec![d, kv]),
                (l.wv.as_str(), vec![d, kv]),
                (l.wo.as_str(), vec![q, d]),
                (l.ffn_norm.as_str(), vec![d]),
                (l.w_gate.as_str(), vec![d, f]),
                (l.w_up.as_str(), vec![d, f]),
                (l.w_down.as_str(), vec![f, d]),
            ]);
        }
        out
    }

    /// Checks that every tensor exists with the expected shape and a type the engine can run.
    pub fn validate(&self, gguf: &Gguf, config: &ModelConfig) -> Result<()> {
        for (name, shape) in self.expected_shapes(config) {
            let info = gguf.require_tensor(name)?;
            check_shape(info, &shape)?;
            if crate::gguf::dequantize_row_into(info.ty, &[], &mut []).is_none() {
                return Err(Error::UnsupportedTensorType { name: name.into(), ty: info.ty.name() });
            }
        }
        Ok(())
    }
}

fn check_shape(info: &TensorInfo, expected: &[u64]) -> Result<()> {
    // GGUF writers may keep trailing dimensions of size 1.
    let trimmed: Vec<u64> = {
        let mut s = info.shape.clone();
        while s.len() > expected.len() && s.last() == Some(&1) {
            s.pop();
        }
        s
    };
    if trimmed != expected {
        return Err(GgufError::UnexpectedShape {
            name: info.name.clone(),
            expected: expected.to_vec(),
            found: info.shape.clone(),
        }
        .into());
    }
    Ok(())
}
