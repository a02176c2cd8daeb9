//! The GGUF header parser: a bounds-checked cursor over the file bytes.
//!
//! Every count read from the file is checked against the bytes that remain before
//! anything is allocated, so a hostile count fails fast instead of allocating.

use super::value::{GgufArray, GgufValue, min_size, type_id};
use super::{GgufError, Header, TensorInfo, UnsupportedTensor};
use std::collections::HashSet;
use tandem_kernels::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Arrays may nest; a bound keeps a crafted file from overflowing the stack.
const MAX_NESTING: usize = 8;
/// GGML tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;

type R<T> = std::result::Result<T, GgufError>;

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> R<&'a [u8]> {
        if n > self.left() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos,
                need: n as u64,
                left: self.left(),
            });
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, what: &dyn Fn() -> String) -> R<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> R<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> R<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    /// A count of elements at least `min` bytes each, bounded by the bytes left.
    fn count(&mut self, min: usize, what: &dyn Fn() -> String) -> R<usize> {
        let offset = self.pos;
        let n = self.u64(what)?;
        let fits = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(min))
            .is_some_and(|bytes| bytes <= self.left());
        if !fits {
            return Err(GgufError::BadCount {
                what: what(),
                count: n,
                offset,
                left: self.left(),
            });
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> R<String> {
        let n = self.count(1, what)?;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8 { what: what() })
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> R<GgufValue> {
        use type_id::*;
        let what = || format!("value of metadata key {key}");
        Ok(match ty {
            U8 => GgufValue::U8(self.arr::<1>(&what)?[0]),
            I8 => GgufValue::I8(self.arr::<1>(&what)?[0] as i8),
            U16 => GgufValue::U16(u16::from_le_bytes(self.arr(&what)?)),
            I16 => GgufValue::I16(i16::from_le_bytes(self.arr(&what)?)),
            U32 => GgufValue::U32(u32::from_le_bytes(self.arr(&what)?)),
            I32 => GgufValue::I32(i32::from_le_bytes(self.arr(&what)?)),
            U64 => GgufValue::U64(u64::from_le_bytes(self.arr(&what)?)),
            I64 => GgufValue::I64(i64::from_le_bytes(self.arr(&what)?)),
            F32 => GgufValue::F32(f32::from_le_bytes(self.arr(&what)?)),
            F64 => GgufValue::F64(f64::from_le_bytes(self.arr(&what)?)),
            BOOL => GgufValue::Bool(self.bool(key)?),
            STRING => GgufValue::String(self.string(&what)?),
            ARRAY => GgufValue::Array(self.array(key, depth)?),
            other => {
                return Err(GgufError::BadValueType {
                    key: key.to_string(),
                    ty: other,
                });
            }
        })
    }

    fn bool(&mut self, key: &str) -> R<bool> {
        let offset = self.pos;
        match self.arr::<1>(&|| format!("value of metadata key {key}"))?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(GgufError::BadValue {
                key: key.to_string(),
                reason: format!("bool byte {b} at offset {offset} is neither 0 nor 1"),
            }),
        }
    }

    fn array(&mut self, key: &str, depth: usize) -> R<GgufArray> {
        if depth >= MAX_NESTING {
            return Err(GgufError::BadValue {
                key: key.to_string(),
                reason: format!("arrays nested deeper than {MAX_NESTING}"),
            });
        }
        let what = || format!("array of metadata key {key}");
        let ty = self.u32(&what)?;
        let min = min_size(ty).ok_or_else(|| GgufError::BadValueType {
            key: key.to_string(),
            ty,
        })?;
        let n = self.count(min, &what)?;
        macro_rules! nums {
            ($variant:ident, $t:ty) => {{
                let bytes = self.take(n * min, &what)?;
                GgufArray::$variant(
                    bytes
                        .chunks_exact(min)
                        .map(|c| {
                            <$t>::from_le_bytes(c.try_into().expect("chunk of the type's size"))
                        })
                        .collect(),
                )
            }};
        }
        use type_id::*;
        Ok(match ty {
            U8 => GgufArray::U8(self.take(n, &what)?.to_vec()),
            I8 => GgufArray::I8(self.take(n, &what)?.iter().map(|b| *b as i8).collect()),
            U16 => nums!(U16, u16),
            I16 => nums!(I16, i16),
            U32 => nums!(U32, u32),
            I32 => nums!(I32, i32),
            U64 => nums!(U64, u64),
            I64 => nums!(I64, i64),
            F32 => nums!(F32, f32),
            F64 => nums!(F64, f64),
            BOOL => GgufArray::Bool((0..n).map(|_| self.bool(key)).collect::<R<_>>()?),
            STRING => GgufArray::String((0..n).map(|_| self.string(&what)).collect::<R<_>>()?),
            _ => GgufArray::Array(
                (0..n)
                    .map(|_| self.array(key, depth + 1))
                    .collect::<R<_>>()?,
            ),
        })
    }
}

/// Parse everything before the tensor data: header, metadata, tensor infos. `bytes` is
/// the whole file, so tensor extents are checked against its length too.
pub fn parse_header(bytes: &[u8]) -> R<Header> {
    let mut c = Cursor { b: bytes, pos: 0 };
    let magic = c.arr::<4>(&|| "magic".into())?;
    if &magic != MAGIC {
        return Err(GgufError::BadMagic(u32::from_le_bytes(magic)));
    }
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    // Each tensor info takes at least 8 (name) + 4 + 4 + 8 bytes, each KV pair 8 + 4 + 1.
    let n_tensors = c.count(24, &|| "tensor count".into())?;
    let n_kv = c.count(13, &|| "metadata count".into())?;

    let mut metadata = Vec::with_capacity(n_kv);
    let mut keys = HashSet::with_capacity(n_kv);
    for i in 0..n_kv {
        let key = c.string(&|| format!("key of metadata entry {i}"))?;
        let ty = c.u32(&|| format!("type of metadata key {key}"))?;
        let value = c.value(ty, &key, 0)?;
        if !keys.insert(key.clone()) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((k, v)) => match v {
            GgufValue::U32(a) if a.is_power_of_two() => *a as usize,
            other => {
                return Err(GgufError::BadValue {
                    key: k.clone(),
                    reason: format!("{other:?} is not a power-of-two u32"),
                });
            }
        },
    };

    let mut infos = Vec::with_capacity(n_tensors);
    let mut unsupported = Vec::new();
    let mut names = HashSet::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name = c.string(&|| format!("name of tensor {i}"))?;
        if !names.insert(name.clone()) {
            return Err(GgufError::Tensor {
                tensor: name,
                reason: "appears twice".into(),
            });
        }
        match tensor_info(&mut c, name, alignment)? {
            Parsed::Known(t) => infos.push(t),
            Parsed::Unsupported(t) => unsupported.push(t),
        }
    }

    let data_offset = c.pos.div_ceil(alignment) * alignment;
    let data_len = bytes.len().saturating_sub(data_offset);
    for t in &infos {
        let end = t.offset.checked_add(t.n_bytes as u64);
        if end.is_none_or(|e| e > data_len as u64) {
            return Err(GgufError::Tensor {
                tensor: t.name.clone(),
                reason: format!(
                    "data at offset {} + {} bytes lies outside the {data_len} bytes of tensor data (truncated file?)",
                    t.offset, t.n_bytes
                ),
            });
        }
    }
    Ok(Header {
        version,
        metadata,
        tensors: infos,
        unsupported,
        alignment,
        data_offset,
    })
}

/// A tensor info: one the kernels read, or one whose type they do not (kept by name so
/// that the refusal can list it).
enum Parsed {
    Known(TensorInfo),
    Unsupported(UnsupportedTensor),
}

fn tensor_info(c: &mut Cursor<'_>, name: String, alignment: usize) -> R<Parsed> {
    let bad = |reason: String| GgufError::Tensor {
        tensor: name.clone(),
        reason,
    };
    let what = || format!("info of tensor {name}");
    let n_dims = c.u32(&what)?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(bad(format!(
            "{n_dims} dimensions (1..={MAX_DIMS} supported)"
        )));
    }
    let dims = (0..n_dims).map(|_| c.u64(&what)).collect::<R<Vec<_>>>()?;
    let ty_id = c.u32(&what)?;
    let offset = c.u64(&what)?;
    let Ok(ty) = GgmlType::from_id(ty_id) else {
        return Ok(Parsed::Unsupported(UnsupportedTensor {
            name,
            dims,
            type_id: ty_id,
        }));
    };
    let n_elems = dims
        .iter()
        .try_fold(1u64, |a, d| a.checked_mul(*d))
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
    if dims[0] % ty.block_len() as u64 != 0 {
        return Err(bad(format!(
            "row length {} is not a multiple of the {ty} block size {}",
            dims[0],
            ty.block_len()
        )));
    }
    let n_bytes = (n_elems / ty.block_len())
        .checked_mul(ty.block_bytes())
        .ok_or_else(|| bad("byte size overflows".into()))?;
    if offset % alignment as u64 != 0 {
        return Err(bad(format!(
            "offset {offset} is not aligned to {alignment}"
        )));
    }
    Ok(Parsed::Known(TensorInfo {
        name,
        dims,
        ty,
        offset,
        n_bytes,
    }))
}
