//! PD roles over ZeroMQ: the prefill's ROUTER loop (`prefill`) and the decode's DEALER loop
//! per prefill (`decode`), both supervised (`supervise`), plus the readiness checks
//! `/ready` reports for them. The protocol itself (codec, handshake, rooms) is `crate::kv`.
//!
//! Threads: every socket is owned by exactly one loop thread (ZeroMQ sockets are not
//! thread safe). The engine thread and the HTTP tasks talk to the loops only through
//! bounded channels with non-blocking sends, so no socket I/O ever happens on the engine
//! thread (rule 10), and the health probe (PING/PONG) runs through the very loop and socket
//! that carry KV (rule 5). Rule numbers are those of `docs/architecture.md`.

pub mod decode;
mod peer_loop;
pub mod prefill;
mod supervise;
#[cfg(test)]
mod tests;
mod wire;

use std::time::Duration;

use crate::engine_api::ModelInfo;
use crate::kv::KvLayout;
use crate::kv::auth::LocalIdentity;

pub use decode::{DecodeClient, RoomFailure};
pub use prefill::PrefillHandle;
pub use supervise::{LoopHealth, supervise};

/// One `/ready` check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

/// The PD side of a process, for `/ready` and request routing.
pub enum PdRole {
    Prefill(PrefillHandle),
    Decode(DecodeClient),
}

impl PdRole {
    pub fn checks(&self) -> Vec<Check> {
        match self {
            Self::Prefill(p) => p.checks(),
            Self::Decode(d) => d.checks(),
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
