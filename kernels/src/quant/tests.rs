use super::*;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

#[test]
fn round_trip_error_is_bounded_per_type() {
    let mut seed = 7;
    let x: Vec<f32> = (0..256).map(|_| lcg(&mut seed) * 3.0).collect();
    // Worst-case absolute error of each format for values in [-3, 3].
    for (ty, tol) in [
        (GgmlType::F32, 0.0),
        (GgmlType::F16, 3.0 / 1024.0),
        (GgmlType::BF16, 3.0 / 128.0),
        (GgmlType::Q8_0, 3.0 / 127.0),
        // The code opposite the extreme clamps at 15, one step short: error up to d.
        (GgmlType::Q4_0, 3.0 / 8.0 + 1e-3),
        (GgmlType::Q4_1, 6.0 / 15.0 * 0.5 + 3e-3),
        (GgmlType::Q5_0, 3.0 / 16.0 + 1e-3),
        (GgmlType::Q5_1, 6.0 / 31.0 * 0.5 + 3e-3),
        // Sub-block steps rounded up to 6-bit multiples of d = max step / 63, the min
        // rounded up likewise: half a step of at most range/qmax + d, plus f16 rounding.
        (
            GgmlType::Q4_K,
            (6.0 / 15.0 + 6.0 / 15.0 / 63.0) * 0.5 + 3e-3,
        ),
        (
            GgmlType::Q5_K,
            (6.0 / 31.0 + 6.0 / 31.0 / 63.0) * 0.5 + 3e-3,
        ),
        // As Q4_0: a step of |max| / 32 per 16 elements on the side opposite the extreme
        // (code 63 is one short of +32 steps), plus the clamp of the extreme when its i8
        // scale rounds down: 32 · d / 2 with d = (3/32) / 127.
        (
            GgmlType::Q6_K,
            3.0 / 32.0 + 16.0 * 3.0 / 32.0 / 127.0 + 1e-3,
        ),
    ] {
        let mut bytes = vec![0u8; ty.row_bytes(x.len()).unwrap()];
        quantize_row(ty, &x, &mut bytes).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize_row(ty, &bytes, &mut y).unwrap();
        let err = x
            .iter()
            .zip(&y)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err <= tol, "{ty}: max error {err} > {tol}");
    }
}

#[test]
fn layouts_match_gguf_definition() {
    // Q4_0: d = 1.0, low nibble of byte j = element j, high nibble = element j+16.
    let mut b = vec![0u8; 18];
    b[..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
    b[2] = 0x9a; // element 0 = 0xa - 8 = 2, element 16 = 0x9 - 8 = 1
    let mut y = [0f32; 32];
    dequantize_row(GgmlType::Q4_0, &b, &mut y).unwrap();
    assert_eq!((y[0], y[16], y[1]), (2.0, 1.0, -8.0));
    // Q4_1: d = 0.5, m = -1.0.
    let mut b = vec![0u8; 20];
    b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
    b[2..4].copy_from_slice(&half::f16::from_f32(-1.0).to_bits().to_le_bytes());
    b[4 + 3] = 0x4f;
    let mut y = [0f32; 32];
    dequantize_row(GgmlType::Q4_1, &b, &mut y).unwrap();
    assert_eq!((y[3], y[19], y[0]), (6.5, 1.0, -1.0));
    // Q8_0: d = 0.25, signed bytes.
    let mut b = vec![0u8; 34];
    b[..2].copy_from_slice(&half::f16::from_f32(0.25).to_bits().to_le_bytes());
    b[2 + 5] = (-4i8) as u8;
    let mut y = [0f32; 32];
    dequantize_row(GgmlType::Q8_0, &b, &mut y).unwrap();
    assert_eq!((y[5], y[0]), (-1.0, 0.0));
}

#[test]
fn integer_dot_approximates_float_dot() {
    let mut seed = 11;
    let n = 512;
    let w: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
    let x: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
    let mut act = vec![BlockQ8::default(); n / QK];
    quantize_act_row(&x, &mut act).unwrap();
    let mut act_k = vec![BlockQ8K::default(); n / QK_K];
    quantize_act_row_k(&x, &mut act_k).unwrap();
    for ty in GgmlType::ALL.into_iter().filter(|t| t.is_quantized()) {
        let mut bytes = vec![0u8; ty.row_bytes(n).unwrap()];
        quantize_row(ty, &w, &mut bytes).unwrap();
        let mut wd = vec![0f32; n];
        dequantize_row(ty, &bytes, &mut wd).unwrap();
        let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
        let got = match ty.act_format().unwrap() {
            crate::ActFormat::Q8 => vec_dot_q8(ty, &bytes, &act),
            crate::ActFormat::Q8K => vec_dot_q8k(ty, &bytes, &act_k),
        };
        // Activation quantization error: |Σ w·e| with |e| ≤ d/2 = amax/254 per element
        // (|x| ≤ 1 here, whatever the block size).
        let bound: f32 = wd.iter().map(|v| v.abs()).sum::<f32>() / 254.0;
        assert!(
            (exact - got).abs() <= bound,
            "{ty}: {exact} vs {got} (bound {bound})"
        );
    }
}

#[test]
fn q8k_blocks_sum_their_codes_and_use_ggml_scale() {
    let mut seed = 3;
    let mut x: Vec<f32> = (0..2 * QK_K).map(|_| lcg(&mut seed) * 4.0).collect();
    x[300] = -9.5; // the extreme of block 1 is negative
    x[QK_K..QK_K + 16].fill(0.0);
    let mut a = vec![BlockQ8K::default(); 2];
    quantize_act_row_k(&x, &mut a).unwrap();
    let id = 127.0f32 / 9.5;
    assert_eq!(a[1].d.to_bits(), (1.0 / id).to_bits());
    assert_eq!(a[1].qs[300 - QK_K], -127);
    assert_eq!(a[1].bsums[0], 0);
    for blk in &a {
        for (s, qs) in blk.bsums.iter().zip(blk.qs.chunks_exact(16)) {
            assert_eq!(*s as i32, qs.iter().map(|q| *q as i32).sum::<i32>());
        }
    }
    for (i, v) in x.iter().enumerate() {
        let (b, q) = (&a[i / QK_K], a[i / QK_K].qs[i % QK_K] as f32);
        assert!((q * b.d - v).abs() <= b.d * 0.5 + 1e-6, "element {i}");
    }
    let mut zero = [BlockQ8K::default()];
    quantize_act_row_k(&[0.0; QK_K], &mut zero).unwrap();
    assert_eq!(
        (zero[0].d, zero[0].qs, zero[0].bsums),
        (0.0, [0; QK_K], [0; 16])
    );
}

#[test]
fn kquant_scales_unpack_the_six_bit_layout() {
    // sc = 1..8, m = 63, 62, ..: every high-bit position used.
    let sc: [u8; 8] = [1, 2, 3, 4, 45, 50, 60, 63];
    let m: [u8; 8] = [63, 62, 33, 0, 17, 48, 31, 32];
    let mut b = [0u8; 12];
    kquants::put_kquant_scales(&mut b, &sc, &m);
    assert_eq!(kquant_scales(&b), (sc, m));
    // Byte 8 = low nibble of sc4 | low nibble of m4 << 4; byte 0's top bits = sc4 >> 4.
    assert_eq!(b[8], (45 & 15) | ((17 & 15) << 4));
    assert_eq!(b[0] >> 6, 45 >> 4);
    assert_eq!(b[4] >> 6, 17 >> 4);
}

#[test]
fn rounding_is_half_to_even_and_clamped() {
    for (v, q) in [
        (0.5, 0),
        (1.5, 2),
        (2.5, 2),
        (-0.5, 0),
        (-1.5, -2),
        (126.5, 126),
        (200.0, 127),
        (-1e9, -127),
        (0.49999997, 0),
        (3.7, 4),
    ] {
        assert_eq!(round_q8(v), q, "{v}");
    }
    let mut seed = 5;
    for _ in 0..10000 {
        let v = lcg(&mut seed) * 130.0;
        assert_eq!(
            round_q8(v) as f32,
            v.round_ties_even().clamp(-127.0, 127.0),
            "{v}"
        );
    }
}

#[test]
fn shape_errors_are_reported() {
    let mut y = [0f32; 31];
    assert!(dequantize_row(GgmlType::Q8_0, &[0; 34], &mut y).is_err());
    let mut out = [BlockQ8::default(); 1];
    assert!(quantize_act_row(&[0.0; 33], &mut out).is_err());
    let mut out = [BlockQ8K::default(); 1];
    assert!(quantize_act_row_k(&[0.0; 288], &mut out).is_err());
    let mut y = [0f32; 288];
    assert_eq!(
        dequantize_row(GgmlType::Q4_K, &[0; 144], &mut y).unwrap_err(),
        crate::Error::RowNotBlockAligned {
            ty: "Q4_K",
            len: 288,
            block: 256
        }
    );
}
