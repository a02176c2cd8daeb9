//! Polling with a deadline: every wait in the suite names what it waited for and shows the
//! last observation when it gives up.

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

/// Poll `probe` every `every` until it returns `Ok(Some(v))`, at most `within`.
/// `Ok(None)` means "not yet"; an `Err` is remembered as the last observation and polling
/// continues (the API server may be briefly unavailable).
pub async fn until<T, F, Fut>(
    what: &str,
    within: Duration,
    every: Duration,
    mut probe: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let start = Instant::now();
    let mut last;
    loop {
        match probe().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => last = "not yet".into(),
            Err(e) => last = format!("{e:#}"),
        }
        if start.elapsed() >= within {
            bail!("timed out after {within:?} waiting for {what}; last: {last}");
        }
        tokio::time::sleep(every).await;
    }
}

/// Like [`until`], but the probe reports what it saw, so a timeout shows it.
pub async fn until_seen<T, S, F, Fut>(
    what: &str,
    within: Duration,
    every: Duration,
    mut probe: F,
) -> Result<T>
where
    S: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<std::result::Result<T, S>>>,
{
    let start = Instant::now();
    let mut last;
    loop {
        match probe().await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(seen)) => last = format!("{seen:?}"),
            Err(e) => last = format!("error: {e:#}"),
        }
        if start.elapsed() >= within {
            bail!("timed out after {within:?} waiting for {what}; last seen: {last}");
        }
        tokio::time::sleep(every).await;
    }
}
