//! A small persistent fork-join pool.
//!
//! A decode step issues ~150 parallel kernel calls per token; spawning threads for each
//! (tens of µs) would cost more than the work. Workers here spin briefly between jobs and
//! then park, so back-to-back kernels pay well under a microsecond to fan out.
//!
//! The pool runs a borrowed closure on several threads. That needs its lifetime erased
//! while the workers hold it; `run` does not return until no worker can still touch the
//! closure, which is what makes the erasure sound.
//!
//! Cores are shared with other processes, so a worker may be descheduled when a job
//! arrives. The caller never waits for such a worker: it runs the remaining tasks itself,
//! closes the job (a `gate`), and waits only for workers that entered before the close.
//! A worker that wakes up later sees the gate closed and leaves the closure alone.
#![allow(unsafe_code)]

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

type Task<'a> = dyn Fn(usize) + Sync + 'a;

/// How long an idle worker spins before parking: long enough to bridge the gap between
/// two kernels of one forward pass, short enough not to burn a core between requests.
const SPIN: Duration = Duration::from_micros(300);

#[derive(Clone, Copy)]
struct JobPtr(*const Task<'static>);
// SAFETY: the pointee is `Sync` (required by `Task`), and the pointer is only
// dereferenced while `run` keeps the closure alive (see `run`).
unsafe impl Send for JobPtr {}

struct Shared {
    /// `2·epoch + 1` while job `epoch` is open, `2·epoch` once closed.
    gate: AtomicU64,
    /// Workers that entered the open job and may still touch it.
    inside: AtomicUsize,
    job: Mutex<Option<(JobPtr, usize)>>,
    next: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleeping: Vec<AtomicBool>,
}

pub struct ThreadPool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    /// Held by the one caller that owns the workers; others run their job inline, which
    /// also makes nested or concurrent use safe (just not parallel).
    busy: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `threads` threads in all, the calling thread included.
    pub fn new(threads: usize) -> Self {
        let workers = threads.saturating_sub(1);
        let shared = Arc::new(Shared {
            gate: AtomicU64::new(0),
            inside: AtomicUsize::new(0),
            job: Mutex::new(None),
            next: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleeping: (0..workers).map(|_| AtomicBool::new(false)).collect(),
        });
        let handles = (0..workers)
            .map(|i| {
                let s = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("tandem-kernel-{i}"))
                    .spawn(move || worker(&s, i))
                    .expect("spawn kernel worker thread")
            })
            .collect();
        Self {
            shared,
            handles,
            busy: Mutex::new(()),
        }
    }

    /// The process-wide pool with one thread per available core.
    pub fn global() -> &'static ThreadPool {
        static DEFAULT: OnceLock<&'static ThreadPool> = OnceLock::new();
        DEFAULT.get_or_init(|| Self::shared(None))
    }

    /// The process-wide pool of `threads` threads (`None`: one per available core),
    /// started on first use. One pool per distinct size lives for the rest of the process,
    /// so backends configured alike share their workers.
    pub fn shared(threads: Option<usize>) -> &'static ThreadPool {
        static POOLS: Mutex<Vec<&'static ThreadPool>> = Mutex::new(Vec::new());
        let n = threads
            .unwrap_or_else(|| thread::available_parallelism().map_or(1, |n| n.get()))
            .max(1);
        let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pools.iter().find(|p| p.threads() == n) {
            return p;
        }
        let p: &'static ThreadPool = Box::leak(Box::new(ThreadPool::new(n)));
        pools.push(p);
        p
    }

    pub fn threads(&self) -> usize {
        self.handles.len() + 1
    }

    /// Call `f(i)` for every `i in 0..n`, spread over the pool; returns when all are done.
    /// A panic in any task is re-raised here after every worker has let go of `f`.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n == 0 {
            return;
        }
        let guard = if n > 1 && !self.handles.is_empty() {
            self.busy.try_lock().ok()
        } else {
            None
        };
        let Some(_guard) = guard else {
            (0..n).for_each(f);
            return;
        };
        let s = &*self.shared;
        // SAFETY: only the lifetime is changed. Workers dereference the pointer only after
        // entering the job while its gate is open (counted in `inside`), and this function
        // closes the gate and waits for `inside` to drop to zero before returning or
        // unwinding, so `f` outlives every use.
        let ptr = JobPtr(unsafe { std::mem::transmute::<&Task<'_>, &Task<'static>>(f) });
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some((ptr, n));
        s.next.store(0, Ordering::SeqCst);
        s.panicked.store(false, Ordering::SeqCst);
        let epoch = s.gate.load(Ordering::SeqCst) / 2 + 1;
        s.gate.store(2 * epoch + 1, Ordering::SeqCst);
        for (h, sleeping) in self.handles.iter().zip(&s.sleeping) {
            if sleeping.load(Ordering::SeqCst) {
                h.thread().unpark();
            }
        }
        run_tasks(s, f, n);
        s.gate.store(2 * epoch, Ordering::SeqCst);
        let start = Instant::now();
        while s.inside.load(Ordering::SeqCst) != 0 {
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if s.panicked.load(Ordering::SeqCst) {
            panic!("a kernel task panicked");
        }
    }

    /// Hand each element of `parts` to exactly one call of `f`, in parallel. Lets tasks own
    /// disjoint `&mut` slices without any unsafe code at the call site.
    pub fn for_each<P: Send>(&self, parts: Vec<P>, f: impl Fn(usize, P) + Sync) {
        let slots: Vec<Mutex<Option<P>>> = parts.into_iter().map(|p| Mutex::new(Some(p))).collect();
        self.run(slots.len(), &|i| {
            let part = slots[i].lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(p) = part {
                f(i, p);
            }
        });
    }
}

fn run_tasks(s: &Shared, f: &Task<'_>, n: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            break;
        }
        if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
            s.panicked.store(true, Ordering::SeqCst);
        }
    }
}

fn worker(s: &Shared, idx: usize) {
    let mut seen = 0u64;
    // A job this worker has not looked at yet, if one is open.
    let fresh = |seen: u64| {
        let g = s.gate.load(Ordering::SeqCst);
        (g % 2 == 1 && g / 2 != seen).then_some(g / 2)
    };
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            if s.shutdown.load(Ordering::Relaxed) {
                return;
            }
            if let Some(e) = fresh(seen) {
                break e;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            // Announce sleep, then re-check: either `run` sees the flag and unparks us,
            // or we see its open gate here (both sides use SeqCst).
            s.sleeping[idx].store(true, Ordering::SeqCst);
            if fresh(seen).is_none() && !s.shutdown.load(Ordering::SeqCst) {
                thread::park();
            }
            s.sleeping[idx].store(false, Ordering::SeqCst);
        };
        seen = epoch;
        s.inside.fetch_add(1, Ordering::SeqCst);
        // Entered only if the gate is still open for this epoch; otherwise the caller may
        // already have returned and the closure must not be touched.
        if s.gate.load(Ordering::SeqCst) == 2 * epoch + 1 {
            let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((ptr, n)) = job {
                // SAFETY: we are counted in `inside` and saw the gate open after that, so
                // `run` is still waiting for us and the closure is alive.
                let f = unsafe { &*ptr.0 };
                run_tasks(s, f, n);
            }
        }
        s.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for h in &self.handles {
            h.thread().unpark();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once() {
        let pool = ThreadPool::new(3);
        for n in [1, 2, 7, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn for_each_gives_out_disjoint_mut_slices() {
        let pool = ThreadPool::new(2);
        let mut v = vec![0usize; 100];
        pool.for_each(v.chunks_mut(7).collect(), |i, c: &mut [usize]| {
            c.fill(i + 1)
        });
        assert_eq!(v[0], 1);
        assert_eq!(v[99], 100 / 7 + 1);
    }

    #[test]
    fn nested_use_runs_inline_and_panics_propagate() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run(3, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(total.load(Ordering::Relaxed), 12);
        let r = catch_unwind(AssertUnwindSafe(|| pool.run(8, &|i| assert!(i != 5))));
        assert!(r.is_err());
        // The pool still works after a panicking job.
        let count = AtomicUsize::new(0);
        pool.run(5, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn shared_pools_are_one_per_size() {
        let a = ThreadPool::shared(Some(2));
        assert_eq!(a.threads(), 2);
        assert!(std::ptr::eq(a, ThreadPool::shared(Some(2))));
        assert_eq!(
            ThreadPool::shared(Some(0)).threads(),
            1,
            "at least the caller"
        );
        assert!(std::ptr::eq(ThreadPool::global(), ThreadPool::shared(None)));
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = ThreadPool::new(2);
        thread::sleep(SPIN * 4);
        let count = AtomicUsize::new(0);
        pool.run(64, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 64);
    }
}
