//! The Llama-family model: configuration, weights, paged KV cache, the batched forward
//! pass, and the `ModelRunner` implementation.

mod config;
#[cfg(feature = "cuda")]
pub mod cuda_runner;
mod forward;
pub mod kv_cache;
mod kv_transfer;
mod runner;
pub mod synthetic;
mod weights;

#[cfg(test)]
mod tests;

pub use config::LlamaConfig;
pub use kv_cache::{KvCacheConfig, PagedKvCache};
pub use kv_transfer::{KV_EXPORT_MAGIC, KV_EXPORT_VERSION};
pub use runner::{CpuModelRunner, RunnerConfig};
pub use weights::{LayerWeights, WeightRef, Weights};
