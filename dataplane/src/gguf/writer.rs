//! A minimal GGUF writer, used to generate synthetic models and hostile inputs in tests.

use super::value::{GgufArray, GgufValue};
use super::{DEFAULT_ALIGNMENT, GgmlType};

#[derive(Debug, Clone)]
pub struct GgufWriter {
    version: u32,
    alignment: usize,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        Self {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    pub fn version(mut self, v: u32) -> Self {
        self.version = v;
        self
    }

    /// Also records `general.alignment` (as GGUF requires for a non-default alignment).
    pub fn alignment(mut self, a: usize) -> Self {
        self.alignment = a;
        self.metadata.retain(|(k, _)| k != "general.alignment");
        self.metadata
            .push(("general.alignment".into(), GgufValue::U32(a as u32)));
        self
    }

    pub fn meta(&mut self, key: &str, v: GgufValue) -> &mut Self {
        self.metadata.push((key.to_string(), v));
        self
    }

    /// Add a tensor; `data` must already be encoded as `ty` (see
    /// `tandem_kernels::quantize_row`). Sizes are not checked here so tests can write
    /// inconsistent files on purpose.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut b, k);
            b.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut b, v);
        }
        let align = |n: usize| n.div_ceil(self.alignment) * self.alignment;
        let mut offset = 0usize;
        for (name, dims, ty, data) in &self.tensors {
            put_str(&mut b, name);
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.id().to_le_bytes());
            b.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = align(offset + data.len());
        }
        b.resize(align(b.len()), 0);
        for (_, _, _, data) in &self.tensors {
            b.extend_from_slice(data);
            let start = b.len() - data.len();
            b.resize(start + align(data.len()), 0);
        }
        b
    }

    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        std::fs::write(path, self.to_bytes())
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

fn put_value(b: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => b.push(*x),
        GgufValue::I8(x) => b.push(*x as u8),
        GgufValue::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => b.push(*x as u8),
        GgufValue::String(s) => put_str(b, s),
        GgufValue::Array(a) => put_array(b, a),
    }
}

fn put_array(b: &mut Vec<u8>, a: &GgufArray) {
    b.extend_from_slice(&a.elem_type_id().to_le_bytes());
    b.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                b.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        GgufArray::U8(v) => b.extend_from_slice(v),
        GgufArray::I8(v) => each!(v),
        GgufArray::U16(v) => each!(v),
        GgufArray::I16(v) => each!(v),
        GgufArray::U32(v) => each!(v),
        GgufArray::I32(v) => each!(v),
        GgufArray::U64(v) => each!(v),
        GgufArray::I64(v) => each!(v),
        GgufArray::F32(v) => each!(v),
        GgufArray::F64(v) => each!(v),
        GgufArray::Bool(v) => b.extend(v.iter().map(|x| *x as u8)),
        GgufArray::String(v) => v.iter().for_each(|s| put_str(b, s)),
        GgufArray::Array(v) => v.iter().for_each(|x| put_array(b, x)),
    }
}
