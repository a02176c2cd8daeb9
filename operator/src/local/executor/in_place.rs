//! The local executor's half of an in-place reset (`ResetMember`): ask the member over
//! its admin call, in the background ([`Processes::reset`]), and take its answer
//! ([`LocalExecutor::on_reset`]), which moves the member's incarnation on.

use k8s_openapi::jiff::Timestamp;

use super::{EntryKind, LocalExecutor, Processes, ResetCall};
use crate::executor::MemberReset;
use crate::local::member::ProbeOutcome;
use crate::reset_call::ResetReply;

impl<P: Processes> LocalExecutor<P> {
    pub(super) fn reset(&mut self, r: &MemberReset<'_>, now: Timestamp) {
        let Some(m) = self.members.get_mut(r.pod) else {
            return;
        };
        if !m.alive()
            || m.terminating.is_some()
            || m.incarnation >= r.to_incarnation
            || m.resetting == Some(r.to_incarnation)
        {
            // Gone (the planner falls back), already there, or asked already.
            return;
        }
        let group = m.group;
        let Some(key) = self.objects.keys.get(&group) else {
            let msg = format!(
                "cannot ask {} to reset in place: group {group} has no key",
                r.pod
            );
            self.record
                .push(now, EntryKind::Failed, true, group, Some(r.pod), None, msg);
            return;
        };
        m.resetting = Some(r.to_incarnation);
        let call = ResetCall {
            pod: m.name.clone(),
            http: m.http,
            role: m.role,
            to_incarnation: r.to_incarnation,
            key: key.clone(),
            timeout: r.timeout,
        };
        let msg = format!(
            "asked {} {} (pid {}) to reset in place: incarnation {} → {}",
            m.role.as_str(),
            m.name,
            m.pid,
            r.from_incarnation,
            r.to_incarnation
        );
        self.processes.reset(&call);
        self.record.push(
            now,
            EntryKind::Resetting,
            false,
            group,
            Some(r.pod),
            None,
            msg,
        );
    }

    /// The answer of a reset call: on ready, the member serves `to` (and is ready there, in
    /// its own words: no probe period is waited for). Returns true (the planner runs
    /// again either way: it asks again or moves on).
    pub fn on_reset(&mut self, pod: &str, to: i64, reply: ResetReply, now: Timestamp) -> bool {
        let Some(m) = self.members.get_mut(pod) else {
            return false;
        };
        if m.resetting == Some(to) {
            m.resetting = None;
        }
        if !m.alive() || m.terminating.is_some() {
            return false;
        }
        let group = m.group;
        match reply {
            ResetReply::Ready {
                reset,
                incarnation,
                took_ms,
            } => {
                if m.incarnation < to {
                    m.incarnation = to;
                    m.resets += 1;
                }
                let threshold = m.health.failure_threshold;
                m.readiness.record(ProbeOutcome::Ready, threshold, now);
                let what = if reset {
                    "reset in place"
                } else {
                    "already served"
                };
                let msg = format!(
                    "{} {pod} (pid {}) {what} incarnation {to} and is ready ({took_ms} ms; process incarnation {incarnation}; weights kept)",
                    m.role.as_str(),
                    m.pid,
                );
                self.record
                    .push(now, EntryKind::Reset, false, group, Some(pod), None, msg);
            }
            other => {
                let why = match &other {
                    ResetReply::Refused {
                        status,
                        reason,
                        message,
                    } => format!("answered {status} {reason}: {message}"),
                    ResetReply::Failed(e) => e.clone(),
                    ResetReply::Ready { .. } => unreachable!("matched above"),
                };
                let msg = format!(
                    "{} {pod} did not reset to incarnation {to}: {why}",
                    m.role.as_str()
                );
                self.record
                    .push(now, EntryKind::Failed, true, group, Some(pod), None, msg);
            }
        }
        true
    }
}
