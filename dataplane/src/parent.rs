//! Dying with the parent process.
//!
//! The local runtime (`tandem-operator local`) starts each dataplane as a child process and
//! passes its own PID in [`PARENT_PID_ENV`]. The child then asks the kernel to SIGKILL it
//! when its parent dies (`PR_SET_PDEATHSIG`), so no dataplane outlives the runtime even when
//! the runtime itself is SIGKILLed and has no chance to stop its children.
//!
//! The request can only be made by the child, after it started. If the parent died before
//! that, the child has already been re-parented (to init or a subreaper) and the kernel would
//! never send the signal; so the child checks that its parent is still the PID it was given,
//! and exits if not.
//!
//! Note: the kernel sends the signal when the parent *thread* that forked the child exits,
//! so the runtime starts children from a thread that lives as long as it does.
//!
//! Without the variable (a pod, or a process started by hand) nothing is done.

use nix::sys::prctl;
use nix::sys::signal::Signal;
use nix::unistd::getppid;

/// Environment variable holding the PID of the process this one must die with.
pub const PARENT_PID_ENV: &str = "TANDEM_PARENT_PID";

#[derive(Debug, thiserror::Error)]
pub enum ParentError {
    #[error("{PARENT_PID_ENV}={0:?} is not a process id")]
    BadPid(String),
    #[error("cannot ask to be killed with the parent (PR_SET_PDEATHSIG): {0}")]
    Prctl(nix::Error),
    #[error(
        "the parent process {expected} ({PARENT_PID_ENV}) is already gone (parent is now {actual}); exiting"
    )]
    ParentGone { expected: i32, actual: i32 },
}

/// If [`PARENT_PID_ENV`] is set, die with that process (see the module header).
pub fn die_with_parent() -> Result<(), ParentError> {
    let Some(value) = std::env::var_os(PARENT_PID_ENV) else {
        return Ok(());
    };
    let value = value.to_string_lossy();
    let pid = value
        .trim()
        .parse::<i32>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ParentError::BadPid(value.to_string()))?;
    die_with(pid)
}

/// Ask for SIGKILL when the parent dies, then check the parent is still `parent`.
pub fn die_with(parent: i32) -> Result<(), ParentError> {
    prctl::set_pdeathsig(Signal::SIGKILL).map_err(ParentError::Prctl)?;
    let actual = getppid().as_raw();
    if actual != parent {
        return Err(ParentError::ParentGone {
            expected: parent,
            actual,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_real_parent_is_accepted_and_the_death_signal_is_set() {
        let parent = getppid().as_raw();
        die_with(parent).unwrap();
        assert_eq!(prctl::get_pdeathsig().unwrap(), Some(Signal::SIGKILL));
    }

    #[test]
    fn a_parent_that_is_gone_is_an_error() {
        let parent = getppid().as_raw();
        let err = die_with(parent + 1_000_000).unwrap_err();
        assert!(
            matches!(err, ParentError::ParentGone { expected, actual } if expected == parent + 1_000_000 && actual == parent),
            "{err}"
        );
    }
}
