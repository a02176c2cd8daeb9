//! Logits processing on the device: greedy tokens, top-k candidates and full sampling.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{CudaDevice, i32_of, len_check};
use crate::cuda::launch;
use crate::cuda::sources::Kernel;
use crate::error::{Result, shape};

impl CudaDevice {
    /// Greedy token of each of `rows` rows of `vocab` logits.
    pub fn argmax(
        &self,
        logits: &CudaView<'_, f32>,
        rows: usize,
        vocab: usize,
        out: &mut CudaViewMut<'_, u32>,
    ) -> Result<()> {
        len_check("argmax", "logits", logits.len(), rows * vocab)?;
        len_check("argmax", "out", out.len(), rows)?;
        if rows == 0 || vocab == 0 {
            return Ok(());
        }
        let v = i32_of(vocab)?;
        self.launch(Kernel::Argmax, launch::per_row(rows, 1024)?, |b| {
            b.arg(logits).arg(&v).arg(out);
        })
    }

    /// The `k` largest logits of each row, descending (lowest index first on ties).
    pub fn topk(
        &self,
        logits: &CudaView<'_, f32>,
        rows: usize,
        vocab: usize,
        k: usize,
        vals: &mut CudaViewMut<'_, f32>,
        idx: &mut CudaViewMut<'_, u32>,
    ) -> Result<()> {
        let l = launch::topk(rows.max(1), k, vocab)?;
        len_check("topk", "logits", logits.len(), rows * vocab)?;
        len_check("topk", "vals", vals.len(), rows * k)?;
        len_check("topk", "idx", idx.len(), rows * k)?;
        if rows == 0 {
            return Ok(());
        }
        let (v, kk) = (i32_of(vocab)?, i32_of(k)?);
        self.launch(Kernel::TopK, l, |b| {
            b.arg(logits).arg(&v).arg(&kk).arg(vals).arg(idx);
        })
    }

    /// Sample one token per row of `rows` rows of `vocab` logits with per-row parameters
    /// ([`launch::pack_sample_rows`]); a row the device leaves to the host gets
    /// [`launch::SAMPLE_DEFER`] (see sampling.cu).
    pub fn sample(
        &self,
        logits: &CudaView<'_, f32>,
        rows: usize,
        vocab: usize,
        params: &CudaView<'_, u32>,
        out: &mut CudaViewMut<'_, u32>,
    ) -> Result<()> {
        len_check("sample", "logits", logits.len(), rows * vocab)?;
        len_check(
            "sample",
            "params",
            params.len(),
            rows * launch::SAMPLE_WORDS,
        )?;
        len_check("sample", "out", out.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        if vocab == 0 {
            return Err(shape("sample", "empty vocabulary"));
        }
        let v = i32_of(vocab)?;
        self.launch(Kernel::Sample, launch::sample(rows)?, |b| {
            b.arg(logits).arg(&v).arg(params).arg(out);
        })
    }
}
