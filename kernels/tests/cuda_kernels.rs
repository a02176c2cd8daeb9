//! Every CUDA kernel against the scalar reference on random inputs. These need a GPU, so
//! they exist only with feature `gpu-tests`: CI compiles and lints them (`make cuda-check`)
//! and `tests/gpu/run.sh` runs them. Without a usable device they FAIL (never skip).
//!
//! Tolerances (max |gpu − ref| over the output):
//! - matmul: 1e-3 · max(1, max|ref|) — the per-block integer dot products are exact on
//!   both sides (same Q8 / Q8K activation quantization, bit for bit); only the order of
//!   the f32 sums over blocks differs (and the K-quants apply their scales per sub-block
//!   in f32 where the reference combines them in i32 first).
//! - rmsnorm (also in place, per head), rope, silu_mul, gelu_mul: 1e-5 relative (the sum
//!   of squares runs in another order; a GPU's expf / tanhf are within 2 ulp);
//!   attention: 2e-4 absolute (values are O(1); other summation order and expf), with and
//!   without a sliding window.
//! - embed, argmax, top-k, KV store / gather / scatter, add_bias, scale: exact (one f32
//!   operation per element, or none). rmsnorm in place equals rmsnorm into another buffer
//!   bit for bit (the same kernel arithmetic).
#![cfg(feature = "gpu-tests")]

use tandem_kernels::cuda::CudaKernels;
use tandem_kernels::{
    AttnQuery, AttnShape, GgmlType, Kernels, KvView, Matrix, RopeStyle, RopeTable, ScalarKernels,
    dequantize_row, quantize_row,
};

fn gpu() -> CudaKernels {
    CudaKernels::new(0).unwrap_or_else(|e| {
        panic!(
            "GPU test run without a usable CUDA device: {e} (run tests/gpu/run.sh on a GPU machine)"
        )
    })
}

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

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0f32, |m, v| m.max(v.abs()))
}

fn encode(ty: GgmlType, x: &[f32], cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut out = vec![0u8; x.len() / cols * rb];
    for (src, dst) in x.chunks(cols).zip(out.chunks_mut(rb)) {
        quantize_row(ty, src, dst).unwrap();
    }
    out
}

#[test]
fn matmul_matches_reference_for_every_type_and_batch_size() {
    let g = gpu();
    let mut r = Rng(1);
    for ty in GgmlType::ALL {
        // 576 × 1536-ish shapes (whole K-quant super-blocks for those), odd row counts for
        // partial tiles, and both kernel paths (warp-per-row up to 16 tokens, tiled beyond).
        for (rows, cols) in [(67, 576usize), (130, 1536), (64, 32)] {
            let cols = cols.next_multiple_of(ty.block_len());
            let w = encode(ty, &r.vec(rows * cols, 1.0), cols);
            let m = Matrix::new(ty, rows, cols, &w).unwrap();
            // 11: the second launch row of the warp-per-row kernels is partial.
            for n_tok in [1, 3, 8, 11, 16, 17, 64, 100] {
                let x = r.vec(n_tok * cols, 2.0);
                let mut want = vec![0f32; n_tok * rows];
                let mut got = vec![0f32; n_tok * rows];
                ScalarKernels
                    .matmul(&[m], &x, n_tok, &mut [&mut want])
                    .unwrap();
                g.matmul(&[m], &x, n_tok, &mut [&mut got]).unwrap();
                let tol = 1e-3 * max_abs(&want).max(1.0);
                let d = max_diff(&want, &got);
                assert!(
                    d <= tol,
                    "{ty} {rows}x{cols} n_tok {n_tok}: diff {d} > {tol}"
                );
            }
        }
    }
}

#[test]
fn norm_rope_and_swiglu_match_reference() {
    let g = gpu();
    let mut r = Rng(2);
    let (rows, dim) = (7, 576);
    let x = r.vec(rows * dim, 3.0);
    let w = r.vec(dim, 1.0);
    let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
    ScalarKernels.rmsnorm(&x, &w, 1e-5, &mut a).unwrap();
    g.rmsnorm(&x, &w, 1e-5, &mut b).unwrap();
    assert!(max_diff(&a, &b) <= 1e-5 * max_abs(&a).max(1.0), "rmsnorm");

    for (style, rot) in [
        (RopeStyle::Normal, 64),
        (RopeStyle::Neox, 64),
        (RopeStyle::Normal, 32),
    ] {
        let table = RopeTable::new(style, rot, 10000.0, 2048).unwrap();
        let positions = [0usize, 1, 17, 500, 2047];
        let x = r.vec(positions.len() * 9 * 64, 2.0);
        let (mut a, mut b) = (x.clone(), x.clone());
        ScalarKernels
            .rope(&mut a, 9, 64, &positions, &table)
            .unwrap();
        g.rope(&mut b, 9, 64, &positions, &table).unwrap();
        assert!(
            max_diff(&a, &b) <= 1e-5 * max_abs(&a).max(1.0),
            "rope {style:?} {rot}"
        );
    }

    let gate = r.vec(3 * 1536, 6.0);
    let up = r.vec(3 * 1536, 2.0);
    let (mut a, mut b) = (gate.clone(), gate.clone());
    ScalarKernels.silu_mul(&mut a, &up).unwrap();
    g.silu_mul(&mut b, &up).unwrap();
    assert!(max_diff(&a, &b) <= 1e-5 * max_abs(&a).max(1.0), "silu_mul");
}

/// The element-wise operations of the newer architectures: per-head RMS norms of Q and K
/// (rows are heads; head_dim 64, Gemma's 256, and rows longer than the 256-thread block),
/// GeGLU, projection biases and Gemma's embedding scale.
#[test]
fn per_head_norm_geglu_bias_and_scale_match_reference() {
    let g = gpu();
    let d = g.device();
    let mut r = Rng(5);
    for (rows, dim) in [(5 * 9, 64), (3 * 4, 256), (3, 640)] {
        let x = r.vec(rows * dim, 3.0);
        let w = r.vec(dim, 1.0);
        let (mut a, mut b) = (x.clone(), x.clone());
        ScalarKernels.rmsnorm_in_place(&mut a, &w, 1e-6).unwrap();
        g.rmsnorm_in_place(&mut b, &w, 1e-6).unwrap();
        let dd = max_diff(&a, &b);
        assert!(
            dd <= 1e-5 * max_abs(&a).max(1.0),
            "rmsnorm_in_place {rows}x{dim}: {dd}"
        );
        let mut c = vec![0f32; x.len()];
        g.rmsnorm(&x, &w, 1e-6, &mut c).unwrap();
        assert_eq!(
            b, c,
            "rmsnorm in place vs into another buffer, {rows}x{dim}"
        );
    }

    let gate = r.vec(3 * 1536 + 17, 6.0);
    let up = r.vec(gate.len(), 2.0);
    let (mut a, mut b) = (gate.clone(), gate.clone());
    ScalarKernels.gelu_mul(&mut a, &up).unwrap();
    g.gelu_mul(&mut b, &up).unwrap();
    let dd = max_diff(&a, &b);
    assert!(dd <= 1e-5 * max_abs(&a).max(1.0), "gelu_mul: {dd}");

    // Bias rows of 200 (not a multiple of the 256-thread block) over 7 rows: 6 blocks.
    let (rows, width) = (7, 200);
    let x = r.vec(rows * width + 50, 2.0);
    let bias = r.vec(width, 1.0);
    let mut xd = d.upload(&x).unwrap();
    let bd = d.upload(&bias).unwrap();
    d.add_bias(&mut xd.as_view_mut(), &bd.as_view(), rows)
        .unwrap();
    let got = d.download(&xd.as_view(), x.len()).unwrap();
    let mut want = x.clone();
    for (i, v) in want[..rows * width].iter_mut().enumerate() {
        *v += bias[i % width];
    }
    assert_eq!(
        got, want,
        "add_bias (the 50 values past the rows untouched)"
    );
    assert!(
        d.add_bias(&mut xd.as_view_mut(), &bd.as_view(), rows + 1)
            .is_err()
    );

    let s = (640f32).sqrt();
    let n = 1000;
    d.scale(&mut xd.as_view_mut(), s, n).unwrap();
    let got = d.download(&xd.as_view(), x.len()).unwrap();
    want[..n].iter_mut().for_each(|v| *v *= s);
    assert_eq!(got, want, "scale of the first {n} values");
}

/// Sliding-window attention (Gemma 3's local layers) in both kernels: windows shorter and
/// longer than the K/V tile, queries whose context is still inside the window (they see
/// everything) beside ones past it, in one prefill tile and as single decode queries.
#[test]
fn sliding_window_attention_matches_reference_in_decode_and_prefill() {
    let g = gpu();
    let mut r = Rng(6);
    // head_dim 256 has 8-position K/V tiles in the prefill kernel, 64 has 32.
    for (ty, n_heads, n_kv, hd) in [(GgmlType::F16, 4, 1, 256), (GgmlType::Q8_0, 6, 2, 64)] {
        let (bt, n_blocks) = (16, 12);
        let kv_dim = n_kv * hd;
        let kdata = encode(ty, &r.vec(n_blocks * bt * kv_dim, 1.0), kv_dim);
        let vdata = encode(ty, &r.vec(n_blocks * bt * kv_dim, 1.0), kv_dim);
        let k = KvView {
            ty,
            data: &kdata,
            block_tokens: bt,
        };
        let v = KvView {
            ty,
            data: &vdata,
            block_tokens: bt,
        };
        let t1: Vec<u32> = vec![7, 2, 9, 0, 11, 4, 1];
        let t2: Vec<u32> = vec![3, 10];
        let t3: Vec<u32> = vec![5, 8, 6];
        for window in [5, 40] {
            let s = AttnShape {
                n_heads,
                n_kv_heads: n_kv,
                head_dim: hd,
                window: Some(window),
            };
            // A 20-token prompt from position 0 (queries inside and past a 5-window in
            // one tile); a 30-token chunk at positions 30..60 (inside and past 40); single
            // queries at n_ctx 3 (inside both) and 100 (past both, several 32-position
            // chunks of the decode kernel for 40).
            let mut queries: Vec<AttnQuery<'_>> = (1..=20)
                .map(|n| AttnQuery {
                    block_table: &t3,
                    n_ctx: n,
                })
                .collect();
            queries.extend((31..=60).map(|n| AttnQuery {
                block_table: &t1,
                n_ctx: n,
            }));
            queries.push(AttnQuery {
                block_table: &t2,
                n_ctx: 3,
            });
            let t4 = t1.clone();
            queries.push(AttnQuery {
                block_table: &t4,
                n_ctx: 100,
            });
            let q = r.vec(queries.len() * s.q_dim(), 2.0);
            let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            ScalarKernels
                .attention(&s, &q, &queries, &k, &v, &mut a)
                .unwrap();
            g.attention(&s, &q, &queries, &k, &v, &mut b).unwrap();
            let dd = max_diff(&a, &b);
            assert!(dd <= 2e-4, "{ty} {s:?}: diff {dd}");
            // The window mattered: without it the outputs of queries past it differ.
            let full = AttnShape { window: None, ..s };
            let mut c = vec![0f32; q.len()];
            ScalarKernels
                .attention(&full, &q, &queries, &k, &v, &mut c)
                .unwrap();
            assert!(
                max_diff(&a, &c) > 1e-2,
                "{ty} window {window} changed nothing"
            );
        }
    }
}

/// A paged pool with a shuffled block table per sequence, attended by a mix of single
/// decode queries and prompt runs (the prefill kernel's tiles).
#[test]
fn paged_attention_matches_reference_for_decode_and_prefill() {
    let g = gpu();
    let mut r = Rng(3);
    for (ty, n_heads, n_kv, hd) in [
        (GgmlType::F16, 9, 3, 64),
        (GgmlType::F32, 4, 4, 128),
        (GgmlType::Q8_0, 8, 2, 64),
        (GgmlType::F16, 2, 1, 256),
    ] {
        let s = AttnShape {
            n_heads,
            n_kv_heads: n_kv,
            head_dim: hd,
            window: None,
        };
        let (bt, n_blocks) = (16, 64);
        let rb = ty.row_bytes(s.kv_dim()).unwrap();
        let kdata = encode(ty, &r.vec(n_blocks * bt * s.kv_dim(), 1.0), s.kv_dim());
        let vdata = encode(ty, &r.vec(n_blocks * bt * s.kv_dim(), 1.0), s.kv_dim());
        assert_eq!(kdata.len(), n_blocks * bt * rb);
        let k = KvView {
            ty,
            data: &kdata,
            block_tokens: bt,
        };
        let v = KvView {
            ty,
            data: &vdata,
            block_tokens: bt,
        };
        let t1: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % 64).collect(); // 320 positions
        let t2: Vec<u32> = vec![5, 60, 33];
        // seq1: a 40-token prompt chunk at positions 250..290; seq2: one decode token at
        // position 37; seq1 again is not allowed in one step, so a third run reuses t2 as
        // another sequence's single token at position 1.
        let mut queries: Vec<AttnQuery<'_>> = (250..290)
            .map(|p| AttnQuery {
                block_table: &t1,
                n_ctx: p + 1,
            })
            .collect();
        queries.push(AttnQuery {
            block_table: &t2,
            n_ctx: 38,
        });
        let t3 = t2.clone();
        queries.push(AttnQuery {
            block_table: &t3,
            n_ctx: 1,
        });
        let q = r.vec(queries.len() * s.q_dim(), 2.0);
        let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        ScalarKernels
            .attention(&s, &q, &queries, &k, &v, &mut a)
            .unwrap();
        g.attention(&s, &q, &queries, &k, &v, &mut b).unwrap();
        let d = max_diff(&a, &b);
        assert!(d <= 2e-4, "{ty} {s:?}: diff {d}");
    }
}

#[test]
fn embedding_sampling_and_kv_transfer_kernels_are_exact() {
    let g = gpu();
    let d = g.device();
    let mut r = Rng(4);
    // Embedding rows of every type decode exactly like dequantize_row.
    for ty in GgmlType::ALL {
        let (rows, dim) = (50, 96usize.next_multiple_of(ty.block_len()));
        let table = encode(ty, &r.vec(rows * dim, 1.0), dim);
        let m = d
            .upload_matrix(&Matrix::new(ty, rows, dim, &table).unwrap())
            .unwrap();
        let toks = [0u32, 49, 7, 7];
        let td = d.upload(&toks).unwrap();
        let mut out = d.zeros::<f32>(toks.len() * dim).unwrap();
        d.embed(&m, &td.as_view(), toks.len(), &mut out.as_view_mut())
            .unwrap();
        let got = d.download(&out.as_view(), toks.len() * dim).unwrap();
        let rb = ty.row_bytes(dim).unwrap();
        for (i, t) in toks.iter().enumerate() {
            let mut want = vec![0f32; dim];
            dequantize_row(ty, &table[*t as usize * rb..][..rb], &mut want).unwrap();
            assert_eq!(&got[i * dim..(i + 1) * dim], &want[..], "{ty} token {t}");
        }
    }

    // argmax and top-k, including ties (lowest index first) and -inf entries.
    let vocab = 49152;
    let mut logits = r.vec(3 * vocab, 10.0);
    logits[vocab + 100] = 50.0;
    logits[vocab + 7] = 50.0;
    logits[2 * vocab + 3] = f32::NEG_INFINITY;
    let ld = d.upload(&logits).unwrap();
    let mut ids = d.zeros::<u32>(3).unwrap();
    d.argmax(&ld.as_view(), 3, vocab, &mut ids.as_view_mut())
        .unwrap();
    let ids = d.download(&ids.as_view(), 3).unwrap();
    for (row, id) in ids.iter().enumerate() {
        let x = &logits[row * vocab..(row + 1) * vocab];
        let mut best = 0;
        for (i, v) in x.iter().enumerate() {
            if *v > x[best] {
                best = i;
            }
        }
        assert_eq!(*id as usize, best, "argmax row {row}");
    }
    assert_eq!(ids[1], 7);
    for k in [1, 2, 50, 256] {
        let mut vals = d.zeros::<f32>(3 * k).unwrap();
        let mut idx = d.zeros::<u32>(3 * k).unwrap();
        d.topk(
            &ld.as_view(),
            3,
            vocab,
            k,
            &mut vals.as_view_mut(),
            &mut idx.as_view_mut(),
        )
        .unwrap();
        let vals = d.download(&vals.as_view(), 3 * k).unwrap();
        let idx = d.download(&idx.as_view(), 3 * k).unwrap();
        for row in 0..3 {
            let x = &logits[row * vocab..(row + 1) * vocab];
            let mut order: Vec<usize> = (0..vocab).collect();
            order.sort_by(|a, b| x[*b].total_cmp(&x[*a]).then(a.cmp(b)));
            let want: Vec<u32> = order[..k].iter().map(|i| *i as u32).collect();
            assert_eq!(&idx[row * k..(row + 1) * k], &want[..], "top-{k} row {row}");
            for (v, i) in vals[row * k..(row + 1) * k].iter().zip(&want) {
                assert_eq!(*v, x[*i as usize]);
            }
        }
    }

    // KV store encodes like quantize_row; gather packs the TKV1 body; scatter inverts it.
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::F32] {
        let (layers, kv_dim, bt, nb) = (3, 64, 4, 10);
        let mut kv = d.alloc_kv(ty, layers, kv_dim, bt, nb).unwrap();
        let table = [9u32, 2, 5];
        let n = 10;
        let mut expect = Vec::new();
        let rb = ty.row_bytes(kv_dim).unwrap();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for _ in 0..layers {
            let k = r.vec(n * kv_dim, 3.0);
            let v = r.vec(n * kv_dim, 3.0);
            expect.extend(encode(ty, &k, kv_dim));
            expect.extend(encode(ty, &v, kv_dim));
            ks.push(k);
            vs.push(v);
        }
        let slots: Vec<i64> = (0..n)
            .map(|p| (table[p / bt] as usize * bt + p % bt) as i64)
            .collect();
        let sd = d.upload(&slots).unwrap();
        for l in 0..layers {
            let (kd, vd) = (d.upload(&ks[l]).unwrap(), d.upload(&vs[l]).unwrap());
            d.kv_store(&mut kv, l, &kd.as_view(), &vd.as_view(), &sd.as_view(), n)
                .unwrap();
        }
        let packed = d.kv_gather(&kv, &table, n).unwrap();
        assert_eq!(packed.len(), layers * 2 * n * rb);
        assert_eq!(packed, expect, "{ty}: gather of stored rows");
        let mut kv2 = d.alloc_kv(ty, layers, kv_dim, bt, nb).unwrap();
        let other = [0u32, 1, 3];
        d.kv_scatter(&mut kv2, &other, n, &packed).unwrap();
        assert_eq!(
            d.kv_gather(&kv2, &other, n).unwrap(),
            packed,
            "{ty}: scatter"
        );
        assert!(
            d.kv_scatter(&mut kv2, &[0, 1, 99], n, &packed).is_err(),
            "bad block"
        );
    }
}

#[test]
fn sample_kernel_greedy_and_top1_rows_are_exact_and_deferral_is_flagged() {
    // The full sampler is checked against the host `Sampler` in the dataplane GPU tests;
    // here the rows whose answer does not depend on rounding: greedy and top_k = 1 equal
    // argmax (lowest index on ties), a row without a finite logit is left to the host.
    use tandem_kernels::cuda::launch::{self, SampleRow};
    let g = gpu();
    let d = g.device();
    let mut r = Rng(9);
    let vocab = 49152;
    let mut logits = r.vec(4 * vocab, 10.0);
    logits[100] = 40.0;
    logits[30] = 40.0; // tie: 30 wins
    logits[vocab + 5000] = 35.0;
    logits[3 * vocab..].fill(f32::NEG_INFINITY);
    logits[3 * vocab + 17] = f32::NAN;
    let top1 = SampleRow {
        inv_temperature: 1.0 / 0.7,
        top_k: 1,
        top_p: 1.0,
        uniform: 0.99,
    };
    let rows = [
        SampleRow::GREEDY,
        top1,
        SampleRow {
            uniform: 0.0,
            ..top1
        },
        SampleRow {
            inv_temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            uniform: 0.5,
        },
    ];
    let ld = d.upload(&logits).unwrap();
    let pd = d.upload(&launch::pack_sample_rows(&rows)).unwrap();
    let mut od = d.zeros::<u32>(4).unwrap();
    d.sample(
        &ld.as_view(),
        4,
        vocab,
        &pd.as_view(),
        &mut od.as_view_mut(),
    )
    .unwrap();
    let got = d.download(&od.as_view(), 4).unwrap();
    let argmax = |row: usize| {
        let x = &logits[row * vocab..(row + 1) * vocab];
        let mut best = 0;
        for (i, v) in x.iter().enumerate() {
            if *v > x[best] {
                best = i;
            }
        }
        best as u32
    };
    assert_eq!(got[0], 30, "greedy, lowest index of the tie");
    assert_eq!(got[1], argmax(1));
    assert_eq!(got[1], 5000);
    assert_eq!(got[2], argmax(2));
    assert_eq!(got[3], launch::SAMPLE_DEFER, "no finite logit");
    // Greedy over that row: argmax's answer (index 0 of an all -inf / NaN row).
    let pd = d
        .upload(&launch::pack_sample_rows(&[SampleRow::GREEDY; 4]))
        .unwrap();
    d.sample(
        &ld.as_view(),
        4,
        vocab,
        &pd.as_view(),
        &mut od.as_view_mut(),
    )
    .unwrap();
    let got = d.download(&od.as_view(), 4).unwrap();
    assert_eq!(got, (0..4).map(argmax).collect::<Vec<_>>());
}

#[test]
fn kv_store_skips_negative_slots_and_graphs_capture_and_replay() {
    let g = gpu();
    let d = g.device();
    // Padding rows of a decode graph carry slot -1: nothing is written for them.
    let mut kv = d.alloc_kv(GgmlType::F32, 1, 32, 4, 2).unwrap();
    let k: Vec<f32> = (0..64).map(|i| i as f32 + 1.0).collect();
    let kd = d.upload(&k).unwrap();
    let sd = d.upload(&[-1i64, 5]).unwrap();
    d.kv_store(&mut kv, 0, &kd.as_view(), &kd.as_view(), &sd.as_view(), 2)
        .unwrap();
    let all = d.kv_gather(&kv, &[0, 1], 8).unwrap();
    let rows: Vec<f32> = all
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    for (pos, row) in rows[..8 * 32].chunks(32).enumerate() {
        let want: &[f32] = if pos == 5 { &k[32..] } else { &[0.0; 32] };
        assert_eq!(row, want, "K row {pos}");
    }

    // A captured graph runs nothing until launched, then replays the same kernels on
    // whatever the buffers hold at launch time.
    let mut x = d.upload(&[1f32; 64]).unwrap();
    let mut y = d.upload(&[2f32; 64]).unwrap();
    let graph = d
        .capture(|| d.add(&mut x.as_view_mut(), &y.as_view(), 64))
        .unwrap();
    assert_eq!(d.download(&x.as_view(), 64).unwrap(), vec![1.0; 64]);
    d.launch_graph(&graph).unwrap();
    assert_eq!(d.download(&x.as_view(), 64).unwrap(), vec![3.0; 64]);
    d.upload_into(&[5f32; 64], &mut y).unwrap();
    d.launch_graph(&graph).unwrap();
    assert_eq!(d.download(&x.as_view(), 64).unwrap(), vec![8.0; 64]);
    // A capture that does something a capture may not (synchronize) fails cleanly and
    // leaves the stream usable.
    assert!(d.capture(|| d.synchronize()).is_err());
    d.add(&mut x.as_view_mut(), &y.as_view(), 64).unwrap();
    assert_eq!(d.download(&x.as_view(), 64).unwrap(), vec![13.0; 64]);
}
