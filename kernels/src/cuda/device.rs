//! A CUDA device: driver probe, context, one stream, the loaded kernels, device-resident
//! weights / KV pools, and one typed launch wrapper per kernel.
//!
//! Every wrapper checks the lengths of the buffers it is given against the shapes it is
//! told, so that every index a kernel computes stays inside its buffers; what it cannot
//! check (values stored on the device: token ids, block ids, positions) is a documented
//! precondition that the callers validate on the host before uploading.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr,
    DriverError, PushKernelArg, ValidAsZeroBits, result as drv, sys,
};
use cudarc::nvrtc::Ptx;

use super::launch::{self, DecodeRow, Launch, MatmulKind};
use super::sources::{self, Kernel, Target};
use crate::api::{AttnQuery, AttnShape, Matrix};
use crate::backend::StepDesc;
use crate::error::{Error, Result, shape};
use crate::rope::{RopeStyle, RopeTable};
use crate::types::GgmlType;

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
    pub total_mem: usize,
    /// Devices the driver sees.
    pub device_count: usize,
}

pub(crate) fn driver_err(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Cuda(format!("{what}: {e}"))
}

/// Check that a driver and device `ordinal` exist, without creating a context. cudarc
/// panics when `libcuda` is missing on first use, so the library is looked up first.
pub fn probe(ordinal: usize) -> Result<DeviceInfo> {
    // SAFETY: only tries `dlopen` on the driver's library names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::Cuda(
            "no CUDA driver: libcuda.so.1 not found (is the NVIDIA driver installed and \
             visible to this process?)"
                .into(),
        ));
    }
    drv::init().map_err(driver_err("CUDA driver initialisation failed"))?;
    let count = drv::device::get_count().map_err(driver_err("counting CUDA devices"))? as usize;
    if ordinal >= count {
        return Err(Error::Cuda(format!(
            "no device {ordinal}: the driver sees {count} CUDA device(s)"
        )));
    }
    let dev = drv::device::get(ordinal as i32).map_err(driver_err("cuDeviceGet"))?;
    let attr = |a| {
        // SAFETY: `dev` was returned by cuDeviceGet above.
        unsafe { drv::device::get_attribute(dev, a) }.map_err(driver_err("device attribute"))
    };
    let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok(DeviceInfo {
        ordinal,
        name: drv::device::get_name(dev).map_err(driver_err("device name"))?,
        compute_capability: (major as u32, minor as u32),
        // SAFETY: as above.
        total_mem: unsafe { drv::device::total_mem(dev) }.map_err(driver_err("device memory"))?,
        device_count: count,
    })
}

/// A weight matrix uploaded once, in its GGUF layout.
#[derive(Debug)]
pub struct DeviceMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: CudaSlice<u8>,
}

impl DeviceMatrix {
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }
}

/// A rope table on the device: `[max_pos][rot_dim / 2]` cos and sin.
#[derive(Debug)]
pub struct DeviceRope {
    pub style: RopeStyle,
    pub rot_dim: usize,
    pub max_pos: usize,
    pub cos: CudaSlice<f32>,
    pub sin: CudaSlice<f32>,
}

/// Paged K and V pools of every layer: `k` is `[layer][pool]`, likewise `v`; a pool is
/// `n_blocks · block_tokens` rows of `row_bytes` (the layout of the CPU backend's
/// `HostKv`).
#[derive(Debug)]
pub struct DeviceKv {
    pub ty: GgmlType,
    pub n_layers: usize,
    pub kv_dim: usize,
    pub block_tokens: usize,
    pub n_blocks: usize,
    pub row_bytes: usize,
    pub k: CudaSlice<u8>,
    pub v: CudaSlice<u8>,
}

impl DeviceKv {
    pub fn pool_bytes(&self) -> usize {
        self.n_blocks * self.block_tokens * self.row_bytes
    }

    /// Bytes of all K and V pools (what [`CudaDevice::alloc_kv`] allocates).
    pub fn bytes_for(
        ty: GgmlType,
        n_layers: usize,
        kv_dim: usize,
        block_tokens: usize,
        n_blocks: usize,
    ) -> Result<usize> {
        let row = ty.row_bytes(kv_dim)?;
        [n_blocks, block_tokens, row, n_layers, 2]
            .into_iter()
            .try_fold(1usize, |a, b| a.checked_mul(b))
            .ok_or_else(|| shape("cuda kv", "KV pool size overflows"))
    }
}

/// The attention work of one batch, on the device. Built by [`CudaDevice::attn_plan`].
#[derive(Debug)]
pub struct DeviceAttnPlan {
    pub n_queries: usize,
    n_singles: usize,
    n_tiles: usize,
    singles: CudaSlice<i32>,
    tiles: CudaSlice<i32>,
    n_ctx: CudaSlice<i32>,
    tbl_off: CudaSlice<i32>,
    tables: CudaSlice<u32>,
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

/// Fixed device buffers of a decode step (one new token for each of up to `cap`
/// sequences), so that a CUDA graph captured over them stays valid from step to step:
/// [`CudaDevice::write_decode_inputs`] refreshes their contents by copies before each
/// launch, and every per-step value the kernels need (tokens, positions, KV slots,
/// context lengths, block tables) is read from them on the device.
#[derive(Debug)]
pub struct DecodeInputs {
    cap: usize,
    table_cap: usize,
    /// `want` is `0..cap`: every row wants logits, in order.
    step: CudaStep,
}

impl DecodeInputs {
    /// Most rows (the largest bucket).
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Most block-table entries over all rows of a step.
    pub fn table_cap(&self) -> usize {
        self.table_cap
    }

    /// Rows of the last write (the bucket), as the attention plan sees them.
    pub fn rows(&self) -> usize {
        self.step.plan.n_queries
    }

    /// The last write as step inputs: decode attention, all single-token queries.
    pub fn step(&self) -> &CudaStep {
        &self.step
    }
}

/// Work recorded by [`CudaDevice::capture`], replayed by [`CudaDevice::launch_graph`]. It
/// refers to the device buffers it was recorded with by address: they must outlive it and
/// must not be reallocated while it is in use.
pub struct DeviceGraph {
    graph: CudaGraph,
}

impl std::fmt::Debug for DeviceGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceGraph")
    }
}

// SAFETY: a CUDA graph and its executable are plain driver handles that any thread may
// use as long as calls on them are serialized (CUDA's graph thread-safety rules); this
// type is not `Sync` and every use goes through `&self` of its one owner, so moving it to
// another thread (the engine thread owns the runner) cannot introduce concurrent access.
unsafe impl Send for DeviceGraph {}

pub struct CudaDevice {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    funcs: Vec<CudaFunction>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("info", &self.info)
            .finish()
    }
}

fn len_check(op: &'static str, what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(shape(op, format!("{what}: {have} elements, need {need}")));
    }
    Ok(())
}

fn i32_of(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| shape("cuda", format!("{v} exceeds i32")))
}

fn ty_id(ty: GgmlType) -> i32 {
    ty.id() as i32
}

impl CudaDevice {
    /// Probe, create a context and stream on device `ordinal`, and load every kernel
    /// (compiled by NVRTC for the device's architecture, once per process).
    pub fn new(ordinal: usize) -> Result<Self> {
        let info = probe(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(driver_err("creating a context"))?;
        // SAFETY: everything runs on the one stream below, in order, so the per-buffer
        // events cudarc records to order multiple streams are not needed; leaving them off
        // also keeps kernels capturable into CUDA graphs.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver_err("creating a stream"))?;
        let (major, minor) = info.compute_capability;
        let images = sources::images_for_arch(major, minor, Target::Cubin)?;
        let mut modules = Vec::with_capacity(images.len());
        for (file, image) in images.iter() {
            let m = match ctx.load_module(Ptx::from_binary(image.clone())) {
                Ok(m) => m,
                // An unknown architecture for this NVRTC's ptxas, or a cubin the driver
                // refuses: let the driver JIT the PTX instead.
                Err(e) => {
                    let ptx = sources::compile(
                        sources::SOURCES
                            .iter()
                            .find(|s| s.file == *file)
                            .expect("listed"),
                        major,
                        minor,
                        Target::Ptx,
                    )?;
                    let text = String::from_utf8_lossy(&ptx).into_owned();
                    ctx.load_module(Ptx::from_src(text)).map_err(|e2| {
                        Error::Cuda(format!("loading {file}: cubin: {e}; ptx: {e2}"))
                    })?
                }
            };
            modules.push((*file, m));
        }
        let funcs = Kernel::ALL
            .iter()
            .map(|k| {
                let (_, m) = modules
                    .iter()
                    .find(|(f, _)| *f == k.file())
                    .expect("every kernel's file is compiled");
                m.load_function(k.name())
                    .map_err(driver_err(&format!("loading kernel {}", k.name())))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            info,
            ctx,
            stream,
            funcs,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn func(&self, k: Kernel) -> &CudaFunction {
        &self.funcs[k.index()]
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err("synchronize"))
    }

    pub fn upload<T: DeviceRepr + ValidAsZeroBits>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        if data.is_empty() {
            // cuMemAlloc of 0 bytes fails; a 1-element buffer stands in for "nothing".
            return self.zeros(1);
        }
        self.stream
            .clone_htod(data)
            .map_err(driver_err("host-to-device copy"))
    }

    pub fn upload_into<T: DeviceRepr>(&self, data: &[T], dst: &mut CudaSlice<T>) -> Result<()> {
        len_check("upload", "destination", dst.len(), data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        self.stream
            .memcpy_htod(data, &mut dst.slice_mut(..data.len()))
            .map_err(driver_err("host-to-device copy"))
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(n.max(1))
            .map_err(driver_err("device allocation"))
    }

    /// Copy `n` elements back (synchronous).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        src: &CudaView<'_, T>,
        n: usize,
    ) -> Result<Vec<T>> {
        len_check("download", "source", src.len(), n)?;
        let mut out = vec![T::default(); n];
        if n > 0 {
            self.stream
                .memcpy_dtoh(&src.slice(..n), &mut out)
                .map_err(driver_err("device-to-host copy"))?;
        }
        self.synchronize()?;
        Ok(out)
    }

    /// The device kernels read GGUF rows: a matrix in another layout is gathered back
    /// into them first.
    pub fn upload_matrix(&self, m: &Matrix<'_>) -> Result<DeviceMatrix> {
        Matrix::with_layout(m.ty, m.rows, m.cols, m.data, m.layout)?;
        Ok(DeviceMatrix {
            ty: m.ty,
            rows: m.rows,
            cols: m.cols,
            data: self.upload(&m.to_gguf())?,
        })
    }

    /// The table's cos/sin values read back through its public rotation (a unit vector
    /// in each pair rotates to exactly (cos, sin)), so the device uses the very same f32
    /// values as the CPU backends.
    pub fn upload_rope(&self, t: &RopeTable) -> Result<DeviceRope> {
        let (rot, half) = (t.rot_dim(), t.rot_dim() / 2);
        let mut unit = vec![0f32; rot];
        for i in 0..half {
            let a = match t.style() {
                RopeStyle::Normal => 2 * i,
                RopeStyle::Neox => i,
            };
            unit[a] = 1.0;
        }
        let n = t.max_pos();
        let mut x: Vec<f32> = Vec::with_capacity(n * rot);
        for _ in 0..n {
            x.extend_from_slice(&unit);
        }
        let positions: Vec<usize> = (0..n).collect();
        crate::Kernels::rope(&crate::ScalarKernels, &mut x, 1, rot, &positions, t)?;
        let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
        for head in x.chunks_exact(rot) {
            for i in 0..half {
                let (a, b) = match t.style() {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                cos.push(head[a]);
                sin.push(head[b]);
            }
        }
        Ok(DeviceRope {
            style: t.style(),
            rot_dim: rot,
            max_pos: n,
            cos: self.upload(&cos)?,
            sin: self.upload(&sin)?,
        })
    }

    pub fn alloc_kv(
        &self,
        ty: GgmlType,
        n_layers: usize,
        kv_dim: usize,
        block_tokens: usize,
        n_blocks: usize,
    ) -> Result<DeviceKv> {
        if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0) {
            return Err(shape(
                "cuda kv",
                format!("KV dtype {ty} (use F32, F16 or Q8_0)"),
            ));
        }
        if block_tokens == 0 || n_blocks == 0 || n_blocks > u32::MAX as usize {
            return Err(shape(
                "cuda kv",
                format!("{n_blocks} blocks of {block_tokens}"),
            ));
        }
        // The store kernel encodes whole 32-value chunks (Q8_0 blocks).
        if kv_dim == 0 || !kv_dim.is_multiple_of(crate::QK) {
            return Err(shape(
                "cuda kv",
                format!("kv_dim {kv_dim} is not a multiple of 32"),
            ));
        }
        let total = DeviceKv::bytes_for(ty, n_layers, kv_dim, block_tokens, n_blocks)?;
        Ok(DeviceKv {
            ty,
            n_layers,
            kv_dim,
            block_tokens,
            n_blocks,
            row_bytes: ty.row_bytes(kv_dim)?,
            k: self.zeros(total / 2)?,
            v: self.zeros(total / 2)?,
        })
    }

    /// `'a` ties the pushed arguments to this call: they must outlive the builder.
    fn launch<'a>(
        &'a self,
        k: Kernel,
        l: Launch,
        args: impl FnOnce(&mut cudarc::driver::LaunchArgs<'a>),
    ) -> Result<()> {
        let mut b = self.stream.launch_builder(self.func(k));
        args(&mut b);
        // SAFETY: each caller pushes exactly the arguments of the kernel's C signature, in
        // order and with matching types (device buffers as pointers, i32 for `int`, u64
        // for `u64`, f32 for `float`), after checking every buffer length the kernel's
        // indexing relies on.
        unsafe { b.launch(l.into()) }
            .map(|_| ())
            .map_err(driver_err(k.name()))
    }

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

    /// Quantize `n_values` activations (a multiple of 32) into BlockQ8 bytes.
    pub fn quantize_q8(
        &self,
        x: &CudaView<'_, f32>,
        n_values: usize,
        out: &mut CudaViewMut<'_, u8>,
    ) -> Result<()> {
        if !n_values.is_multiple_of(crate::QK) {
            return Err(shape("quantize_q8", format!("{n_values} values")));
        }
        len_check("quantize_q8", "x", x.len(), n_values)?;
        len_check("quantize_q8", "out", out.len(), launch::q8_bytes(n_values))?;
        let nb = n_values / crate::QK;
        if nb == 0 {
            return Ok(());
        }
        let nb64 = nb as u64;
        self.launch(Kernel::QuantizeQ8, launch::quantize_q8(nb)?, |b| {
            b.arg(x).arg(&nb64).arg(out);
        })
    }

    /// `out[t·rows + r] = Σ_c W[r][c] · x[t·cols + c]`. For quantized `w`, `xq` must hold
    /// [`CudaDevice::quantize_q8`] of `x` (shared by all matrices with the same input).
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
        len_check("matmul", "xq", xq.len(), launch::q8_bytes(n_tok * w.cols))?;
        let nb = i32_of(w.cols / crate::QK)?;
        let k = match (kind, w.ty) {
            (MatmulKind::Vector, GgmlType::Q4_0) => Kernel::MmvqQ4_0,
            (MatmulKind::Vector, GgmlType::Q4_1) => Kernel::MmvqQ4_1,
            (MatmulKind::Vector, _) => Kernel::MmvqQ8_0,
            (_, GgmlType::Q4_0) => Kernel::MmqQ4_0,
            (_, GgmlType::Q4_1) => Kernel::MmqQ4_1,
            _ => Kernel::MmqQ8_0,
        };
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
                    .arg(&scale);
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
                    .arg(&bk);
            })?;
        }
        Ok(())
    }

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
}

impl CudaDevice {
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

    /// Buffers for decode steps of up to `cap` rows and `table_cap` block-table entries.
    pub fn alloc_decode_inputs(&self, cap: usize, table_cap: usize) -> Result<DecodeInputs> {
        if cap == 0 || table_cap <= cap {
            return Err(shape(
                "decode inputs",
                format!("{cap} rows, {table_cap} table entries"),
            ));
        }
        let rows: Vec<i32> = (0..i32_of(cap)?).collect();
        let want: Vec<u32> = (0..cap as u32).collect();
        Ok(DecodeInputs {
            cap,
            table_cap,
            step: CudaStep {
                tokens: self.zeros(cap)?,
                positions: self.zeros(cap)?,
                slots: self.upload(&vec![-1i64; cap])?,
                want: self.upload(&want)?,
                plan: DeviceAttnPlan {
                    n_queries: cap,
                    n_singles: cap,
                    n_tiles: 0,
                    singles: self.upload(&rows)?,
                    tiles: self.zeros(1)?,
                    n_ctx: self.upload(&vec![1i32; cap])?,
                    tbl_off: self.zeros(cap)?,
                    tables: self.zeros(table_cap)?,
                },
            },
        })
    }

    /// Copy one decode step into `inp`, padded to `bucket` rows ([`launch::pack_decode`]
    /// checks every block id against `kv`). The copies are ordered on the stream before
    /// whatever is launched next.
    pub fn write_decode_inputs(
        &self,
        inp: &mut DecodeInputs,
        kv: &DeviceKv,
        rows: &[DecodeRow<'_>],
        bucket: usize,
    ) -> Result<()> {
        if bucket > inp.cap {
            return Err(shape(
                "decode inputs",
                format!("bucket {bucket} over {}", inp.cap),
            ));
        }
        let p = launch::pack_decode(rows, bucket, kv.block_tokens, kv.n_blocks, inp.table_cap)?;
        let st = &mut inp.step;
        self.upload_into(&p.tokens, &mut st.tokens)?;
        self.upload_into(&p.positions, &mut st.positions)?;
        self.upload_into(&p.slots, &mut st.slots)?;
        self.upload_into(&p.n_ctx, &mut st.plan.n_ctx)?;
        self.upload_into(&p.tbl_off, &mut st.plan.tbl_off)?;
        self.upload_into(&p.tables, &mut st.plan.tables)?;
        st.plan.n_queries = bucket;
        st.plan.n_singles = bucket;
        Ok(())
    }

    /// Record the work `record` enqueues on the stream into a graph instead of running
    /// it. Nothing executes while recording, and `record` must only launch kernels (no
    /// allocation, copy or synchronization: the driver refuses those during a capture).
    /// The capture is always ended, also when `record` fails, so the stream is usable
    /// afterwards either way.
    /// `record`'s error type is the caller's (anything a kernel [`Error`] converts into).
    pub fn capture<E: From<Error>>(
        &self,
        record: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<DeviceGraph, E> {
        // Thread-local mode: only this thread's capture-unsafe calls are refused, other
        // threads' contexts (tests, other runners) are unaffected.
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver_err("beginning a graph capture"))?;
        let recorded = record();
        let ended = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver_err("ending a graph capture"));
        recorded?;
        let graph = ended?.ok_or_else(|| Error::Cuda("graph capture recorded nothing".into()))?;
        graph
            .upload()
            .map_err(driver_err("uploading a captured graph"))?;
        Ok(DeviceGraph { graph })
    }

    /// Replay a captured graph on the stream (asynchronously, like a kernel launch).
    pub fn launch_graph(&self, g: &DeviceGraph) -> Result<()> {
        g.graph.launch().map_err(driver_err("graph launch"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_without_a_driver_is_a_clear_error_not_a_panic() {
        // This machine class (CI) has no NVIDIA driver; on a GPU machine the probe must
        // succeed instead, so the assertion depends on what the loader finds.
        // SAFETY: dlopen attempts only.
        let driver = unsafe { sys::is_culib_present() };
        match probe(0) {
            Err(Error::Cuda(msg)) if !driver => {
                assert!(msg.contains("libcuda.so.1 not found"), "{msg}")
            }
            Ok(info) if driver => assert_eq!(info.ordinal, 0),
            Err(Error::Cuda(msg)) if driver => {
                assert!(msg.contains("no device") || msg.contains("CUDA"), "{msg}")
            }
            other => panic!("driver present: {driver}, probe: {other:?}"),
        }
        match probe(4096) {
            Err(Error::Cuda(msg)) => assert!(
                msg.contains("libcuda.so.1 not found") || msg.contains("no device 4096"),
                "{msg}"
            ),
            other => panic!("{other:?}"),
        }
        assert!(CudaDevice::new(4096).is_err());
    }

    #[test]
    fn kv_pool_sizes_match_the_cpu_layout() {
        // SmolLM2: 30 layers, kv_dim 192, F16 rows of 384 bytes, 16-token blocks.
        let b = DeviceKv::bytes_for(GgmlType::F16, 30, 192, 16, 2048).unwrap();
        assert_eq!(b, 2048 * 16 * 384 * 30 * 2);
        assert_eq!(
            DeviceKv::bytes_for(GgmlType::Q8_0, 1, 64, 4, 3).unwrap(),
            3 * 4 * 68 * 2
        );
        assert!(DeviceKv::bytes_for(GgmlType::F32, usize::MAX, 64, 16, 16).is_err());
        assert!(DeviceKv::bytes_for(GgmlType::Q8_0, 1, 33, 16, 16).is_err());
    }
}
