//! The routing policy: one request's facts and the decodes' state in, the order in which
//! to try the decodes out. Pure: no I/O, no clock, no randomness, so the same inputs give
//! the same order (ties rotate with a counter the host passes), and both hosts (the local
//! runtime, a cluster router) route the same way because they call this.
//!
//! - **Candidates**: only decodes of groups Ready at their current incarnation, serving at
//!   that incarnation ([`Backend::eligible`]). Nothing else is ever in the order.
//! - **Cost** of sending the request to a decode, in prompt blocks (the engine's 16-token
//!   KV blocks): the blocks of the prompt it does not hold in its prefix cache (to be
//!   computed), plus [`PolicyConfig::request_cost`] per outstanding request (queued,
//!   running, or sent by this router and not finished), plus [`PolicyConfig::kv_cost`]
//!   times its KV-block use. The cheapest goes first.
//! - **Bounded load**: a decode whose outstanding requests reach
//!   [`load_cap`] (`ceil(load_factor × (total + 1) / n) + load_slack`) gets no credit for its
//!   cached prefix and goes after every decode under the cap. So one hot prefix cannot
//!   pile every request on the group that holds it: that group takes at most about
//!   `load_factor` times its share (plus the slack) while others have room, and the
//!   others then cache the prefix too.
//! - **Session**: a request whose session is pinned to an eligible decode goes there
//!   first, whatever the cost; a session whose decode is not eligible is routed by cost
//!   (the host pins it to the new choice).
//! - **Cooling**: a decode that failed a request lately goes after the others.
//! - **Stalled**: a decode whose engine has had work and made no step for the router's
//!   stall limit (its report says so) goes after every other, cooling ones included, and a
//!   session pinned to it is routed by cost: it is alive and may be ready, but what is
//!   sent there waits.
//! - **Round robin** ([`Mode::RoundRobin`]): the eligible decodes in rotation, nothing else
//!   considered (the baseline the benchmark compares against).

/// What the policy knows of one decode (a group's entry point).
#[derive(Debug, Clone, PartialEq)]
pub struct Backend {
    pub group: i32,
    /// The incarnation the decode serves at.
    pub incarnation: i64,
    /// The group as the operator's status says: Ready, and its current incarnation.
    pub group_ready: bool,
    pub group_incarnation: i64,
    /// Leading whole blocks of this request's prompt that the decode holds in its prefix
    /// cache.
    pub cached_blocks: usize,
    pub load: Load,
    /// A request to it failed lately (refused, closed, 5xx): tried after the others.
    pub cooling: bool,
    /// Its engine has had work and made no step for the stall limit, or it has answered
    /// no report call that long (`fleet::Hung`): tried last.
    pub stalled: bool,
}

impl Backend {
    /// Whether the decode may be sent anything: its group is Ready and it serves at the
    /// group's current incarnation.
    pub fn eligible(&self) -> bool {
        self.group_ready && self.incarnation == self.group_incarnation
    }
}

/// A decode's load.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Load {
    /// Requests waiting for admission (the decode's report).
    pub queued: u32,
    /// Requests in its running batch (the decode's report).
    pub running: u32,
    /// KV blocks referenced by sequences over all its blocks, 0 to 1 (the decode's report).
    pub kv_usage: f64,
    /// Requests this router has sent it that have not finished.
    pub in_flight: u32,
}

impl Load {
    /// Outstanding requests: the decode's own count or this router's, whichever is higher
    /// (the decode's includes other routers' requests, this router's is fresher than the
    /// last report). The maximum, not the sum: this router's requests are in both.
    pub fn outstanding(&self) -> u32 {
        self.in_flight.max(self.queued.saturating_add(self.running))
    }
}

/// The facts of one request.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Request {
    /// Whole KV blocks of the prompt (0: not known, routed by load alone).
    pub prompt_blocks: usize,
    /// The backend (index) the request's session is pinned to, if any.
    pub session: Option<usize>,
    /// Rotates ties between equal decodes (the host passes a request counter).
    pub tiebreak: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Prefix affinity balanced by load (the default).
    #[default]
    PrefixLoad,
    /// Eligible decodes in rotation.
    RoundRobin,
}

/// The weights of the cost, in prompt blocks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyConfig {
    pub mode: Mode,
    /// What one outstanding request costs, in prompt blocks: a decode that holds the whole
    /// prompt is preferred to an idle one until it has about `prompt blocks /
    /// request_cost` more outstanding requests.
    pub request_cost: f64,
    /// What a full KV pool costs (scaled by its use), in prompt blocks: a nearly full
    /// decode queues new requests for memory.
    pub kv_cost: f64,
    /// Bounded load: a decode at `ceil(load_factor × (total + 1) / n) + load_slack`
    /// outstanding requests or more gets no prefix credit.
    pub load_factor: f64,
    pub load_slack: u32,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            mode: Mode::PrefixLoad,
            request_cost: 8.0,
            kv_cost: 32.0,
            load_factor: 1.5,
            load_slack: 2,
        }
    }
}

/// Why the first decode of a ranking was chosen (the router counts choices by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The request's session is pinned there.
    Session,
    /// It holds part of the prompt.
    Prefix,
    /// By load alone (no decode under the cap holds any of the prompt).
    Load,
    /// Round robin.
    RoundRobin,
    /// No eligible decode.
    NoCandidate,
}

impl Why {
    pub fn label(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Prefix => "prefix",
            Self::Load => "load",
            Self::RoundRobin => "round_robin",
            Self::NoCandidate => "no_candidate",
        }
    }
}

/// The order in which to try decodes (indices into the backends given), and why the first.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranking {
    pub order: Vec<usize>,
    pub why: Why,
}

/// The bounded-load cap for `total` outstanding requests over `n` eligible decodes.
pub fn load_cap(total: u64, n: usize, cfg: &PolicyConfig) -> u32 {
    let share = cfg.load_factor.max(1.0) * (total as f64 + 1.0) / n.max(1) as f64;
    (share.ceil() as u32).saturating_add(cfg.load_slack)
}

/// The order in which to try `backends` for `req`.
pub fn rank(req: &Request, backends: &[Backend], cfg: &PolicyConfig) -> Ranking {
    let eligible: Vec<usize> = (0..backends.len())
        .filter(|&i| backends[i].eligible())
        .collect();
    let n = eligible.len();
    if n == 0 {
        return Ranking {
            order: Vec::new(),
            why: Why::NoCandidate,
        };
    }
    let rot = (req.tiebreak % n as u64) as usize;
    // Position in the rotation: the tie-break, and the whole order in round robin.
    let turn = |pos: usize| (pos + n - rot) % n;
    if cfg.mode == Mode::RoundRobin {
        return Ranking {
            order: (0..n).map(|k| eligible[(rot + k) % n]).collect(),
            why: Why::RoundRobin,
        };
    }
    let total: u64 = eligible
        .iter()
        .map(|&i| u64::from(backends[i].load.outstanding()))
        .sum();
    let cap = load_cap(total, n, cfg);
    struct Key {
        stalled: bool,
        cooling: bool,
        over: bool,
        cost: f64,
        turn: usize,
        credit: usize,
        idx: usize,
    }
    let mut keys: Vec<Key> = eligible
        .iter()
        .enumerate()
        .map(|(pos, &i)| {
            let b = &backends[i];
            let out = b.load.outstanding();
            let over = out >= cap;
            let credit = if over {
                0
            } else {
                b.cached_blocks.min(req.prompt_blocks)
            };
            let kv = if b.load.kv_usage.is_finite() {
                b.load.kv_usage.clamp(0.0, 1.0)
            } else {
                0.0
            };
            let cost = (req.prompt_blocks - credit) as f64
                + cfg.request_cost * f64::from(out)
                + cfg.kv_cost * kv;
            Key {
                stalled: b.stalled,
                cooling: b.cooling,
                over,
                cost,
                turn: turn(pos),
                credit,
                idx: i,
            }
        })
        .collect();
    keys.sort_by(|a, b| {
        (a.stalled, a.cooling, a.over)
            .cmp(&(b.stalled, b.cooling, b.over))
            .then(a.cost.total_cmp(&b.cost))
            .then(a.turn.cmp(&b.turn))
    });
    let mut why = if keys[0].credit > 0 {
        Why::Prefix
    } else {
        Why::Load
    };
    let mut order: Vec<usize> = keys.iter().map(|k| k.idx).collect();
    if let Some(s) = req.session
        && !backends[s].stalled
        && let Some(pos) = order.iter().position(|&i| i == s)
    {
        let s = order.remove(pos);
        order.insert(0, s);
        why = Why::Session;
    }
    Ranking { order, why }
}

/// The decode to retry on after `failed` (the first choice) failed: the first of `order`
/// in another group, else the next one; `None` when there is no other.
pub fn retry_target(order: &[usize], backends: &[Backend], failed: usize) -> Option<usize> {
    let group = backends.get(failed).map(|b| b.group);
    let others = || order.iter().copied().filter(move |&i| i != failed);
    others()
        .find(|&i| Some(backends[i].group) != group)
        .or_else(|| others().next())
}

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
