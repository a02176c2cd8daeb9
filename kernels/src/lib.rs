//! Compute kernels for Tandem's model engine.
//!
//! Two levels:
//! - [`Backend`]: what a forward pass runs on. Its buffers, weights, KV pools and step
//!   inputs are the backend's own types (host vectors and mapped file bytes for
//!   [`CpuBackend`], device allocations for `cuda::CudaBackend`), so the model's one
//!   forward pass is generic over it and never moves activations between host and device.
//! - [`Kernels`]: the same operations on host slices, with two CPU implementations that
//!   [`CpuBackend`] runs on:
//!   - [`ScalarKernels`]: plain loops, written for clarity; the test oracle.
//!   - [`CpuKernels`]: AVX2/FMA integer dot products chosen at run time (scalar fallback),
//!     spread over all cores by a persistent thread pool.
//!
//!   The CUDA kernels implement it too (`cuda::CudaKernels`, copying slices in and out per
//!   call) so that tests hold every GPU kernel against [`ScalarKernels`].
//!
//! Weights come from GGUF as [`HostMatrix`] / [`Matrix`] (type, shape, bytes as stored);
//! a backend repacks them once into the [`Layout`] its kernels read fastest (the CPU's
//! 8-row interleave) or uploads them once (CUDA).

mod api;
mod backend;
pub mod checksum;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod quant;
mod reference;
mod rope;
mod types;

pub use api::{AttnQuery, AttnShape, Kernels, KvView, Layout, Matrix};
pub use backend::{Backend, HostMatrix, PagedKvSpec, SharedBytes, StepDesc, StepSeq};
pub use cpu::{CpuBackend, CpuKernels, CpuOptions, HostKv, SimdTier};
pub use error::{Error, Result};
pub use quant::{
    ActRow, BlockQ8, BlockQ8K, dequantize_row, quantize_act_row, quantize_act_row_k, quantize_row,
    vec_dot,
};
pub use reference::ScalarKernels;
pub use rope::{RopeStyle, RopeTable};
pub use types::{ActFormat, GgmlType, QK, QK_K};

use std::sync::Arc;

/// The fastest backend available on this machine.
pub fn best_backend() -> Arc<dyn Kernels> {
    Arc::new(CpuKernels::new())
}
