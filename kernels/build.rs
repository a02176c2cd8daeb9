//! With feature `cuda-sim`: builds the CPU executor of the CUDA path (kernels/cuda-sim,
//! see its README.md) into `$OUT_DIR/cuda-sim`, with the C++ compiler the `cc` crate finds
//! (`CXX`, else `c++`) and nothing downloaded:
//! - `libcuda.so.1`: the stand-in driver and the executor;
//! - `libtandem_cuda_kernels.so` / `..._checked.so`: every `kernels/src/cuda/*.cu` compiled
//!   as C++17 (plain, and instrumented for the race / bounds detectors);
//! - `libtandem_cuda_selftest.so`: the executor's own test kernels (checked).
//!
//! Kernels are found, not listed: each `.cu` file is preprocessed with `TSIM_SCAN`, and
//! every `__global__ void name(` in it is registered with a trampoline derived from its
//! signature. Without the feature this script does nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The C++ compiler the `cc` crate finds (`CXX`, else `c++`). `cc` is a build dependency
/// only with feature `cuda-sim`; without it `main` returns before this is called.
#[cfg(feature = "cuda-sim")]
fn cxx() -> PathBuf {
    cc::Build::new()
        .cpp(true)
        .cargo_metadata(false)
        .get_compiler()
        .path()
        .to_path_buf()
}

#[cfg(not(feature = "cuda-sim"))]
fn cxx() -> PathBuf {
    unreachable!("the CPU executor is built only with feature cuda-sim")
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA_SIM").is_none() {
        return;
    }
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let sim = root.join("cuda-sim");
    let cuda = root.join("src/cuda");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("cuda-sim");
    std::fs::create_dir_all(&out).unwrap();
    for dir in [&sim, &sim.join("tests"), &cuda] {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    let target = std::env::var("TARGET").unwrap();
    if !target.starts_with("x86_64-") || !target.contains("linux") {
        panic!("feature cuda-sim: the CPU executor runs on x86-64 Linux only (target {target})");
    }
    let cxx = cxx();
    let b = Builder {
        cxx,
        sim: sim.clone(),
        cuda: cuda.clone(),
        out: out.clone(),
        jobs: std::env::var("NUM_JOBS")
            .ok()
            .and_then(|j| j.parse().ok())
            .unwrap_or(2),
    };

    let mut cus: Vec<PathBuf> = std::fs::read_dir(&cuda)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    cus.sort();
    let selftest = sim.join("tests/selftest.cu");

    // The driver and executor.
    let mut jobs = Vec::new();
    for f in ["driver", "scheduler", "checks", "image"] {
        jobs.push(b.compile(
            &sim.join(format!("{f}.cpp")),
            &format!("{f}.o"),
            Flavor::Host,
        ));
    }
    jobs.push(b.compile(&sim.join("switch_x86_64.S"), "switch.o", Flavor::Host));
    // Every .cu file, plain and checked, and the self-test kernels (checked).
    let mut plain = vec![b.compile(&sim.join("registry.cpp"), "registry.o", Flavor::Host)];
    let mut checked = vec![
        b.compile(
            &sim.join("registry.cpp"),
            "registry_checked.o",
            Flavor::HostChecked,
        ),
        b.compile(&sim.join("check_hooks.cpp"), "check_hooks.o", Flavor::Host),
    ];
    let mut selftests = vec![checked[0].clone(), checked[1].clone()];
    for cu in cus.iter().chain([&selftest]) {
        let stem = cu.file_stem().unwrap().to_str().unwrap().to_string();
        let unit = b.unit(cu, &stem);
        let is_test = cu == &selftest;
        let c = b.compile(&unit, &format!("{stem}_checked.o"), Flavor::KernelChecked);
        if is_test {
            selftests.push(c);
        } else {
            checked.push(c);
            plain.push(b.compile(&unit, &format!("{stem}.o"), Flavor::Kernel));
        }
    }
    b.run_all(
        jobs.iter()
            .chain(&plain)
            .chain(&checked)
            .chain(&selftests[2..]),
    );

    let driver: Vec<&Job> = jobs.iter().collect();
    b.link(
        &driver,
        "libcuda.so.1",
        &["-Wl,-soname,libcuda.so.1", "-ldl", "-lpthread"],
    );
    let against_driver = ["-L.", "-l:libcuda.so.1"];
    b.link(
        &plain.iter().collect::<Vec<_>>(),
        "libtandem_cuda_kernels.so",
        &against_driver,
    );
    b.link(
        &checked.iter().collect::<Vec<_>>(),
        "libtandem_cuda_kernels_checked.so",
        &against_driver,
    );
    b.link(
        &selftests.iter().collect::<Vec<_>>(),
        "libtandem_cuda_selftest.so",
        &against_driver,
    );
    println!("cargo:rustc-env=TANDEM_CUDA_SIM_DIR={}", out.display());
}

#[derive(Clone, Copy, PartialEq)]
enum Flavor {
    /// The executor and library glue.
    Host,
    /// Glue of a checked library (reports itself as checked).
    HostChecked,
    /// Kernels as the executor runs them by default.
    Kernel,
    /// Kernels with every memory access reported to the detectors.
    KernelChecked,
}

#[derive(Clone)]
struct Job {
    src: PathBuf,
    obj: String,
    flavor: Flavor,
}

struct Builder {
    cxx: PathBuf,
    sim: PathBuf,
    cuda: PathBuf,
    out: PathBuf,
    jobs: usize,
}

const COMMON: &[&str] = &[
    "-std=gnu++17",
    "-O2",
    "-fPIC",
    "-fvisibility=hidden",
    "-fvisibility-inlines-hidden",
    "-fno-exceptions",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
];

/// The executor itself is warning-free; kernel code gets the warnings without failing.
const HOST: &[&str] = &["-Werror", "-fno-semantic-interposition"];

/// The executor's float semantics (see cuda_sim.h): one IEEE operation at a time. -O3
/// changes no float result (without -ffast-math g++ neither reassociates nor contracts);
/// it unrolls the kernels' small fixed loops (their `#pragma unroll`), which halves the
/// time of the tiled matmuls.
const KERNEL: &[&str] = &[
    "-O3",
    "-march=native",
    "-DTANDEM_CUDA_SIM",
    "-fno-plt",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-fno-math-errno",
    "-fno-strict-aliasing",
    "-fno-rtti",
    "-Wno-unknown-pragmas",
    "-Wno-unused-function",
    "-Wno-sign-compare",
];

/// GCC's thread-sanitizer instrumentation without its runtime (check_hooks.cpp receives the
/// calls); no loop is turned into a memset/memcpy call the hooks would not see.
const CHECKED: &[&str] = &[
    "-DTSIM_CHECKED",
    "-fsanitize=thread",
    "--param=tsan-instrument-func-entry-exit=0",
    "-fno-tree-loop-distribute-patterns",
];

impl Builder {
    fn cmd(&self) -> Command {
        let mut c = Command::new(&self.cxx);
        c.current_dir(&self.out);
        c
    }

    /// The translation unit of one .cu file: the built-ins, then common.cuh and the file
    /// inside a namespace of its own, then the registrar of the kernels it defines.
    fn unit(&self, cu: &Path, stem: &str) -> PathBuf {
        let ns = format!("tsim_cu_{stem}");
        let body = format!(
            "#include \"cuda_sim.h\"\nnamespace {ns} {{\nstatic const char tsim_file[] = \"{stem}.cu\";\n\
             #include \"common.cuh\"\n#include \"{}\"\n}}\n",
            cu.display()
        );
        let path = self.out.join(format!("{stem}_unit.cpp"));
        std::fs::write(&path, &body).unwrap();
        let pre = self
            .cmd()
            .args(COMMON)
            .args(KERNEL)
            .arg("-DTSIM_SCAN")
            .arg("-E")
            .arg("-P")
            .arg(format!("-I{}", self.sim.display()))
            .arg(format!("-I{}", self.cuda.display()))
            .arg(&path)
            .output()
            .unwrap_or_else(|e| panic!("running {}: {e}", self.cxx.display()));
        if !pre.status.success() {
            panic!(
                "preprocessing {}:\n{}",
                cu.display(),
                String::from_utf8_lossy(&pre.stderr)
            );
        }
        let names = kernel_names(&String::from_utf8_lossy(&pre.stdout))
            .unwrap_or_else(|e| panic!("{}: {e}", cu.display()));
        if names.is_empty() {
            panic!("{}: defines no __global__ kernel", cu.display());
        }
        let regs: String = names
            .iter()
            .map(|n| format!(" TSIM_KERNEL({ns}, {n})"))
            .collect();
        std::fs::write(&path, format!("{body}TSIM_REGISTER({ns},{regs})\n")).unwrap();
        path
    }

    fn compile(&self, src: &Path, obj: &str, flavor: Flavor) -> Job {
        Job {
            src: src.to_path_buf(),
            obj: obj.to_string(),
            flavor,
        }
    }

    fn command(&self, j: &Job) -> Command {
        let mut c = self.cmd();
        let asm = j.src.extension().is_some_and(|e| e == "S");
        if !asm {
            c.args(COMMON);
        }
        match j.flavor {
            Flavor::Host => {
                c.args(HOST);
            }
            Flavor::HostChecked => {
                c.args(HOST).arg("-DTSIM_CHECKED");
            }
            Flavor::Kernel => {
                c.args(KERNEL);
            }
            Flavor::KernelChecked => {
                c.args(KERNEL).args(CHECKED);
            }
        }
        c.arg(format!("-I{}", self.sim.display()))
            .arg(format!("-I{}", self.cuda.display()))
            .arg("-c")
            .arg(&j.src)
            .arg("-o")
            .arg(&j.obj);
        c
    }

    /// Compiles the jobs, `self.jobs` at a time.
    fn run_all<'a>(&self, jobs: impl Iterator<Item = &'a Job>) {
        let jobs: Vec<&Job> = jobs.collect();
        for chunk in jobs.chunks(self.jobs.max(1)) {
            let running: Vec<_> = chunk
                .iter()
                .map(|j| {
                    let child = self
                        .command(j)
                        .stderr(std::process::Stdio::piped())
                        .spawn()
                        .unwrap_or_else(|e| panic!("running {}: {e}", self.cxx.display()));
                    (j, child)
                })
                .collect();
            for (j, child) in running {
                let o = child.wait_with_output().unwrap();
                if !o.status.success() {
                    panic!(
                        "compiling {} for the CUDA CPU executor:\n{}",
                        j.src.display(),
                        String::from_utf8_lossy(&o.stderr)
                    );
                }
            }
        }
    }

    fn link(&self, objs: &[&Job], lib: &str, extra: &[&str]) {
        let o = self
            .cmd()
            .arg("-shared")
            .arg("-Wl,-z,defs")
            .arg("-o")
            .arg(lib)
            .args(objs.iter().map(|j| &j.obj))
            .args(extra)
            .output()
            .unwrap();
        if !o.status.success() {
            panic!("linking {lib}:\n{}", String::from_utf8_lossy(&o.stderr));
        }
    }
}

/// Every `__tsim_kernel__ void NAME (` of a preprocessed unit (what `__global__` becomes
/// under TSIM_SCAN); anything else after the marker is an error naming it.
fn kernel_names(pre: &str) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    let mut rest = pre;
    while let Some(at) = rest.find("__tsim_kernel__") {
        rest = &rest[at + "__tsim_kernel__".len()..];
        let t = rest.trim_start();
        let Some(after_void) = t.strip_prefix("void") else {
            return Err(format!(
                "a __global__ function that is not `__global__ void name(...)`: {}",
                &t[..t.len().min(60)]
            ));
        };
        let t = after_void.trim_start();
        let end = t
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(t.len());
        let (name, tail) = t.split_at(end);
        if name.is_empty() || !tail.trim_start().starts_with('(') {
            return Err(format!(
                "cannot read the kernel name in `__global__ void {}`",
                &t[..t.len().min(60)]
            ));
        }
        names.push(name.to_string());
    }
    Ok(names)
}
