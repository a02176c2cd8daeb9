//! [`ModelInfo`] from a GGUF file: the one place every runner gets it from, so that a CPU
//! prefill and a GPU decode of the same file report the same facts and fingerprint (the
//! PD handshake compares them).

use std::path::Path;

use sha2::{Digest, Sha256};

use super::config::ModelConfig;
use crate::engine_api::ModelInfo;
use crate::gguf::Gguf;

impl ModelInfo {
    /// The facts of the model in `g` (hyperparameters `cfg`, parsed from it) served with
    /// a KV cache of `kv_block_size`-token blocks.
    pub fn from_gguf(g: &Gguf, cfg: &ModelConfig, kv_block_size: usize) -> Self {
        ModelInfo {
            name: cfg.name.clone(),
            vocab_size: cfg.vocab_size,
            context_length: cfg.context_length,
            n_layers: cfg.n_layers,
            n_kv_heads: cfg.n_kv_heads,
            head_dim: cfg.head_dim,
            kv_block_size,
            fingerprint: fingerprint(g),
        }
    }

    /// Name the model after its file (without extension) when the file names none.
    pub fn or_file_name(mut self, path: &Path) -> Self {
        if self.name.is_empty() {
            self.name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
        }
        self
    }
}

/// SHA-256 over everything before the tensor data (architecture, hyperparameters,
/// vocabulary, tensor names, types, shapes and offsets) plus a 4 KiB sample from the
/// start, middle and end of every tensor: distinguishes different weights without
/// hashing the whole file at every start.
fn fingerprint(g: &Gguf) -> String {
    let mut h = Sha256::new();
    h.update(&g.bytes()[..g.header().data_offset.min(g.bytes().len())]);
    for t in g.tensors() {
        let d = g.tensor_data(t);
        const S: usize = 4096;
        for start in [0, d.len().saturating_sub(S) / 2, d.len().saturating_sub(S)] {
            h.update(&d[start..(start + S).min(d.len())]);
        }
    }
    hex::encode(h.finalize())
}
