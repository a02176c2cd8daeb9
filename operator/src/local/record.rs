//! The local runtime's record: the observable history of what it did, in order (what
//! Events and the pods' history are on a cluster), each entry also a log line.

use std::collections::VecDeque;

use k8s_openapi::jiff::Timestamp;
use serde::Serialize;
use tracing::{info, warn};

use crate::reasons::EventReason;

/// What a record entry is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum EntryKind {
    /// A planner event (co-restart, phase change, scale-down).
    Event,
    Started,
    /// SIGTERM sent for a planned delete.
    Terminating,
    /// SIGKILL sent (grace period over, or no start within the startup allowance).
    Killed,
    Exited,
    /// An exited process deleted by the planner.
    Removed,
    Ready,
    NotReady,
    GateOpened,
    GateClosed,
    /// A group object (key, bootstrap addresses, client endpoint) made or removed.
    Object,
    /// The manifest was reloaded (or could not be).
    Spec,
    /// An action could not be carried out.
    Failed,
    /// An in-place reset call was made to a member.
    Resetting,
    /// A member answered that it serves its new incarnation (reset in place).
    Reset,
}

/// One line of the runtime's record: the observable history of what it did, in order.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    pub seq: u64,
    pub time: Timestamp,
    pub kind: EntryKind,
    pub warning: bool,
    /// -1 when not about one group.
    pub group: i32,
    pub pod: Option<String>,
    /// A planner Event's reason (`MemberFailed`, `GroupPhaseChanged`, …) or the runtime's
    /// own (`SpecChanged`, …); shown as `""` when the entry has none.
    #[serde(serialize_with = "reason_or_empty")]
    pub reason: Option<EventReason>,
    pub message: String,
}

fn reason_or_empty<S: serde::Serializer>(r: &Option<EventReason>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.map_or("", EventReason::as_str))
}

/// The newest entries, oldest first.
#[derive(Debug, Default)]
pub struct Record {
    next: u64,
    entries: VecDeque<Entry>,
}

const RECORD_CAPACITY: usize = 2000;

impl Record {
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        time: Timestamp,
        kind: EntryKind,
        warning: bool,
        group: i32,
        pod: Option<&str>,
        reason: Option<EventReason>,
        message: String,
    ) {
        let entry = Entry {
            seq: self.next,
            time,
            kind,
            warning,
            group,
            pod: pod.map(str::to_string),
            reason,
            message,
        };
        self.next += 1;
        // Only the fields that are set appear on the log line.
        let pod = entry.pod.as_deref();
        let group = (group >= 0).then_some(group);
        let reason = reason.map(EventReason::as_str);
        if warning {
            warn!(kind = ?entry.kind, group, pod, reason, "{}", entry.message);
        } else {
            info!(kind = ?entry.kind, group, pod, reason, "{}", entry.message);
        }
        if self.entries.len() == RECORD_CAPACITY {
            self.entries.pop_front();
        }
        self.entries.push_back(entry);
    }

    pub fn entries(&self) -> impl DoubleEndedIterator<Item = &Entry> + ExactSizeIterator {
        self.entries.iter()
    }
}
