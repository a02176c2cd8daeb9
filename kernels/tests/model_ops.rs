//! The operations other architectures add to the forward pass (per-head RMS norm in place,
//! GeGLU, sliding-window attention), on every CPU implementation against the scalar
//! reference and against their definitions computed here in f64.

use tandem_kernels::{
    AttnQuery, AttnShape, CpuKernels, GgmlType, Kernels, KvView, ScalarKernels, SimdTier,
    dequantize_row, quantize_row,
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

/// The scalar reference and every CPU tier this machine has (one line per missing tier).
fn backends() -> Vec<(&'static str, Box<dyn Kernels>)> {
    let mut out: Vec<(&'static str, Box<dyn Kernels>)> = vec![("scalar", Box::new(ScalarKernels))];
    for tier in SimdTier::ALL {
        match CpuKernels::with_simd(true).with_tier(tier) {
            Some(k) => out.push((k.name(), Box::new(k))),
            None => eprintln!("skipped: this CPU has no {tier}; its kernels were not compared"),
        }
    }
    out
}

#[test]
fn rmsnorm_in_place_is_rmsnorm_bit_for_bit_and_matches_its_definition() {
    let mut rng = Rng(3);
    // Head-sized rows: 1 head, a few heads of one token, a batch of 70 tokens x 4 heads
    // (large enough to split over the pool).
    for (rows, dim) in [(1usize, 64usize), (4, 128), (280, 256), (7, 96)] {
        let x = rng.vec(rows * dim, 3.0);
        let w = rng.vec(dim, 1.0);
        for (name, k) in backends() {
            let mut out = vec![0f32; x.len()];
            k.rmsnorm(&x, &w, 1e-6, &mut out).unwrap();
            let mut inplace = x.clone();
            k.rmsnorm_in_place(&mut inplace, &w, 1e-6).unwrap();
            assert!(
                out.iter()
                    .zip(&inplace)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: in place differs from rmsnorm ({rows}x{dim})"
            );
            for (r, row) in x.chunks(dim).enumerate() {
                let ms: f64 = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
                for i in 0..dim {
                    let want = row[i] as f64 / (ms + 1e-6).sqrt() * w[i] as f64;
                    let got = inplace[r * dim + i] as f64;
                    assert!((want - got).abs() < 1e-5 * (1.0 + want.abs()), "{name}");
                }
            }
        }
        let mut odd = vec![0f32; dim + 1];
        assert!(ScalarKernels.rmsnorm_in_place(&mut odd, &w, 1e-6).is_err());
        assert!(
            CpuKernels::new()
                .rmsnorm_in_place(&mut odd, &w, 1e-6)
                .is_err()
        );
    }
}

#[test]
fn gelu_mul_matches_the_tanh_formula_on_every_backend() {
    let mut rng = Rng(11);
    for n in [1usize, 31, 2048, 70_000] {
        let gate = rng.vec(n, 6.0);
        let up = rng.vec(n, 2.0);
        let mut want = gate.clone();
        ScalarKernels.gelu_mul(&mut want, &up).unwrap();
        for (i, (g, u)) in gate.iter().zip(&up).enumerate() {
            let x = *g as f64;
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let gelu = 0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh());
            let d = (gelu * *u as f64 - want[i] as f64).abs();
            assert!(
                d < 1e-5 * (1.0 + gelu.abs()),
                "at {i}: {x} -> {gelu} vs {}",
                want[i]
            );
        }
        for (name, k) in backends() {
            let mut got = gate.clone();
            k.gelu_mul(&mut got, &up).unwrap();
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name}: gelu_mul of {n} differs from the reference"
            );
            assert!(k.gelu_mul(&mut got, &up[1..]).is_err(), "{name}: lengths");
        }
    }
}

/// A paged pool of `n` positions with random rows, its block table (blocks out of order)
/// and the dequantized rows.
fn paged(
    rng: &mut Rng,
    ty: GgmlType,
    n: usize,
    kv_dim: usize,
    bt: usize,
) -> (Vec<u8>, Vec<u32>, Vec<f32>) {
    let n_blocks = n.div_ceil(bt) + 2;
    let table: Vec<u32> = (0..n.div_ceil(bt))
        .map(|b| ((b * 5 + 1) % n_blocks) as u32)
        .collect();
    let rb = ty.row_bytes(kv_dim).unwrap();
    let mut pool = vec![0u8; n_blocks * bt * rb];
    let mut dense = vec![0f32; n * kv_dim];
    for p in 0..n {
        let vals = rng.vec(kv_dim, 1.0);
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

/// Sliding-window attention is attention over the last `window` positions: against the
/// dense definition, on every backend, alone and in batches big enough to take the
/// per-query path (windows that start mid-block, cover whole chunks, or exceed the
/// context), and bit-identical alone and batched.
#[test]
fn sliding_window_attention_reads_only_the_window() {
    let mut rng = Rng(23);
    let (bt, n) = (16, 150);
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::F32] {
        for window in [1usize, 7, 32, 45, 512] {
            let s = AttnShape {
                n_heads: 4,
                n_kv_heads: 1,
                head_dim: 64,
                window: Some(window),
            };
            let (kp, table, kd) = paged(&mut rng, ty, n, s.kv_dim(), bt);
            let (vp, vtable, vd) = paged(&mut rng, ty, n, s.kv_dim(), bt);
            assert_eq!(table, vtable);
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
            let n_q = 4 * CpuKernels::new().threads() + 1;
            let queries: Vec<AttnQuery> = (0..n_q)
                .map(|i| AttnQuery {
                    block_table: &table,
                    n_ctx: 1 + (i * 41) % n,
                })
                .collect();
            let q = rng.vec(n_q * s.q_dim(), 1.0);
            let mut want = vec![0f32; q.len()];
            ScalarKernels
                .attention(&s, &q, &queries, &k, &v, &mut want)
                .unwrap();
            for (qi, qu) in queries.iter().enumerate() {
                let lo = qu.n_ctx.saturating_sub(window);
                for h in 0..s.n_heads {
                    let qh = &q[(qi * s.n_heads + h) * 64..][..64];
                    let sc: Vec<f64> = (lo..qu.n_ctx)
                        .map(|t| {
                            (0..64)
                                .map(|i| (qh[i] * kd[t * 64 + i]) as f64)
                                .sum::<f64>()
                                / 8.0
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = sc.iter().map(|x| (x - mx).exp()).sum();
                    for i in 0..64 {
                        let o: f64 = (lo..qu.n_ctx)
                            .zip(&sc)
                            .map(|(t, s)| (s - mx).exp() / z * vd[t * 64 + i] as f64)
                            .sum();
                        let got = want[(qi * s.n_heads + h) * 64 + i] as f64;
                        assert!((o - got).abs() < 1e-4, "{ty} w={window}: {o} vs {got}");
                    }
                }
            }
            for (name, kern) in backends() {
                let mut all = vec![0f32; q.len()];
                kern.attention(&s, &q, &queries, &k, &v, &mut all).unwrap();
                for (a, b) in want.iter().zip(&all) {
                    assert!((a - b).abs() < 1e-5, "{name} {ty} w={window}: {a} vs {b}");
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
                        "{name} {ty} w={window}: query {i} differs alone and batched"
                    );
                }
            }
        }
    }
    // A window of 0 positions is refused.
    let s = AttnShape {
        n_heads: 1,
        n_kv_heads: 1,
        head_dim: 32,
        window: Some(0),
    };
    let pool = vec![0u8; 16 * 32 * 4];
    let kv = KvView {
        ty: GgmlType::F32,
        data: &pool,
        block_tokens: 16,
    };
    let qs = [AttnQuery {
        block_table: &[0],
        n_ctx: 1,
    }];
    let mut out = vec![0f32; 32];
    assert!(
        ScalarKernels
            .attention(&s, &[0.0; 32], &qs, &kv, &kv, &mut out)
            .is_err()
    );
}
