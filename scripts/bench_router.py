#!/usr/bin/env python3
"""The router on the local runtime (`make bench-router`; docs/routing.md, BENCHMARKS.md).

Runs `tandem-operator local` with N groups of SmolLM2 (default 4 groups, 512 KV blocks per
process) and a shared-prompt workload: P distinct system prompts of about 400 tokens
(default 64: more than one group's pool holds, fewer than all of them together), each
request one of them (uniformly) and a short question of its own, streamed, arriving at a
steady rate (open loop: a request starts on time whether or not earlier ones finished).

Phase 1, routing: the same workload with `--routing round-robin` and with the router
(`prefix-load`), a fresh runtime each. Per run: TTFT p50/p99 (first content chunk of the
stream), output tok/s over the run, the prefix hit rate of the prefills and of the decodes
(their `tandem_prefix_cache_hit_tokens_total / lookup_tokens_total`), and that rate over
the ideal one (every request but the first of each prompt hits its whole shared prefix).

Phase 2, a killed group: the router with `--retries 1` and with `--retries 0`; one group's
decode is SIGKILLed a third of the way into the run; requests that failed (non-200, or a
stream that ended without `[DONE]`) are counted.

Prints each run as it ends and a Markdown table at the end (also written as JSON with
--json). `--smoke` is a tiny run (2 groups, 4 prompts, a few seconds) to check the script.
"""

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(os.environ.get("TANDEM_MODEL_DIR", os.path.join(ROOT, ".cache/models")),
                     "SmolLM2-135M-Instruct.Q4_1.gguf")
TOPICS = ["a bakery", "a bicycle shop", "a dental clinic", "a hotel", "a library",
          "a train company", "a bank", "a garden centre", "a museum", "a car rental"]
QUESTIONS = ["When are you open?", "How much does it cost?", "Can I book for Friday?",
             "Do you deliver?", "Where are you?", "Is there parking?", "Can I pay by card?",
             "Do you have gift cards?", "Who do I call?", "What do you recommend?"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(i):
    """About 400 tokens, distinct from the first words on (so no two prompts share a block)."""
    topic = TOPICS[i % len(TOPICS)]
    rules = (f"Rule {{k}} for assistant {i}: answer questions about {topic} politely, in one "
             f"short sentence, and never invent prices or opening hours. ")
    return f"Assistant {i} of {topic}. " + "".join(rules.format(k=k) for k in range(14))


def manifest(name, groups, kv_blocks):
    return {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "PDDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "smollm2-135m-instruct", "path": MODEL},
            "groups": groups,
            "prefill": {"replicas": 1, "args": ["--kv-blocks", str(kv_blocks)]},
            "decode": {"replicas": 1, "args": ["--kv-blocks", str(kv_blocks)]},
            "health": {"probePeriodSeconds": 2, "failureThreshold": 3,
                       "coRestartAfterSeconds": 10, "unresponsiveGraceSeconds": 1},
            "restart": {"policy": "CoRestartGroup",
                        "backoff": {"baseSeconds": 1, "maxSeconds": 10}},
        },
    }


def get_json(base, path):
    with urllib.request.urlopen(base + path, timeout=10) as r:
        return json.load(r)


def metrics(addr):
    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        k, v = line.rsplit(" ", 1)
        try:
            out[k] = float(v)
        except ValueError:
            pass
    return out


class Runtime:
    def __init__(self, bin_dir, groups, kv_blocks, routing, retries):
        self.dir = tempfile.mkdtemp(prefix="tandem-bench-router-")
        self.file = os.path.join(self.dir, "manifest.yaml")
        with open(self.file, "w") as f:
            json.dump(manifest("bench", groups, kv_blocks), f)  # JSON is YAML
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.groups = groups
        self.log = open(os.path.join(self.dir, "runtime.log"), "w")
        self.proc = subprocess.Popen(
            [os.path.join(bin_dir, "tandem-operator"), "local", "-f", self.file,
             "--port", str(self.port), "--log-dir", os.path.join(self.dir, "logs"),
             "--grace-period-seconds", "3", "--log-format", "json",
             "--dataplane", os.path.join(bin_dir, "tandem-dataplane"),
             "--routing", routing, "--retries", str(retries)],
            stdout=self.log, stderr=self.log, cwd=ROOT)

    def wait_ready(self, timeout=600):
        t = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"the runtime exited with {self.proc.returncode}; see {self.dir}")
            try:
                r = get_json(self.base, "/ready")
                if len(r.get("endpoints", [])) == self.groups:
                    return time.monotonic() - t
            except OSError:
                pass
            if time.monotonic() - t > timeout:
                sys.exit(f"not every group serves within {timeout} s; see {self.dir}")
            time.sleep(0.2)

    def members(self):
        return get_json(self.base, "/status")["members"]

    def hit_rates(self):
        """Prefix-cache hit tokens / lookup tokens, summed over each role's members."""
        out = {}
        for role in ("prefill", "decode"):
            hit = look = 0.0
            for m in self.members():
                if m["role"] == role:
                    x = metrics(m["http"])
                    hit += x.get("tandem_prefix_cache_hit_tokens_total", 0.0)
                    look += x.get("tandem_prefix_cache_lookup_tokens_total", 0.0)
            out[role] = hit / look if look else 0.0
        return out

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def one_request(port, body):
    """(ok, ttft seconds or None, completion tokens, prompt tokens)."""
    start = time.monotonic()
    ttft = None
    tokens = prompt_tokens = 0
    done = False
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/chat/completions", body=body,
                  headers={"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            r.read()
            return False, None, 0, 0
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            ev = json.loads(data)
            if ev.get("usage"):
                tokens = ev["usage"].get("completion_tokens", tokens)
                prompt_tokens = ev["usage"].get("prompt_tokens", 0)
            choices = ev.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content") and ttft is None:
                ttft = time.monotonic() - start
        c.close()
    except (OSError, http.client.HTTPException, ValueError):
        return False, ttft, tokens, prompt_tokens
    return done, ttft, tokens, prompt_tokens


def workload(port, prompts, rate, duration, max_tokens, seed, on_tick=None):
    rng = random.Random(seed)
    n = int(rate * duration)
    results = []
    lock = threading.Lock()
    used = set()

    def run(i):
        p = rng.randrange(prompts)
        with lock:
            first = p not in used
            used.add(p)
        body = json.dumps({
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "system", "content": system_prompt(p)},
                         {"role": "user", "content": rng.choice(QUESTIONS) + f" (#{i})"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
        })
        ok, ttft, tok, ptok = one_request(port, body)
        with lock:
            results.append({"ok": ok, "ttft": ttft, "tokens": tok, "prompt_tokens": ptok,
                            "first_of_prompt": first})

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=256) as pool:
        futures = []
        for i in range(n):
            at = start + i / rate
            while time.monotonic() < at:
                time.sleep(min(0.01, max(0.0, at - time.monotonic())))
            if on_tick:
                on_tick(time.monotonic() - start)
            futures.append(pool.submit(run, i))
        concurrent.futures.wait(futures)
    wall = time.monotonic() - start
    return results, wall


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def shared_fraction(results, shared_tokens):
    """The ideal hit rate: every request but the first of its prompt hits the shared part."""
    total = sum(r["prompt_tokens"] for r in results)
    hit = sum(shared_tokens for r in results if not r["first_of_prompt"])
    return hit / total if total else 0.0


def shared_tokens_of(rt):
    """Tokens in whole blocks two users of one system prompt share (from a decode)."""
    ep = get_json(rt.base, "/ready")["endpoints"][0]["addr"]
    keys = []
    for q in ("a?", "something else entirely?"):
        body = json.dumps({"messages": [{"role": "system", "content": system_prompt(0)},
                                        {"role": "user", "content": q}]}).encode()
        req = urllib.request.Request(f"http://{ep}/tandem/prompt-keys?api=chat", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            v = json.load(r)
        keys.append(v["keys"])
    n = 0
    while n < min(map(len, keys)) and keys[0][n] == keys[1][n]:
        n += 1
    return n * v["blockTokens"]


def routing_run(args, routing):
    rt = Runtime(args.bin_dir, args.groups, args.kv_blocks, routing, 1)
    try:
        rt.wait_ready()
        shared = shared_tokens_of(rt)
        results, wall = workload(rt.port, args.prompts, args.rate, args.duration,
                                 args.max_tokens, args.seed)
        ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
        hits = rt.hit_rates()
        m = metrics(f"127.0.0.1:{rt.port}")
        keys_n = m.get("tandem_router_prompt_keys_seconds_count", 0.0)
        keys_ms = 1000 * m.get("tandem_router_prompt_keys_seconds_sum", 0.0) / keys_n if keys_n else 0.0
        ideal = shared_fraction(results, shared)
        return {
            "routing": routing, "requests": len(results),
            "failed": sum(not r["ok"] for r in results),
            "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
            "tok_s": sum(r["tokens"] for r in results) / wall,
            "hit_prefill": hits["prefill"], "hit_decode": hits["decode"], "hit_ideal": ideal,
            "of_ideal": hits["prefill"] / ideal if ideal else float("nan"),
            "prompt_keys_ms": keys_ms,
        }
    finally:
        rt.stop()


def kill_run(args, retries):
    rt = Runtime(args.bin_dir, args.groups, args.kv_blocks, "prefix-load", retries)
    killed = {}
    try:
        rt.wait_ready()
        victim = next(m for m in rt.members() if m["role"] == "decode" and m["group"] == 0)

        def tick(t):
            if not killed and t >= args.duration / 3:
                os.kill(victim["pid"], signal.SIGKILL)
                killed["at"] = t

        results, _ = workload(rt.port, args.prompts, args.rate, args.duration,
                              args.max_tokens, args.seed + 1, on_tick=tick)
        m = metrics(f"127.0.0.1:{rt.port}")
        return {
            "retries": retries, "requests": len(results),
            "failed": sum(not r["ok"] for r in results), "killed_at": killed.get("at"),
            "retried": m.get('tandem_router_requests_total{outcome="retried"}', 0.0),
        }
    finally:
        rt.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--kv-blocks", type=int, default=512)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per run")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "target/release"))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--skip-kill", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a tiny run that checks the script")
    args = ap.parse_args()
    if args.smoke:
        args.groups, args.prompts, args.rate, args.duration = 2, 4, 1.0, 8.0
        args.kv_blocks, args.max_tokens = 128, 4
    if not os.path.isfile(MODEL):
        sys.exit(f"no model at {MODEL}: run `make model`")
    print(f"{args.groups} groups x {args.kv_blocks} KV blocks, {args.prompts} system prompts, "
          f"{args.rate} req/s for {args.duration} s, {args.max_tokens} tokens each", flush=True)
    routing = []
    for mode in ("round-robin", "prefix-load"):
        r = routing_run(args, mode)
        routing.append(r)
        print(json.dumps(r), flush=True)
    kills = []
    if not args.skip_kill:
        for retries in (0, 1):
            r = kill_run(args, retries)
            kills.append(r)
            print(json.dumps(r), flush=True)
    print()
    print("| routing | requests | failed | TTFT p50 (s) | TTFT p99 (s) | tok/s | prefill hit | decode hit | ideal | of ideal | prompt keys (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in routing:
        print(f"| {r['routing']} | {r['requests']} | {r['failed']} | {r['ttft_p50']:.3f} | "
              f"{r['ttft_p99']:.3f} | {r['tok_s']:.1f} | {r['hit_prefill']:.1%} | "
              f"{r['hit_decode']:.1%} | {r['hit_ideal']:.1%} | {r['of_ideal']:.0%} | "
              f"{r['prompt_keys_ms']:.1f} |")
    if len(routing) == 2 and routing[1]["ttft_p50"] > 0:
        print(f"\nTTFT p50 round robin / router: {routing[0]['ttft_p50'] / routing[1]['ttft_p50']:.2f}x "
              f"(target >= 3x); router hit rate {routing[1]['of_ideal']:.0%} of ideal (target >= 80%)")
    if kills:
        print("\n| one of the groups' decode SIGKILLed | requests | failed | retried |")
        print("|---|---|---|---|")
        for r in kills:
            print(f"| retries {r['retries']} (at {r['killed_at'] or 0:.1f} s) | {r['requests']} | "
                  f"{r['failed']} | {r['retried']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "routing": routing, "kill": kills}, f, indent=2)


if __name__ == "__main__":
    main()
