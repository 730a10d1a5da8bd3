//! GGUF metadata values: the 13 value types of the spec. An array is one typed vector (its
//! strings packed into one buffer), so it takes about as much memory as its bytes in the file,
//! not an enum of 24 bytes or more per element.

use super::reader::Reader;
use super::GgufError;

/// Arrays nest; a limit keeps a crafted file from exhausting the stack.
const MAX_ARRAY_DEPTH: u32 = 8;

/// The spec's value type ids are the indices of this list.
const TYPE_NAMES: [&str; 13] =
    ["u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"];
const STRING: u32 = 8;
const ARRAY: u32 = 9;

/// A metadata value as the file holds it.
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
    /// An array: its elements share one type, stored as one typed vector.
    List(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A value borrowed from a `Value` or from an element of an `Array`; the accessors live here once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ValueRef<'a> {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(&'a str),
    Array(&'a Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A GGUF array: every element has the same type, stored in one vector of that type.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    /// Boxed so that an array of arrays costs 32 bytes an element.
    String(Box<Strings>),
    Array(Vec<Array>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

/// Strings stored end to end in one buffer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Strings {
    text: String,
    /// Where each string ends in `text`.
    ends: Vec<usize>,
}

impl Value {
    pub(super) fn read(r: &mut Reader, depth: u32) -> Result<Self, GgufError> {
        let offset = r.offset();
        let value_type = r.u32("metadata value type")?;
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
            STRING => Value::String(r.str("metadata string")?.to_string()),
            ARRAY => Value::List(Array::read(r, offset, depth)?),
            10 => Value::U64(r.u64(W)?),
            11 => Value::I64(r.u64(W)? as i64),
            12 => Value::F64(f64::from_bits(r.u64(W)?)),
            _ => return Err(GgufError::UnknownValueType { offset, value_type }),
        })
    }

    /// The value, borrowed.
    pub fn view(&self) -> ValueRef<'_> {
        match self {
            Value::U8(v) => ValueRef::U8(*v),
            Value::I8(v) => ValueRef::I8(*v),
            Value::U16(v) => ValueRef::U16(*v),
            Value::I16(v) => ValueRef::I16(*v),
            Value::U32(v) => ValueRef::U32(*v),
            Value::I32(v) => ValueRef::I32(*v),
            Value::F32(v) => ValueRef::F32(*v),
            Value::Bool(v) => ValueRef::Bool(*v),
            Value::String(v) => ValueRef::String(v),
            Value::List(v) => ValueRef::Array(v),
            Value::U64(v) => ValueRef::U64(*v),
            Value::I64(v) => ValueRef::I64(*v),
            Value::F64(v) => ValueRef::F64(*v),
        }
    }

    /// The spec's id of this value's type.
    pub fn type_id(&self) -> u32 {
        self.view().type_id()
    }

    pub fn type_name(&self) -> &'static str {
        self.view().type_name()
    }

    /// Any integer type holding a value >= 0 (writers differ in the width they use).
    pub fn as_u64(&self) -> Option<u64> {
        self.view().as_u64()
    }

    pub fn as_i64(&self) -> Option<i64> {
        self.view().as_i64()
    }

    pub fn as_f32(&self) -> Option<f32> {
        self.view().as_f32()
    }

    pub fn as_str(&self) -> Option<&str> {
        self.view().as_str()
    }

    pub fn as_array(&self) -> Option<&Array> {
        self.view().as_array()
    }
}

impl<'a> ValueRef<'a> {
    pub fn type_id(&self) -> u32 {
        match self {
            ValueRef::U8(_) => 0,
            ValueRef::I8(_) => 1,
            ValueRef::U16(_) => 2,
            ValueRef::I16(_) => 3,
            ValueRef::U32(_) => 4,
            ValueRef::I32(_) => 5,
            ValueRef::F32(_) => 6,
            ValueRef::Bool(_) => 7,
            ValueRef::String(_) => STRING,
            ValueRef::Array(_) => ARRAY,
            ValueRef::U64(_) => 10,
            ValueRef::I64(_) => 11,
            ValueRef::F64(_) => 12,
        }
    }

    pub fn type_name(&self) -> &'static str {
        TYPE_NAMES[self.type_id() as usize]
    }

    /// Any integer type holding a value >= 0 (writers differ in the width they use).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            ValueRef::U8(v) => Some(v.into()),
            ValueRef::U16(v) => Some(v.into()),
            ValueRef::U32(v) => Some(v.into()),
            ValueRef::U64(v) => Some(v),
            ValueRef::I8(v) => u64::try_from(v).ok(),
            ValueRef::I16(v) => u64::try_from(v).ok(),
            ValueRef::I32(v) => u64::try_from(v).ok(),
            ValueRef::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            ValueRef::I8(v) => Some(v.into()),
            ValueRef::I16(v) => Some(v.into()),
            ValueRef::I32(v) => Some(v.into()),
            ValueRef::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            ValueRef::F32(v) => Some(v),
            ValueRef::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&'a str> {
        match *self {
            ValueRef::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&'a Array> {
        match *self {
            ValueRef::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl Array {
    /// Reads an array's element type, length and elements (the value type was read at `offset`).
    /// Nothing is allocated before the elements' bytes are known to be there.
    fn read(r: &mut Reader, offset: u64, depth: u32) -> Result<Self, GgufError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep { offset, max: MAX_ARRAY_DEPTH });
        }
        let elem_offset = r.offset();
        let elem_type = r.u32("array element type")?;
        let (min_bytes, _) = elem_bytes(elem_type, elem_offset)?;
        let n = r.count("array length", min_bytes)?;
        Ok(match elem_type {
            0 => Array::U8(r.take(n as u64, "metadata array")?.to_vec()),
            1 => Array::I8(fixed(r, n, |b: [u8; 1]| b[0] as i8)?),
            2 => Array::U16(fixed(r, n, u16::from_le_bytes)?),
            3 => Array::I16(fixed(r, n, i16::from_le_bytes)?),
            4 => Array::U32(fixed(r, n, u32::from_le_bytes)?),
            5 => Array::I32(fixed(r, n, i32::from_le_bytes)?),
            6 => Array::F32(fixed(r, n, f32::from_le_bytes)?),
            7 => Array::Bool(fixed(r, n, |b: [u8; 1]| b[0] != 0)?),
            STRING => Array::String(Box::new(Strings::read(r, n)?)),
            ARRAY => {
                // Walked once first, so the vector is allocated once, at its size.
                let mut scan = r.clone();
                for _ in 0..n {
                    Array::skip(&mut scan, elem_offset, depth + 1)?;
                }
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(Array::read(r, elem_offset, depth + 1)?);
                }
                Array::Array(items)
            }
            10 => Array::U64(fixed(r, n, u64::from_le_bytes)?),
            11 => Array::I64(fixed(r, n, i64::from_le_bytes)?),
            _ => Array::F64(fixed(r, n, f64::from_le_bytes)?),
        })
    }

    /// Steps over an array as `read` would read it, allocating nothing (strings are not checked
    /// for UTF-8 here: `read` does that).
    fn skip(r: &mut Reader, offset: u64, depth: u32) -> Result<(), GgufError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep { offset, max: MAX_ARRAY_DEPTH });
        }
        let elem_offset = r.offset();
        let elem_type = r.u32("array element type")?;
        let (min_bytes, fixed) = elem_bytes(elem_type, elem_offset)?;
        let n = r.count("array length", min_bytes)?;
        if fixed {
            r.take(n as u64 * min_bytes, "metadata array")?;
        } else {
            for _ in 0..n {
                match elem_type {
                    STRING => {
                        let len = r.u64("metadata string")?;
                        r.take(len, "metadata string")?;
                    }
                    _ => Array::skip(r, elem_offset, depth + 1)?,
                }
            }
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The spec's id of the elements' type.
    pub fn elem_type_id(&self) -> u32 {
        match self {
            Array::U8(_) => 0,
            Array::I8(_) => 1,
            Array::U16(_) => 2,
            Array::I16(_) => 3,
            Array::U32(_) => 4,
            Array::I32(_) => 5,
            Array::F32(_) => 6,
            Array::Bool(_) => 7,
            Array::String(_) => STRING,
            Array::Array(_) => ARRAY,
            Array::U64(_) => 10,
            Array::I64(_) => 11,
            Array::F64(_) => 12,
        }
    }

    pub fn get(&self, i: usize) -> Option<ValueRef<'_>> {
        Some(match self {
            Array::U8(v) => ValueRef::U8(*v.get(i)?),
            Array::I8(v) => ValueRef::I8(*v.get(i)?),
            Array::U16(v) => ValueRef::U16(*v.get(i)?),
            Array::I16(v) => ValueRef::I16(*v.get(i)?),
            Array::U32(v) => ValueRef::U32(*v.get(i)?),
            Array::I32(v) => ValueRef::I32(*v.get(i)?),
            Array::F32(v) => ValueRef::F32(*v.get(i)?),
            Array::Bool(v) => ValueRef::Bool(*v.get(i)?),
            Array::String(v) => ValueRef::String(v.get(i)?),
            Array::Array(v) => ValueRef::Array(v.get(i)?),
            Array::U64(v) => ValueRef::U64(*v.get(i)?),
            Array::I64(v) => ValueRef::I64(*v.get(i)?),
            Array::F64(v) => ValueRef::F64(*v.get(i)?),
        })
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = ValueRef<'_>> + '_ {
        (0..self.len()).map(|i| self.get(i).expect("index below len"))
    }

    /// The strings, when this is an array of strings.
    pub fn as_strings(&self) -> Option<&Strings> {
        match self {
            Array::String(s) => Some(s),
            _ => None,
        }
    }
}

/// An empty array, for `Option<&Array>::unwrap_or_default`.
impl Default for &Array {
    fn default() -> Self {
        static EMPTY: Array = Array::U8(Vec::new());
        &EMPTY
    }
}

impl<S: AsRef<str>> From<Vec<S>> for Array {
    fn from(strings: Vec<S>) -> Self {
        Array::String(Box::new(strings.iter().map(AsRef::as_ref).collect()))
    }
}

impl Strings {
    /// `n` strings (length, then bytes). A first pass finds their total length, so the text
    /// buffer is allocated once, at its size, after every string is known to be in the file.
    fn read(r: &mut Reader, n: usize) -> Result<Self, GgufError> {
        const W: &str = "metadata string";
        let mut scan = r.clone();
        let mut text_len = 0;
        for _ in 0..n {
            let len = scan.u64(W)?;
            scan.take(len, W)?;
            text_len += len as usize;
        }
        let mut strings = Strings { text: String::with_capacity(text_len), ends: Vec::with_capacity(n) };
        for _ in 0..n {
            strings.text.push_str(r.str(W)?);
            strings.ends.push(strings.text.len());
        }
        Ok(strings)
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    pub fn get(&self, i: usize) -> Option<&str> {
        let end = *self.ends.get(i)?;
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        Some(&self.text[start..end])
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        (0..self.len()).map(|i| self.get(i).expect("index below len"))
    }
}

impl<'s> FromIterator<&'s str> for Strings {
    fn from_iter<I: IntoIterator<Item = &'s str>>(iter: I) -> Self {
        let mut strings = Strings::default();
        for s in iter {
            strings.text.push_str(s);
            strings.ends.push(strings.text.len());
        }
        strings
    }
}

/// The fewest bytes an element of type `elem_type` takes, and whether all take that many.
fn elem_bytes(elem_type: u32, offset: u64) -> Result<(u64, bool), GgufError> {
    Ok(match elem_type {
        0 | 1 | 7 => (1, true),
        2 | 3 => (2, true),
        4..=6 => (4, true),
        10..=12 => (8, true),
        STRING => (8, false),
        // Element type and length.
        ARRAY => (12, false),
        _ => return Err(GgufError::UnknownValueType { offset, value_type: elem_type }),
    })
}

/// `n` fixed-size little-endian elements, converted once their bytes are known to be there.
fn fixed<T, const N: usize>(r: &mut Reader, n: usize, convert: impl Fn([u8; N]) -> T) -> Result<Vec<T>, GgufError> {
    let bytes = r.take(n as u64 * N as u64, "metadata array")?;
    Ok(bytes.chunks_exact(N).map(|c| convert(c.try_into().expect("chunks of N bytes"))).collect())
}
