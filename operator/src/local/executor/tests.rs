//! The executor's bookkeeping without processes, and the planner driven through it.

use std::net::Ipv4Addr;

use super::*;
use crate::crd::{CoRestartReason, GroupPhase, PDDeploymentStatus};
use crate::planner::{self, PlanInput, PodPhase, ReadyDetail};
use crate::reasons::EventReason;
use crate::testutil::spec;

#[derive(Default)]
pub(super) struct Fake {
    next_port: u16,
    next_pid: u32,
    pub(super) spawned: Vec<Launch>,
    pub(super) signals: Vec<(String, Signal)>,
    fail_spawn: bool,
    pub(super) resets: Vec<ResetCall>,
}

impl Processes for Fake {
    fn free_ports(&mut self, n: usize) -> Result<Vec<u16>, String> {
        Ok((0..n)
            .map(|_| {
                self.next_port += 1;
                20000 + self.next_port
            })
            .collect())
    }
    fn spawn(&mut self, launch: &Launch) -> Result<u32, String> {
        if self.fail_spawn {
            return Err("no such file".into());
        }
        self.spawned.push(launch.clone());
        self.next_pid += 1;
        Ok(1000 + self.next_pid)
    }
    fn signal(&mut self, pod: &str, signal: Signal) {
        self.signals.push((pod.to_string(), signal));
    }
    fn reset(&mut self, call: &ResetCall) {
        self.resets.push(call.clone());
    }
}

pub(super) fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + s).unwrap()
}

pub(super) fn executor() -> LocalExecutor<Fake> {
    LocalExecutor::new(
        ExecutorConfig {
            deployment: "demo".into(),
            namespace: "default".into(),
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            grace: Duration::from_secs(5),
            log_dir: PathBuf::from("/tmp/logs"),
        },
        Fake::default(),
    )
}

fn intent(role: Role, incarnation: i64) -> PodIntent {
    let mut s = spec(1);
    s.health.startup_timeout_seconds = 60;
    PodIntent {
        name: names::pod_name("demo", 0, incarnation, role, 0),
        group: 0,
        role,
        index: 0,
        incarnation,
        revision: "r1".into(),
        template: crate::crd::RevisionedSpec::from_spec(&s),
    }
}

fn env_of<'a>(l: &'a Launch, name: &str) -> Option<&'a str> {
    l.env
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[test]
fn objects_are_recorded_and_a_key_is_never_overwritten() {
    let mut x = executor();
    let obs = x.observed();
    assert!(!obs.client_service && obs.group_secrets.is_empty());
    for a in [
        PlannedAction::ApplyClientService,
        PlannedAction::ApplyGroupService { group: 0 },
        PlannedAction::ApplyNetworkPolicy { group: 0 },
        PlannedAction::CreateGroupSecret { group: 0 },
    ] {
        x.execute(&a, t(0)).unwrap();
    }
    let obs = x.observed();
    assert!(obs.client_service);
    assert_eq!(obs.group_services, BTreeSet::from([0]));
    assert_eq!(obs.network_policies, BTreeSet::from([0]));
    assert_eq!(obs.group_secrets, BTreeSet::from([0]));
    let key = x.objects.keys[&0].clone();
    assert_eq!(key.len(), 64);
    x.execute(&PlannedAction::CreateGroupSecret { group: 0 }, t(1))
        .unwrap();
    assert_eq!(x.objects.keys[&0], key, "an existing key is kept");
    x.execute(&PlannedAction::DeleteGroupResources { group: 0 }, t(2))
        .unwrap();
    let obs = x.observed();
    assert!(obs.group_services.is_empty() && obs.network_policies.is_empty());
    assert!(obs.group_secrets.is_empty());
}

#[test]
fn a_pod_becomes_a_process_with_the_pods_args_and_env_on_loopback() {
    let mut x = executor();
    x.execute(&PlannedAction::CreateGroupSecret { group: 0 }, t(0))
        .unwrap();
    let key = x.objects.keys[&0].clone();
    let p = intent(Role::Prefill, 1);
    x.execute(&PlannedAction::CreatePod(Box::new(p.clone())), t(1))
        .unwrap();
    let l = x.processes.spawned[0].clone();
    // The same function the controller puts into the pod, with the local network.
    let want = resources::dataplane_invocation(
        "demo",
        &p,
        &DataplaneNetwork {
            host: Some("127.0.0.1".into()),
            http_port: 20001,
            kv_port: 20002,
            prefill_peers: vec![],
        },
    );
    assert_eq!(l.args, want.args);
    assert_eq!(l.args[3], "--host=127.0.0.1");
    assert!(l.args.contains(&"--group-incarnation=1".to_string()));
    // The key, resolved from the runtime's Secret store, is the whole environment.
    assert_eq!(
        l.env,
        [("TANDEM_GROUP_KEY".to_string(), key.clone())],
        "{:?}",
        l.env
    );
    assert_eq!(l.http, "127.0.0.1:20001".parse().unwrap());
    assert_eq!(l.log, PathBuf::from("/tmp/logs/demo-g0-i1-p0.log"));
    assert_eq!(l.probe_period, Duration::from_secs(2));
    let m = &x.members["demo-g0-i1-p0"];
    assert_eq!((m.pid, m.kv_port), (1001, 20002));
    let o = x.observed();
    assert_eq!(o.pods.len(), 1);
    assert_eq!(o.pods[0].phase, PodPhase::Running);
    assert!(!o.pods[0].ready);

    // The decode is told its prefill's loopback KV address.
    x.execute(
        &PlannedAction::CreatePod(Box::new(intent(Role::Decode, 1))),
        t(2),
    )
    .unwrap();
    let d = &x.processes.spawned[1];
    assert!(
        d.args.contains(&"--prefill=127.0.0.1:20002".to_string()),
        "{:?}",
        d.args
    );
    assert_eq!(
        env_of(d, "TANDEM_PREFILL_PEERS"),
        None,
        "one channel: the flag"
    );
}

#[test]
fn a_decode_without_its_prefill_or_a_failed_spawn_is_an_error_that_changes_nothing() {
    let mut x = executor();
    x.execute(&PlannedAction::CreateGroupSecret { group: 0 }, t(0))
        .unwrap();
    let err = x
        .execute(
            &PlannedAction::CreatePod(Box::new(intent(Role::Decode, 1))),
            t(1),
        )
        .unwrap_err();
    assert!(err.contains("demo-g0-i1-p0 is not running"), "{err}");
    x.processes.fail_spawn = true;
    let err = x
        .execute(
            &PlannedAction::CreatePod(Box::new(intent(Role::Prefill, 1))),
            t(1),
        )
        .unwrap_err();
    assert_eq!(err, "no such file");
    assert!(x.members.is_empty());
    // Without the group's key nothing starts either.
    let mut x = executor();
    let err = x
        .execute(
            &PlannedAction::CreatePod(Box::new(intent(Role::Prefill, 1))),
            t(1),
        )
        .unwrap_err();
    assert!(err.contains("demo-g0-key"), "{err}");
}

fn started(x: &mut LocalExecutor<Fake>) {
    x.execute(&PlannedAction::CreateGroupSecret { group: 0 }, t(0))
        .unwrap();
    x.execute(
        &PlannedAction::CreatePod(Box::new(intent(Role::Prefill, 1))),
        t(0),
    )
    .unwrap();
}

#[test]
fn delete_is_sigterm_then_sigkill_after_the_grace_period() {
    let mut x = executor();
    started(&mut x);
    let del = PlannedAction::DeletePod {
        name: "demo-g0-i1-p0".into(),
        group: 0,
        role: Role::Prefill,
        incarnation: 1,
        reason: DeleteReason::CoRestart(CoRestartReason::MemberFailed),
        grace: Grace::Full,
    };
    x.execute(&del, t(10)).unwrap();
    x.execute(&del, t(11)).unwrap();
    assert_eq!(
        x.processes.signals,
        [("demo-g0-i1-p0".to_string(), Signal::SIGTERM)],
        "one SIGTERM however often the planner asks"
    );
    assert!(x.observed().pods[0].terminating);
    assert_eq!(x.next_deadline(), Some(t(15)));
    x.enforce_deadlines(t(14));
    assert_eq!(x.processes.signals.len(), 1);
    x.enforce_deadlines(t(15));
    assert_eq!(
        x.processes.signals[1],
        ("demo-g0-i1-p0".to_string(), Signal::SIGKILL)
    );
    x.enforce_deadlines(t(16));
    assert_eq!(x.processes.signals.len(), 2, "one SIGKILL");
    assert_eq!(x.next_deadline(), None);
    // The exit of a terminating member removes it: the pod is gone.
    x.on_exit(
        "demo-g0-i1-p0",
        "killed by signal 9".into(),
        false,
        None,
        t(16),
    );
    assert!(x.observed().pods.is_empty());
    let kinds: Vec<EntryKind> = x.record.entries().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            EntryKind::Object,
            EntryKind::Started,
            EntryKind::Terminating,
            EntryKind::Killed,
            EntryKind::Exited
        ]
    );
}

/// The planner's short grace: SIGKILL that long after SIGTERM, not after the runtime's
/// grace; and never later than the runtime's grace either.
#[test]
fn an_unresponsive_member_is_killed_after_the_short_grace() {
    let short = |seconds| PlannedAction::DeletePod {
        name: "demo-g0-i1-p0".into(),
        group: 0,
        role: Role::Prefill,
        incarnation: 1,
        reason: DeleteReason::CoRestart(CoRestartReason::MemberNotReady),
        grace: Grace::Unresponsive {
            seconds,
            cause: planner::UnresponsiveCause::NotReady,
        },
    };
    let mut x = executor();
    started(&mut x);
    x.execute(&short(2), t(10)).unwrap();
    assert_eq!(x.next_deadline(), Some(t(12)), "SIGKILL 2 s after SIGTERM");
    x.enforce_deadlines(t(11));
    assert_eq!(x.processes.signals.len(), 1, "only the SIGTERM before 2 s");
    x.enforce_deadlines(t(12));
    assert_eq!(
        x.processes.signals,
        [
            ("demo-g0-i1-p0".to_string(), Signal::SIGTERM),
            ("demo-g0-i1-p0".to_string(), Signal::SIGKILL)
        ]
    );
    let term = x
        .record
        .entries()
        .find(|e| e.kind == EntryKind::Terminating)
        .unwrap();
    assert!(term.warning, "a short grace is a warning in the record");
    assert!(
        term.message.contains("SIGKILL after 2s")
            && term.message.contains("incarnation 1")
            && term
                .message
                .contains("short grace of an unresponsive member"),
        "{}",
        term.message
    );

    // A short grace longer than the runtime's own (5 s) is cut to it.
    let mut x = executor();
    started(&mut x);
    x.execute(&short(20), t(10)).unwrap();
    assert_eq!(x.next_deadline(), Some(t(15)));
}

#[test]
fn an_unexpected_exit_is_a_failed_pod_until_the_planner_deletes_it() {
    let mut x = executor();
    started(&mut x);
    x.on_exit(
        "demo-g0-i1-p0",
        "killed by signal 9 (SIGKILL)".into(),
        false,
        Some("bye".into()),
        t(3),
    );
    let o = x.observed();
    assert_eq!(o.pods[0].phase, PodPhase::Failed);
    let last = x.record.entries().last().unwrap();
    assert!(last.warning);
    assert!(
        last.message.contains("exited on its own"),
        "{}",
        last.message
    );
    assert!(
        last.message.contains("last log line: bye"),
        "{}",
        last.message
    );
    x.execute(
        &PlannedAction::DeletePod {
            name: "demo-g0-i1-p0".into(),
            group: 0,
            role: Role::Prefill,
            incarnation: 1,
            reason: DeleteReason::CoRestart(CoRestartReason::MemberFailed),
            grace: Grace::Unresponsive {
                seconds: 2,
                cause: planner::UnresponsiveCause::Exited,
            },
        },
        t(4),
    )
    .unwrap();
    assert!(
        x.processes.signals.is_empty(),
        "an exited process is not signalled"
    );
    assert!(x.members.is_empty());
}

#[test]
fn a_process_that_never_answers_is_killed_after_the_startup_allowance() {
    let mut x = executor();
    started(&mut x);
    assert_eq!(x.next_deadline(), Some(t(60)));
    // Loading for 59 s is fine.
    x.on_probe(
        "demo-g0-i1-p0",
        ProbeOutcome::Unreachable("connection refused".into()),
        t(59),
    );
    x.enforce_deadlines(t(59));
    assert!(x.processes.signals.is_empty());
    x.enforce_deadlines(t(60));
    assert_eq!(x.processes.signals.len(), 1);
    assert_eq!(x.processes.signals[0].1, Signal::SIGKILL);
    x.on_exit(
        "demo-g0-i1-p0",
        "killed by signal 9".into(),
        false,
        None,
        t(61),
    );
    let m = &x.members["demo-g0-i1-p0"];
    assert!(
        m.exit
            .as_ref()
            .unwrap()
            .how
            .contains("startupTimeoutSeconds (60s)"),
        "{:?}",
        m.exit
    );
    assert_eq!(x.observed().pods[0].phase, PodPhase::Failed);
}

#[test]
fn a_decode_serves_only_with_its_gate_open_and_its_own_readiness() {
    let mut x = executor();
    started(&mut x);
    x.on_probe("demo-g0-i1-p0", ProbeOutcome::Ready, t(1));
    x.execute(
        &PlannedAction::CreatePod(Box::new(intent(Role::Decode, 1))),
        t(2),
    )
    .unwrap();
    let d = "demo-g0-i1-d0";
    assert!(x.on_probe(d, ProbeOutcome::Ready, t(3)));
    assert!(x.endpoints().is_empty(), "gate closed");
    x.execute(
        &PlannedAction::SetGroupReadyGate {
            pod: d.into(),
            ready: true,
        },
        t(3),
    )
    .unwrap();
    let eps = x.endpoints();
    assert_eq!(eps.len(), 1);
    assert_eq!(eps[0].pod, d);
    // Its own readiness fails (threshold 3 by default): out of the router before the
    // planner closes the gate.
    for s in 4..7 {
        x.on_probe(
            d,
            ProbeOutcome::NotReady(ReadyDetail::new(
                "probe_timeout",
                "probe 127.0.0.1:2: last PONG 6100 ms ago",
            )),
            t(s),
        );
    }
    assert!(x.endpoints().is_empty());
    assert!(x.members[d].gate);
}

/// The planner driven through this executor, with process exits and probe results fed
/// back as the runtime does: a group is built prefill first, and a decode that dies
/// makes the whole group restart, decode removed before the prefill is stopped, and
/// rebuilt prefill first at the next incarnation.
#[test]
fn the_planner_through_this_executor_co_restarts_prefill_first() {
    let s = spec(1);
    let mut x = executor();
    let mut status: Option<PDDeploymentStatus> = None;
    let mut clock = 0;
    let mut reconcile = |x: &mut LocalExecutor<Fake>, clock: i64| {
        for _ in 0..5 {
            let observed = x.observed();
            let plan = planner::plan(&PlanInput {
                name: "demo",
                generation: Some(1),
                spec: &s,
                status: status.as_ref(),
                restart_requested_at: None,
                observed: &observed,
                now: t(clock),
            });
            for a in &plan.actions {
                x.execute(a, t(clock)).unwrap();
            }
            status = Some(plan.status.clone());
            if plan
                .actions
                .iter()
                .all(|a| matches!(a, PlannedAction::Event(_)))
            {
                break;
            }
        }
        status.clone().unwrap()
    };
    let phase = |st: &PDDeploymentStatus| st.group_statuses[0].phase;

    let st = reconcile(&mut x, clock);
    assert_eq!(phase(&st), GroupPhase::StartingPrefill);
    assert_eq!(x.processes.spawned.len(), 1, "prefill only");
    clock += 1;
    x.on_probe("demo-g0-i1-p0", ProbeOutcome::Ready, t(clock));
    reconcile(&mut x, clock);
    assert_eq!(x.processes.spawned[1].pod, "demo-g0-i1-d0");
    clock += 1;
    x.on_probe("demo-g0-i1-d0", ProbeOutcome::Ready, t(clock));
    let st = reconcile(&mut x, clock);
    assert_eq!(phase(&st), GroupPhase::Ready);
    assert_eq!(x.endpoints().len(), 1);

    // SIGKILL of the decode.
    clock += 1;
    x.on_exit(
        "demo-g0-i1-d0",
        "killed by signal 9".into(),
        false,
        None,
        t(clock),
    );
    let st = reconcile(&mut x, clock);
    let g = &st.group_statuses[0];
    assert_eq!(g.incarnation, 2);
    assert_eq!(
        g.last_co_restart.as_ref().unwrap().reason,
        CoRestartReason::MemberFailed
    );
    assert!(x.endpoints().is_empty());
    assert_eq!(
        x.processes.signals,
        [("demo-g0-i1-p0".to_string(), Signal::SIGTERM)]
    );
    assert_eq!(
        x.processes.spawned.len(),
        2,
        "nothing new while the prefill runs"
    );
    clock += 1;
    x.on_exit("demo-g0-i1-p0", "exit code 0".into(), true, None, t(clock));
    reconcile(&mut x, clock);
    assert_eq!(x.processes.spawned[2].pod, "demo-g0-i2-p0");
    assert_eq!(
        x.processes.spawned.len(),
        3,
        "decode waits for the new prefill"
    );
    clock += 1;
    x.on_probe("demo-g0-i2-p0", ProbeOutcome::Ready, t(clock));
    reconcile(&mut x, clock);
    assert_eq!(x.processes.spawned[3].pod, "demo-g0-i2-d0");
    assert!(
        x.processes.spawned[3]
            .args
            .contains(&"--group-incarnation=2".to_string())
    );
    clock += 1;
    x.on_probe("demo-g0-i2-d0", ProbeOutcome::Ready, t(clock));
    let st = reconcile(&mut x, clock);
    assert_eq!(phase(&st), GroupPhase::Ready);
    assert_eq!(x.endpoints()[0].incarnation, 2);

    // The record tells the order.
    let seq = |kind: EntryKind, pod: &str| {
        x.record
            .entries()
            .find(|e| e.kind == kind && e.pod.as_deref() == Some(pod))
            .unwrap_or_else(|| panic!("no {kind:?} of {pod}"))
            .seq
    };
    assert!(
        seq(EntryKind::Removed, "demo-g0-i1-d0") < seq(EntryKind::Terminating, "demo-g0-i1-p0")
    );
    assert!(seq(EntryKind::Exited, "demo-g0-i1-p0") < seq(EntryKind::Started, "demo-g0-i2-p0"));
    assert!(seq(EntryKind::Ready, "demo-g0-i2-p0") < seq(EntryKind::Started, "demo-g0-i2-d0"));
    assert!(
        x.record.entries().any(|e| e.kind == EntryKind::Event
            && e.reason.map(EventReason::as_str) == Some("MemberFailed")),
        "the co-restart event is in the record"
    );
}
