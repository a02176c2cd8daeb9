//! The CUDA C sources, the kernels each defines, and their NVRTC compilation.
//!
//! Every `.cu` file is compiled on its own (prefixed with `common.cuh`) into one PTX
//! module. Kernels are `extern "C"`, so the PTX entry names equal [`Kernel::name`], which
//! is the only way the launch wrappers refer to a kernel; CI checks each name against the
//! PTX of its file (`tests/cuda_nvrtc.rs`).
//!
//! Images are compiled once per process and architecture ([`images_for_arch`]) and
//! shared by every device context of that architecture.

use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::result as nvrtc;
use cudarc::nvrtc::sys as nvrtc_sys;

use crate::error::{Error, Result};
use crate::types::GgmlType;

/// Prepended to every source file.
pub const PRELUDE: &str = include_str!("common.cuh");

/// One `.cu` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Source {
    pub file: &'static str,
    pub code: &'static str,
}

pub const SOURCES: [Source; 8] = [
    Source {
        file: "embed.cu",
        code: include_str!("embed.cu"),
    },
    Source {
        file: "norm.cu",
        code: include_str!("norm.cu"),
    },
    Source {
        file: "rope.cu",
        code: include_str!("rope.cu"),
    },
    Source {
        file: "elementwise.cu",
        code: include_str!("elementwise.cu"),
    },
    Source {
        file: "matmul.cu",
        code: include_str!("matmul.cu"),
    },
    Source {
        file: "attention.cu",
        code: include_str!("attention.cu"),
    },
    Source {
        file: "sampling.cu",
        code: include_str!("sampling.cu"),
    },
    Source {
        file: "kv.cu",
        code: include_str!("kv.cu"),
    },
];

/// Every kernel the launch wrappers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    Embed,
    RmsNorm,
    RmsNormInPlace,
    Rope,
    SiluMul,
    GeluMul,
    AddBias,
    Scale,
    Add,
    GatherRows,
    QuantizeQ8,
    QuantizeQ8K,
    MmvqQ4_0,
    MmvqQ4_1,
    MmvqQ5_0,
    MmvqQ5_1,
    MmvqQ8_0,
    MmvqQ4K,
    MmvqQ5K,
    MmvqQ6K,
    MmqQ4_0,
    MmqQ4_1,
    MmqQ5_0,
    MmqQ5_1,
    MmqQ8_0,
    MmqQ4K,
    MmqQ5K,
    MmqQ6K,
    MmvFloat,
    AttnDecode,
    AttnPrefill,
    Argmax,
    TopK,
    Sample,
    KvStore,
    KvGather,
    KvScatter,
}

impl Kernel {
    pub const ALL: [Kernel; 37] = [
        Kernel::Embed,
        Kernel::RmsNorm,
        Kernel::RmsNormInPlace,
        Kernel::Rope,
        Kernel::SiluMul,
        Kernel::GeluMul,
        Kernel::AddBias,
        Kernel::Scale,
        Kernel::Add,
        Kernel::GatherRows,
        Kernel::QuantizeQ8,
        Kernel::QuantizeQ8K,
        Kernel::MmvqQ4_0,
        Kernel::MmvqQ4_1,
        Kernel::MmvqQ5_0,
        Kernel::MmvqQ5_1,
        Kernel::MmvqQ8_0,
        Kernel::MmvqQ4K,
        Kernel::MmvqQ5K,
        Kernel::MmvqQ6K,
        Kernel::MmqQ4_0,
        Kernel::MmqQ4_1,
        Kernel::MmqQ5_0,
        Kernel::MmqQ5_1,
        Kernel::MmqQ8_0,
        Kernel::MmqQ4K,
        Kernel::MmqQ5K,
        Kernel::MmqQ6K,
        Kernel::MmvFloat,
        Kernel::AttnDecode,
        Kernel::AttnPrefill,
        Kernel::Argmax,
        Kernel::TopK,
        Kernel::Sample,
        Kernel::KvStore,
        Kernel::KvGather,
        Kernel::KvScatter,
    ];

    /// The `extern "C"` entry name in the PTX.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Embed => "tandem_embed",
            Kernel::RmsNorm => "tandem_rmsnorm",
            Kernel::RmsNormInPlace => "tandem_rmsnorm_inplace",
            Kernel::Rope => "tandem_rope",
            Kernel::SiluMul => "tandem_silu_mul",
            Kernel::GeluMul => "tandem_gelu_mul",
            Kernel::AddBias => "tandem_add_bias",
            Kernel::Scale => "tandem_scale",
            Kernel::Add => "tandem_add",
            Kernel::GatherRows => "tandem_gather_rows",
            Kernel::QuantizeQ8 => "tandem_quantize_q8",
            Kernel::QuantizeQ8K => "tandem_quantize_q8k",
            Kernel::MmvqQ4_0 => "tandem_mmvq_q4_0",
            Kernel::MmvqQ4_1 => "tandem_mmvq_q4_1",
            Kernel::MmvqQ5_0 => "tandem_mmvq_q5_0",
            Kernel::MmvqQ5_1 => "tandem_mmvq_q5_1",
            Kernel::MmvqQ8_0 => "tandem_mmvq_q8_0",
            Kernel::MmvqQ4K => "tandem_mmvq_q4_k",
            Kernel::MmvqQ5K => "tandem_mmvq_q5_k",
            Kernel::MmvqQ6K => "tandem_mmvq_q6_k",
            Kernel::MmqQ4_0 => "tandem_mmq_q4_0",
            Kernel::MmqQ4_1 => "tandem_mmq_q4_1",
            Kernel::MmqQ5_0 => "tandem_mmq_q5_0",
            Kernel::MmqQ5_1 => "tandem_mmq_q5_1",
            Kernel::MmqQ8_0 => "tandem_mmq_q8_0",
            Kernel::MmqQ4K => "tandem_mmq_q4_k",
            Kernel::MmqQ5K => "tandem_mmq_q5_k",
            Kernel::MmqQ6K => "tandem_mmq_q6_k",
            Kernel::MmvFloat => "tandem_mmv_float",
            Kernel::AttnDecode => "tandem_attn_decode",
            Kernel::AttnPrefill => "tandem_attn_prefill",
            Kernel::Argmax => "tandem_argmax",
            Kernel::TopK => "tandem_topk",
            Kernel::Sample => "tandem_sample",
            Kernel::KvStore => "tandem_kv_store",
            Kernel::KvGather => "tandem_kv_gather",
            Kernel::KvScatter => "tandem_kv_scatter",
        }
    }

    /// The file that defines it.
    pub fn file(self) -> &'static str {
        match self {
            Kernel::Embed => "embed.cu",
            Kernel::RmsNorm | Kernel::RmsNormInPlace => "norm.cu",
            Kernel::Rope => "rope.cu",
            Kernel::SiluMul
            | Kernel::GeluMul
            | Kernel::AddBias
            | Kernel::Scale
            | Kernel::Add
            | Kernel::GatherRows
            | Kernel::QuantizeQ8
            | Kernel::QuantizeQ8K => "elementwise.cu",
            Kernel::AttnDecode | Kernel::AttnPrefill => "attention.cu",
            Kernel::Argmax | Kernel::TopK | Kernel::Sample => "sampling.cu",
            Kernel::KvStore | Kernel::KvGather | Kernel::KvScatter => "kv.cu",
            // MmvFloat and the quantized products of [`Kernel::MATMUL`] (the NVRTC test
            // finds each in this file's PTX).
            _ => "matmul.cu",
        }
    }

    /// The quantized matrix kernels of each weight type: (type, few tokens, many tokens).
    /// Adding a type to the CUDA backend is one row here, its two variants above, and
    /// its `load_wblock` / `load_ksub` case and entries in `matmul.cu`.
    pub const MATMUL: [(GgmlType, Kernel, Kernel); 8] = [
        (GgmlType::Q4_0, Kernel::MmvqQ4_0, Kernel::MmqQ4_0),
        (GgmlType::Q4_1, Kernel::MmvqQ4_1, Kernel::MmqQ4_1),
        (GgmlType::Q5_0, Kernel::MmvqQ5_0, Kernel::MmqQ5_0),
        (GgmlType::Q5_1, Kernel::MmvqQ5_1, Kernel::MmqQ5_1),
        (GgmlType::Q8_0, Kernel::MmvqQ8_0, Kernel::MmqQ8_0),
        (GgmlType::Q4_K, Kernel::MmvqQ4K, Kernel::MmqQ4K),
        (GgmlType::Q5_K, Kernel::MmvqQ5K, Kernel::MmqQ5K),
        (GgmlType::Q6_K, Kernel::MmvqQ6K, Kernel::MmqQ6K),
    ];

    /// The kernel multiplying quantized `ty` weights: the warp-per-row one (`tiled` false)
    /// or the shared-memory tile; `None` for a type without CUDA kernels.
    pub fn for_matmul(ty: GgmlType, tiled: bool) -> Option<Kernel> {
        Kernel::MATMUL
            .iter()
            .find(|(t, _, _)| *t == ty)
            .map(|&(_, v, t)| if tiled { t } else { v })
    }

    /// Position in [`Kernel::ALL`] (the index of its loaded function).
    pub fn index(self) -> usize {
        Kernel::ALL
            .iter()
            .position(|k| *k == self)
            .expect("every kernel is listed in ALL")
    }
}

/// The full text NVRTC compiles for `src`.
pub fn full_source(src: &Source) -> String {
    format!("{PRELUDE}\n// ---- {} ----\n{}", src.file, src.code)
}

/// What NVRTC produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// PTX for the virtual architecture `compute_XY` (JIT-compiled by the driver; needs a
    /// driver at least as new as NVRTC).
    Ptx,
    /// SASS for the real architecture `sm_XY`. What the device loads: CUDA's minor-version
    /// compatibility lets a 12.x driver run it, unlike newer PTX.
    Cubin,
}

/// NVRTC's architecture option for compute capability `major.minor`.
pub fn arch_option(major: u32, minor: u32, target: Target) -> String {
    match target {
        Target::Ptx => format!("--gpu-architecture=compute_{major}{minor}"),
        Target::Cubin => format!("--gpu-architecture=sm_{major}{minor}"),
    }
}

/// The loader's library names (`libnvrtc.so.12`, ...) are only tried when first used and
/// a miss panics inside cudarc, so check first and turn a miss into an error.
pub fn nvrtc_available() -> Result<()> {
    // SAFETY: only tries `dlopen` on the candidate names; nothing is called through them.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if present {
        Ok(())
    } else {
        Err(Error::Cuda(
            "NVRTC library not found (libnvrtc.so.12): install the nvidia-cuda-nvrtc-cu12 \
             wheel (`make pyenv`) and put its lib directory on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// An NVRTC program, destroyed on drop (also on every error path).
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program` and destroyed only here, once.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn chars_to_string(v: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = v
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compile one source for compute capability `major.minor`: PTX text (without its
/// terminating NUL) or a CUBIN image.
pub fn compile(src: &Source, major: u32, minor: u32, target: Target) -> Result<Vec<u8>> {
    nvrtc_available()?;
    let fail =
        |what: String| Error::Cuda(format!("NVRTC, {} for sm_{major}{minor}: {what}", src.file));
    let code = CString::new(full_source(src)).map_err(|e| fail(e.to_string()))?;
    let name = CString::new(src.file).map_err(|e| fail(e.to_string()))?;
    // `code` and `name` are declared first, so they outlive the program that points to them.
    let prog =
        Program(nvrtc::create_program(&code, Some(&name)).map_err(|e| fail(format!("{e:?}")))?);
    let opts = [arch_option(major, minor, target), "--std=c++17".to_string()];
    // SAFETY: `prog` is a live program (destroyed only by its Drop).
    if let Err(e) = unsafe { nvrtc::compile_program(prog.0, &opts) } {
        // SAFETY: as above.
        let log = unsafe { nvrtc::get_program_log(prog.0) }
            .map(|l| chars_to_string(&l))
            .unwrap_or_default();
        return Err(fail(format!("{e:?}\n{log}")));
    }
    match target {
        Target::Ptx => {
            // SAFETY: as above, after a successful compile.
            let ptx = unsafe { nvrtc::get_ptx(prog.0) }.map_err(|e| fail(format!("{e:?}")))?;
            Ok(chars_to_string(&ptx).into_bytes())
        }
        Target::Cubin => {
            let mut size = 0usize;
            // SAFETY: as above; `size` is a valid out-pointer.
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| fail(format!("{e:?}")))?;
            let mut image = vec![0u8; size];
            // SAFETY: `image` holds exactly the `size` bytes NVRTC reported.
            unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, image.as_mut_ptr().cast()) }
                .result()
                .map_err(|e| fail(format!("{e:?}")))?;
            Ok(image)
        }
    }
}

/// The compiled image of every source, in [`SOURCES`] order.
pub type ModuleImages = Vec<(&'static str, Vec<u8>)>;

type ImageCache = Mutex<HashMap<(u32, u32, Target), Arc<ModuleImages>>>;

/// All sources compiled for `major.minor`, compiled on the first call in this process and
/// shared afterwards (NVRTC takes seconds; engines and tests may create many contexts).
pub fn images_for_arch(major: u32, minor: u32, target: Target) -> Result<Arc<ModuleImages>> {
    static CACHE: OnceLock<ImageCache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // Compile under the lock: a second caller waits for the first instead of compiling
    // the same thing again.
    let mut map = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = map.get(&(major, minor, target)) {
        return Ok(Arc::clone(p));
    }
    let mut out = Vec::with_capacity(SOURCES.len());
    for s in &SOURCES {
        out.push((s.file, compile(s, major, minor, target)?));
    }
    let out = Arc::new(out);
    map.insert((major, minor, target), Arc::clone(&out));
    Ok(out)
}

/// Whether PTX text defines an entry point `name` (`.entry name(` or `.entry name (`).
pub fn ptx_has_entry(ptx: &str, name: &str) -> bool {
    ptx.lines().any(|l| {
        l.split_whitespace()
            .skip_while(|w| *w != ".entry")
            .nth(1)
            .is_some_and(|w| w == name || w.strip_suffix('(') == Some(name))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_listed_once_and_its_file_exists_and_names_it() {
        let mut names: Vec<_> = Kernel::ALL.iter().map(|k| k.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Kernel::ALL.len());
        for (i, k) in Kernel::ALL.iter().enumerate() {
            assert_eq!(k.index(), i);
            let src = SOURCES
                .iter()
                .find(|s| s.file == k.file())
                .unwrap_or_else(|| panic!("{k:?}: no source {}", k.file()));
            let decl = format!("__global__ void {}(", k.name());
            assert!(
                src.code.contains(&decl) || src.code.contains(&format!("MM_ENTRY({},", k.name())),
                "{} does not define {}",
                src.file,
                k.name()
            );
        }
        // Every source file defines at least one kernel the wrappers use.
        for s in &SOURCES {
            assert!(Kernel::ALL.iter().any(|k| k.file() == s.file), "{}", s.file);
        }
    }

    #[test]
    fn ptx_entry_matching_is_exact() {
        let ptx = ".visible .entry tandem_add(\n\t.param .u64 a\n)\n.entry tandem_x (\n";
        assert!(ptx_has_entry(ptx, "tandem_add"));
        assert!(ptx_has_entry(ptx, "tandem_x"));
        assert!(!ptx_has_entry(ptx, "tandem_ad"));
        assert!(!ptx_has_entry(ptx, "tandem_add_more"));
    }

    #[test]
    fn arch_option_names_the_virtual_architecture() {
        assert_eq!(
            arch_option(9, 0, Target::Ptx),
            "--gpu-architecture=compute_90"
        );
        assert_eq!(arch_option(8, 6, Target::Cubin), "--gpu-architecture=sm_86");
    }
}
