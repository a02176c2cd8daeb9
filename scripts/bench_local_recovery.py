#!/usr/bin/env python3
"""Recovery time of the local runtime (`make bench-local`).

Starts `target/release/tandem-operator local` on the example manifest
(manifests/examples/smollm2-local.yaml; only its co-restart backoff shortened to 1 s
doubling up to 4 s, so that repeated kills do not wait minutes), and measures in one run:
- cold start: runtime started -> first chat answer (one group built from nothing);
- SIGKILL of the decode -> first chat answer again (a MemberFailed co-restart);
- SIGKILL of the prefill -> first chat answer again;
alternating the two kills `--reps` times, so both are measured under the same load, each
once the group's co-restart backoff from the previous kill has expired.
Each answer is a real chat completion (8 tokens, greedy) through the local endpoint.
Prints every figure and the medians; stops the runtime with SIGTERM at the end.
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


def wait_serving(base, proc, since, timeout=300):
    while not chat_ok(base):
        if proc.poll() is not None:
            sys.exit(f"the runtime exited with {proc.returncode}")
        if time.monotonic() - since > timeout:
            sys.exit("not serving in time")
        time.sleep(0.05)
    return time.monotonic() - since


def wait_backoff(base):
    """Wait until the group's co-restart backoff has expired, so the next kill measures a
    co-restart, not the backoff (the example's base is 5 s, doubling per failure)."""
    after = status(base)["status"]["groupStatuses"][0].get("nextRestartAfter")
    if after:
        until = datetime.datetime.fromisoformat(after.replace("Z", "+00:00"))
        left = (until - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
        if left > 0:
            time.sleep(left + 0.2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    binary = os.path.join(ROOT, "target/release/tandem-operator")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logs = tempfile.mkdtemp(prefix="tandem-bench-local-")
    with open(os.path.join(ROOT, "manifests/examples/smollm2-local.yaml")) as f:
        text = f.read()
    fast = text.replace("backoff: {baseSeconds: 5, maxSeconds: 60}",
                        "backoff: {baseSeconds: 1, maxSeconds: 4}")
    assert fast != text, "the example's backoff line changed: update this script"
    manifest = os.path.join(logs, "smollm2-local.yaml")
    with open(manifest, "w") as f:
        f.write(fast)
    with open(os.path.join(logs, "runtime.log"), "w") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen([binary, "local", "-f", manifest, "--port", str(port),
                                 "--log-dir", logs], stdout=out, stderr=out, cwd=ROOT)
        try:
            cold = wait_serving(base, proc, t0)
            print(f"cold start (nothing -> first answer): {cold:.2f} s", flush=True)
            figures = {"decode": [], "prefill": []}
            for i in range(args.reps):
                for role in ("decode", "prefill"):
                    pid = [m["pid"] for m in status(base)["members"] if m["role"] == role][0]
                    t = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                    took = wait_serving(base, proc, t)
                    figures[role].append(took)
                    g = status(base)["status"]["groupStatuses"][0]
                    print(f"rep {i + 1}: SIGKILL {role:7} -> serving again {took:.2f} s "
                          f"(incarnation {g['incarnation']}, {g['lastCoRestart']['reason']})",
                          flush=True)
                    wait_backoff(base)
            for role, xs in figures.items():
                print(f"SIGKILL {role}: median {statistics.median(xs):.2f} s, "
                      f"min {min(xs):.2f}, max {max(xs):.2f} over {len(xs)}")
            print(f"cold start: {cold:.2f} s")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    print(f"runtime exit status {proc.returncode}; logs in {logs}")


if __name__ == "__main__":
    main()
