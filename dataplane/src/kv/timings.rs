//! The protocol's timings: how often a decode probes, how much silence makes a peer
//! down, and the no-progress limits of handshakes and rooms. Both sides' sessions read
//! them; the configuration makes them from its flags.

use std::time::Duration;

/// The protocol's timings (from `--probe-period-seconds`, `--failure-threshold`,
/// `--bootstrap-timeout-seconds` and `--kv-timeout-seconds`).
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
