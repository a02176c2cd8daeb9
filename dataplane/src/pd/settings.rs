//! What a KV channel is started with: this process's identity in the handshake, the group
//! key, the protocol timings and the limits; and the random ids the protocol uses.

use std::time::Duration;

use crate::engine_api::ModelInfo;
use crate::kv::KvLayout;
pub use crate::kv::PdTimings;
use crate::kv::auth::{GroupKey, LocalIdentity};

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
    pub key: GroupKey,
    pub timings: PdTimings,
    pub limits: PdLimits,
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
