//! Supervision of the socket loops (every loop is supervised): a panic is caught,
//! counted and logged, the loop's `after_panic` fails the rooms it owned, and the loop runs
//! again. Each loop beats a heartbeat that `/ready` checks, so a dead or stuck loop turns
//! the process not-ready.
//!
//! Lifecycle: every loop reads its [`Lifecycle`] once per iteration (at most `wire::POLL_MS`
//! apart). `drain` asks it to take no new work; `stop` asks it to end what is left with a
//! reason, say goodbye to its peers, close its socket with a bounded linger and return,
//! which ends its thread (the process joins it with a bound).
//!
//! Fault injection: `LoopHealth::inject` arms a one-shot fault (stall or panic) that the
//! loop hits at its next `fault_point`, right after a heartbeat. Unit tests call it
//! directly; a running process reaches it only through `POST /debug/fault`, which exists
//! only when the process was started with `--fault-injection` *and* the environment
//! variable `TANDEM_ALLOW_FAULT_INJECTION=yes` (refused at start otherwise). Unarmed, a
//! fault point costs one relaxed atomic load.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::metrics::{LoopLabels, Metrics};

/// What the process asks of its loops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Run,
    /// Shutting down: take no new work, finish what is in flight.
    Drain,
    /// End what is left now and return.
    Stop,
}

/// Shared by a side's handle (which sets the phase) and its loops (which read it).
#[derive(Debug, Default)]
pub struct Lifecycle {
    /// 0 run, 1 drain, 2 stop, 3 stop for an in-place reset (rooms end with `reset`).
    phase: AtomicU8,
    /// Rooms the loops ended when they stopped (the in-place reset reports them).
    rooms_ended: AtomicUsize,
}

impl Lifecycle {
    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Relaxed) {
            0 => Phase::Run,
            1 => Phase::Drain,
            _ => Phase::Stop,
        }
    }

    /// Never moves backwards (a drain after a stop stays a stop).
    pub fn drain(&self) {
        let _ = self
            .phase
            .compare_exchange(0, 1, Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Never changes a stop for a reset back into a plain one: the loops may have read it.
    pub fn stop(&self) {
        let _ = self
            .phase
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| {
                (p < 2).then_some(2)
            });
    }

    /// Stop for an in-place reset: rooms end with `reset`, not `shutdown`.
    pub fn stop_for_reset(&self) {
        let _ = self
            .phase
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |p| {
                (p < 2).then_some(3)
            });
    }

    /// Whether the stop asked for is an in-place reset.
    pub fn is_reset(&self) -> bool {
        self.phase.load(Ordering::Relaxed) == 3
    }

    /// A loop ended `n` rooms as it stopped.
    pub fn rooms_ended(&self, n: usize) {
        self.rooms_ended.fetch_add(n, Ordering::Relaxed);
    }

    /// Rooms ended by the loops' stops so far.
    pub fn rooms_ended_total(&self) -> usize {
        self.rooms_ended.load(Ordering::Relaxed)
    }
}

/// Threads of one side's loops; joined with a bound when the process stops.
#[derive(Debug, Default)]
pub struct LoopThreads(Mutex<Vec<(String, JoinHandle<()>)>>);

impl LoopThreads {
    pub fn push(&self, name: String, h: JoinHandle<()>) {
        if let Ok(mut v) = self.0.lock() {
            v.push((name, h));
        }
    }

    /// Wait until every loop thread has ended or `deadline` passed; the names of those
    /// still running, which are abandoned (the process exits without them).
    pub fn join_until(&self, deadline: Instant) -> Vec<String> {
        let Ok(mut v) = self.0.lock() else {
            return Vec::new();
        };
        while v.iter().any(|(_, h)| !h.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut left = Vec::new();
        for (name, h) in v.drain(..) {
            if h.is_finished() {
                let _ = h.join();
            } else {
                left.push(name);
            }
        }
        left
    }
}

#[derive(Debug)]
pub struct LoopHealth {
    pub name: String,
    start: Instant,
    last_beat_ms: AtomicU64,
    restarts: AtomicU64,
    armed: AtomicBool,
    fault: Mutex<Option<Fault>>,
    stalled_at: Mutex<Option<Instant>>,
}

/// A one-shot fault (see the module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Stop beating for this long, as a loop stuck in a blocking call would.
    Stall(Duration),
    /// Panic inside the loop body.
    Panic,
}

impl LoopHealth {
    pub fn new(name: impl Into<String>) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            start: Instant::now(),
            last_beat_ms: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            armed: AtomicBool::new(false),
            fault: Mutex::new(None),
            stalled_at: Mutex::new(None),
        })
    }

    /// Where a loop hits an injected fault; called right after `beat`.
    #[inline]
    pub(super) fn fault_point(&self) {
        if !self.armed.load(Ordering::Relaxed) {
            return;
        }
        self.armed.store(false, Ordering::Relaxed);
        let fault = self.fault.lock().ok().and_then(|mut f| f.take());
        match fault {
            None => {}
            Some(Fault::Stall(d)) => {
                if let Ok(mut at) = self.stalled_at.lock() {
                    *at = Some(Instant::now());
                }
                tracing::warn!(r#loop = %self.name, stall_ms = d.as_millis() as u64, "injected fault: stalling the loop");
                std::thread::sleep(d);
            }
            Some(Fault::Panic) => panic!("injected fault"),
        }
    }

    /// Arm a one-shot fault (tests, and `POST /debug/fault` when fault injection is on).
    pub fn inject(&self, f: Fault) {
        if let Ok(mut slot) = self.fault.lock() {
            *slot = Some(f);
            self.armed.store(true, Ordering::Relaxed);
        }
    }

    /// When the last injected stall began.
    pub fn stalled_at(&self) -> Option<Instant> {
        self.stalled_at.lock().ok().and_then(|a| *a)
    }

    pub fn beat(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_beat_ms.store(ms, Ordering::Relaxed);
    }

    pub fn age(&self) -> Duration {
        let now = self.start.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_beat_ms.load(Ordering::Relaxed)))
    }

    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }
}

/// A loop body: `run` returns only to stop for good; a panic inside it restarts it.
pub trait Supervised: Send + 'static {
    fn run(&mut self);
    /// Clean up after a panic in `run`: fail the rooms the loop owned.
    fn after_panic(&mut self, message: &str);
}

pub fn supervise<S: Supervised>(
    mut body: S,
    health: Arc<LoopHealth>,
    metrics: Arc<Metrics>,
) -> std::io::Result<JoinHandle<()>> {
    // The loop's restart series exists (at 0) from its start.
    let _ = metrics.kv.loop_restarts.get_or_create(&LoopLabels {
        r#loop: health.name.clone(),
    });
    std::thread::Builder::new()
        .name(format!("tandem-{}", health.name))
        .spawn(move || {
            loop {
                match catch_unwind(AssertUnwindSafe(|| body.run())) {
                    Ok(()) => return,
                    Err(p) => {
                        let msg = p
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "non-string panic".into());
                        health.restarts.fetch_add(1, Ordering::Relaxed);
                        metrics
                            .kv
                            .loop_restarts
                            .get_or_create(&LoopLabels {
                                r#loop: health.name.clone(),
                            })
                            .inc();
                        tracing::error!(r#loop = %health.name, panic = %msg, "KV loop panicked; failing its rooms and restarting");
                        // A panic while failing rooms must not kill the supervisor too.
                        let _ = catch_unwind(AssertUnwindSafe(|| body.after_panic(&msg)));
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Flaky {
        runs: Arc<AtomicU64>,
        cleaned: Arc<AtomicU64>,
        health: Arc<LoopHealth>,
    }

    impl Supervised for Flaky {
        fn run(&mut self) {
            self.health.beat();
            if self.runs.fetch_add(1, Ordering::SeqCst) < 2 {
                panic!("boom");
            }
        }
        fn after_panic(&mut self, message: &str) {
            assert_eq!(message, "boom");
            self.cleaned.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn panics_are_counted_cleaned_up_and_the_loop_restarts() {
        let health = LoopHealth::new("flaky");
        let metrics = Arc::new(Metrics::new());
        let (runs, cleaned) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let body = Flaky {
            runs: runs.clone(),
            cleaned: cleaned.clone(),
            health: health.clone(),
        };
        supervise(body, health.clone(), metrics.clone())
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(
            runs.load(Ordering::SeqCst),
            3,
            "two panics, then a clean return"
        );
        assert_eq!(cleaned.load(Ordering::SeqCst), 2);
        assert_eq!(health.restarts(), 2);
        assert!(
            metrics
                .encode()
                .contains("tandem_kv_loop_restarts_total{loop=\"flaky\"} 2")
        );
        assert!(health.age() < Duration::from_secs(5));
    }
}
