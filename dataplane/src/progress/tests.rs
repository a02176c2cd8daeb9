//! The `no_progress` verdict, without processes: times are offsets in seconds.

use std::time::Duration;

use super::{ProgressInputs, Verdict, judge};

const N: u64 = 30;

fn s(x: f64) -> Duration {
    Duration::from_secs_f64(x)
}

fn at(now: f64) -> ProgressInputs {
    ProgressInputs {
        limit: Duration::from_secs(N),
        now: s(now),
        ..Default::default()
    }
}

fn stalled(v: &Verdict) -> Option<(&'static str, Duration)> {
    match v {
        Verdict::Ready => None,
        Verdict::NoProgress { stalled, for_, .. } => Some((stalled, *for_)),
    }
}

#[test]
fn idle_stays_ready_however_long() {
    for now in [0.0, 29.0, 31.0, 3600.0, 86400.0 * 30.0] {
        let i = ProgressInputs {
            last_step_ok: Some(s(1.0)),
            ..at(now)
        };
        assert_eq!(judge(&i), Verdict::Ready, "idle at {now}");
    }
    // Never stepped at all, and idle: ready too.
    assert_eq!(judge(&at(1e6)), Verdict::Ready);
}

#[test]
fn work_with_tokens_flowing_stays_ready() {
    // Work since 0; a step succeeded every 2 s up to now.
    for now in (0..600).map(|k| k as f64 * 2.0 + 1.0) {
        let i = ProgressInputs {
            engine_work: true,
            work_since: Some(s(0.0)),
            last_step_ok: Some(s(now - 1.0)),
            ..at(now)
        };
        assert_eq!(judge(&i), Verdict::Ready, "at {now}");
    }
}

#[test]
fn work_and_no_token_for_the_limit_is_no_progress() {
    let base = ProgressInputs {
        engine_work: true,
        work_since: Some(s(100.0)),
        last_step_ok: Some(s(110.0)),
        ..at(0.0)
    };
    // 29.9 s after the last success: still ready; 30 s: not.
    assert!(
        judge(&ProgressInputs {
            now: s(139.9),
            ..base
        })
        .is_ready()
    );
    let v = judge(&ProgressInputs {
        now: s(140.0),
        ..base
    });
    assert_eq!(stalled(&v), Some(("engine", s(30.0))));
    let Verdict::NoProgress { detail, .. } = v else {
        unreachable!()
    };
    assert!(detail.contains("no step succeeded for 30.0 s"), "{detail}");
    assert!(detail.contains("limit 30.0 s"), "{detail}");
    assert!(
        detail.contains("last successful step 30.0 s ago"),
        "{detail}"
    );
}

#[test]
fn work_after_a_long_idle_spell_starts_a_fresh_clock() {
    // Last step an hour ago; work arrived 5 s ago: not stalled yet, stalled at 30 s.
    let base = ProgressInputs {
        engine_work: true,
        work_since: Some(s(3600.0)),
        last_step_ok: Some(s(10.0)),
        ..at(3605.0)
    };
    assert!(judge(&base).is_ready());
    let v = judge(&ProgressInputs {
        now: s(3630.0),
        ..base
    });
    assert_eq!(stalled(&v), Some(("engine", s(30.0))));
    // Never stepped (a runner that hangs on its first step).
    let first = ProgressInputs {
        last_step_ok: None,
        ..base
    };
    let v = judge(&ProgressInputs {
        now: s(3631.0),
        ..first
    });
    assert_eq!(stalled(&v), Some(("engine", s(31.0))));
    let Verdict::NoProgress { detail, .. } = v else {
        unreachable!()
    };
    assert!(detail.contains("no successful step yet"), "{detail}");
}

#[test]
fn failing_steps_count_as_no_progress() {
    // Work queued throughout, every step failing since 50 (last success 49).
    let base = ProgressInputs {
        engine_work: true,
        work_since: Some(s(0.0)),
        last_step_ok: Some(s(49.0)),
        failing_since: Some(s(50.0)),
        failed_steps: 300,
        ..at(0.0)
    };
    let v = judge(&ProgressInputs {
        now: s(80.0),
        last_step_failed: Some(s(79.9)),
        ..base
    });
    // Counted from the last success (49), the longer of the two stalls.
    assert_eq!(stalled(&v), Some(("engine", s(31.0))));
    let Verdict::NoProgress { detail, .. } = v else {
        unreachable!()
    };
    assert!(detail.contains("the last 300 steps failed"), "{detail}");
    // A sparse stream of requests, each failed at once (the engine idle between them):
    // the streak is the work.
    let sparse = ProgressInputs {
        engine_work: false,
        work_since: None,
        last_step_ok: Some(s(49.0)),
        failing_since: Some(s(50.0)),
        last_step_failed: Some(s(78.0)),
        failed_steps: 15,
        ..at(80.0)
    };
    assert_eq!(stalled(&judge(&sparse)), Some(("engine", s(30.0))));
    // A request of that stream in the engine right now: its fresh spell of work does not
    // reset the streak's clock.
    let arriving = ProgressInputs {
        engine_work: true,
        work_since: Some(s(79.9)),
        ..sparse
    };
    assert_eq!(stalled(&judge(&arriving)), Some(("engine", s(30.0))));
    assert!(
        judge(&ProgressInputs {
            now: s(79.95),
            ..arriving
        })
        .is_ready()
    );
}

#[test]
fn one_failed_step_then_idle_never_trips() {
    // A single failure (a bad request) and nothing after: ready at every moment.
    for now in [50.5, 60.0, 79.9, 80.0, 81.0, 1000.0] {
        let i = ProgressInputs {
            last_step_ok: Some(s(49.0)),
            failing_since: Some(s(50.0)),
            last_step_failed: Some(s(50.0)),
            failed_steps: 1,
            ..at(now)
        };
        assert!(judge(&i).is_ready(), "at {now}: {:?}", judge(&i));
    }
}

#[test]
fn transfers_pending_with_no_bytes_for_the_limit_is_no_progress() {
    let base = ProgressInputs {
        kv_pending_since: Some(s(10.0)),
        last_kv_moved: Some(s(12.0)),
        ..at(0.0)
    };
    assert!(
        judge(&ProgressInputs {
            now: s(41.9),
            ..base
        })
        .is_ready()
    );
    let v = judge(&ProgressInputs {
        now: s(42.0),
        ..base
    });
    assert_eq!(stalled(&v), Some(("kv_transfer", s(30.0))));
    let Verdict::NoProgress { detail, .. } = v else {
        unreachable!()
    };
    assert!(
        detail.contains("KV bytes in flight and none moved for 30.0 s"),
        "{detail}"
    );
    // Bytes that moved long before the transfer became pending do not count against it.
    let fresh = ProgressInputs {
        kv_pending_since: Some(s(100.0)),
        last_kv_moved: Some(s(1.0)),
        ..at(129.0)
    };
    assert!(judge(&fresh).is_ready());
    // Bytes moving while pending: ready.
    let moving = ProgressInputs {
        last_kv_moved: Some(s(1000.0)),
        ..ProgressInputs {
            now: s(1001.0),
            ..base
        }
    };
    assert!(judge(&moving).is_ready());
    // Nothing pending: ready whatever the last move.
    assert!(
        judge(&ProgressInputs {
            kv_pending_since: None,
            now: s(1e5),
            ..base
        })
        .is_ready()
    );
}

#[test]
fn recovery_when_progress_resumes() {
    let stuck = ProgressInputs {
        engine_work: true,
        work_since: Some(s(0.0)),
        last_step_ok: Some(s(5.0)),
        failing_since: Some(s(6.0)),
        last_step_failed: Some(s(40.0)),
        failed_steps: 20,
        ..at(40.0)
    };
    assert!(!judge(&stuck).is_ready());
    // A step succeeds: the engine clears the streak and stamps the success.
    let resumed = ProgressInputs {
        last_step_ok: Some(s(41.0)),
        failing_since: None,
        failed_steps: 0,
        now: s(41.5),
        ..stuck
    };
    assert_eq!(judge(&resumed), Verdict::Ready);
    // The work ends: ready.
    let done = ProgressInputs {
        engine_work: false,
        work_since: None,
        ..resumed
    };
    assert_eq!(judge(&done), Verdict::Ready);
    // A stuck transfer that moves again.
    let kv = ProgressInputs {
        kv_pending_since: Some(s(0.0)),
        last_kv_moved: None,
        ..at(31.0)
    };
    assert!(!judge(&kv).is_ready());
    assert!(
        judge(&ProgressInputs {
            last_kv_moved: Some(s(31.0)),
            ..kv
        })
        .is_ready()
    );
}

#[test]
fn a_zero_limit_turns_the_check_off() {
    let i = ProgressInputs {
        limit: Duration::ZERO,
        engine_work: true,
        work_since: Some(s(0.0)),
        kv_pending_since: Some(s(0.0)),
        ..at(1e6)
    };
    assert_eq!(judge(&i), Verdict::Ready);
}
