//! Compute kernels for Tandem's model engine.
//!
//! One backend-neutral interface, [`Kernels`], with two implementations today:
//! - [`ScalarKernels`]: plain loops, written for clarity; the test oracle.
//! - [`CpuKernels`]: AVX2/FMA integer dot products chosen at run time (scalar fallback),
//!   spread over all cores by a persistent thread pool.
//!
//! A CUDA backend (feature `cuda`) implements the same trait. Weights are described by
//! [`Matrix`] (type, shape, bytes as stored in GGUF), never by a backend-specific type,
//! so the model code above does not care which backend runs it.

mod api;
pub mod checksum;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod quant;
mod reference;
mod rope;
mod types;

pub use api::{AttnQuery, AttnShape, Kernels, KvView, Matrix};
pub use cpu::CpuKernels;
pub use error::{Error, Result};
pub use quant::{BlockQ8, dequantize_row, quantize_act_row, quantize_row};
pub use reference::ScalarKernels;
pub use rope::{RopeStyle, RopeTable};
pub use types::{GgmlType, QK};

use std::sync::Arc;

/// The fastest backend available on this machine.
pub fn best_backend() -> Arc<dyn Kernels> {
    Arc::new(CpuKernels::new())
}
