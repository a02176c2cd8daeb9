//! API keys of the public OpenAI endpoints (the router's and a decode's OpenAI port): how
//! they are given, how a request's `Authorization: Bearer <key>` is checked, and the 401
//! answer, shared by every host so that they behave alike (as llama-server and vLLM do
//! with `--api-key`).
//!
//! - Keys come from a flag or its variable ([`API_KEY`]: one key) and a keys file
//!   ([`API_KEY_FILE`]: one key a line, blank lines and `#` comments skipped); both may
//!   be given, and every key of both is accepted. No key at all: the endpoint is open.
//! - A key is compared in constant time against every configured key (no early exit, no
//!   length-dependent shortcut), and never appears in an error, a log line or `Debug`.
//! - Only the API is gated: each host keeps its health, readiness and metrics paths open
//!   to probes and scrapers.

use std::fmt;
use std::path::Path;

use super::Setting;

/// One key (`--api-key`); a key never belongs on a command line that others can read, so
/// the variable is the better channel.
pub const API_KEY: Setting = Setting {
    flag: "api-key",
    env: "TANDEM_API_KEY",
};
/// A file of keys, one a line (`--api-key-file`).
pub const API_KEY_FILE: Setting = Setting {
    flag: "api-key-file",
    env: "TANDEM_API_KEY_FILE",
};

/// Why keys could not be read; names the file and line, never a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeysError(pub String);

impl fmt::Display for KeysError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KeysError {}

/// The accepted keys. Empty: every request is let through.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ApiKeys {
    keys: Vec<Box<[u8]>>,
}

// Manual: a derived Debug would print the keys.
impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ApiKeys({} key(s))", self.keys.len())
    }
}

/// Why a request was refused (401).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization` header.
    Missing,
    /// An `Authorization` header that is not `Bearer <key>`.
    NotBearer,
    /// A bearer key that is not one of the configured keys.
    Invalid,
}

impl Refusal {
    /// The error's `code` and the metric reason label.
    pub fn code(self) -> &'static str {
        match self {
            Self::Missing => "missing_api_key",
            Self::NotBearer => "invalid_authorization_header",
            Self::Invalid => "invalid_api_key",
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            Self::Missing => {
                "no API key: send it as the header Authorization: Bearer <key> (this endpoint was started with API keys)"
            }
            Self::NotBearer => {
                "the Authorization header must be Bearer <key> (this endpoint was started with API keys)"
            }
            Self::Invalid => "the API key is not valid for this endpoint",
        }
    }

    /// The 401 body in OpenAI's error shape. The messages hold no quote or backslash, so
    /// they need no escaping (a test holds that).
    pub fn body(self) -> String {
        format!(
            r#"{{"error":{{"message":"{}","type":"invalid_request_error","param":null,"code":"{}"}}}}"#,
            self.message(),
            self.code()
        )
    }
}

/// The `WWW-Authenticate` value of a 401 (RFC 6750).
pub const WWW_AUTHENTICATE: &str = "Bearer";

/// Keys may be any visible ASCII but whitespace, so that they fit in a header unchanged.
fn check_key(key: &str) -> Result<(), &'static str> {
    if key.is_empty() {
        return Err("is empty");
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(
            "has a character that is not visible ASCII (spaces and control characters cannot be sent in a header)",
        );
    }
    Ok(())
}

/// Equal in time that depends only on the longer length, never on where they differ.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = (a.len() != b.len()) as u8;
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

impl ApiKeys {
    /// No keys: the endpoint is open.
    pub fn none() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Keys from the flag (`key`) and the text of a keys file (`file`: its name, for
    /// errors, and its text).
    pub fn from_parts(key: Option<&str>, file: Option<(&str, &str)>) -> Result<Self, KeysError> {
        let mut keys = Vec::new();
        if let Some(k) = key {
            let k = k.trim();
            check_key(k).map_err(|why| {
                KeysError(format!(
                    "--{} (or {}): the key {why}",
                    API_KEY.flag, API_KEY.env
                ))
            })?;
            keys.push(k.as_bytes().into());
        }
        if let Some((name, text)) = file {
            let before = keys.len();
            for (i, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                check_key(line)
                    .map_err(|why| KeysError(format!("{name} line {}: the key {why}", i + 1)))?;
                keys.push(line.as_bytes().into());
            }
            if keys.len() == before {
                return Err(KeysError(format!(
                    "{name}: no key in the file (one key a line; blank lines and # comments are skipped)"
                )));
            }
        }
        Ok(Self { keys })
    }

    /// Keys from the flag and a keys file on disk.
    pub fn load(key: Option<&str>, file: Option<&Path>) -> Result<Self, KeysError> {
        let text = match file {
            Some(p) => Some(std::fs::read_to_string(p).map_err(|e| {
                KeysError(format!(
                    "--{} {}: cannot be read: {e}",
                    API_KEY_FILE.flag,
                    p.display()
                ))
            })?),
            None => None,
        };
        let name = file.map(|p| p.display().to_string()).unwrap_or_default();
        Self::from_parts(key, text.as_deref().map(|t| (name.as_str(), t)))
    }

    /// Check a request's `Authorization` header value. Always `Ok` without keys.
    pub fn check(&self, authorization: Option<&[u8]>) -> Result<(), Refusal> {
        if self.keys.is_empty() {
            return Ok(());
        }
        let value = authorization.ok_or(Refusal::Missing)?;
        let given = bearer(value).ok_or(Refusal::NotBearer)?;
        // Every key is compared, so the time says nothing about which one matched.
        let mut ok = false;
        for k in &self.keys {
            ok |= ct_eq(k, given);
        }
        if ok { Ok(()) } else { Err(Refusal::Invalid) }
    }
}

/// The key of `Bearer <key>` (the scheme in any case, spaces after it skipped).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let scheme = value.get(..7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let key = value[7..].trim_ascii();
    (!key.is_empty()).then_some(key)
}
