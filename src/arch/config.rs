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
    /// The gated FFN's hidden width (each expert's, in a mixture of experts).
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rope_base: f32,
    pub rope_dim: usize,
    pub rms_eps: f32,
    /// The output projection reuses `token_embd` (no `output.weight` tensor in the file).
    pub tied_output: bool,
    /// Multi-token-prediction layers after the `n_layers` (Qwen3.5's `nextn_predict_layers`,
    /// counted in the file's `block_count`).
    pub mtp_layers: usize,
}

impl ModelConfig {
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let arch = gguf
            .get_str("general.architecture")?
            .ok_or_else(|| Error::MissingMetadata("general.architecture".into()))?
            .to_string();
        if !crate::arch::ARCHITECTURES.contains(&arch.as_str()) {
            return Err(Error::UnsupportedArchitecture { name: arch, supported: super::ARCHITECTURES.join(", ") });
        }
        let key = |k: &str| format!("{arch}.{k}");
        let required = |k: &str| -> Result<usize> {
            let full = key(k);
            let v = gguf.get_u64(&full)?.ok_or(Error::MissingMetadata(full.clone()))?;
            positive(&full, v)
        };

        // Each count and size below sizes memory somewhere (layers, buffers, the KV cache), so
        // each is checked against the tensors it describes before anything is made from it: a
        // header cannot ask for more than its file holds.
        let token_embd = gguf.require_tensor("token_embd.weight")?;
        let blocks = required("block_count")?;
        if blocks > gguf.tensors.len() {
            let reason = format!("the file has {} tensors, and every layer needs its own", gguf.tensors.len());
            return Err(invalid(&key("block_count"), blocks, &reason));
        }
        // Qwen3.5's MTP layers are the last of the blocks; no other plan has them.
        let mtp_layers = gguf.get_u64(&key("nextn_predict_layers"))?.unwrap_or(0);
        if mtp_layers > 0 && !super::QWEN35.contains(&arch.as_str()) {
            return Err(Error::Unsupported(format!(
                "multi-token-prediction layers ({}) for architecture {arch:?}",
                key("nextn_predict_layers")
            )));
        }
        if mtp_layers >= blocks as u64 {
            let reason = format!("the block count {blocks} must be larger");
            return Err(invalid(&key("nextn_predict_layers"), mtp_layers, &reason));
        }
        let (n_layers, mtp_layers) = (blocks - mtp_layers as usize, mtp_layers as usize);
        let d_model = required("embedding_length")?;
        if d_model as u64 != token_embd.shape[0] {
            let reason = format!("token_embd.weight has rows of {}", token_embd.shape[0]);
            return Err(invalid(&key("embedding_length"), d_model, &reason));
        }
        let n_heads = required("attention.head_count")?;
        // A mixture of experts' FFN is its experts' (each `expert_feed_forward_length` wide);
        // `feed_forward_length` there is a dense model's, which no layer has.
        let experts = gguf.get_u64(&key("expert_count"))?.is_some_and(|n| n > 0);
        if experts && !super::MOE_ARCHITECTURES.contains(&arch.as_str()) {
            return Err(Error::Unsupported(format!(
                "mixture of experts ({}) for architecture {arch:?}",
                key("expert_count")
            )));
        }
        let (ffn_key, ffn_down) = match experts {
            true => ("expert_feed_forward_length", "blk.0.ffn_down_exps.weight"),
            false => ("feed_forward_length", "blk.0.ffn_down.weight"),
        };
        // Gemma 4 writes a width per layer (wider on its KV-shared layers): the largest here,
        // each layer's in its plan.
        let ffn_dim = match per_layer(gguf, &key(ffn_key), blocks)? {
            Some(widths) if arch == "gemma4" => {
                positive(&key(ffn_key), widths.iter().copied().max().unwrap_or(0) as u64)?
            }
            // LFM2-MoE's leading dense layers are wider than its experts: the larger here, each
            // layer's in its plan.
            _ if arch == "lfm2moe" => required(ffn_key)?.max(required("feed_forward_length")?),
            _ => required(ffn_key)?,
        };
        let context_length = required("context_length")?;
        // The key that sets the head size, and its value, for the error when heads do not fit.
        let (head_dim, head_key, head_value) = match gguf.get_u64(&key("attention.key_length"))? {
            Some(v) => (positive(&key("attention.key_length"), v)?, "attention.key_length", v as usize),
            None if d_model % n_heads == 0 => (d_model / n_heads, "attention.head_count", n_heads),
            None => {
                let reason = format!("the embedding length {d_model} is not a multiple of it");
                return Err(invalid(&key("attention.head_count"), n_heads, &reason));
            }
        };
        // Every architecture projects the heads back to the model width with attn_output
        // ([q_dim, d_model]; the first attention layer's: LFM2 starts with convolutions) and the
        // FFN with ffn_down ([ffn_dim, d_model]).
        let q_dim = (n_heads as u64).checked_mul(head_dim as u64);
        let first_attention = (0..n_layers).find(|i| gguf.tensor(&format!("blk.{i}.attn_output.weight")).is_some());
        let output_name = format!("blk.{}.attn_output.weight", first_attention.unwrap_or(0));
        let attn_output = gguf.require_tensor(&output_name)?;
        // Gemma 4's sliding layers have heads of their own size (its plan checks each layer).
        if q_dim != Some(attn_output.shape[0]) && arch != "gemma4" {
            let reason = format!(
                "{n_heads} heads of {head_dim} values do not make the {} inputs of {output_name}",
                attn_output.shape[0]
            );
            return Err(invalid(&key(head_key), head_value, &reason));
        }
        if let Some(v) = gguf.get_u64(&key("attention.value_length"))? {
            if v != head_dim as u64 {
                return Err(invalid(&key("attention.value_length"), v, "must equal the key length"));
            }
        }
        let n_kv_heads = match kv_heads_per_layer(gguf, &arch, n_layers)? {
            Some(per_layer) => {
                // LFM2: 0 marks a short-convolution layer; the attention layers share one count.
                let mut counts = per_layer.iter().copied().filter(|&n| n > 0);
                let first = counts.next().ok_or_else(|| {
                    invalid(&key("attention.head_count_kv"), "all 0", "some layer must have attention")
                })?;
                // Gemma 4: its sliding and full layers each their own count (the plan's per
                // layer; the largest here).
                if arch == "gemma4" {
                    let most = per_layer.iter().copied().max().unwrap_or(first);
                    positive(&key("attention.head_count_kv"), most as u64)?
                } else if counts.any(|n| n != first) {
                    return Err(Error::Unsupported(format!(
                        "attention layers with different KV head counts ({})",
                        key("attention.head_count_kv")
                    )));
                } else {
                    positive(&key("attention.head_count_kv"), first as u64)?
                }
            }
            None => match gguf.get_u64(&key("attention.head_count_kv"))? {
                Some(v) => positive(&key("attention.head_count_kv"), v)?,
                None => n_heads,
            },
        };
        if n_heads % n_kv_heads != 0 {
            return Err(invalid(
                &key("attention.head_count_kv"),
                n_kv_heads,
                "the head count must be a multiple of it",
            ));
        }
        let down = match arch.as_str() {
            // LFM2-MoE's first layers are dense (its plan checks each layer's shapes).
            "lfm2moe" => gguf.require_tensor(&format!("blk.{}.ffn_down.weight", 0))?,
            _ => gguf.require_tensor(ffn_down)?,
        };
        if ffn_dim as u64 != down.shape[0] && arch != "gemma4" && arch != "lfm2moe" {
            let reason = format!("{ffn_down} has {} inputs", down.shape[0]);
            return Err(invalid(&key(ffn_key), ffn_dim, &reason));
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

        // One embedding row per token (ggml's shape [d_model] is one row).
        let embd_rows = token_embd.rows().1;
        let vocab_size = match gguf.get_u64(&key("vocab_size"))? {
            Some(v) if v != embd_rows as u64 => {
                let reason = format!("token_embd.weight has {embd_rows} rows, one per token");
                return Err(invalid(&key("vocab_size"), v, &reason));
            }
            _ => embd_rows,
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
            mtp_layers,
        })
    }

    /// This config with a layer's head size, KV heads and FFN width (Gemma 4's differ by layer).
    pub fn with_dims(&self, d: &super::LayerDims) -> Self {
        Self { head_dim: d.head_dim, n_kv_heads: d.n_kv_heads, ffn_dim: d.ffn_dim, ..self.clone() }
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// `attention.head_count_kv` as one count per layer, when the file writes an array (LFM2:
/// 0 for its short-convolution layers); None when it is one number or absent.
pub(crate) fn kv_heads_per_layer(gguf: &Gguf, arch: &str, n_layers: usize) -> Result<Option<Vec<usize>>> {
    per_layer(gguf, &format!("{arch}.attention.head_count_kv"), n_layers)
}

/// `key` as one number per layer, when the file writes an array; None when it is one number or
/// absent.
pub(crate) fn per_layer(gguf: &Gguf, key: &str, n_layers: usize) -> Result<Option<Vec<usize>>> {
    let key = key.to_string();
    if !matches!(gguf.get(&key), Some(crate::gguf::Value::List(_))) {
        return Ok(None);
    }
    let list = gguf.get_array(&key)?.expect("checked above");
    if list.len() != n_layers {
        return Err(invalid(&key, format!("{} values", list.len()), &format!("must have one per layer ({n_layers})")));
    }
    (0..list.len())
        .map(|i| {
            let v = list.get(i).and_then(|v| v.as_u64());
            v.filter(|&v| v <= u32::MAX as u64)
                .map(|v| v as usize)
                .ok_or_else(|| invalid(&key, format!("element {i}"), "must be an unsigned integer"))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
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
