//! The matrix-product launch wrapper: picks the kernel by weight type and batch size
//! ([`launch::matmul`]) and passes the quantized activations to the integer kernels.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{CudaDevice, DeviceMatrix, i32_of, len_check, ty_id};
use crate::cuda::launch::{self, MatmulKind};
use crate::cuda::sources::Kernel;
use crate::error::Result;

impl CudaDevice {
    /// `out[t·rows + r] = Σ_c W[r][c] · x[t·cols + c]`. For quantized `w`, `xq` must hold
    /// [`CudaDevice::quantize_act`] of `x` in `w`'s activation format (shared by all
    /// matrices of that format with the same input).
    pub fn matmul(
        &self,
        w: &DeviceMatrix,
        x: &CudaView<'_, f32>,
        xq: &CudaView<'_, u8>,
        n_tok: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        len_check("matmul", "out", out.len(), n_tok * w.rows)?;
        if n_tok == 0 {
            return Ok(());
        }
        let (kind, l) = launch::matmul(w.ty, w.rows, n_tok)?;
        let (rb, rows, nt) = (w.row_bytes() as u64, i32_of(w.rows)?, i32_of(n_tok)?);
        if kind == MatmulKind::Float {
            len_check("matmul", "x", x.len(), n_tok * w.cols)?;
            let (ty, cols) = (ty_id(w.ty), i32_of(w.cols)?);
            return self.launch(Kernel::MmvFloat, l, |b| {
                b.arg(&w.data)
                    .arg(&ty)
                    .arg(&rb)
                    .arg(&rows)
                    .arg(&cols)
                    .arg(x)
                    .arg(&nt)
                    .arg(out);
            });
        }
        let fmt = w.ty.act_format().expect("a quantized type");
        len_check(
            "matmul",
            "xq",
            xq.len(),
            launch::act_bytes(fmt, n_tok * w.cols),
        )?;
        let nb = i32_of(w.cols / w.ty.block_len())?;
        let k = Kernel::for_matmul(w.ty, kind == MatmulKind::Tiled)
            .expect("launch::matmul checked the type");
        self.launch(k, l, |b| {
            b.arg(&w.data)
                .arg(&rb)
                .arg(&rows)
                .arg(&nb)
                .arg(xq)
                .arg(&nt)
                .arg(out);
        })
    }
}
