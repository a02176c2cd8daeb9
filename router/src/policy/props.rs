//! Properties of the policy over arbitrary fleets and requests.

use proptest::prelude::*;

use super::*;

fn any_backend() -> impl Strategy<Value = Backend> {
    (
        0..6i32,
        1..4i64,
        any::<bool>(),
        1..4i64,
        0..40usize,
        (0..12u32, 0..12u32, 0.0..1.0f64, 0..12u32),
        prop::bool::weighted(0.1),
        prop::bool::weighted(0.1),
    )
        .prop_map(
            |(group, incarnation, ready, current, cached, (q, r, kv, f), cooling, stalled)| {
                Backend {
                    group,
                    incarnation,
                    group_ready: ready,
                    group_incarnation: current,
                    cached_blocks: cached,
                    load: Load {
                        queued: q,
                        running: r,
                        kv_usage: kv,
                        in_flight: f,
                    },
                    cooling,
                    stalled,
                }
            },
        )
}

fn any_request(n: usize) -> impl Strategy<Value = Request> {
    (0..40usize, prop::option::of(0..n.max(1)), any::<u64>()).prop_map(
        |(prompt_blocks, session, tiebreak)| Request {
            prompt_blocks,
            session,
            tiebreak,
        },
    )
}

fn fleet_and_request() -> impl Strategy<Value = (Vec<Backend>, Request)> {
    prop::collection::vec(any_backend(), 0..8).prop_flat_map(|b| {
        let n = b.len();
        (Just(b), any_request(n))
    })
}

proptest! {
    /// The order holds every eligible decode exactly once and nothing else, whatever the
    /// mode.
    #[test]
    fn only_eligible_decodes_are_ever_candidates(
        (backends, req) in fleet_and_request(),
        round_robin in any::<bool>(),
    ) {
        let cfg = PolicyConfig {
            mode: if round_robin { Mode::RoundRobin } else { Mode::PrefixLoad },
            ..PolicyConfig::default()
        };
        let r = rank(&req, &backends, &cfg);
        let mut got = r.order.clone();
        got.sort_unstable();
        let want: Vec<usize> = (0..backends.len()).filter(|&i| backends[i].eligible()).collect();
        prop_assert_eq!(got, want);
        prop_assert_eq!(r.why == Why::NoCandidate, r.order.is_empty());
    }

    /// Same inputs, same order.
    #[test]
    fn the_policy_is_deterministic((backends, req) in fleet_and_request()) {
        let cfg = PolicyConfig::default();
        prop_assert_eq!(rank(&req, &backends, &cfg), rank(&req, &backends.clone(), &cfg));
    }

    /// Without a session or a cooling decode, the first choice is always under the load
    /// cap: no decode gets more than `load_factor` times its share plus the slack while
    /// another is under it, however much of the prompt it holds.
    #[test]
    fn the_first_choice_is_under_the_load_cap((mut backends, mut req) in fleet_and_request()) {
        req.session = None;
        for b in &mut backends {
            b.cooling = false;
            b.stalled = false;
        }
        let cfg = PolicyConfig::default();
        let r = rank(&req, &backends, &cfg);
        if let Some(&first) = r.order.first() {
            let eligible: Vec<&Backend> = backends.iter().filter(|b| b.eligible()).collect();
            let total: u64 = eligible.iter().map(|b| u64::from(b.load.outstanding())).sum();
            let cap = load_cap(total, eligible.len(), &cfg);
            prop_assert!(backends[first].load.outstanding() < cap);
        }
    }

    /// A pinned session goes first exactly when its decode is eligible and not stalled.
    #[test]
    fn a_session_is_honoured_exactly_when_its_decode_is_eligible((backends, req) in fleet_and_request()) {
        let r = rank(&req, &backends, &PolicyConfig::default());
        match req.session {
            Some(s) if s < backends.len() && backends[s].eligible() && !backends[s].stalled => {
                prop_assert_eq!(r.order[0], s);
                prop_assert_eq!(r.why, Why::Session);
            }
            _ => prop_assert_ne!(r.why, Why::Session),
        }
    }

    /// A stalled decode never goes before one that steps, whatever it holds, its load or
    /// a session pinned to it.
    #[test]
    fn a_stalled_decode_is_always_tried_after_every_stepping_one((backends, req) in fleet_and_request()) {
        let r = rank(&req, &backends, &PolicyConfig::default());
        let first_stalled = r.order.iter().position(|&i| backends[i].stalled);
        if let Some(p) = first_stalled {
            prop_assert!(r.order[p..].iter().all(|&i| backends[i].stalled), "{:?}", r.order);
        }
    }

    /// Holding more of the prompt never moves a decode back in the order.
    #[test]
    fn more_cached_blocks_never_rank_a_decode_lower(
        (mut backends, mut req) in fleet_and_request(),
        pick in any::<prop::sample::Index>(),
        more in 1..20usize,
    ) {
        req.session = None;
        prop_assume!(!backends.is_empty());
        let i = pick.index(backends.len());
        let cfg = PolicyConfig::default();
        let before = rank(&req, &backends, &cfg).order.iter().position(|&x| x == i);
        backends[i].cached_blocks += more;
        let after = rank(&req, &backends, &cfg).order.iter().position(|&x| x == i);
        if let (Some(b), Some(a)) = (before, after) {
            prop_assert!(a <= b, "{} -> {}", b, a);
        }
    }

    /// A hot prefix with requests that never finish: the group that holds it takes its
    /// bounded share, and the idle groups get the rest; no group ever exceeds the cap of
    /// the load routed so far.
    #[test]
    fn a_hot_prefix_cannot_pile_every_request_on_one_group(
        groups in 2..8usize,
        requests in 1..200usize,
        prompt_blocks in 1..600usize,
    ) {
        let cfg = PolicyConfig::default();
        let mut backends: Vec<Backend> = (0..groups as i32)
            .map(|g| Backend {
                group: g,
                incarnation: 1,
                group_ready: true,
                group_incarnation: 1,
                cached_blocks: 0,
                load: Load::default(),
                cooling: false,
                stalled: false,
            })
            .collect();
        backends[0].cached_blocks = prompt_blocks;
        for t in 0..requests {
            let r = rank(&Request { prompt_blocks, session: None, tiebreak: t as u64 }, &backends, &cfg);
            let first = r.order[0];
            backends[first].load.in_flight += 1;
            // The chosen group computes and caches the prefix.
            backends[first].cached_blocks = prompt_blocks;
            let total = (t + 1) as u64;
            let cap = load_cap(total - 1, groups, &cfg);
            let max = backends.iter().map(|b| b.load.in_flight).max().unwrap_or(0);
            prop_assert!(max <= cap, "after {} requests: max {} cap {}", total, max, cap);
        }
    }
}
