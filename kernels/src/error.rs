//! Errors of the kernels crate.

/// What a kernel call rejected. Kernels validate shapes up front so that a bad call is an
/// error at the boundary rather than a panic or an out-of-bounds read deep in a loop.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("unknown GGML tensor type id {0}")]
    UnknownType(u32),
    #[error("row length {len} is not a multiple of the {ty} block size {block}")]
    RowNotBlockAligned {
        ty: &'static str,
        len: usize,
        block: usize,
    },
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    /// The CUDA backend failed: no driver or device, NVRTC missing or rejecting a kernel,
    /// or a driver call (allocation, copy, launch) returning an error.
    #[error("CUDA: {0}")]
    Cuda(String),
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn shape(op: &'static str, detail: impl Into<String>) -> Error {
    Error::Shape {
        op,
        detail: detail.into(),
    }
}
