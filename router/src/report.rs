//! The two answers a decode gives the router (`tandem_contract::routing`), as the router
//! reads them.

use serde::Deserialize;

use crate::prefix::{BlockKey, parse_key};
use crate::{Error, Result};

/// `GET /tandem/report`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub block_tokens: usize,
    pub waiting: u32,
    pub running: u32,
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
    pub kv_cache_usage: f64,
    /// Bumped by every change of the prefix cache (0: never changed, or no prefix cache).
    pub prefix_version: u64,
    /// Left out when the prefix cache has not changed since the version asked about.
    #[serde(default)]
    pub keys: Option<Vec<String>>,
    /// How long its engine has had requests queued or running without a successful step
    /// (0: idle, or stepping). A decode that predates the field sends none: 0.
    #[serde(default)]
    pub engine_stalled_ms: u64,
}

/// `POST /tandem/prompt-keys`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PromptKeys {
    pub block_tokens: usize,
    pub prompt_tokens: usize,
    pub keys: Vec<String>,
}

/// Keys as numbers; a malformed one is an error naming it (a decode of another version).
pub fn parse_keys(keys: &[String]) -> Result<Vec<BlockKey>> {
    keys.iter()
        .map(|k| parse_key(k).ok_or_else(|| Error::Report(format!("{k:?} is not a block key"))))
        .collect()
}

pub fn parse_report(body: &[u8]) -> Result<Report> {
    serde_json::from_slice(body).map_err(|e| Error::Report(format!("the report is not valid: {e}")))
}

pub fn parse_prompt_keys(body: &[u8]) -> Result<PromptKeys> {
    serde_json::from_slice(body)
        .map_err(|e| Error::Report(format!("the prompt keys are not valid: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_parse_with_or_without_keys() {
        let r = parse_report(
            br#"{"blockTokens":16,"waiting":1,"running":2,"kvBlocksUsed":10,"kvBlocksTotal":512,
                "kvCacheUsage":0.02,"prefixVersion":7,"keys":["00000000000000ff"]}"#,
        )
        .unwrap();
        assert_eq!(
            r.keys.as_deref().map(parse_keys).unwrap().unwrap(),
            vec![255]
        );
        let r = parse_report(
            br#"{"blockTokens":16,"waiting":0,"running":0,"kvBlocksUsed":0,"kvBlocksTotal":512,
                "kvCacheUsage":0.0,"prefixVersion":7}"#,
        )
        .unwrap();
        assert_eq!(r.keys, None);
        assert_eq!(r.engine_stalled_ms, 0, "absent: not stalled");
        let r = parse_report(
            br#"{"blockTokens":16,"waiting":3,"running":1,"kvBlocksUsed":4,"kvBlocksTotal":512,
                "kvCacheUsage":0.01,"prefixVersion":7,"engineStalledMs":6200}"#,
        )
        .unwrap();
        assert_eq!(r.engine_stalled_ms, 6200);
        assert!(parse_report(b"{}").is_err());
        assert!(parse_keys(&["nope".into()]).is_err());
    }
}
