#!/usr/bin/env bash
# Container images of the operator and the CPU dataplane (docker/*.Dockerfile, FROM scratch).
#
#   scripts/images.sh static   build the two static binaries and check them: no shared
#                              library and no loader (readelf), `--version` and `--help`
#                              run in an empty root with nothing but the binary, and a
#                              prefill + decode serve a chat request from an empty root
#   scripts/images.sh build    static, then `docker build` both images
#   scripts/images.sh test     what `make test` runs: where a Docker daemon answers, build
#                              both images and run `--version` and `--help` in each; where
#                              none does, say so in one line and succeed
#
# Image names: IMAGE_REGISTRY (default ghcr.io/tandem) + operator|dataplane, tagged with the
# Cargo workspace version; the chart's values and the examples use the same names (checked
# by scripts/chart.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
IMAGE_REGISTRY="${IMAGE_REGISTRY:-ghcr.io/tandem}"
version="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)"
target=x86_64-unknown-linux-gnu
bin_dir="target/$target/release"
ctx="target/image-context"
bins=(tandem-operator tandem-dataplane)
declare -A image=(
  [tandem-operator]="$IMAGE_REGISTRY/operator:$version"
  [tandem-dataplane]="$IMAGE_REGISTRY/dataplane:$version"
)
declare -A dockerfile=(
  [tandem-operator]=docker/operator.Dockerfile
  [tandem-dataplane]=docker/dataplane.Dockerfile
)
# What `--version` must print.
declare -A version_line=(
  [tandem-operator]="tandem-operator $version"
  [tandem-dataplane]="tandem-dataplane $version"
)

# Static glibc: `--target` keeps RUSTFLAGS off build scripts and proc macros, and its own
# directory (target/x86_64-unknown-linux-gnu) keeps the normal build cache untouched.
build_static() {
  RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
    cargo build --release --locked --target "$target" \
      -p tandem-operator -p tandem-dataplane --bin tandem-operator --bin tandem-dataplane
}

check_output() { # name, what, output
  local name="$1" what="$2" out="$3"
  case "$what" in
    --version) [[ "$out" == *"${version_line[$name]}"* ]] \
      || { echo "$name --version printed '$out', expected '${version_line[$name]}'" >&2; return 1; } ;;
    --help) [[ "$out" == *"Usage: $name"* ]] \
      || { echo "$name --help printed no usage: $out" >&2; return 1; } ;;
  esac
}

check_static() {
  for b in "${bins[@]}"; do
    local path="$bin_dir/$b"
    # A static-pie binary keeps a dynamic section for its own relocations, but names no
    # shared library (NEEDED) and no loader (INTERP).
    if readelf -d "$path" | grep -q NEEDED || readelf -l "$path" | grep -q INTERP; then
      readelf -d "$path" | grep NEEDED >&2 || true
      echo "$path needs shared libraries or a loader" >&2
      return 1
    fi
    # An empty root with only the binary, as in the scratch image.
    local jail
    jail="$(mktemp -d)"
    chmod 755 "$jail"
    cp "$path" "$jail/$b"
    for what in --version --help; do
      local out
      if [[ "$(id -u)" == 0 ]] && command -v chroot >/dev/null; then
        out="$(chroot --userspec=65532:65532 "$jail" "/$b" "$what" 2>&1)" || true
      else
        out="$(env -i "$jail/$b" "$what" 2>&1)" || true
      fi
      check_output "$b" "$what" "$out"
    done
    rm -rf "$jail"
    echo "static: $path ($(du -h "$path" | cut -f1)): no shared library, no loader; --version and --help run alone as 65532"
  done
}

# PD serving from the static binaries in an empty root, as the scratch image runs them:
# only the binary, the model, what the kubelet mounts (/etc/hosts, /etc/resolv.conf) and
# the devices every OCI runtime provides (/dev/null, /dev/random, /dev/urandom), as UID
# 65532. The decode reaches its prefill by a host name, as on a cluster. Needs root
# (chroot, mknod) and the model (make model); says so and skips otherwise.
serve_in_root() {
  local model="${TANDEM_MODEL_DIR:-$root/.cache/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
  if [[ "$(id -u)" != 0 ]] || ! command -v chroot >/dev/null || [[ ! -f "$model" ]]; then
    echo "static: serving check skipped (needs root, chroot and the model)"
    return 0
  fi
  local jail pids=()
  jail="$(mktemp -d)"
  chmod 755 "$jail"
  mkdir -p "$jail/etc" "$jail/dev" "$jail/models"
  cp "$bin_dir/tandem-dataplane" "$jail/"
  cp "$model" "$jail/models/m.gguf"
  chmod 444 "$jail/models/m.gguf"
  cp /etc/resolv.conf "$jail/etc/resolv.conf" 2>/dev/null || true
  printf '127.0.0.1 localhost
127.0.0.1 prefill-0.demo-g0-bootstrap.default.svc
' >"$jail/etc/hosts"
  mknod -m 666 "$jail/dev/null" c 1 3
  mknod -m 666 "$jail/dev/random" c 1 8
  mknod -m 666 "$jail/dev/urandom" c 1 9
  local http kv
  http=$((20000 + RANDOM % 20000)); kv=$((http + 1))
  local run=(chroot --userspec=65532:65532 "$jail" /tandem-dataplane --model /models/m.gguf
             --served-model-name m --group-key static-check --kv-blocks 256)
  "${run[@]}" --role prefill --port $((http + 2)) --kv-port "$kv" >"$jail/prefill.log" 2>&1 &
  pids+=($!)
  "${run[@]}" --role decode --port "$http" \
    --prefill "prefill-0.demo-g0-bootstrap.default.svc:$kv" >"$jail/decode.log" 2>&1 &
  pids+=($!)
  local ok=0 body=""
  for _ in $(seq 1 120); do
    if curl -sf "http://127.0.0.1:$http/ready" >/dev/null 2>&1; then ok=1; break; fi
    sleep 1
  done
  if [[ $ok == 1 ]]; then
    body="$(curl -sf "http://127.0.0.1:$http/v1/chat/completions" -H 'content-type: application/json' \
      -d '{"model":"m","messages":[{"role":"user","content":"Hi"}],"max_tokens":8}')" || ok=0
  fi
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 1 40); do kill -0 "${pids[@]}" 2>/dev/null || break; sleep 1; done
  kill -KILL "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
  if [[ $ok != 1 || "$body" != *'"completion_tokens":'* ]]; then
    tail -20 "$jail/prefill.log" "$jail/decode.log" >&2
    rm -rf "$jail"
    echo "static: PD serving in an empty root failed (response: ${body:-none})" >&2
    return 1
  fi
  rm -rf "$jail"
  echo "static: prefill + decode served a chat request from an empty root as 65532 (peer found by host name)"
}

build_images() {
  for b in "${bins[@]}"; do
    rm -rf "${ctx:?}/$b"
    mkdir -p "$ctx/$b"
    cp "$bin_dir/$b" "$ctx/$b/$b"
    docker build -q -f "${dockerfile[$b]}" -t "${image[$b]}" "$ctx/$b" >/dev/null
    echo "built ${image[$b]}"
  done
}

run_images() {
  for b in "${bins[@]}"; do
    local user
    user="$(docker image inspect -f '{{.Config.User}}' "${image[$b]}")"
    [[ "$user" == "65532:65532" ]] || { echo "${image[$b]} runs as '$user'" >&2; return 1; }
    for what in --version --help; do
      local out
      out="$(docker run --rm --network none "${image[$b]}" "$what" 2>&1)" || true
      check_output "$b" "$what" "$out"
    done
    echo "ran ${image[$b]} --version and --help as 65532"
  done
}

case "${1:-}" in
  static) build_static && check_static && serve_in_root ;;
  build) build_static && check_static && build_images ;;
  test)
    if ! command -v docker >/dev/null || ! docker info >/dev/null 2>&1; then
      echo "image check: no Docker daemon here, images not built (make images builds them where one runs)"
      exit 0
    fi
    build_static && check_static && build_images && run_images
    ;;
  *) echo "usage: $0 static|build|test" >&2; exit 2 ;;
esac
