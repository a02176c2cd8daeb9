//! Prefill role: one ROUTER socket on `--kv-port` and one supervised loop (`router_loop`)
//! that serves every decode. `PrefillHandle` is what the rest of the process holds: the
//! readiness checks and peer reports, and the drain and stop of the loop.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::report::{Check, PeerReport, loop_check, loop_stale_after};
use super::router_loop::{RouterConfig, RouterLoop, RouterReport};
use super::settings::ChannelConfig;
use super::supervise::{Lifecycle, LoopHealth, LoopThreads, supervise};
use super::wire;
use crate::metrics::Metrics;
use crate::scheduler::EngineHandle;

pub struct PrefillHandle {
    bound: Arc<AtomicBool>,
    health: Arc<LoopHealth>,
    stale_after: Duration,
    pub endpoint: String,
    lifecycle: Arc<Lifecycle>,
    threads: LoopThreads,
    report: Arc<Mutex<RouterReport>>,
    rooms_open: Arc<AtomicUsize>,
}

impl PrefillHandle {
    pub fn checks(&self) -> Vec<Check> {
        let bound = self.bound.load(Ordering::Relaxed);
        vec![
            Check::new(
                "kv_socket_bound",
                bound,
                "kv_socket_unbound",
                if bound {
                    format!("ROUTER bound on {}", self.endpoint)
                } else {
                    format!("ROUTER not bound on {}", self.endpoint)
                },
            ),
            loop_check(&self.health, self.stale_after),
        ]
    }

    /// The decode sessions, most recently seen first; the last refusal is reported as a
    /// peer of its own when its peer holds no session.
    pub fn peers(&self) -> Vec<PeerReport> {
        let Ok(r) = self.report.lock() else {
            return Vec::new();
        };
        let mut peers = r.peers.clone();
        if let Some((addr, refusal)) = &r.last_refusal
            && !peers.iter().any(|p| &p.address == addr)
        {
            peers.push(PeerReport {
                address: addr.clone(),
                state: "idle",
                incarnation: None,
                rooms: 0,
                last_contact_ms: None,
                bytes_in_flight: None,
                last_refusal: Some(refusal.clone()),
                last_failure: None,
            });
        }
        peers
    }

    pub fn loops(&self) -> Vec<Arc<LoopHealth>> {
        vec![self.health.clone()]
    }

    /// Say GOODBYE to every decode and refuse new rooms and handshakes; rooms in flight go on.
    pub fn drain(&self) {
        self.lifecycle.drain();
    }

    /// No room left in flight.
    pub fn is_idle(&self) -> bool {
        self.rooms_open.load(Ordering::Relaxed) == 0
    }

    /// Fail what is left (`shutdown`, pushed to the decodes), close the socket, and wait for
    /// the loop thread until `deadline`. The loop drops its engine handle when it ends, so
    /// the engine thread can finish too.
    pub fn stop(&self, deadline: Instant) -> Vec<String> {
        self.lifecycle.stop();
        let left = self.threads.join_until(deadline);
        self.bound.store(false, Ordering::Relaxed);
        left
    }

    /// As `stop`, for an in-place reset: the rooms and sessions end with `reset`. Once it
    /// returned with no loop left, the port is free for the next ROUTER.
    pub fn stop_for_reset(&self, deadline: Instant) -> Vec<String> {
        self.lifecycle.stop_for_reset();
        self.stop(deadline)
    }

    /// Rooms the loop ended when it stopped.
    pub fn rooms_ended(&self) -> usize {
        self.lifecycle.rooms_ended_total()
    }
}

/// How long a start retries binding a port still held: after an in-place reset the old
/// ROUTER's listener is closed by libzmq's I/O thread, normally before its loop's thread
/// ends, but not by contract.
const BIND_RETRY: Duration = Duration::from_secs(2);

fn bind_retrying(sock: &zmq::Socket, endpoint: &str) -> zmq::Result<()> {
    let until = Instant::now() + BIND_RETRY;
    loop {
        match sock.bind(endpoint) {
            Err(zmq::Error::EADDRINUSE) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

/// Bind the ROUTER (failing the start when the port is taken) and start the loop.
pub fn start(
    host: &str,
    port: u16,
    channel: ChannelConfig,
    engine: EngineHandle,
    metrics: Arc<Metrics>,
) -> crate::Result<PrefillHandle> {
    let ChannelConfig {
        local,
        key,
        timings,
        limits,
    } = channel;
    let io = |source| crate::Error::Transport {
        endpoint: format!("tcp://{host}:{port}"),
        source,
    };
    let ctx = zmq::Context::new();
    let sock = ctx.socket(zmq::ROUTER).map_err(io)?;
    wire::configure(&sock).map_err(io)?;
    // Sends to a peer that went away fail (and are counted) instead of vanishing.
    sock.set_router_mandatory(true).map_err(io)?;
    let endpoint = format!("tcp://{host}:{port}");
    bind_retrying(&sock, &endpoint).map_err(io)?;
    let bound = Arc::new(AtomicBool::new(true));
    let health = LoopHealth::new("kv_router");
    health.beat();
    tracing::info!(%endpoint, incarnation = local.incarnation, group_incarnation = local.group_incarnation, "KV ROUTER bound");
    let lifecycle = Arc::new(Lifecycle::default());
    let report = Arc::new(Mutex::new(RouterReport::default()));
    let rooms_open = Arc::new(AtomicUsize::new(0));
    let config = RouterConfig {
        ctx,
        sock,
        local,
        key,
        timings,
        limits,
        engine,
        metrics: metrics.clone(),
        lifecycle: lifecycle.clone(),
        report: report.clone(),
        rooms_open: rooms_open.clone(),
    };
    let body = RouterLoop::new(config, health.clone());
    let thread =
        supervise(body, health.clone(), metrics).map_err(|source| crate::Error::Thread {
            name: "KV loop".into(),
            source,
        })?;
    let threads = LoopThreads::default();
    threads.push(health.name.clone(), thread);
    Ok(PrefillHandle {
        bound,
        health,
        stale_after: loop_stale_after(timings.probe_period),
        endpoint,
        lifecycle,
        threads,
        report,
        rooms_open,
    })
}
