//! The one error type users meet: each variant says what was wrong and what to do about it.

use crate::gguf::GgufError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `supported`: the architectures this engine runs, as the refusing code lists them.
    #[error("model architecture {name:?} is not supported (supported: {supported})")]
    UnsupportedArchitecture { name: String, supported: String },
    #[error("this model uses {0}, which this engine does not implement yet")]
    Unsupported(String),
    #[error("the GGUF file lacks the metadata key {0:?}, which this model architecture needs")]
    MissingMetadata(String),
    #[error("the GGUF metadata value {key:?} = {value} is invalid: {reason}")]
    InvalidMetadata { key: String, value: String, reason: String },
    /// `supported`: the tensor types this engine runs, as the refusing code lists them.
    #[error("tensor {name:?} has type {ty}, which this engine cannot run yet (supported: {supported})")]
    UnsupportedTensorType { name: String, ty: &'static str, supported: String },
    #[error("the tokenizer {0} is not supported")]
    UnsupportedTokenizer(String),
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    #[error("chat template error: {0}")]
    ChatTemplate(String),
    #[error("the model has no chat template (tokenizer.chat_template) and its vocabulary matches no built-in one (Gemma, ChatML, Llama 3, Phi-3); raw-prompt generation still works")]
    NoChatTemplate,
    #[error("invalid sampling parameter {name} = {value}: {expected}")]
    InvalidSamplingParameter { name: &'static str, value: String, expected: &'static str },
    #[error("the prompt has {prompt_tokens} tokens and asks for {max_tokens} more, but the context holds {context_length}; shorten the prompt, lower max_tokens or load with a longer context")]
    ContextOverflow { prompt_tokens: usize, max_tokens: usize, context_length: usize },
    /// Token counts are whole KV blocks: what the pool lacks is blocks.
    #[error("the KV cache pool is full: {needed_tokens} more tokens needed, {free_tokens} free of {capacity_tokens}; finish or free other sequences, or load with a longer context")]
    KvPoolFull { needed_tokens: usize, free_tokens: usize, capacity_tokens: usize },
    #[error("all {max} sequence slots are in use: finish or free a sequence first, or load with more sequences")]
    TooManySequences { max: usize },
    #[error("invalid {name} = {value}: {expected}")]
    InvalidOption { name: &'static str, value: String, expected: String },
    /// A constraint (`response_format`, `regex`, `grammar`) that does not compile, or whose
    /// grammar the output can no longer follow.
    #[error("invalid {field}: {reason}")]
    InvalidConstraint { field: &'static str, reason: String },
    #[error("the model produced non-finite values (NaN or infinity) in its logits after {position} tokens: its weights or metadata are corrupt, or it overflows in this precision; nothing was sampled from them")]
    NonFiniteLogits { position: usize },
    #[error("the prompt is empty: give at least one token")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    #[error("no GPU adapter found: WebGPU (in the browser) or Vulkan/Metal/DX12 (natively) is unavailable; {0}")]
    NoAdapter(String),
    #[error("the GPU device could not be created: {0}")]
    DeviceRequest(String),
    #[error("the GPU cannot hold this model: it needs {limit} = {needed} bytes, the adapter allows {available}")]
    LimitExceeded { limit: &'static str, needed: u64, available: u64 },
    #[error("GPU error: {0}")]
    Gpu(String),
    /// `buffer_bytes`: what the engine had asked the device to hold when it ran out, where known.
    #[error("the GPU ran out of memory{}: try a smaller model or a shorter context length, or close other tabs and programs using the GPU", .buffer_bytes.map(|b| format!(" holding this model's buffers ({} MiB)", b.div_ceil(1 << 20))).unwrap_or_default())]
    OutOfGpuMemory { buffer_bytes: Option<u64> },
    #[error("the browser did not finish {what} within {} s, twice: try again, and if it stays stuck restart the browser (its GPU process may be hung)", *.ms as f64 / 1000.0)]
    Stalled { what: &'static str, ms: u32 },
    #[error("the GPU device was lost ({0}); reload the model")]
    DeviceLost(String),
    #[error("I/O error on {path}: {source}")]
    Io { path: String, source: std::io::Error },
}

impl Error {
    /// The kind of error as a stable word for programs (the npm package's `error.code`): what a
    /// caller may act on without reading the message.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Gguf(GgufError::Read(_)) => "io",
            Error::Gguf(GgufError::Stalled(_)) | Error::Stalled { .. } => "stalled",
            Error::Gguf(_) => "invalid-file",
            Error::UnsupportedArchitecture { .. }
            | Error::Unsupported(_)
            | Error::UnsupportedTensorType { .. }
            | Error::UnsupportedTokenizer(_) => "unsupported",
            Error::MissingMetadata(_) | Error::InvalidMetadata { .. } => "invalid-metadata",
            Error::Tokenizer(_) => "tokenizer",
            Error::ChatTemplate(_) | Error::NoChatTemplate => "chat-template",
            Error::InvalidSamplingParameter { .. } | Error::InvalidOption { .. } => "invalid-option",
            Error::InvalidConstraint { .. } => "invalid-constraint",
            Error::ContextOverflow { .. } => "context-overflow",
            Error::KvPoolFull { .. } => "kv-pool-full",
            Error::TooManySequences { .. } => "too-many-sequences",
            Error::NonFiniteLogits { .. } => "non-finite",
            Error::EmptyPrompt | Error::TokenOutOfRange { .. } => "invalid-prompt",
            Error::NoAdapter(_) | Error::DeviceRequest(_) => "no-gpu",
            Error::LimitExceeded { .. } => "gpu-limit",
            Error::Gpu(_) => "gpu",
            Error::OutOfGpuMemory { .. } => "out-of-gpu-memory",
            Error::DeviceLost(_) => "device-lost",
            Error::Io { .. } => "io",
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
