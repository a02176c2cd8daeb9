//! The contract between the operator and the dataplane: what the operator tells every
//! member it starts, as one type.
//!
//! The operator (both executors: a pod's container, a local process) renders a
//! [`MemberSettings`] to a command line with [`MemberSettings::to_args`] and gives the
//! group key through [`GROUP_KEY_ENV`] (from the group's Secret: a key never appears on a
//! command line). The dataplane declares each of these flags with the names in
//! [`settings`] (its clap attributes name these constants, so a rename here renames both
//! sides) and reads them back with `Config::member_settings`; a round-trip test in the
//! dataplane holds `parse(to_args(s)) == s` for every `s`.
//!
//! Each value goes through exactly one channel: everything on the command line except the
//! key, which is only in the environment. The dataplane still accepts every flag from its
//! `TANDEM_*` variable (for people running it by hand); the operator never sets those.
//!
//! No dependencies: both the operator and the dataplane link this crate, and neither
//! needs the other's.

#![forbid(unsafe_code)]

pub mod api_keys;
pub mod routing;

/// The variable that carries the group key (hex) into the dataplane.
pub const GROUP_KEY_ENV: &str = "TANDEM_GROUP_KEY";

/// One setting of the dataplane: its flag (without `--`) and its variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    pub flag: &'static str,
    pub env: &'static str,
}

impl Setting {
    /// `--<flag>`.
    pub fn long(self) -> String {
        format!("--{}", self.flag)
    }
}

/// The settings the operator gives; the dataplane's flags of the same names.
pub mod settings {
    use super::Setting;

    macro_rules! settings {
        ($($(#[$m:meta])* $name:ident = $flag:literal, $env:literal;)*) => {
            $($(#[$m])* pub const $name: Setting = Setting { flag: $flag, env: $env };)*
            /// Every setting the operator gives, in the order [`super::MemberSettings::to_args`]
            /// renders them (the group key last: it is given through the environment).
            pub const ALL: &[Setting] = &[$($name,)*];
        };
    }

    settings! {
        /// `prefill` or `decode`.
        ROLE = "role", "TANDEM_ROLE";
        /// Path of the GGUF file inside the pod.
        MODEL = "model", "TANDEM_MODEL";
        /// The name clients send as `model`.
        SERVED_MODEL_NAME = "served-model-name", "TANDEM_SERVED_MODEL_NAME";
        /// Address the HTTP server binds (only the local runtime sets it: loopback).
        HOST = "host", "TANDEM_HOST";
        /// HTTP port (OpenAI API, probes, metrics).
        PORT = "port", "TANDEM_PORT";
        /// The prefill's KV transfer port.
        KV_PORT = "kv-port", "TANDEM_KV_PORT";
        /// A decode's prefill KV endpoints, comma separated, in replica order.
        PREFILL = "prefill", "TANDEM_PREFILL_PEERS";
        /// The group's incarnation; both roles put it in the handshake.
        GROUP_INCARNATION = "group-incarnation", "TANDEM_GROUP_INCARNATION";
        /// The decode's PING period, and the probe period of the pods.
        PROBE_PERIOD_SECONDS = "probe-period-seconds", "TANDEM_PROBE_PERIOD_SECONDS";
        /// Missed probe periods before `/ready` fails.
        FAILURE_THRESHOLD = "failure-threshold", "TANDEM_FAILURE_THRESHOLD";
        /// No-progress limit of handshakes.
        BOOTSTRAP_TIMEOUT_SECONDS = "bootstrap-timeout-seconds", "TANDEM_BOOTSTRAP_TIMEOUT_SECONDS";
        /// No-progress limit of rooms waiting for or receiving KV.
        KV_TIMEOUT_SECONDS = "kv-timeout-seconds", "TANDEM_KV_TIMEOUT_SECONDS";
        /// The decode's channel deadline: longest a prefill may leave a PING unanswered
        /// before its rooms fail `peer_unresponsive` (milliseconds).
        CHANNEL_DEADLINE_MS = "channel-deadline-ms", "TANDEM_CHANNEL_DEADLINE_MS";
        /// `/ready` fails `no_progress` when queued work or KV in flight makes no progress
        /// this long (seconds; 0: off).
        NO_PROGRESS_SECONDS = "no-progress-seconds", "TANDEM_NO_PROGRESS_SECONDS";
        /// The group key; given through [`super::GROUP_KEY_ENV`], never as a flag.
        GROUP_KEY = "group-key", "TANDEM_GROUP_KEY";
    }

    /// Flags on every member's command line that the user's `args` must not repeat (the
    /// dataplane refuses a flag given twice), and `--check-config`, which would make the
    /// member exit instead of serving.
    pub fn reserved() -> Vec<String> {
        ALL.iter()
            .filter(|s| **s != GROUP_KEY)
            .map(|s| s.long())
            .chain(["--check-config".to_string()])
            .collect()
    }
}

/// A member's role (a group's members are never `both`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemberRole {
    Prefill,
    Decode,
}

impl MemberRole {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// Everything the operator tells one member, but the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberSettings {
    pub role: MemberRole,
    pub model: String,
    pub served_model_name: String,
    /// `None`: the dataplane's default (every interface), as in a pod.
    pub host: Option<String>,
    pub port: u16,
    pub kv_port: u16,
    /// A decode's prefill endpoints (`host:port`); empty for a prefill.
    pub prefill_peers: Vec<String>,
    pub group_incarnation: u64,
    pub probe_period_seconds: u32,
    pub failure_threshold: u32,
    pub bootstrap_timeout_seconds: u32,
    pub kv_timeout_seconds: u32,
    pub channel_deadline_ms: u32,
    pub no_progress_seconds: u32,
}

impl MemberSettings {
    /// The command line (without the program name), each setting once as `--flag=value`:
    /// one argument each, so no value can be read as a flag (a model named `--x` stays a
    /// value).
    pub fn to_args(&self) -> Vec<String> {
        use settings::*;
        let mut args = Vec::with_capacity(14);
        let mut put = |s: Setting, v: String| args.push(format!("--{}={v}", s.flag));
        put(ROLE, self.role.as_str().into());
        put(MODEL, self.model.clone());
        put(SERVED_MODEL_NAME, self.served_model_name.clone());
        if let Some(h) = &self.host {
            put(HOST, h.clone());
        }
        put(PORT, self.port.to_string());
        put(KV_PORT, self.kv_port.to_string());
        if self.role == MemberRole::Decode {
            put(PREFILL, self.prefill_peers.join(","));
        }
        put(GROUP_INCARNATION, self.group_incarnation.to_string());
        put(PROBE_PERIOD_SECONDS, self.probe_period_seconds.to_string());
        put(FAILURE_THRESHOLD, self.failure_threshold.to_string());
        put(
            BOOTSTRAP_TIMEOUT_SECONDS,
            self.bootstrap_timeout_seconds.to_string(),
        );
        put(KV_TIMEOUT_SECONDS, self.kv_timeout_seconds.to_string());
        put(CHANNEL_DEADLINE_MS, self.channel_deadline_ms.to_string());
        put(NO_PROGRESS_SECONDS, self.no_progress_seconds.to_string());
        args
    }
}

/// The in-place reset (docs/in-place-reset.md): how an executor asks a live member to end
/// every room, forget its KV session state and serve at the next group incarnation without
/// exiting, so that a group co-restarts in about a second and keeps its weights.
///
/// `POST` [`PATH`] with the JSON body `{"group_incarnation": N, "timeout_ms": T}` and the
/// header `Authorization: Tandem-Reset <proof>`, where the proof is the lowercase hex
/// HMAC-SHA256 of [`proof_message`]`(role, N)` keyed by the bytes of the member's group key
/// (the value of [`super::GROUP_KEY_ENV`] as given). The proof names the incarnation and the
/// role, so a proof seen on the wire only repeats a reset that has already happened (a reset
/// to the incarnation a member already has is answered without doing anything). The key
/// never crosses the wire.
pub mod reset {
    use super::MemberRole;

    /// The path of the reset call on a member's HTTP port.
    pub const PATH: &str = "/admin/reset";
    /// The `Authorization` scheme of the reset call.
    pub const AUTH_SCHEME: &str = "Tandem-Reset";
    /// How long a member waits for its channel at the new incarnation before it answers
    /// 504 `reset_incomplete` (the reset itself stays done), unless the body says otherwise.
    pub const DEFAULT_TIMEOUT_MS: u64 = 5_000;

    /// What the proof of a reset to `group_incarnation` for a member of `role` signs.
    pub fn proof_message(role: MemberRole, group_incarnation: u64) -> String {
        format!("tandem-reset/v1 {} {group_incarnation}", role.as_str())
    }
}

#[cfg(test)]
mod tests;
