//! Prometheus metrics of the serving layer, shared by the HTTP handlers and the engine
//! thread (all handles are atomics, so updating them never blocks), and the prefix
//! cache's report for routers (`prefix_report`: its keys behind a lock taken only to copy
//! them).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub status: String,
}

/// `cache_config_info`'s labels (vLLM's names: endpoint pickers read the block size there).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheConfigLabels {
    pub block_size: String,
    pub num_gpu_blocks: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

/// One label for the KV protocol families (the label name differs per family).
macro_rules! label {
    ($name:ident, $field:ident) => {
        #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
        pub struct $name {
            pub $field: String,
        }
    };
}
label!(KindLabels, kind);
label!(ResultLabels, result);
label!(LoopLabels, r#loop);
label!(PeerLabels, peer);
label!(DirectionLabels, direction);
label!(OutcomeLabels, outcome);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoomLabels {
    pub state: String,
    pub reason: String,
}

/// KV transfer protocol metrics (PD roles). Every failure path has a reason label.
pub struct KvMetrics {
    /// Rooms opened; every one ends in exactly one `rooms` sample.
    pub rooms_opened: Counter,
    /// Rooms by terminal state (done, failed, aborted) and reason.
    pub rooms: Family<RoomLabels, Counter>,
    pub transfer_bytes: Family<DirectionLabels, Counter>,
    pub ping_rtt: Histogram,
    pub handshakes: Family<ResultLabels, Counter>,
    /// Dropped inbound messages by kind (decode error kinds, unexpected, unauthenticated).
    pub malformed: Family<KindLabels, Counter>,
    pub loop_restarts: Family<LoopLabels, Counter>,
    pub peer_incarnation_changes: Counter,
    pub send_failures: Family<ResultLabels, Counter>,
    /// KV blocks held by rooms still in transfer, per peer.
    pub blocks_in_transfer: Family<PeerLabels, Gauge>,
    /// Prefill: authenticated decode sessions it keeps state for.
    pub sessions: Gauge,
    /// Prefill: decode sessions dropped, by reason (expired, peer_restarted, capacity,
    /// peer_shutdown).
    pub sessions_dropped: Family<ReasonLabels, Counter>,
    /// Decode: PROGRESS messages that refreshed a room's deadline.
    pub progress: Counter,
    /// Decode: GOODBYE messages from prefills (a prefill began shutting down).
    pub peer_goodbye: Counter,
    /// Decode: TCP connections to a prefill that closed (socket monitor).
    pub peer_disconnects: Counter,
    /// Decode: sessions ended because the prefill left a PING unanswered past the channel
    /// deadline.
    pub peer_unresponsive: Counter,
    /// Prefill: KV bytes sent to decodes and not yet acknowledged (CREDIT), all sessions.
    pub bytes_in_flight: Gauge,
}

impl KvMetrics {
    fn register(r: &mut Registry) -> Self {
        let m = Self {
            rooms_opened: Counter::default(),
            rooms: Family::default(),
            transfer_bytes: Family::default(),
            ping_rtt: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            handshakes: Family::default(),
            malformed: Family::default(),
            loop_restarts: Family::default(),
            peer_incarnation_changes: Counter::default(),
            send_failures: Family::default(),
            blocks_in_transfer: Family::default(),
            sessions: Gauge::default(),
            sessions_dropped: Family::default(),
            progress: Counter::default(),
            peer_goodbye: Counter::default(),
            peer_disconnects: Counter::default(),
            peer_unresponsive: Counter::default(),
            bytes_in_flight: Gauge::default(),
        };
        r.register(
            "kv_rooms_opened",
            "KV transfer rooms opened",
            m.rooms_opened.clone(),
        );
        r.register(
            "kv_rooms",
            "Finished KV transfer rooms by terminal state and reason",
            m.rooms.clone(),
        );
        r.register(
            "kv_transfer_bytes",
            "KV bytes moved, by direction",
            m.transfer_bytes.clone(),
        );
        r.register(
            "kv_ping_rtt_seconds",
            "PING/PONG round trip over the KV channel",
            m.ping_rtt.clone(),
        );
        r.register(
            "kv_handshakes",
            "KV channel handshakes by result",
            m.handshakes.clone(),
        );
        r.register(
            "kv_malformed_messages",
            "Dropped KV protocol messages by kind",
            m.malformed.clone(),
        );
        r.register(
            "kv_loop_restarts",
            "Supervised KV loop restarts after a panic",
            m.loop_restarts.clone(),
        );
        r.register(
            "kv_peer_incarnation_changes",
            "Peers seen with a new process incarnation",
            m.peer_incarnation_changes.clone(),
        );
        r.register(
            "kv_send_failures",
            "KV messages that could not be sent, by reason",
            m.send_failures.clone(),
        );
        r.register(
            "kv_transfer_blocks_held",
            "KV blocks held by rooms in transfer",
            m.blocks_in_transfer.clone(),
        );
        r.register(
            "kv_sessions",
            "Authenticated decode sessions held by the prefill",
            m.sessions.clone(),
        );
        r.register(
            "kv_sessions_dropped",
            "Decode sessions the prefill dropped, with their rooms, by reason",
            m.sessions_dropped.clone(),
        );
        r.register(
            "kv_progress_messages",
            "PROGRESS messages that kept a room waiting for KV alive",
            m.progress.clone(),
        );
        r.register(
            "kv_peer_goodbyes",
            "GOODBYE messages from KV peers that began shutting down",
            m.peer_goodbye.clone(),
        );
        r.register(
            "kv_peer_disconnects",
            "TCP connections to a prefill that closed (the rooms in flight fail peer_lost)",
            m.peer_disconnects.clone(),
        );
        r.register(
            "kv_peer_unresponsive",
            "Sessions ended because the prefill answered no PING within the channel deadline (the rooms in flight fail peer_unresponsive)",
            m.peer_unresponsive.clone(),
        );
        r.register(
            "kv_bytes_in_flight",
            "KV bytes sent to decodes and not yet acknowledged",
            m.bytes_in_flight.clone(),
        );
        m.touch_known_labels();
        m
    }

    /// Create every series whose labels are known in advance, at 0, so that a dashboard (or
    /// a test) sees a zero instead of a missing series, and a renamed label shows up as a
    /// missing series rather than as a silent zero.
    fn touch_known_labels(&self) {
        use crate::kv::{FailCode, RejectReason};
        for c in FailCode::ALL {
            let _ = self.rooms.get_or_create(&RoomLabels {
                state: "failed".into(),
                reason: c.label().into(),
            });
        }
        for (state, reason) in [
            ("done", "none"),
            ("aborted", "client_abort"),
            ("aborted", "abort_ack_timeout"),
            ("aborted", "shutdown"),
            ("aborted", "reset"),
        ] {
            let _ = self.rooms.get_or_create(&RoomLabels {
                state: state.into(),
                reason: reason.into(),
            });
        }
        for r in RejectReason::ALL {
            let _ = self.handshakes.get_or_create(&ResultLabels {
                result: r.label().into(),
            });
        }
        for r in ["ok", "timeout"] {
            let _ = self
                .handshakes
                .get_or_create(&ResultLabels { result: r.into() });
        }
        for r in [
            "queue_full_or_disconnected",
            "peer_unreachable",
            "socket_error",
            "byte_budget",
        ] {
            let _ = self
                .send_failures
                .get_or_create(&ResultLabels { result: r.into() });
        }
        for r in ["expired", "peer_restarted", "capacity", "peer_shutdown"] {
            let _ = self
                .sessions_dropped
                .get_or_create(&ReasonLabels { reason: r.into() });
        }
        for d in ["sent", "received"] {
            let _ = self.transfer_bytes.get_or_create(&DirectionLabels {
                direction: d.into(),
            });
        }
    }

    pub fn session_dropped(&self, reason: &str) {
        let _ = self
            .sessions_dropped
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub fn room(&self, state: &str, reason: &str) {
        let l = RoomLabels {
            state: state.to_owned(),
            reason: reason.to_owned(),
        };
        let _ = self.rooms.get_or_create(&l).inc();
    }

    pub fn malformed(&self, kind: &str) {
        self.malformed
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc();
    }

    pub fn handshake(&self, result: &str) {
        self.handshakes
            .get_or_create(&ResultLabels {
                result: result.to_owned(),
            })
            .inc();
    }

    pub fn send_failure(&self, reason: &str) {
        let _ = self
            .send_failures
            .get_or_create(&ResultLabels {
                result: reason.to_owned(),
            })
            .inc();
    }

    pub fn bytes(&self, direction: &str, n: usize) {
        let _ = self
            .transfer_bytes
            .get_or_create(&DirectionLabels {
                direction: direction.to_owned(),
            })
            .inc_by(n as u64);
    }
}

/// Prefix-cache metrics, published from the runner's cumulative counters by the engine.
pub struct PrefixCacheMetrics {
    /// Prompt tokens of requests that looked for a cached prefix.
    pub lookup_tokens: Counter,
    /// Prompt tokens found in the cache (hit rate = hit / lookup).
    pub hit_tokens: Counter,
    pub evictions: Counter,
    pub cached_blocks: Gauge,
}

impl PrefixCacheMetrics {
    fn register(r: &mut Registry) -> Self {
        let m = Self {
            lookup_tokens: Counter::default(),
            hit_tokens: Counter::default(),
            evictions: Counter::default(),
            cached_blocks: Gauge::default(),
        };
        r.register(
            "prefix_cache_lookup_tokens",
            "Prompt tokens of requests that looked for a cached prefix",
            m.lookup_tokens.clone(),
        );
        r.register(
            "prefix_cache_hit_tokens",
            "Prompt tokens whose KV came from the prefix cache (hit rate: hit / lookup)",
            m.hit_tokens.clone(),
        );
        r.register(
            "prefix_cache_evictions",
            "Idle prefix-cache blocks evicted for new blocks",
            m.evictions.clone(),
        );
        r.register(
            "prefix_cache_blocks",
            "KV blocks held by the prefix cache, in use or idle (idle ones count as free)",
            m.cached_blocks.clone(),
        );
        m
    }

    /// Bring the counters up to the runner's cumulative `kv.prefix` (`seen`: what was
    /// published before) and the gauge to its cached blocks.
    pub fn publish(
        &self,
        seen: &mut crate::engine_api::PrefixCacheCounters,
        kv: &crate::engine_api::KvUsage,
    ) {
        let now = kv.prefix;
        self.lookup_tokens
            .inc_by(now.lookup_tokens.saturating_sub(seen.lookup_tokens));
        self.hit_tokens
            .inc_by(now.hit_tokens.saturating_sub(seen.hit_tokens));
        self.evictions
            .inc_by(now.evictions.saturating_sub(seen.evictions));
        self.cached_blocks.set(kv.blocks_cached as i64);
        *seen = now;
    }
}

pub struct Metrics {
    registry: Registry,
    pub prefix_cache: PrefixCacheMetrics,
    pub kv: KvMetrics,
    pub requests: Family<RequestLabels, Counter>,
    /// Every failed or aborted generation, by reason (queue_timeout, client_disconnected...).
    pub failures: Family<ReasonLabels, Counter>,
    /// HTTP requests refused with a 4xx before any work, by reason (invalid_json, ...).
    pub rejected: Family<ReasonLabels, Counter>,
    /// HTTP connections that ended in a protocol or I/O error, by kind (parse_error,
    /// header_too_large, incomplete_request, io_error, ...).
    pub connection_errors: Family<KindLabels, Counter>,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub running: Gauge,
    pub waiting: Gauge,
    /// Forward steps of the engine, and the sequences they carried (their ratio is the
    /// mean batch: 1 means the requests ran one after another).
    pub engine_steps: Counter,
    pub engine_step_sequences: Counter,
    pub kv_blocks_used: Gauge,
    pub kv_blocks_free: Gauge,
    /// Times `/ready` found a member that was making progress stalled, by reason
    /// (`no_progress`): counted once per spell, when `/ready` first sees it.
    pub progress_stalls: Family<ReasonLabels, Counter>,
    /// In-place reset calls (`POST /admin/reset`), by outcome (`pd::reset::Outcome`).
    pub resets: Family<OutcomeLabels, Counter>,
    /// Turns of `/ready` to not ready, by the first failing check's reason (a change of
    /// reason while not ready counts again).
    pub not_ready: Family<ReasonLabels, Counter>,
    /// KV blocks in use over all blocks, 0 to 1 (the Gateway API Inference Extension's
    /// KVCacheUsage, named as vLLM's `kv_cache_usage_perc`; docs/routing.md).
    pub kv_cache_usage: Gauge<f64, AtomicU64>,
    /// 1, labelled with the KV block size and the blocks in the pool (`cache_config_info`).
    pub cache_config: Family<CacheConfigLabels, Gauge>,
    /// The prefix cache's keys for routers (`GET /tandem/report`).
    pub prefix_report: crate::prefix_report::PrefixReport,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("tandem");
        let requests = Family::<RequestLabels, Counter>::default();
        let failures = Family::<ReasonLabels, Counter>::default();
        let rejected = Family::<ReasonLabels, Counter>::default();
        let connection_errors = Family::<KindLabels, Counter>::default();
        let prompt_tokens = Counter::default();
        let generated_tokens = Counter::default();
        // 1 ms .. ~65 s
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 17));
        let inter_token = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let (running, waiting) = (Gauge::default(), Gauge::default());
        let (engine_steps, engine_step_sequences) = (Counter::default(), Counter::default());
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
            "http_rejected_requests",
            "HTTP requests refused with a client error, by reason",
            rejected.clone(),
        );
        registry.register(
            "http_connection_errors",
            "HTTP connections ended by a protocol or I/O error, by kind",
            connection_errors.clone(),
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
            "engine_steps",
            "Forward steps of the engine",
            engine_steps.clone(),
        );
        registry.register(
            "engine_step_sequences",
            "Sequences carried by the engine's forward steps (divided by the steps: the mean batch)",
            engine_step_sequences.clone(),
        );
        registry.register(
            "kv_blocks_used",
            "KV cache blocks in use",
            kv_blocks_used.clone(),
        );
        registry.register(
            "kv_blocks_free",
            "KV cache blocks free (idle prefix-cache blocks included)",
            kv_blocks_free.clone(),
        );
        let progress_stalls = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "progress_stalls",
            "Spells in which /ready found work making no progress (engine or KV transfers), by reason",
            progress_stalls.clone(),
        );
        let _ = progress_stalls.get_or_create(&ReasonLabels {
            reason: "no_progress".into(),
        });
        let not_ready = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "not_ready",
            "Turns of /ready to not ready, by the first failing check's reason",
            not_ready.clone(),
        );
        let resets = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "resets",
            "In-place reset calls (POST /admin/reset), by outcome",
            resets.clone(),
        );
        let kv_cache_usage = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "kv_cache_usage_perc",
            "KV blocks in use over all KV blocks, 0 to 1 (idle prefix-cache blocks count as free)",
            kv_cache_usage.clone(),
        );
        let cache_config = Family::<CacheConfigLabels, Gauge>::default();
        registry.register(
            "cache_config_info",
            "The KV cache's configuration in labels: block_size (tokens) and num_gpu_blocks (blocks in the pool, whatever the device)",
            cache_config.clone(),
        );
        let kv = KvMetrics::register(&mut registry);
        let prefix_cache = PrefixCacheMetrics::register(&mut registry);
        for reason in [
            "queue_full",
            "queue_timeout",
            "too_large",
            "invalid_request",
            "step_failed",
            "engine_stopped",
            "kv_transfer",
            "client_disconnected",
            "drain_deadline",
            "shutdown",
            "reset",
            "accept_error",
        ] {
            let _ = failures.get_or_create(&ReasonLabels {
                reason: reason.into(),
            });
        }
        for kind in [
            "header_too_large",
            "parse_error",
            "incomplete_request",
            "timeout",
            "idle_timeout",
            "body_write_aborted",
            "io_error",
        ] {
            let _ = connection_errors.get_or_create(&KindLabels { kind: kind.into() });
        }
        Self {
            registry,
            prefix_cache,
            kv,
            requests,
            failures,
            rejected,
            connection_errors,
            prompt_tokens,
            generated_tokens,
            ttft,
            inter_token,
            running,
            waiting,
            engine_steps,
            engine_step_sequences,
            kv_blocks_used,
            kv_blocks_free,
            progress_stalls,
            resets,
            not_ready,
            kv_cache_usage,
            cache_config,
            prefix_report: Default::default(),
        }
    }

    /// Count an in-place reset call by its outcome (`pd::reset::Outcome::label`).
    pub fn reset(&self, outcome: &str) {
        self.resets
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// Show every outcome of `tandem_resets_total` at 0 from the start (a counter that
    /// appears only once it counts reads as missing to a rate() over the first hour).
    pub fn preset_resets<'a>(&self, outcomes: impl IntoIterator<Item = &'a str>) {
        for o in outcomes {
            let _ = self.resets.get_or_create(&OutcomeLabels {
                outcome: o.to_owned(),
            });
        }
    }

    /// Publish the KV cache's configuration (`cache_config_info`), once the model is loaded.
    pub fn set_cache_config(&self, block_size: usize, blocks: usize) {
        self.cache_config
            .get_or_create(&CacheConfigLabels {
                block_size: block_size.to_string(),
                num_gpu_blocks: blocks.to_string(),
            })
            .set(1);
    }

    pub fn fail(&self, reason: &str) {
        self.failures
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub fn rejected(&self, reason: &str) {
        self.rejected
            .get_or_create(&ReasonLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub fn connection_error(&self, kind: &str) {
        self.connection_errors
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
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
