//! Prometheus metrics of the serving layer, shared by the HTTP handlers and the engine
//! thread (all handles are atomics, so updating them never blocks).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    /// Every failed or aborted generation, by reason (queue_timeout, client_disconnected...).
    pub failures: Family<ReasonLabels, Counter>,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub running: Gauge,
    pub waiting: Gauge,
    pub kv_blocks_used: Gauge,
    pub kv_blocks_free: Gauge,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("tandem");
        let requests = Family::<RequestLabels, Counter>::default();
        let failures = Family::<ReasonLabels, Counter>::default();
        let prompt_tokens = Counter::default();
        let generated_tokens = Counter::default();
        // 1 ms .. ~65 s
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 17));
        let inter_token = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let (running, waiting) = (Gauge::default(), Gauge::default());
        let (kv_blocks_used, kv_blocks_free) = (Gauge::default(), Gauge::default());
        registry.register(
            "http_requests",
            "HTTP requests by endpoint and status code",
            requests.clone(),
        );
        registry.register(
            "request_failures",
            "Failed or aborted generations by reason",
            failures.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens processed",
            prompt_tokens.clone(),
        );
        registry.register(
            "generation_tokens",
            "Tokens generated",
            generated_tokens.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Request arrival to first token",
            ttft.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Time between consecutive tokens",
            inter_token.clone(),
        );
        registry.register(
            "requests_running",
            "Requests in the running batch",
            running.clone(),
        );
        registry.register(
            "requests_waiting",
            "Requests waiting for admission",
            waiting.clone(),
        );
        registry.register(
            "kv_blocks_used",
            "KV cache blocks in use",
            kv_blocks_used.clone(),
        );
        registry.register(
            "kv_blocks_free",
            "KV cache blocks free",
            kv_blocks_free.clone(),
        );
        Self {
            registry,
            requests,
            failures,
            prompt_tokens,
            generated_tokens,
            ttft,
            inter_token,
            running,
            waiting,
            kv_blocks_used,
            kv_blocks_free,
        }
    }

    pub fn fail(&self, reason: &str) {
        self.failures
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub fn request(&self, endpoint: &str, status: u16) {
        let l = RequestLabels {
            endpoint: endpoint.to_owned(),
            status: status.to_string(),
        };
        self.requests.get_or_create(&l).inc();
    }

    pub fn encode(&self) -> String {
        let mut s = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
