use super::writer::GgufWriter;
use super::*;
use proptest::prelude::*;

fn sample_values() -> Vec<(&'static str, GgufValue)> {
    vec![
        ("u8", GgufValue::U8(200)),
        ("i8", GgufValue::I8(-5)),
        ("u16", GgufValue::U16(65000)),
        ("i16", GgufValue::I16(-300)),
        ("u32", GgufValue::U32(4_000_000_000)),
        ("i32", GgufValue::I32(-70000)),
        ("u64", GgufValue::U64(u64::MAX - 1)),
        ("i64", GgufValue::I64(i64::MIN + 3)),
        ("f32", GgufValue::F32(1.5e-5)),
        ("f64", GgufValue::F64(-2.25e100)),
        ("bool", GgufValue::Bool(true)),
        ("string", GgufValue::String("héllo".into())),
        ("a.u8", GgufValue::Array(GgufArray::U8(vec![1, 2, 3]))),
        ("a.i32", GgufValue::Array(GgufArray::I32(vec![-1, 7]))),
        ("a.f32", GgufValue::Array(GgufArray::F32(vec![0.5, -0.25]))),
        (
            "a.bool",
            GgufValue::Array(GgufArray::Bool(vec![true, false])),
        ),
        (
            "a.str",
            GgufValue::Array(GgufArray::String(vec!["a".into(), "".into(), "ü".into()])),
        ),
        ("a.u64", GgufValue::Array(GgufArray::U64(vec![]))),
        (
            "a.nested",
            GgufValue::Array(GgufArray::Array(vec![
                GgufArray::I16(vec![1, -2]),
                GgufArray::String(vec!["x".into()]),
            ])),
        ),
    ]
}

fn sample_file(version: u32, alignment: Option<usize>) -> Vec<u8> {
    let mut w = GgufWriter::new().version(version);
    if let Some(a) = alignment {
        w = w.alignment(a);
    }
    for (k, v) in sample_values() {
        w.meta(k, v);
    }
    let f32s: Vec<u8> = (0..64).flat_map(|i| (i as f32).to_le_bytes()).collect();
    w.tensor("t.f32", &[16, 4], GgmlType::F32, f32s);
    w.tensor("t.q41", &[32, 2], GgmlType::Q4_1, vec![7; 40]);
    w.tensor("t.q80", &[64], GgmlType::Q8_0, vec![9; 68]);
    w.to_bytes()
}

#[test]
fn round_trips_every_value_type_in_v2_and_v3() {
    for version in [2, 3] {
        for alignment in [None, Some(64), Some(8)] {
            let g = Gguf::from_bytes(sample_file(version, alignment)).unwrap();
            assert_eq!(g.version(), version);
            assert_eq!(g.header().alignment, alignment.unwrap_or(32));
            for (k, v) in sample_values() {
                assert_eq!(g.get(k), Some(&v), "key {k}");
            }
            let t = g.tensor("t.f32").unwrap();
            assert_eq!(
                (t.dims.clone(), t.ty, t.n_bytes),
                (vec![16, 4], GgmlType::F32, 256)
            );
            assert_eq!(g.tensor_data(t)[4..8], 1f32.to_le_bytes());
            assert_eq!(g.header().data_offset % g.header().alignment, 0);
            for t in g.tensors() {
                assert_eq!(t.offset % g.header().alignment as u64, 0, "{}", t.name);
            }
            assert_eq!(g.tensor_data(g.tensor("t.q41").unwrap()), &[7u8; 40][..]);
            assert_eq!(g.tensor_data(g.tensor("t.q80").unwrap()), &[9u8; 68][..]);
        }
    }
}

#[test]
fn typed_getters_name_the_key() {
    let g = Gguf::from_bytes(sample_file(3, None)).unwrap();
    assert_eq!(g.get_usize("u16").unwrap(), 65000);
    assert_eq!(g.get_f32("f32").unwrap(), 1.5e-5);
    assert_eq!(g.get_str("string").unwrap(), "héllo");
    assert!(g.get_usize("i8").unwrap_err().to_string().contains("i8"));
    let e = g.get_usize("no.such.key").unwrap_err();
    assert_eq!(e, GgufError::MissingKey("no.such.key".into()));
    let e = g.get_str("u8").unwrap_err().to_string();
    assert!(e.contains("u8") && e.contains("string"), "{e}");
    assert!(g.tensor("nope").unwrap_err().to_string().contains("nope"));
}

fn err(bytes: Vec<u8>) -> GgufError {
    parse_header(&bytes).unwrap_err()
}

#[test]
fn rejects_bad_magic_and_versions() {
    let mut b = sample_file(3, None);
    b[0] = b'X';
    assert!(matches!(err(b), GgufError::BadMagic(_)));
    for v in [1u32, 4, 0x0300_0000] {
        let mut b = sample_file(3, None);
        b[4..8].copy_from_slice(&v.to_le_bytes());
        assert_eq!(err(b), GgufError::UnsupportedVersion(v));
    }
}

#[test]
fn every_truncation_is_an_error_naming_the_place() {
    let full = sample_file(3, None);
    let h = parse_header(&full).unwrap();
    let header_end = h.data_offset;
    let data_end = h
        .tensors
        .iter()
        .map(|t| header_end + t.offset as usize + t.n_bytes)
        .max()
        .unwrap();
    // Only the final tensor's alignment padding may be cut.
    assert!(parse_header(&full[..data_end]).is_ok());
    for n in 0..data_end {
        let e = parse_header(&full[..n]).expect_err(&format!("prefix of {n} bytes parsed"));
        let msg = e.to_string();
        if n >= header_end {
            // The header is intact; the data of some tensor is cut.
            assert!(msg.contains("tensor t."), "{n}: {msg}");
        } else {
            assert!(!msg.is_empty());
        }
    }
}

#[test]
fn hostile_counts_fail_without_allocating() {
    // Tensor count u64::MAX.
    let mut b = sample_file(3, None);
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(err(b), GgufError::BadCount { .. }));
    // An array claiming 2^60 strings.
    let mut w = GgufWriter::new();
    w.meta("big", GgufValue::Array(GgufArray::String(vec!["a".into()])));
    let mut b = w.to_bytes();
    let count_at = 24 + 8 + 3 + 4 + 4;
    b[count_at..count_at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    match err(b) {
        GgufError::BadCount { what, .. } => assert!(what.contains("big"), "{what}"),
        e => panic!("{e}"),
    }
    // A string length of 2^62.
    let mut w = GgufWriter::new();
    w.meta("s", GgufValue::String("abc".into()));
    let mut b = w.to_bytes();
    b[24 + 8 + 1 + 4..24 + 8 + 1 + 4 + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    assert!(err(b).to_string().contains("key s"));
}

#[test]
fn semantic_errors_name_key_or_tensor() {
    let mut w = GgufWriter::new();
    w.meta("k", GgufValue::U8(1)).meta("k", GgufValue::U8(2));
    assert_eq!(err(w.to_bytes()), GgufError::DuplicateKey("k".into()));

    let mut w = GgufWriter::new();
    w.meta("general.alignment", GgufValue::U32(24));
    assert!(err(w.to_bytes()).to_string().contains("general.alignment"));

    let mut w = GgufWriter::new();
    w.meta("weird", GgufValue::U8(1));
    let mut b = w.to_bytes();
    b[24 + 8 + 5..24 + 8 + 5 + 4].copy_from_slice(&99u32.to_le_bytes());
    assert_eq!(
        err(b),
        GgufError::BadValueType {
            key: "weird".into(),
            ty: 99
        }
    );

    let mut w = GgufWriter::new();
    w.meta("flag", GgufValue::Bool(true));
    let mut b = w.to_bytes();
    b[24 + 8 + 4 + 4] = 2;
    assert!(err(b).to_string().contains("flag"));

    // Nesting beyond the limit.
    let mut a = GgufArray::U8(vec![1]);
    for _ in 0..12 {
        a = GgufArray::Array(vec![a]);
    }
    let mut w = GgufWriter::new();
    w.meta("deep", GgufValue::Array(a));
    assert!(err(w.to_bytes()).to_string().contains("deep"));

    // A tensor type the kernels cannot read (IQ1_S = 19) parses, is listed, and reading
    // the tensor names it and its type by name; an id ggml never assigned reads as such.
    for (id, name) in [(19u32, "IQ1_S"), (77, "type 77")] {
        let mut w = GgufWriter::new();
        w.tensor("blk.0.x", &[32], GgmlType::Q8_0, vec![0; 34]);
        let mut b = w.to_bytes();
        let ty_at = 24 + 8 + 7 + 4 + 8;
        b[ty_at..ty_at + 4].copy_from_slice(&id.to_le_bytes());
        let g = Gguf::from_bytes(b).unwrap();
        assert_eq!(g.unsupported_tensors()[0].type_id, id);
        assert!(g.tensors().is_empty() && g.has_tensor("blk.0.x"));
        let e = g.tensor("blk.0.x").unwrap_err().to_string();
        assert!(
            e.contains("blk.0.x") && e.contains(name) && e.contains("Q8_0"),
            "{e}"
        );
    }

    // Row length not a multiple of the block size.
    let mut w = GgufWriter::new();
    w.tensor("odd", &[31], GgmlType::Q8_0, vec![0; 34]);
    assert!(err(w.to_bytes()).to_string().contains("odd"));

    // Duplicate tensor names.
    let mut w = GgufWriter::new();
    w.tensor("t", &[1], GgmlType::F32, vec![0; 4]);
    w.tensor("t", &[1], GgmlType::F32, vec![0; 4]);
    assert!(err(w.to_bytes()).to_string().contains("tensor t"));

    // Too many dims / overflowing dims.
    let mut w = GgufWriter::new();
    w.tensor("big", &[u64::MAX, 4], GgmlType::F32, vec![]);
    assert!(err(w.to_bytes()).to_string().contains("big"));
    let mut w = GgufWriter::new();
    w.tensor("five", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0; 4]);
    assert!(err(w.to_bytes()).to_string().contains("five"));
}

#[test]
fn misaligned_tensor_offset_is_rejected() {
    let mut w = GgufWriter::new();
    w.tensor("a", &[1], GgmlType::F32, vec![0; 4]);
    let mut b = w.to_bytes();
    let off_at = 24 + 8 + 1 + 4 + 8 + 4;
    b[off_at..off_at + 8].copy_from_slice(&4u64.to_le_bytes());
    assert!(err(b).to_string().contains("aligned"));
}

fn mutate(mut b: Vec<u8>, ops: &[(u8, usize, u8)]) -> Vec<u8> {
    for &(kind, pos, val) in ops {
        if b.is_empty() {
            break;
        }
        let p = pos % b.len();
        match kind % 4 {
            0 => b[p] = val,
            1 => b[p] ^= 1 << (val % 8),
            2 => b.truncate(p),
            _ => b.insert(p, val),
        }
    }
    b
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    /// Random bytes behind a valid magic and version never panic the parser.
    #[test]
    fn random_bytes_never_panic(version in 2u32..4, tail in proptest::collection::vec(any::<u8>(), 0..256)) {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&version.to_le_bytes());
        b.extend_from_slice(&tail);
        let _ = parse_header(&b);
    }

    /// Mutations of a valid file parse or fail cleanly; when they parse, every tensor
    /// lies inside the file.
    #[test]
    fn mutated_files_never_panic(
        version in 2u32..4,
        ops in proptest::collection::vec((any::<u8>(), any::<usize>(), any::<u8>()), 1..6),
    ) {
        let b = mutate(sample_file(version, None), &ops);
        if let Ok(h) = parse_header(&b) {
            for t in &h.tensors {
                prop_assert!(h.data_offset + t.offset as usize + t.n_bytes <= b.len());
            }
        }
    }
}

#[test]
fn reads_the_real_model() {
    let g = Gguf::open(&crate::test_support::model_path()).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_usize("llama.block_count").unwrap(), 30);
    assert_eq!(g.get_array("tokenizer.ggml.tokens").unwrap().len(), 49152);
    assert_eq!(g.tensors().len(), 272);
    assert_eq!(g.tensor("token_embd.weight").unwrap().ty, GgmlType::Q8_0);
    assert_eq!(g.tensor("blk.0.attn_q.weight").unwrap().ty, GgmlType::Q4_1);
    assert_eq!(g.tensor("output_norm.weight").unwrap().ty, GgmlType::F32);
    assert!(
        g.tensor("output.weight").is_err(),
        "SmolLM2 ties its output embedding"
    );
}

/// A repacked model drops the mapped pages of the tensors it copied; reading them again
/// still gives the file's bytes (they fault back in), and the pages leave the RSS.
#[test]
fn released_pages_read_back_unchanged_and_leave_the_rss() {
    let g = Gguf::open(&crate::test_support::model_path()).unwrap();
    let t = g.tensor("token_embd.weight").unwrap();
    let start = g.header().data_offset + t.offset as usize;
    let sum = |g: &Gguf| -> u64 { g.tensor_data(t).iter().map(|b| *b as u64).sum() };
    let mapped_rss_kb = || -> u64 {
        // This mapping's resident size, from the line after its address range.
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let base = g.bytes().as_ptr() as usize;
        let mut lines = smaps.lines();
        while let Some(l) = lines.next() {
            let range = l.split_whitespace().next().unwrap_or("");
            if let Some((a, _)) = range.split_once('-')
                && usize::from_str_radix(a, 16) == Ok(base)
            {
                return lines
                    .find_map(|l| l.strip_prefix("Rss:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                    .unwrap();
            }
        }
        panic!("mapping at {base:#x} not in smaps");
    };
    let before = sum(&g);
    let touched = mapped_rss_kb();
    assert!(
        touched * 1024 >= t.n_bytes as u64 / 2,
        "{touched} kB resident after reading"
    );
    g.release_pages(start, t.n_bytes).unwrap();
    let released = mapped_rss_kb();
    assert!(
        released * 1024 + t.n_bytes as u64 / 2 <= touched * 1024,
        "{touched} kB before, {released} kB after releasing {} bytes",
        t.n_bytes
    );
    assert_eq!(sum(&g), before, "the bytes fault back in unchanged");
    // Owned files have nothing to release.
    let owned =
        Gguf::from_bytes(std::fs::read(crate::test_support::model_path()).unwrap()).unwrap();
    owned.release_pages(start, t.n_bytes).unwrap();
}
