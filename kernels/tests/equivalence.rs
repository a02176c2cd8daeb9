//! Every optimized path must agree with the scalar reference on random inputs.
//!
//! Quantized products are bit-identical to the reference: the integer work per block is
//! exact and every kernel runs the reference's float steps (`crate::quant::Terms`: one
//! fma per block per term, in block order) on its lanes. Float weights are multiplied in
//! another summation order, so they agree to 1e-5 of Σ|w·x| (the scale of the rounding
//! error of any order). Attention and norms: 1e-5 absolute on values of order 1.

use tandem_kernels::{
    AttnQuery, AttnShape, CpuKernels, GgmlType, Kernels, KvView, Layout, Matrix, RopeStyle,
    RopeTable, ScalarKernels, SimdTier, dequantize_row, quantize_row,
};

struct Rng(u64);
impl Rng {
    fn f(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

/// The CPU backend at every tier this machine runs (one line, once, per tier it lacks).
fn backends() -> Vec<(&'static str, Box<dyn Kernels>)> {
    static SKIPS: std::sync::Once = std::sync::Once::new();
    let mut out: Vec<(&'static str, Box<dyn Kernels>)> = Vec::new();
    for tier in SimdTier::ALL {
        match CpuKernels::with_simd(true).with_tier(tier) {
            Some(k) => out.push((k.name(), Box::new(k))),
            None => SKIPS.call_once(|| {
                for t in SimdTier::ALL.into_iter().filter(|t| !t.available()) {
                    eprintln!("skipped: this CPU has no {t}, so the {t} kernels were not compared");
                }
            }),
        }
    }
    out
}

/// `cols` rounded up to whole blocks of `ty` (the K-quants' rows are multiples of 256).
fn fit(ty: GgmlType, cols: usize) -> usize {
    cols.next_multiple_of(ty.block_len())
}

fn encode(ty: GgmlType, rows: usize, cols: usize, w: &[f32]) -> Vec<u8> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut bytes = vec![0u8; rows * rb];
    for r in 0..rows {
        quantize_row(
            ty,
            &w[r * cols..(r + 1) * cols],
            &mut bytes[r * rb..(r + 1) * rb],
        )
        .unwrap();
    }
    bytes
}

#[test]
fn simd_detected_on_this_machine_when_available() {
    // Not an equivalence check: documents which path the other tests exercised.
    eprintln!("optimized backend: {:?}", CpuKernels::new());
}

#[test]
fn matmul_matches_reference_for_every_type_and_batch_size() {
    let mut rng = Rng(42);
    let ks = backends();
    for ty in GgmlType::ALL {
        for &(rows, cols) in &[(37usize, 64usize), (130, 576), (8, 1536)] {
            let cols = fit(ty, cols);
            let w = rng.vec(rows * cols, 0.5);
            let bytes = encode(ty, rows, cols, &w);
            let m = Matrix::new(ty, rows, cols, &bytes).unwrap();
            let mut deq = vec![0f32; rows * cols];
            for r in 0..rows {
                dequantize_row(ty, &m.row(r), &mut deq[r * cols..(r + 1) * cols]).unwrap();
            }
            for n_tok in [1usize, 2, 3, 4, 5, 8, 9, 16, 17, 24, 29, 33, 35] {
                let x = rng.vec(n_tok * cols, 2.0);
                let mut want = vec![0f32; n_tok * rows];
                ScalarKernels
                    .matmul(&[m], &x, n_tok, &mut [&mut want])
                    .unwrap();
                for (name, k) in &ks {
                    let mut got = vec![f32::NAN; n_tok * rows];
                    k.matmul(&[m], &x, n_tok, &mut [&mut got]).unwrap();
                    for t in 0..n_tok {
                        for r in 0..rows {
                            let (a, b) = (want[t * rows + r], got[t * rows + r]);
                            if ty.is_quantized() {
                                assert_eq!(
                                    a.to_bits(),
                                    b.to_bits(),
                                    "{name} {ty} {rows}x{cols} T={n_tok} t={t} r={r}: {a} vs {b}"
                                );
                                continue;
                            }
                            let mag: f32 = (0..cols)
                                .map(|c| (deq[r * cols + c] * x[t * cols + c]).abs())
                                .sum();
                            assert!(
                                (a - b).abs() <= 1e-5 * mag + 1e-6,
                                "{name} {ty} {rows}x{cols} T={n_tok} t={t} r={r}: {a} vs {b} (mag {mag})"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Every token of a batch gets exactly the bits it gets alone (batched decoding must
/// reproduce sequential decoding), for every tile shape and remainder of the batch kernel.
#[test]
fn batched_matmul_is_bit_identical_to_single_token() {
    let mut rng = Rng(23);
    let ks = backends();
    for ty in GgmlType::ALL {
        for &(rows, cols) in &[(37usize, 64usize), (130, 576), (16, 1536)] {
            let cols = fit(ty, cols);
            let w = rng.vec(rows * cols, 0.5);
            let bytes = encode(ty, rows, cols, &w);
            let m = Matrix::new(ty, rows, cols, &bytes).unwrap();
            // Tiles span 1 or 4 groups of 8 tokens: full, partial last group, remainders;
            // and both sides of every type's switch from the single-token kernel (3/4,
            // 4/5, 5/6, 8/9 tokens).
            for n_tok in [2usize, 3, 4, 5, 6, 7, 8, 9, 16, 17, 23, 29, 32, 35, 40] {
                let x = rng.vec(n_tok * cols, 2.0);
                for (name, k) in &ks {
                    let mut batch = vec![f32::NAN; n_tok * rows];
                    k.matmul(&[m], &x, n_tok, &mut [&mut batch]).unwrap();
                    for t in 0..n_tok {
                        let mut one = vec![f32::NAN; rows];
                        k.matmul(&[m], &x[t * cols..(t + 1) * cols], 1, &mut [&mut one])
                            .unwrap();
                        let got = &batch[t * rows..(t + 1) * rows];
                        for r in 0..rows {
                            assert_eq!(
                                got[r].to_bits(),
                                one[r].to_bits(),
                                "{name} {ty} {rows}x{cols} T={n_tok} t={t} r={r}: {} vs {}",
                                got[r],
                                one[r]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// One call with matrices whose types switch to the tiled kernel at different batch
/// sizes (one input quantized both per token and interleaved): every token of every
/// matrix gets the bits it gets alone.
#[test]
fn one_call_mixing_kernels_gives_every_matrix_its_own_bits() {
    let mut rng = Rng(31);
    let cols = 512;
    let types = [
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q4_1,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];
    let bytes: Vec<Vec<u8>> = types
        .iter()
        .map(|&ty| encode(ty, 24, cols, &rng.vec(24 * cols, 0.5)))
        .collect();
    let ms: Vec<Matrix> = types
        .iter()
        .zip(&bytes)
        .map(|(&ty, b)| Matrix::new(ty, 24, cols, b).unwrap())
        .collect();
    for n_tok in [4usize, 5, 6, 8, 9] {
        let x = rng.vec(n_tok * cols, 2.0);
        for (name, k) in &backends() {
            let mut outs = vec![vec![f32::NAN; n_tok * 24]; ms.len()];
            let mut views: Vec<&mut [f32]> = outs.iter_mut().map(|o| &mut o[..]).collect();
            k.matmul(&ms, &x, n_tok, &mut views).unwrap();
            for (j, m) in ms.iter().enumerate() {
                for t in 0..n_tok {
                    let mut one = vec![f32::NAN; 24];
                    k.matmul(&[*m], &x[t * cols..(t + 1) * cols], 1, &mut [&mut one])
                        .unwrap();
                    let got: Vec<u32> = outs[j][t * 24..(t + 1) * 24]
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    let want: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{name} {} T={n_tok} t={t}", types[j]);
                }
            }
        }
    }
}

#[test]
fn matmul_of_several_matrices_shares_one_input() {
    let mut rng = Rng(9);
    let cols = 96;
    let (wa, wb) = (rng.vec(40 * cols, 1.0), rng.vec(24 * cols, 1.0));
    let (ba, bb) = (
        encode(GgmlType::Q4_1, 40, cols, &wa),
        encode(GgmlType::F16, 24, cols, &wb),
    );
    let ma = Matrix::new(GgmlType::Q4_1, 40, cols, &ba).unwrap();
    let mb = Matrix::new(GgmlType::F16, 24, cols, &bb).unwrap();
    let x = rng.vec(3 * cols, 1.0);
    for (_, k) in backends() {
        let (mut oa, mut ob) = (vec![0f32; 3 * 40], vec![0f32; 3 * 24]);
        k.matmul(&[ma, mb], &x, 3, &mut [&mut oa, &mut ob]).unwrap();
        let (mut ra, mut rb) = (vec![0f32; 3 * 40], vec![0f32; 3 * 24]);
        ScalarKernels.matmul(&[ma], &x, 3, &mut [&mut ra]).unwrap();
        ScalarKernels.matmul(&[mb], &x, 3, &mut [&mut rb]).unwrap();
        for (a, b) in oa.iter().zip(&ra).chain(ob.iter().zip(&rb)) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }
}

/// Weights repacked 8 rows at a time ([`Layout::Rows8`], what the CPU backend multiplies
/// when it has SIMD) give every backend exactly the bits of the GGUF rows: the same blocks
/// in the same order, only read from other addresses. Row counts cover whole groups,
/// padded last groups and a single row; token counts the single-token kernel, every
/// batch tile remainder, and several matrices of both layouts in one call.
#[test]
fn rows8_weights_give_the_bits_of_gguf_rows() {
    let mut rng = Rng(77);
    let mut all: Vec<(&'static str, Box<dyn Kernels>)> = backends();
    all.push(("scalar", Box::new(ScalarKernels)));
    let simd = CpuKernels::with_simd(true);
    for ty in GgmlType::ALL.into_iter().filter(|t| t.is_quantized()) {
        let want = if simd.has_simd() {
            Layout::Rows8
        } else {
            Layout::Gguf
        };
        assert_eq!(simd.weight_layout(ty), want, "{ty}");
        for &(rows, cols) in &[(1usize, 64usize), (13, 64), (40, 576), (37, 1536)] {
            let cols = fit(ty, cols);
            let bytes = encode(ty, rows, cols, &rng.vec(rows * cols, 0.5));
            let m = Matrix::new(ty, rows, cols, &bytes).unwrap();
            let packed = m.to_rows8().unwrap();
            let p = Matrix::with_layout(ty, rows, cols, &packed, Layout::Rows8).unwrap();
            let other = encode(ty, 24, cols, &rng.vec(24 * cols, 0.5));
            let o = Matrix::new(ty, 24, cols, &other).unwrap();
            for n_tok in [1usize, 2, 5, 8, 9, 17, 33] {
                let x = rng.vec(n_tok * cols, 2.0);
                for (name, k) in &all {
                    let run = |w: Matrix<'_>| {
                        let (mut a, mut b) = (vec![f32::NAN; n_tok * rows], vec![0f32; n_tok * 24]);
                        k.matmul(&[w, o], &x, n_tok, &mut [&mut a, &mut b]).unwrap();
                        (a, b)
                    };
                    let ((g, go), (q, qo)) = (run(m), run(p));
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&g), bits(&q), "{name} {ty} {rows}x{cols} T={n_tok}");
                    assert_eq!(bits(&go), bits(&qo), "{name} {ty}: the other matrix");
                }
            }
        }
    }
}

/// A matrix without columns multiplies to zeros on every backend (a sum over nothing), in
/// both layouts and for one token and a batch, instead of panicking.
#[test]
fn matmul_of_a_matrix_without_columns_is_zero() {
    let mut all: Vec<(&'static str, Box<dyn Kernels>)> = backends();
    all.push(("scalar", Box::new(ScalarKernels)));
    for ty in GgmlType::ALL {
        let m = Matrix::new(ty, 13, 0, &[]).unwrap();
        let packed = m.to_rows8();
        let layouts = [
            Some(m),
            packed
                .as_deref()
                .map(|p| Matrix::with_layout(ty, 13, 0, p, Layout::Rows8).unwrap()),
        ];
        for w in layouts.into_iter().flatten() {
            for n_tok in [1usize, 2, 9] {
                for (name, k) in &all {
                    let mut out = vec![f32::NAN; 13 * n_tok];
                    k.matmul(&[w], &[], n_tok, &mut [&mut out]).unwrap();
                    assert!(
                        out.iter().all(|v| *v == 0.0),
                        "{name} {ty} {:?} T={n_tok}: {out:?}",
                        w.layout
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_rejects_bad_shapes() {
    let bytes = vec![0u8; 4 * 20];
    let m = Matrix::new(GgmlType::Q4_1, 4, 32, &bytes).unwrap();
    assert!(Matrix::new(GgmlType::Q4_1, 5, 32, &bytes).is_err());
    assert!(Matrix::new(GgmlType::Q4_1, 1, 31, &bytes[..20]).is_err());
    for (_, k) in backends() {
        let mut out = vec![0f32; 3];
        assert!(k.matmul(&[m], &[0.0; 32], 1, &mut [&mut out]).is_err());
        let mut out = vec![0f32; 4];
        assert!(k.matmul(&[m], &[0.0; 33], 1, &mut [&mut out]).is_err());
    }
}

/// A paged pool holding one sequence of `n` tokens in shuffled blocks, and the dense
/// f32 values it stores (after the storage type's rounding).
fn paged(
    rng: &mut Rng,
    ty: GgmlType,
    n: usize,
    kv_dim: usize,
    bt: usize,
) -> (Vec<u8>, Vec<u32>, Vec<f32>) {
    let n_blocks = n.div_ceil(bt) + 3;
    let rb = ty.row_bytes(kv_dim).unwrap();
    let mut pool = vec![0u8; n_blocks * bt * rb];
    let mut table: Vec<u32> = (0..n_blocks as u32).rev().collect();
    table.rotate_left(2);
    let mut dense = vec![0f32; n * kv_dim];
    for p in 0..n {
        let vals = rng.vec(kv_dim, 1.5);
        let off = (table[p / bt] as usize * bt + p % bt) * rb;
        quantize_row(ty, &vals, &mut pool[off..off + rb]).unwrap();
        dequantize_row(
            ty,
            &pool[off..off + rb],
            &mut dense[p * kv_dim..(p + 1) * kv_dim],
        )
        .unwrap();
    }
    (pool, table, dense)
}

#[test]
fn attention_matches_dense_math_and_reference() {
    let mut rng = Rng(5);
    let s = AttnShape {
        n_heads: 6,
        n_kv_heads: 2,
        head_dim: 64,
        window: None,
    };
    let (bt, n) = (16, 45);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0] {
        let (kp, table, kd) = paged(&mut rng, ty, n, s.kv_dim(), bt);
        let (vp, _, vd) = {
            // V uses the same block table; rebuild its pool with that table.
            let rb = ty.row_bytes(s.kv_dim()).unwrap();
            let mut pool = vec![0u8; kp.len()];
            let mut dense = vec![0f32; n * s.kv_dim()];
            for p in 0..n {
                let vals = rng.vec(s.kv_dim(), 1.0);
                let off = (table[p / bt] as usize * bt + p % bt) * rb;
                quantize_row(ty, &vals, &mut pool[off..off + rb]).unwrap();
                dequantize_row(
                    ty,
                    &pool[off..off + rb],
                    &mut dense[p * s.kv_dim()..(p + 1) * s.kv_dim()],
                )
                .unwrap();
            }
            (pool, (), dense)
        };
        // Three query tokens at different causal depths.
        let ctxs = [1usize, 17, 45];
        let queries: Vec<AttnQuery> = ctxs
            .iter()
            .map(|&c| AttnQuery {
                block_table: &table,
                n_ctx: c,
            })
            .collect();
        let q = rng.vec(ctxs.len() * s.q_dim(), 1.0);
        let kv = |d: &'static str, p: &[u8]| -> Vec<u8> {
            let _ = d;
            p.to_vec()
        };
        let (kp, vp) = (kv("k", &kp), kv("v", &vp));
        let k = KvView {
            ty,
            data: &kp,
            block_tokens: bt,
        };
        let v = KvView {
            ty,
            data: &vp,
            block_tokens: bt,
        };
        let mut want = vec![0f32; q.len()];
        ScalarKernels
            .attention(&s, &q, &queries, &k, &v, &mut want)
            .unwrap();
        // Dense math straight from the definition.
        for (qi, &c) in ctxs.iter().enumerate() {
            for h in 0..s.n_heads {
                let g = h / s.group();
                let qh = &q[(qi * s.n_heads + h) * 64..][..64];
                let sc: Vec<f64> = (0..c)
                    .map(|t| {
                        (0..64)
                            .map(|i| (qh[i] * kd[t * s.kv_dim() + g * 64 + i]) as f64)
                            .sum::<f64>()
                            / 8.0
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                for i in 0..64 {
                    let o: f64 = (0..c)
                        .map(|t| (sc[t] - mx).exp() / z * vd[t * s.kv_dim() + g * 64 + i] as f64)
                        .sum();
                    let got = want[(qi * s.n_heads + h) * 64 + i];
                    assert!((o - got as f64).abs() < 1e-4, "{ty} dense {o} vs ref {got}");
                }
            }
        }
        for (name, kern) in backends() {
            let mut got = vec![0f32; q.len()];
            kern.attention(&s, &q, &queries, &k, &v, &mut got).unwrap();
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert!((a - b).abs() < 1e-5, "{name} {ty} at {i}: {a} vs {b}");
            }
        }
        // A block id outside the pool is an error, not an out-of-bounds read.
        let bad = vec![u32::MAX; 4];
        let bq = [AttnQuery {
            block_table: &bad,
            n_ctx: 3,
        }];
        let mut o = vec![0f32; s.q_dim()];
        assert!(
            ScalarKernels
                .attention(&s, &q[..s.q_dim()], &bq, &k, &v, &mut o)
                .is_err()
        );
        assert!(
            CpuKernels::new()
                .attention(&s, &q[..s.q_dim()], &bq, &k, &v, &mut o)
                .is_err()
        );
    }
}

#[test]
fn elementwise_kernels_match_reference() {
    let mut rng = Rng(77);
    let w = rng.vec(96, 1.0);
    let x = rng.vec(96 * 5, 3.0);
    let table = RopeTable::new(RopeStyle::Normal, 32, 10000.0, 64).unwrap();
    for (name, k) in backends() {
        let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        ScalarKernels.rmsnorm(&x, &w, 1e-5, &mut a).unwrap();
        k.rmsnorm(&x, &w, 1e-5, &mut b).unwrap();
        assert!(
            a.iter().zip(&b).all(|(p, q)| (p - q).abs() < 1e-5),
            "{name} rmsnorm"
        );
        // rmsnorm definition on one row.
        let ms: f32 = x[..96].iter().map(|v| v * v).sum::<f32>() / 96.0;
        assert!((a[3] - x[3] / (ms + 1e-5).sqrt() * w[3]).abs() < 1e-4);

        let (mut ga, mut gb) = (x.clone(), x.clone());
        ScalarKernels.silu_mul(&mut ga, &w.repeat(5)).unwrap();
        k.silu_mul(&mut gb, &w.repeat(5)).unwrap();
        assert!(
            ga.iter().zip(&gb).all(|(p, q)| (p - q).abs() < 1e-5),
            "{name} silu"
        );
        assert!((ga[0] - x[0] / (1.0 + (-x[0]).exp()) * w[0]).abs() < 1e-5);

        let (mut ra, mut rb) = (x.clone(), x.clone());
        let pos = [0usize, 3, 9, 30, 63];
        ScalarKernels.rope(&mut ra, 3, 32, &pos, &table).unwrap();
        k.rope(&mut rb, 3, 32, &pos, &table).unwrap();
        assert_eq!(ra, rb, "{name} rope");
        assert_eq!(&ra[..96], &x[..96], "position 0 is the identity");

        let (mut sa, mut sb) = (x.clone(), x.clone());
        ScalarKernels.softmax(&mut sa);
        k.softmax(&mut sb);
        assert!((sa.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert!(sa.iter().zip(&sb).all(|(p, q)| (p - q).abs() < 1e-7));
    }
}

/// Large batches take the pooled paths (rows of norms and rope split over threads, silu
/// in chunks): the same results as the reference, and each row the same bits as when it
/// is computed alone (batched decoding equals single-sequence decoding bit for bit).
#[test]
fn pooled_elementwise_paths_match_reference_and_single_rows() {
    let mut rng = Rng(78);
    let (dim, rows) = (96, 37);
    let w = rng.vec(dim, 1.0);
    let x = rng.vec(dim * rows, 3.0);
    let pos: Vec<usize> = (0..rows).map(|i| (i * 7) % 64).collect();
    let table = RopeTable::new(RopeStyle::Normal, 32, 10000.0, 64).unwrap();
    let big_gate = rng.vec(3 * 16 * 1024 + 5, 4.0);
    let big_up = rng.vec(big_gate.len(), 2.0);
    for (name, k) in backends() {
        let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        ScalarKernels.rmsnorm(&x, &w, 1e-5, &mut a).unwrap();
        k.rmsnorm(&x, &w, 1e-5, &mut b).unwrap();
        for (i, (p, q)) in a.iter().zip(&b).enumerate() {
            assert!(
                (p - q).abs() <= 1e-5 * p.abs().max(1.0),
                "{name} rmsnorm at {i}"
            );
        }
        for r in [0, 17, rows - 1] {
            let mut one = vec![0f32; dim];
            k.rmsnorm(&x[r * dim..(r + 1) * dim], &w, 1e-5, &mut one)
                .unwrap();
            assert_eq!(one, b[r * dim..(r + 1) * dim], "{name} rmsnorm row {r}");
        }

        let (mut ra, mut rb) = (x.clone(), x.clone());
        ScalarKernels.rope(&mut ra, 3, 32, &pos, &table).unwrap();
        k.rope(&mut rb, 3, 32, &pos, &table).unwrap();
        assert_eq!(ra, rb, "{name} rope over {rows} tokens");
        let short = &mut x.clone()[..dim * 3];
        assert!(
            k.rope(short, 3, 32, &pos, &table).is_err(),
            "{name}: rope with more positions than tokens is an error"
        );

        let (mut ga, mut gb) = (big_gate.clone(), big_gate.clone());
        ScalarKernels.silu_mul(&mut ga, &big_up).unwrap();
        k.silu_mul(&mut gb, &big_up).unwrap();
        assert!(
            ga.iter()
                .zip(&gb)
                .all(|(p, q)| (p - q).abs() <= 1e-5 * p.abs().max(1.0)),
            "{name} silu over {} values",
            ga.len()
        );
        let mut part = big_gate[..4096].to_vec();
        k.silu_mul(&mut part, &big_up[..4096]).unwrap();
        assert_eq!(
            part,
            gb[..4096],
            "{name} silu: a chunk alone gives the same bits"
        );
    }
}

#[test]
fn silu_matches_reference_on_tails_and_extremes() {
    let mut rng = Rng(31);
    let mut x = rng.vec(45, 12.0);
    x.extend([
        -200.0, -89.0, -88.0, -87.5, -30.0, 0.0, 30.0, 87.5, 88.5, 200.0, -0.0,
    ]);
    let up = rng.vec(x.len(), 2.0);
    for n in [x.len(), 8, 7, 1] {
        let mut want = x[..n].to_vec();
        ScalarKernels.silu_mul(&mut want, &up[..n]).unwrap();
        for (name, k) in backends() {
            let mut got = x[..n].to_vec();
            k.silu_mul(&mut got, &up[..n]).unwrap();
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * a.abs().max(1.0),
                    "{name} silu({}) at {i}: {a} vs {b}",
                    x[i]
                );
            }
        }
    }
}

#[test]
fn attention_over_several_sequences_matches_reference() {
    let mut rng = Rng(17);
    let s = AttnShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        window: None,
    };
    let bt = 16;
    let n_blocks = 12;
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::F32] {
        let rb = ty.row_bytes(s.kv_dim()).unwrap();
        let mut kp = vec![0u8; n_blocks * bt * rb];
        let mut vp = vec![0u8; n_blocks * bt * rb];
        for row in kp.chunks_mut(rb).chain(vp.chunks_mut(rb)) {
            quantize_row(ty, &rng.vec(s.kv_dim(), 1.0), row).unwrap();
        }
        let tables: [Vec<u32>; 3] = [vec![5, 2, 9], vec![0, 11], vec![7]];
        let queries = [
            AttnQuery {
                block_table: &tables[0],
                n_ctx: 6,
            },
            AttnQuery {
                block_table: &tables[1],
                n_ctx: 5,
            },
            AttnQuery {
                block_table: &tables[2],
                n_ctx: 2,
            },
            AttnQuery {
                block_table: &tables[0],
                n_ctx: 40,
            },
            AttnQuery {
                block_table: &tables[1],
                n_ctx: 17,
            },
        ];
        let q = rng.vec(queries.len() * s.q_dim(), 1.0);
        let k = KvView {
            ty,
            data: &kp,
            block_tokens: bt,
        };
        let v = KvView {
            ty,
            data: &vp,
            block_tokens: bt,
        };
        let mut want = vec![0f32; q.len()];
        ScalarKernels
            .attention(&s, &q, &queries, &k, &v, &mut want)
            .unwrap();
        for (name, kern) in backends() {
            let mut got = vec![0f32; q.len()];
            kern.attention(&s, &q, &queries, &k, &v, &mut got).unwrap();
            for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                assert!((a - b).abs() < 1e-5, "{name} {ty} at {i}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn exact_activation_mode_matches_dense_f32_math() {
    let mut rng = Rng(3);
    for ty in GgmlType::ALL {
        let (rows, cols) = (45, fit(ty, 192));
        let w = rng.vec(rows * cols, 0.5);
        let bytes = encode(ty, rows, cols, &w);
        let m = Matrix::new(ty, rows, cols, &bytes).unwrap();
        let mut deq = vec![0f32; rows * cols];
        dequantize_row(ty, &bytes, &mut deq).unwrap();
        for n_tok in [1, 6] {
            let x = rng.vec(n_tok * cols, 2.0);
            for k in [
                CpuKernels::with_simd(true).exact_activations(),
                CpuKernels::with_simd(false).exact_activations(),
            ] {
                let mut got = vec![0f32; n_tok * rows];
                k.matmul(&[m], &x, n_tok, &mut [&mut got]).unwrap();
                for t in 0..n_tok {
                    for r in 0..rows {
                        let terms =
                            (0..cols).map(|c| deq[r * cols + c] as f64 * x[t * cols + c] as f64);
                        let (want, mag) =
                            terms.fold((0f64, 0f64), |(s, a), v| (s + v, a + v.abs()));
                        let g = got[t * rows + r] as f64;
                        assert!(
                            (want - g).abs() <= 1e-5 * mag + 1e-6,
                            "{k:?} {ty}: {want} vs {g}"
                        );
                    }
                }
            }
        }
    }
}

/// A query's attention output does not depend on the batch it is computed in (batched
/// decoding reproduces sequential decoding bit for bit): the same bits alone and among
/// many queries of different lengths, whatever the task split of the pool. Alone, a query
/// is one task per KV head; in a batch of at least two per thread, one task per query
/// that walks whole KV rows 32 positions at a time (cpu/attention.rs): contexts up to 150
/// cross several of those chunks, mid-block and at block ends.
#[test]
fn attention_of_a_query_is_bit_identical_alone_and_in_a_large_batch() {
    let mut rng = Rng(29);
    let s = AttnShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        window: None,
    };
    let (bt, positions) = (16, 150);
    for ty in [GgmlType::Q8_0, GgmlType::F16, GgmlType::BF16, GgmlType::F32] {
        let (kp, table, _) = paged(&mut rng, ty, positions, s.kv_dim(), bt);
        let (vp, _, _) = paged(&mut rng, ty, positions, s.kv_dim(), bt);
        let k = KvView {
            ty,
            data: &kp,
            block_tokens: bt,
        };
        let v = KvView {
            ty,
            data: &vp,
            block_tokens: bt,
        };
        let n_q = 4 * CpuKernels::new().threads() + 3;
        let queries: Vec<AttnQuery> = (0..n_q)
            .map(|i| AttnQuery {
                block_table: &table,
                n_ctx: 1 + (i * 37) % positions,
            })
            .collect();
        let q = rng.vec(n_q * s.q_dim(), 1.0);
        let mut want = vec![0f32; q.len()];
        ScalarKernels
            .attention(&s, &q, &queries, &k, &v, &mut want)
            .unwrap();
        for (name, kern) in backends() {
            let mut all = vec![0f32; q.len()];
            kern.attention(&s, &q, &queries, &k, &v, &mut all).unwrap();
            for (i, (a, b)) in want.iter().zip(&all).enumerate() {
                assert!((a - b).abs() < 1e-5, "{name} {ty} at {i}: {a} vs {b}");
            }
            for (i, qu) in queries.iter().enumerate() {
                let mut one = vec![0f32; s.q_dim()];
                let qi = &q[i * s.q_dim()..(i + 1) * s.q_dim()];
                kern.attention(&s, qi, std::slice::from_ref(qu), &k, &v, &mut one)
                    .unwrap();
                assert!(
                    one.iter()
                        .zip(&all[i * s.q_dim()..])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name} {ty}: query {i} differs alone and in a batch of {n_q}"
                );
            }
        }
    }
}

/// One call over matrices of every quantized family and a float one (a K-quant model's
/// Q, K, V and a Q8_0 or F16 neighbour share one input): each gets the activation blocks
/// of its own format, and every result equals the matrix multiplied alone, bit for bit.
#[test]
fn one_call_over_mixed_formats_equals_each_alone() {
    let mut rng = Rng(64);
    let cols = 512;
    let types = [
        GgmlType::Q4_K,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
        GgmlType::F16,
        GgmlType::Q5_0,
        GgmlType::Q5_K,
    ];
    let rows = [24usize, 16, 9, 8, 40, 17];
    let bytes: Vec<Vec<u8>> = types
        .iter()
        .zip(rows)
        .map(|(&ty, r)| encode(ty, r, cols, &rng.vec(r * cols, 0.5)))
        .collect();
    let ms: Vec<Matrix> = types
        .iter()
        .zip(rows)
        .zip(&bytes)
        .map(|((&ty, r), b)| Matrix::new(ty, r, cols, b).unwrap())
        .collect();
    let mut all: Vec<(&'static str, Box<dyn Kernels>)> = backends();
    all.push(("scalar", Box::new(ScalarKernels)));
    for n_tok in [1usize, 3, 12] {
        let x = rng.vec(n_tok * cols, 1.5);
        for (name, k) in &all {
            let mut outs: Vec<Vec<f32>> = rows.iter().map(|r| vec![f32::NAN; r * n_tok]).collect();
            let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|v| &mut v[..]).collect();
            k.matmul(&ms, &x, n_tok, &mut o).unwrap();
            for (i, m) in ms.iter().enumerate() {
                let mut alone = vec![f32::NAN; m.rows * n_tok];
                k.matmul(&[*m], &x, n_tok, &mut [&mut alone]).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&outs[i]), bits(&alone), "{name} {} T={n_tok}", m.ty);
            }
        }
    }
}
