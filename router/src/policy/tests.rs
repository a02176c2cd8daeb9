use super::*;

fn backend(group: i32) -> Backend {
    Backend {
        group,
        incarnation: 1,
        group_ready: true,
        group_incarnation: 1,
        cached_blocks: 0,
        load: Load::default(),
        cooling: false,
        stalled: false,
    }
}

fn req(prompt_blocks: usize) -> Request {
    Request {
        prompt_blocks,
        session: None,
        tiebreak: 0,
    }
}

fn cfg() -> PolicyConfig {
    PolicyConfig::default()
}

#[test]
fn only_groups_ready_at_their_current_incarnation_are_candidates() {
    let mut b = vec![backend(0), backend(1), backend(2), backend(3)];
    b[1].group_ready = false;
    // A decode of the previous incarnation, still answering while its group restarts.
    b[2].incarnation = 1;
    b[2].group_incarnation = 2;
    b[3].cached_blocks = 25;
    let r = rank(&req(25), &b, &cfg());
    assert_eq!(r.order, vec![3, 0]);
    assert_eq!(r.why, Why::Prefix);
    b[0].group_ready = false;
    b[3].group_ready = false;
    let r = rank(&req(25), &b, &cfg());
    assert_eq!((r.order, r.why), (vec![], Why::NoCandidate));
}

#[test]
fn the_longest_cached_prefix_wins_at_equal_load() {
    let mut b = vec![backend(0), backend(1), backend(2)];
    b[0].cached_blocks = 3;
    b[1].cached_blocks = 20;
    b[2].cached_blocks = 10;
    let r = rank(&req(25), &b, &cfg());
    assert_eq!(r.order, vec![1, 2, 0]);
    assert_eq!(r.why, Why::Prefix);
    // Cached blocks past the prompt's count nothing more.
    b[1].cached_blocks = 25;
    b[2].cached_blocks = 90;
    assert_eq!(
        rank(&req(25), &b, &cfg()).order[0],
        1,
        "ties go by rotation"
    );
}

#[test]
fn load_outweighs_a_prefix_once_the_queue_costs_more_than_computing_it() {
    let mut b = vec![backend(0), backend(1)];
    b[0].cached_blocks = 25;
    // 2 outstanding cost 16 blocks < 25 to compute: stay.
    b[0].load.in_flight = 2;
    assert_eq!(rank(&req(25), &b, &cfg()).order, vec![0, 1]);
    // 4 cost 32 > 25: the idle decode computes the prefix instead.
    b[0].load.in_flight = 4;
    let r = rank(&req(25), &b, &cfg());
    assert_eq!((r.order, r.why), (vec![1, 0], Why::Load));
    // The decode's own report counts as well as the router's in-flight count.
    b[0].load = Load {
        queued: 3,
        running: 1,
        ..Load::default()
    };
    assert_eq!(rank(&req(25), &b, &cfg()).order, vec![1, 0]);
}

#[test]
fn a_decode_at_the_load_cap_gets_no_credit_for_its_prefix() {
    // A huge prompt: without the cap, 500 cached blocks would outweigh 60 requests.
    let mut b = vec![backend(0), backend(1), backend(2), backend(3)];
    b[0].cached_blocks = 500;
    b[0].load.in_flight = 6;
    // total 6, n 4: cap = ceil(1.5 * 7 / 4) + 2 = 5.
    assert_eq!(load_cap(6, 4, &cfg()), 5);
    let r = rank(&req(500), &b, &cfg());
    assert_eq!(r.order.last(), Some(&0), "{r:?}");
    assert_eq!(r.why, Why::Load);
}

#[test]
fn kv_use_counts_against_a_decode() {
    let mut b = vec![backend(0), backend(1)];
    b[0].load.kv_usage = 0.95;
    assert_eq!(rank(&req(4), &b, &cfg()).order, vec![1, 0]);
    // A report of nonsense counts as nothing rather than poisoning the sort.
    b[0].load.kv_usage = f64::NAN;
    b[1].load.kv_usage = 0.5;
    assert_eq!(rank(&req(4), &b, &cfg()).order, vec![0, 1]);
}

#[test]
fn ties_rotate_with_the_tiebreak() {
    let b = vec![backend(0), backend(1), backend(2)];
    let firsts: Vec<usize> = (0..6)
        .map(|t| {
            rank(
                &Request {
                    tiebreak: t,
                    ..req(0)
                },
                &b,
                &cfg(),
            )
            .order[0]
        })
        .collect();
    assert_eq!(firsts, vec![0, 1, 2, 0, 1, 2]);
}

#[test]
fn a_session_goes_to_its_decode_while_eligible_and_by_cost_otherwise() {
    let mut b = vec![backend(0), backend(1), backend(2)];
    b[2].cached_blocks = 25;
    b[0].load.in_flight = 9;
    let r = rank(
        &Request {
            session: Some(0),
            ..req(25)
        },
        &b,
        &cfg(),
    );
    assert_eq!((r.order[0], r.why), (0, Why::Session));
    assert_eq!(r.order.len(), 3);
    b[0].group_ready = false;
    let r = rank(
        &Request {
            session: Some(0),
            ..req(25)
        },
        &b,
        &cfg(),
    );
    assert_eq!((r.order, r.why), (vec![2, 1], Why::Prefix));
}

#[test]
fn a_cooling_decode_goes_last() {
    let mut b = vec![backend(0), backend(1)];
    b[0].cached_blocks = 25;
    b[0].cooling = true;
    assert_eq!(rank(&req(25), &b, &cfg()).order, vec![1, 0]);
}

#[test]
fn round_robin_rotates_over_the_eligible_only() {
    let mut b = vec![backend(0), backend(1), backend(2)];
    b[1].group_ready = false;
    b[2].cached_blocks = 25;
    let c = PolicyConfig {
        mode: Mode::RoundRobin,
        ..cfg()
    };
    let orders: Vec<Vec<usize>> = (0..3)
        .map(|t| {
            rank(
                &Request {
                    tiebreak: t,
                    ..req(25)
                },
                &b,
                &c,
            )
            .order
        })
        .collect();
    assert_eq!(orders, vec![vec![0, 2], vec![2, 0], vec![0, 2]]);
}

#[test]
fn a_retry_goes_to_another_group_when_there_is_one() {
    let mut b = vec![backend(0), backend(0), backend(1)];
    b[1].incarnation = 1;
    assert_eq!(retry_target(&[0, 1, 2], &b, 0), Some(2));
    assert_eq!(retry_target(&[0, 1], &b, 0), Some(1));
    assert_eq!(retry_target(&[0], &b, 0), None);
}

#[test]
fn a_stalled_decode_goes_last_even_with_the_prompt_and_the_session() {
    let mut b = vec![backend(0), backend(1), backend(2)];
    b[0].cached_blocks = 25;
    b[0].stalled = true;
    b[1].load.queued = 3;
    let r = rank(&req(25), &b, &cfg());
    assert_eq!(r.order, vec![2, 1, 0]);
    assert_eq!(r.why, Why::Load);
    let pinned = Request {
        session: Some(0),
        ..req(25)
    };
    let r = rank(&pinned, &b, &cfg());
    assert_eq!(r.order[0], 2, "a session pinned to a stalled decode moves");
    assert_ne!(r.why, Why::Session);
    // Every decode stalled: still an order (the stall may pass), by cost.
    b[1].stalled = true;
    b[2].stalled = true;
    assert_eq!(rank(&req(25), &b, &cfg()).order, vec![0, 2, 1]);
}
