//! The CPU executor of the CUDA path (feature `cuda-sim`; `kernels/cuda-sim/README.md`).
//!
//! build.rs compiles a stand-in `libcuda.so.1` (the driver functions cudarc calls, on the
//! CPU) and every `.cu` file as C++ into kernel libraries. [`install`] loads that driver
//! into the process *before* cudarc looks for one, under the real driver's soname, so
//! cudarc's lazy `dlopen("libcuda.so.1")` finds it: from then on every CUDA call of the
//! process — NVRTC-compiled modules, launches, copies, graphs — runs the real `.cu` code on
//! the CPU. Nothing loads it unless a test asks: [`install`] directly, or
//! [`super::probe`] when `TANDEM_CUDA_SIM=1` is set. It refuses to stand in where an
//! NVIDIA driver exists (a GPU machine runs `tests/gpu/run.sh` on the real one).
//!
//! Per-thread executor options ([`Executor::set_thread_options`], defaults from
//! `TANDEM_CUDA_SIM_ORDER=forward|reverse|random[:SEED]` and `TANDEM_CUDA_SIM_CHECKS=1`):
//! the order in which a block's threads are resumed, and whether launches run the checked
//! kernel library (race, out-of-bounds and uninitialized-shared-memory detection).

#[cfg(test)]
mod tests;

use std::ffi::{CStr, c_char, c_int};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_LAZY, RTLD_LOCAL, RTLD_NOW};

use crate::error::{Error, Result};

/// Where build.rs put the executor's libraries.
pub const DIR: &str = env!("TANDEM_CUDA_SIM_DIR");

/// Files whose presence means an NVIDIA kernel driver is installed.
pub const DRIVER_EVIDENCE: [&str; 3] = [
    "/proc/driver/nvidia/version",
    "/dev/nvidiactl",
    "/dev/nvidia0",
];

/// The order in which the executor resumes a block's threads: warp by warp in warp order,
/// the lanes of a warp in lane order; `Random` draws both orders afresh at every barrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    Forward,
    Reverse,
    Random(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub order: Order,
    /// Run the checked kernel library (race / bounds / uninitialized-read detection).
    pub checks: bool,
}

impl Options {
    fn raw(self) -> (c_int, u64, c_int) {
        let (o, seed) = match self.order {
            Order::Forward => (0, 1),
            Order::Reverse => (1, 1),
            Order::Random(s) => (2, s),
        };
        (o, seed, c_int::from(self.checks))
    }
}

impl std::str::FromStr for Order {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.split_once(':') {
            None if s == "forward" => Ok(Order::Forward),
            None if s == "reverse" => Ok(Order::Reverse),
            None if s == "random" => Ok(Order::Random(1)),
            Some(("random", seed)) => seed
                .parse()
                .map(Order::Random)
                .map_err(|_| format!("bad seed in {s:?}")),
            _ => Err(format!(
                "bad thread order {s:?}: use forward, reverse or random[:SEED]"
            )),
        }
    }
}

/// Process totals of the executor.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Stats {
    pub launches: u64,
    pub blocks: u64,
    pub threads: u64,
    /// Fiber switches (what synchronization costs on the CPU).
    pub switches: u64,
    pub checked_launches: u64,
    /// CPU time the launching threads spent inside launches.
    pub cpu_seconds: f64,
}

type SetOptions = unsafe extern "C" fn(c_int, u64, c_int);
type GetOptions = unsafe extern "C" fn(*mut c_int, *mut u64, *mut c_int);
type StatsFn = unsafe extern "C" fn(*mut u64);
type LastError = unsafe extern "C" fn(*mut c_char, usize) -> usize;
type LoadLibrary = unsafe extern "C" fn(*const c_char, *mut c_char, usize) -> c_int;
type MemoryFn = unsafe extern "C" fn(*mut u64, *mut u64);

/// The loaded executor.
pub struct Executor {
    _lib: Library,
    set_options: SetOptions,
    get_options: GetOptions,
    set_defaults: SetOptions,
    stats: StatsFn,
    last_error: LastError,
    load_library: LoadLibrary,
    memory: MemoryFn,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor").field("dir", &DIR).finish()
    }
}

/// Whether the environment asks for the executor (`TANDEM_CUDA_SIM=1`).
pub fn requested() -> bool {
    std::env::var("TANDEM_CUDA_SIM").is_ok_and(|v| v == "1")
}

/// The first of `paths` that exists: evidence of an NVIDIA driver.
pub fn driver_evidence<'a>(paths: &[&'a str]) -> Option<&'a str> {
    paths.iter().copied().find(|p| Path::new(p).exists())
}

fn sim_err(what: impl std::fmt::Display) -> Error {
    Error::Cuda(format!("CUDA CPU executor: {what}"))
}

/// A library by name (as cudarc looks for the driver) that is not the executor.
fn real_driver_library() -> Option<String> {
    for name in ["libcuda.so.1", "libcuda.so"] {
        // SAFETY: loading runs the library's initializers; a system's libcuda is designed
        // to be loaded this way (it is what cudarc does next), and the handle is closed
        // before anything is called through it.
        if let Ok(lib) = unsafe { Library::open(Some(name), RTLD_LAZY | RTLD_LOCAL) } {
            // SAFETY: only looks the symbol up; nothing is called.
            let ours =
                unsafe { lib.get::<unsafe extern "C" fn() -> u32>(b"tsim_abi_version") }.is_ok();
            if !ours {
                return Some(name.to_string());
            }
        }
    }
    None
}

/// Load the executor into this process (once; later calls return the same), refusing
/// where an NVIDIA driver exists.
pub fn install() -> Result<&'static Executor> {
    static EXEC: OnceLock<std::result::Result<Executor, String>> = OnceLock::new();
    EXEC.get_or_init(|| load(&DRIVER_EVIDENCE).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| Error::Cuda(e.clone()))
}

/// Path of one of the executor's libraries.
pub fn library(name: &str) -> PathBuf {
    Path::new(DIR).join(name)
}

fn load(evidence: &[&str]) -> Result<Executor> {
    if let Some(p) = driver_evidence(evidence) {
        return Err(sim_err(format!(
            "this machine has an NVIDIA driver ({p}): the CPU executor does not stand in for \
             it; run tests/gpu/run.sh on the GPU instead"
        )));
    }
    if let Some(name) = real_driver_library() {
        return Err(sim_err(format!(
            "a CUDA driver library ({name}) is installed: the CPU executor does not stand in \
             for it"
        )));
    }
    let path = library("libcuda.so.1");
    // SAFETY: the library is the executor build.rs built for this crate (same ABI as the
    // declarations below); RTLD_GLOBAL makes it the process's `libcuda.so.1` for cudarc and
    // for the kernel libraries linked against it. It stays loaded for the process's life
    // (the Executor lives in a static).
    let lib = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| sim_err(format!("loading {}: {e}", path.display())))?;
    // SAFETY: each symbol is exported by driver.cpp with exactly the signature named here.
    let exec = unsafe {
        Executor {
            set_options: *lib
                .get::<SetOptions>(b"tsim_set_thread_options")
                .map_err(sim_err)?,
            get_options: *lib
                .get::<GetOptions>(b"tsim_get_thread_options")
                .map_err(sim_err)?,
            set_defaults: *lib
                .get::<SetOptions>(b"tsim_set_default_options")
                .map_err(sim_err)?,
            stats: *lib.get::<StatsFn>(b"tsim_stats").map_err(sim_err)?,
            last_error: *lib.get::<LastError>(b"tsim_last_error").map_err(sim_err)?,
            load_library: *lib
                .get::<LoadLibrary>(b"tsim_load_library")
                .map_err(sim_err)?,
            memory: *lib.get::<MemoryFn>(b"tsim_memory").map_err(sim_err)?,
            _lib: lib,
        }
    };
    exec.load_kernel_library(&library("libtandem_cuda_kernels.so"))?;
    exec.load_kernel_library(&library("libtandem_cuda_kernels_checked.so"))?;
    let order = match std::env::var("TANDEM_CUDA_SIM_ORDER") {
        Ok(s) => s.parse().map_err(sim_err)?,
        Err(_) => Order::Forward,
    };
    let checks = std::env::var("TANDEM_CUDA_SIM_CHECKS").is_ok_and(|v| v == "1");
    let (o, seed, c) = Options { order, checks }.raw();
    // SAFETY: plain values.
    unsafe { (exec.set_defaults)(o, seed, c) };
    Ok(exec)
}

impl Executor {
    /// Make a kernel library's kernels launchable by name (the executor's self-test
    /// kernels, or a library of another build).
    pub fn load_kernel_library(&self, path: &Path) -> Result<()> {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| sim_err("library path with a NUL byte"))?;
        let mut err = vec![0 as c_char; 512];
        // SAFETY: `c` is a NUL-terminated path and `err` a buffer of the length passed.
        if unsafe { (self.load_library)(c.as_ptr(), err.as_mut_ptr(), err.len()) } != 0 {
            // SAFETY: the executor wrote a NUL-terminated message into `err`.
            let msg = unsafe { CStr::from_ptr(err.as_ptr()) };
            return Err(sim_err(msg.to_string_lossy()));
        }
        Ok(())
    }

    /// Options of the launches the calling thread makes from now on.
    pub fn set_thread_options(&self, o: Options) {
        let (order, seed, checks) = o.raw();
        // SAFETY: plain values.
        unsafe { (self.set_options)(order, seed, checks) }
    }

    pub fn thread_options(&self) -> Options {
        let (mut o, mut seed, mut c) = (0, 0u64, 0);
        // SAFETY: three valid out-pointers.
        unsafe { (self.get_options)(&mut o, &mut seed, &mut c) };
        let order = match o {
            0 => Order::Forward,
            1 => Order::Reverse,
            _ => Order::Random(seed),
        };
        Options {
            order,
            checks: c != 0,
        }
    }

    pub fn stats(&self) -> Stats {
        let mut v = [0u64; 6];
        // SAFETY: the executor writes exactly six values.
        unsafe { (self.stats)(v.as_mut_ptr()) };
        Stats {
            launches: v[0],
            blocks: v[1],
            threads: v[2],
            switches: v[3],
            checked_launches: v[4],
            cpu_seconds: v[5] as f64 * 1e-9,
        }
    }

    /// The report of the calling thread's last failed launch (every failure is also
    /// printed to stderr).
    pub fn last_error(&self) -> String {
        let mut buf = vec![0 as c_char; 4096];
        // SAFETY: `buf` has the length passed; the executor NUL-terminates within it.
        unsafe { (self.last_error)(buf.as_mut_ptr(), buf.len()) };
        // SAFETY: NUL-terminated as above.
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    /// Live device allocations: (count, bytes).
    pub fn memory(&self) -> (u64, u64) {
        let (mut n, mut b) = (0, 0);
        // SAFETY: two valid out-pointers.
        unsafe { (self.memory)(&mut n, &mut b) };
        (n, b)
    }
}
