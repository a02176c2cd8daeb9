//! Tandem operator: reconciles `PDDeployment` resources into bootstrap groups of
//! prefill + decode pods that are created, co-restarted and rolled as units.

pub mod cluster_router;
pub mod controller;
pub mod crd;
pub mod executor;
pub mod leader;
pub mod local;
pub mod metrics;
pub mod names;
pub mod planner;
pub mod ready;
pub mod reasons;
pub mod reset_call;
pub mod resources;
pub mod role;
pub mod server;

#[cfg(test)]
pub(crate) mod testutil;
