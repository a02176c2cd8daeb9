//! The pure parts of an in-place reset (docs/in-place-reset.md): what a reset call asks
//! for given where the member is (`decide`), whether its `Authorization` proves the group
//! key (`check_authorization`), and the outcomes it is counted under. The I/O (stopping
//! and starting the KV channel) is `slot`; the HTTP call is `server::reset`.

use tandem_contract::MemberRole;
use tandem_contract::reset::{AUTH_SCHEME, proof_message};

use crate::kv::auth::GroupKey;

/// What a reset call to `asked` does on a member at group incarnation `current`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// SIGTERM came first: the member is going away, it resets nothing (409 `draining`).
    Draining,
    /// `asked` is older than the member's incarnation (409 `stale_incarnation`): a late or
    /// replayed call, never a step back.
    Stale,
    /// The member is at `asked` already (or a reset to it just finished): nothing to do;
    /// the call only waits for readiness (the operator repeats calls on every reconcile).
    Noop,
    /// End the channel at `current` and start it again at `asked`.
    Reset,
}

pub fn decide(current: u64, asked: u64, draining: bool) -> Decision {
    if draining {
        Decision::Draining
    } else if asked < current {
        Decision::Stale
    } else if asked == current {
        Decision::Noop
    } else {
        Decision::Reset
    }
}

/// How a reset call ended: the `outcome` label of `tandem_resets_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Reset, and ready at the new incarnation within the call's timeout.
    Done,
    /// Already at the incarnation, and ready.
    Noop,
    /// Reset (or already at the incarnation) but not ready within the timeout (504).
    Incomplete,
    /// An older incarnation than the member's (409).
    Stale,
    /// No, a malformed or a wrong proof (401).
    Unauthorized,
    /// The member is shutting down (409).
    Draining,
    /// The channel could not be started again at the new incarnation (500).
    Failed,
}

impl Outcome {
    pub const ALL: [Outcome; 7] = [
        Self::Done,
        Self::Noop,
        Self::Incomplete,
        Self::Stale,
        Self::Unauthorized,
        Self::Draining,
        Self::Failed,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::Noop => "noop",
            Self::Incomplete => "incomplete",
            Self::Stale => "stale",
            Self::Unauthorized => "unauthorized",
            Self::Draining => "draining",
            Self::Failed => "failed",
        }
    }
}

/// Why an `Authorization` header does not prove the group key. The messages never quote
/// the header: a proof is a credential for its incarnation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProofError {
    Missing,
    /// Another scheme, or not 64 hex digits.
    Malformed,
    /// A well-formed proof of another key, role or incarnation.
    Wrong,
}

impl ProofError {
    pub fn message(self) -> String {
        match self {
            Self::Missing => {
                format!("the reset call needs the header 'Authorization: {AUTH_SCHEME} <proof>'")
            }
            Self::Malformed => format!(
                "the Authorization header is not '{AUTH_SCHEME} <proof>' with the proof as 64 \
                 hex digits"
            ),
            Self::Wrong => "the proof does not verify with this member's group key for its role \
                            and the group incarnation asked for"
                .to_owned(),
        }
    }
}

/// The proof of a reset of a `role` member to `group_incarnation`: lowercase hex
/// HMAC-SHA256 of [`proof_message`] keyed by the group key (what an executor sends).
pub fn proof(key: &GroupKey, role: MemberRole, group_incarnation: u64) -> String {
    hex::encode(key.sign_message(proof_message(role, group_incarnation).as_bytes()))
}

/// Check an `Authorization` header (`None`: absent) against the proof of a reset of this
/// `role` member to `group_incarnation`. The scheme is matched without regard to case, as
/// HTTP auth schemes are; the MAC is compared in constant time.
pub fn check_authorization(
    header: Option<&[u8]>,
    key: &GroupKey,
    role: MemberRole,
    group_incarnation: u64,
) -> Result<(), ProofError> {
    let header = header.ok_or(ProofError::Missing)?;
    let text = std::str::from_utf8(header).map_err(|_| ProofError::Malformed)?;
    let (scheme, value) = text.trim().split_once(' ').ok_or(ProofError::Malformed)?;
    if !scheme.eq_ignore_ascii_case(AUTH_SCHEME) {
        return Err(ProofError::Malformed);
    }
    let value = value.trim();
    if value.len() != 64 {
        return Err(ProofError::Malformed);
    }
    let mac = hex::decode(value).map_err(|_| ProofError::Malformed)?;
    let message = proof_message(role, group_incarnation);
    if key.verify_message(message.as_bytes(), &mac) {
        Ok(())
    } else {
        Err(ProofError::Wrong)
    }
}

#[cfg(test)]
mod tests;
