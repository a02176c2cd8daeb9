//! Launch wrappers of the row-wise and element-wise kernels of the forward pass:
//! embedding, RMS norm, rope, SwiGLU, residual add, row gathers and Q8 activation
//! quantization.

use cudarc::driver::{CudaView, CudaViewMut, PushKernelArg};

use super::{CudaDevice, DeviceMatrix, DeviceRope, i32_of, len_check, ty_id};
use crate::cuda::launch;
use crate::cuda::sources::Kernel;
use crate::error::{Result, shape};
use crate::rope::RopeStyle;
use crate::types::ActFormat;

impl CudaDevice {
    /// `out[t] = dequant(table row tokens[t])`. Precondition: every token < `table.rows`.
    pub fn embed(
        &self,
        table: &DeviceMatrix,
        tokens: &CudaView<'_, u32>,
        n_tok: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        len_check("embed", "tokens", tokens.len(), n_tok)?;
        len_check("embed", "out", out.len(), n_tok * table.cols)?;
        if n_tok == 0 {
            return Ok(());
        }
        let (ty, rb, n, dim) = (
            ty_id(table.ty),
            table.row_bytes() as u64,
            i32_of(n_tok)?,
            i32_of(table.cols)?,
        );
        self.launch(Kernel::Embed, launch::embed(n_tok, table.cols)?, |b| {
            b.arg(&table.data)
                .arg(&ty)
                .arg(&rb)
                .arg(tokens)
                .arg(&n)
                .arg(&dim)
                .arg(out);
        })
    }

    /// Row-wise RMS norm of `rows` rows of `w.len()`.
    pub fn rmsnorm(
        &self,
        x: &CudaView<'_, f32>,
        w: &CudaView<'_, f32>,
        eps: f32,
        rows: usize,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let dim = w.len();
        len_check("rmsnorm", "x", x.len(), rows * dim)?;
        len_check("rmsnorm", "out", out.len(), rows * dim)?;
        if rows == 0 {
            return Ok(());
        }
        let d = i32_of(dim)?;
        self.launch(Kernel::RmsNorm, launch::per_row(rows, 256)?, |b| {
            b.arg(x).arg(w).arg(&eps).arg(&d).arg(out);
        })
    }

    /// Rotate `n_tok` tokens × `n_heads` heads in place. Precondition: positions <
    /// `table.max_pos`.
    pub fn rope(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        n_tok: usize,
        n_heads: usize,
        head_dim: usize,
        positions: &CudaView<'_, i32>,
        table: &DeviceRope,
    ) -> Result<()> {
        if table.rot_dim > head_dim {
            return Err(shape(
                "rope",
                format!("rot {} > head {head_dim}", table.rot_dim),
            ));
        }
        len_check("rope", "x", x.len(), n_tok * n_heads * head_dim)?;
        len_check("rope", "positions", positions.len(), n_tok)?;
        let pairs = n_tok * n_heads * table.rot_dim / 2;
        if pairs == 0 {
            return Ok(());
        }
        let (nt, nh, hd, rh) = (
            i32_of(n_tok)?,
            i32_of(n_heads)?,
            i32_of(head_dim)?,
            i32_of(table.rot_dim / 2)?,
        );
        let neox = i32::from(table.style == RopeStyle::Neox);
        self.launch(Kernel::Rope, launch::elementwise(pairs)?, |b| {
            b.arg(x)
                .arg(&nt)
                .arg(&nh)
                .arg(&hd)
                .arg(&rh)
                .arg(positions)
                .arg(&table.cos)
                .arg(&table.sin)
                .arg(&neox);
        })
    }

    /// RMS norm in place of `rows` rows of `w.len()` (per-head norms).
    pub fn rmsnorm_in_place(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        w: &CudaView<'_, f32>,
        eps: f32,
        rows: usize,
    ) -> Result<()> {
        let dim = w.len();
        len_check("rmsnorm_in_place", "x", x.len(), rows * dim)?;
        if rows == 0 {
            return Ok(());
        }
        let d = i32_of(dim)?;
        self.launch(Kernel::RmsNormInPlace, launch::per_row(rows, 256)?, |b| {
            b.arg(x).arg(w).arg(&eps).arg(&d);
        })
    }

    /// `gate[..n] = gelu_tanh(gate) · up`.
    pub fn gelu_mul(
        &self,
        gate: &mut CudaViewMut<'_, f32>,
        up: &CudaView<'_, f32>,
        n: usize,
    ) -> Result<()> {
        len_check("gelu_mul", "gate", gate.len(), n)?;
        len_check("gelu_mul", "up", up.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        self.launch(Kernel::GeluMul, launch::elementwise(n)?, |b| {
            b.arg(gate).arg(up).arg(&n64);
        })
    }

    /// `x[r] += bias` for `rows` rows of `bias.len()`.
    pub fn add_bias(
        &self,
        x: &mut CudaViewMut<'_, f32>,
        bias: &CudaView<'_, f32>,
        rows: usize,
    ) -> Result<()> {
        let width = bias.len();
        if width == 0 {
            return Err(shape("add_bias", "an empty bias"));
        }
        let n = rows * width;
        len_check("add_bias", "x", x.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let (n64, w) = (n as u64, i32_of(width)?);
        self.launch(Kernel::AddBias, launch::elementwise(n)?, |b| {
            b.arg(x).arg(bias).arg(&n64).arg(&w);
        })
    }

    /// `x[..n] *= s`.
    pub fn scale(&self, x: &mut CudaViewMut<'_, f32>, s: f32, n: usize) -> Result<()> {
        len_check("scale", "x", x.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        self.launch(Kernel::Scale, launch::elementwise(n)?, |b| {
            b.arg(x).arg(&s).arg(&n64);
        })
    }

    /// `gate[..n] = silu(gate) · up`.
    pub fn silu_mul(
        &self,
        gate: &mut CudaViewMut<'_, f32>,
        up: &CudaView<'_, f32>,
        n: usize,
    ) -> Result<()> {
        len_check("silu_mul", "gate", gate.len(), n)?;
        len_check("silu_mul", "up", up.len(), n)?;
        let n64 = n as u64;
        self.launch(Kernel::SiluMul, launch::elementwise(n)?, |b| {
            b.arg(gate).arg(up).arg(&n64);
        })
    }

    /// `x[..n] += y`.
    pub fn add(&self, x: &mut CudaViewMut<'_, f32>, y: &CudaView<'_, f32>, n: usize) -> Result<()> {
        len_check("add", "x", x.len(), n)?;
        len_check("add", "y", y.len(), n)?;
        let n64 = n as u64;
        self.launch(Kernel::Add, launch::elementwise(n)?, |b| {
            b.arg(x).arg(y).arg(&n64);
        })
    }

    /// `dst[r] = src[idx[r]]`, rows of `dim`. Precondition: indices < rows of `src`.
    pub fn gather_rows(
        &self,
        src: &CudaView<'_, f32>,
        idx: &CudaView<'_, u32>,
        n: usize,
        dim: usize,
        dst: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        len_check("gather_rows", "idx", idx.len(), n)?;
        len_check("gather_rows", "dst", dst.len(), n * dim)?;
        if n == 0 {
            return Ok(());
        }
        let (ni, d) = (i32_of(n)?, i32_of(dim)?);
        self.launch(Kernel::GatherRows, launch::per_row(n, 256)?, |b| {
            b.arg(src).arg(idx).arg(&ni).arg(&d).arg(dst);
        })
    }

    /// Quantize `n_values` activations into the blocks of `fmt` (BlockQ8 for the
    /// 32-element formats, BlockQ8K for the K-quants; `n_values` a multiple of the block).
    pub fn quantize_act(
        &self,
        fmt: ActFormat,
        x: &CudaView<'_, f32>,
        n_values: usize,
        out: &mut CudaViewMut<'_, u8>,
    ) -> Result<()> {
        let (kernel, block) = match fmt {
            ActFormat::Q8 => (Kernel::QuantizeQ8, crate::QK),
            ActFormat::Q8K => (Kernel::QuantizeQ8K, crate::QK_K),
        };
        if !n_values.is_multiple_of(block) {
            return Err(shape(
                "quantize_act",
                format!("{n_values} values into {fmt:?}"),
            ));
        }
        len_check("quantize_act", "x", x.len(), n_values)?;
        len_check(
            "quantize_act",
            "out",
            out.len(),
            launch::act_bytes(fmt, n_values),
        )?;
        let nb = n_values / block;
        if nb == 0 {
            return Ok(());
        }
        let nb64 = nb as u64;
        self.launch(kernel, launch::quantize_q8(nb)?, |b| {
            b.arg(x).arg(&nb64).arg(out);
        })
    }

    /// Quantize `n_values` activations (a multiple of 32) into BlockQ8 bytes.
    pub fn quantize_q8(
        &self,
        x: &CudaView<'_, f32>,
        n_values: usize,
        out: &mut CudaViewMut<'_, u8>,
    ) -> Result<()> {
        self.quantize_act(ActFormat::Q8, x, n_values, out)
    }
}
