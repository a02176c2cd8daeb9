//! The dataplane library's error type.
//!
//! NOTE (serving layer -> engine engineer): created by the serving layer because nothing
//! existed yet; this file is yours — add, rename or regroup variants freely. The serving
//! layer relies on: `KvCacheFull` (returned by `ModelRunner::reserve` when blocks are
//! short: the scheduler keeps the request waiting instead of failing it), `Tokenizer`,
//! `ChatTemplate`, `Model`.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// Not enough free KV blocks right now; a retry may succeed after other sequences free.
    #[error("KV cache full: need {needed} blocks, {free} free")]
    KvCacheFull { needed: usize, free: usize },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("model: {0}")]
    Model(String),
    #[error("I/O error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A malformed or unsupported GGUF file; the message names the key or tensor.
    #[error("GGUF: {0}")]
    Gguf(#[from] crate::gguf::GgufError),
    /// A kernel rejected its arguments (a shape bug in the caller, never bad user input).
    #[error("kernel: {0}")]
    Kernel(#[from] tandem_kernels::Error),
    /// A caller error in a `ModelRunner` call: unknown sequence, empty step, context
    /// length exceeded, token id out of range, a sequence twice in one batch.
    #[error("invalid request to the model runner: {0}")]
    InvalidInput(String),
    /// A KV export/import payload that does not fit this runner (layout, dtype, size).
    #[error("KV transfer: {0}")]
    KvTransfer(String),
}

pub type Result<T> = std::result::Result<T, Error>;
