//! Names of every GGML tensor type a GGUF file may name by id (ggml's `ggml_type`), so that
//! a file this build cannot serve is refused with the type's name (`Q5_K`), not its number.

/// The GGML name of type id `id` (the kernels' table of what they read and what they do
/// not), or `None` for an id ggml never assigned (or removed).
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    tandem_kernels::GgmlType::name_of_id(id)
}

/// `Q5_K` for a known id, `type 99` otherwise.
pub fn describe_type(id: u32) -> String {
    match ggml_type_name(id) {
        Some(n) => n.to_string(),
        None => format!("type {id}"),
    }
}

/// The tensor types this build's kernels read, in GGUF id order, for refusals.
pub fn supported_types() -> String {
    let mut ids: Vec<u32> = tandem_kernels::GgmlType::ALL
        .iter()
        .map(|t| t.id())
        .collect();
    ids.sort_unstable();
    ids.iter()
        .map(|&id| describe_type(id))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_kernels::GgmlType;

    #[test]
    fn every_kernel_type_has_its_ggml_name_and_unknown_ids_say_so() {
        for t in GgmlType::ALL {
            assert_eq!(ggml_type_name(t.id()), Some(t.name()), "{t}");
        }
        assert_eq!(describe_type(6), "Q5_0");
        assert_eq!(describe_type(14), "Q6_K");
        assert_eq!(describe_type(4), "type 4");
        let s = supported_types();
        assert!(s.starts_with("F32, F16") && s.contains("Q8_0"), "{s}");
    }
}
