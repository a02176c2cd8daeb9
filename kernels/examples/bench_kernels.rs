//! Kernel microbenchmark on a model's shapes with synthetic weights (SmolLM2-135M by
//! default; `--model qwen0.5b` / `qwen1.5b`: Qwen2.5-Coder 0.5B / 1.5B Q4_K_M, their
//! tensor types and shapes as the GGUF files store them).
//!
//! cargo run --release -p tandem-kernels --example bench_kernels -- [--threads N]
//!     [--model smollm2|qwen0.5b|qwen1.5b] [--simd best|avx2|avx512|portable]
//!
//! Each figure is the minimum wall time over repetitions (default 20, `REPS=n`): with one
//! thread that filters out most preemption on a shared machine.

use std::time::Instant;

use tandem_kernels::{
    AttnQuery, AttnShape, CpuKernels, CpuOptions, GgmlType, Kernels, KvView, Layout, Matrix,
    SimdTier, quantize_row,
};

/// Minimum wall time over `reps` runs of `f`, in ms.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::MAX, f64::min)
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
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

fn encode(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut bytes = vec![0u8; rows * rb];
    for row in bytes.chunks_mut(rb) {
        quantize_row(ty, &rng.vec(cols), row).unwrap();
    }
    bytes
}

fn main() {
    // `--threads N`: the kernel pool's size (default: one thread per core).
    let mut args = std::env::args().skip(1);
    let mut threads = None;
    let mut model = "smollm2".to_string();
    let mut tier = "best".to_string();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--threads" => threads = args.next().and_then(|n| n.parse().ok()),
            "--model" => model = args.next().expect("--model NAME"),
            "--simd" => tier = args.next().expect("--simd TIER"),
            other => panic!(
                "unknown argument {other:?} (usage: [--threads N] [--model NAME] [--simd TIER])"
            ),
        }
    }
    let k = CpuKernels::with_options(CpuOptions {
        threads,
        simd: tier != "portable",
    });
    let k = match tier.as_str() {
        "best" | "portable" => k,
        t => {
            let tier = SimdTier::ALL
                .into_iter()
                .find(|x| x.name() == t)
                .unwrap_or_else(|| panic!("unknown tier {t}"));
            k.with_tier(tier)
                .unwrap_or_else(|| panic!("this CPU has no {t}"))
        }
    };
    println!("{k:?}");
    // KERNEL=Q4_K:512x1536:32[,...]: only those products (type:rows x cols:tokens, Rows8),
    // many short repetitions, the minimum: on a loaded machine a run short enough to fit
    // one time slice often goes unpreempted.
    if let Ok(spec) = std::env::var("KERNEL") {
        let reps = std::env::var("REPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200);
        let mut rng = Rng(1);
        for one in spec.split(',') {
            kernel_only(&k, one, &mut rng, reps);
        }
        return;
    }
    if model != "smollm2" {
        let shape = ModelShape::named(&model);
        let reps = std::env::var("REPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20);
        let mut rng = Rng(1);
        layer_matmuls(&k, &shape, &mut rng, reps);
        shape_model_matmuls(&k, &shape, &mut rng, reps.div_ceil(4));
        return;
    }
    let mut rng = Rng(1);
    let reps = std::env::var("REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    // One layer's matrices (as called by the forward pass) and the output matrix.
    let shapes: [(&str, GgmlType, &[usize], usize); 4] = [
        ("qkv", GgmlType::Q4_1, &[576, 192, 192], 576),
        ("gate+up", GgmlType::Q4_1, &[1536, 1536], 576),
        ("down", GgmlType::Q4_1, &[576], 1536),
        ("output", GgmlType::Q8_0, &[49152], 576),
    ];
    // ONLY=attention skips the matmuls (quick attention experiments).
    let only_attention = std::env::var("ONLY").is_ok_and(|v| v == "attention");
    // Each shape in GGUF layout and in the CPU backend's 8-row interleave (what serving
    // multiplies). The matrices are reused across reps, so they come from cache: see
    // `bench_engine` for the whole model streamed from DRAM.
    for n_tok in [1usize, 32] {
        if only_attention {
            break;
        }
        let mut layer_total = [0.0; 2];
        for (name, ty, rows, cols) in shapes {
            let data: Vec<Vec<u8>> = rows
                .iter()
                .map(|&r| encode(&mut rng, ty, r, cols))
                .collect();
            let gguf: Vec<Matrix> = rows
                .iter()
                .zip(&data)
                .map(|(&r, d)| Matrix::new(ty, r, cols, d).unwrap())
                .collect();
            let packed: Vec<Vec<u8>> = gguf.iter().map(|m| m.to_rows8().unwrap()).collect();
            let rows8: Vec<Matrix> = rows
                .iter()
                .zip(&packed)
                .map(|(&r, d)| Matrix::with_layout(ty, r, cols, d, Layout::Rows8).unwrap())
                .collect();
            let x = rng.vec(n_tok * cols);
            let mut outs: Vec<Vec<f32>> = rows.iter().map(|&r| vec![0f32; r * n_tok]).collect();
            let macs = rows.iter().sum::<usize>() * cols * n_tok;
            for (i, (layout, ms)) in [("gguf", &gguf), ("rows8", &rows8)].into_iter().enumerate() {
                let ms_ = time(reps, || {
                    let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|v| &mut v[..]).collect();
                    k.matmul(ms, &x, n_tok, &mut o).unwrap();
                });
                println!(
                    "matmul {name:8} {layout:5} T={n_tok:2}: {ms_:8.3} ms  {:6.1} G MAC/s",
                    macs as f64 / ms_ / 1e6
                );
                if name != "output" {
                    layer_total[i] += ms_;
                }
            }
        }
        println!(
            "  layer matmuls T={n_tok}: gguf {:.3} ms (x30 = {:.1} ms), rows8 {:.3} ms (x30 = {:.1} ms)",
            layer_total[0],
            layer_total[0] * 30.0,
            layer_total[1],
            layer_total[1] * 30.0
        );
    }
    if !only_attention {
        model_matmuls(&k, &mut rng, reps.div_ceil(4));
    }
    // Attention: C queries over 480 positions each, 9 heads / 3 KV heads, as a decode step
    // at C = 1, 4 and 32 sees it. `ATTN_C=1,32` picks the levels, `ATTN_CTX` the context.
    let s = AttnShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
        window: None,
    };
    let levels: Vec<usize> = std::env::var("ATTN_C")
        .ok()
        .map(|v| v.split(',').filter_map(|c| c.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 4, 32]);
    for ty in [GgmlType::Q8_0, GgmlType::F16] {
        for &nq in &levels {
            attention_level(&k, &mut rng, reps, &s, ty, nq);
        }
        attention_prefill(&k, &mut rng, reps, &s, ty);
    }
}

/// Times the attention of a 512-token prompt in one step: 512 queries of one sequence,
/// query t seeing positions 0..=t.
fn attention_prefill(k: &CpuKernels, rng: &mut Rng, reps: usize, s: &AttnShape, ty: GgmlType) {
    let (bt, n) = (16usize, 512usize);
    let table: Vec<u32> = (0..(n / bt) as u32).collect();
    let queries: Vec<AttnQuery> = (0..n)
        .map(|t| AttnQuery {
            block_table: &table,
            n_ctx: t + 1,
        })
        .collect();
    let q = rng.vec(n * s.q_dim());
    let mut out = vec![0f32; q.len()];
    let kp = encode(rng, ty, n, s.kv_dim());
    let vp = encode(rng, ty, n, s.kv_dim());
    let view = |data| KvView {
        ty,
        data,
        block_tokens: bt,
    };
    let ms = time(reps, || {
        k.attention(s, &q, &queries, &view(&kp), &view(&vp), &mut out)
            .unwrap();
    });
    println!(
        "attention {ty} prefill of {n} tokens: one layer {ms:7.3} ms (x30 = {:6.1})",
        ms * 30.0
    );
}

/// Times attention of `nq` queries over `ATTN_CTX` (480) positions each: one layer hot, and 30
/// distinct layers' pools in a row (K/V from DRAM, as one decode step reads them).
fn attention_level(
    k: &CpuKernels,
    rng: &mut Rng,
    reps: usize,
    s: &AttnShape,
    ty: GgmlType,
    nq: usize,
) {
    // `ATTN_CTX=n`: positions per query (default 480, a long decode context).
    let ctx: usize = std::env::var("ATTN_CTX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(480);
    let bt = 16usize;
    let blocks = nq * ctx / bt;
    let tables: Vec<Vec<u32>> = (0..nq)
        .map(|i| ((i * ctx / bt) as u32..((i + 1) * ctx / bt) as u32).collect())
        .collect();
    let queries: Vec<AttnQuery> = tables
        .iter()
        .map(|t| AttnQuery {
            block_table: t,
            n_ctx: ctx,
        })
        .collect();
    let q = rng.vec(nq * s.q_dim());
    let mut out = vec![0f32; q.len()];
    let layers: Vec<(Vec<u8>, Vec<u8>)> = (0..30)
        .map(|_| {
            (
                encode(rng, ty, blocks * bt, s.kv_dim()),
                encode(rng, ty, blocks * bt, s.kv_dim()),
            )
        })
        .collect();
    fn view(ty: GgmlType, data: &[u8], bt: usize) -> KvView<'_> {
        KvView {
            ty,
            data,
            block_tokens: bt,
        }
    }
    let mut layer = |(kp, vp): &(Vec<u8>, Vec<u8>)| {
        k.attention(
            s,
            &q,
            &queries,
            &view(ty, kp, bt),
            &view(ty, vp, bt),
            &mut out,
        )
        .unwrap();
    };
    let hot = time(reps, || layer(&layers[0]));
    let cold = time(reps.div_ceil(4), || layers.iter().for_each(&mut layer));
    println!(
        "attention {ty} C={nq:2} x {ctx}: one layer {hot:7.3} ms (x30 = {:6.1}), \
         30 layers from DRAM {cold:7.2} ms",
        hot * 30.0
    );
}

/// A whole model's matrices as one decode step multiplies them: 30 distinct layers (66 MB
/// of Q4_1, so they come from DRAM as in serving) and the Q8_0 output, at T = 1, 2, 3, 4, 8 and 32
/// tokens, in GGUF layout and in the 8-row interleave; the two layouts alternate rep by
/// rep, so drift hits both alike.
fn model_matmuls(k: &CpuKernels, rng: &mut Rng, reps: usize) {
    let (dim, q, kv, ffn, vocab) = (576usize, 576usize, 192usize, 1536usize, 49152usize);
    let ty = GgmlType::Q4_1;
    // Per layer: (rows of each matrix sharing one input, cols).
    let layer: [(&[usize], usize); 4] = [
        (&[q, kv, kv], dim),
        (&[dim], q),
        (&[ffn, ffn], dim),
        (&[dim], ffn),
    ];
    let mut gguf: Vec<(GgmlType, usize, usize, Vec<u8>)> = Vec::new();
    // Matrices per call: those sharing an input go in one call, as the forward pass does.
    let mut calls = Vec::new();
    for _ in 0..30 {
        for (rows, cols) in layer {
            for &r in rows {
                gguf.push((ty, r, cols, encode(rng, ty, r, cols)));
            }
            calls.push(rows.len());
        }
    }
    calls.push(1);
    gguf.push((
        GgmlType::Q8_0,
        vocab,
        dim,
        encode(rng, GgmlType::Q8_0, vocab, dim),
    ));
    let rows8: Vec<Vec<u8>> = gguf
        .iter()
        .map(|(t, r, c, d)| Matrix::new(*t, *r, *c, d).unwrap().to_rows8().unwrap())
        .collect();
    let mats = |layout: Layout| -> Vec<Matrix<'_>> {
        gguf.iter()
            .zip(&rows8)
            .map(|((t, r, c, d), p)| match layout {
                Layout::Gguf => Matrix::new(*t, *r, *c, d).unwrap(),
                Layout::Rows8 => Matrix::with_layout(*t, *r, *c, p, layout).unwrap(),
            })
            .collect()
    };
    let (mg, mp) = (mats(Layout::Gguf), mats(Layout::Rows8));
    for n_tok in [1usize, 2, 3, 4, 8, 32] {
        let x = rng.vec(n_tok * ffn);
        let mut outs: Vec<Vec<f32>> = gguf
            .iter()
            .map(|(_, r, _, _)| vec![0f32; n_tok * r])
            .collect();
        let mut step = |ms: &[Matrix<'_>]| {
            let t = Instant::now();
            let mut i = 0;
            for &n in &calls {
                let cols = ms[i].cols;
                let mut o: Vec<&mut [f32]> =
                    outs[i..i + n].iter_mut().map(|v| &mut v[..]).collect();
                k.matmul(&ms[i..i + n], &x[..n_tok * cols], n_tok, &mut o)
                    .unwrap();
                i += n;
            }
            t.elapsed().as_secs_f64() * 1e3
        };
        let (mut bg, mut bp) = (f64::MAX, f64::MAX);
        for _ in 0..reps {
            bg = bg.min(step(&mg));
            bp = bp.min(step(&mp));
        }
        println!(
            "model matmuls (30 layers + output, from DRAM) T={n_tok:2}: gguf {bg:7.2} ms, rows8 {bp:7.2} ms ({:.2}x)",
            bg / bp
        );
    }
}

/// A model's matrix products per decode step: `layers` layers of calls (matrices sharing
/// one input: (type, rows) each, and the input's length), the type alternating by layer
/// parity where the GGUF mixes two (Q4_K_M's attn_v / ffn_down), and the output matrix.
/// A matrix as (type, rows) in even and in odd layers.
type Variants = [(GgmlType, usize); 2];

struct ModelShape {
    name: &'static str,
    layers: usize,
    calls: Vec<(Vec<Variants>, usize)>,
    output: (GgmlType, usize, usize),
}

impl ModelShape {
    fn named(name: &str) -> Self {
        use GgmlType::*;
        let both = |t: GgmlType, r: usize| [(t, r), (t, r)];
        match name {
            // Qwen2.5-Coder-0.5B-Instruct Q4_K_M: d 896 (not a multiple of 256, so Q5_0
            // where a K-quant would be), 24 layers, GQA 14/2 × 64, FFN 4864.
            "qwen0.5b" => Self {
                name: "Qwen2.5-0.5B Q4_K_M",
                layers: 24,
                calls: vec![
                    (
                        vec![both(Q5_0, 896), both(Q5_0, 128), [(Q5_0, 128), (Q8_0, 128)]],
                        896,
                    ),
                    (vec![both(Q5_0, 896)], 896),
                    (vec![both(Q5_0, 4864), both(Q5_0, 4864)], 896),
                    (vec![[(Q4_K, 896), (Q6_K, 896)]], 4864),
                ],
                output: (Q8_0, 151_936, 896),
            },
            // Qwen2.5-Coder-1.5B-Instruct Q4_K_M: d 1536, 28 layers, GQA 12/2 × 128, FFN 8960.
            "qwen1.5b" => Self {
                name: "Qwen2.5-1.5B Q4_K_M",
                layers: 28,
                calls: vec![
                    (
                        vec![
                            both(Q4_K, 1536),
                            both(Q4_K, 256),
                            [(Q4_K, 256), (Q6_K, 256)],
                        ],
                        1536,
                    ),
                    (vec![both(Q4_K, 1536)], 1536),
                    (vec![both(Q4_K, 8960), both(Q4_K, 8960)], 1536),
                    (vec![[(Q4_K, 1536), (Q6_K, 1536)]], 8960),
                ],
                output: (Q6_K, 151_936, 1536),
            },
            other => panic!("unknown model {other} (smollm2, qwen0.5b, qwen1.5b)"),
        }
    }
}

/// `rows` rows of random blocks of `ty` with finite f16 scales of order 1e-2 (the
/// kernels' speed does not depend on the values; encoding a billion floats would).
fn random_blocks(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let mut bytes: Vec<u8> = (0..ty.row_bytes(cols).unwrap() * rows)
        .map(|_| (rng.f() * 128.0 + 128.0) as u8)
        .collect();
    let scales: &[usize] = match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        _ => &[0],
    };
    for blk in bytes.chunks_exact_mut(ty.block_bytes()) {
        for &o in scales {
            let v = half::f16::from_f32(rng.f() * 0.02);
            blk[o..o + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    bytes
}

/// Each call of one layer (both variants where the type alternates), hot in cache, at
/// T = 1 and 32, in the 8-row interleave the CPU backend multiplies.
fn layer_matmuls(k: &CpuKernels, shape: &ModelShape, rng: &mut Rng, reps: usize) {
    println!("{}: one layer's matmuls, weights hot", shape.name);
    // AS_TYPE=Q4_0 multiplies every 32-element-block matrix as that type instead (A/B of
    // formats on the same shapes).
    let as_type = std::env::var("AS_TYPE").ok().map(|n| {
        *GgmlType::ALL
            .iter()
            .find(|t| t.name() == n)
            .unwrap_or_else(|| panic!("unknown type {n}"))
    });
    for n_tok in [1usize, 32] {
        let mut total = 0.0;
        for (mats, cols) in &shape.calls {
            for v in 0..2 {
                if v == 1 && mats.iter().all(|m| m[0] == m[1]) {
                    continue;
                }
                let packed: Vec<(GgmlType, usize, Vec<u8>)> = mats
                    .iter()
                    .map(|m| {
                        let (ty, rows) = m[v];
                        let ty = match as_type {
                            Some(t) if ty.block_len() == t.block_len() => t,
                            _ => ty,
                        };
                        let g = random_blocks(rng, ty, rows, *cols);
                        let p = Matrix::new(ty, rows, *cols, &g)
                            .unwrap()
                            .to_rows8()
                            .unwrap();
                        (ty, rows, p)
                    })
                    .collect();
                let ms: Vec<Matrix> = packed
                    .iter()
                    .map(|(t, r, p)| Matrix::with_layout(*t, *r, *cols, p, Layout::Rows8).unwrap())
                    .collect();
                let x = rng.vec(n_tok * cols);
                let mut outs: Vec<Vec<f32>> =
                    ms.iter().map(|m| vec![0f32; m.rows * n_tok]).collect();
                let ms_ = time(reps, || {
                    let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|v| &mut v[..]).collect();
                    k.matmul(&ms, &x, n_tok, &mut o).unwrap();
                });
                let macs = ms.iter().map(|m| m.rows).sum::<usize>() * cols * n_tok;
                let what: Vec<String> = ms.iter().map(|m| format!("{}x{}", m.ty, m.rows)).collect();
                println!(
                    "  T={n_tok:2} {:32} cols {cols:5}: {ms_:8.3} ms {:7.1} G MAC/s",
                    what.join(" "),
                    macs as f64 / ms_ / 1e6
                );
                if v == 0 || mats.iter().any(|m| m[0] != m[1]) {
                    total += if mats.iter().any(|m| m[0] != m[1]) {
                        ms_ / 2.0
                    } else {
                        ms_
                    };
                }
            }
        }
        println!(
            "  T={n_tok:2} layer (mixed types averaged): {total:.3} ms (x{} = {:.1} ms)",
            shape.layers,
            total * shape.layers as f64
        );
    }
}

/// The whole model's matrices as one decode step multiplies them (distinct layers, so
/// from DRAM as in serving; the 8-row interleave) and the output matrix, at several T.
fn shape_model_matmuls(k: &CpuKernels, shape: &ModelShape, rng: &mut Rng, reps: usize) {
    let mut mats: Vec<(GgmlType, usize, usize, Vec<u8>)> = Vec::new();
    let mut calls = Vec::new();
    for l in 0..shape.layers {
        for (ms, cols) in &shape.calls {
            for m in ms {
                let (ty, rows) = m[l % 2];
                let g = random_blocks(rng, ty, rows, *cols);
                let p = Matrix::new(ty, rows, *cols, &g)
                    .unwrap()
                    .to_rows8()
                    .unwrap();
                mats.push((ty, rows, *cols, p));
            }
            calls.push(ms.len());
        }
    }
    let (oty, orows, ocols) = shape.output;
    let g = random_blocks(rng, oty, orows, ocols);
    mats.push((
        oty,
        orows,
        ocols,
        Matrix::new(oty, orows, ocols, &g)
            .unwrap()
            .to_rows8()
            .unwrap(),
    ));
    calls.push(1);
    let bytes: usize = mats.iter().map(|m| m.3.len()).sum();
    let ms: Vec<Matrix> = mats
        .iter()
        .map(|(t, r, c, p)| Matrix::with_layout(*t, *r, *c, p, Layout::Rows8).unwrap())
        .collect();
    let max_cols = ms.iter().map(|m| m.cols).max().unwrap();
    for n_tok in [1usize, 2, 4, 8, 32] {
        let x = rng.vec(n_tok * max_cols);
        let mut outs: Vec<Vec<f32>> = ms.iter().map(|m| vec![0f32; n_tok * m.rows]).collect();
        let mut best = f64::MAX;
        for _ in 0..reps {
            let t = Instant::now();
            let mut i = 0;
            for &n in &calls {
                let cols = ms[i].cols;
                let mut o: Vec<&mut [f32]> =
                    outs[i..i + n].iter_mut().map(|v| &mut v[..]).collect();
                k.matmul(&ms[i..i + n], &x[..n_tok * cols], n_tok, &mut o)
                    .unwrap();
                i += n;
            }
            best = best.min(t.elapsed().as_secs_f64() * 1e3);
        }
        println!(
            "{} model matmuls ({} MB, from DRAM) T={n_tok:2}: {best:7.2} ms ({:.1} GB/s, {:.0} tok/s)",
            shape.name,
            bytes / 1_000_000,
            bytes as f64 / best / 1e6,
            n_tok as f64 * 1e3 / best
        );
    }
}

/// One product `TYPE:ROWSxCOLS:T` (8-row interleave), minimum over `reps`.
fn kernel_only(k: &CpuKernels, spec: &str, rng: &mut Rng, reps: usize) {
    let parts: Vec<&str> = spec.split(':').collect();
    let ty = *GgmlType::ALL
        .iter()
        .find(|t| t.name() == parts[0])
        .unwrap_or_else(|| panic!("unknown type in {spec}"));
    let (rows, cols) = parts[1].split_once('x').expect("ROWSxCOLS");
    let (rows, cols): (usize, usize) = (rows.parse().unwrap(), cols.parse().unwrap());
    let n_tok: usize = parts[2].parse().unwrap();
    let g = random_blocks(rng, ty, rows, cols);
    let p = Matrix::new(ty, rows, cols, &g).unwrap().to_rows8().unwrap();
    let m = Matrix::with_layout(ty, rows, cols, &p, Layout::Rows8).unwrap();
    let x = rng.vec(n_tok * cols);
    let mut out = vec![0f32; rows * n_tok];
    let ms = time(reps, || k.matmul(&[m], &x, n_tok, &mut [&mut out]).unwrap());
    println!(
        "{spec:24} {ms:8.4} ms {:7.1} G MAC/s {:6.2} GB/s of weights",
        (rows * cols * n_tok) as f64 / ms / 1e6,
        p.len() as f64 / ms / 1e6
    );
}
