//! Every [`Backend`] operation, one at a time, against the same operation on the CPU
//! backend over the scalar reference kernels: the trait layer the model's forward pass
//! calls (buffer prefixes, step inputs made from a `StepDesc`, several matrices sharing one
//! quantized input, wanted-row gathers, KV transfer appending to a buffer).
//!
//! Runs for the optimized CPU backend everywhere, and for the CUDA backend with feature
//! `gpu-tests` (`tests/gpu/run.sh`; it fails, never skips, without a device).
//!
//! The operations of the newer architectures too: K-quant weights beside 32-element
//! formats in one product (both activation formats made from one input), projection
//! biases, per-head norms in place, Gemma's embedding scale, GeGLU and sliding-window
//! attention.
//!
//! Tolerances (max |got − ref|): matmul 1e-3 · max(1, max|ref|) (same Q8 / Q8K
//! activations, other f32 summation order); norm (also in place), rope, silu, gelu 1e-5
//! relative; attention 2e-4 (with or without a window); embedding, gathers, bias, scale,
//! KV stores and transfers exact.

use std::sync::Arc;

use tandem_kernels::{
    AttnShape, Backend, CpuBackend, CpuKernels, GgmlType, HostMatrix, PagedKvSpec, RopeStyle,
    RopeTable, ScalarKernels, StepDesc, quantize_row,
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

fn matrix(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> HostMatrix {
    let rb = ty.row_bytes(cols).unwrap();
    let mut bytes = vec![0u8; rows * rb];
    for r in bytes.chunks_mut(rb) {
        quantize_row(ty, &rng.vec(cols, 1.0), r).unwrap();
    }
    HostMatrix::owned(ty, rows, cols, bytes).unwrap()
}

const SHAPE: AttnShape = AttnShape {
    n_heads: 4,
    n_kv_heads: 2,
    head_dim: 32,
    window: None,
};
const DIM: usize = 128;
const FFN: usize = 192;
/// Columns of the K-quant products (one 256-value super-block per row).
const KDIM: usize = 256;
/// SHAPE with a 6-position window: the step's contexts are 5..=13 (A) and 7 (B), so A's
/// first two queries see everything and the rest only the last six positions.
const SWA: AttnShape = AttnShape {
    window: Some(6),
    ..SHAPE
};

/// A step of two sequences: A's 9-token prompt chunk after 4 stored tokens (blocks
/// [5, 1, 3, 0] of 4), B's one decode token at position 6 (blocks [2, 4]); both want
/// logits.
fn step() -> StepDesc {
    let mut d = StepDesc::default();
    d.push_seq(&[5, 1, 3, 0], 4, 4, &[3, 1, 4, 1, 5, 9, 2, 6, 5], true)
        .unwrap();
    d.push_seq(&[2, 4], 4, 6, &[7], true).unwrap();
    d
}

/// Every operation's outputs on the host.
#[derive(Debug)]
struct Outputs {
    embed: Vec<f32>,
    norm: Vec<f32>,
    qkv: [Vec<f32>; 3],
    float_product: Vec<f32>,
    kquant_products: Vec<Vec<f32>>,
    bias: Vec<f32>,
    head_norm: Vec<f32>,
    scaled: Vec<f32>,
    gelu: Vec<f32>,
    attention_swa: Vec<f32>,
    rope_q: Vec<f32>,
    kv_export: Vec<u8>,
    attention: Vec<f32>,
    silu: Vec<f32>,
    add: Vec<f32>,
    gathered: Vec<f32>,
}

fn run<B: Backend>(b: &B) -> Outputs {
    let mut rng = Rng(42);
    let n = step().len();
    let embd = b
        .load_weight(&matrix(&mut rng, GgmlType::Q8_0, 16, DIM))
        .unwrap();
    let (q_dim, kv_dim) = (SHAPE.q_dim(), SHAPE.kv_dim());
    let wq = b
        .load_weight(&matrix(&mut rng, GgmlType::Q4_1, q_dim, DIM))
        .unwrap();
    let wk = b
        .load_weight(&matrix(&mut rng, GgmlType::Q4_0, kv_dim, DIM))
        .unwrap();
    let wv = b
        .load_weight(&matrix(&mut rng, GgmlType::Q8_0, kv_dim, DIM))
        .unwrap();
    let wf = b
        .load_weight(&matrix(&mut rng, GgmlType::F16, FFN, DIM))
        .unwrap();
    let norm_w = b.upload(&rng.vec(DIM, 1.0)).unwrap();
    let table = RopeTable::new(RopeStyle::Normal, 32, 10000.0, 64).unwrap();
    let rope = b.load_rope(&table).unwrap();
    let spec = PagedKvSpec {
        ty: GgmlType::F16,
        n_layers: 2,
        kv_dim,
        block_tokens: 4,
        n_blocks: 6,
    };
    let mut kv = b.alloc_kv(&spec).unwrap();
    // Buffers longer than the step, as the forward pass's are.
    let cap = n + 5;
    let mut scratch = b.scratch(cap * FFN).unwrap();
    let buf = |w: usize| b.zeros(cap * w).unwrap();
    let (mut x, mut h) = (buf(DIM), buf(DIM));
    let (mut q, mut k, mut v) = (buf(q_dim), buf(kv_dim), buf(kv_dim));
    let (mut f, mut att, mut last) = (buf(FFN), buf(q_dim), buf(DIM));

    // Stored positions the step attends to: sequence A's first 4 tokens, B's first 6,
    // written through a step of their own (layer 1 of the pool).
    let mut history = StepDesc::default();
    history
        .push_seq(&[5, 1, 3, 0], 4, 0, &[1; 4], false)
        .unwrap();
    history.push_seq(&[2, 4], 4, 0, &[2; 6], false).unwrap();
    let hk = b.upload(&rng.vec(10 * kv_dim, 1.0)).unwrap();
    let hv = b.upload(&rng.vec(10 * kv_dim, 1.0)).unwrap();
    let hist = b.prepare_step(history, &kv).unwrap();
    b.kv_store(&mut kv, 1, &hk, &hv, &hist, 10).unwrap();
    b.finish_step(hist).unwrap();

    let st = b.prepare_step(step(), &kv).unwrap();
    b.embed(&embd, &st, n, &mut x).unwrap();
    let embed = b.to_host(&x, n * DIM).unwrap();
    // Larger values, so that norms and products are not all near zero.
    let big = b.upload(&rng.vec(cap * DIM, 3.0)).unwrap();
    b.add(&mut x, &big, n * DIM).unwrap();
    let add = b.to_host(&x, n * DIM).unwrap();
    b.rmsnorm(&x, &norm_w, 1e-5, n, &mut h).unwrap();
    let norm = b.to_host(&h, n * DIM).unwrap();
    b.matmul(
        [&wq, &wk, &wv],
        &h,
        n,
        [&mut q, &mut k, &mut v],
        &mut scratch,
    )
    .unwrap();
    let qkv = [
        b.to_host(&q, n * q_dim).unwrap(),
        b.to_host(&k, n * kv_dim).unwrap(),
        b.to_host(&v, n * kv_dim).unwrap(),
    ];
    b.matmul([&wf], &h, n, [&mut f], &mut scratch).unwrap();
    let float_product = b.to_host(&f, n * FFN).unwrap();
    // Q4_K, Q5_K, Q6_K and Q5_0, Q5_1 weights of one input: Q8K and Q8 blocks of it side
    // by side in the scratch. Row counts not a multiple of the 8 warps of a block.
    let ktypes = [
        (GgmlType::Q4_K, 40),
        (GgmlType::Q5_K, 24),
        (GgmlType::Q6_K, 33),
        (GgmlType::Q5_0, 17),
        (GgmlType::Q5_1, 9),
    ];
    let kw: Vec<_> = ktypes
        .iter()
        .map(|&(ty, rows)| b.load_weight(&matrix(&mut rng, ty, rows, KDIM)).unwrap())
        .collect();
    let kx = b.upload(&rng.vec(cap * KDIM, 2.0)).unwrap();
    let mut kout: Vec<_> = ktypes.iter().map(|&(_, rows)| buf(rows)).collect();
    let mut kscratch = b.scratch(cap * KDIM).unwrap();
    {
        let [o0, o1, o2, o3, o4] = &mut kout[..] else {
            unreachable!()
        };
        b.matmul(
            [&kw[0], &kw[1], &kw[2], &kw[3], &kw[4]],
            &kx,
            n,
            [o0, o1, o2, o3, o4],
            &mut kscratch,
        )
        .unwrap();
    }
    let kquant_products = kout
        .iter()
        .zip(&ktypes)
        .map(|(o, &(_, rows))| b.to_host(o, n * rows).unwrap())
        .collect();
    // From here on the reference's own values, so that each operation is compared on
    // identical inputs.
    let (qh, kh, vh) = (
        b.upload(&padded(&qkv[0], cap * q_dim)).unwrap(),
        b.upload(&padded(&qkv[1], cap * kv_dim)).unwrap(),
        b.upload(&padded(&qkv[2], cap * kv_dim)).unwrap(),
    );
    (q, k, v) = (qh, kh, vh);
    // Qwen2's projection bias, Qwen3's / Gemma 3's per-head norm of K, Gemma's embedding
    // scale, on inputs of their own (the same on every backend: exact comparisons).
    let mut biased = b.upload(&rng.vec(cap * q_dim, 3.0)).unwrap();
    let qbias = b.upload(&rng.vec(q_dim, 1.0)).unwrap();
    b.add_bias(&mut biased, &qbias, n).unwrap();
    let bias = b.to_host(&biased, n * q_dim).unwrap();
    let mut normed = b.upload(&rng.vec(cap * kv_dim, 3.0)).unwrap();
    let head_w = b.upload(&rng.vec(SHAPE.head_dim, 1.0)).unwrap();
    b.rmsnorm_in_place(&mut normed, &head_w, 1e-6, n * SHAPE.n_kv_heads)
        .unwrap();
    let head_norm = b.to_host(&normed, n * kv_dim).unwrap();
    let mut scaled = b.upload(&rng.vec(cap * q_dim, 3.0)).unwrap();
    b.scale(&mut scaled, (DIM as f32).sqrt(), n * q_dim)
        .unwrap();
    let scaled = b.to_host(&scaled, n * q_dim).unwrap();
    b.rope(&mut q, n, SHAPE.n_heads, SHAPE.head_dim, &st, &rope)
        .unwrap();
    b.rope(&mut k, n, SHAPE.n_kv_heads, SHAPE.head_dim, &st, &rope)
        .unwrap();
    let rope_q = b.to_host(&q, n * q_dim).unwrap();
    b.kv_store(&mut kv, 1, &k, &v, &st, n).unwrap();
    b.attention(&SHAPE, &q, &st, &kv, 1, &mut att).unwrap();
    let attention = b.to_host(&att, n * q_dim).unwrap();
    b.attention(&SWA, &q, &st, &kv, 1, &mut att).unwrap();
    let attention_swa = b.to_host(&att, n * q_dim).unwrap();
    let mut kv_export = b"TKV1".to_vec();
    b.kv_gather(&kv, &[5, 1, 3, 0], 13, &mut kv_export).unwrap();
    b.kv_gather(&kv, &[2, 4], 7, &mut kv_export).unwrap();
    let mut up = b.upload(&rng.vec(cap * FFN, 2.0)).unwrap();
    b.silu_mul(&mut f, &up, n * FFN).unwrap();
    let silu = b.to_host(&f, n * FFN).unwrap();
    let mut gate = b.upload(&rng.vec(cap * FFN, 4.0)).unwrap();
    b.gelu_mul(&mut gate, &up, n * FFN).unwrap();
    let gelu = b.to_host(&gate, n * FFN).unwrap();
    b.gather_wanted(&x, &st, 2, DIM, &mut last).unwrap();
    let gathered = b.to_host(&last, 2 * DIM).unwrap();
    // Shapes a caller gets wrong are errors, not out-of-bounds accesses.
    assert!(b.rmsnorm(&x, &norm_w, 1e-5, cap + 1, &mut h).is_err());
    assert!(b.silu_mul(&mut f, &up, cap * FFN + 1).is_err());
    assert!(b.kv_gather(&kv, &[5, 9], 7, &mut Vec::new()).is_err());
    up = b.zeros(1).unwrap();
    assert!(b.add(&mut x, &up, 2).is_err());
    b.finish_step(st).unwrap();

    // The transfer body back into other blocks of a fresh pool reads back the same.
    let mut kv2 = b.alloc_kv(&spec).unwrap();
    let body_a = &kv_export[4..4 + 2 * 2 * 13 * spec.row_bytes().unwrap()];
    b.kv_scatter(&mut kv2, &[0, 2, 4, 1], 13, body_a).unwrap();
    let mut again = Vec::new();
    b.kv_gather(&kv2, &[0, 2, 4, 1], 13, &mut again).unwrap();
    assert_eq!(again, body_a, "{}: KV transfer round trip", b.name());
    Outputs {
        embed,
        norm,
        qkv,
        float_product,
        kquant_products,
        bias,
        head_norm,
        scaled,
        gelu,
        attention_swa,
        rope_q,
        kv_export,
        attention,
        silu,
        add,
        gathered,
    }
}

fn padded(v: &[f32], n: usize) -> Vec<f32> {
    let mut p = v.to_vec();
    p.resize(n, 0.0);
    p
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(1f32, |m, v| m.max(v.abs()))
}

fn compare(name: &str, got: &Outputs, want: &Outputs) {
    // The reference computed something: no output is all zeros.
    for (what, v) in [
        ("embed", &want.embed),
        ("rmsnorm", &want.norm),
        ("matmul", &want.qkv[1]),
        ("float matmul", &want.float_product),
        ("rope", &want.rope_q),
        ("attention", &want.attention),
        ("windowed attention", &want.attention_swa),
        ("per-head norm", &want.head_norm),
        ("gelu", &want.gelu),
        ("silu", &want.silu),
        ("gathered", &want.gathered),
    ] {
        assert!(
            v.iter().any(|x| x.abs() > 1e-3),
            "reference {what} is all zeros"
        );
    }
    let close = |what: &str, g: &[f32], w: &[f32], tol: f32| {
        let d = max_diff(g, w);
        assert!(d <= tol, "{name} {what}: max diff {d} > {tol}");
    };
    assert_eq!(got.embed, want.embed, "{name} embed");
    assert_eq!(got.add, want.add, "{name} add");
    close("rmsnorm", &got.norm, &want.norm, 1e-5 * max_abs(&want.norm));
    for (i, (g, w)) in got.qkv.iter().zip(&want.qkv).enumerate() {
        close(&format!("matmul {i}"), g, w, 1e-3 * max_abs(w));
    }
    close(
        "float matmul",
        &got.float_product,
        &want.float_product,
        1e-3 * max_abs(&want.float_product),
    );
    close(
        "rope",
        &got.rope_q,
        &want.rope_q,
        1e-5 * max_abs(&want.rope_q),
    );
    close("attention", &got.attention, &want.attention, 2e-4);
    close(
        "windowed attention",
        &got.attention_swa,
        &want.attention_swa,
        2e-4,
    );
    // The window changed what the queries past it see (and not what the first two see).
    let d = max_diff(&want.attention_swa, &want.attention);
    assert!(d > 1e-2, "the window changed nothing ({d})");
    let first_two = 2 * SHAPE.q_dim();
    assert_eq!(
        want.attention_swa[..first_two],
        want.attention[..first_two],
        "queries inside the window"
    );
    for (i, (g, w)) in got
        .kquant_products
        .iter()
        .zip(&want.kquant_products)
        .enumerate()
    {
        assert!(
            w.iter().any(|x| x.abs() > 1e-3),
            "K-quant product {i} all zeros"
        );
        close(&format!("K-quant product {i}"), g, w, 1e-3 * max_abs(w));
    }
    assert_eq!(got.bias, want.bias, "{name} add_bias");
    assert_eq!(got.scaled, want.scaled, "{name} scale");
    close(
        "rmsnorm in place",
        &got.head_norm,
        &want.head_norm,
        1e-5 * max_abs(&want.head_norm),
    );
    close(
        "gelu_mul",
        &got.gelu,
        &want.gelu,
        1e-5 * max_abs(&want.gelu),
    );
    close(
        "silu_mul",
        &got.silu,
        &want.silu,
        1e-5 * max_abs(&want.silu),
    );
    assert_eq!(got.gathered, want.gathered, "{name} gathered rows");
    // K rows went through rope on both sides; the stored F16 rows of the reference's
    // inputs may round differently only where rope's last bit differs.
    assert_eq!(got.kv_export.len(), want.kv_export.len());
    let (g16, w16) = (halves(&got.kv_export[4..]), halves(&want.kv_export[4..]));
    close("KV store + export", &g16, &w16, 1e-3 * max_abs(&w16));
}

fn halves(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|h| half::f16::from_le_bytes([h[0], h[1]]).to_f32())
        .collect()
}

fn reference() -> Outputs {
    run(&CpuBackend::new(Arc::new(ScalarKernels)))
}

#[test]
fn optimized_cpu_backend_matches_the_scalar_reference_op_by_op() {
    let want = reference();
    for (name, k) in [
        ("cpu-simd", CpuKernels::with_simd(true)),
        ("cpu-portable", CpuKernels::with_simd(false)),
    ] {
        compare(name, &run(&CpuBackend::new(Arc::new(k))), &want);
    }
}

#[cfg(feature = "gpu-tests")]
#[test]
fn cuda_backend_matches_the_scalar_reference_op_by_op() {
    let b = tandem_kernels::cuda::CudaBackend::new(0).unwrap_or_else(|e| {
        panic!(
            "GPU test run without a usable CUDA device: {e} (run tests/gpu/run.sh on a GPU machine)"
        )
    });
    compare("cuda", &run(&b), &reference());
}
