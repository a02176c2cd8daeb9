//! Attention on the CPU pool: which task reads which KV rows.
//!
//! The paged pool stores a token's KV heads side by side, so a task that handles one KV
//! head reads a slice of every row: with SmolLM2's F16 KV, 2 of every 6 cache lines, with
//! gaps. A decode step at a long context is mostly such reads (32 sequences × 480
//! positions is 354 MB of K and V per step), and on the 2-core EPYC this was measured on,
//! head-sliced reads stream at 5–6 GB/s where whole rows stream at 14–16 GB/s (a C probe
//! of the two access patterns over 30 layers' pools; the attention kernels alone showed
//! the same 5 GB/s).
//!
//! So a batch with enough queries to keep every thread busy runs one task per query: it
//! walks the context [`CHUNK`] positions at a time and, within a chunk, does every KV head
//! before moving on, so each chunk's rows are read whole, once. A smaller batch keeps one
//! task per (query, KV head), so a single sequence still spreads over three threads.
//!
//! Both shapes run the same kernels on the same rows in the same order: a row's score
//! depends only on that row, chunks start at multiples of 8 (the scores kernel's group),
//! and the weighted sum over V continues from the stored accumulator chunk after chunk,
//! which adds the same terms in the same order as one pass. A query's output is therefore
//! the same bits whichever shape its batch took (batch invariance); a test checks it.
//!
//! A sliding window (`AttnShape::window`) only moves where both shapes start: positions
//! `first_pos(n_ctx)..n_ctx`, read in the same order by both.

use super::{CpuKernels, SCRATCH, fill_offsets, grow};
use crate::api::{AttnQuery, AttnShape, Kernels as _, KvView};
use crate::error::Result;
use crate::reference::ScalarKernels;
use crate::types::GgmlType;

/// Positions per chunk of a per-query task: two 16-token blocks, whose K (or V) rows for
/// all heads (12 KB for SmolLM2 with F16 KV) stay in L1 while every head uses them. A
/// multiple of 8, the scores kernel's group of rows, so chunking never regroups a row.
#[cfg(target_arch = "x86_64")]
const CHUNK: usize = 32;

/// One attention call, as every task reads it.
struct Call<'a> {
    s: &'a AttnShape,
    q: &'a [f32],
    queries: &'a [AttnQuery<'a>],
    k: &'a KvView<'a>,
    v: &'a KvView<'a>,
    scale: f32,
    /// Bytes of a whole K row and of one head's slice of it; the same for V.
    k_row: usize,
    k_head: usize,
    v_row: usize,
    v_head: usize,
}

/// Runs a checked attention call (`check_attention` has passed).
pub(super) fn run(
    kern: &CpuKernels,
    s: &AttnShape,
    q: &[f32],
    queries: &[AttnQuery<'_>],
    k: &KvView<'_>,
    v: &KvView<'_>,
    out: &mut [f32],
) -> Result<()> {
    let hd = s.head_dim;
    let call = Call {
        s,
        q,
        queries,
        k,
        v,
        scale: 1.0 / (hd as f32).sqrt(),
        k_row: k.ty.row_bytes(s.kv_dim())?,
        k_head: k.ty.row_bytes(hd)?,
        v_row: v.ty.row_bytes(s.kv_dim())?,
        v_head: v.ty.row_bytes(hd)?,
    };
    #[cfg(target_arch = "x86_64")]
    if let Some(sx) = kern.simd
        && sx.attn_fused(k.ty, v.ty, hd, s.group())
        && queries.len() >= 2 * kern.pool.threads()
    {
        let outs: Vec<&mut [f32]> = out.chunks_mut(s.q_dim()).collect();
        kern.pool
            .for_each(outs, |qi, o| attend_query(sx, &call, qi, o));
        return Ok(());
    }
    let n_kv = s.n_kv_heads;
    let outs: Vec<&mut [f32]> = out.chunks_mut(s.group() * hd).collect();
    kern.pool
        .for_each(outs, |i, o| attend_head(kern, &call, i / n_kv, i % n_kv, o));
    Ok(())
}

/// All heads of query `qi`, reading whole KV rows a chunk at a time (see the module
/// header). Only called when [`super::simd::Avx2::attn_fused`] holds.
#[cfg(target_arch = "x86_64")]
fn attend_query(sx: super::Avx2, c: &Call<'_>, qi: usize, o: &mut [f32]) {
    let (s, k, v) = (c.s, c.k, c.v);
    let (hd, g_size, n_kv) = (s.head_dim, s.group(), s.n_kv_heads);
    let qu = &c.queries[qi];
    // Positions lo..n_ctx (a sliding window's), `n` of them; offsets of all 0..n_ctx.
    let (lo, n_ctx) = (s.first_pos(qu.n_ctx), qu.n_ctx);
    let n = n_ctx - lo;
    let q = &c.q[qi * s.q_dim()..][..s.q_dim()];
    SCRATCH.with_borrow_mut(|sc| {
        grow(&mut sc.f, s.n_heads * n);
        grow(&mut sc.offs, n_ctx + CHUNK);
        // scores[h * n + t]: query head h against position lo + t.
        let scores = &mut sc.f[..s.n_heads * n];
        let (all_rows, heads) = sc.offs.split_at_mut(n_ctx);
        let heads = &mut heads[..CHUNK];
        // Where each position's row starts (head 0), then per chunk and head the slices.
        fill_offsets(all_rows, qu.block_table, k.block_tokens, c.k_row, 0, 0);
        let rows = &all_rows[lo..];
        for t0 in (0..n).step_by(CHUNK) {
            let m = CHUNK.min(n - t0);
            for g in 0..n_kv {
                for (h, r) in heads.iter_mut().zip(&rows[t0..t0 + m]) {
                    *h = r + g * c.k_head;
                }
                let qg = &q[g * g_size * hd..(g + 1) * g_size * hd];
                let sg = &mut scores[g * g_size * n + t0..];
                let fused = sx.attn_scores(k.ty, k.data, &heads[..m], hd, qg, c.scale, sg, n);
                debug_assert!(fused, "attn_fused promised a scores kernel");
            }
        }
        for row in scores.chunks_exact_mut(n) {
            sx.softmax(row);
        }
        fill_offsets(all_rows, qu.block_table, v.block_tokens, c.v_row, 0, 0);
        let rows = &all_rows[lo..];
        for t0 in (0..n).step_by(CHUNK) {
            let m = CHUNK.min(n - t0);
            for g in 0..n_kv {
                for (h, r) in heads.iter_mut().zip(&rows[t0..t0 + m]) {
                    *h = r + g * c.v_head;
                }
                let p = &scores[g * g_size * n + t0..];
                let og = &mut o[g * g_size * hd..(g + 1) * g_size * hd];
                let fused = sx.attn_pv(v.ty, v.data, &heads[..m], hd, p, n, og, t0 > 0);
                debug_assert!(fused, "attn_fused promised a weighted-sum kernel");
            }
        }
    });
}

/// The query heads of query `qi` in KV group `g`, over its whole context, into `o` (one
/// row of `hd` per head). Fused SIMD kernels where there are some, else decoded rows.
fn attend_head(kern: &CpuKernels, c: &Call<'_>, qi: usize, g: usize, o: &mut [f32]) {
    let (hd, g_size) = (c.s.head_dim, c.s.group());
    let (k, v) = (c.k, c.v);
    let qu = &c.queries[qi];
    // Positions lo..n_ctx (a sliding window's), `n` of them; offsets of all 0..n_ctx.
    let (lo, n_ctx) = (c.s.first_pos(qu.n_ctx), qu.n_ctx);
    let n = n_ctx - lo;
    let qg = &c.q[(qi * c.s.n_heads + g * g_size) * hd..][..g_size * hd];
    SCRATCH.with_borrow_mut(|sc| {
        grow(&mut sc.f, g_size * n);
        grow(&mut sc.f2, n * hd);
        grow(&mut sc.offs, n_ctx);
        let (scores, rows) = (&mut sc.f[..g_size * n], &mut sc.f2[..n * hd]);
        let all_offs = &mut sc.offs[..n_ctx];
        fill_offsets(
            all_offs,
            qu.block_table,
            k.block_tokens,
            c.k_row,
            c.k_head,
            g,
        );
        let offs = &all_offs[lo..];
        let fused = match kern.simd {
            #[cfg(target_arch = "x86_64")]
            Some(sx) => sx.attn_scores(k.ty, k.data, offs, hd, qg, c.scale, scores, n),
            _ => false,
        };
        if !fused {
            decode_rows(kern, k.ty, k.data, offs, c.k_head, rows);
            for h in 0..g_size {
                let qh = &qg[h * hd..(h + 1) * hd];
                for (sc, row) in scores[h * n..(h + 1) * n]
                    .iter_mut()
                    .zip(rows.chunks_exact(hd))
                {
                    *sc = kern.dot_f32(qh, row) * c.scale;
                }
            }
        }
        for row in scores.chunks_exact_mut(n) {
            match kern.simd {
                #[cfg(target_arch = "x86_64")]
                Some(sx) => sx.softmax(row),
                _ => ScalarKernels.softmax(row),
            }
        }
        fill_offsets(
            all_offs,
            qu.block_table,
            v.block_tokens,
            c.v_row,
            c.v_head,
            g,
        );
        let offs = &all_offs[lo..];
        let fused = match kern.simd {
            #[cfg(target_arch = "x86_64")]
            Some(sx) => sx.attn_pv(v.ty, v.data, offs, hd, scores, n, o, false),
            _ => false,
        };
        if fused {
            return;
        }
        decode_rows(kern, v.ty, v.data, offs, c.v_head, rows);
        for h in 0..g_size {
            let (p, oh) = (&scores[h * n..(h + 1) * n], &mut o[h * hd..(h + 1) * hd]);
            match kern.simd {
                #[cfg(target_arch = "x86_64")]
                Some(sx) if hd.is_multiple_of(8) => sx.weighted_sum(p, rows, oh),
                _ => {
                    oh.fill(0.0);
                    for (pt, row) in p.iter().zip(rows.chunks_exact(hd)) {
                        oh.iter_mut().zip(row).for_each(|(a, b)| *a += pt * b);
                    }
                }
            }
        }
    });
}

/// The head slices at `offs` (`head_bytes` each), decoded into consecutive rows of `rows`.
fn decode_rows(
    kern: &CpuKernels,
    ty: GgmlType,
    data: &[u8],
    offs: &[usize],
    head_bytes: usize,
    rows: &mut [f32],
) {
    let hd = rows.len() / offs.len().max(1);
    for (row, &off) in rows.chunks_exact_mut(hd).zip(offs) {
        kern.decode_row(ty, &data[off..off + head_bytes], row);
    }
}
