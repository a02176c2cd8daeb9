//! Helpers shared by the operator's integration tests: the repository, the cached model,
//! and the `tandem-dataplane` binary of this build.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::SystemTime;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

pub fn model() -> PathBuf {
    let dir = std::env::var_os("TANDEM_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".cache/models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "model {} not found: run `make model`",
        p.display()
    );
    p
}

pub fn newest_source(dir: &Path) -> SystemTime {
    let mut newest = SystemTime::UNIX_EPOCH;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(m) = e.metadata().and_then(|m| m.modified()) {
                newest = newest.max(m);
            }
        }
    }
    newest
}

/// The dataplane binary of this build, refusing a missing or stale one.
pub fn dataplane() -> PathBuf {
    let operator = PathBuf::from(env!("CARGO_BIN_EXE_tandem-operator"));
    let bin = operator.with_file_name("tandem-dataplane");
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| {
            panic!(
                "{} missing ({e}): run `cargo build -p tandem-dataplane --bin tandem-dataplane` (make test does)",
                bin.display()
            )
        });
    for src in ["dataplane/src", "kernels/src"] {
        assert!(
            newest_source(&repo().join(src)) <= built,
            "{} is older than {src}: run `cargo build -p tandem-dataplane --bin tandem-dataplane`",
            bin.display()
        );
    }
    bin
}
pub mod local;
