//! Run-time switches of the CUDA runner: the dataplane's `--cuda-sampling` and
//! `--cuda-graphs` (`TANDEM_CUDA_SAMPLING`, `TANDEM_CUDA_GRAPHS`), parsed in `config.rs`.

/// Run-time switches of the CUDA runner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// `step_sample` samples on the device and copies only token ids back (default on).
    /// Off: it copies every logits row back and samples on the host, exactly like `step`
    /// + `Sampler::sample`.
    pub device_sampling: bool,
    /// Decode steps replay CUDA graphs (default off: the capture path has not yet run on
    /// a GPU; `tests/gpu/run.sh` checks it).
    pub graphs: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device_sampling: true,
            graphs: false,
        }
    }
}
