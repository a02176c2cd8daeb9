//! The CUDA backend (feature `cuda`).
//!
//! CUDA C kernels (`*.cu` next to this file) are compiled at run time by NVRTC for the
//! device's architecture, once per process, and driven through cudarc with the driver
//! library loaded dynamically: building needs neither the CUDA toolkit nor a driver, and
//! without a driver every entry point returns [`crate::Error::Cuda`] instead of panicking
//! ([`probe`] first, always).
//!
//! - [`sources`]: the sources, the kernel names, NVRTC compilation and the image cache.
//! - [`launch`]: launch geometry, pure functions.
//! - [`CudaDevice`]: context + one stream + loaded kernels, device buffers for weights
//!   ([`DeviceMatrix`]), rope tables and the paged KV pool ([`DeviceKv`]), and a typed
//!   wrapper per kernel. A model runner keeps everything resident and only moves token
//!   ids in and sampled tokens (or logits) out: `tandem_sample` (sampling.cu) samples
//!   with temperature / top-k / top-p given one host-drawn uniform number per row.
//! - [`CudaBackend`]: the [`crate::Backend`] trait on the device: buffers are
//!   `CudaSlice<f32>`, weights [`DeviceMatrix`], the KV pools [`DeviceKv`], a step's inputs
//!   [`CudaStep`]; every method only enqueues kernels on the stream (nothing is copied
//!   between host and device but a step's inputs in [`crate::Backend::prepare_step`] and
//!   explicit downloads), so the model's one forward pass runs resident on the GPU and
//!   can be captured into a CUDA graph.
//! - [`DecodeInputs`], [`CudaDevice::capture`], [`DeviceGraph`]: fixed-address inputs of
//!   decode steps and CUDA-graph capture / replay of the work that reads them.
//! - [`CudaKernels`]: the slice-level [`crate::Kernels`] trait on top, copying host slices
//!   in and out per call. For tests against [`crate::ScalarKernels`], not for serving.
//! - `sim` (feature `cuda-sim`, tests only): the CPU executor that runs all of the above —
//!   the real `.cu` kernels and the real driver calls — without a GPU.
//!
//! Memory layouts (all identical to the CPU side so KV export/import and tests compare
//! byte for byte):
//! - weights: GGUF rows as stored (see `types.rs`), one allocation per matrix;
//! - activations: f32 row-major `[token][dim]`; Q8 activations: `quant::BlockQ8` (40 bytes:
//!   f32 d, f32 s, 32 × i8) per 32 values, row after row;
//! - KV: per layer a K pool and a V pool of `n_blocks · block_tokens` rows of `kv_dim`
//!   values as F32/F16/Q8_0, row of (block b, offset o) at `(b · block_tokens + o) ·
//!   row_bytes`; all layers' K pools in one allocation, likewise V;
//! - KV transfer: the body of the `TKV1` payload (per layer K rows 0..n then V rows).
#![allow(unsafe_code)]

mod backend;
mod device;
mod kernels;
pub mod launch;
#[cfg(feature = "cuda-sim")]
pub mod sim;
pub mod sources;

pub use backend::CudaBackend;
pub use device::{
    CudaDevice, CudaStep, DecodeInputs, DeviceAttnPlan, DeviceGraph, DeviceInfo, DeviceKv,
    DeviceMatrix, DeviceRope, probe,
};
pub use kernels::CudaKernels;
pub use sources::{Kernel, SOURCES, Source, Target};

/// Re-exported so that users of the backend name buffer types without depending on
/// cudarc themselves.
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
