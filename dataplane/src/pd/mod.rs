//! PD roles over ZeroMQ. Each side is a handle the rest of the process holds and the loop
//! behind it: the prefill's `PrefillHandle` (`prefill`) and its `RouterLoop` (`router_loop`,
//! one ROUTER socket for every decode); the decode's `DecodeHandle` (`decode`) and one
//! `DealerLoop` per prefill (`dealer_loop`, one DEALER socket each). Both loops are
//! supervised (`supervise`) and share the ZeroMQ plumbing (`wire`). The protocol itself
//! (codec, handshake, rooms) is `crate::kv`.
//!
//! Imports run one way: `slot` (the current channel, replaced by an in-place reset) →
//! `PdRole` (here) → handle → loop → the leaves `report` (readiness checks and peer
//! reports), `reset` (the pure parts of a reset), `settings` (what a channel is started
//! with), `supervise`, `wire`, and `crate::kv`. No module imports from one above it.
//!
//! Threads: every socket is owned by exactly one loop thread (ZeroMQ sockets are not
//! thread safe). The engine thread and the HTTP tasks talk to the loops only through
//! bounded channels with non-blocking sends, so no socket I/O ever happens on the engine
//! thread, and the health probe (PING/PONG) runs through the very loop and socket that
//! carry KV, so it measures the data path itself.

mod dealer_loop;
pub mod decode;
pub mod prefill;
pub mod report;
pub mod reset;
mod router_loop;
pub mod settings;
pub mod slot;
mod supervise;
#[cfg(test)]
mod tests;
mod wire;

use std::sync::Arc;
use std::time::Instant;

pub use dealer_loop::RoomFailure;
pub use decode::DecodeHandle;
pub use prefill::PrefillHandle;
pub use report::{Check, PeerReport, Problem};
pub use settings::{ChannelConfig, PdLimits, PdTimings, local_identity, random_id};
pub use slot::{PdRun, PdSlot, PdStarter, ResetDone, ResetError};
pub use supervise::{Fault, LoopHealth, supervise};

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

    /// As `stop`, for an in-place reset (`slot`): rooms and sessions end with `reset`.
    pub fn stop_for_reset(&self, deadline: Instant) -> Vec<String> {
        match self {
            Self::Prefill(p) => p.stop_for_reset(deadline),
            Self::Decode(d) => d.stop_for_reset(deadline),
        }
    }

    /// Rooms the loops ended when they stopped.
    pub fn rooms_ended(&self) -> usize {
        match self {
            Self::Prefill(p) => p.rooms_ended(),
            Self::Decode(d) => d.rooms_ended(),
        }
    }
}
