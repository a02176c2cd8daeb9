//! Whether this engine can serve a GGUF file, decided from its header alone (no weights
//! read): the architecture, every tensor's type, the tokenizer model and its
//! pre-tokenizer. Every missing piece is named with what is supported instead, in one
//! error, so that `--check-config` and the load tell a user everything at once.

use super::arch;
use crate::gguf::{Gguf, describe_type, supported_types};
use crate::tokenizer;
use crate::{Error, Result};

/// At most this many tensor names per unsupported type in the message.
const NAMES_SHOWN: usize = 3;

/// [`check`] of the file at `path` (its header is parsed; no weight is read).
pub fn check_file(path: &std::path::Path) -> Result<()> {
    check(&Gguf::open(path)?)
}

/// `Ok` when `g` can be served; else [`Error::Unsupported`] naming every reason.
pub fn check(g: &Gguf) -> Result<()> {
    let mut missing = Vec::new();
    match g.get("general.architecture").and_then(|v| v.as_str()) {
        Some(a) if arch::family(a).is_some() => {}
        Some(a) => missing.push(format!(
            "architecture '{a}' (general.architecture; supported: {})",
            arch::supported_architectures()
        )),
        None => missing.push("no general.architecture".into()),
    }
    // Unsupported tensor types, by type in the order first met.
    let mut by_type: Vec<(u32, Vec<&str>)> = Vec::new();
    for t in g.unsupported_tensors() {
        match by_type.iter_mut().find(|(id, _)| *id == t.type_id) {
            Some((_, names)) => names.push(&t.name),
            None => by_type.push((t.type_id, vec![&t.name])),
        }
    }
    if !by_type.is_empty() {
        let types: Vec<String> = by_type
            .iter()
            .map(|(id, names)| {
                let shown = names[..names.len().min(NAMES_SHOWN)].join(", ");
                let more = names.len().saturating_sub(NAMES_SHOWN);
                let more = if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                };
                format!(
                    "{} ({} tensor{}: {shown}{more})",
                    describe_type(*id),
                    names.len(),
                    if names.len() == 1 { "" } else { "s" }
                )
            })
            .collect();
        missing.push(format!(
            "tensor type{} {} (supported: {})",
            if types.len() == 1 { "" } else { "s" },
            types.join("; "),
            supported_types()
        ));
    }
    let model = g.get("tokenizer.ggml.model").and_then(|v| v.as_str());
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.as_str())
        .unwrap_or("gpt2");
    match model {
        Some(m) => {
            if let Err(e) = tokenizer::check_support(m, pre) {
                missing.push(e);
            }
        }
        None => missing.push("no tokenizer (tokenizer.ggml.model)".into()),
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::Unsupported(missing))
    }
}
