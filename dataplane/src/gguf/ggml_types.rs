//! Names of every GGML tensor type a GGUF file may name by id (ggml's `ggml_type`), so that
//! a file this build cannot serve is refused with the type's name (`Q5_K`), not its number.

/// The GGML name of type id `id`, or `None` for an id ggml never assigned (or removed).
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        40 => "NVFP4",
        41 => "Q1_0",
        42 => "Q2_0",
        _ => return None,
    })
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
