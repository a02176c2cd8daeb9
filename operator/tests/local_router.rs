//! The local runtime's router end to end: the real `tandem-operator local` binary with
//! two groups of real `tandem-dataplane` processes serving the real model, API keys in
//! the environment (the members inherit them), real HTTP. Checks that a shared prompt goes
//! to the group whose decode holds it, in the engine's own blocks (the decode's report
//! holds exactly the keys its prompt-keys call gives), and that SIGKILL of one group's
//! decode fails no request.
//!
//! Needs `target/<profile>/tandem-dataplane` (see local_runtime.rs).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use common::{dataplane, model, repo};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

mod common;

const KEY: &str = "sk-local-router-test";

struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One request on its own connection (`Connection: close`), chunked bodies decoded.
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
    key: Option<&str>,
) -> Answer {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let mut rest = &raw[split + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        let mut out = Vec::new();
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let n = usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16)
                .unwrap_or(0);
            if n == 0 {
                break;
            }
            let data = &rest[eol + 2..];
            out.extend_from_slice(&data[..n.min(data.len())]);
            rest = &data[(n + 2).min(data.len())..];
        }
        out
    } else {
        rest.to_vec()
    };
    Answer {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

struct Local {
    child: Child,
    addr: SocketAddr,
    dir: std::path::PathBuf,
}

impl Drop for Local {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
        let start = Instant::now();
        while self.child.try_wait().ok().flatten().is_none()
            && start.elapsed() < Duration::from_secs(15)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("runtime files kept in {}", self.dir.display());
        }
    }
}

impl Local {
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("runtime.log")).unwrap_or_default()
    }

    fn wait_for(&mut self, what: &str, timeout: Duration, cond: impl Fn(&Self) -> bool) {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!(
                    "the runtime exited ({st}) waiting for {what}; log:\n{}",
                    self.log()
                );
            }
            if TcpStream::connect(self.addr).is_ok() && cond(self) {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "{what}: not within {timeout:?}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn status(&self) -> Value {
        http(self.addr, "GET", "/status", None, Some(KEY)).json()
    }

    fn metric(&self, series: &str) -> f64 {
        let m = http(self.addr, "GET", "/metrics", None, None).body;
        m.lines()
            .find_map(|l| l.strip_prefix(series).and_then(|r| r.trim().parse().ok()))
            .unwrap_or_else(|| panic!("no {series} in:\n{m}"))
    }
}

fn start(name: &str) -> Local {
    let text =
        std::fs::read_to_string(repo().join("manifests/examples/smollm2-local.yaml")).unwrap();
    let mut m: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    m["metadata"]["name"] = name.into();
    m["spec"]["model"]["path"] = model().to_string_lossy().into_owned().into();
    m["spec"]["groups"] = 2.into();
    m["spec"]["health"] = serde_yaml::from_str(
        "{probePeriodSeconds: 1, failureThreshold: 3, coRestartAfterSeconds: 4}",
    )
    .unwrap();
    m["spec"]["restart"]["backoff"] =
        serde_yaml::from_str("{baseSeconds: 1, maxSeconds: 10}").unwrap();
    for role in ["prefill", "decode"] {
        m["spec"][role]["args"] = serde_yaml::from_str("[--kv-blocks, '128']").unwrap();
    }
    let dir = std::env::temp_dir().join(format!(
        "tandem-local-router-{name}-{}-{}",
        std::process::id(),
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_millis()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("manifest.yaml");
    std::fs::write(&file, serde_yaml::to_string(&m).unwrap()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = std::fs::File::create(dir.join("runtime.log")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_tandem-operator"))
        .args(["local", "-f"])
        .arg(&file)
        .args([
            "--port",
            &port.to_string(),
            "--grace-period-seconds",
            "3",
            "--log-format",
            "json",
        ])
        .arg("--log-dir")
        .arg(dir.join("logs"))
        .arg("--dataplane")
        .arg(dataplane())
        // Through the environment: the members inherit it and require the key too.
        .env("TANDEM_API_KEY", KEY)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("start tandem-operator local");
    let mut l = Local {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        dir,
    };
    l.wait_for("both groups to serve", Duration::from_secs(240), |l| {
        let r = http(l.addr, "GET", "/ready", None, None);
        r.status == 200
            && r.json()["endpoints"]
                .as_array()
                .is_some_and(|e| e.len() == 2)
    });
    l
}

/// A system prompt of about 300 tokens shared by many users.
fn system() -> String {
    "You are the support assistant of a small bakery. Answer briefly and kindly. ".repeat(20)
}

fn chat(user: &str) -> Value {
    json!({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "system", "content": system()}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
    })
}

#[test]
fn a_shared_prompt_goes_to_the_group_that_holds_it_and_a_killed_group_fails_no_request() {
    let mut l = start("router");
    // Keys: the API needs one, the probes and scrapes do not.
    let r = http(
        l.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("hi")),
        None,
    );
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "missing_api_key");
    assert_eq!(http(l.addr, "GET", "/health", None, None).status, 200);
    assert_eq!(http(l.addr, "GET", "/status", None, None).status, 401);

    let first = http(
        l.addr,
        "POST",
        "/v1/chat/completions",
        Some(&chat("Do you sell rye bread?")),
        Some(KEY),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    let home = first.header("x-tandem-pod").unwrap().to_string();
    // The decode's report now holds the prompt's blocks: exactly the keys its own
    // prompt-keys call gives (the engine's hashes, not the router's guess).
    let decode = l.status()["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["pod"] == home.as_str())
        .unwrap()["addr"]
        .as_str()
        .unwrap()
        .parse::<SocketAddr>()
        .unwrap();
    let keys = http(
        decode,
        "POST",
        "/tandem/prompt-keys?api=chat",
        Some(&chat("Do you sell rye bread?")),
        Some(KEY),
    )
    .json();
    let keys: Vec<String> = keys["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    assert!(keys.len() >= 15, "{keys:?}");
    assert_eq!(
        http(decode, "GET", "/tandem/report", None, None).status,
        401,
        "the decode has the key too"
    );
    let start = Instant::now();
    loop {
        let report = http(decode, "GET", "/tandem/report", None, Some(KEY)).json();
        let held: Vec<&str> = report["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap())
            .collect();
        // All whole blocks but possibly the last (the engine always computes a token).
        if keys[..keys.len() - 1]
            .iter()
            .all(|k| held.contains(&k.as_str()))
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{keys:?} not all in {held:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(600));
    // Other users behind the same system prompt go where it is cached.
    for user in [
        "Are you open on Sunday?",
        "Do you bake wedding cakes?",
        "Is there parking?",
    ] {
        let r = http(
            l.addr,
            "POST",
            "/v1/chat/completions",
            Some(&chat(user)),
            Some(KEY),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-tandem-pod"), Some(home.as_str()), "{user}");
        assert_eq!(r.header("x-tandem-route"), Some("prefix"), "{user}");
        // The decode reused the prompt's blocks from its prefix cache.
        let cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        assert!(
            cached.unwrap_or(0) >= 16 * (keys.len() as u64 - 2),
            "{user}: {}",
            r.body
        );
    }
    assert!(l.metric("tandem_router_matched_blocks_total") >= 3.0 * (keys.len() - 1) as f64);

    // SIGKILL of the decode that holds the prompt, then the same prompt at once and
    // while its group co-restarts: the other group answers every one.
    let pid = l.status()["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == home.as_str())
        .unwrap()["pid"]
        .as_i64()
        .unwrap();
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    let killed = Instant::now();
    let mut answered = 0;
    while killed.elapsed() < Duration::from_secs(8) {
        let r = http(
            l.addr,
            "POST",
            "/v1/chat/completions",
            Some(&chat("And croissants?")),
            Some(KEY),
        );
        assert_eq!(r.status, 200, "after {:?}: {}", killed.elapsed(), r.body);
        assert_ne!(r.header("x-tandem-pod"), Some(home.as_str()));
        answered += 1;
    }
    assert!(answered >= 2);
    assert_eq!(
        l.metric("tandem_router_requests_total{outcome=\"failed\"}"),
        0.0
    );
    println!(
        "local_router: {answered} requests after SIGKILL of the decode holding the prompt, none failed; retried {}",
        l.metric("tandem_router_requests_total{outcome=\"retried\"}")
    );
    l.wait_for(
        "the killed group to serve again",
        Duration::from_secs(120),
        |l| {
            let r = http(l.addr, "GET", "/ready", None, None);
            r.status == 200
                && r.json()["endpoints"]
                    .as_array()
                    .is_some_and(|e| e.len() == 2)
        },
    );
}
