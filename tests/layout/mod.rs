//! Where each field of a GGUF header lies, found by a walk of the format written for the tests
//! (apart from the reader under test), so that tests can patch counts, lengths and values in
//! place. The walk stops quietly at the first field that does not fit: it also runs on mutated
//! files.
#![allow(dead_code)]

#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    TensorCount,
    KvCount,
    KeyLength,
    /// The type id of the value of `key`.
    ValueType {
        key: String,
    },
    /// A scalar value of `key` with type id `ty`.
    Value {
        key: String,
        ty: u32,
    },
    StringLength,
    ArrayElemType,
    ArrayLength {
        key: String,
    },
    NameLength,
    NDims,
    Dim,
    TensorType,
    DataOffset,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Field {
    pub offset: usize,
    pub width: usize,
    pub kind: Kind,
}

impl Field {
    /// An integer field (every field but the strings' bytes is one).
    pub fn read(&self, bytes: &[u8]) -> u64 {
        let mut b = [0u8; 8];
        b[..self.width].copy_from_slice(&bytes[self.offset..self.offset + self.width]);
        u64::from_le_bytes(b)
    }

    pub fn write(&self, bytes: &mut [u8], value: u64) {
        bytes[self.offset..self.offset + self.width].copy_from_slice(&value.to_le_bytes()[..self.width]);
    }
}

/// Bytes of a scalar of each type id (strings and arrays: 0, they have their own fields).
fn scalar_width(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        10..=12 => 8,
        8 | 9 => 0,
        _ => return None,
    })
}

struct Walk<'a> {
    bytes: &'a [u8],
    pos: usize,
    fields: Vec<Field>,
}

impl Walk<'_> {
    fn int(&mut self, width: usize, kind: Kind) -> Option<u64> {
        if self.pos + width > self.bytes.len() {
            return None;
        }
        let field = Field { offset: self.pos, width, kind };
        let v = field.read(self.bytes);
        self.fields.push(field);
        self.pos += width;
        Some(v)
    }

    fn string(&mut self, kind: Kind) -> Option<String> {
        let len = self.int(8, kind)? as usize;
        let end = self.pos.checked_add(len).filter(|&e| e <= self.bytes.len())?;
        let s = String::from_utf8_lossy(&self.bytes[self.pos..end]).into_owned();
        self.pos = end;
        Some(s)
    }

    fn value(&mut self, key: &str, ty: u32, depth: u32) -> Option<()> {
        match ty {
            8 => self.string(Kind::StringLength).map(drop),
            9 if depth < 8 => {
                let elem = self.int(4, Kind::ArrayElemType)? as u32;
                let n = self.int(8, Kind::ArrayLength { key: key.into() })?;
                if let Some(width @ 1..) = scalar_width(elem) {
                    // Elements are not fields of their own: skip them at once.
                    self.pos = (n as usize).checked_mul(width)?.checked_add(self.pos)?;
                    return (self.pos <= self.bytes.len()).then_some(());
                }
                for _ in 0..n {
                    self.value(key, elem, depth + 1)?;
                }
                Some(())
            }
            _ => {
                let width = scalar_width(ty).filter(|&w| w > 0)?;
                self.int(width, Kind::Value { key: key.into(), ty }).map(drop)
            }
        }
    }
}

/// The header's fields in file order, as far as they can be walked.
pub fn fields(bytes: &[u8]) -> Vec<Field> {
    let mut w = Walk { bytes, pos: 8, fields: Vec::new() };
    let _ = (|| -> Option<()> {
        let n_tensors = w.int(8, Kind::TensorCount)?;
        let n_kv = w.int(8, Kind::KvCount)?;
        for _ in 0..n_kv {
            let key = w.string(Kind::KeyLength)?;
            let ty = w.int(4, Kind::ValueType { key: key.clone() })? as u32;
            w.value(&key, ty, 0)?;
        }
        for _ in 0..n_tensors {
            w.string(Kind::NameLength)?;
            let n_dims = w.int(4, Kind::NDims)?;
            for _ in 0..n_dims.min(8) {
                w.int(8, Kind::Dim)?;
            }
            w.int(4, Kind::TensorType)?;
            w.int(8, Kind::DataOffset)?;
        }
        Some(())
    })();
    w.fields
}

/// The field holding the scalar value of `key`.
pub fn value_field(bytes: &[u8], key: &str) -> Option<Field> {
    fields(bytes).into_iter().find(|f| matches!(&f.kind, Kind::Value { key: k, .. } if k == key))
}

/// The field holding the length of the array `key`.
pub fn array_length_field(bytes: &[u8], key: &str) -> Option<Field> {
    fields(bytes).into_iter().find(|f| matches!(&f.kind, Kind::ArrayLength { key: k } if k == key))
}
