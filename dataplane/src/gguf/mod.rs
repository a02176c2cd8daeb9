//! GGUF reader (versions 2 and 3) with memory-mapped tensor data, and a small writer used
//! to build synthetic models for tests.
//!
//! File layout: magic `GGUF`, u32 version, u64 tensor count, u64 metadata count, the
//! metadata key/value pairs, the tensor infos (name, dims, type, offset), padding to
//! `general.alignment` (default 32), then tensor data; tensor offsets are relative to the
//! start of the data and aligned too.

mod ggml_types;
mod parse;
mod value;
pub mod writer;

#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::Arc;

pub use ggml_types::{describe_type, ggml_type_name, supported_types};
pub use parse::{DEFAULT_ALIGNMENT, parse_header};
pub use tandem_kernels::GgmlType;
pub use value::{GgufArray, GgufValue, type_id};

/// What was wrong with a GGUF file. Messages name the key or tensor concerned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file (magic {0:#010x})")]
    BadMagic(u32),
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error("truncated file: {what} at offset {offset} needs {need} bytes, {left} left")]
    Truncated {
        what: String,
        offset: usize,
        need: u64,
        left: usize,
    },
    #[error(
        "{what}: count {count} at offset {offset} exceeds what the remaining {left} bytes can hold"
    )]
    BadCount {
        what: String,
        count: u64,
        offset: usize,
        left: usize,
    },
    #[error("metadata key {key}: unknown value type {ty}")]
    BadValueType { key: String, ty: u32 },
    #[error("{what}: invalid UTF-8")]
    BadUtf8 { what: String },
    #[error("metadata key {0} appears twice")]
    DuplicateKey(String),
    #[error("missing metadata key {0}")]
    MissingKey(String),
    #[error("metadata key {key}: {reason}")]
    BadValue { key: String, reason: String },
    #[error("tensor {tensor}: {reason}")]
    Tensor { tensor: String, reason: String },
    #[error("missing tensor {0}")]
    MissingTensor(String),
    /// A tensor whose type this build's kernels do not read (`type_name` from
    /// [`describe_type`]).
    #[error(
        "tensor {tensor} is stored as {type_name}, a tensor type this build cannot read (supported: {supported})"
    )]
    UnsupportedTensorType {
        tensor: String,
        type_name: String,
        supported: String,
    },
    /// The file could not be opened or mapped (the crate's [`crate::Error::Io`] once
    /// converted; kept as kind and text so that this type stays `Clone` and `PartialEq`).
    #[error("I/O error on {path}: {message}")]
    Io {
        path: String,
        kind: std::io::ErrorKind,
        message: String,
    },
}

/// One tensor's description; `offset` is relative to the start of the tensor data.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the row length (contiguous), `dims[1]` the row count.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub offset: u64,
    pub n_bytes: usize,
}

/// A tensor of a type the kernels cannot read: named, never read (its size is unknown
/// here, so its bytes are not bounds-checked either).
#[derive(Debug, Clone, PartialEq)]
pub struct UnsupportedTensor {
    pub name: String,
    pub dims: Vec<u64>,
    /// The GGML type id as stored.
    pub type_id: u32,
}

/// Everything before the tensor data.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub version: u32,
    pub metadata: Vec<(String, GgufValue)>,
    pub tensors: Vec<TensorInfo>,
    /// Tensors of types the kernels do not read, in file order (the engine refuses such a
    /// file naming them; see `model::support`).
    pub unsupported: Vec<UnsupportedTensor>,
    pub alignment: usize,
    /// Absolute file offset where tensor data begins.
    pub data_offset: usize,
}

enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file whose tensor data stays in the (mapped) file.
pub struct Gguf {
    header: Header,
    storage: Arc<Storage>,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.header.version)
            .field("metadata", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .finish()
    }
}

/// The whole file, so that weights can hold views into the mapping
/// (`tandem_kernels::HostMatrix`).
impl AsRef<[u8]> for Gguf {
    fn as_ref(&self) -> &[u8] {
        self.bytes()
    }
}

impl Gguf {
    /// Map and parse a file. Model files are treated as immutable while mapped.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |e: std::io::Error| GgufError::Io {
            path: path.display().to_string(),
            kind: e.kind(),
            message: e.to_string(),
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only and private to this process; the file is a
        // model weight file that nothing modifies while it is served (changing it under a
        // running server is unsupported, like with any mmap-based model loader).
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::from_storage(Storage::Mmap(map))
    }

    /// Parse a file held in memory (tests, synthetic models).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::from_storage(Storage::Owned(bytes))
    }

    fn from_storage(storage: Storage) -> Result<Self, GgufError> {
        let header = parse_header(storage.bytes())?;
        Ok(Self {
            header,
            storage: Arc::new(storage),
        })
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn version(&self) -> u32 {
        self.header.version
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.header
            .metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    fn require(&self, key: &str) -> Result<&GgufValue, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn wrong(key: &str, expected: &str, v: &GgufValue) -> GgufError {
        GgufError::BadValue {
            key: key.to_string(),
            reason: format!("expected {expected}, found {}", v.type_name()),
        }
    }

    /// A non-negative integer of any width that fits in `usize`.
    pub fn get_usize(&self, key: &str) -> Result<usize, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| Self::wrong(key, "a non-negative integer", v))
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|f| f as f32)
            .ok_or_else(|| Self::wrong(key, "a number", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong(key, "a string", v))
    }

    pub fn get_array(&self, key: &str) -> Result<&GgufArray, GgufError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| Self::wrong(key, "an array", v))
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        if let Some(t) = self.header.unsupported.iter().find(|t| t.name == name) {
            return Err(GgufError::UnsupportedTensorType {
                tensor: name.to_string(),
                type_name: describe_type(t.type_id),
                supported: supported_types(),
            });
        }
        self.header
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))
    }

    /// Whether the file has a tensor of this name (of any type).
    pub fn has_tensor(&self, name: &str) -> bool {
        self.header.tensors.iter().any(|t| t.name == name)
            || self.header.unsupported.iter().any(|t| t.name == name)
    }

    /// Tensors of types this build cannot read.
    pub fn unsupported_tensors(&self) -> &[UnsupportedTensor] {
        &self.header.unsupported
    }

    /// The bytes of a tensor (bounds were checked when parsing).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = self.header.data_offset + t.offset as usize;
        &self.storage.bytes()[start..start + t.n_bytes]
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Drop the process's resident pages of `bytes()[start..start + len]` (a tensor a
    /// backend has copied and no longer reads), so that a repacked or uploaded model is
    /// not counted twice in the RSS. Reading the range again is still correct: the pages
    /// fault back in from the file. Owned storage has nothing to drop.
    pub fn release_pages(&self, start: usize, len: usize) -> std::io::Result<()> {
        match &*self.storage {
            Storage::Owned(_) => Ok(()),
            Storage::Mmap(m) => {
                // SAFETY: the mapping is read-only and private (`Mmap::map`), so this
                // process never wrote to it: MADV_DONTNEED only unmaps clean pages, which
                // refault with the same file contents, and no reference sees a change.
                #[allow(unsafe_code)]
                unsafe {
                    m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len)
                }
            }
        }
    }
}
