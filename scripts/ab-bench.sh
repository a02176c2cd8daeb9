#!/usr/bin/env bash
# Interleaved A/B of `make bench` (bench_engine) and `make bench-pd` (bench_pd) between two
# revisions, on the same machine in the same run: A, B, A, B, ... each run preceded by the
# load average, so that a figure is read beside how busy the machine was.
#
#   scripts/ab-bench.sh [BASE [HEAD]] [--reps N] [--engine-only | --pd-only]
#
# BASE defaults to main, HEAD to the working tree. Each revision is exported with
# `git archive` into target/ab/<name>/src and built in release with its own target dir
# (target/ab/<name>/target); the model comes from .cache/models (scripts/fetch-model.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
base=main head=WORKTREE reps=3 which=both
args=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --reps) reps=$2; shift 2 ;;
    --engine-only) which=engine; shift ;;
    --pd-only) which=pd; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
[[ ${#args[@]} -ge 1 ]] && base=${args[0]}
[[ ${#args[@]} -ge 2 ]] && head=${args[1]}
model=$root/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $model ]] || scripts/fetch-model.sh

build() { # name rev
  local dir=$root/target/ab/$1
  mkdir -p "$dir"
  if [[ $2 == WORKTREE ]]; then
    rm -rf "$dir/src" && mkdir -p "$dir/src"
    git ls-files -co --exclude-standard -z | xargs -0 -I{} cp --parents {} "$dir/src/" 2>/dev/null || true
  else
    rm -rf "$dir/src" && mkdir -p "$dir/src"
    git archive "$2" | tar -x -C "$dir/src"
  fi
  (cd "$dir/src" && CARGO_TARGET_DIR=$dir/target nice -n 5 cargo build -q --release \
    -p tandem-dataplane --bin tandem-dataplane --example bench_engine --example bench_pd)
}

echo "A = $base, B = $head; $reps interleaved rounds"
build A "$base"
build B "$head"
for i in $(seq 1 "$reps"); do
  for side in A B; do
    t=$root/target/ab/$side/target/release
    if [[ $which != pd ]]; then
      echo "== round $i $side engine | load $(cut -d' ' -f1-3 /proc/loadavg)"
      "$t/examples/bench_engine" --reps 1 "$model" | grep -E 'tok/s|C=|prompt|RSS' || true
    fi
    if [[ $which != engine ]]; then
      echo "== round $i $side pd | load $(cut -d' ' -f1-3 /proc/loadavg)"
      "$t/examples/bench_pd" --bin "$t/tandem-dataplane" --model "$model" || true
    fi
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
