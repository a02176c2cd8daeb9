//! Metrics of the local runtime, registered beside the operator's own (which count
//! reconciles, co-restarts by reason and time to group Ready the same way for both
//! executors). Its endpoint's requests are the router's (`tandem_router_*`, served on the
//! same `/metrics`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExitLabel {
    pub role: String,
    /// `planned` (after SIGTERM/SIGKILL from the runtime) or `unexpected`.
    pub kind: String,
}

#[derive(Clone, Default)]
pub struct LocalMetrics {
    pub exits: Family<ExitLabel, Counter>,
    /// Actions the executor could not carry out (a process that could not start).
    pub action_failures: Counter,
}

impl LocalMetrics {
    /// Create and register in `registry` (prefixed like the operator's metrics).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "local_process_exits",
            "Member processes that exited, by role and whether the runtime stopped them",
            m.exits.clone(),
        );
        registry.register(
            "local_action_failures",
            "Planned actions the local executor could not carry out",
            m.action_failures.clone(),
        );
        m
    }

    pub fn exit(&self, role: &str, planned: bool) {
        self.exits
            .get_or_create(&ExitLabel {
                role: role.to_string(),
                kind: if planned { "planned" } else { "unexpected" }.to_string(),
            })
            .inc();
    }
}
