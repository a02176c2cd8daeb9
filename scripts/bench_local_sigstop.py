#!/usr/bin/env python3
# Usage: .venv/bin/python scripts/bench_local_sigstop.py "$PWD" <unresponsiveGraceSeconds>
# (after cargo build -p tandem-operator -p tandem-dataplane; needs `make model` and pyyaml).
"""SIGSTOP of the prefill under the local runtime with the example's health settings:
time until the group serves again, and the stopped prefill's SIGTERM -> SIGKILL delay,
for a given health.unresponsiveGraceSeconds (the runtime's own grace stays 30 s)."""
import json, os, signal, socket, subprocess, sys, time, urllib.request, tempfile
import yaml  # noqa

repo, grace = sys.argv[1], int(sys.argv[2])
m = yaml.safe_load(open(f"{repo}/manifests/examples/smollm2-local.yaml"))
m["metadata"]["name"] = f"stop{grace}"
m["spec"]["model"]["path"] = f"{repo}/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
m["spec"]["health"]["unresponsiveGraceSeconds"] = grace
d = tempfile.mkdtemp(prefix="i22g-")
open(f"{d}/m.yaml", "w").write(yaml.safe_dump(m))
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
log = open(f"{d}/runtime.log", "w")
rt = subprocess.Popen([f"{repo}/target/debug/tandem-operator", "local", "-f", f"{d}/m.yaml",
                       "--port", str(port), "--log-dir", f"{d}/logs",
                       "--dataplane", f"{repo}/target/debug/tandem-dataplane", "--log-format", "json"],
                      stdout=log, stderr=log, stdin=subprocess.DEVNULL)
base = f"http://127.0.0.1:{port}"
def get(path):
    try:
        with urllib.request.urlopen(base + path, timeout=3) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except Exception:
        return None, b""
def status():
    return json.loads(get("/status")[1])
try:
    t0 = time.time()
    while get("/ready")[0] != 200:
        assert time.time() - t0 < 180, "never ready"
        time.sleep(0.2)
    time.sleep(1)
    p = next(x for x in status()["members"] if x["role"] == "prefill")
    os.kill(p["pid"], signal.SIGSTOP)
    stopped = time.time()
    while True:
        st = status()
        if st["status"]["groupStatuses"][0]["incarnation"] == 2 and get("/ready")[0] == 200:
            break
        assert time.time() - stopped < 180, "never served again"
        time.sleep(0.1)
    served = time.time() - stopped
    rec = status()["record"]
    from datetime import datetime
    def at(kind):
        e = next(e for e in rec if e["kind"] == kind and e["pod"] == p["name"])
        return datetime.fromisoformat(e["time"].replace("Z", "+00:00")).timestamp()
    co = next(e for e in rec if e["kind"] == "Event" and e["reason"] == "MemberNotReady")
    co_at = datetime.fromisoformat(co["time"].replace("Z", "+00:00")).timestamp() - stopped
    print(f"unresponsiveGraceSeconds {grace}: co-restart {co_at:.1f} s after SIGSTOP, "
          f"stopped prefill SIGKILLed {at('Killed') - at('Terminating'):.1f} s after its SIGTERM, "
          f"group serving again {served:.1f} s after SIGSTOP")
finally:
    rt.send_signal(signal.SIGTERM)
    try:
        rt.wait(40)
    except subprocess.TimeoutExpired:
        rt.kill(); rt.wait()
