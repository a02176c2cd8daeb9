#!/usr/bin/env bash
# `make demo`: fetch SmolLM2-135M-Instruct, build the release binaries, run the example
# PDDeployment with the local runtime (one group: a prefill and a decode process), wait
# until the group is Ready, ask it a question through the OpenAI endpoint, print the answer
# and how to use it — then keep it running, showing the runtime's log, until Ctrl-C.
#
# TANDEM_DEMO_PORT (default 8000) sets the endpoint's port.
set -euo pipefail
# Job control: the runtime gets its own process group, so Ctrl-C reaches only this script,
# which then stops the runtime once (SIGTERM), and the runtime stops its members in order.
set -m
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
port="${TANDEM_DEMO_PORT:-8000}"
url="http://127.0.0.1:$port"
state="$root/.cache/demo"
manifest="manifests/examples/smollm2-local.yaml"
model_dir="${TANDEM_MODEL_DIR:-$root/.cache/models}"

command -v curl >/dev/null || { echo "demo: curl is needed" >&2; exit 1; }
scripts/fetch-model.sh
echo "building the release binaries (the first build takes a few minutes)..."
cargo build --release -q -p tandem-operator -p tandem-dataplane \
  --bin tandem-operator --bin tandem-dataplane

mkdir -p "$state"
if [ "$(cd "$model_dir" && pwd)" != "$root/.cache/models" ]; then
  # The example names the repository's model cache; point a copy at TANDEM_MODEL_DIR.
  sed "s|path: .cache/models/|path: $model_dir/|" "$manifest" > "$state/smollm2-local.yaml"
  manifest="$state/smollm2-local.yaml"
fi
log="$state/runtime.log"
: > "$log"
./target/release/tandem-operator local -f "$manifest" --port "$port" \
  --log-dir "$state/logs" >"$log" 2>&1 &
runtime=$!
tail_pid=""

stop() {
  trap - INT TERM
  echo
  echo "stopping the local runtime (SIGTERM: it stops the decode, then the prefill)..."
  kill -TERM "$runtime" 2>/dev/null || true
  wait "$runtime" 2>/dev/null || true
  sleep 0.5  # let the log's last lines through
  [ -n "$tail_pid" ] && kill "$tail_pid" 2>/dev/null || true
  exit 0
}
trap stop INT TERM

echo "starting $manifest: prefill first, then the decode once the prefill is ready..."
deadline=$((SECONDS + 300))
until curl -sf -o /dev/null "$url/ready"; do
  if ! kill -0 "$runtime" 2>/dev/null; then
    echo "demo: the local runtime exited; its log:" >&2
    cat "$log" >&2
    exit 1
  fi
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "demo: no group was ready after 300 s; the runtime's log:" >&2
    tail -n 30 "$log" >&2
    stop
  fi
  sleep 0.5
done

question="What is the capital of France?"
body='{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "'"$question"'"}], "max_tokens": 24, "temperature": 0}'
answer="$(curl -s "$url/v1/chat/completions" -H 'content-type: application/json' -d "$body")"
status="$(curl -s "$url/status")"
read -r prefill_pid decode_pid < <(printf '%s' "$status" | python3 -c '
import json, sys
s = json.load(sys.stdin)
pid = {m["role"]: m["pid"] for m in s["members"]}
print(pid.get("prefill", "?"), pid.get("decode", "?"))')

cat <<EOF

Q: $question
A: $(printf '%s' "$answer" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["message"]["content"].strip())')
   (SmolLM2-135M is tiny; the answer came from the prefill process (pid $prefill_pid) and
   the decode process (pid $decode_pid) of one bootstrap group, joined by the KV protocol.)

The OpenAI endpoint stays up at $url/v1:
  curl $url/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}'
  curl $url/status.txt      # the group: phase, incarnation, co-restarts, members
  curl $url/status          # the same as JSON, with the runtime's record of what it did
  watch -n1 curl -s $url/status.txt

Break it and watch it heal (in another terminal; the log below shows what happens):
  # the decode dies: the group co-restarts, decode gone first, then rebuilt prefill first
  kill -9 $decode_pid
  # the prefill hangs: the decode goes not ready, requests get 503 at once, and 10 s
  # later the group is co-restarted
  kill -STOP $prefill_pid
  # change the decode's args (or any pod-shaping field): the group rolls to the new spec
  \$EDITOR $manifest

Ctrl-C stops everything. The runtime's log ($log):
EOF
tail -n 0 -f "$log" &
tail_pid=$!
wait "$runtime" || true
echo "the local runtime exited; its last lines:"
tail -n 5 "$log"
[ -n "$tail_pid" ] && kill "$tail_pid" 2>/dev/null || true
