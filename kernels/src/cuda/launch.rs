//! Launch geometry for every kernel: pure functions of the problem size, unit-tested on
//! the CPU. Each mirrors the thread mapping documented at the top of its `.cu` kernel.

use crate::error::{Result, shape};
use crate::types::GgmlType;

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub smem: u32,
}

impl Launch {
    fn new(grid: (usize, usize), block: u32, smem: usize) -> Result<Self> {
        // CUDA limits: grid.x < 2^31, grid.y <= 65535; 48 KiB of shared memory without
        // an opt-in attribute.
        if grid.0 == 0 || grid.1 == 0 || grid.0 >= 1 << 31 || grid.1 > 65535 {
            return Err(shape("cuda launch", format!("grid {grid:?} out of range")));
        }
        if smem > SMEM_LIMIT {
            return Err(shape(
                "cuda launch",
                format!("{smem} bytes of shared memory"),
            ));
        }
        Ok(Self {
            grid: (grid.0 as u32, grid.1 as u32, 1),
            block: (block, 1, 1),
            smem: smem as u32,
        })
    }
}

impl From<Launch> for cudarc::driver::LaunchConfig {
    fn from(l: Launch) -> Self {
        Self {
            grid_dim: l.grid,
            block_dim: l.block,
            shared_mem_bytes: l.smem,
        }
    }
}

/// Shared memory a kernel may use without `cuFuncSetAttribute`.
pub const SMEM_LIMIT: usize = 48 * 1024;
/// Threads of the element-wise kernels.
pub const ELEMWISE_THREADS: u32 = 256;
/// Tokens per row of the `mmvq` / `mmv_float` grids (`MMV_T` in matmul.cu).
pub const MMV_T: usize = 8;
/// Up to this many tokens the warp-per-row kernels beat the tiled one: the weights are read
/// once per `MMV_T` tokens either way, and `mmq`'s 64-row tiles leave most SMs idle on small
/// batches.
pub const MMV_MAX_TOKENS: usize = 16;
/// Rows and tokens per `mmq` tile (`MQ_R`, `MQ_T`).
pub const MMQ_TILE: usize = 64;
/// Queries per prefill-attention tile (`PF_Q`).
pub const PREFILL_Q: usize = 16;
/// Largest head size the attention kernels support (`ATT_MAX_DPL` · 32).
pub const MAX_HEAD_DIM: usize = 256;
/// Largest k of the top-k kernel (`TOPK_MAX`).
pub const TOPK_MAX: usize = 256;

/// One thread per element.
pub fn elementwise(n: usize) -> Result<Launch> {
    Launch::new(
        (n.div_ceil(ELEMWISE_THREADS as usize).max(1), 1),
        ELEMWISE_THREADS,
        0,
    )
}

/// One block per row (rmsnorm, gather_rows, argmax, kv gather/scatter).
pub fn per_row(rows: usize, threads: u32) -> Result<Launch> {
    Launch::new((rows, 1), threads, 0)
}

/// Embedding: x = token, y = chunks of `dim`.
pub fn embed(n_tok: usize, dim: usize) -> Result<Launch> {
    Launch::new(
        (n_tok, dim.div_ceil(ELEMWISE_THREADS as usize)),
        ELEMWISE_THREADS,
        0,
    )
}

/// One warp per 32-value block (BlockQ8) or 256-value super-block (BlockQ8K).
pub fn quantize_q8(n_blocks: usize) -> Result<Launch> {
    let warps = (ELEMWISE_THREADS / 32) as usize;
    Launch::new((n_blocks.div_ceil(warps), 1), ELEMWISE_THREADS, 0)
}

/// Which matrix kernel runs a product and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKind {
    /// Quantized weights, warp per row.
    Vector,
    /// Quantized weights, 64 × 64 shared-memory tiles.
    Tiled,
    /// Float weights against f32 activations.
    Float,
}

pub fn matmul(ty: GgmlType, rows: usize, n_tok: usize) -> Result<(MatmulKind, Launch)> {
    if ty.is_quantized() && crate::cuda::sources::Kernel::for_matmul(ty, false).is_none() {
        return Err(crate::Error::Cuda(format!(
            "no CUDA matmul kernel for {ty} weights (the CPU backend multiplies them)"
        )));
    }
    let warps = 8usize;
    let kind = if !ty.is_quantized() {
        MatmulKind::Float
    } else if n_tok <= MMV_MAX_TOKENS {
        MatmulKind::Vector
    } else {
        MatmulKind::Tiled
    };
    let l = match kind {
        MatmulKind::Vector | MatmulKind::Float => Launch::new(
            (rows.div_ceil(warps), n_tok.div_ceil(MMV_T)),
            32 * warps as u32,
            0,
        )?,
        MatmulKind::Tiled => {
            Launch::new((rows.div_ceil(MMQ_TILE), n_tok.div_ceil(MMQ_TILE)), 256, 0)?
        }
    };
    Ok((kind, l))
}

fn check_head_dim(hd: usize) -> Result<()> {
    if hd == 0 || hd > MAX_HEAD_DIM || !hd.is_multiple_of(2) {
        return Err(shape(
            "cuda attention",
            format!("head_dim {hd} (even, at most {MAX_HEAD_DIM})"),
        ));
    }
    Ok(())
}

/// Decode attention: 4 heads (warps) of one query per block.
pub fn attn_decode(n_heads: usize, n_queries: usize, hd: usize) -> Result<Launch> {
    check_head_dim(hd)?;
    Launch::new((n_heads.div_ceil(4), n_queries), 128, 4 * hd * 4)
}

fn prefill_smem(hd: usize, bk: usize) -> usize {
    (PREFILL_Q * (hd + 1) + bk * (hd + 1) + bk * hd) * 4
}

/// Positions per K/V tile of the prefill kernel: the largest of 32 / 16 / 8 (at most one
/// per lane) whose tiles fit the shared-memory limit.
pub fn prefill_bk(hd: usize) -> Result<usize> {
    check_head_dim(hd)?;
    [32, 16, 8]
        .into_iter()
        .find(|bk| prefill_smem(hd, *bk) <= SMEM_LIMIT)
        .ok_or_else(|| shape("cuda attention", format!("head_dim {hd} too large")))
}

pub fn attn_prefill(n_heads: usize, n_tiles: usize, hd: usize) -> Result<(Launch, usize)> {
    let bk = prefill_bk(hd)?;
    Ok((
        Launch::new((n_heads, n_tiles), 128, prefill_smem(hd, bk))?,
        bk,
    ))
}

/// A run of consecutive query tokens of one sequence (a prompt chunk): queries
/// `first..first + len`, their block table at `table_offset` in the concatenated tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryRun {
    pub first: usize,
    pub len: usize,
    pub table_offset: usize,
}

/// Split runs into the kernels' work lists: runs of one token go to the decode kernel
/// (their query indices), longer runs become prefill tiles `[first, count, table_offset]`
/// of at most [`PREFILL_Q`] queries.
pub fn plan_attention(runs: &[QueryRun]) -> Result<(Vec<i32>, Vec<i32>)> {
    let mut singles = Vec::new();
    let mut tiles = Vec::new();
    let int = |v: usize| {
        i32::try_from(v).map_err(|_| shape("cuda attention", format!("{v} exceeds i32")))
    };
    for r in runs {
        if r.len == 1 {
            singles.push(int(r.first)?);
            continue;
        }
        let mut at = 0;
        while at < r.len {
            let n = (r.len - at).min(PREFILL_Q);
            tiles.extend([int(r.first + at)?, int(n)?, int(r.table_offset)?]);
            at += n;
        }
    }
    Ok((singles, tiles))
}

/// KV store: one thread per (token, K|V, 32-value chunk).
pub fn kv_store(n_tok: usize, kv_dim: usize) -> Result<Launch> {
    elementwise(n_tok * 2 * kv_dim.div_ceil(32))
}

/// Top-k: one block of 1024 threads per row.
pub fn topk(rows: usize, k: usize, vocab: usize) -> Result<Launch> {
    if k == 0 || k > TOPK_MAX || k > vocab {
        return Err(shape(
            "cuda topk",
            format!("k {k} (1..={TOPK_MAX}, at most the vocabulary {vocab})"),
        ));
    }
    per_row(rows, 1024)
}

/// Candidates the device sampler materialises per row (`SAMPLE_CAP` in sampling.cu).
pub const SAMPLE_CAP: usize = TOPK_MAX;
/// u32 words of one row of sampling parameters.
pub const SAMPLE_WORDS: usize = 4;
/// The token `tandem_sample` writes for a row it leaves to the host (see sampling.cu).
pub const SAMPLE_DEFER: u32 = u32::MAX;

/// Sampling parameters of one row for `tandem_sample`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRow {
    /// `1 / temperature` computed exactly as the host sampler does; 0 (or below) is greedy.
    pub inv_temperature: f32,
    /// 0: no top-k cut.
    pub top_k: u32,
    /// 1 (or above): no nucleus cut.
    pub top_p: f32,
    /// The row's random number in `[0, 1)`, drawn on the host from the request's RNG.
    pub uniform: f32,
}

impl SampleRow {
    pub const GREEDY: SampleRow = SampleRow {
        inv_temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        uniform: 0.0,
    };
}

/// The `params` buffer of `tandem_sample`: [`SAMPLE_WORDS`] words per row (f32 bits of
/// 1/T, top_k, f32 bits of top_p, f32 bits of u).
pub fn pack_sample_rows(rows: &[SampleRow]) -> Vec<u32> {
    rows.iter()
        .flat_map(|r| {
            [
                r.inv_temperature.to_bits(),
                r.top_k,
                r.top_p.to_bits(),
                r.uniform.to_bits(),
            ]
        })
        .collect()
}

/// Sampling: one block of 1024 threads per row.
pub fn sample(rows: usize) -> Result<Launch> {
    per_row(rows, 1024)
}

/// One sequence of a decode step: its new token at `position`, its block table.
#[derive(Debug, Clone, Copy)]
pub struct DecodeRow<'a> {
    pub token: u32,
    pub position: usize,
    pub table: &'a [u32],
}

/// Host images of a decode step's fixed device buffers ([`pack_decode`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DecodePack {
    pub tokens: Vec<u32>,
    pub positions: Vec<i32>,
    /// Pool slot of each new token's KV; -1 for padding rows (the store skips them).
    pub slots: Vec<i64>,
    pub n_ctx: Vec<i32>,
    pub tbl_off: Vec<i32>,
    /// The rows' block tables (the blocks their contexts use), then one padding entry.
    pub tables: Vec<u32>,
}

/// Lay out a decode step of `rows` (one new token each) padded to `bucket` rows, for a
/// CUDA graph captured at that size: row i's query is query i. Padding rows embed token
/// 0 at position 0, store nothing (slot -1) and attend to one position of block 0; their
/// results are computed and discarded, and no kernel mixes rows, so the real rows come
/// out as without padding. Checks what the kernels cannot: block ids inside the pool of
/// `n_blocks` blocks of `block_tokens`, tables long enough, and at most `table_cap`
/// table entries.
pub fn pack_decode(
    rows: &[DecodeRow<'_>],
    bucket: usize,
    block_tokens: usize,
    n_blocks: usize,
    table_cap: usize,
) -> Result<DecodePack> {
    let bad = |m: String| shape("cuda decode inputs", m);
    if rows.is_empty() || rows.len() > bucket || block_tokens == 0 || n_blocks == 0 {
        return Err(bad(format!(
            "{} rows in a bucket of {bucket} ({n_blocks} blocks of {block_tokens})",
            rows.len()
        )));
    }
    let int = |v: usize| i32::try_from(v).map_err(|_| bad(format!("{v} exceeds i32")));
    let mut p = DecodePack::default();
    for (i, r) in rows.iter().enumerate() {
        let n_ctx = r.position + 1;
        let need = n_ctx.div_ceil(block_tokens);
        let Some(used) = r.table.get(..need) else {
            return Err(bad(format!(
                "row {i}: position {} needs {need} blocks, the table has {}",
                r.position,
                r.table.len()
            )));
        };
        if let Some(b) = used.iter().find(|b| **b as usize >= n_blocks) {
            return Err(bad(format!("row {i}: block {b} outside {n_blocks}")));
        }
        let block = used[r.position / block_tokens] as usize;
        p.tokens.push(r.token);
        p.positions.push(int(r.position)?);
        p.slots
            .push((block * block_tokens + r.position % block_tokens) as i64);
        p.n_ctx.push(int(n_ctx)?);
        p.tbl_off.push(int(p.tables.len())?);
        p.tables.extend_from_slice(used);
    }
    let pad = int(p.tables.len())?;
    p.tables.push(0);
    if p.tables.len() > table_cap {
        return Err(bad(format!(
            "{} table entries, room for {table_cap}",
            p.tables.len()
        )));
    }
    for _ in rows.len()..bucket {
        p.tokens.push(0);
        p.positions.push(0);
        p.slots.push(-1);
        p.n_ctx.push(1);
        p.tbl_off.push(pad);
    }
    Ok(p)
}

/// Bytes of `n` activation blocks (`quant::BlockQ8`, 40 bytes each).
pub fn q8_bytes(n_values: usize) -> usize {
    n_values / crate::QK * std::mem::size_of::<crate::BlockQ8>()
}

/// Bytes of the K-quants' activation blocks for `n` values (`quant::BlockQ8K`, 292 bytes
/// per 256).
pub fn q8k_bytes(n_values: usize) -> usize {
    n_values / crate::QK_K * std::mem::size_of::<crate::BlockQ8K>()
}

/// Bytes of the activation blocks of `fmt` for `n` values.
pub fn act_bytes(fmt: crate::ActFormat, n_values: usize) -> usize {
    match fmt {
        crate::ActFormat::Q8 => q8_bytes(n_values),
        crate::ActFormat::Q8K => q8k_bytes(n_values),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elementwise_covers_every_element_with_whole_blocks() {
        for n in [1, 255, 256, 257, 1 << 20] {
            let l = elementwise(n).unwrap();
            let threads = l.grid.0 as usize * l.block.0 as usize;
            assert!(threads >= n && threads - n < 256, "{n}: {l:?}");
        }
        assert_eq!(
            elementwise(0).unwrap().grid.0,
            1,
            "empty launches stay valid"
        );
    }

    #[test]
    fn matmul_picks_the_kernel_by_type_and_batch() {
        let (k, l) = matmul(GgmlType::Q4_1, 576, 1).unwrap();
        assert_eq!(k, MatmulKind::Vector);
        assert_eq!((l.grid, l.block.0), ((72, 1, 1), 256), "8 rows per block");
        let (k, l) = matmul(GgmlType::Q4_0, 1536, 16).unwrap();
        assert_eq!((k, l.grid.1), (MatmulKind::Vector, 2));
        let (k, l) = matmul(GgmlType::Q8_0, 49152, 300).unwrap();
        assert_eq!(k, MatmulKind::Tiled);
        assert_eq!(l.grid, (768, 5, 1));
        let (k, l) = matmul(GgmlType::F16, 100, 300).unwrap();
        assert_eq!((k, l.grid), (MatmulKind::Float, (13, 38, 1)));
        assert!(
            matmul(GgmlType::F32, 64, 8 * 65536).is_err(),
            "grid.y limit"
        );
    }

    #[test]
    fn prefill_tiles_fit_shared_memory() {
        assert_eq!(prefill_bk(64).unwrap(), 32);
        assert_eq!(prefill_bk(128).unwrap(), 32);
        assert_eq!(prefill_bk(256).unwrap(), 8);
        for hd in (2..=256).step_by(2) {
            let (l, bk) = attn_prefill(9, 3, hd).unwrap();
            assert!(l.smem as usize <= SMEM_LIMIT && bk <= 32, "{hd}");
        }
        assert!(prefill_bk(258).is_err());
        assert!(attn_decode(9, 1, 0).is_err());
        assert_eq!(attn_decode(9, 5, 64).unwrap().grid, (3, 5, 1));
    }

    #[test]
    fn attention_plan_splits_runs_into_singles_and_tiles() {
        let runs = [
            QueryRun {
                first: 0,
                len: 1,
                table_offset: 0,
            },
            QueryRun {
                first: 1,
                len: 35,
                table_offset: 4,
            },
            QueryRun {
                first: 36,
                len: 1,
                table_offset: 9,
            },
        ];
        let (singles, tiles) = plan_attention(&runs).unwrap();
        assert_eq!(singles, vec![0, 36]);
        assert_eq!(tiles, vec![1, 16, 4, 17, 16, 4, 33, 3, 4]);
        // Every query of the batch is covered exactly once.
        let mut seen = [0; 37];
        for q in &singles {
            seen[*q as usize] += 1;
        }
        for t in tiles.chunks(3) {
            for q in t[0]..t[0] + t[1] {
                seen[q as usize] += 1;
            }
        }
        assert!(seen.iter().all(|c| *c == 1));
    }

    #[test]
    fn topk_limits_and_buffer_sizes() {
        assert!(topk(1, 0, 10).is_err());
        assert!(topk(1, 11, 10).is_err());
        assert!(topk(1, 257, 50000).is_err());
        assert_eq!(topk(4, 50, 50000).unwrap().grid, (4, 1, 1));
        assert_eq!(q8_bytes(576), 18 * 40);
        assert_eq!(kv_store(3, 192).unwrap().grid.0, 1, "36 threads");
        assert_eq!(embed(7, 576).unwrap().grid, (7, 3, 1));
        assert_eq!(quantize_q8(18).unwrap().grid.0, 3);
    }

    #[test]
    fn sample_rows_pack_as_four_words() {
        let rows = [
            SampleRow::GREEDY,
            SampleRow {
                inv_temperature: 1.0 / 0.7,
                top_k: 40,
                top_p: 0.9,
                uniform: 0.25,
            },
        ];
        let w = pack_sample_rows(&rows);
        assert_eq!(w.len(), 2 * SAMPLE_WORDS);
        assert_eq!(&w[..4], &[0, 0, 1f32.to_bits(), 0]);
        assert_eq!(f32::from_bits(w[4]), 1.0 / 0.7);
        assert_eq!(
            (w[5], f32::from_bits(w[6]), f32::from_bits(w[7])),
            (40, 0.9, 0.25)
        );
        assert_eq!(sample(3).unwrap().grid, (3, 1, 1));
        assert_eq!(sample(3).unwrap().block.0, 1024);
        assert!(sample(0).is_err());
        assert_eq!(SAMPLE_CAP, TOPK_MAX);
    }

    #[test]
    fn decode_inputs_pack_rows_then_padding() {
        let (t0, t1) = ([7u32, 3, 9], [4u32, 5]);
        let rows = [
            DecodeRow {
                token: 11,
                position: 9, // block 2 of t0 (block size 4), offset 1
                table: &t0,
            },
            DecodeRow {
                token: 12,
                position: 3, // only block 0 of t1 is used
                table: &t1,
            },
        ];
        let p = pack_decode(&rows, 4, 4, 10, 64).unwrap();
        assert_eq!(p.tokens, vec![11, 12, 0, 0]);
        assert_eq!(p.positions, vec![9, 3, 0, 0]);
        assert_eq!(p.slots, vec![9 * 4 + 1, 4 * 4 + 3, -1, -1]);
        assert_eq!(p.n_ctx, vec![10, 4, 1, 1]);
        assert_eq!(p.tables, vec![7, 3, 9, 4, 0]);
        assert_eq!(p.tbl_off, vec![0, 3, 4, 4]);
        // Exactly full: no padding.
        let q = pack_decode(&rows, 2, 4, 10, 5).unwrap();
        assert_eq!((q.tokens.len(), q.tables.len()), (2, 5));
        // Refused: table too short, block outside the pool, no room, bucket too small.
        let short = [DecodeRow {
            token: 1,
            position: 12,
            table: &t0,
        }];
        assert!(pack_decode(&short, 1, 4, 10, 64).is_err());
        assert!(pack_decode(&rows, 2, 4, 9, 64).is_err(), "block 9 of 9");
        assert!(pack_decode(&rows, 2, 4, 10, 4).is_err(), "table room");
        assert!(pack_decode(&rows, 1, 4, 10, 64).is_err(), "bucket");
        assert!(pack_decode(&[], 1, 4, 10, 64).is_err(), "empty");
    }
}
