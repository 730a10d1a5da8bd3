//! Errors of the GGUF reader: each names what was wrong and the byte offset where it was found.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum GgufError {
    #[error("not a GGUF file: the first 4 bytes are {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("GGUF version {version} is not supported (this reader supports versions 2 and 3); re-convert the model with a current llama.cpp")]
    UnsupportedVersion { version: u32 },
    #[error("GGUF file is truncated: reading {what} at offset {offset} needs {needed} bytes, but the file has {file_len} bytes")]
    Truncated { what: String, offset: u64, needed: u64, file_len: u64 },
    /// The header goes on past the bytes read so far: read at least `needed` and parse again.
    #[error("the GGUF header continues past the first {read} bytes read (it needs {needed})")]
    HeaderPastPrefix { read: u64, needed: u64 },
    #[error("could not read the model: {0}")]
    Read(String),
    /// A read the browser never finished (tried twice): the message says what and how long.
    #[error("{0}")]
    Stalled(String),
    #[error(
        "the split GGUF parts do not fit together: {0}; give every part, in order (name-00001-of-0000N.gguf first)"
    )]
    SplitMismatch(String),
    #[error("GGUF {what} at offset {offset} declares {count} entries, more than the {remaining} bytes left in the file can hold")]
    CountTooLarge { what: String, offset: u64, count: u64, remaining: u64 },
    #[error("GGUF string at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { offset: u64 },
    #[error("GGUF metadata value at offset {offset} has unknown type {value_type}")]
    UnknownValueType { offset: u64, value_type: u32 },
    #[error("GGUF metadata array at offset {offset} nests deeper than {max} levels")]
    NestingTooDeep { offset: u64, max: u32 },
    #[error("GGUF metadata key {key:?} at offset {offset} appears twice")]
    DuplicateKey { key: String, offset: u64 },
    #[error("GGUF metadata key {key:?} has type {found}, expected {expected}")]
    WrongValueType { key: String, expected: &'static str, found: &'static str },
    #[error("GGUF alignment {alignment} is invalid: it must be a power of two between 1 and 65536")]
    BadAlignment { alignment: u64 },
    #[error("GGUF tensor {name:?} (info at offset {offset}) has {n_dims} dimensions; at most 4 are allowed")]
    TooManyDims { name: String, offset: u64, n_dims: u32 },
    #[error("GGUF tensor {name:?} (info at offset {offset}) has a zero or overflowing shape {shape:?}")]
    BadShape { name: String, offset: u64, shape: Vec<u64> },
    #[error("GGUF tensor {name:?} (info at offset {offset}) has unknown tensor type {type_id}")]
    UnknownTensorType { name: String, offset: u64, type_id: u32 },
    #[error("GGUF tensor {name:?} has shape {shape:?}, whose first dimension is not a multiple of the {block}-element block of type {ty}")]
    ShapeNotBlockAligned { name: String, shape: Vec<u64>, ty: &'static str, block: u64 },
    #[error("GGUF tensor {name:?} data offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor { name: String, offset: u64, alignment: u64 },
    #[error("GGUF tensor {name:?} data [{start}, {end}) lies outside the file's data section of {data_len} bytes (which starts at file offset {data_start}): the file is truncated or corrupt")]
    TensorOutOfBounds { name: String, start: u64, end: u64, data_start: u64, data_len: u64 },
    #[error("GGUF tensors {first:?} and {second:?} overlap in the data section (at data offset {offset})")]
    TensorsOverlap { first: String, second: String, offset: u64 },
    #[error("GGUF tensor name {name:?} appears twice")]
    DuplicateTensor { name: String },
    #[error("tensor {name:?} is missing from the GGUF file")]
    MissingTensor { name: String },
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    UnexpectedShape { name: String, expected: Vec<u64>, found: Vec<u64> },
}
