//! The model: architectures as data (`arch`: llama, qwen2, qwen3, gemma3), configuration,
//! weights, the paged KV cache's accounting, the one batched forward pass (generic over
//! `tandem_kernels::Backend`), and the `ModelRunner` implementations on top of it: the
//! CPU runner and, with feature `cuda`, the CUDA runner.

pub mod arch;
mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
mod forward;
mod info;
pub mod kv_cache;
mod kv_transfer;
mod loaded;
pub mod prefix_cache;
mod runner;
pub mod support;
pub mod synthetic;
mod weights;

#[cfg(test)]
mod prefix_tests;
#[cfg(test)]
mod tests;

pub use config::{LayerSpec, ModelConfig, RopeSpec};
pub use forward::{Activations, LayerOn, ModelWeights, forward, rope_tables};
pub use kv_cache::{BlockAllocator, KvCacheConfig};
pub use kv_transfer::{KV_EXPORT_MAGIC, KV_EXPORT_VERSION, KvHeader};
pub use loaded::{LoadedModel, RunnerConfig, StepOutcome};
pub use runner::CpuModelRunner;
pub use weights::{AttnBias, LayerWeights, WeightRef, Weights};
