//! A CUDA device: driver probe, context, one stream, the loaded kernels, device-resident
//! weights / KV pools, and one typed launch wrapper per kernel.
//!
//! Every wrapper checks the lengths of the buffers it is given against the shapes it is
//! told, so that every index a kernel computes stays inside its buffers; what it cannot
//! check (values stored on the device: token ids, block ids, positions) is a documented
//! precondition that the callers validate on the host before uploading.
//!
//! By concern: [`resident`] (weights, rope tables, KV pools), [`elementwise`] and
//! [`matmul`] (the forward pass's kernels), [`attention`] (the attention plan and kernel),
//! [`kv`] (KV store and transfer), [`sampling`] (greedy, top-k, sampling), [`graph`]
//! (decode-step inputs at fixed addresses, capture and replay).

mod attention;
mod elementwise;
mod graph;
mod kv;
mod matmul;
mod resident;
mod sampling;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DeviceRepr, DriverError,
    ValidAsZeroBits, result as drv, sys,
};
use cudarc::nvrtc::Ptx;

pub use attention::{CudaStep, DeviceAttnPlan};
pub use graph::{DecodeInputs, DeviceGraph};
pub use resident::{DeviceKv, DeviceMatrix, DeviceRope};

use super::launch::Launch;
use super::sources::{self, Kernel, Target};
use crate::error::{Error, Result, shape};
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
    // A test that asks for the CPU executor gets it before cudarc looks for a driver.
    #[cfg(feature = "cuda-sim")]
    if super::sim::requested() {
        super::sim::install()?;
    }
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

pub(super) fn len_check(op: &'static str, what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(shape(op, format!("{what}: {have} elements, need {need}")));
    }
    Ok(())
}

pub(super) fn i32_of(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| shape("cuda", format!("{v} exceeds i32")))
}

pub(super) fn ty_id(ty: GgmlType) -> i32 {
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
}
