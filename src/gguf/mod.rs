//! GGUF reading: header, metadata, tensor infos and views of tensor data. Knows nothing of GPUs
//! or of decoding blocks (src/quant does that). Every length read from the file is checked against the bytes that are
//! actually left before anything is allocated, so a corrupt file gives an error, never a panic or
//! an allocation larger than the file.

mod error;
mod reader;
mod source;
mod types;
mod value;
mod writer;

pub use error::GgufError;
#[cfg(not(target_arch = "wasm32"))]
pub use source::FileSource;
pub use source::{ByteSource, SplitSource};
pub use types::GgmlType;
pub use value::{Array, Strings, Value, ValueRef};
pub use writer::GgufWriter;

use reader::Reader;
use std::collections::HashMap;

const MAGIC: [u8; 4] = *b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Smallest encoding of one tensor info: empty name (8), n_dims (4), type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 24;
/// Smallest encoding of one metadata pair: empty key (8), type (4), one-byte value (1).
const MIN_KV_BYTES: u64 = 13;

/// Where one tensor's data lies and how it is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `shape[0]` is the contiguous (row) dimension.
    pub shape: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub file_offset: u64,
    pub byte_size: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Elements per row (the contiguous dimension) and number of rows.
    pub fn rows(&self) -> (usize, usize) {
        let cols = self.shape[0];
        (cols as usize, self.n_elements().checked_div(cols).unwrap_or(0) as usize)
    }

    /// The tensor's bytes inside the whole file's bytes (bounds were checked when parsing).
    pub fn data<'a>(&self, file: &'a [u8]) -> &'a [u8] {
        &file[self.file_offset as usize..(self.file_offset + self.byte_size) as usize]
    }
}

/// A parsed GGUF header: metadata and tensor infos. Tensor data stays in the caller's bytes.
#[derive(Debug, Clone)]
pub struct Gguf {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    pub alignment: u64,
    pub data_offset: u64,
}

impl Gguf {
    /// Parses the header of a GGUF file held in memory and checks every tensor against the file.
    pub fn parse(file: &[u8]) -> Result<Self, GgufError> {
        Self::parse_prefix(file, file.len() as u64)
    }

    /// Parses the header from `prefix`, the first bytes of a file of `file_len` bytes; a header
    /// longer than the prefix is `HeaderPastPrefix` with the length to read.
    pub fn parse_prefix(prefix: &[u8], file_len: u64) -> Result<Self, GgufError> {
        let mut r = Reader::new(prefix, file_len);
        let magic = r.array::<4>("magic")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let n_tensors = r.count("tensor count", MIN_TENSOR_INFO_BYTES)?;
        let n_kv = r.count("metadata count", MIN_KV_BYTES)?;

        // Grown as pairs are read, not reserved from the count: each pair takes 13 bytes or more
        // of the file but some 70 of memory.
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let offset = r.offset();
            let key = r.str("metadata key")?;
            let value = Value::read(&mut r, 0)?;
            if metadata.contains_key(key) {
                return Err(GgufError::DuplicateKey { key: key.into(), offset });
            }
            metadata.insert(key.to_string(), value);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v.as_u64().ok_or_else(|| GgufError::WrongValueType {
                key: "general.alignment".into(),
                expected: "unsigned integer",
                found: v.type_name(),
            })?,
        };
        if alignment == 0 || alignment > 65536 || !alignment.is_power_of_two() {
            return Err(GgufError::BadAlignment { alignment });
        }

        // Reserved for the infos that are there, not for the count (an info takes 24 bytes or
        // more of the file, some 80 of memory).
        let present = {
            let mut scan = r.clone();
            (0..n_tensors).take_while(|_| read_tensor_info(&mut scan).is_ok()).count()
        };
        let mut raw = Vec::with_capacity(present);
        for _ in 0..n_tensors {
            raw.push(read_tensor_info(&mut r)?);
        }
        let data_offset = r.offset().next_multiple_of(alignment);
        let data_len = file_len.saturating_sub(data_offset);

        let mut tensors = Vec::with_capacity(raw.len());
        let mut tensor_index = HashMap::with_capacity(raw.len());
        for (info, rel_offset) in raw {
            if rel_offset % alignment != 0 {
                return Err(GgufError::MisalignedTensor { name: info.name, offset: rel_offset, alignment });
            }
            let end = rel_offset.checked_add(info.byte_size);
            if end.is_none_or(|end| end > data_len) {
                return Err(GgufError::TensorOutOfBounds {
                    name: info.name,
                    start: rel_offset,
                    end: end.unwrap_or(u64::MAX),
                    data_start: data_offset,
                    data_len,
                });
            }
            if tensor_index.insert(info.name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor { name: info.name });
            }
            tensors.push(TensorInfo { file_offset: data_offset + rel_offset, ..info });
        }
        check_no_overlap(&tensors, data_offset)?;

        Ok(Self { version, metadata, tensors, tensor_index, alignment, data_offset })
    }

    /// The headers of a split model's parts (in order, starting at `starts` in the concatenation)
    /// as one: part 1's metadata, every part's tensors at their offsets in the concatenation.
    pub fn merge_split(parts: Vec<Gguf>, starts: &[u64]) -> Result<Self, GgufError> {
        let n = parts.len() as u64;
        let split_key =
            |g: &Gguf, key: &str| g.get_u64(key).map(|v| v.unwrap_or(if key == "split.no" { 0 } else { 1 }));
        let mut merged: Option<Gguf> = None;
        for (i, (part, &start)) in parts.into_iter().zip(starts).enumerate() {
            let (no, count) = (split_key(&part, "split.no")?, split_key(&part, "split.count")?);
            if no != i as u64 || count != n {
                return Err(GgufError::SplitMismatch(format!(
                    "part {} says it is part {} of {count}, but {n} parts were given in this order",
                    i + 1,
                    no + 1
                )));
            }
            match &mut merged {
                None => merged = Some(part),
                Some(m) => {
                    for t in part.tensors {
                        if m.tensor_index.insert(t.name.clone(), m.tensors.len()).is_some() {
                            return Err(GgufError::DuplicateTensor { name: t.name });
                        }
                        m.tensors.push(TensorInfo { file_offset: t.file_offset + start, ..t });
                    }
                }
            }
        }
        let merged = merged.ok_or_else(|| GgufError::SplitMismatch("no parts were given".into()))?;
        if let Some(total) = merged.get_u64("split.tensors.count")? {
            if total != merged.tensors.len() as u64 {
                return Err(GgufError::SplitMismatch(format!(
                    "split.tensors.count is {total}, the parts hold {} tensors",
                    merged.tensors.len()
                )));
            }
        }
        Ok(merged)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor { name: name.into() })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// An unsigned integer value of any width, or an error when the key has another type.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.typed(key, "unsigned integer", Value::as_u64)
    }

    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.typed(key, "float", Value::as_f32)
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.typed(key, "string", Value::as_str)
    }

    pub fn get_array(&self, key: &str) -> Result<Option<&Array>, GgufError> {
        self.typed(key, "array", Value::as_array)
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl Fn(&'a Value) -> Option<T>,
    ) -> Result<Option<T>, GgufError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => convert(v).map(Some).ok_or_else(|| GgufError::WrongValueType {
                key: key.into(),
                expected,
                found: v.type_name(),
            }),
        }
    }
}

/// Reads one tensor info; returns it with its offset relative to the data section.
fn read_tensor_info(r: &mut Reader) -> Result<(TensorInfo, u64), GgufError> {
    let offset = r.offset();
    let name = r.str("tensor name")?.to_string();
    let n_dims = r.u32("tensor dimension count")?;
    if n_dims == 0 || n_dims > 4 {
        return Err(GgufError::TooManyDims { name, offset, n_dims });
    }
    let mut shape = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        shape.push(r.u64("tensor dimension")?);
    }
    let type_id = r.u32("tensor type")?;
    let rel_offset = r.u64("tensor data offset")?;
    let n_elements = shape.iter().try_fold(1u64, |acc, &d| if d == 0 { None } else { acc.checked_mul(d) });
    let Some(n_elements) = n_elements else {
        return Err(GgufError::BadShape { name, offset, shape });
    };
    let Some(ty) = GgmlType::from_id(type_id) else {
        return Err(GgufError::UnknownTensorType { name, offset, type_id });
    };
    let (block, _) = ty.block_layout();
    let byte_size = match ty.byte_size(n_elements) {
        Some(size) if shape[0] % block == 0 => size,
        _ => return Err(GgufError::ShapeNotBlockAligned { name, shape, ty: ty.name(), block }),
    };
    Ok((TensorInfo { name, shape, ty, file_offset: 0, byte_size }, rel_offset))
}

fn check_no_overlap(tensors: &[TensorInfo], data_offset: u64) -> Result<(), GgufError> {
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.file_offset);
    for pair in order.windows(2) {
        if pair[0].file_offset + pair[0].byte_size > pair[1].file_offset {
            return Err(GgufError::TensorsOverlap {
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
                offset: pair[1].file_offset - data_offset,
            });
        }
    }
    Ok(())
}
