//! Supervision of the socket loops (rule 3 in docs/architecture.md): a panic is caught,
//! counted and logged, the loop's `after_panic` fails the rooms it owned, and the loop runs
//! again. Each loop beats a heartbeat that `/ready` checks, so a dead or stuck loop turns
//! the process not-ready.
//!
//! Test hook: in `cfg(test)` builds only, `LoopHealth::inject` arms a one-shot fault (stall
//! or panic) that the loop hits at its next `fault_point`, right after a heartbeat. In
//! other builds `fault_point` is an empty inline function: nothing is compiled in.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::metrics::{LoopLabels, Metrics};

#[derive(Debug)]
pub struct LoopHealth {
    pub name: String,
    start: Instant,
    last_beat_ms: AtomicU64,
    restarts: AtomicU64,
    #[cfg(test)]
    fault: std::sync::Mutex<Option<Fault>>,
    #[cfg(test)]
    stalled_at: std::sync::Mutex<Option<Instant>>,
}

/// A one-shot fault for tests (see the module header).
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fault {
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
            #[cfg(test)]
            fault: std::sync::Mutex::new(None),
            #[cfg(test)]
            stalled_at: std::sync::Mutex::new(None),
        })
    }

    /// Where a loop hits an injected fault; called right after `beat`.
    #[cfg(not(test))]
    #[inline(always)]
    pub(super) fn fault_point(&self) {}

    #[cfg(test)]
    pub(super) fn fault_point(&self) {
        let fault = self.fault.lock().unwrap().take();
        match fault {
            None => {}
            Some(Fault::Stall(d)) => {
                *self.stalled_at.lock().unwrap() = Some(Instant::now());
                std::thread::sleep(d);
            }
            Some(Fault::Panic) => panic!("injected fault"),
        }
    }

    #[cfg(test)]
    pub(crate) fn inject(&self, f: Fault) {
        *self.fault.lock().unwrap() = Some(f);
    }

    /// When the last injected stall began.
    #[cfg(test)]
    pub(crate) fn stalled_at(&self) -> Option<Instant> {
        *self.stalled_at.lock().unwrap()
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
