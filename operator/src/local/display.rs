//! The live status on a terminal: groups, phases, incarnations, co-restarts and their
//! reasons, each member's state (model loading included) and the latest record entries,
//! redrawn in place twice a second and on every change. Used only when stdout is a
//! terminal; otherwise the record's log lines are the output.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use tokio::sync::watch;

use super::executor::EntryKind;
use super::snapshot::Snapshot;
use crate::crd::conditions;

/// Record entries shown under the groups.
const RECENT: usize = 10;
const MAX_LINE: usize = 160;

fn ago(now: Timestamp, t: Timestamp) -> String {
    let s = now.duration_since(t).as_secs_f64().max(0.0) as u64;
    if s < 120 {
        format!("{s}s")
    } else if s < 7200 {
        format!("{}m", s / 60)
    } else {
        format!("{}h", s / 3600)
    }
}

fn cut(mut s: String) -> String {
    if s.chars().count() > MAX_LINE {
        s = s.chars().take(MAX_LINE - 1).collect::<String>() + "…";
    }
    s
}

/// The screen for `snap` at `now`, one string per line.
pub fn render(snap: &Snapshot, now: Timestamp) -> Vec<String> {
    let grace = snap.grace_seconds;
    let mut out = Vec::new();
    out.push(format!(
        "Tandem local runtime · {} · generation {} · {}",
        snap.deployment,
        snap.generation,
        snap.file.display()
    ));
    out.push(format!(
        "OpenAI endpoint {}/v1   ({}/status for details)   logs {}",
        snap.endpoint,
        snap.endpoint,
        snap.log_dir.display()
    ));
    if let Some(st) = &snap.status {
        let cond = |t: &str| {
            st.conditions
                .iter()
                .find(|c| c.type_ == t)
                .map(|c| format!("{} {} ({})", t, c.status, c.reason))
                .unwrap_or_default()
        };
        out.push(format!(
            "{} ready of {} · {} · {} · {}",
            st.ready_groups,
            st.group_statuses.len(),
            cond(conditions::AVAILABLE),
            cond(conditions::DEGRADED),
            cond(conditions::BOOTSTRAP_HEALTHY)
        ));
    }
    if snap.endpoints.is_empty() {
        out.push(format!("requests now get 503: {}", snap.unavailable));
    } else {
        let eps: Vec<&str> = snap.endpoints.iter().map(|e| e.pod.as_str()).collect();
        out.push(format!("routing to {}", eps.join(", ")));
    }
    if let Some(e) = &snap.spec_error {
        out.push(format!("! the file's latest version is not used: {e}"));
    }
    out.push(String::new());
    out.push(format!(
        "{:<6} {:<16} {:>4}  {:<11} {:>11}  {}",
        "GROUP", "PHASE", "INC", "REVISION", "CO-RESTARTS", "LAST CO-RESTART"
    ));
    if let Some(st) = &snap.status {
        for g in &st.group_statuses {
            let last = g
                .last_co_restart
                .as_ref()
                .map(|r| format!("{} {} ago", r.reason, ago(now, r.time.0)))
                .unwrap_or_else(|| "-".into());
            out.push(format!(
                "{:<6} {:<16} {:>4}  {:<11} {:>11}  {}",
                g.index,
                format!("{:?}", g.phase),
                g.incarnation,
                g.revision,
                g.co_restarts,
                last
            ));
            if let Some(m) = &g.message {
                out.push(format!("       {m}"));
            }
            for m in snap.members.iter().filter(|m| m.member.group == g.index) {
                let routed = if m.member.serving() { "  [routed]" } else { "" };
                out.push(format!(
                    "       {:<8} {:<24} pid {:<8} {}{routed}",
                    m.member.role.as_str(),
                    m.member.name,
                    m.member.pid,
                    m.state
                ));
            }
        }
    }
    out.push(String::new());
    out.push("recent".into());
    let recent: Vec<_> = snap
        .record
        .iter()
        .filter(|e| !matches!(e.kind, EntryKind::Object))
        .rev()
        .take(RECENT)
        .collect();
    for e in recent.into_iter().rev() {
        let mark = if e.warning { "!" } else { " " };
        let reason = e.reason.map(|r| format!("{r} ")).unwrap_or_default();
        out.push(format!(
            " {mark}{:>5} ago  {reason}{}",
            ago(now, e.time),
            e.message
        ));
    }
    out.push(String::new());
    out.push(if snap.shutting_down {
        format!(
            "stopping: SIGTERM to every member, SIGKILL after {grace}s (Ctrl-C again to kill now)"
        )
    } else {
        format!("Ctrl-C stops every member (SIGTERM, then SIGKILL after {grace}s)")
    });
    out.into_iter().map(cut).collect()
}

fn draw(lines: &[String]) {
    let mut buf = String::from("\x1b[H");
    for l in lines {
        buf.push_str(l);
        buf.push_str("\x1b[K\n");
    }
    buf.push_str("\x1b[J");
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(buf.as_bytes());
    let _ = stdout.flush();
}

/// Redraw until the snapshot sender goes away (or the task is aborted).
pub async fn run(mut rx: watch::Receiver<Arc<Snapshot>>) {
    {
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(b"\x1b[2J\x1b[H\x1b[?25l");
        let _ = stdout.flush();
    }
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            r = rx.changed() => if r.is_err() { break },
            _ = tick.tick() => {}
        }
        let snap = rx.borrow().clone();
        draw(&render(&snap, Timestamp::now()));
    }
}

/// Draw `snap` one last time and give the cursor back.
pub fn finish(snap: &Snapshot) {
    draw(&render(snap, Timestamp::now()));
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_all(b"\x1b[?25h");
    let _ = stdout.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{
        CoRestartReason, CoRestartRecord, GroupPhase, GroupStatus, PDDeploymentStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    #[test]
    fn the_screen_shows_groups_co_restarts_and_recent_entries() {
        let now = Timestamp::from_second(1_800_000_100).unwrap();
        let mut snap = Snapshot::empty(
            "demo",
            "m.yaml".into(),
            "http://127.0.0.1:8000".into(),
            "/tmp/l".into(),
            30,
        );
        snap.generation = 2;
        snap.status = Some(PDDeploymentStatus {
            group_statuses: vec![GroupStatus {
                index: 0,
                incarnation: 3,
                phase: GroupPhase::StartingDecode,
                revision: "abc".into(),
                co_restarts: 2,
                last_co_restart: Some(CoRestartRecord {
                    time: Time(Timestamp::from_second(1_800_000_088).unwrap()),
                    reason: CoRestartReason::MemberNotReady,
                    in_place: false,
                }),
                ..Default::default()
            }],
            ..Default::default()
        });
        snap.unavailable = "no group is ready: group 0 is StartingDecode".into();
        snap.spec_error = Some("spec.groups: -1 is less than the minimum 0".into());
        let text = render(&snap, now).join("\n");
        for want in [
            "demo · generation 2",
            "http://127.0.0.1:8000/v1",
            "requests now get 503: no group is ready",
            "the file's latest version is not used: spec.groups",
            "StartingDecode",
            "MemberNotReady 12s ago",
            "SIGKILL after 30s",
        ] {
            assert!(text.contains(want), "{want:?} not in\n{text}");
        }
    }
}
