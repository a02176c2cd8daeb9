//! Tandem's router: one routing policy and the proxy around it, for every host that sends
//! clients' requests to a PDDeployment's decodes (docs/routing.md).
//!
//! - [`policy`]: pure — a request's facts and the decodes' state in, the order to try them
//!   out (prefix affinity in the engine's KV blocks, balanced by load; session affinity;
//!   only groups Ready at their current incarnation).
//! - [`prefix`]: what each decode holds in its prefix cache (the block keys it reports,
//!   and those of prompts sent to it since).
//! - [`fleet`]: the decodes the host lists ([`Targets`]), each one's report, in-flight
//!   count and recent failures; its [`fleet::Poller`] asks them for reports.
//! - [`proxy`]: the request path — API key, bounded body, prompt keys, ranking, one
//!   retry before the first byte, metrics.
//!
//! # Hosts
//! A host owns the listener and knows which decodes exist. It publishes [`Targets`]
//! through a `tokio::sync::watch` channel whenever they change, spawns
//! [`Router::poller`]`().run()`, hands `/v1/*` to [`Router::forward`] and serves its own
//! `/health`, `/ready` (some target [`Target::eligible`]) and `/metrics` (its registry,
//! which holds the router's `tandem_router_*` families).
//!
//! - The local runtime (`tandem-operator local`) builds [`Targets`] from its snapshot:
//!   the serving decodes and the planner's group statuses.
//! - A cluster router (a Deployment the operator runs for a PDDeployment that asks for
//!   one) builds them the same way from the PDDeployment's status (`groupStatuses`: phase
//!   and incarnation) and its decode pods (ready, their incarnation label, pod IP and HTTP
//!   port), watched through the API server; the rest is this crate, unchanged.
//!
//! No dependency on the dataplane or the operator: decodes are reached over HTTP
//! (`tandem_contract::routing`), so neither host links the model code.

pub mod client;
pub mod fleet;
pub mod metrics;
pub mod policy;
pub mod prefix;
pub mod proxy;
pub mod report;
pub mod session;

pub use fleet::{Target, Targets};
pub use proxy::{Body, BoxError, Router, RouterConfig, Secret};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A decode's report or prompt keys could not be read.
    #[error("{0}")]
    Report(String),
}

pub type Result<T> = std::result::Result<T, Error>;
