#!/usr/bin/env bash
# Container images of the operator and the CPU dataplane (docker/*.Dockerfile, FROM scratch)
# and the static pause image of the end-to-end node (docker/pause.Dockerfile).
#
#   scripts/images.sh static   build the two static binaries and check them: no shared
#                              library and no loader (readelf), `--version` and `--help`
#                              run in an empty root with nothing but the binary, and a
#                              prefill + decode serve a chat request from an empty root
#   scripts/images.sh oci      build the three images without a daemon: umoci applies each
#                              Dockerfile (FROM scratch, COPY, USER, EXPOSE, ENTRYPOINT,
#                              ENV, LABEL — anything else is refused) to an empty OCI
#                              layout; the archives go to target/images/, listed in
#                              target/images/images.txt (what `make e2e` imports into the
#                              nodes' containerd)
#   scripts/images.sh build    `make images`: oci; where a Docker daemon answers, also
#                              `docker build` of the same Dockerfiles
#   scripts/images.sh test     what `make test` runs: oci, then each archive's config
#                              checked against its Dockerfile (user, entrypoint, ports) and
#                              `--version`/`--help` run from its unpacked root filesystem as
#                              the image's user; where a Docker daemon answers, the docker
#                              images too
#
# Image names: IMAGE_REGISTRY (default ghcr.io/tandem) + operator|dataplane, tagged with the
# Cargo workspace version; the chart's values and the examples use the same names (checked
# by scripts/chart.sh). The pause image is IMAGE_REGISTRY/pause:e2e.
#
# IMAGE_PROFILE picks the cargo profile of the static binaries: `release` (default: what
# you ship) or `dev` (what `make test` builds for the e2e suite: no second optimised build
# of the whole dependency tree on CI; the suite ran debug binaries before it ran images).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
IMAGE_REGISTRY="${IMAGE_REGISTRY:-ghcr.io/tandem}"
IMAGE_PROFILE="${IMAGE_PROFILE:-release}"
version="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)"
target=x86_64-unknown-linux-gnu
case "$IMAGE_PROFILE" in
  dev) profile_dir=debug ;;
  *) profile_dir=$IMAGE_PROFILE ;;
esac
bin_dir="target/$target/$profile_dir"
ctx="target/image-context"
out="target/images"
bins=(tandem-operator tandem-dataplane)
declare -A image=(
  [tandem-operator]="$IMAGE_REGISTRY/operator:$version"
  [tandem-dataplane]="$IMAGE_REGISTRY/dataplane:$version"
  [pause]="$IMAGE_REGISTRY/pause:e2e"
)
declare -A dockerfile=(
  [tandem-operator]=docker/operator.Dockerfile
  [tandem-dataplane]=docker/dataplane.Dockerfile
  [pause]=docker/pause.Dockerfile
)
declare -A archive=(
  [tandem-operator]=operator.tar
  [tandem-dataplane]=dataplane.tar
  [pause]=pause.tar
)
# What `--version` must print.
declare -A version_line=(
  [tandem-operator]="tandem-operator $version"
  [tandem-dataplane]="tandem-dataplane $version"
  [pause]="tandem-pause 1"
)

log() { echo "images: $*" >&2; }

# Static glibc: `--target` keeps RUSTFLAGS off build scripts and proc macros, and its own
# directory (target/x86_64-unknown-linux-gnu) keeps the normal build cache untouched.
build_static() {
  local start=$SECONDS
  RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static" \
    cargo build --profile "$IMAGE_PROFILE" --locked --target "$target" \
      -p tandem-operator -p tandem-dataplane --bin tandem-operator --bin tandem-dataplane
  log "static binaries ($IMAGE_PROFILE profile) built in $((SECONDS - start)) s"
}

# The pod sandbox program: plain C, linked statically.
build_pause() {
  mkdir -p "$ctx/pause"
  cc -static -Os -Wall -Wextra -Werror -o "$ctx/pause/pause" docker/pause.c
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

no_shared_libraries() { # path
  # A static-pie binary keeps a dynamic section for its own relocations, but names no
  # shared library (NEEDED) and no loader (INTERP).
  if readelf -d "$1" 2>/dev/null | grep -q NEEDED || readelf -l "$1" | grep -q INTERP; then
    readelf -d "$1" | grep NEEDED >&2 || true
    echo "$1 needs shared libraries or a loader" >&2
    return 1
  fi
}

check_static() {
  for b in "${bins[@]}"; do
    local path="$bin_dir/$b"
    no_shared_libraries "$path"
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

# Prepare each image's context: a directory with only its binary.
prepare_contexts() {
  for b in "${bins[@]}"; do
    rm -rf "${ctx:?}/$b"
    mkdir -p "$ctx/$b"
    cp "$bin_dir/$b" "$ctx/$b/$b"
  done
  build_pause
}

# Apply a Dockerfile to an empty OCI layout with umoci: FROM scratch, COPY, USER, EXPOSE,
# ENTRYPOINT (JSON form), ENV, LABEL; anything else is refused by name.
build_oci() { # name
  local name=$1 df=${dockerfile[$1]} ref=${image[$1]}
  local repo=${ref%:*} tag=${ref##*:}
  local layout="$ctx/oci-$name" cfg=() n=0 from=""
  rm -rf "$layout"
  umoci init --layout "$layout"
  umoci new --image "$layout:$tag"
  while IFS= read -r line || [[ -n "$line" ]]; do
    n=$((n + 1))
    [[ "$line" =~ ^[[:space:]]*(#|$) ]] && continue
    [[ "$line" == *\\ ]] && { echo "$df:$n: continuation lines are not supported" >&2; return 1; }
    local instr=${line%%[[:space:]]*} args=${line#*[[:space:]]}
    case "${instr^^}" in
      FROM)
        [[ "$args" == scratch ]] || { echo "$df:$n: only FROM scratch is built without a daemon (got '$args')" >&2; return 1; }
        from=scratch ;;
      COPY)
        local src dst
        read -r src dst <<<"$args"
        [[ -n "$dst" && -e "$ctx/$name/$src" ]] || { echo "$df:$n: COPY $args: no $ctx/$name/$src" >&2; return 1; }
        umoci insert --image "$layout:$tag" "$ctx/$name/$src" "$dst" >/dev/null ;;
      USER) cfg+=(--config.user "$args") ;;
      EXPOSE)
        local p
        for p in $args; do [[ "$p" == */* ]] || p="$p/tcp"; cfg+=(--config.exposedports "$p"); done ;;
      ENTRYPOINT)
        local part
        while IFS= read -r part; do cfg+=(--config.entrypoint "$part"); done < <(
          python3 -c 'import json,sys; [print(a) for a in json.loads(sys.argv[1])]' "$args") \
          || { echo "$df:$n: ENTRYPOINT must be a JSON array" >&2; return 1; } ;;
      ENV) cfg+=(--config.env "${args/ /=}") ;;
      LABEL) cfg+=(--config.label "$args") ;;
      *) echo "$df:$n: $instr is not supported by the daemon-less build" >&2; return 1 ;;
    esac
  done <"$df"
  [[ "$from" == scratch ]] || { echo "$df: no FROM scratch" >&2; return 1; }
  umoci config --image "$layout:$tag" --os linux --architecture amd64 \
    --author "scripts/images.sh" --history.created_by "scripts/images.sh oci $df" "${cfg[@]}"
  umoci gc --layout "$layout"
  mkdir -p "$out"
  tar -C "$layout" -cf "$out/${archive[$name]}.tmp" . && mv "$out/${archive[$name]}.tmp" "$out/${archive[$name]}"
  echo "$repo $tag ${archive[$name]}" >>"$out/images.txt.tmp"
  log "built $ref → $out/${archive[$name]} ($(du -h "$out/${archive[$name]}" | cut -f1))"
}

build_all_oci() {
  command -v umoci >/dev/null || { echo "umoci is not installed (apt-get install umoci; .ci/run does it)" >&2; return 1; }
  prepare_contexts
  mkdir -p "$out"
  echo "# Built by scripts/images.sh oci ($IMAGE_PROFILE binaries): REPOSITORY TAG ARCHIVE" >"$out/images.txt.tmp"
  for name in "${bins[@]}" pause; do build_oci "$name"; done
  mv "$out/images.txt.tmp" "$out/images.txt"
}

# Each archive: its config as its Dockerfile says, and its program runs from its own root
# filesystem as its user.
test_oci() {
  for name in "${bins[@]}" pause; do
    local ref=${image[$name]} tmp
    local tag=${ref##*:}
    tmp="$(mktemp -d)"
    mkdir "$tmp/layout"
    tar -C "$tmp/layout" -xf "$out/${archive[$name]}"
    python3 - "$tmp/layout" "$tag" "${dockerfile[$name]}" <<'PY'
import json, os, sys
layout, tag, df = sys.argv[1:]
blob = lambda d: json.load(open(os.path.join(layout, "blobs", *d.split(":"))))
index = json.load(open(os.path.join(layout, "index.json")))
m = next(m for m in index["manifests"] if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
cfg = blob(blob(m["digest"])["config"]["digest"])
want = {}
for line in open(df):
    w = line.split(None, 1)
    if len(w) == 2 and w[0] in ("USER", "ENTRYPOINT", "EXPOSE"):
        want[w[0]] = w[1].strip()
c = cfg["config"]
assert cfg["os"] == "linux" and cfg["architecture"] == "amd64", cfg
assert c.get("User") == want["USER"], (c.get("User"), want)
assert c.get("Entrypoint") == json.loads(want["ENTRYPOINT"]), (c.get("Entrypoint"), want)
ports = sorted(p if "/" in p else p + "/tcp" for p in want.get("EXPOSE", "").split())
assert sorted(c.get("ExposedPorts", {})) == ports, (c.get("ExposedPorts"), ports)
print(f"images: {tag}: user {c['User']}, entrypoint {c['Entrypoint']}, ports {ports or 'none'} as {df} says")
PY
    umoci unpack --image "$tmp/layout:$tag" "$tmp/bundle" >/dev/null
    local user entry
    user="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["process"]["user"]["uid"])' "$tmp/bundle/config.json")"
    entry="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["process"]["args"][0])' "$tmp/bundle/config.json")"
    no_shared_libraries "$tmp/bundle/rootfs$entry"
    if [[ "$(id -u)" == 0 ]] && command -v chroot >/dev/null; then
      local what
      for what in --version $([[ $name == pause ]] || echo --help); do
        local o
        o="$(chroot --userspec="$user:$user" "$tmp/bundle/rootfs" "$entry" "$what" 2>&1)" || true
        check_output "$name" "$what" "$o"
      done
      echo "images: ran $ref $entry from its own root filesystem as $user"
    else
      echo "images: $ref not run from its root filesystem (needs root for chroot)"
    fi
    rm -rf "$tmp"
  done
}

have_docker() { command -v docker >/dev/null && docker info >/dev/null 2>&1; }

docker_images() {
  for b in "${bins[@]}"; do
    docker build -q -f "${dockerfile[$b]}" -t "${image[$b]}" "$ctx/$b" >/dev/null
    echo "built ${image[$b]} with docker"
  done
}

run_docker_images() {
  for b in "${bins[@]}"; do
    local user
    user="$(docker image inspect -f '{{.Config.User}}' "${image[$b]}")"
    [[ "$user" == "65532:65532" ]] || { echo "${image[$b]} runs as '$user'" >&2; return 1; }
    for what in --version --help; do
      local o
      o="$(docker run --rm --network none "${image[$b]}" "$what" 2>&1)" || true
      check_output "$b" "$what" "$o"
    done
    echo "ran ${image[$b]} --version and --help as 65532 with docker"
  done
}

case "${1:-}" in
  static) build_static && check_static && serve_in_root ;;
  oci) build_static && check_static && build_all_oci ;;
  build)
    build_static && check_static && build_all_oci
    if have_docker; then docker_images; else echo "images: no Docker daemon here; the OCI archives in $out are the images (ctr/podman/skopeo import them)"; fi
    ;;
  test)
    build_static && check_static && build_all_oci && test_oci
    if have_docker; then docker_images && run_docker_images; else echo "images: no Docker daemon here; built and checked without one"; fi
    ;;
  *) echo "usage: $0 static|oci|build|test" >&2; exit 2 ;;
esac
