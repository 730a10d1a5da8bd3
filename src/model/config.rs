//! The model's shape and hyper-parameters, read from GGUF metadata (what every architecture has;
//! src/arch adds what differs).

use crate::error::{Error, Result};
use crate::gguf::Gguf;

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub name: String,
    pub architecture: String,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rope_base: f32,
    pub rope_dim: usize,
    pub rms_eps: f32,
    /// The output projection reuses `token_embd` (no `output.weight` tensor in the file).
    pub tied_output: bool,
}

impl ModelConfig {
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let arch = gguf
            .get_str("general.architecture")?
            .ok_or_else(|| Error::MissingMetadata("general.architecture".into()))?
            .to_string();
        if !crate::arch::ARCHITECTURES.contains(&arch.as_str()) {
            return Err(Error::UnsupportedArchitecture(arch));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let required = |k: &str| -> Result<usize> {
            let full = key(k);
            let v = gguf.get_u64(&full)?.ok_or(Error::MissingMetadata(full.clone()))?;
            positive(&full, v)
        };

        let n_layers = required("block_count")?;
        let d_model = required("embedding_length")?;
        let n_heads = required("attention.head_count")?;
        let ffn_dim = required("feed_forward_length")?;
        let context_length = required("context_length")?;
        let n_kv_heads = match gguf.get_u64(&key("attention.head_count_kv"))? {
            Some(v) => positive(&key("attention.head_count_kv"), v)?,
            None => n_heads,
        };
        if n_heads % n_kv_heads != 0 {
            return Err(invalid(
                &key("attention.head_count_kv"),
                n_kv_heads,
                "the head count must be a multiple of it",
            ));
        }
        let head_dim = match gguf.get_u64(&key("attention.key_length"))? {
            Some(v) => positive(&key("attention.key_length"), v)?,
            None if d_model % n_heads == 0 => d_model / n_heads,
            None => return Err(invalid(&key("embedding_length"), d_model, "not a multiple of the head count")),
        };
        if let Some(v) = gguf.get_u64(&key("attention.value_length"))? {
            if v as usize != head_dim {
                return Err(invalid(&key("attention.value_length"), v, "must equal the key length"));
            }
        }
        let rope_dim = match gguf.get_u64(&key("rope.dimension_count"))? {
            Some(v) => positive(&key("rope.dimension_count"), v)?,
            None => head_dim,
        };
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(invalid(&key("rope.dimension_count"), rope_dim, "must be even and at most the head dimension"));
        }
        let rope_base = gguf.get_f32(&key("rope.freq_base"))?.unwrap_or(10000.0);
        let rms_eps = gguf
            .get_f32(&key("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| Error::MissingMetadata(key("attention.layer_norm_rms_epsilon")))?;
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            return Err(invalid(&key("attention.layer_norm_rms_epsilon"), rms_eps, "must be a positive number"));
        }
        if !(rope_base.is_finite() && rope_base > 0.0) {
            return Err(invalid(&key("rope.freq_base"), rope_base, "must be a positive number"));
        }

        let token_embd = gguf.require_tensor("token_embd.weight")?;
        let vocab_size = match gguf.get_u64(&key("vocab_size"))? {
            Some(v) => positive(&key("vocab_size"), v)?,
            None => *token_embd.shape.get(1).unwrap_or(&0) as usize,
        };
        let name = gguf.get_str("general.name")?.unwrap_or("unnamed model").to_string();
        Ok(Self {
            name,
            architecture: arch,
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim,
            vocab_size,
            context_length,
            rope_base,
            rope_dim,
            rms_eps,
            tied_output: gguf.tensor("output.weight").is_none(),
        })
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

fn positive(key: &str, v: u64) -> Result<usize> {
    if v == 0 || v > u32::MAX as u64 {
        return Err(invalid(key, v, "must be between 1 and 2^32-1"));
    }
    Ok(v as usize)
}

/// An InvalidMetadata error for `key`.
pub(crate) fn invalid(key: &str, value: impl ToString, reason: &str) -> Error {
    Error::InvalidMetadata { key: key.into(), value: value.to_string(), reason: reason.into() }
}
