//! KV-cache launch wrappers: storing a step's K/V rows into the paged pools, and packing /
//! unpacking a sequence's rows in the KV transfer layout.

use cudarc::driver::{CudaView, PushKernelArg};

use super::{CudaDevice, DeviceKv, i32_of, len_check, ty_id};
use crate::cuda::launch;
use crate::cuda::sources::Kernel;
use crate::error::{Result, shape};

impl CudaDevice {
    /// Store `n_tok` tokens' K and V rows (f32 `[n_tok][kv_dim]`) of `layer` at `slots`
    /// (`block · block_tokens + pos % block_tokens`); negative slots store nothing.
    /// Precondition: slots < blocks · bt.
    pub fn kv_store(
        &self,
        kv: &mut DeviceKv,
        layer: usize,
        k: &CudaView<'_, f32>,
        v: &CudaView<'_, f32>,
        slots: &CudaView<'_, i64>,
        n_tok: usize,
    ) -> Result<()> {
        if layer >= kv.n_layers || !kv.kv_dim.is_multiple_of(crate::QK) {
            return Err(shape(
                "kv_store",
                format!("layer {layer}, kv_dim {}", kv.kv_dim),
            ));
        }
        len_check("kv_store", "k", k.len(), n_tok * kv.kv_dim)?;
        len_check("kv_store", "v", v.len(), n_tok * kv.kv_dim)?;
        len_check("kv_store", "slots", slots.len(), n_tok)?;
        if n_tok == 0 {
            return Ok(());
        }
        let pb = kv.pool_bytes();
        let (nt, dim, ty, rb) = (
            i32_of(n_tok)?,
            i32_of(kv.kv_dim)?,
            ty_id(kv.ty),
            i32_of(kv.row_bytes)?,
        );
        let l = launch::kv_store(n_tok, kv.kv_dim)?;
        let mut kp = kv.k.slice_mut(layer * pb..(layer + 1) * pb);
        let mut vp = kv.v.slice_mut(layer * pb..(layer + 1) * pb);
        self.launch(Kernel::KvStore, l, |b| {
            b.arg(k)
                .arg(v)
                .arg(slots)
                .arg(&nt)
                .arg(&dim)
                .arg(&ty)
                .arg(&rb)
                .arg(&mut kp)
                .arg(&mut vp);
        })
    }

    fn check_table(kv: &DeviceKv, table: &[u32], n_tok: usize) -> Result<()> {
        let need = n_tok.div_ceil(kv.block_tokens);
        if table.len() < need || table[..need].iter().any(|b| *b as usize >= kv.n_blocks) {
            return Err(shape(
                "kv transfer",
                format!(
                    "{n_tok} tokens with table {table:?} in {} blocks",
                    kv.n_blocks
                ),
            ));
        }
        Ok(())
    }

    /// Pack `n_tok` positions of a sequence (block table `table`) into the transfer layout
    /// (per layer: K rows, then V rows) and download it.
    pub fn kv_gather(&self, kv: &DeviceKv, table: &[u32], n_tok: usize) -> Result<Vec<u8>> {
        Self::check_table(kv, table, n_tok)?;
        let bytes = kv.n_layers * 2 * n_tok * kv.row_bytes;
        if n_tok == 0 {
            return Ok(Vec::new());
        }
        let tbl = self.upload(table)?;
        let mut out = self.zeros::<u8>(bytes)?;
        let (pb, bt, nt, rb) = (
            kv.pool_bytes() as u64,
            i32_of(kv.block_tokens)?,
            i32_of(n_tok)?,
            i32_of(kv.row_bytes)?,
        );
        self.launch(
            Kernel::KvGather,
            launch::per_row(kv.n_layers * 2 * n_tok, 128)?,
            |b| {
                b.arg(&kv.k)
                    .arg(&kv.v)
                    .arg(&pb)
                    .arg(&tbl)
                    .arg(&bt)
                    .arg(&nt)
                    .arg(&rb)
                    .arg(&mut out);
            },
        )?;
        self.download(&out.as_view(), bytes)
    }

    /// Inverse of [`CudaDevice::kv_gather`]: write a packed payload body into the blocks of
    /// `table`.
    pub fn kv_scatter(
        &self,
        kv: &mut DeviceKv,
        table: &[u32],
        n_tok: usize,
        packed: &[u8],
    ) -> Result<()> {
        Self::check_table(kv, table, n_tok)?;
        let bytes = kv.n_layers * 2 * n_tok * kv.row_bytes;
        if packed.len() != bytes {
            return Err(shape(
                "kv_scatter",
                format!("{} bytes, need {bytes}", packed.len()),
            ));
        }
        if n_tok == 0 {
            return Ok(());
        }
        let tbl = self.upload(table)?;
        let src = self.upload(packed)?;
        let (pb, bt, nt, rb) = (
            kv.pool_bytes() as u64,
            i32_of(kv.block_tokens)?,
            i32_of(n_tok)?,
            i32_of(kv.row_bytes)?,
        );
        self.launch(
            Kernel::KvScatter,
            launch::per_row(kv.n_layers * 2 * n_tok, 128)?,
            |b| {
                b.arg(&src)
                    .arg(&pb)
                    .arg(&tbl)
                    .arg(&bt)
                    .arg(&nt)
                    .arg(&rb)
                    .arg(&mut kv.k)
                    .arg(&mut kv.v);
            },
        )?;
        // `src` and `tbl` are freed on drop; finish the copy first.
        self.synchronize()
    }
}
