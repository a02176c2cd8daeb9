//! The dataplane library's error type: one variant per failure class, each naming what
//! was wrong and, where there is one, carrying the underlying error as its source.
//!
//! Add context where an error crosses a boundary that knows more than the failing call
//! (which file, which device, which peer) with [`Context::context`]:
//!
//! ```text
//! runner.import_kv(seq, &payload).context(format!("room {room}: importing KV"))?;
//! ```
//!
//! The scheduler matches on [`Error::KvCacheFull`] (the request waits for memory instead of
//! failing); everything else is reported with its message.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// Not enough free KV blocks right now; a retry may succeed after other sequences free.
    #[error("KV cache full: need {needed} blocks, {free} free")]
    KvCacheFull { needed: usize, free: usize },
    /// A setting (flag, environment variable, or a combination of them) that cannot work.
    #[error("configuration {setting}: {reason}")]
    Config { setting: String, reason: String },
    /// The tokenizer data of the model file is malformed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template of the model file fails to compile or render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// Reading a file.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Starting a thread (the OS refused: limits, memory).
    #[error("starting the {name} thread: {source}")]
    Thread {
        name: String,
        #[source]
        source: std::io::Error,
    },
    /// A ZeroMQ socket call (create, configure, bind, connect).
    #[error("ZeroMQ socket {endpoint}: {source}")]
    Transport {
        endpoint: String,
        #[source]
        source: zmq::Error,
    },
    /// A model file this engine cannot serve: each entry names what is missing
    /// (architecture, tensor type, tokenizer, pre-tokenizer) and what is supported.
    #[error("this engine cannot serve this model: {}", .0.join("; "))]
    Unsupported(Vec<String>),
    /// A malformed or unsupported GGUF file; the message names the key or tensor.
    #[error("GGUF: {0}")]
    Gguf(#[source] crate::gguf::GgufError),
    /// A kernel or compute device failed: a shape the kernel refused (a bug in the caller,
    /// never bad user input), or the CUDA backend (no driver or device, NVRTC, a driver
    /// call, a device result out of range).
    #[error("kernel: {0}")]
    Kernel(#[from] tandem_kernels::Error),
    /// A caller error in a `ModelRunner` call: unknown sequence, empty step, context
    /// length exceeded, token id out of range, a sequence twice in one batch.
    #[error("invalid request to the model runner: {0}")]
    InvalidInput(String),
    /// A KV export/import payload that does not fit this runner (layout, dtype, size).
    #[error("KV transfer: {0}")]
    KvTransfer(String),
    /// Another error, with what was being done when it happened.
    #[error("{context}: {source}")]
    Context {
        context: String,
        #[source]
        source: Box<Error>,
    },
}

impl From<crate::gguf::GgufError> for Error {
    /// A file that could not be read is an I/O error whatever was reading it; the rest is
    /// a malformed or unsupported file.
    fn from(e: crate::gguf::GgufError) -> Self {
        match e {
            crate::gguf::GgufError::Io {
                path,
                kind,
                message,
            } => Error::Io {
                path,
                source: std::io::Error::new(kind, message),
            },
            other => Error::Gguf(other),
        }
    }
}

impl Error {
    pub fn config(setting: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Config {
            setting: setting.into(),
            reason: reason.into(),
        }
    }

    /// The innermost error under any [`Error::Context`] layers (what to match on).
    pub fn root(&self) -> &Error {
        match self {
            Self::Context { source, .. } => source.root(),
            other => other,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;

/// Say what was being done when an error happened, as candle's `Context` trait does:
/// `result.context("loading weights")?` turns an error `e` into
/// `Error::Context { context: "loading weights", source: e }`.
pub trait Context<T> {
    fn context(self, context: impl Into<String>) -> Result<T>;

    /// [`Context::context`] with a message built only on failure.
    fn with_context<C: Into<String>>(self, f: impl FnOnce() -> C) -> Result<T>;
}

impl<T, E: Into<Error>> Context<T> for std::result::Result<T, E> {
    fn context(self, context: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::Context {
            context: context.into(),
            source: Box::new(e.into()),
        })
    }

    fn with_context<C: Into<String>>(self, f: impl FnOnce() -> C) -> Result<T> {
        self.map_err(|e| Error::Context {
            context: f().into(),
            source: Box::new(e.into()),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn context_wraps_and_keeps_the_source() {
        let r: std::result::Result<(), tandem_kernels::Error> =
            Err(tandem_kernels::Error::UnknownType(99));
        let e = r.context("loading blk.3.attn_q.weight").unwrap_err();
        assert_eq!(
            e.to_string(),
            "loading blk.3.attn_q.weight: kernel: unknown GGML tensor type id 99"
        );
        assert!(matches!(
            e.root(),
            Error::Kernel(tandem_kernels::Error::UnknownType(99))
        ));
        assert!(
            e.source()
                .is_some_and(|s| s.to_string().starts_with("kernel:"))
        );
        let twice = Err::<(), _>(e)
            .with_context(|| "starting the runner")
            .unwrap_err();
        assert!(matches!(twice.root(), Error::Kernel(_)));
        assert!(
            twice
                .to_string()
                .starts_with("starting the runner: loading")
        );
    }

    #[test]
    fn every_class_names_what_was_wrong() {
        let e = Error::config("--device cuda", "built without CUDA");
        assert_eq!(
            e.to_string(),
            "configuration --device cuda: built without CUDA"
        );
        let e = Error::Transport {
            endpoint: "tcp://0.0.0.0:5600".into(),
            source: zmq::Error::EADDRINUSE,
        };
        assert!(e.to_string().contains("tcp://0.0.0.0:5600"), "{e}");
        assert!(e.source().is_some());
        let e = Error::Thread {
            name: "engine".into(),
            source: std::io::Error::other("EAGAIN"),
        };
        assert_eq!(e.to_string(), "starting the engine thread: EAGAIN");
    }
}
