//! A batch's attention work on the device (the plan of decode queries and prefill tiles,
//! a step's uploaded inputs) and the attention launch wrapper.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};

use super::{CudaDevice, DeviceKv, i32_of, len_check, ty_id};
use crate::api::{AttnQuery, AttnShape};
use crate::backend::StepDesc;
use crate::cuda::launch;
use crate::cuda::sources::Kernel;
use crate::error::{Result, shape};

/// The attention work of one batch, on the device (fields visible to [`super::graph`],
/// which keeps one at fixed addresses). Built by [`CudaDevice::attn_plan`].
#[derive(Debug)]
pub struct DeviceAttnPlan {
    pub n_queries: usize,
    pub(super) n_singles: usize,
    pub(super) n_tiles: usize,
    pub(super) singles: CudaSlice<i32>,
    pub(super) tiles: CudaSlice<i32>,
    pub(super) n_ctx: CudaSlice<i32>,
    pub(super) tbl_off: CudaSlice<i32>,
    pub(super) tables: CudaSlice<u32>,
}

/// One step's inputs on the device, as the kernels read them: token ids, positions, KV
/// slots (negative: store nothing), the tokens whose logits are wanted, and the attention
/// plan. Made per step by [`CudaDevice::upload_step`], or held at fixed addresses for
/// CUDA graphs inside [`DecodeInputs`].
#[derive(Debug)]
pub struct CudaStep {
    pub(crate) tokens: CudaSlice<u32>,
    pub(crate) positions: CudaSlice<i32>,
    pub(crate) slots: CudaSlice<i64>,
    pub(crate) want: CudaSlice<u32>,
    pub(crate) plan: DeviceAttnPlan,
}

impl CudaStep {
    /// Query tokens of the step (the padded bucket for graph inputs).
    pub fn n_queries(&self) -> usize {
        self.plan.n_queries
    }

    pub fn plan(&self) -> &DeviceAttnPlan {
        &self.plan
    }
}

impl CudaDevice {
    /// Upload one batch's attention work: `queries` in batch order, grouped into `runs`
    /// of consecutive tokens of one sequence (see [`launch::plan_attention`]). Validates
    /// every block id against the pool, so the kernels never index outside it.
    pub fn attn_plan(
        &self,
        queries: &[AttnQuery<'_>],
        runs: &[launch::QueryRun],
        kv: &DeviceKv,
    ) -> Result<DeviceAttnPlan> {
        let mut tables: Vec<u32> = Vec::new();
        let mut n_ctx = Vec::with_capacity(queries.len());
        let mut tbl_off = Vec::with_capacity(queries.len());
        let mut run_offsets = Vec::with_capacity(runs.len());
        let mut covered = 0;
        for r in runs {
            if r.first != covered || r.len == 0 || r.first + r.len > queries.len() {
                return Err(shape(
                    "attn_plan",
                    format!("run {r:?} after {covered} queries"),
                ));
            }
            covered += r.len;
            let off = tables.len();
            let table = queries[r.first].block_table;
            for (i, q) in queries[r.first..r.first + r.len].iter().enumerate() {
                let need = q.n_ctx.div_ceil(kv.block_tokens);
                if q.n_ctx == 0 || q.block_table.len() < need || !std::ptr::eq(q.block_table, table)
                {
                    return Err(shape(
                        "attn_plan",
                        format!("query {} of run {r:?}: n_ctx {}", r.first + i, q.n_ctx),
                    ));
                }
                if let Some(b) = q.block_table[..need]
                    .iter()
                    .find(|b| **b as usize >= kv.n_blocks)
                {
                    return Err(shape(
                        "attn_plan",
                        format!("block {b} outside {}", kv.n_blocks),
                    ));
                }
                n_ctx.push(i32_of(q.n_ctx)?);
                tbl_off.push(i32_of(off)?);
            }
            tables.extend_from_slice(table);
            run_offsets.push(launch::QueryRun {
                table_offset: off,
                ..*r
            });
        }
        if covered != queries.len() {
            return Err(shape(
                "attn_plan",
                format!("runs cover {covered} of {}", queries.len()),
            ));
        }
        let (singles, tiles) = launch::plan_attention(&run_offsets)?;
        Ok(DeviceAttnPlan {
            n_queries: queries.len(),
            n_singles: singles.len(),
            n_tiles: tiles.len() / 3,
            singles: self.upload(&singles)?,
            tiles: self.upload(&tiles)?,
            n_ctx: self.upload(&n_ctx)?,
            tbl_off: self.upload(&tbl_off)?,
            tables: self.upload(&tables)?,
        })
    }

    /// Upload a step's description: token ids, positions, KV slots, wanted rows and the
    /// attention plan (each sequence's tokens one run), checking every block id.
    pub fn upload_step(&self, desc: &StepDesc, kv: &DeviceKv) -> Result<CudaStep> {
        let n = desc.len();
        if desc.positions.len() != n || desc.slots.len() != n {
            return Err(shape(
                "step",
                format!("{n} tokens, inconsistent description"),
            ));
        }
        let rows = kv.n_blocks * kv.block_tokens;
        if let Some(s) = desc.slots.iter().find(|s| **s >= rows) {
            return Err(shape("step", format!("KV slot {s} outside {rows}")));
        }
        if let Some(w) = desc.want.iter().find(|w| **w >= n) {
            return Err(shape("step", format!("wanted token {w} of {n}")));
        }
        let runs: Vec<launch::QueryRun> = desc
            .seqs
            .iter()
            .map(|s| launch::QueryRun {
                first: s.first,
                len: s.len,
                table_offset: 0,
            })
            .collect();
        let plan = self.attn_plan(&desc.queries(), &runs, kv)?;
        let positions = desc
            .positions
            .iter()
            .map(|p| i32_of(*p))
            .collect::<Result<Vec<_>>>()?;
        let slots: Vec<i64> = desc.slots.iter().map(|s| *s as i64).collect();
        let want: Vec<u32> = desc.want.iter().map(|w| *w as u32).collect();
        Ok(CudaStep {
            tokens: self.upload(&desc.tokens)?,
            positions: self.upload(&positions)?,
            slots: self.upload(&slots)?,
            want: self.upload(&want)?,
            plan,
        })
    }

    /// Causal attention of the plan's queries over layer `layer` of `kv`.
    pub fn attention(
        &self,
        s: &AttnShape,
        q: &CudaView<'_, f32>,
        plan: &DeviceAttnPlan,
        kv: &DeviceKv,
        layer: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        if s.n_kv_heads == 0 || !s.n_heads.is_multiple_of(s.n_kv_heads) {
            return Err(shape("attention", format!("bad head counts {s:?}")));
        }
        if s.kv_dim() != kv.kv_dim || layer >= kv.n_layers {
            return Err(shape(
                "attention",
                format!("{s:?} vs KV of dim {}", kv.kv_dim),
            ));
        }
        len_check("attention", "q", q.len(), plan.n_queries * s.q_dim())?;
        len_check("attention", "out", out.len(), plan.n_queries * s.q_dim())?;
        let pb = kv.pool_bytes();
        let (kp, vp) = (
            kv.k.slice(layer * pb..(layer + 1) * pb),
            kv.v.slice(layer * pb..(layer + 1) * pb),
        );
        let head_bytes = kv.ty.row_bytes(s.head_dim)?;
        let (ty, rb, hb, bt) = (
            ty_id(kv.ty),
            i32_of(kv.row_bytes)?,
            i32_of(head_bytes)?,
            i32_of(kv.block_tokens)?,
        );
        let (nh, nkv, hd) = (
            i32_of(s.n_heads)?,
            i32_of(s.n_kv_heads)?,
            i32_of(s.head_dim)?,
        );
        let scale = 1.0 / (s.head_dim as f32).sqrt();
        // 0: no window.
        let window = i32_of(s.window.unwrap_or(0))?;
        if s.window == Some(0) {
            return Err(shape("attention", "a sliding window of 0 positions"));
        }
        if plan.n_singles > 0 {
            let l = launch::attn_decode(s.n_heads, plan.n_singles, s.head_dim)?;
            self.launch(Kernel::AttnDecode, l, |b| {
                b.arg(q)
                    .arg(&mut *out)
                    .arg(&plan.singles)
                    .arg(&plan.n_ctx)
                    .arg(&plan.tbl_off)
                    .arg(&plan.tables)
                    .arg(&kp)
                    .arg(&vp)
                    .arg(&ty)
                    .arg(&rb)
                    .arg(&hb)
                    .arg(&bt)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&hd)
                    .arg(&scale)
                    .arg(&window);
            })?;
        }
        if plan.n_tiles > 0 {
            let (l, bk) = launch::attn_prefill(s.n_heads, plan.n_tiles, s.head_dim)?;
            let bk = i32_of(bk)?;
            self.launch(Kernel::AttnPrefill, l, |b| {
                b.arg(q)
                    .arg(&mut *out)
                    .arg(&plan.tiles)
                    .arg(&plan.n_ctx)
                    .arg(&plan.tables)
                    .arg(&kp)
                    .arg(&vp)
                    .arg(&ty)
                    .arg(&rb)
                    .arg(&hb)
                    .arg(&bt)
                    .arg(&nh)
                    .arg(&nkv)
                    .arg(&hd)
                    .arg(&scale)
                    .arg(&bk)
                    .arg(&window);
            })?;
        }
        Ok(())
    }
}
