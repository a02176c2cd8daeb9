//! The protocol's timings: how often a decode probes, how much silence makes a peer
//! down, and the no-progress limits of handshakes and rooms. Both sides' sessions read
//! them; the configuration makes them from its flags.

use std::time::Duration;

/// Shortest channel heartbeat: the loops poll every 10 ms, so a shorter one would only
/// send PINGs that the prefill answers in the same breath.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(20);

/// The protocol's timings (from `--probe-period-seconds`, `--failure-threshold`,
/// `--bootstrap-timeout-seconds`, `--kv-timeout-seconds` and `--channel-deadline-ms`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdTimings {
    pub probe_period: Duration,
    pub failure_threshold: u32,
    pub bootstrap_timeout: Duration,
    pub kv_timeout: Duration,
    /// Decode: longest an established prefill may leave a PING unanswered (no message of
    /// any kind since the PING went out) before the session ends as `peer_unresponsive`:
    /// its rooms fail at once and new requests are refused until a new handshake. It is
    /// the channel's own deadline, independent of the kubelet's probe period.
    pub channel_deadline: Duration,
}

impl PdTimings {
    /// How long without a PONG before a peer counts as down.
    pub fn liveness_window(&self) -> Duration {
        self.probe_period * self.failure_threshold.max(1)
    }

    /// Decode: how often an established session PINGs: a quarter of the channel deadline
    /// (so a deadline is four missed PINGs, not one late one), never less often than the
    /// probe period and never more often than [`MIN_HEARTBEAT`]. A silent prefill is seen
    /// between one deadline and one deadline plus one heartbeat after its last message.
    pub fn channel_heartbeat(&self) -> Duration {
        (self.channel_deadline / 4)
            .min(self.probe_period)
            .max(MIN_HEARTBEAT)
    }

    /// Prefill: how long a decode session may stay silent (no message at all, PING
    /// included) before the prefill drops it and fails its rooms: twice the decode's own
    /// liveness window (a live decode PINGs every heartbeat, which is at most a probe
    /// period), and never less than the bootstrap timeout. Not tied to the channel
    /// deadline: the prefill has nothing to gain from dropping a decode early (its rooms
    /// are failed by the decode, which pushes FAILED), and a short expiry would turn a
    /// decode's own pause (a stall, a stop) into lost rooms.
    pub fn session_expiry(&self) -> Duration {
        (self.liveness_window() * 2).max(self.bootstrap_timeout)
    }
}
