//! Leader election on a `coordination.k8s.io/v1` Lease, so that only one of several
//! operator replicas reconciles.
//!
//! Protocol (the same as client-go's): the holder renews `renewTime` every
//! [`ElectionConfig::retry_period`]; another replica takes the lease once it has seen the
//! lease record unchanged for `leaseDurationSeconds` by its own clock. Expiry is never
//! judged from `renewTime` itself: that is the holder's clock, and a skewed clock on
//! either side would let two replicas lead at once. Every write is a replace carrying the
//! `resourceVersion` that was read, so two replicas racing for an expired lease cannot
//! both win: the loser gets 409 Conflict and stays standby.
//!
//! Every round (read plus write) runs under [`ElectionConfig::renew_deadline`], so a hung
//! API request cannot keep a deposed leader believing it still leads.
//!
//! A leader that cannot renew within [`ElectionConfig::renew_deadline`] (shorter than
//! the lease duration, so it stops before anyone else may start) considers itself
//! deposed. The binary then stops the controller and exits non-zero, and its Deployment
//! restarts it as a fresh standby: simpler and safer than trying to resume a controller
//! whose caches and in-flight reconciles belong to a term that has ended.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tracing::{info, warn};

/// Name of the Lease.
pub const LEASE_NAME: &str = "tandem-operator";

#[derive(Debug, Clone)]
pub struct ElectionConfig {
    pub lease_name: String,
    pub namespace: String,
    /// Unique per process: pod name plus a random suffix.
    pub identity: String,
    pub lease_duration: Duration,
    /// A leader that has not renewed for this long steps down (< lease duration).
    pub renew_deadline: Duration,
    /// How often the leader renews and a standby retries.
    pub retry_period: Duration,
}

impl ElectionConfig {
    pub fn new(namespace: impl Into<String>, identity: impl Into<String>) -> Self {
        Self {
            lease_name: LEASE_NAME.into(),
            namespace: namespace.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(5),
        }
    }
}

/// `<base>-<8 random hex digits>`: unique even when two processes share a hostname.
pub fn identity(base: &str) -> String {
    format!("{base}-{}", hex::encode(rand::random::<[u8; 4]>()))
}

/// What to do with the lease as it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// No lease exists: create it, held by us.
    Create,
    /// Free or expired: take it over (a new term, `leaseTransitions` + 1).
    Acquire,
    /// Ours: renew it.
    Renew,
    /// Someone else holds a live lease.
    Standby {
        holder: String,
        expires_in: Duration,
    },
}

/// The parts of a lease record whose change proves that its holder is alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub holder: String,
    pub renew_time: Option<Timestamp>,
    pub acquire_time: Option<Timestamp>,
    pub transitions: Option<i32>,
    pub duration_seconds: Option<i32>,
}

impl Observed {
    pub fn of(lease: &Lease) -> Observed {
        let spec = lease.spec.clone().unwrap_or_default();
        Observed {
            holder: spec.holder_identity.unwrap_or_default(),
            renew_time: spec.renew_time.map(|t| t.0),
            acquire_time: spec.acquire_time.map(|t| t.0),
            transitions: spec.lease_transitions,
            duration_seconds: spec.lease_duration_seconds,
        }
    }
}

/// Decide from the lease (if any) and how long ago, by our clock, its record last
/// changed (`unchanged_for`). Pure.
pub fn decide(lease: Option<&Lease>, me: &str, unchanged_for: Duration) -> Decision {
    let Some(lease) = lease else {
        return Decision::Create;
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.unwrap_or_default();
    if holder.is_empty() {
        return Decision::Acquire;
    }
    if holder == me {
        return Decision::Renew;
    }
    let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
    if unchanged_for >= duration {
        Decision::Acquire
    } else {
        Decision::Standby {
            holder,
            expires_in: duration - unchanged_for,
        }
    }
}

/// The lease spec after a `Create`, `Acquire` or `Renew` decision.
pub fn next_spec(
    prev: Option<&LeaseSpec>,
    decision: &Decision,
    cfg: &ElectionConfig,
    now: Timestamp,
) -> LeaseSpec {
    let mut spec = prev.cloned().unwrap_or_default();
    let now = MicroTime(now);
    match decision {
        Decision::Create => {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(0);
        }
        Decision::Acquire => {
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        Decision::Renew | Decision::Standby { .. } => {}
    }
    spec.holder_identity = Some(cfg.identity.clone());
    spec.lease_duration_seconds = Some(cfg.lease_duration.as_secs() as i32);
    spec.renew_time = Some(now);
    spec
}

/// One participant in the election.
pub struct Elector {
    api: Api<Lease>,
    cfg: ElectionConfig,
    /// The lease record as last read, and when (by our clock) it last changed.
    observed: Mutex<Option<(Observed, Instant)>>,
}

impl Elector {
    pub fn new(client: Client, cfg: ElectionConfig) -> Self {
        Self {
            api: Api::namespaced(client, &cfg.namespace),
            cfg,
            observed: Mutex::new(None),
        }
    }

    /// Remember `lease` and return how long its record has been unchanged. A record seen
    /// for the first time counts as just renewed.
    fn observe(&self, lease: Option<&Lease>) -> Duration {
        let mut observed = self.observed.lock().unwrap_or_else(|e| e.into_inner());
        let Some(lease) = lease else {
            *observed = None;
            return Duration::ZERO;
        };
        let record = Observed::of(lease);
        match &*observed {
            Some((seen, at)) if *seen == record => at.elapsed(),
            _ => {
                *observed = Some((record, Instant::now()));
                Duration::ZERO
            }
        }
    }

    pub fn config(&self) -> &ElectionConfig {
        &self.cfg
    }

    /// One round: read the lease and create, take over or renew it when we may.
    /// Returns whether we hold the lease afterwards.
    pub async fn try_acquire_or_renew(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let current = self.api.get_opt(&self.cfg.lease_name).await?;
        let unchanged_for = self.observe(current.as_ref());
        let decision = decide(current.as_ref(), &self.cfg.identity, unchanged_for);
        let spec = next_spec(
            current.as_ref().and_then(|l| l.spec.as_ref()),
            &decision,
            &self.cfg,
            now,
        );
        let result = match (&decision, current) {
            (Decision::Standby { .. }, _) => return Ok(false),
            (Decision::Create, _) => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.cfg.lease_name.clone()),
                        namespace: Some(self.cfg.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(spec),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            (_, Some(mut lease)) => {
                // metadata.resourceVersion is the one we read: a concurrent writer
                // makes this fail with 409.
                lease.spec = Some(spec);
                self.api
                    .replace(&self.cfg.lease_name, &PostParams::default(), &lease)
                    .await
            }
            (_, None) => unreachable!("decide returns Create when there is no lease"),
        };
        match result {
            Ok(_) => {
                if decision == Decision::Acquire || decision == Decision::Create {
                    info!(identity = %self.cfg.identity, "acquired the leader lease");
                }
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Give the lease up (on shutdown) so a standby takes over at once.
    pub async fn release(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.cfg.lease_name).await? else {
            return Ok(());
        };
        let mut spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        lease.spec = Some(spec);
        match self
            .api
            .replace(&lease.name_any(), &PostParams::default(), &lease)
            .await
        {
            Ok(_) => {
                info!("released the leader lease");
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Run the election until `stop` turns true, publishing leadership on `leader` and
    /// the time of the last successful round on `healthy` (for readiness).
    /// Returns when the leadership is lost (after having been held) or on stop.
    pub async fn run(
        &self,
        leader: watch::Sender<bool>,
        healthy: watch::Sender<Option<std::time::Instant>>,
        mut stop: watch::Receiver<bool>,
    ) -> Outcome {
        let mut last_renew: Option<Instant> = None;
        loop {
            if *stop.borrow() {
                return Outcome::Stopped;
            }
            let was_leader = *leader.borrow();
            let round = tokio::time::timeout(self.cfg.renew_deadline, self.try_acquire_or_renew());
            match round
                .await
                .unwrap_or_else(|_| Err(round_timeout(self.cfg.renew_deadline)))
            {
                Ok(true) => {
                    last_renew = Some(Instant::now());
                    healthy.send_replace(Some(std::time::Instant::now()));
                    if !was_leader {
                        leader.send_replace(true);
                    }
                }
                Ok(false) => {
                    healthy.send_replace(Some(std::time::Instant::now()));
                    if was_leader {
                        warn!("another replica holds the leader lease");
                        leader.send_replace(false);
                        return Outcome::Lost;
                    }
                }
                Err(e) => {
                    warn!("leader election round failed: {e}");
                    if was_leader
                        && last_renew.is_none_or(|t| t.elapsed() >= self.cfg.renew_deadline)
                    {
                        warn!("could not renew the leader lease within the deadline");
                        leader.send_replace(false);
                        return Outcome::Lost;
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.retry_period) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

/// A round that did not finish within the renew deadline, as an error like any other.
fn round_timeout(deadline: Duration) -> kube::Error {
    kube::Error::Service(format!("leader election round did not finish within {deadline:?}").into())
}

/// Why [`Elector::run`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Stopped,
    Lost,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    fn lease(holder: Option<&str>, renewed: Option<i64>, duration: i32) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(LEASE_NAME.into()),
                resource_version: Some("7".into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(Into::into),
                renew_time: renewed.map(|s| MicroTime(at(s))),
                lease_duration_seconds: Some(duration),
                lease_transitions: Some(3),
                ..Default::default()
            }),
        }
    }

    const SECS: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn no_lease_is_created() {
        assert_eq!(decide(None, "me", Duration::ZERO), Decision::Create);
    }

    #[test]
    fn our_lease_is_renewed_even_when_expired() {
        let l = lease(Some("me"), Some(-100), 15);
        assert_eq!(decide(Some(&l), "me", SECS(100)), Decision::Renew);
    }

    #[test]
    fn a_live_foreign_lease_means_standby() {
        let l = lease(Some("other"), Some(-5), 15);
        assert_eq!(
            decide(Some(&l), "me", SECS(5)),
            Decision::Standby {
                holder: "other".into(),
                expires_in: SECS(10)
            }
        );
    }

    #[test]
    fn expiry_is_judged_by_our_clock_not_the_holders_renew_time() {
        // The holder's clock is an hour behind: its renewTime looks ancient, but the
        // record just changed, so the holder is alive.
        let skewed = lease(Some("other"), Some(-3600), 15);
        assert!(matches!(
            decide(Some(&skewed), "me", SECS(1)),
            Decision::Standby { .. }
        ));
        // The holder's clock is ahead: a renewTime in the future does not keep a dead
        // holder's lease alive once the record has stood still for the duration.
        let ahead = lease(Some("other"), Some(3600), 15);
        assert_eq!(decide(Some(&ahead), "me", SECS(15)), Decision::Acquire);
    }

    #[test]
    fn an_expired_or_free_lease_is_acquired() {
        let expired = lease(Some("other"), Some(-15), 15);
        assert_eq!(decide(Some(&expired), "me", SECS(15)), Decision::Acquire);
        let released = lease(None, Some(-1), 1);
        assert_eq!(
            decide(Some(&released), "me", Duration::ZERO),
            Decision::Acquire
        );
        let empty = lease(Some(""), Some(0), 15);
        assert_eq!(
            decide(Some(&empty), "me", Duration::ZERO),
            Decision::Acquire
        );
        let never_renewed = lease(Some("other"), None, 15);
        assert!(matches!(
            decide(Some(&never_renewed), "me", SECS(3)),
            Decision::Standby { .. }
        ));
        assert_eq!(
            decide(Some(&never_renewed), "me", SECS(15)),
            Decision::Acquire
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_record_ages_only_while_it_does_not_change() {
        let (svc, _handle) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let e = Elector::new(Client::new(svc, "default"), ElectionConfig::new("ns", "me"));
        let first = lease(Some("other"), Some(0), 15);
        assert_eq!(
            e.observe(Some(&first)),
            Duration::ZERO,
            "first sight: just renewed"
        );
        tokio::time::advance(SECS(10)).await;
        assert_eq!(e.observe(Some(&first)), SECS(10));
        let renewed = lease(Some("other"), Some(10), 15);
        assert_eq!(
            e.observe(Some(&renewed)),
            Duration::ZERO,
            "a renewal resets the age"
        );
        tokio::time::advance(SECS(16)).await;
        assert_eq!(e.observe(Some(&renewed)), SECS(16));
        assert_eq!(e.observe(None), Duration::ZERO);
    }

    #[test]
    fn next_spec_counts_transitions_and_stamps_times() {
        let cfg = ElectionConfig::new("ns", "me");
        let l = lease(Some("other"), Some(-20), 15);
        let s = next_spec(l.spec.as_ref(), &Decision::Acquire, &cfg, at(0));
        assert_eq!(s.holder_identity.as_deref(), Some("me"));
        assert_eq!(s.lease_transitions, Some(4));
        assert_eq!(s.acquire_time, Some(MicroTime(at(0))));
        assert_eq!(s.renew_time, Some(MicroTime(at(0))));
        assert_eq!(s.lease_duration_seconds, Some(15));

        let mine = next_spec(Some(&s), &Decision::Renew, &cfg, at(5));
        assert_eq!(mine.lease_transitions, Some(4));
        assert_eq!(mine.acquire_time, Some(MicroTime(at(0))));
        assert_eq!(mine.renew_time, Some(MicroTime(at(5))));

        let created = next_spec(None, &Decision::Create, &cfg, at(0));
        assert_eq!(created.lease_transitions, Some(0));
    }

    mod api {
        use super::*;
        use http::{Method, Request, Response, StatusCode};
        use kube::client::Body;
        use serde_json::{Value, json};
        use tower_test::mock;

        type Handle = mock::Handle<Request<Body>, Response<Body>>;
        const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/ops/leases/tandem-operator";

        fn elector() -> (Elector, Handle) {
            let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
            let client = Client::new(svc, "default");
            (
                Elector::new(client, ElectionConfig::new("ops", "me-1")),
                handle,
            )
        }

        async fn expect(
            h: &mut Handle,
            method: Method,
            uri: &str,
            status: u16,
            reply: Value,
        ) -> Value {
            let (req, send) = h.next_request().await.expect("a request");
            assert_eq!(
                (req.method(), req.uri().to_string()),
                (&method, uri.to_string())
            );
            let bytes = req.into_body().collect_bytes().await.unwrap();
            let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            // Every request of the elector is one the chart's RBAC allows.
            crate::testutil::rbac::assert_allowed(&method, uri, None, &body);
            let reply = if reply.is_null() { body.clone() } else { reply };
            send.send_response(
                Response::builder()
                    .status(StatusCode::from_u16(status).unwrap())
                    .body(Body::from(serde_json::to_vec(&reply).unwrap()))
                    .unwrap(),
            );
            body
        }

        fn not_found() -> Value {
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404})
        }

        #[tokio::test]
        async fn creates_a_missing_lease() {
            let (e, mut h) = elector();
            let server = tokio::spawn(async move {
                expect(&mut h, Method::GET, LEASE, 404, not_found()).await;
                let body = expect(
                    &mut h,
                    Method::POST,
                    "/apis/coordination.k8s.io/v1/namespaces/ops/leases?",
                    201,
                    Value::Null,
                )
                .await;
                assert_eq!(body["spec"]["holderIdentity"], "me-1");
                assert_eq!(body["spec"]["leaseDurationSeconds"], 15);
            });
            assert!(e.try_acquire_or_renew().await.unwrap());
            server.await.unwrap();
        }

        #[tokio::test(start_paused = true)]
        async fn takes_over_a_lease_unchanged_for_its_duration_and_loses_races() {
            let (e, mut h) = elector();
            let expired = serde_json::to_value(lease(Some("other"), Some(-3600), 15)).unwrap();
            let server = tokio::spawn(async move {
                // First sight: the record counts as just renewed; no write.
                expect(&mut h, Method::GET, LEASE, 200, expired.clone()).await;
                // Unchanged for the lease duration: take it over with its resourceVersion.
                expect(&mut h, Method::GET, LEASE, 200, expired.clone()).await;
                let body =
                    expect(&mut h, Method::PUT, &format!("{LEASE}?"), 200, Value::Null).await;
                assert_eq!(body["metadata"]["resourceVersion"], "7");
                assert_eq!(body["spec"]["holderIdentity"], "me-1");
                assert_eq!(body["spec"]["leaseTransitions"], 4);
                // Third round: someone else wrote first.
                expect(&mut h, Method::GET, LEASE, 200, expired).await;
                let conflict = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                      "reason": "Conflict", "code": 409});
                expect(&mut h, Method::PUT, &format!("{LEASE}?"), 409, conflict).await;
            });
            assert!(!e.try_acquire_or_renew().await.unwrap());
            tokio::time::advance(Duration::from_secs(15)).await;
            assert!(e.try_acquire_or_renew().await.unwrap());
            assert!(!e.try_acquire_or_renew().await.unwrap());
            server.await.unwrap();
        }

        #[tokio::test(start_paused = true)]
        async fn a_leader_whose_rounds_hang_steps_down_within_the_renew_deadline() {
            let (e, mut h) = elector();
            let (leader_tx, mut leader_rx) = watch::channel(false);
            let (ok_tx, _ok_rx) = watch::channel(None);
            let (_stop_tx, stop_rx) = watch::channel(false);
            let server = tokio::spawn(async move {
                expect(&mut h, Method::GET, LEASE, 404, not_found()).await;
                expect(
                    &mut h,
                    Method::POST,
                    "/apis/coordination.k8s.io/v1/namespaces/ops/leases?",
                    201,
                    Value::Null,
                )
                .await;
                // The next read never gets an answer.
                let (_req, _send) = h.next_request().await.expect("a renewal");
                std::future::pending::<()>().await;
            });
            let run = tokio::spawn(async move { e.run(leader_tx, ok_tx, stop_rx).await });
            leader_rx.wait_for(|l| *l).await.unwrap();
            let led = Instant::now();
            let outcome = run.await.unwrap();
            assert_eq!(outcome, Outcome::Lost);
            let cfg = ElectionConfig::new("ops", "me-1");
            assert!(
                led.elapsed() <= cfg.retry_period + cfg.renew_deadline,
                "stepped down after {:?}",
                led.elapsed()
            );
            server.abort();
        }

        #[tokio::test]
        async fn release_hands_our_lease_back_and_leaves_anothers_alone() {
            let (e, mut h) = elector();
            let mut ours = lease(Some("me-1"), None, 15);
            ours.spec.as_mut().unwrap().renew_time = Some(MicroTime(Timestamp::now()));
            let ours = serde_json::to_value(ours).unwrap();
            let theirs = serde_json::to_value(lease(Some("other"), None, 15)).unwrap();
            let server = tokio::spawn(async move {
                // Ours: written back with no holder and a 1 s duration, at the
                // resourceVersion read (a replica that took over meanwhile wins).
                expect(&mut h, Method::GET, LEASE, 200, ours).await;
                let body =
                    expect(&mut h, Method::PUT, &format!("{LEASE}?"), 200, Value::Null).await;
                assert_eq!(body["spec"]["holderIdentity"], Value::Null, "{body}");
                assert_eq!(body["spec"]["leaseDurationSeconds"], 1);
                assert_eq!(body["metadata"]["resourceVersion"], "7");
                // Another's: read, never written.
                expect(&mut h, Method::GET, LEASE, 200, theirs).await;
                // Gone: nothing to release.
                expect(&mut h, Method::GET, LEASE, 404, not_found()).await;
                assert!(h.next_request().await.is_none(), "no write");
            });
            e.release().await.unwrap();
            e.release().await.unwrap();
            e.release().await.unwrap();
            drop(e);
            server.await.unwrap();
        }

        #[tokio::test(start_paused = true)]
        async fn a_leader_that_finds_another_holder_reports_the_loss() {
            let (e, mut h) = elector();
            let (leader_tx, mut leader_rx) = watch::channel(false);
            let (ok_tx, _ok_rx) = watch::channel(None);
            let (_stop_tx, stop_rx) = watch::channel(false);
            let server = tokio::spawn(async move {
                expect(&mut h, Method::GET, LEASE, 404, not_found()).await;
                expect(
                    &mut h,
                    Method::POST,
                    "/apis/coordination.k8s.io/v1/namespaces/ops/leases?",
                    201,
                    Value::Null,
                )
                .await;
                // Someone took the lease over (we were partitioned past its duration).
                let mut taken = lease(Some("other"), None, 15);
                taken.spec.as_mut().unwrap().renew_time = Some(MicroTime(Timestamp::now()));
                expect(
                    &mut h,
                    Method::GET,
                    LEASE,
                    200,
                    serde_json::to_value(taken).unwrap(),
                )
                .await;
            });
            let run = tokio::spawn(async move { e.run(leader_tx, ok_tx, stop_rx).await });
            leader_rx.wait_for(|l| *l).await.unwrap();
            assert_eq!(run.await.unwrap(), Outcome::Lost);
            assert!(!*leader_rx.borrow(), "leadership withdrawn");
            server.await.unwrap();
        }

        #[tokio::test]
        async fn stands_by_without_writing_while_another_holds_the_lease() {
            let (e, mut h) = elector();
            let mut live = lease(Some("other"), None, 15);
            live.spec.as_mut().unwrap().renew_time = Some(MicroTime(Timestamp::now()));
            let live = serde_json::to_value(live).unwrap();
            let server = tokio::spawn(async move {
                expect(&mut h, Method::GET, LEASE, 200, live).await;
                assert!(h.next_request().await.is_none(), "no write");
            });
            assert!(!e.try_acquire_or_renew().await.unwrap());
            drop(e);
            server.await.unwrap();
        }
    }

    #[test]
    fn identities_are_unique() {
        let a = identity("pod");
        assert!(a.starts_with("pod-"));
        assert_eq!(a.len(), "pod-".len() + 8);
        assert_ne!(a, identity("pod"));
    }
}
