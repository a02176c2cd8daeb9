//! The forward pass: the only one, for every backend. All tokens of all sequences in a
//! step form one matrix, so each weight matrix is read once per step whatever the batch
//! size; every operation is a [`Backend`] kernel over the backend's own buffers, so on a
//! GPU the whole pass stays on the device (and can be captured into a CUDA graph: it only
//! enqueues kernels, it never allocates, copies or waits).

use tandem_kernels::{AttnShape, Backend, RopeTable};

use super::arch::Activation;
use super::config::ModelConfig;
use super::weights::Weights;
use crate::error::{Context, Result};

/// One layer's weights on a backend; the optional ones are there when the architecture
/// and the file have them (see `super::arch`).
pub struct LayerOn<B: Backend> {
    pub attn_norm: B::Buf,
    pub wq: B::Weight,
    pub wk: B::Weight,
    pub wv: B::Weight,
    pub wo: B::Weight,
    /// Q, K and V biases.
    pub qkv_bias: Option<[B::Buf; 3]>,
    pub wo_bias: Option<B::Buf>,
    /// Per-head RMS norms of Q and K.
    pub qk_norm: Option<[B::Buf; 2]>,
    pub post_attn_norm: Option<B::Buf>,
    pub ffn_norm: B::Buf,
    pub w_gate: B::Weight,
    pub w_up: B::Weight,
    pub w_down: B::Weight,
    pub post_ffn_norm: Option<B::Buf>,
}

/// The model on a backend: its hyperparameters and every weight in the backend's form
/// (the mapped file's bytes for the CPU, device copies for CUDA).
pub struct ModelWeights<B: Backend> {
    pub cfg: ModelConfig,
    pub token_embd: B::Weight,
    /// `None` when the output projection is the token embedding (tied), so that it is
    /// not held twice.
    pub output: Option<B::Weight>,
    pub output_norm: B::Buf,
    pub layers: Vec<LayerOn<B>>,
    /// The RoPE tables of `cfg.ropes`; layer `l` uses `ropes[cfg.layers[l].rope]`.
    pub ropes: Vec<B::Rope>,
}

/// The RoPE tables of `cfg` (its specs, with the file's frequency factors where a spec
/// asks for them), for positions below the context length.
pub fn rope_tables(cfg: &ModelConfig, factors: Option<&[f32]>) -> Result<Vec<RopeTable>> {
    cfg.ropes
        .iter()
        .map(|r| {
            let f = if r.factors { factors } else { None };
            RopeTable::scaled(
                cfg.rope_style(),
                cfg.rope_dim,
                r.base,
                r.freq_scale,
                f,
                cfg.context_length,
            )
            .context("building the RoPE table")
        })
        .collect()
}

impl<B: Backend> ModelWeights<B> {
    pub fn load(b: &B, w: &Weights, cfg: &ModelConfig, ropes: &[RopeTable]) -> Result<Self> {
        let bytes = w.bytes();
        let load = |name: &str, r: &super::weights::WeightRef| -> Result<B::Weight> {
            let what = || format!("loading {name} onto the {} backend", b.name());
            let m = r.host(&bytes).with_context(what)?;
            let loaded = b.load_weight(&m).with_context(what)?;
            // A copy (repacked, uploaded) no longer reads the file: its pages can go.
            if !b.holds_host_bytes(&m) {
                w.release(name, r);
            }
            Ok(loaded)
        };
        let vector = |name: &str, v: &[f32]| {
            b.upload(v)
                .with_context(|| format!("loading {name} onto the {} backend", b.name()))
        };
        let opt =
            |name: &str, v: &Option<Vec<f32>>| v.as_deref().map(|v| vector(name, v)).transpose();
        let tied = w.output.same_place(&w.token_embd);
        let token_embd = if tied {
            load("token_embd.weight", &w.token_embd)?
        } else {
            // Only looked up a row at a time: no repacking for products.
            w.token_embd
                .host(&bytes)
                .and_then(|m| b.load_table(&m))
                .with_context(|| {
                    format!("loading token_embd.weight onto the {} backend", b.name())
                })?
        };
        let output = if tied {
            None
        } else {
            Some(load("output.weight", &w.output)?)
        };
        let layers = w
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let n = |s: &str| format!("blk.{i}.{s}.weight");
                let bias = |s: &str| format!("blk.{i}.{s}.bias");
                let qkv_bias = match &l.qkv_bias {
                    Some(bs) => Some([
                        vector(&bias("attn_q"), &bs.q)?,
                        vector(&bias("attn_k"), &bs.k)?,
                        vector(&bias("attn_v"), &bs.v)?,
                    ]),
                    None => None,
                };
                let qk_norm = match (&l.q_norm, &l.k_norm) {
                    (Some(q), Some(k)) => {
                        Some([vector(&n("attn_q_norm"), q)?, vector(&n("attn_k_norm"), k)?])
                    }
                    _ => None,
                };
                Ok(LayerOn {
                    attn_norm: vector(&n("attn_norm"), &l.attn_norm)?,
                    wq: load(&n("attn_q"), &l.wq)?,
                    wk: load(&n("attn_k"), &l.wk)?,
                    wv: load(&n("attn_v"), &l.wv)?,
                    wo: load(&n("attn_output"), &l.wo)?,
                    qkv_bias,
                    wo_bias: opt(&bias("attn_output"), &l.wo_bias)?,
                    qk_norm,
                    post_attn_norm: opt(&n("post_attention_norm"), &l.post_attn_norm)?,
                    ffn_norm: vector(&n("ffn_norm"), &l.ffn_norm)?,
                    w_gate: load(&n("ffn_gate"), &l.w_gate)?,
                    w_up: load(&n("ffn_up"), &l.w_up)?,
                    w_down: load(&n("ffn_down"), &l.w_down)?,
                    post_ffn_norm: opt(&n("post_ffw_norm"), &l.post_ffn_norm)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cfg: cfg.clone(),
            token_embd,
            output,
            output_norm: vector("output_norm.weight", &w.output_norm)?,
            layers,
            ropes: ropes
                .iter()
                .map(|r| b.load_rope(r).context("loading the rope table"))
                .collect::<Result<_>>()?,
        })
    }

    /// The output projection (the token embedding when tied).
    pub fn output(&self) -> &B::Weight {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }
}

/// Activation buffers sized for `cap` tokens and `want_cap` logits rows; grown (never
/// shrunk) when a step is larger, so that steady-state steps allocate nothing. Logits are
/// sized apart because a long prompt chunk needs one row, not one per token.
pub struct Activations<B: Backend> {
    cap: usize,
    want_cap: usize,
    x: B::Buf,
    h: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    att: B::Buf,
    o: B::Buf,
    gate: B::Buf,
    up: B::Buf,
    last: B::Buf,
    normed: B::Buf,
    logits: B::Buf,
    scratch: B::Scratch,
}

/// New (token, logits-row) capacities when a step of `n` tokens and `nw` logits rows does
/// not fit `(cap, want_cap)`; they only grow, to powers of two.
pub(crate) fn grown_caps(
    cap: usize,
    want_cap: usize,
    n: usize,
    nw: usize,
) -> Option<(usize, usize)> {
    (n > cap || nw > want_cap).then(|| {
        (
            n.max(cap).next_power_of_two(),
            nw.max(want_cap).next_power_of_two(),
        )
    })
}

impl<B: Backend> Activations<B> {
    pub fn new(b: &B, c: &ModelConfig, cap: usize, want_cap: usize) -> Result<Self> {
        let widest = c.dim.max(c.q_dim()).max(c.ffn_dim);
        let buf = |n: usize| b.zeros(n).context("allocating activation buffers");
        Ok(Self {
            cap,
            want_cap,
            x: buf(cap * c.dim)?,
            h: buf(cap * c.dim)?,
            q: buf(cap * c.q_dim())?,
            k: buf(cap * c.kv_dim())?,
            v: buf(cap * c.kv_dim())?,
            att: buf(cap * c.q_dim())?,
            o: buf(cap * c.dim)?,
            gate: buf(cap * c.ffn_dim)?,
            up: buf(cap * c.ffn_dim)?,
            last: buf(want_cap * c.dim)?,
            normed: buf(want_cap * c.dim)?,
            logits: buf(want_cap * c.vocab_size)?,
            scratch: b
                .scratch(cap * widest)
                .context("allocating activation buffers")?,
        })
    }

    /// Make room for `n` tokens and `nw` logits rows; `true` when the buffers were
    /// reallocated (they moved: anything holding their addresses, such as a CUDA graph,
    /// is stale).
    pub fn ensure(&mut self, b: &B, c: &ModelConfig, n: usize, nw: usize) -> Result<bool> {
        match grown_caps(self.cap, self.want_cap, n, nw) {
            Some((cap, want_cap)) => {
                *self = Self::new(b, c, cap, want_cap)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// (tokens, logits rows) the buffers hold.
    pub fn caps(&self) -> (usize, usize) {
        (self.cap, self.want_cap)
    }

    /// Logits of the last step's wanted tokens, rows of `vocab_size` in order.
    pub fn logits(&self) -> &B::Buf {
        &self.logits
    }
}

/// Run `n` step tokens through the model, writing their K/V into `kv` (at the slots of
/// `step`, reserved by the caller), and leave the logits of the step's first `nw` wanted
/// tokens in `a.logits()`.
pub fn forward<B: Backend>(
    b: &B,
    m: &ModelWeights<B>,
    kv: &mut B::Kv,
    a: &mut Activations<B>,
    step: &B::Step,
    n: usize,
    nw: usize,
) -> Result<()> {
    let c = &m.cfg;
    let (dim, ffn, eps, hd) = (c.dim, c.ffn_dim, c.rms_eps, c.head_dim);
    b.embed(&m.token_embd, step, n, &mut a.x)?;
    if let Some(s) = c.embed_scale {
        b.scale(&mut a.x, s, n * dim)?;
    }
    for (l, lw) in m.layers.iter().enumerate() {
        let spec = c.layers[l];
        let rope = &m.ropes[spec.rope];
        b.rmsnorm(&a.x, &lw.attn_norm, eps, n, &mut a.h)?;
        b.matmul(
            [&lw.wq, &lw.wk, &lw.wv],
            &a.h,
            n,
            [&mut a.q, &mut a.k, &mut a.v],
            &mut a.scratch,
        )?;
        if let Some([bq, bk, bv]) = &lw.qkv_bias {
            b.add_bias(&mut a.q, bq, n)?;
            b.add_bias(&mut a.k, bk, n)?;
            b.add_bias(&mut a.v, bv, n)?;
        }
        if let Some([qn, kn]) = &lw.qk_norm {
            b.rmsnorm_in_place(&mut a.q, qn, eps, n * c.n_heads)?;
            b.rmsnorm_in_place(&mut a.k, kn, eps, n * c.n_kv_heads)?;
        }
        b.rope(&mut a.q, n, c.n_heads, hd, step, rope)?;
        b.rope(&mut a.k, n, c.n_kv_heads, hd, step, rope)?;
        if let Some(s) = c.q_scale {
            b.scale(&mut a.q, s, n * c.q_dim())?;
        }
        b.kv_store(kv, l, &a.k, &a.v, step, n)?;
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: hd,
            window: spec.window,
        };
        b.attention(&shape, &a.q, step, kv, l, &mut a.att)?;
        b.matmul([&lw.wo], &a.att, n, [&mut a.o], &mut a.scratch)?;
        if let Some(bo) = &lw.wo_bias {
            b.add_bias(&mut a.o, bo, n)?;
        }
        residual(
            b,
            &mut a.x,
            &a.o,
            lw.post_attn_norm.as_ref(),
            eps,
            n,
            dim,
            &mut a.h,
        )?;

        b.rmsnorm(&a.x, &lw.ffn_norm, eps, n, &mut a.h)?;
        b.matmul(
            [&lw.w_gate, &lw.w_up],
            &a.h,
            n,
            [&mut a.gate, &mut a.up],
            &mut a.scratch,
        )?;
        match c.activation() {
            Activation::Silu => b.silu_mul(&mut a.gate, &a.up, n * ffn)?,
            Activation::GeluTanh => b.gelu_mul(&mut a.gate, &a.up, n * ffn)?,
        }
        b.matmul([&lw.w_down], &a.gate, n, [&mut a.o], &mut a.scratch)?;
        residual(
            b,
            &mut a.x,
            &a.o,
            lw.post_ffn_norm.as_ref(),
            eps,
            n,
            dim,
            &mut a.h,
        )?;
    }
    if nw > 0 {
        b.gather_wanted(&a.x, step, nw, dim, &mut a.last)?;
        b.rmsnorm(&a.last, &m.output_norm, eps, nw, &mut a.normed)?;
        b.matmul([m.output()], &a.normed, nw, [&mut a.logits], &mut a.scratch)?;
    }
    Ok(())
}

/// `x += y`, or `x += rmsnorm(y, post)` with a sandwich norm (normed through `tmp`).
#[allow(clippy::too_many_arguments)]
fn residual<B: Backend>(
    b: &B,
    x: &mut B::Buf,
    y: &B::Buf,
    post: Option<&B::Buf>,
    eps: f32,
    n: usize,
    dim: usize,
    tmp: &mut B::Buf,
) -> Result<()> {
    match post {
        Some(w) => {
            b.rmsnorm(y, w, eps, n, tmp)?;
            b.add(x, tmp, n * dim)?;
        }
        None => b.add(x, y, n * dim)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_grow_only_when_needed_to_powers_of_two() {
        assert_eq!(grown_caps(64, 32, 64, 32), None);
        assert_eq!(grown_caps(64, 32, 65, 1), Some((128, 32)));
        assert_eq!(grown_caps(64, 32, 1, 33), Some((64, 64)));
        assert_eq!(grown_caps(64, 32, 300, 40), Some((512, 64)));
        assert_eq!(grown_caps(0, 0, 1, 0), Some((1, 1)));
    }
}
