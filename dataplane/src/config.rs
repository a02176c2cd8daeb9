//! Command-line and environment configuration of the dataplane binary: every setting is
//! a flag with an environment variable (`TANDEM_<NAME>`), parsed and checked here, and
//! passed down as plain values; nothing below reads the environment.
//!
//! [`Config::check`] is every check that needs no model loaded (combinations of flags,
//! the model file being a readable GGUF file); `--check-config` runs it and prints
//! [`Config::effective`] instead of serving.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use clap::{ArgAction, Parser, ValueEnum};
use serde::Serialize;
use serde_json::{Value, json};
use tandem_kernels::CpuOptions;

use crate::scheduler::SchedulerConfig;

/// The compute device of the model runner (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// CUDA device by ordinal (a build with feature `cuda`).
    Cuda(usize),
}

impl FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("bad device {other:?}: use cpu, cuda or cuda:N")),
        }
    }
}

impl Serialize for Device {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefill and decode in one process (no KV transfer).
    Both,
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Both => "both",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// Storage type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// 2 bytes per value.
    F16,
    /// 34 bytes per 32 values: about half the memory of F16 (values rounded per 32-block
    /// to 8 bits with one f16 scale).
    #[value(name = "q8_0")]
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 4 bytes per value (for debugging).
    F32,
}

impl KvDtype {
    pub fn ggml(self) -> tandem_kernels::GgmlType {
        match self {
            Self::F16 => tandem_kernels::GgmlType::F16,
            Self::Q8_0 => tandem_kernels::GgmlType::Q8_0,
            Self::F32 => tandem_kernels::GgmlType::F32,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Parser, Serialize)]
#[command(
    name = "tandem-dataplane",
    version,
    about = "Tandem dataplane: OpenAI-compatible LLM serving"
)]
pub struct Config {
    #[arg(long, env = "TANDEM_ROLE", value_enum, default_value = "both")]
    pub role: Role,
    /// GGUF model file.
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: PathBuf,
    /// Name clients use in `model`; defaults to the model file name without `.gguf`.
    #[arg(long, env = "TANDEM_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Jinja chat template file for `/v1/chat/completions`, instead of the model's own
    /// `tokenizer.chat_template` (needed for a model that has none, such as a base model).
    #[arg(long, env = "TANDEM_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,
    /// Compute device: `cpu`, or `cuda` / `cuda:N` in a build with feature `cuda`.
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: Device,
    /// CPU: threads of the kernel pool, the engine thread included (default: one per core).
    #[arg(long, env = "TANDEM_THREADS", value_parser = at_least_one)]
    pub threads: Option<usize>,
    /// CPU: portable kernels only, no SIMD (to compare or debug; `TANDEM_NO_SIMD=1`).
    #[arg(long, env = "TANDEM_NO_SIMD", value_parser = clap::builder::FalseyValueParser::new())]
    pub no_simd: bool,
    /// CUDA: sample on the device and copy only token ids back (`on`), or copy logits
    /// rows back and sample on the host (`off`).
    #[arg(long, env = "TANDEM_CUDA_SAMPLING", default_value = "on", value_parser = on_off, action = ArgAction::Set)]
    pub cuda_sampling: bool,
    /// CUDA: replay decode steps as CUDA graphs (`off` until checked on a GPU).
    #[arg(long, env = "TANDEM_CUDA_GRAPHS", default_value = "off", value_parser = on_off, action = ArgAction::Set)]
    pub cuda_graphs: bool,
    #[arg(long, env = "TANDEM_HOST", default_value = "0.0.0.0")]
    pub host: String,
    #[arg(long, env = "TANDEM_PORT", default_value_t = 8000)]
    pub port: u16,
    /// KV cache blocks (16 tokens each).
    #[arg(long, env = "TANDEM_KV_BLOCKS", default_value_t = 2048, value_parser = at_least_one)]
    pub kv_blocks: usize,
    /// KV cache storage type. The prefill and decode roles of one group must use the same
    /// (their handshake checks it).
    #[arg(long, env = "TANDEM_KV_DTYPE", value_enum, default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Turn the prefix cache off: every prompt is computed in full, and KV blocks are
    /// free as soon as their request ends (`TANDEM_NO_PREFIX_CACHE=1`).
    #[arg(long, env = "TANDEM_NO_PREFIX_CACHE", value_parser = clap::builder::FalseyValueParser::new())]
    pub no_prefix_cache: bool,
    /// Most prompt tokens prefilled per engine step.
    #[arg(long, env = "TANDEM_CHUNK_SIZE", default_value_t = 256, value_parser = at_least_one)]
    pub chunk_size: usize,
    /// Most sequences in the running batch.
    #[arg(long, env = "TANDEM_MAX_BATCH", default_value_t = 16, value_parser = at_least_one)]
    pub max_batch: usize,
    /// Most requests waiting for admission; more get 503.
    #[arg(long, env = "TANDEM_MAX_WAITING", default_value_t = 256, value_parser = at_least_one)]
    pub max_waiting: usize,
    /// Seconds a request may wait for KV memory before failing with 503.
    #[arg(long, env = "TANDEM_QUEUE_TIMEOUT_SECONDS", default_value_t = 30.0, value_parser = positive_seconds)]
    pub queue_timeout_seconds: f64,
    /// max_tokens for requests that set none.
    #[arg(long, env = "TANDEM_DEFAULT_MAX_TOKENS", default_value_t = 256, value_parser = at_least_one)]
    pub default_max_tokens: usize,
    /// `/ready` fails when the engine loop is stuck this long.
    #[arg(long, env = "TANDEM_ENGINE_STALL_SECONDS", default_value_t = 10.0, value_parser = positive_seconds)]
    pub engine_stall_seconds: f64,
    /// On SIGTERM, how long in-flight requests may run before the process exits anyway.
    #[arg(long, env = "TANDEM_DRAIN_SECONDS", default_value_t = 30.0, value_parser = non_negative_seconds)]
    pub drain_seconds: f64,
    /// Seconds a client may take to send a request head (the line and headers), and that an
    /// idle keep-alive connection stays open; then the connection is closed and counted as
    /// `tandem_http_connection_errors_total{kind="timeout"}`.
    #[arg(long, env = "TANDEM_HTTP_HEADER_TIMEOUT_SECONDS", default_value_t = 10.0, value_parser = positive_seconds)]
    pub http_header_timeout_seconds: f64,
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Prefill: TCP port of the KV transfer ROUTER socket.
    #[arg(long, env = "TANDEM_KV_PORT", default_value_t = 5600)]
    pub kv_port: u16,
    /// Decode: prefill KV endpoints (`host:port`), comma separated.
    #[arg(long = "prefill", env = "TANDEM_PREFILL_PEERS", value_delimiter = ',')]
    pub prefill_peers: Vec<String>,
    /// Incarnation of the bootstrap group (from the operator); peers must agree.
    #[arg(long, env = "TANDEM_GROUP_INCARNATION", default_value_t = 0)]
    pub group_incarnation: u64,
    /// Shared secret of the group for the handshake (required for prefill and decode).
    #[arg(
        long,
        env = "TANDEM_GROUP_KEY",
        hide_env_values = true,
        default_value = ""
    )]
    #[serde(serialize_with = "redacted")]
    pub group_key: String,
    /// Decode: seconds between PINGs to each prefill.
    #[arg(long, env = "TANDEM_PROBE_PERIOD_SECONDS", default_value_t = 2.0, value_parser = positive_seconds)]
    pub probe_period_seconds: f64,
    /// Decode: missed probe periods before `/ready` fails.
    #[arg(long, env = "TANDEM_FAILURE_THRESHOLD", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub failure_threshold: u32,
    /// No-progress limit of handshakes, rooms waiting for a session, and abort acks.
    #[arg(long, env = "TANDEM_BOOTSTRAP_TIMEOUT_SECONDS", default_value_t = 10.0, value_parser = positive_seconds)]
    pub bootstrap_timeout_seconds: f64,
    /// No-progress limit of rooms waiting for or receiving KV (the prefill's PROGRESS
    /// keeps a room alive while its engine works, so this measures silence).
    #[arg(long, env = "TANDEM_KV_TIMEOUT_SECONDS", default_value_t = 30.0, value_parser = positive_seconds)]
    pub kv_timeout_seconds: f64,
    /// Most KV bytes in flight to one peer (sent, not yet acknowledged), in MiB; a room past
    /// it fails at once with `send_budget`.
    #[arg(long, env = "TANDEM_KV_SEND_BUDGET_MIB", default_value_t = 256, value_parser = at_least_one)]
    pub kv_send_budget_mib: usize,
    /// Tests only: serve `POST /debug/fault` (arm a panic or stall in a KV loop). Refused at
    /// start unless the environment also sets `TANDEM_ALLOW_FAULT_INJECTION=yes`.
    #[arg(long)]
    pub fault_injection: bool,
    /// Check the configuration (every flag and variable, their combinations, the model
    /// file) without loading the model or binding a port: print the effective
    /// configuration as JSON and exit 0, or print what is wrong and exit 2.
    #[arg(long)]
    #[serde(skip)]
    pub check_config: bool,
}

/// The group key is a secret: `--check-config` says only whether one is set.
fn redacted<S: serde::Serializer>(key: &str, s: S) -> Result<S::Ok, S::Error> {
    if key.is_empty() {
        s.serialize_str("")
    } else {
        s.collect_str(&format_args!("<redacted: {} bytes>", key.len()))
    }
}

/// Protocol timings derived from the configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdTimings {
    pub probe_period: Duration,
    pub failure_threshold: u32,
    pub bootstrap_timeout: Duration,
    pub kv_timeout: Duration,
}

impl PdTimings {
    /// How long without a PONG before a peer counts as down.
    pub fn liveness_window(&self) -> Duration {
        self.probe_period * self.failure_threshold.max(1)
    }

    /// Prefill: how long a decode session may stay silent (no message at all, PING
    /// included) before the prefill drops it and fails its rooms: twice the decode's own
    /// liveness window (a live decode PINGs every probe period), and never less than the
    /// bootstrap timeout.
    pub fn session_expiry(&self) -> Duration {
        (self.liveness_window() * 2).max(self.bootstrap_timeout)
    }
}

impl Config {
    /// Every check that needs no model loaded: what `--check-config` runs, and what the
    /// server runs before loading the model.
    pub fn check(&self) -> crate::Result<()> {
        if self.role != Role::Both && self.group_key.is_empty() {
            return Err(crate::Error::config(
                "--group-key",
                format!(
                    "role '{}' needs a group key (--group-key or TANDEM_GROUP_KEY) to authenticate its KV peers",
                    self.role.as_str()
                ),
            ));
        }
        if self.fault_injection
            && std::env::var("TANDEM_ALLOW_FAULT_INJECTION").as_deref() != Ok("yes")
        {
            return Err(crate::Error::config(
                "--fault-injection",
                "for tests only: it is refused unless the environment also sets \
                 TANDEM_ALLOW_FAULT_INJECTION=yes",
            ));
        }
        if matches!(self.device, Device::Cuda(_)) && !cfg!(feature = "cuda") {
            return Err(crate::Error::config(
                format!("--device {}", self.device),
                "this binary was built without CUDA support (build with `--features cuda`); \
                 use --device cpu",
            ));
        }
        if self.role == Role::Decode {
            if self.prefill_peers.is_empty() {
                return Err(crate::Error::config(
                    "--prefill",
                    "role decode needs at least one --prefill address",
                ));
            }
            for peer in &self.prefill_peers {
                check_peer(peer)?;
            }
        }
        if let Some(t) = &self.chat_template {
            crate::chat::read_template_file(t)?;
        }
        check_model_file(&self.model)
    }

    /// The configuration as it would be served, as JSON: every setting by its field name
    /// (the flag without `--`, `-` as `_`; `--prefill` is `prefill_peers`), the group key
    /// redacted, and the values derived from them.
    pub fn effective(&self) -> Value {
        let t = self.pd_timings();
        json!({
            "config": self,
            "derived": {
                "served_model_name": self.served_name(),
                "liveness_window_seconds": t.liveness_window().as_secs_f64(),
                "session_expiry_seconds": t.session_expiry().as_secs_f64(),
                "kv_send_budget_bytes": self.pd_limits().send_budget,
            },
        })
    }

    pub fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            max_batch: self.max_batch,
            chunk_size: self.chunk_size,
            max_waiting: self.max_waiting,
            queue_timeout: secs(self.queue_timeout_seconds),
            ..SchedulerConfig::default()
        }
    }

    pub fn cpu_options(&self) -> CpuOptions {
        CpuOptions {
            threads: self.threads,
            simd: !self.no_simd,
        }
    }

    #[cfg(feature = "cuda")]
    pub fn cuda_options(&self) -> crate::model::cuda::CudaOptions {
        crate::model::cuda::CudaOptions {
            device_sampling: self.cuda_sampling,
            graphs: self.cuda_graphs,
        }
    }

    pub fn served_name(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            let f = self
                .model
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            f.strip_suffix(".gguf").map(str::to_owned).unwrap_or(f)
        })
    }

    pub fn http_header_timeout(&self) -> Duration {
        secs(self.http_header_timeout_seconds)
    }

    pub fn drain(&self) -> Duration {
        secs(self.drain_seconds)
    }

    pub fn engine_stall(&self) -> Duration {
        secs(self.engine_stall_seconds)
    }

    pub fn pd_limits(&self) -> crate::pd::PdLimits {
        crate::pd::PdLimits {
            send_budget: (self.kv_send_budget_mib as u64) << 20,
            engine_stall: self.engine_stall(),
        }
    }

    pub fn pd_timings(&self) -> PdTimings {
        PdTimings {
            probe_period: secs(self.probe_period_seconds),
            failure_threshold: self.failure_threshold,
            bootstrap_timeout: secs(self.bootstrap_timeout_seconds),
            kv_timeout: secs(self.kv_timeout_seconds),
        }
    }
}

/// A KV endpoint as `--prefill` takes it: `host:port`, port 1-65535.
fn check_peer(peer: &str) -> crate::Result<()> {
    let bad = |why: &str| crate::Error::config("--prefill", format!("{peer:?}: {why}"));
    let (host, port) = peer
        .rsplit_once(':')
        .ok_or_else(|| bad("expected host:port"))?;
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(bad("expected host:port with a host name or address"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(bad("the port must be a number from 1 to 65535")),
    }
}

/// The model file exists, can be read, and starts like a GGUF file (its first four bytes;
/// the rest is read when the model loads).
fn check_model_file(path: &std::path::Path) -> crate::Result<()> {
    use std::io::Read;
    let io = |source| crate::Error::Io {
        path: path.display().to_string(),
        source,
    };
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .map_err(io)?;
    if &magic != b"GGUF" {
        return Err(crate::Error::config(
            "--model",
            format!("{} is not a GGUF file", path.display()),
        ));
    }
    crate::model::support::check_file(path)
}

/// Seconds the parsers below accepted (finite, not negative, not absurdly large).
fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO)
}

/// Longest duration a flag may name: a year, so that `Instant + d` never overflows.
const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

fn parse_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !v.is_finite() || v > MAX_SECONDS {
        return Err(format!(
            "{s:?} seconds is out of range (at most {MAX_SECONDS})"
        ));
    }
    Ok(v)
}

/// A duration in seconds that must be greater than zero (timeouts, periods).
fn positive_seconds(s: &str) -> Result<f64, String> {
    let v = parse_seconds(s)?;
    if v <= 0.0 {
        return Err(format!("{s:?}: must be greater than 0 seconds"));
    }
    Ok(v)
}

/// A duration in seconds that may be zero (a drain deadline of 0 exits at once).
fn non_negative_seconds(s: &str) -> Result<f64, String> {
    let v = parse_seconds(s)?;
    if v < 0.0 {
        return Err(format!("{s:?}: must not be negative"));
    }
    Ok(v)
}

/// An on/off switch: 1/on/true/yes or 0/off/false/no.
fn on_off(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "true" | "yes" => Ok(true),
        "0" | "off" | "false" | "no" => Ok(false),
        _ => Err(format!(
            "{s:?}: expected on or off (1/on/true/yes, 0/off/false/no)"
        )),
    }
}

/// A count that must be at least 1 (batch sizes, queue lengths, cache blocks).
fn at_least_one(s: &str) -> Result<usize, String> {
    let v: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number"))?;
    if v == 0 {
        return Err(format!("{s:?}: must be at least 1"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_flags_and_defaults() {
        let c = Config::try_parse_from([
            "x",
            "--model",
            "/m/SmolLM2.Q4_1.gguf",
            "--port",
            "9000",
            "--chunk-size",
            "64",
        ])
        .unwrap();
        assert_eq!((c.role, c.port, c.chunk_size), (Role::Both, 9000, 64));
        assert_eq!(c.served_name(), "SmolLM2.Q4_1");
        assert_eq!(c.scheduler().chunk_size, 64);
        assert!(Config::try_parse_from(["x", "--model", "m", "--role", "sideways"]).is_err());
        assert!(
            Config::try_parse_from(["x"]).is_err(),
            "--model is required"
        );
    }

    #[test]
    fn parses_pd_flags_as_the_operator_passes_them() {
        let c = Config::try_parse_from([
            "x",
            "--role",
            "decode",
            "--model",
            "m.gguf",
            "--served-model-name",
            "smol",
            "--port",
            "8000",
            "--kv-port",
            "6000",
            "--prefill",
            "p0.g:6000,p1.g:6000",
            "--probe-period-seconds",
            "1",
            "--failure-threshold",
            "2",
        ])
        .unwrap();
        assert_eq!(c.role, Role::Decode);
        assert_eq!(c.kv_dtype, KvDtype::F16, "the default KV dtype");
        assert_eq!(c.prefill_peers, ["p0.g:6000", "p1.g:6000"]);
        assert_eq!(c.kv_port, 6000);
        let t = c.pd_timings();
        assert_eq!(t.liveness_window(), Duration::from_secs(2));
        // 2 x liveness window (4 s) is below the 10 s bootstrap timeout, which wins.
        assert_eq!(t.session_expiry(), Duration::from_secs(10));
        let short = PdTimings {
            bootstrap_timeout: Duration::from_secs(1),
            ..t
        };
        assert_eq!(short.session_expiry(), Duration::from_secs(4));
    }

    /// A file that starts like a GGUF file, removed on drop.
    struct FakeModel(PathBuf);

    impl FakeModel {
        fn new(name: &str, content: &[u8]) -> Self {
            let p = std::env::temp_dir()
                .join(format!("tandem-config-test-{}-{name}", std::process::id()));
            std::fs::write(&p, content).unwrap();
            Self(p)
        }
        fn path(&self) -> &str {
            self.0.to_str().unwrap()
        }
    }

    impl Drop for FakeModel {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn check_refuses_what_would_fail_at_start_naming_the_setting() {
        let tiny = crate::model::synthetic::TinyLlama::default().to_bytes();
        let gguf = FakeModel::new("ok.gguf", &tiny);
        let text = FakeModel::new("text.gguf", b"hello");
        let check = |args: &[&str]| {
            let mut all = vec!["x"];
            all.extend_from_slice(args);
            Config::try_parse_from(all)
                .unwrap()
                .check()
                .map_err(|e| e.to_string())
        };
        let m = gguf.path();
        check(&["--model", m]).unwrap();
        check(&["--model", m, "--role", "prefill", "--group-key", "k"]).unwrap();
        check(&[
            "--model",
            m,
            "--role",
            "decode",
            "--group-key",
            "k",
            "--prefill",
            "p-0.g.ns.svc:5600,10.0.0.1:1",
        ])
        .unwrap();
        for (args, want) in [
            (
                vec!["--model", m, "--role", "decode", "--prefill", "p:1"],
                "configuration --group-key: role 'decode' needs a group key",
            ),
            (
                vec!["--model", m, "--role", "decode", "--group-key", "k"],
                "configuration --prefill: role decode needs at least one --prefill address",
            ),
            (
                vec![
                    "--model",
                    m,
                    "--role",
                    "decode",
                    "--group-key",
                    "k",
                    "--prefill",
                    "p",
                ],
                "configuration --prefill: \"p\": expected host:port",
            ),
            (
                vec![
                    "--model",
                    m,
                    "--role",
                    "decode",
                    "--group-key",
                    "k",
                    "--prefill",
                    "p:0",
                ],
                "configuration --prefill: \"p:0\": the port must be a number from 1 to 65535",
            ),
            (
                vec![
                    "--model",
                    m,
                    "--role",
                    "decode",
                    "--group-key",
                    "k",
                    "--prefill",
                    ":5600",
                ],
                "configuration --prefill: \":5600\": expected host:port with a host name or address",
            ),
            (
                vec!["--model", "/nonexistent/m.gguf"],
                "I/O error on /nonexistent/m.gguf: No such file or directory",
            ),
            (vec!["--model", text.path()], "is not a GGUF file"),
            (
                vec!["--model", m, "--fault-injection"],
                "configuration --fault-injection: for tests only",
            ),
        ] {
            let e = check(&args).expect_err(&format!("{args:?} must be refused"));
            assert!(e.contains(want), "{args:?}: {e}");
        }
        if !cfg!(feature = "cuda") {
            let e = check(&["--model", m, "--device", "cuda"]).unwrap_err();
            assert!(e.contains("built without CUDA support"), "{e}");
        }
    }

    #[test]
    fn the_effective_configuration_has_every_setting_and_no_key() {
        let c = Config::try_parse_from([
            "x",
            "--model",
            "/m/SmolLM2.Q4_1.gguf",
            "--role",
            "decode",
            "--prefill",
            "a:1,b:2",
            "--group-key",
            "s3cret",
            "--kv-dtype",
            "q8_0",
            "--probe-period-seconds",
            "0.5",
            "--failure-threshold",
            "4",
            "--device",
            "cuda:1",
        ])
        .unwrap();
        let v = c.effective();
        let cfg = &v["config"];
        assert_eq!(cfg["role"], "decode");
        assert_eq!(cfg["model"], "/m/SmolLM2.Q4_1.gguf");
        assert_eq!(cfg["prefill_peers"], json!(["a:1", "b:2"]));
        assert_eq!(cfg["kv_dtype"], "q8_0");
        assert_eq!(cfg["device"], "cuda:1");
        assert_eq!(cfg["port"], 8000);
        assert_eq!(cfg["group_key"], "<redacted: 6 bytes>");
        assert!(!v.to_string().contains("s3cret"), "{v}");
        assert!(cfg.get("check_config").is_none());
        assert_eq!(v["derived"]["served_model_name"], "SmolLM2.Q4_1");
        assert_eq!(v["derived"]["liveness_window_seconds"], 2.0);
        // Every flag is there: one key per argument clap knows, less `--check-config`.
        use clap::CommandFactory;
        let flags = Config::command()
            .get_arguments()
            .filter(|a| a.get_long().is_some_and(|l| l != "check-config"))
            .count();
        assert_eq!(cfg.as_object().unwrap().len(), flags, "{cfg}");
    }

    #[test]
    fn bad_numbers_are_rejected_by_name_not_clamped() {
        let err = |flag: &str, value: &str| {
            // `--flag=value`, so that a negative number is not taken for a flag.
            Config::try_parse_from(["x", "--model", "m.gguf", &format!("{flag}={value}")])
                .expect_err(&format!("{flag} {value} must be refused"))
                .to_string()
        };
        for (flag, value) in [
            ("--max-batch", "0"),
            ("--kv-blocks", "0"),
            ("--chunk-size", "0"),
            ("--max-waiting", "0"),
            ("--default-max-tokens", "0"),
            ("--failure-threshold", "0"),
            ("--probe-period-seconds", "0"),
            ("--kv-timeout-seconds", "-1"),
            ("--bootstrap-timeout-seconds", "NaN"),
            ("--queue-timeout-seconds", "inf"),
            ("--engine-stall-seconds", "soon"),
            ("--drain-seconds", "-0.5"),
        ] {
            let e = err(flag, value);
            assert!(e.contains(flag), "the error names {flag}: {e}");
        }
        let c = Config::try_parse_from([
            "x",
            "--model",
            "m.gguf",
            "--drain-seconds",
            "0",
            "--probe-period-seconds",
            "0.25",
        ])
        .unwrap();
        assert_eq!(c.drain(), Duration::ZERO);
        assert_eq!(c.pd_timings().probe_period, Duration::from_millis(250));
    }

    #[test]
    fn device_is_parsed_in_one_place() {
        let dev = |v: &str| Config::try_parse_from(["x", "--model", "m.gguf", "--device", v]);
        assert_eq!(dev("cpu").unwrap().device, Device::Cpu);
        assert_eq!(dev("cuda").unwrap().device, Device::Cuda(0));
        assert_eq!(dev("cuda:3").unwrap().device, Device::Cuda(3));
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        for bad in ["gpu", "cuda:x", "cuda:", "tpu"] {
            let err = dev(bad).unwrap_err().to_string();
            assert!(
                err.contains("--device") && err.contains("use cpu, cuda or cuda:N"),
                "{bad}: {err}"
            );
        }
        let c = Config::try_parse_from(["x", "--model", "m.gguf"]).unwrap();
        assert_eq!(c.device, Device::Cpu, "the default");
    }

    #[test]
    fn backend_knobs_are_flags_passed_down() {
        let c = Config::try_parse_from(["x", "--model", "m.gguf"]).unwrap();
        assert_eq!(c.cpu_options(), CpuOptions::default());
        assert!(
            c.cuda_sampling && !c.cuda_graphs,
            "graphs off until checked on a GPU"
        );
        let c = Config::try_parse_from([
            "x",
            "--model",
            "m.gguf",
            "--threads",
            "3",
            "--no-simd",
            "--cuda-sampling",
            "off",
            "--cuda-graphs",
            "on",
        ])
        .unwrap();
        assert_eq!(
            c.cpu_options(),
            CpuOptions {
                threads: Some(3),
                simd: false
            }
        );
        assert!(!c.cuda_sampling && c.cuda_graphs);
        for (flag, value) in [
            ("--threads", "0"),
            ("--threads", "many"),
            ("--cuda-graphs", "maybe"),
            ("--cuda-sampling", "2"),
        ] {
            let err = Config::try_parse_from(["x", "--model", "m.gguf", flag, value])
                .unwrap_err()
                .to_string();
            assert!(err.contains(flag) && err.contains(value), "{err}");
        }
        assert_eq!(on_off(" Yes "), Ok(true));
        assert_eq!(on_off("0"), Ok(false));
    }

    #[test]
    fn kv_dtype_is_chosen_by_flag_and_bad_values_are_named() {
        let c = Config::try_parse_from(["x", "--model", "m.gguf", "--kv-dtype", "q8_0"]).unwrap();
        assert_eq!(c.kv_dtype, KvDtype::Q8_0);
        assert_eq!(c.kv_dtype.ggml(), tandem_kernels::GgmlType::Q8_0);
        let err = Config::try_parse_from(["x", "--model", "m.gguf", "--kv-dtype", "q4"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--kv-dtype") && err.contains("q4"), "{err}");
        assert!(
            err.contains("q8_0"),
            "the error lists the valid values: {err}"
        );
    }

    #[test]
    fn the_prefix_cache_is_on_unless_turned_off() {
        let parse = |args: &[&str]| {
            let mut v = vec!["x", "--model", "m.gguf"];
            v.extend_from_slice(args);
            Config::try_parse_from(v).unwrap().no_prefix_cache
        };
        assert!(!parse(&[]));
        assert!(parse(&["--no-prefix-cache"]));
    }
}
