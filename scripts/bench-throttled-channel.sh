#!/bin/bash
# Does a prefill under a CPU limit answer the decode's PINGs within the default 1 s channel
# deadline while it computes a prompt? A real CFS quota (cgroup v1 cpu controller, root
# needed) on a prefill process, a decode outside it, three completions of a ~60-token
# prompt; prints each answer, the decode's PONG round-trip histogram and
# tandem_kv_peer_unresponsive_total. QUOTA is µs of CPU per 100 ms: 1000 = 10m (e2e s15's
# limit), 2500 = 25m, 10000 = 100m. Needs `cargo build -p tandem-dataplane --bin
# tandem-dataplane` (debug: the e2e image's profile) and `make model`. Not part of make test.
#
# Measured (2-core EPYC dev machine, 2026-12-02): 10m: PONGs up to 0.8 s, the prefill
# computing the prompt missed the deadline (room failed peer_unresponsive); 25m: slowest
# PONG 0.41 s, 100m: 0.2 s, no miss.
set -u
root="$(cd "$(dirname "$0")/.." && pwd)"
BIN=${BIN:-$root/target/debug/tandem-dataplane}
MODEL=${MODEL:-$root/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
QUOTA=${QUOTA:-1000}   # µs per 100 ms period: 1000 = 10m
CG=/sys/fs/cgroup/cpu/tandem-throttled-channel-$$
OUT=${OUT:-$root/target/throttled-channel}; rm -rf "$OUT"; mkdir -p "$OUT"
export TANDEM_GROUP_KEY=test-group-key TANDEM_GROUP_INCARNATION=7 TANDEM_PROBE_PERIOD_SECONDS=2 \
  TANDEM_FAILURE_THRESHOLD=3 TANDEM_BOOTSTRAP_TIMEOUT_SECONDS=10 TANDEM_KV_TIMEOUT_SECONDS=120
$BIN --role prefill --model $MODEL --port 18601 --kv-port 18602 --host 127.0.0.1 >$OUT/prefill.log 2>&1 &
P=$!
for i in $(seq 100); do curl -sf 127.0.0.1:18601/ready >/dev/null && break; sleep 0.2; done
mkdir -p $CG && echo 100000 > $CG/cpu.cfs_period_us && echo $QUOTA > $CG/cpu.cfs_quota_us
echo $P > $CG/cgroup.procs
$BIN --role decode --model $MODEL --port 18603 --prefill 127.0.0.1:18602 --host 127.0.0.1 >$OUT/decode.log 2>&1 &
D=$!
for i in $(seq 300); do curl -sf 127.0.0.1:18603/ready >/dev/null && break; sleep 0.2; done
echo "decode ready: $(curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:18603/ready)"
PROMPT=$(python3 -c 'print("Tell me about the history of the city of Paris, its bridges, its river and its people. " * 3)')
t0=$(date +%s.%N)
for i in 1 2 3; do
  s=$(date +%s.%N)
  code=$(curl -s -o $OUT/r$i.json -w '%{http_code}' -m 180 127.0.0.1:18603/v1/completions \
    -H 'content-type: application/json' \
    -d "{\"model\":\"SmolLM2-135M-Instruct.Q4_1\",\"prompt\":\"$PROMPT\",\"max_tokens\":4}")
  e=$(date +%s.%N)
  echo "request $i: HTTP $code in $(python3 -c "print(round($e-$s,1))") s: $(head -c 200 $OUT/r$i.json)"
done
curl -s 127.0.0.1:18603/metrics | grep -E 'tandem_kv_peer_unresponsive_total|tandem_kv_ping_rtt_seconds_(bucket|count|sum)|rooms_total\{state="(done|failed)",reason="(none|peer_unresponsive|kv_timeout)"' > $OUT/metrics.txt
cat $OUT/metrics.txt
grep -c "prefill unresponsive" $OUT/decode.log
cat $CG/cpu.stat
kill $D $P; wait $D $P 2>/dev/null
rmdir $CG
