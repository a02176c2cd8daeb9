//! Picks up edits of the manifest: the file is read once a second and, when its bytes
//! changed, checked again and sent to the runtime (valid or not; the runtime keeps the
//! running spec when it is not). Polling the content, not a notification API, follows
//! editors that replace the file instead of writing it in place; a file missing for one
//! poll (mid-replace) is not reported.

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;

use super::manifest;
use super::runtime::Input;

pub const POLL: Duration = Duration::from_secs(1);

/// Watch `file`, whose current content is `seen`, until the runtime goes away.
pub async fn run(file: PathBuf, mut seen: Vec<u8>, tx: UnboundedSender<Input>) {
    // Consecutive polls that could not read the file; reported at the second.
    let mut failed = 0u32;
    loop {
        tokio::time::sleep(POLL).await;
        let bytes = match std::fs::read(&file) {
            Ok(b) => {
                failed = 0;
                b
            }
            Err(e) => {
                failed += 1;
                if failed == 2 {
                    let msg = format!("{}: cannot read: {e}", file.display());
                    if tx.send(Input::Manifest(Err(msg))).is_err() {
                        return;
                    }
                    // Whatever comes back is read again.
                    seen.clear();
                }
                continue;
            }
        };
        if bytes == seen {
            continue;
        }
        seen = bytes;
        if tx
            .send(Input::Manifest(manifest::load(&file).map(Box::new)))
            .is_err()
        {
            return;
        }
    }
}
