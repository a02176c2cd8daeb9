//! Helpers for unit tests that need the real model or the Python reference tools.

pub mod fake_runner;
pub mod http_client;

use std::path::PathBuf;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("dataplane/ has a parent")
        .to_path_buf()
}

/// The real SmolLM2 GGUF. Panics (fails the test) when it is missing: a missing model must
/// never turn into a silently skipped test.
pub fn model_path() -> PathBuf {
    let dir = std::env::var_os("TANDEM_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".cache/models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "model {} not found: run `make model` (or set TANDEM_MODEL_DIR)",
        p.display()
    );
    p
}

pub fn python() -> String {
    std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| {
        let venv = repo_root().join(".venv/bin/python");
        if venv.is_file() {
            venv.display().to_string()
        } else {
            "python3".into()
        }
    })
}
