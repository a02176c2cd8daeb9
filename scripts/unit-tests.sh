#!/usr/bin/env bash
# `make unit`: every test `cargo test --workspace` runs, in two lanes side by side.
#
# Lane "models" is the real-model suites, which compute (the reference forward passes of
# every architecture, llama.cpp's logits, Qwen2.5 and Gemma 3 served): they keep the two
# cores busy. Lane "rest" is everything else — every other test target of every package
# (listed from `cargo metadata`, so a new test file joins it by itself), the libraries'
# and binaries' unit tests and the doc-tests — most of which wait on real processes,
# sockets and timers. Run one after the other the two took ~9 minutes of a quiet 2-core
# CI machine; side by side the waiting overlaps the computing.
#
# Everything is built first (`--no-run`), so the lanes only run tests (cargo takes no
# build lock then). The models lane's output goes to target/unit-models.log and is
# printed when both lanes are done; either lane failing fails the step, and a failed
# lane's log is printed in full.
set -euo pipefail
cd "$(dirname "$0")/.."

# Test targets of the models lane, as package:target.
MODELS_LANE=(tandem-dataplane:model_reference tandem-dataplane:llamacpp_models tandem-dataplane:models_serving)

cargo test --workspace --no-run

# Every other test target `cargo test --workspace` would run (test = true, no required
# features), by name. Both lanes select with `--workspace`, so features unify as in
# `cargo test --workspace` and nothing is built again (`-p` alone would build some crates
# with other features).
rest_args=$(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
models = set(sys.argv[1:])
for p in json.load(sys.stdin)["packages"]:
    for t in p["targets"]:
        if t["kind"] == ["test"] and t.get("test", True) and not t.get("required-features") \
                and p["name"] + ":" + t["name"] not in models:
            print("--test", t["name"])
' "${MODELS_LANE[@]}")

models_args=()
for pt in "${MODELS_LANE[@]}"; do models_args+=(--test "${pt#*:}"); done

start=$(date +%s)
log=target/unit-models.log
rm -f "$log.rc"
( cargo test --workspace "${models_args[@]}" >"$log" 2>&1; echo "$? $(( $(date +%s) - start ))" >"$log.rc" ) &
models_pid=$!

rest_rc=0
# shellcheck disable=SC2086 # one "--test NAME" pair per line
cargo test --workspace --lib --bins $rest_args || rest_rc=1
cargo test --workspace --doc || rest_rc=1
rest_took=$(( $(date +%s) - start ))

wait "$models_pid" || true
read -r models_rc models_took <"$log.rc" || { models_rc=1; models_took="?"; }
echo "unit: the models lane ($(IFS=' '; echo "${MODELS_LANE[*]}")), run beside the rest:"
cat "$log"
echo "unit: rest lane $rest_took s, models lane $models_took s (both from the end of the build)"
if [[ $rest_rc -ne 0 || $models_rc -ne 0 ]]; then
  echo "unit: FAILED (rest lane exit $rest_rc, models lane exit $models_rc)" >&2
  exit 1
fi
