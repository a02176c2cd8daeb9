//! The router's metrics (`tandem_router_*`, docs/routing.md). Every request ends in one
//! `requests_total` sample by outcome; every failed attempt, report and prompt-keys call
//! is counted by reason.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WhyLabel {
    pub why: String,
}

/// Every outcome of a request, so that each series exists from the start.
pub const OUTCOMES: &[&str] = &[
    "forwarded",
    "retried",
    "failed",
    "no_ready_group",
    "unauthorized",
    "body_too_large",
    "bad_request",
];

/// Reasons an attempt fails before the first byte of its answer.
pub const ATTEMPT_FAILURES: &[&str] = &[
    "connect_failed",
    "closed_before_response",
    "closed_before_first_byte",
    "engine_stalled",
    "decode_unresponsive",
    "group_not_ready",
    "status_500",
    "status_502",
    "status_503",
    "status_504",
    "status_5xx",
];

#[derive(Clone)]
pub struct RouterMetrics {
    /// `/v1/*` requests by outcome: `forwarded` (the first decode answered), `retried` (the
    /// second did, after the first failed before its first byte), `failed` (no decode
    /// answered), `no_ready_group`, `unauthorized`, `body_too_large`, `bad_request`.
    pub requests: Family<OutcomeLabel, Counter>,
    /// Attempts that failed before the first byte reached the client, by reason.
    pub attempt_failures: Family<ReasonLabel, Counter>,
    /// Requests sent to a second decode.
    pub retries: Counter,
    /// Answers that broke off after their first byte (never retried: the client has part
    /// of an answer).
    pub broken_answers: Counter,
    /// Why the first decode was chosen: `session`, `prefix`, `load`, `round_robin`.
    pub choices: Family<WhyLabel, Counter>,
    /// Whole prompt blocks of routed requests, and of those the blocks the chosen decode
    /// held (their ratio: the routing's prefix hit rate).
    pub prompt_blocks: Counter,
    pub matched_blocks: Counter,
    /// Calls for a prompt's block keys that failed (the request was routed by load).
    pub prompt_keys_failures: Family<ReasonLabel, Counter>,
    pub prompt_keys_seconds: Histogram,
    /// Decode reports that failed, by reason (`unreachable`, `status`, `invalid`).
    pub report_failures: Family<ReasonLabel, Counter>,
    /// Requests refused 401, by reason (`missing_api_key`, `invalid_api_key`, ...).
    pub auth_refusals: Family<ReasonLabel, Counter>,
}

impl RouterMetrics {
    /// Create and register in `r` (give it a registry prefixed `tandem_router`).
    pub fn register(r: &mut Registry) -> Self {
        let m = Self {
            requests: Family::default(),
            attempt_failures: Family::default(),
            retries: Counter::default(),
            broken_answers: Counter::default(),
            choices: Family::default(),
            prompt_blocks: Counter::default(),
            matched_blocks: Counter::default(),
            prompt_keys_failures: Family::default(),
            prompt_keys_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            report_failures: Family::default(),
            auth_refusals: Family::default(),
        };
        r.register(
            "requests",
            "Requests to /v1/* by outcome",
            m.requests.clone(),
        );
        r.register(
            "attempt_failures",
            "Attempts that failed before the first byte of their answer, by reason",
            m.attempt_failures.clone(),
        );
        r.register(
            "retries",
            "Requests sent to a second decode after the first failed before its first byte",
            m.retries.clone(),
        );
        r.register(
            "broken_answers",
            "Answers that broke off after their first byte reached the client",
            m.broken_answers.clone(),
        );
        r.register(
            "choices",
            "First choices of the policy by why: session, prefix, load, round_robin",
            m.choices.clone(),
        );
        r.register(
            "prompt_blocks",
            "Whole KV blocks of the prompts of routed requests",
            m.prompt_blocks.clone(),
        );
        r.register(
            "matched_blocks",
            "Prompt blocks the chosen decode held in its prefix cache (hit rate: matched / prompt)",
            m.matched_blocks.clone(),
        );
        r.register(
            "prompt_keys_failures",
            "Calls for a prompt's block keys that failed, by reason (the request was routed by load)",
            m.prompt_keys_failures.clone(),
        );
        r.register(
            "prompt_keys_seconds",
            "Time to get a prompt's block keys from a decode",
            m.prompt_keys_seconds.clone(),
        );
        r.register(
            "report_failures",
            "Decode reports (load and prefix-cache keys) that failed, by reason",
            m.report_failures.clone(),
        );
        r.register(
            "auth_refusals",
            "Requests refused 401 for their API key, by reason",
            m.auth_refusals.clone(),
        );
        for o in OUTCOMES {
            let _ = m.requests.get_or_create(&OutcomeLabel {
                outcome: (*o).into(),
            });
        }
        for reason in ATTEMPT_FAILURES {
            let _ = m.attempt_failures.get_or_create(&ReasonLabel {
                reason: (*reason).into(),
            });
        }
        m
    }

    pub fn outcome(&self, outcome: &str) {
        self.requests
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc();
    }

    pub fn attempt_failed(&self, reason: &str) {
        self.attempt_failures
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn choice(&self, why: &str) {
        self.choices
            .get_or_create(&WhyLabel { why: why.into() })
            .inc();
    }

    pub fn prompt_keys_failed(&self, reason: &str) {
        self.prompt_keys_failures
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn report_failed(&self, reason: &str) {
        self.report_failures
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    pub fn auth_refused(&self, reason: &str) {
        self.auth_refusals
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }
}
