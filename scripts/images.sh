#!/usr/bin/env bash
# Container images of the operator and the CPU dataplane (docker/*.Dockerfile, FROM scratch).
#
#   scripts/images.sh static   build the two static binaries and check them: no dynamic
#                              section (`ldd`: not a dynamic executable), `--version` and
#                              `--help` run in an empty root with nothing but the binary
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
    if ldd "$path" >/dev/null 2>&1; then
      ldd "$path" >&2
      echo "$path is dynamically linked" >&2
      return 1
    fi
    # An empty root with only the binary, as in the scratch image.
    local jail
    jail="$(mktemp -d)"
    cp "$path" "$jail/$b"
    for what in --version --help; do
      local out
      if [[ "$(id -u)" == 0 ]] && command -v chroot >/dev/null; then
        out="$(chroot --userspec=65532:65532 "$jail" "/$b" "$what" 2>&1)"
      else
        out="$(env -i "$jail/$b" "$what" 2>&1)"
      fi
      check_output "$b" "$what" "$out"
    done
    rm -rf "$jail"
    echo "static: $path ($(du -h "$path" | cut -f1)), no dynamic section, --version/--help run alone"
  done
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
      check_output "$b" "$what" "$(docker run --rm --network none "${image[$b]}" "$what" 2>&1)"
    done
    echo "ran ${image[$b]} --version and --help as 65532"
  done
}

case "${1:-}" in
  static) build_static && check_static ;;
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
