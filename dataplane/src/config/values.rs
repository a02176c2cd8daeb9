//! The value types and parsers of the dataplane's flags: devices, roles, KV storage types,
//! durations in seconds, counts, on/off switches, KV endpoints, the model file.

use std::str::FromStr;
use std::time::Duration;

use clap::ValueEnum;
use serde::Serialize;

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

/// The group key is a secret: `--check-config` says only whether one is set.
pub(super) fn redacted<S: serde::Serializer>(key: &str, s: S) -> Result<S::Ok, S::Error> {
    if key.is_empty() {
        s.serialize_str("")
    } else {
        s.collect_str(&format_args!("<redacted: {} bytes>", key.len()))
    }
}

/// A KV endpoint as `--prefill` takes it: `host:port`, port 1-65535.
pub(super) fn check_peer(peer: &str) -> crate::Result<()> {
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
pub(super) fn check_model_file(path: &std::path::Path) -> crate::Result<()> {
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
pub(super) fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO)
}

/// Longest duration a flag may name: a year, so that `Instant + d` never overflows.
pub(super) const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;

pub(super) fn parse_seconds(s: &str) -> Result<f64, String> {
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
pub(super) fn positive_seconds(s: &str) -> Result<f64, String> {
    let v = parse_seconds(s)?;
    if v <= 0.0 {
        return Err(format!("{s:?}: must be greater than 0 seconds"));
    }
    Ok(v)
}

/// A duration in seconds that may be zero (a drain deadline of 0 exits at once).
pub(super) fn non_negative_seconds(s: &str) -> Result<f64, String> {
    let v = parse_seconds(s)?;
    if v < 0.0 {
        return Err(format!("{s:?}: must not be negative"));
    }
    Ok(v)
}

/// An on/off switch: 1/on/true/yes or 0/off/false/no.
pub(super) fn on_off(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "true" | "yes" => Ok(true),
        "0" | "off" | "false" | "no" => Ok(false),
        _ => Err(format!(
            "{s:?}: expected on or off (1/on/true/yes, 0/off/false/no)"
        )),
    }
}

/// A count that must be at least 1 (batch sizes, queue lengths, cache blocks).
pub(super) fn at_least_one(s: &str) -> Result<usize, String> {
    let v: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a whole number"))?;
    if v == 0 {
        return Err(format!("{s:?}: must be at least 1"));
    }
    Ok(v)
}
