//! [`CudaKernels`]: the slice-level [`Kernels`] trait on a CUDA device. Each call copies
//! its host inputs to the device, runs the same kernels [`super::CudaBackend`] runs and
//! copies the result back, so GPU tests can hold every kernel against `ScalarKernels`
//! through one interface. Serving keeps data resident instead ([`super::CudaBackend`]).

use std::sync::Mutex;

use super::device::{CudaDevice, DeviceKv};
use super::launch::{self, QueryRun};
use crate::api::{AttnQuery, AttnShape, Kernels, KvView, Matrix, check_attention, check_matmul};
use crate::error::{Result, shape};
use crate::reference::{ScalarKernels, check_rmsnorm};
use crate::rope::RopeTable;
use crate::types::ActFormat;

pub struct CudaKernels {
    dev: CudaDevice,
    /// One call at a time: a call's uploads, launches and download must not interleave
    /// with another thread's on the shared stream.
    lock: Mutex<()>,
}

impl std::fmt::Debug for CudaKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKernels")
            .field("device", self.dev.info())
            .finish()
    }
}

impl CudaKernels {
    /// Open device `ordinal` (probing the driver first).
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Self {
            dev: CudaDevice::new(ordinal)?,
            lock: Mutex::new(()),
        })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Group query tokens into runs of one sequence at consecutive positions (same block
/// table, `n_ctx` growing by one): the prompt chunks the prefill kernel tiles. `keys` are
/// (table identity, n_ctx) per query.
pub(crate) fn runs_of(keys: &[((usize, usize), usize)]) -> Vec<QueryRun> {
    let mut runs: Vec<QueryRun> = Vec::new();
    for (i, (table, n_ctx)) in keys.iter().enumerate() {
        if let Some(r) = runs.last_mut() {
            let (prev_table, prev_ctx) = keys[i - 1];
            if prev_table == *table && prev_ctx + 1 == *n_ctx {
                r.len += 1;
                continue;
            }
        }
        runs.push(QueryRun {
            first: i,
            len: 1,
            table_offset: 0,
        });
    }
    runs
}

impl Kernels for CudaKernels {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn matmul(
        &self,
        ws: &[Matrix<'_>],
        x: &[f32],
        n_tok: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<()> {
        let cols = check_matmul(ws, x, n_tok, outs)?;
        let _g = self.guard();
        let d = &self.dev;
        let xd = d.upload(x)?;
        let n = n_tok * cols;
        // Each activation format the matrices consume, quantized once; float matrices
        // read `x` itself (and get a placeholder).
        let mut xq = Vec::new();
        for fmt in [ActFormat::Q8, ActFormat::Q8K] {
            if ws.iter().any(|w| w.ty.act_format() == Some(fmt)) {
                let mut q = d.zeros::<u8>(launch::act_bytes(fmt, n))?;
                d.quantize_act(fmt, &xd.as_view(), n, &mut q.as_view_mut())?;
                xq.push((fmt, q));
            }
        }
        let none = d.zeros::<u8>(1)?;
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            let xq = xq
                .iter()
                .find(|(f, _)| Some(*f) == w.ty.act_format())
                .map_or(&none, |(_, q)| q);
            let wd = d.upload_matrix(w)?;
            let mut od = d.zeros::<f32>(out.len())?;
            d.matmul(
                &wd,
                &xd.as_view(),
                &xq.as_view(),
                n_tok,
                &mut od.as_view_mut(),
            )?;
            out.copy_from_slice(&d.download(&od.as_view(), out.len())?);
        }
        Ok(())
    }

    fn rmsnorm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<()> {
        check_rmsnorm(x, w, out)?;
        let _g = self.guard();
        let d = &self.dev;
        let (xd, wd) = (d.upload(x)?, d.upload(w)?);
        let mut od = d.zeros::<f32>(out.len())?;
        let rows = x.len() / w.len();
        d.rmsnorm(
            &xd.as_view(),
            &wd.as_view(),
            eps,
            rows,
            &mut od.as_view_mut(),
        )?;
        out.copy_from_slice(&d.download(&od.as_view(), out.len())?);
        Ok(())
    }

    fn rope(
        &self,
        x: &mut [f32],
        n_heads: usize,
        head_dim: usize,
        positions: &[usize],
        table: &RopeTable,
    ) -> Result<()> {
        table.check(x, n_heads, head_dim, positions)?;
        let _g = self.guard();
        let d = &self.dev;
        let rope = d.upload_rope(table)?;
        let pos: Vec<i32> = positions.iter().map(|p| *p as i32).collect();
        let pd = d.upload(&pos)?;
        let mut xd = d.upload(x)?;
        d.rope(
            &mut xd.as_view_mut(),
            positions.len(),
            n_heads,
            head_dim,
            &pd.as_view(),
            &rope,
        )?;
        x.copy_from_slice(&d.download(&xd.as_view(), x.len())?);
        Ok(())
    }

    fn silu_mul(&self, gate: &mut [f32], up: &[f32]) -> Result<()> {
        if gate.len() != up.len() {
            return Err(shape("silu_mul", format!("{} vs {}", gate.len(), up.len())));
        }
        let _g = self.guard();
        let d = &self.dev;
        let (mut gd, ud) = (d.upload(gate)?, d.upload(up)?);
        d.silu_mul(&mut gd.as_view_mut(), &ud.as_view(), gate.len())?;
        gate.copy_from_slice(&d.download(&gd.as_view(), gate.len())?);
        Ok(())
    }

    fn rmsnorm_in_place(&self, x: &mut [f32], w: &[f32], eps: f32) -> Result<()> {
        crate::reference::check_rmsnorm_in_place(x, w)?;
        let _g = self.guard();
        let d = &self.dev;
        let (mut xd, wd) = (d.upload(x)?, d.upload(w)?);
        d.rmsnorm_in_place(&mut xd.as_view_mut(), &wd.as_view(), eps, x.len() / w.len())?;
        x.copy_from_slice(&d.download(&xd.as_view(), x.len())?);
        Ok(())
    }

    fn gelu_mul(&self, gate: &mut [f32], up: &[f32]) -> Result<()> {
        crate::reference::check_glu("gelu_mul", gate, up)?;
        let _g = self.guard();
        let d = &self.dev;
        let (mut gd, ud) = (d.upload(gate)?, d.upload(up)?);
        d.gelu_mul(&mut gd.as_view_mut(), &ud.as_view(), gate.len())?;
        gate.copy_from_slice(&d.download(&gd.as_view(), gate.len())?);
        Ok(())
    }

    /// The forward pass never softmaxes on its own (attention fuses it), so this stays on
    /// the host: a device round trip would only add latency.
    fn softmax(&self, x: &mut [f32]) {
        ScalarKernels.softmax(x)
    }

    fn attention(
        &self,
        s: &AttnShape,
        q: &[f32],
        queries: &[AttnQuery<'_>],
        k: &KvView<'_>,
        v: &KvView<'_>,
        out: &mut [f32],
    ) -> Result<()> {
        check_attention(s, q, queries, k, v, out)?;
        if k.ty != v.ty || k.block_tokens != v.block_tokens || k.data.len() != v.data.len() {
            return Err(shape("attention", "K and V pools differ in layout"));
        }
        if queries.is_empty() {
            return Ok(());
        }
        let _g = self.guard();
        let d = &self.dev;
        let row_bytes = k.ty.row_bytes(s.kv_dim())?;
        let kv = DeviceKv {
            ty: k.ty,
            n_layers: 1,
            kv_dim: s.kv_dim(),
            block_tokens: k.block_tokens,
            n_blocks: k.data.len() / (row_bytes * k.block_tokens),
            row_bytes,
            k: d.upload(k.data)?,
            v: d.upload(v.data)?,
        };
        let keys: Vec<_> = queries
            .iter()
            .map(|qu| {
                (
                    (qu.block_table.as_ptr() as usize, qu.block_table.len()),
                    qu.n_ctx,
                )
            })
            .collect();
        let plan = d.attn_plan(queries, &runs_of(&keys), &kv)?;
        let qd = d.upload(q)?;
        let mut od = d.zeros::<f32>(out.len())?;
        d.attention(s, &qd.as_view(), &plan, &kv, 0, &mut od.as_view_mut())?;
        out.copy_from_slice(&d.download(&od.as_view(), out.len())?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_group_consecutive_positions_of_one_table() {
        let (a, b) = ((1, 4), (2, 4));
        let keys = [(a, 5), (a, 6), (a, 7), (b, 1), (a, 9), (b, 2), (b, 3)];
        let runs = runs_of(&keys);
        let spans: Vec<_> = runs.iter().map(|r| (r.first, r.len)).collect();
        assert_eq!(spans, vec![(0, 3), (3, 1), (4, 1), (5, 2)]);
        assert!(runs_of(&[]).is_empty());
        // A repeated position (not causal-consecutive) starts a new run.
        let spans: Vec<_> = runs_of(&[(a, 3), (a, 3)]).iter().map(|r| r.len).collect();
        assert_eq!(spans, vec![1, 1]);
    }
}
