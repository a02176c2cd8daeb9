#!/usr/bin/env python3
"""Recovery time of the local runtime (`make bench-local`).

Runs `target/release/tandem-operator local` on the example manifest
(manifests/examples/smollm2-local.yaml, unchanged) and measures, per run:
- cold start: runtime started -> first chat answer (one group built from nothing);
- SIGKILL of the decode -> first chat answer again (a MemberFailed co-restart: the old
  prefill is stopped, then the group rebuilt prefill first);
- SIGKILL of the prefill -> first chat answer again (the old decode is stopped first);
and, from the runtime's own record (/status), how much of each recovery was spent waiting
for the surviving member to exit after SIGTERM.

A fresh runtime per run, runs interleaved between the grace periods given (default: 30 s,
the Kubernetes default and the runtime's, and 3 s), so the grace periods are compared
under the same load. Each answer is a real chat completion (8 tokens, greedy) through the
local endpoint. The second kill of a run waits until the co-restart backoff of the first
has expired, so it measures a co-restart, not the backoff.
"""

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "manifests/examples/smollm2-local.yaml")
CHAT = json.dumps({
    "model": "smollm2-135m-instruct",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 8,
    "temperature": 0,
}).encode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat_ok(base):
    req = urllib.request.Request(base + "/v1/chat/completions", data=CHAT,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def status(base):
    with urllib.request.urlopen(base + "/status", timeout=10) as r:
        return json.load(r)


def ts(text):
    """An RFC 3339 UTC time with any number of fractional digits."""
    text = text.rstrip("Z")
    whole, _, frac = text.partition(".")
    t = datetime.datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S")
    t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp() + (float("0." + frac) if frac else 0.0)


def wait_serving(base, proc, since, timeout=300):
    while not chat_ok(base):
        if proc.poll() is not None:
            sys.exit(f"the runtime exited with {proc.returncode}")
        if time.monotonic() - since > timeout:
            sys.exit("not serving in time")
        time.sleep(0.05)
    return time.monotonic() - since


def wait_backoff(base):
    after = status(base)["status"]["groupStatuses"][0].get("nextRestartAfter")
    if after:
        left = ts(after) - time.time()
        if left > 0:
            time.sleep(left + 0.2)


def survivor_exit(base, pod):
    """Seconds between SIGTERM to `pod` and its exit, from the runtime's record."""
    rec = status(base)["record"]
    term = [e for e in rec if e["kind"] == "Terminating" and e["pod"] == pod]
    gone = [e for e in rec if e["kind"] == "Exited" and e["pod"] == pod]
    return ts(gone[0]["time"]) - ts(term[0]["time"])


def run_once(grace):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logs = tempfile.mkdtemp(prefix="tandem-bench-local-")
    out = open(os.path.join(logs, "runtime.log"), "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [os.path.join(ROOT, "target/release/tandem-operator"), "local", "-f", MANIFEST,
         "--port", str(port), "--log-dir", logs, "--grace-period-seconds", str(grace)],
        stdout=out, stderr=out, cwd=ROOT)
    result = {}
    try:
        result["cold"] = wait_serving(base, proc, t0)
        for role, other in (("decode", "prefill"), ("prefill", "decode")):
            members = {m["role"]: m for m in status(base)["members"]}
            t = time.monotonic()
            os.kill(members[role]["pid"], signal.SIGKILL)
            result[role] = wait_serving(base, proc, t)
            result[role + "_survivor"] = survivor_exit(base, members[other]["name"])
            wait_backoff(base)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        out.close()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--grace", type=int, nargs="+", default=[30, 3])
    args = ap.parse_args()
    runs = {g: [] for g in args.grace}
    for rep in range(args.reps):
        for g in args.grace:
            r = run_once(g)
            runs[g].append(r)
            print(f"rep {rep + 1} grace {g:>2}s: cold start {r['cold']:.2f} s | "
                  f"SIGKILL decode -> serving {r['decode']:.2f} s "
                  f"(prefill exited {r['decode_survivor']:.2f} s after SIGTERM) | "
                  f"SIGKILL prefill -> serving {r['prefill']:.2f} s "
                  f"(decode exited {r['prefill_survivor']:.2f} s after SIGTERM)", flush=True)
    print()
    for g, rs in runs.items():
        med = lambda k: statistics.median(r[k] for r in rs)
        print(f"grace {g:>2}s, medians of {len(rs)}: cold start {med('cold'):.2f} s, "
              f"SIGKILL decode -> serving {med('decode'):.2f} s "
              f"(survivor's exit {med('decode_survivor'):.2f} s), "
              f"SIGKILL prefill -> serving {med('prefill'):.2f} s "
              f"(survivor's exit {med('prefill_survivor'):.2f} s)")


if __name__ == "__main__":
    main()
