#!/usr/bin/env bash
# GPU checks of the CUDA backend (issue 5). Run on a machine with an NVIDIA GPU and driver:
#   tests/gpu/run.sh            (or `make gpu-test`)
# Needs: the Rust toolchain, .venv with nvidia-cuda-nvrtc-cu12 (`make pyenv`) or a CUDA
# toolkit's libnvrtc on LD_LIBRARY_PATH, and the model (`make model`). Finishes in a few
# minutes (budget: under 8 on an H200): a release build, every kernel against the scalar
# reference (plus the sampling kernel's exact cases, negative KV slots, graph capture and
# replay), every Backend operation of CudaBackend (what the one generic forward pass
# calls) against CpuBackend on the scalar kernels, the device sampler against the host sampler on fixed logits and uniforms,
# seeded device sampling == host sampling of the same logits, greedy SmolLM2 on GPU == CPU
# for 5 prompts x 32 tokens (via step, step_greedy and step_sample, with and without CUDA
# graphs), graph vs plain decode for batch sizes 1..64, KV export/import across CPU and
# GPU, and throughput (prompt tok/s; decode tok/s at concurrency 1, 32 and 64 with CUDA
# graphs off and on). The tests switch graphs on and off themselves (CudaOptions).
# The GPU tests exist only with feature gpu-tests (CI compiles them); here they run and
# FAIL without a device.
set -euo pipefail
cd "$(dirname "$0")/../.."

nvrtc_lib=$(ls -d "$PWD"/.venv/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib 2>/dev/null | head -1 || true)
if [[ -n "$nvrtc_lib" ]]; then
  export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
elif [[ -d /usr/local/cuda/lib64 ]]; then
  export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  echo "no NVRTC: run 'make pyenv' (nvidia-cuda-nvrtc-cu12) or install the CUDA toolkit" >&2
  exit 1
fi
model=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -f "${TANDEM_MODEL_DIR:-.cache/models}/SmolLM2-135M-Instruct.Q4_1.gguf" ]] || {
  echo "model missing: run 'make model' (expected $model)" >&2
  exit 1
}
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "(nvidia-smi not found)"

start=$SECONDS
echo "== build (release, --features gpu-tests)"
cargo test --release -p tandem-kernels --features gpu-tests --no-run
cargo test --release -p tandem-dataplane --features gpu-tests --lib --no-run

echo "== NVRTC compile checks"
cargo test --release -p tandem-kernels --features gpu-tests --test cuda_nvrtc

echo "== kernels vs scalar reference (GPU)"
cargo test --release -p tandem-kernels --features gpu-tests --test cuda_kernels -- \
  --test-threads=1

echo "== Backend operations: CudaBackend vs CpuBackend (scalar reference)"
cargo test --release -p tandem-kernels --features gpu-tests --test backend_equivalence -- \
  --test-threads=1

echo "== model on GPU: greedy vs CPU, device sampling, graphs vs plain, KV transfer, throughput"
cargo test --release -p tandem-dataplane --features gpu-tests --lib model::cuda -- \
  --test-threads=1 --nocapture

echo "== all GPU checks passed in $((SECONDS - start)) s"
