//! Command-line and environment configuration of the dataplane binary: every setting is
//! a flag with an environment variable (`TANDEM_<NAME>`), parsed and checked here, and
//! passed down as plain values; nothing below reads the environment.
//!
//! The flags are grouped by the subsystem they configure ([`ModelFlags`],
//! [`EngineFlags`], [`HttpFlags`], [`KvFlags`]; `--help` shows the same groups); on the
//! command line they are one flat list, as before. The settings the operator gives every
//! member are named by `tandem_contract::settings`, the contract both sides compile
//! against; [`Config::member_settings`] reads them back.
//!
//! A renamed flag keeps its old spelling (and its variable's) for one release, hidden from
//! `--help`, with a deprecation warning ([`RENAMED`], [`Config::parse_with_deprecations`]).
//!
//! [`Config::check`] is every check that needs no model loaded (combinations of flags,
//! the model file being a readable GGUF file); `--check-config` runs it and prints
//! [`Config::effective`] instead of serving.

mod values;

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args, Parser};
use serde::Serialize;
use serde_json::{Value, json};
use tandem_contract::api_keys;
use tandem_contract::settings as contract;
use tandem_contract::{MemberRole, MemberSettings};
use tandem_kernels::CpuOptions;

use crate::pd::{PdLimits, PdTimings};
use crate::scheduler::SchedulerConfig;
pub use values::{Device, KvDtype, LogFormat, Role};
use values::{
    at_least_one, check_model_file, check_peer, non_negative_seconds, on_off, positive_seconds,
    redacted, secs,
};

#[derive(Debug, Clone, Parser, Serialize)]
#[command(
    name = "tandem-dataplane",
    version,
    about = "Tandem dataplane: OpenAI-compatible LLM serving"
)]
pub struct Config {
    #[arg(long = contract::ROLE.flag, env = contract::ROLE.env, value_enum, default_value = "both")]
    pub role: Role,
    #[command(flatten)]
    #[serde(flatten)]
    pub model: ModelFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub engine: EngineFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub http: HttpFlags,
    #[command(flatten)]
    #[serde(flatten)]
    pub kv: KvFlags,
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
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

/// The model and the device that runs it.
#[derive(Debug, Clone, Args, Serialize)]
#[command(next_help_heading = "Model and device")]
pub struct ModelFlags {
    /// GGUF model file.
    #[arg(long = contract::MODEL.flag, env = contract::MODEL.env)]
    #[serde(rename = "model")]
    pub path: PathBuf,
    /// Name clients use in `model`; defaults to the model file name without `.gguf`.
    #[arg(long = contract::SERVED_MODEL_NAME.flag, env = contract::SERVED_MODEL_NAME.env)]
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
}

/// The engine: KV cache, batching, admission.
#[derive(Debug, Clone, Args, Serialize)]
#[command(next_help_heading = "Engine")]
pub struct EngineFlags {
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
    /// `/ready` fails when the engine loop is stuck this long.
    #[arg(long, env = "TANDEM_ENGINE_STALL_SECONDS", default_value_t = 10.0, value_parser = positive_seconds)]
    pub engine_stall_seconds: f64,
    /// `/ready` fails `no_progress` when requests are queued or running and no engine step
    /// succeeds (a failed step is no progress), or KV bytes are in flight and none move,
    /// for this long; an idle process stays ready. 0 turns the check off. The default is
    /// three times the engine-stall limit: one slow step (a long prompt's chunk under a
    /// CPU limit) already shows as `engine_stalled` after 10 s, so this one is for an
    /// engine that goes round without getting anywhere.
    #[arg(long = contract::NO_PROGRESS_SECONDS.flag, env = contract::NO_PROGRESS_SECONDS.env, default_value_t = 30, value_parser = clap::value_parser!(u32).range(0..=86_400))]
    pub no_progress_seconds: u32,
}

/// The HTTP server: where it listens, what it accepts, how it drains.
#[derive(Debug, Clone, Args, Serialize)]
#[command(next_help_heading = "HTTP server")]
pub struct HttpFlags {
    #[arg(long = contract::HOST.flag, env = contract::HOST.env, default_value = "0.0.0.0")]
    pub host: String,
    #[arg(long = contract::PORT.flag, env = contract::PORT.env, default_value_t = 8000)]
    pub port: u16,
    /// max_tokens for requests that set none.
    #[arg(long, env = "TANDEM_DEFAULT_MAX_TOKENS", default_value_t = 256, value_parser = at_least_one)]
    pub default_max_tokens: usize,
    /// On SIGTERM, how long in-flight requests may run before the process exits anyway.
    #[arg(long, env = "TANDEM_DRAIN_SECONDS", default_value_t = 30.0, value_parser = non_negative_seconds)]
    pub drain_seconds: f64,
    /// Seconds a client may take to send a request head (the line and headers) once it
    /// has sent its first byte; then it gets 408 and the connection is closed, counted as
    /// `tandem_http_connection_errors_total{kind="timeout"}`.
    #[arg(long, env = "TANDEM_HTTP_HEADER_TIMEOUT_SECONDS", default_value_t = 10.0, value_parser = positive_seconds)]
    pub http_header_timeout_seconds: f64,
    /// Seconds a connection may stay open without a request (before its first, and between
    /// keep-alive requests); then it is closed, counted as `kind="idle_timeout"`.
    #[arg(long, env = "TANDEM_HTTP_IDLE_TIMEOUT_SECONDS", default_value_t = 60.0, value_parser = positive_seconds)]
    pub http_idle_timeout_seconds: f64,
    /// Largest request body, in bytes; a larger one gets 413.
    #[arg(long, env = "TANDEM_HTTP_MAX_BODY_BYTES", default_value_t = 8 << 20, value_parser = at_least_one)]
    pub http_max_body_bytes: usize,
    /// Largest request head (request line and headers), in bytes; a larger one gets 431.
    #[arg(long, env = "TANDEM_HTTP_MAX_HEADER_BYTES", default_value_t = 64 << 10, value_parser = at_least_one)]
    pub http_max_header_bytes: usize,
    /// Most headers in one request; more get 431.
    #[arg(long, env = "TANDEM_HTTP_MAX_HEADERS", default_value_t = 100, value_parser = at_least_one)]
    pub http_max_headers: usize,
    /// A key clients must send as `Authorization: Bearer <key>` on `/v1/*` and `/tandem/*`
    /// (401 without it); `/health`, `/ready` and `/metrics` stay open. Prefer the variable
    /// or the file: a command line is visible to every user of the machine.
    #[arg(long = api_keys::API_KEY.flag, env = api_keys::API_KEY.env, hide_env_values = true)]
    #[serde(serialize_with = "redacted_key")]
    pub api_key: Option<String>,
    /// A file of keys accepted like `--api-key`: one a line, blank lines and `#` comments
    /// skipped.
    #[arg(long = api_keys::API_KEY_FILE.flag, env = api_keys::API_KEY_FILE.env)]
    pub api_key_file: Option<PathBuf>,
}

fn redacted_key<S: serde::Serializer>(key: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    redacted(key.as_deref().unwrap_or(""), s)
}

/// The KV transfer channel between a group's prefill and decode members.
#[derive(Debug, Clone, Args, Serialize)]
#[command(next_help_heading = "KV transfer (prefill and decode roles)")]
pub struct KvFlags {
    /// Prefill: TCP port of the KV transfer ROUTER socket.
    #[arg(long = contract::KV_PORT.flag, env = contract::KV_PORT.env, default_value_t = 5600)]
    pub kv_port: u16,
    /// Decode: prefill KV endpoints (`host:port`), comma separated.
    #[arg(long = contract::PREFILL.flag, env = contract::PREFILL.env, value_delimiter = ',')]
    pub prefill_peers: Vec<String>,
    /// Incarnation of the bootstrap group (from the operator); peers must agree.
    #[arg(long = contract::GROUP_INCARNATION.flag, env = contract::GROUP_INCARNATION.env, default_value_t = 0)]
    pub group_incarnation: u64,
    /// Shared secret of the group for the handshake (required for prefill and decode).
    #[arg(
        long = contract::GROUP_KEY.flag,
        env = contract::GROUP_KEY.env,
        hide_env_values = true,
        default_value = ""
    )]
    #[serde(serialize_with = "redacted")]
    pub group_key: String,
    /// Decode: seconds between PINGs to each prefill.
    #[arg(long = contract::PROBE_PERIOD_SECONDS.flag, env = contract::PROBE_PERIOD_SECONDS.env, default_value_t = 2.0, value_parser = positive_seconds)]
    pub probe_period_seconds: f64,
    /// Decode: missed probe periods before `/ready` fails.
    #[arg(long = contract::FAILURE_THRESHOLD.flag, env = contract::FAILURE_THRESHOLD.env, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub failure_threshold: u32,
    /// No-progress limit of handshakes, rooms waiting for a session, and abort acks.
    #[arg(long = contract::BOOTSTRAP_TIMEOUT_SECONDS.flag, env = contract::BOOTSTRAP_TIMEOUT_SECONDS.env, default_value_t = 10.0, value_parser = positive_seconds)]
    pub bootstrap_timeout_seconds: f64,
    /// No-progress limit of rooms waiting for or receiving KV (the prefill's PROGRESS
    /// keeps a room alive while its engine works, so this measures silence).
    #[arg(long = contract::KV_TIMEOUT_SECONDS.flag, env = contract::KV_TIMEOUT_SECONDS.env, default_value_t = 30.0, value_parser = positive_seconds)]
    pub kv_timeout_seconds: f64,
    /// Decode: longest a prefill may leave a PING unanswered (no message of any kind)
    /// before the session ends: its rooms fail `peer_unresponsive` at once and new requests
    /// are refused until a new handshake. PINGs go every quarter of it (at most every probe
    /// period), so a stopped prefill is seen within 1 to 1.25 deadlines.
    #[arg(long = contract::CHANNEL_DEADLINE_MS.flag, env = contract::CHANNEL_DEADLINE_MS.env, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(50..=3_600_000))]
    pub channel_deadline_ms: u32,
    /// Most KV bytes in flight to one peer (sent, not yet acknowledged), in MiB; a room past
    /// it fails at once with `send_budget`.
    #[arg(long, env = "TANDEM_KV_SEND_BUDGET_MIB", default_value_t = 256, value_parser = at_least_one)]
    pub kv_send_budget_mib: usize,
}

/// A flag the dataplane was renamed away from, still accepted (hidden) with a warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renamed {
    pub old_flag: &'static str,
    pub old_env: &'static str,
    pub new_flag: &'static str,
    pub new_env: &'static str,
}

/// The release that stops accepting the spellings of [`RENAMED`].
pub const RENAMED_REMOVED_IN: &str = "0.2.0";

/// Flags renamed in 0.1 (`*_secs` became `*_seconds`): the old spelling of the flag and
/// of its variable still work until [`RENAMED_REMOVED_IN`], with a warning.
pub const RENAMED: &[Renamed] = &[
    Renamed {
        old_flag: "drain-secs",
        old_env: "TANDEM_DRAIN_SECS",
        new_flag: "drain-seconds",
        new_env: "TANDEM_DRAIN_SECONDS",
    },
    Renamed {
        old_flag: "queue-timeout-secs",
        old_env: "TANDEM_QUEUE_TIMEOUT_SECS",
        new_flag: "queue-timeout-seconds",
        new_env: "TANDEM_QUEUE_TIMEOUT_SECONDS",
    },
    Renamed {
        old_flag: "engine-stall-secs",
        old_env: "TANDEM_ENGINE_STALL_SECS",
        new_flag: "engine-stall-seconds",
        new_env: "TANDEM_ENGINE_STALL_SECONDS",
    },
    Renamed {
        old_flag: "http-header-timeout-secs",
        old_env: "TANDEM_HTTP_HEADER_TIMEOUT_SECS",
        new_flag: "http-header-timeout-seconds",
        new_env: "TANDEM_HTTP_HEADER_TIMEOUT_SECONDS",
    },
];

impl Config {
    /// Parse a command line as [`Parser::try_parse_from`] does, accepting the old
    /// spellings of [`RENAMED`]: an old flag is read as the new one, an old variable is
    /// used when neither the new flag nor the new variable is given. Returns the
    /// configuration and one deprecation warning per old spelling used. `env` reads the
    /// environment (`std::env::var_os`, or a map in tests).
    pub fn parse_with_deprecations<I, T>(
        args: I,
        env: impl Fn(&str) -> Option<OsString>,
    ) -> Result<(Config, Vec<String>), clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString>,
    {
        let mut warnings = Vec::new();
        let mut out: Vec<OsString> = Vec::new();
        let mut given = std::collections::HashSet::new();
        for a in args {
            let a: OsString = a.into();
            let text = a.to_string_lossy().into_owned();
            let renamed = RENAMED.iter().find_map(|r| {
                let old = format!("--{}", r.old_flag);
                let rest = text.strip_prefix(&old)?;
                (rest.is_empty() || rest.starts_with('=')).then(|| (r, rest.to_string()))
            });
            match renamed {
                Some((r, rest)) => {
                    warnings.push(format!(
                        "--{} is deprecated and will be removed in {RENAMED_REMOVED_IN}: use --{}",
                        r.old_flag, r.new_flag
                    ));
                    given.insert(r.new_flag);
                    out.push(format!("--{}{rest}", r.new_flag).into());
                }
                None => {
                    if let Some(r) = RENAMED.iter().find(|r| {
                        let new = format!("--{}", r.new_flag);
                        text.strip_prefix(&new)
                            .is_some_and(|rest| rest.is_empty() || rest.starts_with('='))
                    }) {
                        given.insert(r.new_flag);
                    }
                    out.push(a);
                }
            }
        }
        for r in RENAMED {
            let Some(v) = env(r.old_env) else { continue };
            if given.contains(r.new_flag) || env(r.new_env).is_some() {
                warnings.push(format!(
                    "{} is deprecated and ignored (--{} or {} is set); it will be removed in {RENAMED_REMOVED_IN}",
                    r.old_env, r.new_flag, r.new_env
                ));
                continue;
            }
            warnings.push(format!(
                "{} is deprecated and will be removed in {RENAMED_REMOVED_IN}: use {}",
                r.old_env, r.new_env
            ));
            let mut arg = OsString::from(format!("--{}=", r.new_flag));
            arg.push(v);
            out.push(arg);
        }
        Ok((Config::try_parse_from(out)?, warnings))
    }

    /// Every check that needs no model loaded: what `--check-config` runs, and what the
    /// server runs before loading the model.
    pub fn check(&self) -> crate::Result<()> {
        if self.role != Role::Both && self.kv.group_key.is_empty() {
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
        if matches!(self.model.device, Device::Cuda(_)) && !cfg!(feature = "cuda") {
            return Err(crate::Error::config(
                format!("--device {}", self.model.device),
                "this binary was built without CUDA support (build with `--features cuda`); \
                 use --device cpu",
            ));
        }
        if self.role == Role::Decode {
            if self.kv.prefill_peers.is_empty() {
                return Err(crate::Error::config(
                    "--prefill",
                    "role decode needs at least one --prefill address",
                ));
            }
            for peer in &self.kv.prefill_peers {
                check_peer(peer)?;
            }
        }
        if let Some(t) = &self.model.chat_template {
            crate::chat::read_template_file(t)?;
        }
        self.api_keys()?;
        check_model_file(&self.model.path)
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
                "channel_heartbeat_seconds": t.channel_heartbeat().as_secs_f64(),
                "kv_send_budget_bytes": self.pd_limits().send_budget,
            },
        })
    }

    /// What the operator told this member, read back (the contract's parse side; the
    /// render side is [`MemberSettings::to_args`]). `Err` names what is not a member's
    /// setting: role `both`, or a duration that is not a whole number of seconds.
    pub fn member_settings(&self) -> Result<MemberSettings, String> {
        let role = match self.role {
            Role::Prefill => MemberRole::Prefill,
            Role::Decode => MemberRole::Decode,
            Role::Both => return Err("role both is not a group member".into()),
        };
        let whole = |flag: &str, s: f64| -> Result<u32, String> {
            if s.fract() == 0.0 && (1.0..=f64::from(u32::MAX)).contains(&s) {
                Ok(s as u32)
            } else {
                Err(format!("--{flag} {s} is not a whole number of seconds"))
            }
        };
        let kv = &self.kv;
        Ok(MemberSettings {
            role,
            model: self.model.path.to_string_lossy().into_owned(),
            served_model_name: self.served_name(),
            host: (self.http.host != "0.0.0.0").then(|| self.http.host.clone()),
            port: self.http.port,
            kv_port: kv.kv_port,
            prefill_peers: kv.prefill_peers.clone(),
            group_incarnation: kv.group_incarnation,
            probe_period_seconds: whole(
                contract::PROBE_PERIOD_SECONDS.flag,
                kv.probe_period_seconds,
            )?,
            failure_threshold: kv.failure_threshold,
            bootstrap_timeout_seconds: whole(
                contract::BOOTSTRAP_TIMEOUT_SECONDS.flag,
                kv.bootstrap_timeout_seconds,
            )?,
            kv_timeout_seconds: whole(contract::KV_TIMEOUT_SECONDS.flag, kv.kv_timeout_seconds)?,
            channel_deadline_ms: kv.channel_deadline_ms,
            no_progress_seconds: self.engine.no_progress_seconds,
        })
    }

    pub fn scheduler(&self) -> SchedulerConfig {
        let e = &self.engine;
        SchedulerConfig {
            max_batch: e.max_batch,
            chunk_size: e.chunk_size,
            max_waiting: e.max_waiting,
            queue_timeout: secs(e.queue_timeout_seconds),
            ..SchedulerConfig::default()
        }
    }

    pub fn cpu_options(&self) -> CpuOptions {
        CpuOptions {
            threads: self.model.threads,
            simd: !self.model.no_simd,
        }
    }

    #[cfg(feature = "cuda")]
    pub fn cuda_options(&self) -> crate::model::cuda::CudaOptions {
        crate::model::cuda::CudaOptions {
            device_sampling: self.model.cuda_sampling,
            graphs: self.model.cuda_graphs,
        }
    }

    pub fn served_name(&self) -> String {
        self.model.served_model_name.clone().unwrap_or_else(|| {
            let f = self
                .model
                .path
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            f.strip_suffix(".gguf").map(str::to_owned).unwrap_or(f)
        })
    }

    pub fn http_limits(&self) -> crate::server::HttpLimits {
        let h = &self.http;
        crate::server::HttpLimits {
            header_timeout: secs(h.http_header_timeout_seconds),
            idle_timeout: secs(h.http_idle_timeout_seconds),
            max_body_bytes: h.http_max_body_bytes,
            max_header_bytes: h.http_max_header_bytes,
            max_headers: h.http_max_headers,
        }
    }

    /// The API keys of `--api-key` and `--api-key-file` (none: the API is open).
    pub fn api_keys(&self) -> crate::Result<api_keys::ApiKeys> {
        let h = &self.http;
        api_keys::ApiKeys::load(h.api_key.as_deref(), h.api_key_file.as_deref()).map_err(|e| {
            let flag = if h.api_key_file.is_some() {
                format!("--{}", api_keys::API_KEY_FILE.flag)
            } else {
                format!("--{}", api_keys::API_KEY.flag)
            };
            crate::Error::config(flag, e.to_string())
        })
    }

    pub fn drain(&self) -> Duration {
        secs(self.http.drain_seconds)
    }

    pub fn engine_stall(&self) -> Duration {
        secs(self.engine.engine_stall_seconds)
    }

    pub fn no_progress(&self) -> Duration {
        Duration::from_secs(u64::from(self.engine.no_progress_seconds))
    }

    pub fn pd_limits(&self) -> PdLimits {
        PdLimits {
            send_budget: (self.kv.kv_send_budget_mib as u64) << 20,
            engine_stall: self.engine_stall(),
        }
    }

    pub fn pd_timings(&self) -> PdTimings {
        let kv = &self.kv;
        PdTimings {
            probe_period: secs(kv.probe_period_seconds),
            failure_threshold: kv.failure_threshold,
            bootstrap_timeout: secs(kv.bootstrap_timeout_seconds),
            kv_timeout: secs(kv.kv_timeout_seconds),
            channel_deadline: Duration::from_millis(u64::from(kv.channel_deadline_ms)),
        }
    }
}

#[cfg(test)]
mod tests;
