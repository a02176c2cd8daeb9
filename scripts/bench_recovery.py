#!/usr/bin/env python3
"""The recovery table (`make bench-recovery`; BENCHMARKS.md "Recovery").

For every fault, on a fresh local runtime (`target/release/tandem-operator local`) running
the example manifest (manifests/examples/smollm2-local.yaml: its health settings, its
backoff) with one group or two, while a client sends a chat request every 0.1 s through
the runtime's endpoint (8 tokens, greedy, a 15 s client timeout each), it measures
- refused after: from the fault to the first answer that refuses a request with a reason;
- longest wait: the longest any request sent after the fault waited for an answer (a
  request the client gave up on counts 15 s);
- served again: from the fault to the first answer of the requests that follow the last
  failed one (after it, every request is served);
- failed: requests answered with an error, or not at all;
- weights reloaded: whether the group's processes were replaced (a reset in place keeps
  them, and their weights);
and, from the runtime's record, when the co-restart was decided and how long an in-place
reset took. Faults (group 0):
  decode_sigkill, prefill_sigkill, prefill_sigstop, decode_sigstop: the signals;
  kv_loop_stall: the decode's KV loop stalls 30 s (fault injection: a wedged channel
    thread in a live process);
  incarnation_fault: the prefill alone resets to the next group incarnation (a signed
    admin reset, key read from the member's environment), as a prefill that came back
    with another incarnation under a decode that kept the old one;
  no_progress: the decode's engine holds its work 60 s without stepping (fault injection);
  channel_partition: the prefill's KV port is dropped by iptables (only where iptables
    works; otherwise one line says it was skipped);
  decode_sigkill_again, prefill_sigkill_again: that crash AGAIN_AFTER seconds after the
    group served again following an earlier decode SIGKILL (inside the backoff of the first
    co-restart: the backoff must not turn the second crash into a long outage); the
    columns count from the second crash.
It prints the table with the issue's targets, and draws one fault's timeline (requests
answered, refused and waiting over time, with the group's phases) as an SVG.
"""

import argparse
import hashlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "manifests/examples/smollm2-local.yaml")
MODEL = os.path.join(ROOT, ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
CLIENT_TIMEOUT = 15.0
PERIOD = 0.1


def chat_body(model_name):
    return json.dumps({
        "model": model_name,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    }).encode()


CHAT = chat_body("smollm2-135m-instruct")
FAULTS = ["decode_sigkill", "prefill_sigkill", "prefill_sigstop", "decode_sigstop",
          "kv_loop_stall", "incarnation_fault", "no_progress", "channel_partition",
          "decode_sigkill_again", "prefill_sigkill_again"]
CRASH = {"decode_sigkill", "prefill_sigkill", "decode_sigkill_again", "prefill_sigkill_again"}
# Seconds from the group serving again after the earlier crash to the second one.
AGAIN_AFTER = 1.0
HANG = {"prefill_sigstop", "decode_sigstop"}
SESSION = {"kv_loop_stall", "incarnation_fault"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ts(text):
    """An RFC 3339 UTC time (any fractional digits) as a Unix time."""
    import datetime
    text = text.rstrip("Z")
    whole, _, frac = text.partition(".")
    t = datetime.datetime.strptime(whole, "%Y-%m-%dT%H:%M:%S")
    t = t.replace(tzinfo=datetime.timezone.utc)
    return t.timestamp() + (float("0." + frac) if frac else 0.0)


def http(url, data=None, headers=None, timeout=5.0):
    req = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Client:
    """A request every PERIOD seconds, each on its own thread; every outcome kept."""

    def __init__(self, base):
        self.base = base
        self.results = []  # (sent, ended, outcome)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def one(self):
        sent = time.time()
        try:
            status, body = http(self.base + "/v1/chat/completions", CHAT,
                                {"content-type": "application/json"}, CLIENT_TIMEOUT)
            if status == 200:
                outcome = "ok"
            else:
                try:
                    code = json.loads(body)["error"].get("code") or status
                except (ValueError, KeyError, TypeError, AttributeError):
                    code = status
                outcome = f"refused {status} {code}"
        except (socket.timeout, TimeoutError):
            outcome = "timeout"
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            outcome = f"error {type(e).__name__}"
        with self.lock:
            self.results.append((sent, time.time(), outcome))

    def run(self):
        threads = []
        while not self.stop.is_set():
            t = threading.Thread(target=self.one, daemon=True)
            t.start()
            threads.append(t)
            time.sleep(PERIOD)
        for t in threads:
            t.join(CLIENT_TIMEOUT + 5)


class Runtime:
    def __init__(self, groups, name, args):
        m = yaml.safe_load(open(MANIFEST))
        m["metadata"]["name"] = name
        m["spec"]["groups"] = groups
        m["spec"]["model"]["path"] = MODEL
        if args.model:
            m["spec"]["model"]["name"] = args.model
        for role in ("prefill", "decode"):
            spec = m["spec"][role]
            spec["args"] = list(spec.get("args", [])) + ["--fault-injection"]
            spec["template"].setdefault("env", []).append(
                {"name": "TANDEM_ALLOW_FAULT_INJECTION", "value": "yes"})
        if args.probe_period:
            m["spec"]["health"]["probePeriodSeconds"] = args.probe_period
        if args.failure_threshold:
            m["spec"]["health"]["failureThreshold"] = args.failure_threshold
        if args.unresponsive_grace:
            m["spec"]["health"]["unresponsiveGraceSeconds"] = args.unresponsive_grace
        self.health = m["spec"]["health"]
        self.dir = tempfile.mkdtemp(prefix="tandem-bench-recovery-")
        path = os.path.join(self.dir, "m.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(m, f)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(os.path.join(self.dir, "runtime.log"), "w")
        self.proc = subprocess.Popen(
            [args.operator, "local", "-f", path,
             "--port", str(self.port), "--log-dir", os.path.join(self.dir, "logs"),
             "--dataplane", os.path.join(ROOT, "target/release/tandem-dataplane")],
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL, cwd=ROOT)
        self.groups = groups

    def status(self):
        return json.loads(http(self.base + "/status")[1])

    def wait_ready(self, timeout=180):
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"the runtime exited ({self.proc.returncode}); see {self.dir}")
            try:
                st = self.status()
                gs = (st.get("status") or {}).get("groupStatuses", [])
                if len(gs) == self.groups and all(g["phase"] == "Ready" for g in gs) \
                        and http(self.base + "/v1/chat/completions", CHAT,
                                 {"content-type": "application/json"}, 30)[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError, OSError, ValueError):
                pass
            if time.time() - t0 > timeout:
                sys.exit(f"not Ready in {timeout} s; see {self.dir}")
            time.sleep(0.2)

    def members(self, group=0):
        return {m["role"]: m for m in self.status()["members"]
                if m["group"] == group and not m.get("exit") and not m.get("terminating")}

    def close(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def group_key(pid):
    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    for kv in env:
        if kv.startswith(b"TANDEM_GROUP_KEY="):
            return kv.split(b"=", 1)[1]
    sys.exit(f"no TANDEM_GROUP_KEY in the environment of {pid}")


def admin_reset(member, to):
    key = group_key(member["pid"])
    proof = hmac.new(key, f"tandem-reset/v1 {member['role']} {to}".encode(),
                     hashlib.sha256).hexdigest()
    host, port = member["http"].rsplit(":", 1)
    return http(f"http://{host}:{port}/admin/reset",
                json.dumps({"group_incarnation": to, "timeout_ms": 1000}).encode(),
                {"content-type": "application/json",
                 "authorization": f"Tandem-Reset {proof}"}, 10)


def iptables(*args):
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True)


def inject(rt, fault, m):
    """Inject `fault` into group 0; returns an undo callable (or None)."""
    p, d = m["prefill"], m["decode"]
    fault_url = lambda who, q: f"http://{who['http']}/debug/fault?{q}"
    if fault == "decode_sigkill":
        os.kill(d["pid"], signal.SIGKILL)
    elif fault == "prefill_sigkill":
        os.kill(p["pid"], signal.SIGKILL)
    elif fault == "prefill_sigstop":
        os.kill(p["pid"], signal.SIGSTOP)
        return lambda: os.kill(p["pid"], signal.SIGCONT) if os.path.exists(f"/proc/{p['pid']}") else None
    elif fault == "decode_sigstop":
        os.kill(d["pid"], signal.SIGSTOP)
        return lambda: os.kill(d["pid"], signal.SIGCONT) if os.path.exists(f"/proc/{d['pid']}") else None
    elif fault == "kv_loop_stall":
        s, b = http(fault_url(d, "loop=kv_peer_0&fault=stall&ms=30000"), b"")
        assert s == 200, (s, b)
    elif fault == "no_progress":
        s, b = http(fault_url(d, "loop=engine&fault=hold&ms=60000"), b"")
        assert s == 200, (s, b)
    elif fault == "incarnation_fault":
        s, b = admin_reset(p, p["incarnation"] + 1)
        assert s == 200, (s, b)
    elif fault == "channel_partition":
        port = str(p["kvPort"])
        r = iptables("-I", "INPUT", "-p", "tcp", "--dport", port, "-j", "DROP")
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip())
        return lambda: iptables("-D", "INPUT", "-p", "tcp", "--dport", port, "-j", "DROP")
    return None


def group0(rt):
    return ((rt.status().get("status") or {}).get("groupStatuses") or [{}])[0]


def served_again_after(rt, client, since, inc, max_s=60.0):
    """Wait until group 0 is Ready past incarnation `inc` and a request sent after that was
    answered; exits the benchmark if that takes longer than `max_s`."""
    while time.time() - since < max_s:
        time.sleep(0.1)
        g0 = group0(rt)
        if g0.get("phase") == "Ready" and g0.get("incarnation", 0) > inc:
            ready_at = time.time()
            while time.time() - ready_at < 20:
                with client.lock:
                    if any(r[0] > ready_at and r[2] == "ok" for r in client.results):
                        return
                time.sleep(0.05)
    sys.exit(f"group 0 did not serve again within {max_s} s of the earlier crash; see {rt.dir}")


def measure(rt, fault, max_s=120.0):
    client = Client(rt.base)
    before = rt.members()
    client.thread.start()
    time.sleep(2.0)
    earlier = None
    if fault.endswith("_again"):
        earlier = time.time()
        inject(rt, "decode_sigkill", before)
        served_again_after(rt, client, earlier, before["decode"]["incarnation"])
        time.sleep(AGAIN_AFTER)
        before = rt.members()
    t0 = time.time()
    undo = inject(rt, fault.removesuffix("_again"), before)
    # Until group 0 is Ready at a newer incarnation (its co-restart, in place or not, is
    # done) and every request has been served for 3 s (or the limit).
    inc0 = before["decode"]["incarnation"]
    ok_since = None
    while time.time() - t0 < max_s:
        time.sleep(0.2)
        g0 = ((rt.status().get("status") or {}).get("groupStatuses") or [{}])[0]
        if not (g0.get("phase") == "Ready" and g0.get("incarnation", 0) > inc0):
            ok_since = None
            continue
        with client.lock:
            after = [r for r in client.results if r[0] > t0]
        last_bad = max((r[0] for r in after if r[2] != "ok"), default=None)
        oks = [r for r in after if r[2] == "ok" and (last_bad is None or r[0] > last_bad)]
        if oks and time.time() - t0 > 3:
            ok_since = ok_since or time.time()
            if time.time() - ok_since > 3:
                break
        else:
            ok_since = None
    client.stop.set()
    client.thread.join(CLIENT_TIMEOUT + 10)
    if undo:
        undo()
    st = rt.status()
    after_members = rt.members()
    res = sorted(client.results)
    post = [r for r in res if r[0] >= t0 - 0.05]
    bad = [r for r in post if r[2] != "ok"]
    last_bad = max((r[0] for r in bad), default=None)
    good = [r for r in post if r[2] == "ok" and (last_bad is None or r[0] > last_bad)]
    refused = [r for r in post if r[2].startswith("refused")]
    rec = st["record"]
    ev = lambda reason: next((e for e in rec if e.get("reason") == reason and ts(e["time"]) >= t0), None)
    # The co-restart's own Event ("group 0 co-restart …"), not a phase change that names
    # one held back by the backoff.
    decided = next((e for e in rec if e["kind"] == "Event" and ts(e["time"]) >= t0
                    and e["message"].startswith("group 0 co-restart")), None)
    reset_done = ev("InPlaceResetCompleted")
    reset_took = None
    if reset_done and decided:
        reset_took = ts(reset_done["time"]) - ts(decided["time"])
    pids_before = {before[r]["pid"] for r in before}
    pids_after = {after_members[r]["pid"] for r in after_members}
    return {
        "fault": fault,
        "refused_after": (min(r[1] for r in refused) - t0) if refused else None,
        "longest_wait": max((min(r[1] - r[0], CLIENT_TIMEOUT) for r in post), default=0.0),
        "served_again": (min(r[1] for r in good) - t0) if good and bad else (0.0 if not bad else None),
        "failed": len(bad),
        "requests": len(post),
        "outcomes": sorted({r[2] for r in bad}),
        "reloaded": pids_before != pids_after,
        "decided_after": (ts(decided["time"]) - t0) if decided else None,
        "in_place": bool(decided and "in place" in decided["message"]),
        "reset_took": reset_took,
        "after_earlier": (t0 - earlier) if earlier else None,
        "results": res,
        "t0": t0,
        "record": [e for e in rec if ts(e["time"]) >= t0 - 3],
    }


def served_after_decision(r):
    if r["served_again"] is None or r["decided_after"] is None:
        return None
    return r["served_again"] - r["decided_after"]


def fmt(x, unit="s"):
    return "–" if x is None else f"{x:.2f} {unit}"


def targets(r, health):
    f, window = r["fault"], health["coRestartAfterSeconds"]
    out = []
    if f in CRASH:
        out.append(("served again ≤ 3 s", r["served_again"] is not None and r["served_again"] <= 3))
        out.append(("no wait > 1.5 s", r["longest_wait"] <= 1.5))
    if f == "prefill_sigstop":
        out.append(("refused ≤ 1.5 s", r["refused_after"] is not None and r["refused_after"] <= 1.5))
    if f in HANG:
        out.append((f"served again ≤ {window + 5} s",
                     r["served_again"] is not None and r["served_again"] <= window + 5))
    if f in SESSION:
        after = served_after_decision(r)
        out.append(("served again ≤ 1 s after the decision", after is not None and after <= 1.0))
        out.append(("weights kept", not r["reloaded"]))
    return ", ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in out) or "–"


def svg(r, path, title):
    """Requests answered, refused and waiting per 0.25 s, with the group's phases."""
    t0, res = r["t0"], r["results"]
    start, end = -2.0, max((e for _, e, _ in res), default=t0 + 10) - t0 + 0.5
    step = 0.25
    bins = int((end - start) / step) + 1
    ok = [0] * bins
    bad = [0] * bins
    waiting = [0] * bins
    for s, e, o in res:
        i = int((e - t0 - start) / step)
        if 0 <= i < bins:
            (ok if o == "ok" else bad)[i] += 1
        for j in range(bins):
            mid = t0 + start + (j + 0.5) * step
            if s <= mid < e:
                waiting[j] += 1
    W, H, L, B, T = 900, 360, 60, 50, 70
    ymax = max(max(waiting), max(ok), max(bad), 1)
    x = lambda t: L + (t - start) / (end - start) * (W - L - 20)
    y = lambda v: H - B - v / ymax * (H - B - T)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<text x="{L}" y="18" font-size="14">{title}</text>']
    # Phases from the record's phase events.
    phases = [(ts(e["time"]) - t0, e["message"]) for e in r["record"]
              if e.get("reason") == "GroupPhaseChanged" and e["message"].startswith("group 0")]
    colors = {"Ready": "#c8e6c9", "Broken": "#ffcdd2", "Restarting": "#ffe0b2",
              "Resetting": "#bbdefb", "StartingPrefill": "#fff9c4", "StartingDecode": "#fff9c4"}
    spans, cur, cur_t = [], "Ready", start
    for t, msg in phases:
        to = msg.split("→")[-1].split()[0] if "→" in msg else cur
        spans.append((cur_t, t, cur))
        cur, cur_t = to, t
    spans.append((cur_t, end, cur))
    for a, b, ph in spans:
        a, b = max(a, start), min(b, end)
        if b <= a:
            continue
        parts.append(f'<rect x="{x(a):.1f}" y="28" width="{x(b) - x(a):.1f}" height="22" fill="{colors.get(ph, "#eeeeee")}"/>')
        if x(b) - x(a) > 45:
            parts.append(f'<text x="{x(a) + 3:.1f}" y="43">{ph}</text>')
    parts.append(f'<line x1="{L}" y1="{H - B}" x2="{W - 20}" y2="{H - B}" stroke="black"/>')
    parts.append(f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>')
    for v in range(0, ymax + 1, max(1, ymax // 5)):
        parts.append(f'<text x="{L - 8}" y="{y(v) + 4:.1f}" text-anchor="end">{v}</text>')
    t = 0
    while t <= end:
        parts.append(f'<text x="{x(t):.1f}" y="{H - B + 16}" text-anchor="middle">{t:.0f}</text>')
        t += max(1, round((end - start) / 12))
    parts.append(f'<line x1="{x(0):.1f}" y1="{T}" x2="{x(0):.1f}" y2="{H - B}" stroke="#555" stroke-dasharray="4 3"/>')
    parts.append(f'<text x="{x(0) + 4:.1f}" y="{T + 12}">fault</text>')
    for series, color, name in ((waiting, "#1565c0", "waiting"), (ok, "#2e7d32", "answered"),
                                (bad, "#c62828", "refused / failed")):
        pts = " ".join(f"{x(start + (j + 0.5) * step):.1f},{y(v):.1f}" for j, v in enumerate(series))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.6"/>')
    for i, (color, name) in enumerate((("#1565c0", "requests waiting for an answer"),
                                       ("#2e7d32", "answered per 0.25 s"),
                                       ("#c62828", "refused or failed per 0.25 s"))):
        parts.append(f'<rect x="{L + 10 + i * 250}" y="{H - 22}" width="12" height="4" fill="{color}"/>')
        parts.append(f'<text x="{L + 26 + i * 250}" y="{H - 16}">{name}</text>')
    parts.append(f'<text x="{W / 2}" y="{H - 30}" text-anchor="middle">seconds since the fault</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--faults", nargs="+", default=FAULTS, choices=FAULTS)
    ap.add_argument("--svg", default=os.path.join(ROOT, "docs/recovery-timeline.svg"))
    ap.add_argument("--svg-fault", default="prefill_sigstop")
    ap.add_argument("--json", help="write every request of every run here (for a closer look)")
    ap.add_argument("--probe-period", type=int, help="health.probePeriodSeconds instead of the example's")
    ap.add_argument("--failure-threshold", type=int, help="health.failureThreshold instead of the example's")
    ap.add_argument("--unresponsive-grace", type=int, help="health.unresponsiveGraceSeconds instead of the example's")
    ap.add_argument("--period", type=float, default=0.1,
                    help="seconds between the client's requests (a larger model needs more)")
    ap.add_argument("--operator", default=os.path.join(ROOT, "target/release/tandem-operator"),
                    help="the tandem-operator binary to run (an older build, for an A/B)")
    ap.add_argument("--model", help="a model of scripts/fetch-model.sh (fetched if absent) instead of SmolLM2, "
                    "to show the reload an in-place reset avoids")
    args = ap.parse_args()
    global MODEL, CHAT, PERIOD
    PERIOD = args.period
    if args.model:
        fetch = os.path.join(ROOT, "scripts/fetch-model.sh")
        subprocess.run([fetch, args.model], check=True)
        MODEL = subprocess.run([fetch, "--path", args.model], check=True, capture_output=True,
                               text=True).stdout.strip()
        CHAT = chat_body(args.model)
    model_label = args.model or "SmolLM2"
    if "channel_partition" in args.faults and iptables("-L", "INPUT", "-n").returncode != 0:
        print("skipped: channel_partition (iptables does not work here)")
        args.faults = [f for f in args.faults if f != "channel_partition"]
    print(open("/proc/loadavg").read().strip(), "(load before)")
    rows = []
    for groups in args.groups:
        for fault in args.faults:
            rt = Runtime(groups, f"rec{groups}-{fault.replace('_', '-')}", args)
            try:
                rt.wait_ready()
                time.sleep(1)
                r = measure(rt, fault)
            finally:
                rt.close()
            r["groups"] = groups
            rows.append(r)
            print(f"{groups} group(s) {fault:<18} refused {fmt(r['refused_after'])}, longest wait "
                  f"{fmt(r['longest_wait'])}, served again {fmt(r['served_again'])}, failed "
                  f"{r['failed']}/{r['requests']} {r['outcomes']}, reloaded {r['reloaded']}, "
                  f"co-restart at {fmt(r['decided_after'])}{' in place' if r['in_place'] else ''}"
                  f", reset {fmt(r['reset_took'])}"
                  f"{', ' + fmt(r['after_earlier']) + ' after the earlier crash' if r['after_earlier'] else ''}",
                  flush=True)
            if groups == args.groups[0] and fault == args.svg_fault:
                svg(r, args.svg, f"{fault.replace('_', ' ')}, {groups} group(s), local runtime, {model_label}")
    print(open("/proc/loadavg").read().strip(), "(load after)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items()} for r in rows], f)
    print()
    print("| groups | fault | refused after | longest wait | served again | failed | weights reloaded | co-restart decided | served again after the decision | in-place reset | targets |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    health = yaml.safe_load(open(MANIFEST))["spec"]["health"]
    for r in rows:
        print(f"| {r['groups']} | {r['fault']} | {fmt(r['refused_after'])} | {fmt(r['longest_wait'])} | "
              f"{fmt(r['served_again'])} | {r['failed']} of {r['requests']} | "
              f"{'yes' if r['reloaded'] else 'no'} | {fmt(r['decided_after'])}"
              f"{' (in place)' if r['in_place'] else ''} | {fmt(served_after_decision(r))} | "
              f"{fmt(r['reset_took'])} | "
              f"{targets(r, health) if r['groups'] == 1 else '–'} |")


if __name__ == "__main__":
    main()
