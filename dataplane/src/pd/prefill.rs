//! Prefill role: one ROUTER socket on `--kv-port` and one supervised loop (`router_loop`)
//! that serves every decode. `PrefillHandle` is what the rest of the process holds: the
//! readiness checks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::router_loop::{RouterConfig, RouterLoop};
use super::wire;
use super::{Check, LoopHealth, loop_stale_after, supervise};
use crate::config::PdTimings;
use crate::kv::auth::{GroupKey, LocalIdentity};
use crate::metrics::Metrics;
use crate::scheduler::EngineHandle;

pub struct PrefillHandle {
    bound: Arc<AtomicBool>,
    health: Arc<LoopHealth>,
    stale_after: Duration,
    pub endpoint: String,
}

impl PrefillHandle {
    pub fn checks(&self) -> Vec<Check> {
        let bound = self.bound.load(Ordering::Relaxed);
        let age = self.health.age();
        vec![
            Check {
                name: "kv_socket_bound".into(),
                ok: bound,
                detail: if bound {
                    format!("ROUTER bound on {}", self.endpoint)
                } else {
                    format!("ROUTER not bound on {}", self.endpoint)
                },
            },
            Check {
                name: format!("loop_{}", self.health.name),
                ok: age <= self.stale_after,
                detail: format!(
                    "heartbeat {} ms ago (limit {} ms), {} restarts",
                    age.as_millis(),
                    self.stale_after.as_millis(),
                    self.health.restarts()
                ),
            },
        ]
    }
}

/// Bind the ROUTER (failing the start when the port is taken) and start the loop.
pub fn start(
    host: &str,
    port: u16,
    local: LocalIdentity,
    key: GroupKey,
    timings: PdTimings,
    engine: EngineHandle,
    metrics: Arc<Metrics>,
) -> crate::Result<PrefillHandle> {
    let io = |e: zmq::Error| crate::Error::Io {
        path: format!("KV socket tcp://{host}:{port}"),
        source: std::io::Error::other(e),
    };
    let ctx = zmq::Context::new();
    let sock = ctx.socket(zmq::ROUTER).map_err(io)?;
    wire::configure(&sock).map_err(io)?;
    // Sends to a peer that went away fail (and are counted) instead of vanishing.
    sock.set_router_mandatory(true).map_err(io)?;
    let endpoint = format!("tcp://{host}:{port}");
    sock.bind(&endpoint).map_err(io)?;
    let bound = Arc::new(AtomicBool::new(true));
    let health = LoopHealth::new("kv_router");
    health.beat();
    tracing::info!(%endpoint, incarnation = local.incarnation, group_incarnation = local.group_incarnation, "KV ROUTER bound");
    let config = RouterConfig {
        ctx,
        sock,
        local,
        key,
        timings,
        engine,
        metrics: metrics.clone(),
    };
    let body = RouterLoop::new(config, health.clone());
    supervise(body, health.clone(), metrics).map_err(|e| crate::Error::Io {
        path: "KV loop thread".into(),
        source: e,
    })?;
    Ok(PrefillHandle {
        bound,
        health,
        stale_after: loop_stale_after(timings.probe_period),
        endpoint,
    })
}
