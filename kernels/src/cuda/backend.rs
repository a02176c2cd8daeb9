//! [`CudaBackend`]: the [`Backend`] trait on a CUDA device. Every kernel method only
//! enqueues launches on the device's one stream over device-resident buffers (no
//! allocation, no copy, no synchronization), which is what lets the forward pass run
//! resident and be captured into a CUDA graph. Copies happen only where the trait says
//! so: uploads at load, a step's inputs in [`Backend::prepare_step`], and the explicit
//! downloads ([`Backend::to_host`], KV transfer).

use cudarc::driver::CudaSlice;

use super::device::{CudaDevice, CudaStep, DeviceKv, DeviceMatrix, DeviceRope};
use super::launch;
use crate::api::AttnShape;
use crate::backend::{Backend, HostMatrix, PagedKvSpec, StepDesc};
use crate::error::{Result, shape};
use crate::rope::RopeTable;
use crate::types::ActFormat;

pub struct CudaBackend {
    dev: CudaDevice,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", self.dev.info())
            .finish()
    }
}

impl CudaBackend {
    /// Open device `ordinal` (probing the driver first).
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(Self {
            dev: CudaDevice::new(ordinal)?,
        })
    }

    /// The device, for what is CUDA-specific above the forward pass (graphs, sampling).
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }
}

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    type Weight = DeviceMatrix;
    type Rope = DeviceRope;
    type Kv = DeviceKv;
    type Step = CudaStep;
    /// A product input's activation blocks: `quant::BlockQ8` bytes, then
    /// `quant::BlockQ8K` bytes (each format quantized only when a matrix consumes it).
    type Scratch = CudaSlice<u8>;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>> {
        self.dev.zeros(n)
    }

    fn upload(&self, values: &[f32]) -> Result<CudaSlice<f32>> {
        self.dev.upload(values)
    }

    fn to_host(&self, buf: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        self.dev.download(&buf.as_view(), n)
    }

    fn load_weight(&self, m: &HostMatrix) -> Result<DeviceMatrix> {
        self.dev.upload_matrix(&m.matrix())
    }

    /// Weights live on the device once uploaded.
    fn holds_host_bytes(&self, _m: &HostMatrix) -> bool {
        false
    }

    fn load_rope(&self, table: &RopeTable) -> Result<DeviceRope> {
        self.dev.upload_rope(table)
    }

    fn alloc_kv(&self, s: &PagedKvSpec) -> Result<DeviceKv> {
        s.check()?;
        self.dev
            .alloc_kv(s.ty, s.n_layers, s.kv_dim, s.block_tokens, s.n_blocks)
    }

    fn scratch(&self, values: usize) -> Result<CudaSlice<u8>> {
        self.dev
            .zeros(launch::q8_bytes(values) + launch::q8k_bytes(values))
    }

    fn prepare_step(&self, desc: StepDesc, kv: &DeviceKv) -> Result<CudaStep> {
        self.dev.upload_step(&desc, kv)
    }

    /// The step's input buffers are freed on drop: let the work that reads them finish
    /// first.
    fn finish_step(&self, step: CudaStep) -> Result<()> {
        self.dev.synchronize()?;
        drop(step);
        Ok(())
    }

    fn embed(
        &self,
        table: &DeviceMatrix,
        step: &CudaStep,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.dev
            .embed(table, &step.tokens.as_view(), n, &mut out.as_view_mut())
    }

    fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        rows: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.dev.rmsnorm(
            &x.as_view(),
            &w.as_view(),
            eps,
            rows,
            &mut out.as_view_mut(),
        )
    }

    /// Quantizes `x` once into `scratch` per activation format the matrices consume (the
    /// activation quantization the CPU backends do inside their products), then one
    /// product per matrix.
    fn matmul<const N: usize>(
        &self,
        ws: [&DeviceMatrix; N],
        x: &CudaSlice<f32>,
        n_tok: usize,
        outs: [&mut CudaSlice<f32>; N],
        scratch: &mut CudaSlice<u8>,
    ) -> Result<()> {
        let cols = ws.first().map_or(0, |w| w.cols);
        if let Some(w) = ws.iter().find(|w| w.cols != cols) {
            return Err(shape(
                "matmul",
                format!("matrices of {cols} and {} columns", w.cols),
            ));
        }
        let d = &self.dev;
        let n = n_tok * cols;
        // BlockQ8 bytes first, BlockQ8K bytes after them.
        let split = launch::q8_bytes(n);
        let region = |fmt| match fmt {
            ActFormat::Q8 => 0..split,
            ActFormat::Q8K => split..split + launch::q8k_bytes(n),
        };
        if scratch.len() < split + launch::q8k_bytes(n) {
            return Err(shape(
                "matmul",
                format!("scratch of {} bytes for {n} values", scratch.len()),
            ));
        }
        for fmt in [ActFormat::Q8, ActFormat::Q8K] {
            if ws.iter().any(|w| w.ty.act_format() == Some(fmt)) {
                let mut dst = scratch.slice_mut(region(fmt));
                d.quantize_act(fmt, &x.as_view(), n, &mut dst)?;
            }
        }
        for (w, out) in ws.into_iter().zip(outs) {
            let xq = scratch.slice(region(w.ty.act_format().unwrap_or(ActFormat::Q8)));
            d.matmul(w, &x.as_view(), &xq, n_tok, &mut out.as_view_mut())?;
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        n_tok: usize,
        n_heads: usize,
        head_dim: usize,
        step: &CudaStep,
        rope: &DeviceRope,
    ) -> Result<()> {
        self.dev.rope(
            &mut x.as_view_mut(),
            n_tok,
            n_heads,
            head_dim,
            &step.positions.as_view(),
            rope,
        )
    }

    fn kv_store(
        &self,
        kv: &mut DeviceKv,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        step: &CudaStep,
        n_tok: usize,
    ) -> Result<()> {
        self.dev.kv_store(
            kv,
            layer,
            &k.as_view(),
            &v.as_view(),
            &step.slots.as_view(),
            n_tok,
        )
    }

    fn attention(
        &self,
        s: &AttnShape,
        q: &CudaSlice<f32>,
        step: &CudaStep,
        kv: &DeviceKv,
        layer: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.dev.attention(
            s,
            &q.as_view(),
            &step.plan,
            kv,
            layer,
            &mut out.as_view_mut(),
        )
    }

    fn rmsnorm_in_place(
        &self,
        x: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        eps: f32,
        rows: usize,
    ) -> Result<()> {
        self.dev
            .rmsnorm_in_place(&mut x.as_view_mut(), &w.as_view(), eps, rows)
    }

    fn add_bias(&self, x: &mut CudaSlice<f32>, b: &CudaSlice<f32>, rows: usize) -> Result<()> {
        self.dev.add_bias(&mut x.as_view_mut(), &b.as_view(), rows)
    }

    fn scale(&self, x: &mut CudaSlice<f32>, s: f32, n: usize) -> Result<()> {
        self.dev.scale(&mut x.as_view_mut(), s, n)
    }

    fn gelu_mul(&self, g: &mut CudaSlice<f32>, u: &CudaSlice<f32>, n: usize) -> Result<()> {
        self.dev.gelu_mul(&mut g.as_view_mut(), &u.as_view(), n)
    }

    fn silu_mul(&self, gate: &mut CudaSlice<f32>, up: &CudaSlice<f32>, n: usize) -> Result<()> {
        self.dev.silu_mul(&mut gate.as_view_mut(), &up.as_view(), n)
    }

    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<()> {
        self.dev.add(&mut x.as_view_mut(), &y.as_view(), n)
    }

    fn gather_wanted(
        &self,
        src: &CudaSlice<f32>,
        step: &CudaStep,
        n: usize,
        dim: usize,
        dst: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.dev.gather_rows(
            &src.as_view(),
            &step.want.as_view(),
            n,
            dim,
            &mut dst.as_view_mut(),
        )
    }

    fn kv_gather(
        &self,
        kv: &DeviceKv,
        table: &[u32],
        n_tok: usize,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        out.extend_from_slice(&self.dev.kv_gather(kv, table, n_tok)?);
        Ok(())
    }

    fn kv_scatter(
        &self,
        kv: &mut DeviceKv,
        table: &[u32],
        n_tok: usize,
        body: &[u8],
    ) -> Result<()> {
        self.dev.kv_scatter(kv, table, n_tok, body)
    }
}
