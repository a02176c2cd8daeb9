//! One batched forward step. All tokens of all sequences in the batch form one matrix, so
//! each weight matrix is read once per step whatever the batch size.

use tandem_kernels::cpu::ThreadPool;
use tandem_kernels::{AttnQuery, AttnShape, Kernels, RopeTable};

use super::config::LlamaConfig;
use super::kv_cache::PagedKvCache;
use super::weights::Weights;
use crate::engine_api::SeqId;
use crate::error::Result;

/// Where each token of the flattened batch goes.
pub(crate) struct TokenSlot {
    pub seq: SeqId,
    pub pos: usize,
    pub token: u32,
}

/// Activation buffers, kept between steps so that steady-state decoding does not allocate.
#[derive(Default)]
pub(crate) struct Buffers {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Output logits: every element is written by the matmul, so it is only resized
    /// (never cleared) between steps.
    logits: Vec<f32>,
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

pub(crate) struct Forward<'a> {
    pub cfg: &'a LlamaConfig,
    pub w: &'a Weights,
    pub rope: &'a RopeTable,
    pub k: &'a dyn Kernels,
}

impl Forward<'_> {
    /// Run `slots` through the model, writing their K/V into `kv` (capacity already
    /// reserved), and return the final hidden state (after the output norm) of the tokens
    /// listed in `want` (indices into `slots`), as rows of `dim`.
    pub fn run(
        &self,
        slots: &[TokenSlot],
        kv: &mut PagedKvCache,
        want: &[usize],
        b: &mut Buffers,
    ) -> Result<Vec<f32>> {
        let (c, k, file) = (self.cfg, self.k, self.w.file());
        let n = slots.len();
        let (dim, qd, kvd, ffn) = (c.dim, c.q_dim(), c.kv_dim(), c.ffn_dim);
        let positions: Vec<usize> = slots.iter().map(|s| s.pos).collect();
        let seq_pos: Vec<(SeqId, usize)> = slots.iter().map(|s| (s.seq, s.pos)).collect();
        let shape = AttnShape {
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
        };

        let x = sized(&mut b.x, n * dim);
        let embd = self.w.token_embd.matrix(file);
        for (row, s) in x.chunks_exact_mut(dim).zip(slots) {
            tandem_kernels::dequantize_row(embd.ty, embd.row(s.token as usize), row)?;
        }

        for (l, lw) in self.w.layers.iter().enumerate() {
            let h = sized(&mut b.h, n * dim);
            k.rmsnorm(&b.x, &lw.attn_norm, c.rms_eps, h)?;
            let (q, kk, vv) = (
                sized(&mut b.q, n * qd),
                sized(&mut b.k, n * kvd),
                sized(&mut b.v, n * kvd),
            );
            k.matmul(
                &[lw.wq.matrix(file), lw.wk.matrix(file), lw.wv.matrix(file)],
                h,
                n,
                &mut [q, kk, vv],
            )?;
            k.rope(&mut b.q, c.n_heads, c.head_dim, &positions, self.rope)?;
            k.rope(&mut b.k, c.n_kv_heads, c.head_dim, &positions, self.rope)?;
            kv.write_batch(l, &seq_pos, &b.k, &b.v, ThreadPool::global())?;
            let queries: Vec<AttnQuery<'_>> = slots
                .iter()
                .map(|s| AttnQuery {
                    block_table: kv.block_table(s.seq),
                    n_ctx: s.pos + 1,
                })
                .collect();
            let (kview, vview) = kv.views(l);
            let att = sized(&mut b.att, n * qd);
            k.attention(&shape, &b.q, &queries, &kview, &vview, att)?;
            let o = sized(&mut b.o, n * dim);
            k.matmul(&[lw.wo.matrix(file)], att, n, &mut [o])?;
            b.x.iter_mut().zip(b.o.iter()).for_each(|(x, o)| *x += o);

            let h = sized(&mut b.h, n * dim);
            k.rmsnorm(&b.x, &lw.ffn_norm, c.rms_eps, h)?;
            let (g, u) = (sized(&mut b.gate, n * ffn), sized(&mut b.up, n * ffn));
            k.matmul(
                &[lw.w_gate.matrix(file), lw.w_up.matrix(file)],
                h,
                n,
                &mut [g, u],
            )?;
            k.silu_mul(&mut b.gate, &b.up)?;
            let o = sized(&mut b.o, n * dim);
            k.matmul(&[lw.w_down.matrix(file)], &b.gate, n, &mut [o])?;
            b.x.iter_mut().zip(b.o.iter()).for_each(|(x, o)| *x += o);
        }

        let mut last = Vec::with_capacity(want.len() * dim);
        for &i in want {
            last.extend_from_slice(&b.x[i * dim..(i + 1) * dim]);
        }
        let mut normed = vec![0f32; last.len()];
        k.rmsnorm(&last, &self.w.output_norm, c.rms_eps, &mut normed)?;
        Ok(normed)
    }

    /// Logits for rows of final hidden states.
    pub fn logits<'b>(&self, hidden: &[f32], b: &'b mut Buffers) -> Result<&'b [f32]> {
        let n = hidden.len() / self.cfg.dim;
        let out = sized(&mut b.logits, n * self.cfg.vocab_size);
        self.k.matmul(
            &[self.w.output.matrix(self.w.file())],
            hidden,
            n,
            &mut [&mut *out],
        )?;
        Ok(out)
    }
}
