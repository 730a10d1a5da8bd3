//! Writes GGUF files: used to make small synthetic models and hand-made test files.

use super::{Array, GgmlType, Value};

pub struct GgufWriter {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Data)>,
}

/// A tensor's data: its bytes, or only their count (a header written for data made elsewhere).
enum Data {
    Bytes(Vec<u8>),
    Sized(u64),
}

impl Data {
    fn len(&self) -> u64 {
        match self {
            Data::Bytes(b) => b.len() as u64,
            Data::Sized(n) => *n,
        }
    }
}

impl GgufWriter {
    pub fn new(version: u32) -> Self {
        Self { version, alignment: 32, metadata: Vec::new(), tensors: Vec::new() }
    }

    pub fn metadata(&mut self, key: &str, value: Value) -> &mut Self {
        if key == "general.alignment" {
            if let Some(a) = value.as_u64() {
                self.alignment = a;
            }
        }
        self.metadata.push((key.into(), value));
        self
    }

    /// Adds a tensor; `data` must already be in the type's block layout.
    pub fn tensor(&mut self, name: &str, shape: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.into(), shape.to_vec(), ty, Data::Bytes(data)));
        self
    }

    /// Adds a tensor whose `len` bytes of data come from elsewhere (see `header`).
    pub fn tensor_sized(&mut self, name: &str, shape: &[u64], ty: GgmlType, len: u64) -> &mut Self {
        self.tensors.push((name.into(), shape.to_vec(), ty, Data::Sized(len)));
        self
    }

    /// The header up to the aligned start of the data, and each tensor's data offset from there.
    pub fn header(&self) -> (Vec<u8>, Vec<u64>) {
        let mut out = Vec::new();
        let offsets = self.write_header(&mut out);
        out.resize((out.len() as u64).next_multiple_of(self.alignment) as usize, 0);
        (out, offsets)
    }

    /// The whole file (tensors added with `tensor_sized` are zeros).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_header(&mut out);
        for (_, _, _, data) in &self.tensors {
            out.resize((out.len() as u64).next_multiple_of(self.alignment) as usize, 0);
            match data {
                Data::Bytes(bytes) => out.extend_from_slice(bytes),
                Data::Sized(n) => out.resize(out.len() + *n as usize, 0),
            }
        }
        out
    }

    fn write_header(&self, out: &mut Vec<u8>) -> Vec<u64> {
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_str(out, key);
            write_value(out, value, true);
        }
        let (mut offset, mut offsets) = (0u64, Vec::with_capacity(self.tensors.len()));
        for (name, shape, ty, data) in &self.tensors {
            write_str(out, name);
            out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
            shape.iter().for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
            out.extend_from_slice(&type_id(*ty).to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).next_multiple_of(self.alignment);
        }
        offsets
    }
}

fn type_id(ty: GgmlType) -> u32 {
    (0..64).find(|&id| GgmlType::from_id(id) == Some(ty)).expect("every GgmlType has an id")
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, v: &Value, with_type: bool) {
    if with_type {
        out.extend_from_slice(&v.type_id().to_le_bytes());
    }
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => write_str(out, s),
        Value::List(a) => write_array(out, a),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

fn write_array(out: &mut Vec<u8>, a: &Array) {
    out.extend_from_slice(&a.elem_type_id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    fn each<T: Copy, const N: usize>(out: &mut Vec<u8>, items: &[T], bytes: impl Fn(T) -> [u8; N]) {
        items.iter().for_each(|&x| out.extend_from_slice(&bytes(x)));
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => each(out, v, i8::to_le_bytes),
        Array::U16(v) => each(out, v, u16::to_le_bytes),
        Array::I16(v) => each(out, v, i16::to_le_bytes),
        Array::U32(v) => each(out, v, u32::to_le_bytes),
        Array::I32(v) => each(out, v, i32::to_le_bytes),
        Array::F32(v) => each(out, v, f32::to_le_bytes),
        Array::Bool(v) => each(out, v, |b| [b as u8]),
        Array::String(v) => v.iter().for_each(|s| write_str(out, s)),
        Array::Array(v) => v.iter().for_each(|inner| write_array(out, inner)),
        Array::U64(v) => each(out, v, u64::to_le_bytes),
        Array::I64(v) => each(out, v, i64::to_le_bytes),
        Array::F64(v) => each(out, v, f64::to_le_bytes),
    }
}
