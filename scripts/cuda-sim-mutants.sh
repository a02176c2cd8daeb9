#!/usr/bin/env bash
# Mutation check of the CUDA executor's tests (kernels/cuda-sim): each mutant below breaks
# one kernel the way real kernel bugs look — a removed __syncthreads, an off-by-one bound,
# a reduction over 16 lanes instead of 32 — and must make kernels/tests/cuda_kernels.rs
# fail as `make cuda-sim` runs it (detectors on). The mutant is applied with sed to the
# .cu file in this checkout and undone afterwards (also on error or Ctrl-C); the kernel
# library is rebuilt per mutant. Not part of `make test`: about a minute on a built target
# directory. Prints, per mutant, the first failure it caused.
set -euo pipefail
cd "$(dirname "$0")/.."
nvrtc=$(ls -d "$PWD"/.venv/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib 2>/dev/null | head -1)
[ -n "$nvrtc" ] || { echo "cuda-sim-mutants: no NVRTC in .venv: run make pyenv" >&2; exit 1; }
export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" TANDEM_CUDA_SIM=1 TANDEM_CUDA_SIM_CHECKS=1

backup=$(mktemp -d)
restore() { for f in "$backup"/*; do [ -e "$f" ] && cp "$f" "kernels/src/cuda/$(basename "$f")"; done; rm -rf "$backup"; }
trap restore EXIT INT TERM

failed=0
# mutant NAME FILE SED-EXPRESSION TEST-FILTER
mutant() {
    local name=$1 file=kernels/src/cuda/$2 expr=$3 filter=$4 out
    cp "$file" "$backup/$2"
    sed -i "$expr" "$file"
    if cmp -s "$file" "$backup/$2"; then
        echo "cuda-sim-mutants: $name: the sed expression no longer matches $file" >&2
        failed=1
        return
    fi
    out=$(cargo test -q -p tandem-kernels --features cuda-sim,gpu-tests --test cuda_kernels "$filter" 2>&1 || true)
    cp "$backup/$2" "$file"
    if grep -q "test result: FAILED" <<<"$out"; then
        echo "cuda-sim-mutants: $name: caught: $(grep -m1 -E 'CUDA executor:|panicked at' -A1 <<<"$out" | tr '\n' ' ' | cut -c1-300)"
    else
        echo "cuda-sim-mutants: $name: NOT caught (the tests passed or did not run):" >&2
        tail -5 <<<"$out" >&2
        failed=1
    fi
}

mutant "mmq without the barrier after staging its tiles" matmul.cu \
    '/^        }$/{n;s/^        __syncthreads();$/        \/\/ mutant: no barrier/}' matmul
mutant "mmvq bound off by one (row > rows)" matmul.cu \
    '0,/if (row >= rows || t0 >= n_tok) return;/s//if (row > rows || t0 >= n_tok) return;/' matmul
mutant "warp_sum over 16 lanes" common.cuh \
    '/float warp_sum(float v)/,/return v;/s/for (int o = 16; o > 0; o >>= 1) v +=/for (int o = 8; o > 0; o >>= 1) v +=/' rope_and_swiglu
exit $failed
