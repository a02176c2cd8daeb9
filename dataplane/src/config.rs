//! Command-line and environment configuration of the dataplane binary.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::scheduler::SchedulerConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Parser)]
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
    #[arg(long, env = "TANDEM_HOST", default_value = "0.0.0.0")]
    pub host: String,
    #[arg(long, env = "TANDEM_PORT", default_value_t = 8000)]
    pub port: u16,
    /// KV cache blocks (16 tokens each).
    #[arg(long, env = "TANDEM_KV_BLOCKS", default_value_t = 2048)]
    pub kv_blocks: usize,
    /// Most prompt tokens prefilled per engine step.
    #[arg(long, env = "TANDEM_CHUNK_SIZE", default_value_t = 256)]
    pub chunk_size: usize,
    /// Most sequences in the running batch.
    #[arg(long, env = "TANDEM_MAX_BATCH", default_value_t = 16)]
    pub max_batch: usize,
    /// Most requests waiting for admission; more get 503.
    #[arg(long, env = "TANDEM_MAX_WAITING", default_value_t = 256)]
    pub max_waiting: usize,
    /// Seconds a request may wait for KV memory before failing with 503.
    #[arg(long, env = "TANDEM_QUEUE_TIMEOUT_SECS", default_value_t = 30.0)]
    pub queue_timeout_secs: f64,
    /// max_tokens for requests that set none.
    #[arg(long, env = "TANDEM_DEFAULT_MAX_TOKENS", default_value_t = 256)]
    pub default_max_tokens: usize,
    /// `/ready` fails when the engine loop is stuck this long.
    #[arg(long, env = "TANDEM_ENGINE_STALL_SECS", default_value_t = 10.0)]
    pub engine_stall_secs: f64,
    /// On SIGTERM, how long in-flight requests may run before the process exits anyway.
    #[arg(long, env = "TANDEM_DRAIN_SECS", default_value_t = 30.0)]
    pub drain_secs: f64,
    #[arg(long, env = "TANDEM_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

impl Config {
    pub fn scheduler(&self) -> SchedulerConfig {
        SchedulerConfig {
            max_batch: self.max_batch.max(1),
            chunk_size: self.chunk_size.max(1),
            max_waiting: self.max_waiting.max(1),
            queue_timeout: secs(self.queue_timeout_secs),
            ..SchedulerConfig::default()
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

    pub fn drain(&self) -> Duration {
        secs(self.drain_secs)
    }

    pub fn engine_stall(&self) -> Duration {
        secs(self.engine_stall_secs)
    }
}

/// Negative or NaN durations from the command line become zero.
fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::ZERO)
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
}
