//! Tandem dataplane.

pub mod engine_api;
pub mod error;
pub mod gguf;
pub mod model;

pub use error::{Error, Result};

// Serving layer.
pub mod app;
pub mod chat;
pub mod config;
pub mod metrics;
pub mod parent;
pub mod prefix_report;
pub mod sampling;
pub mod scheduler;
pub mod server;
pub mod stop;
pub mod tokenizer;

pub mod kv;
pub mod pd;
pub mod progress;

#[cfg(test)]
mod test_support;
