//! The scalar reference of every block-quantized format against gguf-py's numpy
//! implementation (an independent one), through the fixtures `scripts/quant_reference.py`
//! generated (`make kernel-fixtures-check` keeps them equal to what it generates):
//! dequantization bit for bit, activation quantization bit for bit, and the integer dot
//! product within float rounding of the exactly rounded dot of the dequantized operands.
//! The optimized CPU kernels, at every tier this machine runs, are held against the same
//! dots (and against the scalar reference, bit for bit, on many more shapes in
//! `equivalence.rs`, which also says which tiers it skipped).

use serde_json::Value;
use tandem_kernels::{
    ActFormat, ActRow, BlockQ8, BlockQ8K, CpuKernels, GgmlType, Kernels, Matrix, SimdTier,
    dequantize_row, quantize_act_row, quantize_act_row_k, vec_dot,
};

const FIXTURE: &str = include_str!("fixtures/quant_reference.json");

fn hex(v: &Value) -> Vec<u8> {
    let s = v.as_str().expect("hex string");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    hex(v)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn cases() -> Vec<Value> {
    let v: Value = serde_json::from_str(FIXTURE).unwrap();
    v["types"].as_array().unwrap().clone()
}

fn ty_of(case: &Value) -> GgmlType {
    let ty = GgmlType::from_id(case["id"].as_u64().unwrap() as u32).unwrap();
    assert_eq!(ty.name(), case["type"].as_str().unwrap());
    ty
}

#[test]
fn every_quantized_type_has_a_fixture() {
    let names: Vec<String> = cases()
        .iter()
        .map(|c| c["type"].as_str().unwrap().to_string())
        .collect();
    for ty in GgmlType::ALL.into_iter().filter(|t| t.is_quantized()) {
        assert!(names.iter().any(|n| n == ty.name()), "no fixture for {ty}");
    }
}

#[test]
fn dequantization_equals_gguf_py_bit_for_bit() {
    for case in cases() {
        let ty = ty_of(&case);
        let (w, want) = (hex(&case["weights"]), f32s(&case["values"]));
        let mut got = vec![f32::NAN; want.len()];
        dequantize_row(ty, &w, &mut got).unwrap();
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{ty} element {i}: gguf-py {a}, ours {b}"
            );
        }
    }
}

/// The activations as the fixture quantized them, and ours.
fn activations(case: &Value, ty: GgmlType) -> (Vec<BlockQ8>, Vec<BlockQ8K>) {
    let x = f32s(&case["x"]);
    let act = &case["act"];
    let (d, qs) = (f32s(&act["d"]), hex(&act["qs"]));
    match ty.act_format().unwrap() {
        ActFormat::Q8 => {
            assert_eq!(act["format"], "Q8");
            let mut ours = vec![BlockQ8::default(); x.len() / 32];
            quantize_act_row(&x, &mut ours).unwrap();
            let s = f32s(&act["s"]);
            for (b, blk) in ours.iter().enumerate() {
                let codes: Vec<u8> = blk.qs.iter().map(|q| *q as u8).collect();
                assert_eq!(codes, qs[32 * b..32 * b + 32], "{ty} block {b} codes");
                assert_eq!(blk.d.to_bits(), d[b].to_bits(), "{ty} block {b} d");
                assert_eq!(blk.s.to_bits(), s[b].to_bits(), "{ty} block {b} s");
            }
            (ours, Vec::new())
        }
        ActFormat::Q8K => {
            assert_eq!(act["format"], "Q8K");
            let mut ours = vec![BlockQ8K::default(); x.len() / 256];
            quantize_act_row_k(&x, &mut ours).unwrap();
            let sums: Vec<i16> = hex(&act["bsums"])
                .chunks_exact(2)
                .map(|b| i16::from_le_bytes([b[0], b[1]]))
                .collect();
            for (b, blk) in ours.iter().enumerate() {
                let codes: Vec<u8> = blk.qs.iter().map(|q| *q as u8).collect();
                assert_eq!(codes, qs[256 * b..256 * b + 256], "{ty} block {b} codes");
                assert_eq!(blk.d.to_bits(), d[b].to_bits(), "{ty} block {b} d");
                assert_eq!(blk.bsums, sums[16 * b..16 * b + 16], "{ty} block {b} sums");
            }
            (Vec::new(), ours)
        }
    }
}

#[test]
fn activation_quantization_equals_the_numpy_definition() {
    for case in cases() {
        let ty = ty_of(&case);
        activations(&case, ty);
    }
}

/// |ours − exact| ≤ 1e-5 · Σ|w·a| + 1e-6: a few f32 roundings per block (the integer part
/// is exact), far below that.
fn close(ty: GgmlType, what: &str, got: f32, case: &Value) {
    let (want, mag) = (case["dot"].as_f64().unwrap(), case["mag"].as_f64().unwrap());
    let err = (got as f64 - want).abs();
    assert!(
        err <= 1e-5 * mag + 1e-6,
        "{ty} {what}: {got} vs exact {want} (error {err:.3e}, Σ|w·a| {mag:.3e})"
    );
}

#[test]
fn dot_products_equal_the_exact_dot_of_the_dequantized_operands() {
    for case in cases() {
        let ty = ty_of(&case);
        let (a8, a8k) = activations(&case, ty);
        let act = match ty.act_format().unwrap() {
            ActFormat::Q8 => ActRow::Q8(&a8),
            ActFormat::Q8K => ActRow::Q8K(&a8k),
        };
        let w = hex(&case["weights"]);
        close(ty, "scalar reference", vec_dot(ty, &w, act), &case);
    }
}

#[test]
fn optimized_kernels_reach_the_same_dots() {
    for case in cases() {
        let ty = ty_of(&case);
        let (w, x) = (hex(&case["weights"]), f32s(&case["x"]));
        let m = Matrix::new(ty, 1, x.len(), &w).unwrap();
        let tiers = SimdTier::ALL.into_iter();
        for k in tiers.filter_map(|t| CpuKernels::with_simd(true).with_tier(t)) {
            let packed = m.to_rows8().unwrap();
            let p = Matrix::with_layout(ty, 1, x.len(), &packed, tandem_kernels::Layout::Rows8)
                .unwrap();
            for w in [m, p] {
                let mut out = [f32::NAN];
                k.matmul(&[w], &x, 1, &mut [&mut out[..]]).unwrap();
                close(ty, &format!("{} {:?}", k.name(), w.layout), out[0], &case);
            }
        }
    }
}
