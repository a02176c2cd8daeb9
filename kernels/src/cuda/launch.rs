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

/// One warp per 32-value block.
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

/// Bytes of `n` activation blocks (`quant::BlockQ8`, 40 bytes each).
pub fn q8_bytes(n_values: usize) -> usize {
    n_values / crate::QK * std::mem::size_of::<crate::BlockQ8>()
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
}
