//! What the runtime's task is told, by the member processes, their probes, the manifest
//! watch and the signal handler (one channel; a leaf, so that those senders need not know
//! the runtime).

use super::manifest::Manifest;
use super::member::ProbeOutcome;
use crate::reset_call::ResetReply;

/// What the runtime's task is told.
#[derive(Debug)]
pub enum Input {
    Exited {
        pod: String,
        how: String,
        success: bool,
    },
    Probe {
        pod: String,
        outcome: ProbeOutcome,
    },
    /// The answer of an in-place reset call to a member.
    Reset {
        pod: String,
        to_incarnation: i64,
        reply: ResetReply,
    },
    /// The manifest file changed: its new content, checked.
    Manifest(Result<Box<Manifest>, String>),
    /// SIGINT, SIGTERM or SIGHUP.
    Stop {
        signal: &'static str,
    },
}
