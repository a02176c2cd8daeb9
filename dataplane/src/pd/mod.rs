//! PD roles over ZeroMQ. Each side is a handle the rest of the process holds and the loop
//! behind it: the prefill's `PrefillHandle` (`prefill`) and its `RouterLoop` (`router_loop`,
//! one ROUTER socket for every decode); the decode's `DecodeHandle` (`decode`) and one
//! `DealerLoop` per prefill (`dealer_loop`, one DEALER socket each). Both loops are
//! supervised (`supervise`) and share the ZeroMQ plumbing (`wire`). The protocol itself
//! (codec, handshake, rooms) is `crate::kv`.
//!
//! Imports run one way: handle → loop → `supervise` / `wire` / `crate::kv`; a loop never
//! reaches back into its handle.
//!
//! Threads: every socket is owned by exactly one loop thread (ZeroMQ sockets are not
//! thread safe). The engine thread and the HTTP tasks talk to the loops only through
//! bounded channels with non-blocking sends, so no socket I/O ever happens on the engine
//! thread (rule 10), and the health probe (PING/PONG) runs through the very loop and socket
//! that carry KV (rule 5).

mod dealer_loop;
pub mod decode;
pub mod prefill;
pub mod report;
mod router_loop;
mod supervise;
#[cfg(test)]
mod tests;
mod wire;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine_api::ModelInfo;
use crate::kv::KvLayout;
use crate::kv::auth::LocalIdentity;

pub use dealer_loop::RoomFailure;
pub use decode::DecodeHandle;
pub use prefill::PrefillHandle;
pub use report::{PeerReport, Problem};
pub use supervise::{Fault, LoopHealth, supervise};

/// One `/ready` check. `reason` is a stable snake_case label when the check fails
/// (docs/readiness.md lists them), `None` when it passes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub reason: Option<String>,
    pub detail: String,
}

impl Check {
    pub fn new(name: impl Into<String>, ok: bool, fail_reason: &str, detail: String) -> Self {
        Self {
            name: name.into(),
            ok,
            reason: (!ok).then(|| fail_reason.to_owned()),
            detail,
        }
    }
}

/// Settings of the KV channel beyond its timings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdLimits {
    /// Most KV bytes in flight to one peer (sent, not yet acknowledged); see `kv` module
    /// header, "flow control".
    pub send_budget: u64,
    /// Prefill: PROGRESS keep-alives stop when the engine loop has not gone round for this
    /// long (the `/ready` engine-stall limit).
    pub engine_stall: Duration,
}

impl Default for PdLimits {
    fn default() -> Self {
        Self {
            send_budget: 256 << 20,
            engine_stall: Duration::from_secs(10),
        }
    }
}

/// What either side's KV channel is started with.
#[derive(Debug, Clone)]
pub struct ChannelConfig {
    /// What this process claims in the handshake.
    pub local: LocalIdentity,
    pub key: crate::kv::auth::GroupKey,
    pub timings: crate::config::PdTimings,
    pub limits: PdLimits,
}

/// The PD side of a process, for `/ready`, request routing and shutdown.
pub enum PdRole {
    Prefill(PrefillHandle),
    Decode(DecodeHandle),
}

impl PdRole {
    pub fn checks(&self) -> Vec<Check> {
        match self {
            Self::Prefill(p) => p.checks(),
            Self::Decode(d) => d.checks(),
        }
    }

    /// Every KV peer with its state and last refusal and failure.
    pub fn peers(&self) -> Vec<PeerReport> {
        match self {
            Self::Prefill(p) => p.peers(),
            Self::Decode(d) => d.peers(),
        }
    }

    /// The loops, for fault injection.
    pub fn loops(&self) -> Vec<Arc<LoopHealth>> {
        match self {
            Self::Prefill(p) => p.loops(),
            Self::Decode(d) => d.loops(),
        }
    }

    /// SIGTERM: take no new work (a prefill says GOODBYE to its decodes and refuses new
    /// rooms and handshakes); work in flight goes on.
    pub fn drain(&self) {
        match self {
            Self::Prefill(p) => p.drain(),
            Self::Decode(d) => d.drain(),
        }
    }

    /// Whether the KV side has nothing left in flight (a prefill's rooms; a decode's rooms
    /// belong to HTTP requests, which the server waits for).
    pub fn is_idle(&self) -> bool {
        match self {
            Self::Prefill(p) => p.is_idle(),
            Self::Decode(_) => true,
        }
    }

    /// End every room left with a reason pushed to the peer, say GOODBYE, close the
    /// sockets (bounded linger) and wait for the loop threads until `deadline`; returns the
    /// names of loops that had not ended, which are abandoned.
    pub fn stop(&self, deadline: Instant) -> Vec<String> {
        match self {
            Self::Prefill(p) => p.stop(deadline),
            Self::Decode(d) => d.stop(deadline),
        }
    }
}

/// What this process claims in the handshake.
pub fn local_identity(
    info: &ModelInfo,
    kv_dtype: u32,
    incarnation: u64,
    group_incarnation: u64,
) -> LocalIdentity {
    LocalIdentity {
        incarnation,
        group_incarnation,
        fingerprint: info.fingerprint.clone(),
        layout: KvLayout {
            dtype: kv_dtype,
            layers: info.n_layers as u32,
            kv_heads: info.n_kv_heads as u32,
            head_dim: info.head_dim as u32,
            block_size: info.kv_block_size as u32,
        },
    }
}

/// A random non-zero 64-bit id (process incarnations, room ids, nonces).
pub fn random_id() -> u64 {
    loop {
        let v: u64 = rand::random();
        if v != 0 {
            return v;
        }
    }
}

/// How long a loop may go without a heartbeat before `/ready` calls it stuck.
fn loop_stale_after(probe_period: Duration) -> Duration {
    probe_period.max(Duration::from_millis(500))
}

/// The `/ready` check of one loop's heartbeat.
fn loop_check(health: &LoopHealth, stale_after: Duration) -> Check {
    let age = health.age();
    Check::new(
        format!("loop_{}", health.name),
        age <= stale_after,
        "loop_stalled",
        format!(
            "heartbeat {} ms ago (limit {} ms), {} restarts",
            age.as_millis(),
            stale_after.as_millis(),
            health.restarts()
        ),
    )
}
