//! CI without a GPU: every `.cu` file must compile with NVRTC for the architectures we
//! deploy on (sm_80 A100, sm_90 H100/H200), and every kernel the launch wrappers name
//! must be an entry point of its file's PTX and a symbol of its CUBIN.
//!
//! NVRTC comes from the `nvidia-cuda-nvrtc-cu12` wheel in `.venv` (`make pyenv`); the
//! Makefile puts its directory on `LD_LIBRARY_PATH`.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use tandem_kernels::cuda::sources::{
    Kernel, SOURCES, Target, compile, images_for_arch, nvrtc_available, ptx_has_entry,
};

const ARCHS: [(u32, u32); 2] = [(8, 0), (9, 0)];

fn require_nvrtc() {
    if let Err(e) = nvrtc_available() {
        panic!(
            "{e}\nRun `make pyenv` (installs nvidia-cuda-nvrtc-cu12 into .venv) and run the \
             tests through `make cuda-check`, which sets LD_LIBRARY_PATH."
        );
    }
}

#[test]
fn every_source_compiles_to_ptx_with_every_kernel_entry() {
    require_nvrtc();
    for (major, minor) in ARCHS {
        for src in &SOURCES {
            let ptx = compile(src, major, minor, Target::Ptx).unwrap_or_else(|e| panic!("{e}"));
            let ptx = String::from_utf8(ptx).expect("PTX is text");
            assert!(
                ptx.contains(&format!(".target sm_{major}{minor}")),
                "{}: PTX for the wrong target",
                src.file
            );
            for k in Kernel::ALL.iter().filter(|k| k.file() == src.file) {
                assert!(
                    ptx_has_entry(&ptx, k.name()),
                    "{}: no `.entry {}` in the PTX for sm_{major}{minor}",
                    src.file,
                    k.name()
                );
            }
        }
    }
}

#[test]
fn every_source_compiles_to_cubin_with_every_kernel_symbol() {
    require_nvrtc();
    for (major, minor) in ARCHS {
        let images = images_for_arch(major, minor, Target::Cubin).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(images.len(), SOURCES.len());
        for (file, image) in images.iter() {
            assert_eq!(&image[..4], b"\x7fELF", "{file}: not an ELF cubin");
            for k in Kernel::ALL.iter().filter(|k| k.file() == *file) {
                let name = k.name().as_bytes();
                assert!(
                    image.windows(name.len()).any(|w| w == name),
                    "{file}: no symbol {} in the sm_{major}{minor} cubin",
                    k.name()
                );
            }
        }
        // Compiled once per process: a second request returns the cached images.
        let again = images_for_arch(major, minor, Target::Cubin).unwrap();
        assert!(Arc::ptr_eq(&images, &again));
    }
}

#[test]
fn compile_errors_carry_the_nvrtc_log() {
    require_nvrtc();
    let bad = tandem_kernels::cuda::Source {
        file: "broken.cu",
        code: "extern \"C\" __global__ void k() { undefined_thing(); }",
    };
    let err = compile(&bad, 9, 0, Target::Ptx).unwrap_err().to_string();
    assert!(
        err.contains("broken.cu") && err.contains("undefined_thing"),
        "{err}"
    );
}
