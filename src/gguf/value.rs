//! GGUF metadata values: the 13 value types of the spec, arrays included.

use super::reader::Reader;
use super::GgufError;

/// Arrays nest; a limit keeps a crafted file from exhausting the stack.
const MAX_ARRAY_DEPTH: u32 = 8;

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub(super) fn read(r: &mut Reader, depth: u32) -> Result<Self, GgufError> {
        let offset = r.offset();
        let value_type = r.u32("metadata value type")?;
        Self::read_typed(r, value_type, offset, depth)
    }

    fn read_typed(r: &mut Reader, value_type: u32, offset: u64, depth: u32) -> Result<Self, GgufError> {
        const W: &str = "metadata value";
        Ok(match value_type {
            0 => Value::U8(r.u8(W)?),
            1 => Value::I8(r.u8(W)? as i8),
            2 => Value::U16(r.u16(W)?),
            3 => Value::I16(r.u16(W)? as i16),
            4 => Value::U32(r.u32(W)?),
            5 => Value::I32(r.u32(W)? as i32),
            6 => Value::F32(f32::from_bits(r.u32(W)?)),
            7 => Value::Bool(r.u8(W)? != 0),
            8 => Value::String(r.string("metadata string")?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep { offset, max: MAX_ARRAY_DEPTH });
                }
                let elem_offset = r.offset();
                let elem_type = r.u32("array element type")?;
                let min_bytes = match elem_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => return Err(GgufError::UnknownValueType { offset: elem_offset, value_type: elem_type }),
                };
                let n = r.count("array length", min_bytes)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(Self::read_typed(r, elem_type, elem_offset, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(r.u64(W)?),
            11 => Value::I64(r.u64(W)? as i64),
            12 => Value::F64(f64::from_bits(r.u64(W)?)),
            _ => return Err(GgufError::UnknownValueType { offset, value_type }),
        })
    }

    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }

    /// Any integer type holding a value >= 0 (writers differ in the width they use).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }
}
