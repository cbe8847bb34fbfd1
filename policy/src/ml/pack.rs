//! Steps 5–6 of the `ml` policy: packing every latency-critical service's needs onto the
//! host at once, and the degrade rule when they do not fit.
//!
//! Problem: each service offers a few (cores, ways) points that meet its target (its
//! frontier), or one fixed demand; pick one point per service so that the cores and the
//! latency-critical ways fit, leaving the best-effort jobs as much as possible, without
//! moving what works for nothing.
//!
//! Approach: a dynamic programme over services in configuration order whose state is the
//! ways used so far, keeping per state the cheapest partial packing (cost, cores, choices).
//! Cost of a point: its share of the cores plus `way_cost` times its share of the ways
//! ([`Costs`]), plus [`CHANGE_COST`] per resource that differs from what is in force, so
//! near-ties keep what is in force. A first pass offers a service whose allocation is kept
//! by the hysteresis only that allocation, and a service due to give back its need or what
//! it has (so that a give-back never moves a kept neighbour); if nothing fits, or when some
//! service is measured over its target (it outranks the neighbours' hysteresis: at
//! start-up on the E5 `parties-mix`, moses sat over its target for four intervals on the
//! ways nginx's kept allocation left it, nginx at a sixth of its target), a second pass
//! offers every point.
//! Services that share the pool's ways (beyond the CLOSIDs; last in configuration order, so
//! the isolated services' ways are settled when the programme reaches them) use none of the
//! latency-critical ways and pay only for their cores; their point `(cores, ways)` means
//! "enough with a pool of `ways` ways", so it fits only where the isolated services leave
//! the pool at least that many ([`pool_ways`]). A point `(cores, 0)` of an isolated service
//! puts it on the pool's ways (a cache-insensitive service, see `super::search::pool_point`):
//! it uses no latency-critical way and costs only its cores.
//!
//! Degrade ([`degrade`]) when even that does not fit (the overload rule): nobody of the same
//! or a higher priority is cut to make room, unless it misses its target whatever it gets
//! (the triage below). Each service keeps what it has (or its
//! cheapest point, when that is smaller in every resource; a service sharing the pool's
//! ways gets them whatever its point says). While a service is saturated (its p99 at twice
//! its target or more, over it for `shrink_after` intervals in a row), the hysteresis of
//! services of no higher priority does not hold: each takes its cheapest point at once
//! where that is smaller, as it would after `shrink_after` intervals more, so the room
//! reaches the saturated service sooner (with a model that placed memcached on 12 of the
//! 19 cores it needed at start-up, it sat at 20 times its target for 140 s while moses, at
//! 0.8 of its, gave back a core every 10–20 s). Then services that want more are served
//! in [`growth_order`]: higher `priority` first, then the smallest growth to their cheapest
//! point (the most services meeting their targets), then configuration order. Each takes
//! its cheapest point within reach of what is free; failing that, what it lacks from
//! services of strictly lower priority ([`take_from_lower`], the lowest first, each keeping
//! a core and a way); failing that, it grows toward it as far as what is free allows (a
//! service over its target by a quarter more cores, up to twice its need's). Then the
//! triage ([`triage`]): a service persistently over its target and still short takes what
//! it lacks from services of no higher priority that are persistently over their targets
//! and short as well (they miss either way; one violation fewer), and a donor takes nothing
//! back in a triage for a while. Last, a service over its target still short of ways takes
//! them from the one with the most measured slack whose frontier has a point with fewer
//! ways ([`lend_ways`]), or, where no frontier has one, one way a tick on measurements alone
//! from a neighbour well within its target, if it is only a little over its own
//! ([`measured_donor`]). The
//! best-effort pool yields before any of this (the caller lets the services use every way
//! and throttles the pool's bandwidth, see `super::mba`).
//!
//! Properties: the result depends only on the demands and what is in force (and who gave
//! in a recent triage), so it does not oscillate while the loads hold; a degraded packing
//! takes nothing from a service that is not over its target, except ways its own frontier
//! says it can spare, or what a service of higher priority needs to meet its target.
//!
//! Cost: `services × ways × points` for the programme (points ≤ way counts searched).

use std::collections::BTreeMap;

use super::predict::SATURATED;

/// Cost of changing one resource of one service in the packer (a fraction of the host).
pub(super) const CHANGE_COST: f64 = 0.01;

/// What one service needs, as the packer sees it.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Need {
    /// Frontier from the model: (fewest cores, ways) for each way count that has one.
    Frontier { points: Vec<(u32, u32)> },
    /// A fixed demand (fallback step, hold, GPU service).
    Fixed { cores: u32, ways: u32 },
}

/// One latency-critical service as the packer sees it. For a service sharing the pool's
/// ways, the ways of a point are the pool's size it was sized for.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Demand {
    /// Overload priority (higher wins; [`cohabit_core::ServiceSpec::priority`]).
    pub(super) priority: i32,
    /// (cores, ways) in force.
    pub(super) current: (u32, u32),
    pub(super) need: Need,
    /// The allocation in force, when the hysteresis keeps it (safe and not yet due to
    /// shrink).
    pub(super) keep: Option<(u32, u32)>,
    /// The allocation in force, when the service gives back (safe, due to shrink): offered
    /// beside its need while kept allocations are, so that a give-back never moves a
    /// neighbour off an allocation its hysteresis keeps (to a point only the model vouches
    /// for: on the E5 `mba-stream` memcached was moved to one way for moses to give back two
    /// cores, and saturated).
    pub(super) stay: Option<(u32, u32)>,
    /// Shares the pool's ways instead of a range of its own (beyond the CLOSIDs).
    pub(super) shares_pool_ways: bool,
    /// Measured over its target in the last interval.
    pub(super) violating: bool,
    /// Measured over its target in each of the last `shrink_after` intervals: only such
    /// services take part in the triage ([`triage`]), so that a service just cut, or a
    /// transient miss, is neither raided nor raiding.
    pub(super) persistent: bool,
    /// Gave to another service in a recent triage: may give again, may not take (else two
    /// services trade cores back and forth).
    pub(super) yielded: bool,
    /// Measured slack `1 - p99/target` in the last interval.
    pub(super) slack: Option<f64>,
}

impl Demand {
    /// What (`cores`, `ways`) costs the best-effort jobs ([`Costs::of`]).
    pub(super) fn cost(&self, costs: &Costs, cores: u32, ways: u32) -> f64 {
        costs.of(cores, ways, self.shares_pool_ways)
    }

    /// Persistently over its target ([`Demand::persistent`]) and measured past saturation
    /// ([`SATURATED`] times its target or more) in the last interval: queues growing, a
    /// service that serves no more than it can.
    fn saturated(&self) -> bool {
        self.persistent && self.slack.is_some_and(|s| s <= 1.0 - SATURATED)
    }

    /// The (cores, ways) points the service may get: the kept allocation alone when
    /// `allow_keep` and there is one, else its need (with the allocation it may stay at,
    /// when `allow_keep`).
    fn options(&self, allow_keep: bool) -> Vec<(u32, u32)> {
        if let (true, Some(k)) = (allow_keep, self.keep) {
            return vec![k];
        }
        let mut out = match &self.need {
            Need::Fixed { cores, ways } => vec![(*cores, *ways)],
            Need::Frontier { points } => points.clone(),
        };
        if let (true, Some(s)) = (allow_keep, self.stay) {
            if !out.contains(&s) {
                out.push(s);
            }
        }
        out
    }
}

/// What an allocation costs the best-effort jobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Costs {
    /// The host's cores.
    pub(super) cores: u32,
    /// The host's LLC ways.
    pub(super) llc_ways: u32,
    /// Worth of the whole LLC relative to all cores ([`super::MlConfig::way_cost`]).
    pub(super) way_cost: f64,
}

impl Costs {
    /// Share of the cores plus `way_cost` times share of the ways.
    pub(super) fn cost(&self, cores: u32, ways: u32) -> f64 {
        f64::from(cores) / f64::from(self.cores)
            + self.way_cost * f64::from(ways) / f64::from(self.llc_ways)
    }

    /// What a service's (`cores`, `ways`) costs the best-effort jobs: the cores, and the
    /// ways unless it shares the pool's (`shares_pool_ways`: they are the pool's anyway).
    pub(super) fn of(&self, cores: u32, ways: u32, shares_pool_ways: bool) -> f64 {
        self.cost(cores, if shares_pool_ways { 0 } else { ways })
    }
}

/// What the latency-critical services may use together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Room {
    pub(super) cores: u32,
    /// LLC ways (the pool keeps one when CPU jobs run).
    pub(super) ways: u32,
    /// The host's LLC ways: the pool's range is what the isolated services leave of them.
    pub(super) llc_ways: u32,
}

/// Ways of the pool's range when the isolated services use `used` ways: the rest, or the
/// top way (shared) when they use them all (as [`crate::layout`] lays it out).
pub(super) fn pool_ways(room: Room, used: u32) -> u32 {
    if used < room.llc_ways {
        room.llc_ways - used
    } else {
        1
    }
}

/// The packer's answer.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Packing {
    /// (cores, ways) per demand, in order.
    pub(super) alloc: Vec<(u32, u32)>,
    /// The needs did not all fit: the degrade rule decided.
    pub(super) degraded: bool,
    /// The demands whose hold on taking (re)starts: those that gave to others in the
    /// degrade rule's triage ([`triage`]), and those the triage by the count
    /// ([`serve_most`]) gave up, but for one given up again while held and near its
    /// target ([`holds_restarting`]).
    pub(super) yielded: Vec<usize>,
    /// The demands given up by the triage by the count ([`serve_most`]).
    pub(super) given_up: Vec<usize>,
}

/// How far over its target (as a share of it) a service given up while held may be, and
/// still be tried again when its hold lapses ([`serve_most`]).
const RETRY_NEAR: f64 = 0.25;

/// A partial packing in the dynamic programme: (cost, cores used, (cores, ways) so far).
type Partial = (f64, u32, Vec<(u32, u32)>);

/// Steps 5–6: joint packing of `demands` into `room`, or the degrade rule.
pub(super) fn pack(room: Room, costs: &Costs, demands: &[Demand]) -> Packing {
    // A service over its target outranks its neighbours' hysteresis: the keep pass is for
    // stability while everyone meets their targets, not a reason to leave one short.
    let passes: &[bool] = if demands.iter().any(|d| d.violating) {
        &[false]
    } else {
        &[true, false]
    };
    for &allow_keep in passes {
        if let Some(alloc) = cheapest_fit(room, costs, demands, allow_keep) {
            return Packing {
                alloc,
                degraded: false,
                yielded: Vec::new(),
                given_up: Vec::new(),
            };
        }
    }
    let (alloc, yielded) = degrade(room, costs, demands);
    // The triage by the count stands where it serves more services than the degrade rule.
    if let Some(most) = serve_most(room, costs, demands) {
        if served_score(demands, &most.alloc) > served_score(demands, &alloc) {
            return most;
        }
    }
    Packing {
        alloc,
        degraded: true,
        yielded,
        given_up: Vec::new(),
    }
}

/// Weight of one served service at each priority: `(n + 1)^rank`, rank 0 the lowest
/// priority present, so that one service more at a priority outweighs every service below
/// it (the overload rule's lexicographic order).
fn priority_weights(demands: &[Demand]) -> Vec<u64> {
    let mut levels: Vec<i32> = demands.iter().map(|d| d.priority).collect();
    levels.sort_unstable();
    levels.dedup();
    let base = demands.len() as u64 + 1;
    demands
        .iter()
        .map(|d| {
            let rank = levels.iter().position(|&p| p == d.priority).unwrap_or(0);
            base.saturating_pow(u32::try_from(rank).unwrap_or(u32::MAX))
        })
        .collect()
}

/// The services `alloc` serves (not [`short`]), weighed by [`priority_weights`].
fn served_score(demands: &[Demand], alloc: &[(u32, u32)]) -> u64 {
    priority_weights(demands)
        .iter()
        .zip(demands.iter().zip(alloc))
        .filter(|(_, (d, a))| !short(d, **a))
        .map(|(w, _)| *w)
        .sum()
}

/// A service the triage by the count ([`serve_most`]) may give up: saturated
/// ([`Demand::saturated`]: at twice its target or more for a while, it misses whatever a
/// step gives it), or given up recently ([`Demand::yielded`]) and still over its target, so
/// that one that dips under twice its target for a tick does not come back at once and
/// take the ways just given to others. A service merely over its target is not: given up
/// at a floor it would stay over its target there, and so stay given up, where misses
/// could otherwise rotate among several services (docs/EXPERIMENTS.md, "A triage by the
/// count").
fn hopeless(d: &Demand) -> bool {
    d.saturated() || (d.yielded && d.violating)
}

/// The triage by the count (the overload rule's "fewest violations", searched jointly):
/// one option per service, or giving it up, that serves the most services in overload
/// order ([`priority_weights`]), then cuts the fewest below what they hold, then costs the
/// least ([`total_cost`]'s terms). Only a [`hopeless`] service, or one of lower priority
/// than one, may be given up; it then keeps what it holds or drops to a floor (a core and a
/// way; a core on the pool's ways for a service sharing them). A service meeting its target
/// is served, at any point of its own options (the model vouches for each), so ways can
/// move between the services served, which the degrade rule, keeping what each holds,
/// never does. A hopeless service given up lately is not served again while it stays
/// hopeless: else two of them, each "served" by a fallback step from what it was left (the
/// one at its floor always the cheaper), trade places every tick; one near its target is
/// tried again once its hold lapses ([`holds_restarting`]). Those given up then grow
/// from what they were left toward their cheapest needs with what is free, in growth
/// order (latency-critical before best effort).
/// A dynamic programme over services whose state is (ways used, score, cuts), keeping the
/// cheapest partial packing per state: `services × ways × levels × points` at most.
/// Returns the packing (with those given up), or `None` when no service may be given up or
/// even giving up all that may does not fit.
fn serve_most(room: Room, costs: &Costs, demands: &[Demand]) -> Option<Packing> {
    let top_over = demands
        .iter()
        .filter(|d| hopeless(d))
        .map(|d| d.priority)
        .max()?;
    let may_give_up = |d: &Demand| hopeless(d) || d.priority < top_over;
    let weights = priority_weights(demands);
    let w_total = room.ways as usize;
    // State: (ways used, score, services cut below what they hold); per state the cheapest
    // partial packing, as (cost, cores, the state before, this service's point, served).
    type Key = (usize, u64, usize);
    type Node = (f64, u32, Key, (u32, u32), bool);
    let mut layers: Vec<BTreeMap<Key, Node>> = Vec::with_capacity(demands.len());
    let mut dp: BTreeMap<Key, Node> = BTreeMap::new();
    dp.insert((0, 0, 0), (0.0, 0, (0, 0, 0), (0, 0), true));
    for (i, d) in demands.iter().enumerate() {
        // (point, served, cut below what it holds); a hopeless service given up lately is
        // not served again while it stays hopeless.
        let mut opts: Vec<((u32, u32), bool, bool)> = Vec::new();
        if !(d.yielded && hopeless(d)) {
            opts.extend(d.options(false).into_iter().map(|o| (o, true, false)));
            for o in d.keep.into_iter().chain(d.stay) {
                if !opts.iter().any(|(p, _, _)| *p == o) {
                    opts.push((o, true, false));
                }
            }
        }
        if may_give_up(d) {
            let floor = if d.shares_pool_ways { (1, 0) } else { (1, 1) };
            opts.push((d.current, false, false));
            if floor != d.current {
                opts.push((floor, false, true));
            }
        }
        let cur = d.current;
        let mut next: BTreeMap<Key, Node> = BTreeMap::new();
        for (&(u, score, cuts), &(cst, cores, _, _, _)) in &dp {
            for &((c, w), served, cut) in &opts {
                let dw = if d.shares_pool_ways { 0 } else { w as usize };
                let u2 = u + dw;
                if u2 > w_total || cores + c > room.cores {
                    continue;
                }
                let used = u32::try_from(u).unwrap_or(u32::MAX);
                if d.shares_pool_ways && served && w > pool_ways(room, used) {
                    continue;
                }
                let changes = u32::from(c != cur.0) + u32::from(w != cur.1);
                let c2 = cst + d.cost(costs, c, w) + CHANGE_COST * f64::from(changes);
                let key = (
                    u2,
                    score + if served { weights[i] } else { 0 },
                    cuts + usize::from(cut),
                );
                if next.get(&key).is_none_or(|n| c2 < n.0) {
                    next.insert(key, (c2, cores + c, (u, score, cuts), (c, w), served));
                }
            }
        }
        layers.push(std::mem::replace(&mut dp, next));
    }
    // The most served, then the fewest cut, then the least cost.
    let (key, _) = dp.iter().max_by(|((_, sa, ka), a), ((_, sb, kb), b)| {
        sa.cmp(sb).then(kb.cmp(ka)).then(b.0.total_cmp(&a.0))
    })?;
    let mut key = *key;
    layers.push(dp);
    let mut out = vec![(0, 0); demands.len()];
    let mut given_up = Vec::new();
    for i in (0..demands.len()).rev() {
        let (_, _, prev, pick, served) = layers[i + 1][&key];
        out[i] = pick;
        if !served {
            given_up.push(i);
        }
        key = prev;
    }
    given_up.reverse();
    // Those given up grow toward their cheapest needs with what is free.
    let cheapest: Vec<(u32, u32)> = demands
        .iter()
        .map(|d| cheapest_of(costs, d, d.options(false)).unwrap_or(d.current))
        .collect();
    let mut free = free_after(room, demands, &out);
    for &i in growth_order(costs, demands, &cheapest, &out)
        .iter()
        .filter(|i| given_up.contains(i))
    {
        let d = &demands[i];
        let base = out[i];
        let pick = grow_toward(d, cheapest[i], base, free.0, free.1);
        settle(&mut free, &mut out, i, pick, d.shares_pool_ways);
    }
    let yielded = holds_restarting(demands, &given_up);
    Some(Packing {
        alloc: out,
        degraded: true,
        yielded,
        given_up,
    })
}

/// Which of the services `given_up` by [`serve_most`] start a hold on taking
/// ([`Packing::yielded`]): one given up afresh, or given up again while held and saturated
/// or more than [`RETRY_NEAR`] over its target (a step would not serve it). One given up
/// again while held and nearer its target keeps the hold it has and is tried again when
/// that lapses: else, hopeless because held, it would stay given up for good however
/// little it lacks (docs/EXPERIMENTS.md, "A service given up near its target is tried
/// again").
fn holds_restarting(demands: &[Demand], given_up: &[usize]) -> Vec<usize> {
    given_up
        .iter()
        .copied()
        .filter(|&i| {
            let d = &demands[i];
            !d.yielded || d.saturated() || d.slack.is_none_or(|s| s < -RETRY_NEAR)
        })
        .collect()
}

/// The dynamic programme: the cheapest choice of one option per demand that fits `room`,
/// if any.
fn cheapest_fit(
    room: Room,
    costs: &Costs,
    demands: &[Demand],
    allow_keep: bool,
) -> Option<Vec<(u32, u32)>> {
    let c_total = room.cores;
    let w_total = room.ways as usize;
    // dp[u] = (cost, cores, choices) using u ways.
    let mut dp: Vec<Option<Partial>> = vec![None; w_total + 1];
    dp[0] = Some((0.0, 0, vec![]));
    for d in demands {
        let opts = d.options(allow_keep);
        let cur = d.current;
        let mut next: Vec<Option<Partial>> = vec![None; w_total + 1];
        for (u, e) in dp.iter().enumerate() {
            let Some((cst, cores, ch)) = e else { continue };
            for &(c, w) in &opts {
                let dw = if d.shares_pool_ways { 0 } else { w as usize };
                let u2 = u + dw;
                if u2 > w_total || cores + c > c_total {
                    continue;
                }
                // A sharer sized for a pool of w ways needs at least that many left.
                let used = u32::try_from(u).unwrap_or(u32::MAX);
                if d.shares_pool_ways && w > pool_ways(room, used) {
                    continue;
                }
                // Changing costs a little, so near-ties keep what is in force.
                let changes = u32::from(c != cur.0) + u32::from(w != cur.1);
                let c2 = cst + d.cost(costs, c, w) + CHANGE_COST * f64::from(changes);
                if next[u2].as_ref().is_none_or(|(b, _, _)| c2 < *b) {
                    let mut ch2 = ch.clone();
                    ch2.push((c, w));
                    next[u2] = Some((c2, cores + c, ch2));
                }
            }
        }
        dp = next;
    }
    dp.into_iter()
        .flatten()
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, _, ch)| ch)
}

/// `a` is at most `b` in every resource.
fn below(a: (u32, u32), b: (u32, u32)) -> bool {
    a.0 <= b.0 && a.1 <= b.1
}

/// Moves demand `i` from what it holds in `out` to `pick`, `free` taking back the
/// difference (the ways too, unless it shares the pool's).
fn settle(
    free: &mut (u32, u32),
    out: &mut [(u32, u32)],
    i: usize,
    pick: (u32, u32),
    shares_pool_ways: bool,
) {
    let base = out[i];
    free.0 = (free.0 + base.0).saturating_sub(pick.0);
    if !shares_pool_ways {
        free.1 = (free.1 + base.1).saturating_sub(pick.1);
    }
    out[i] = pick;
}

/// The cheapest of `opts` for `d`, if any.
fn cheapest_of(costs: &Costs, d: &Demand, opts: Vec<(u32, u32)>) -> Option<(u32, u32)> {
    opts.into_iter()
        .min_by(|a, b| d.cost(costs, a.0, a.1).total_cmp(&d.cost(costs, b.0, b.1)))
}

/// The (cores, ways) of `room` that `alloc` leaves free (services sharing the pool's ways
/// use none of the latency-critical ways).
fn free_after(room: Room, demands: &[Demand], alloc: &[(u32, u32)]) -> (u32, u32) {
    let lc_ways: u32 = alloc
        .iter()
        .zip(demands)
        .filter(|(_, d)| !d.shares_pool_ways)
        .map(|(x, _)| x.1)
        .sum();
    (
        room.cores.saturating_sub(alloc.iter().map(|x| x.0).sum()),
        room.ways.saturating_sub(lc_ways),
    )
}

/// The degrade rule (see the module docs). Returns (cores, ways) per demand, and the
/// demands that gave in the triage.
pub(super) fn degrade(
    room: Room,
    costs: &Costs,
    demands: &[Demand],
) -> (Vec<(u32, u32)>, Vec<usize>) {
    // A service saturated for a while outranks the hysteresis of those of no higher
    // priority: they go to their needs at once where those are smaller.
    let top_saturated = demands
        .iter()
        .filter(|d| d.saturated())
        .map(|d| d.priority)
        .max();
    let cheapest: Vec<(u32, u32)> = demands
        .iter()
        .map(|d| {
            let yields = top_saturated.is_some_and(|p| d.priority <= p) && !d.saturated();
            cheapest_of(costs, d, d.options(!yields)).unwrap_or(d.current)
        })
        .collect();
    let mut out: Vec<(u32, u32)> = cheapest
        .iter()
        .zip(demands)
        .map(|(n, d)| if below(*n, d.current) { *n } else { d.current })
        .collect();
    let mut free = free_after(room, demands, &out);
    let order = growth_order(costs, demands, &cheapest, &out);
    for &i in &order {
        let d = &demands[i];
        let base = out[i];
        let pool = d.shares_pool_ways;
        let reach = |&(c, w): &(u32, u32)| c <= base.0 + free.0 && (pool || w <= base.1 + free.1);
        let within: Vec<(u32, u32)> = d.options(false).into_iter().filter(reach).collect();
        let pick = match cheapest_of(costs, d, within) {
            Some(p) => p,
            None => match take_from_lower(demands, &mut out, i, cheapest[i], &mut free) {
                Some(p) => p,
                None => grow_toward(d, cheapest[i], base, free.0, free.1),
            },
        };
        settle(&mut free, &mut out, i, pick, pool);
    }
    let yielded = triage(demands, &cheapest, &order, &mut out, &mut free);
    lend_ways(demands, &cheapest, &mut out, free.0);
    (out, yielded)
}

/// Triage, for the fewest violations: a service persistently over its target
/// ([`Demand::persistent`]) and still short of its need, in growth order (the smallest
/// growth first), takes what it lacks from services of no higher priority that are
/// persistently over their targets and short of their needs as well (the lowest priority
/// first, then the most slack; each keeps a core and a way). Such a donor misses its target
/// whether it gives or not, and the taker then meets its own: one violation fewer. Without
/// it, on the crowded E5 scenario `ml` held five cores and six ways for moses, which no
/// allocation within the host's reach serves, while masstree, mongodb and nginx each missed
/// their targets half of the time for want of a core or two (the oracle gives moses up and
/// meets the other seven). Persistence keeps transient misses out: at start-up, when every
/// service is over its target and the fallback's needs are guesses, moses would take
/// memcached's cores on the E5 `mba-stream` for good. A donor is `yielded` for a while (the
/// caller remembers it) and takes nothing back in the triage meanwhile: else moses and
/// nginx, both short on the crowded E5, took a core from each other every tick. Returns the
/// donors.
fn triage(
    demands: &[Demand],
    cheapest: &[(u32, u32)],
    order: &[usize],
    out: &mut [(u32, u32)],
    free: &mut (u32, u32),
) -> Vec<usize> {
    let mut gave: Vec<usize> = Vec::new();
    for &i in order {
        let d = &demands[i];
        if !d.persistent || d.yielded || gave.contains(&i) || !short(d, out[i]) {
            continue;
        }
        let donors: Vec<usize> = (0..demands.len())
            .filter(|&j| j != i && demands[j].priority <= d.priority)
            .filter(|&j| demands[j].persistent && short(&demands[j], out[j]))
            .collect();
        let before = out.to_vec();
        if let Some(pick) = take_from(demands, out, i, cheapest[i], free, donors) {
            settle(free, out, i, pick, d.shares_pool_ways);
            gave.extend((0..out.len()).filter(|&j| j != i && out[j] != before[j]));
        }
    }
    gave.sort_unstable();
    gave.dedup();
    gave
}

/// The order in which services that want more are served: higher priority first; within
/// a priority the smallest growth to the cheapest need first, so that as many services as
/// possible meet their targets (with one scarce resource, smallest first is the most that
/// fit); then configuration order.
fn growth_order(
    costs: &Costs,
    demands: &[Demand],
    cheapest: &[(u32, u32)],
    out: &[(u32, u32)],
) -> Vec<usize> {
    let growth = |i: usize| {
        let d = &demands[i];
        d.cost(costs, cheapest[i].0, cheapest[i].1) - d.cost(costs, out[i].0, out[i].1)
    };
    let mut order: Vec<usize> = (0..demands.len())
        .filter(|&i| !below(cheapest[i], out[i]))
        .collect();
    order.sort_by(|&a, &b| {
        demands[b]
            .priority
            .cmp(&demands[a].priority)
            .then(growth(a).total_cmp(&growth(b)))
            .then(a.cmp(&b))
    });
    order
}

/// A service `i` whose `need` is out of reach of what is `free` takes what it lacks from
/// services of strictly lower priority ([`take_from`]).
fn take_from_lower(
    demands: &[Demand],
    out: &mut [(u32, u32)],
    i: usize,
    need: (u32, u32),
    free: &mut (u32, u32),
) -> Option<(u32, u32)> {
    let donors = (0..demands.len())
        .filter(|&j| demands[j].priority < demands[i].priority)
        .collect();
    take_from(demands, out, i, need, free, donors)
}

/// Service `i` takes what its `need` lacks beyond what is `free` from `donors` (the lowest
/// priority first, then the one with most measured slack), leaving each at least one core
/// and one way; returns `need` when that is enough (what was taken is then `free`, and the
/// donors' allocations are lowered in `out`), `None` (and nothing changed) otherwise.
fn take_from(
    demands: &[Demand],
    out: &mut [(u32, u32)],
    i: usize,
    need: (u32, u32),
    free: &mut (u32, u32),
    mut donors: Vec<usize>,
) -> Option<(u32, u32)> {
    let d = &demands[i];
    let base = out[i];
    let mut lack_c = need.0.saturating_sub(base.0 + free.0);
    let mut lack_w = if d.shares_pool_ways {
        0
    } else {
        need.1.saturating_sub(base.1 + free.1)
    };
    donors.sort_by(|&a, &b| {
        let (da, db) = (&demands[a], &demands[b]);
        da.priority
            .cmp(&db.priority)
            .then(db.slack.unwrap_or(0.0).total_cmp(&da.slack.unwrap_or(0.0)))
    });
    let spare = |j: usize, out: &[(u32, u32)]| {
        let w = if demands[j].shares_pool_ways {
            0
        } else {
            out[j].1.saturating_sub(1)
        };
        (out[j].0.saturating_sub(1), w)
    };
    let (sc, sw) = donors.iter().fold((0, 0), |acc, &j| {
        let s = spare(j, out);
        (acc.0 + s.0, acc.1 + s.1)
    });
    if sc < lack_c || sw < lack_w || (lack_c == 0 && lack_w == 0) {
        return None;
    }
    for j in donors {
        let (c, w) = spare(j, out);
        let tc = c.min(lack_c);
        let tw = w.min(lack_w);
        out[j] = (out[j].0 - tc, out[j].1 - tw);
        lack_c -= tc;
        lack_w -= tw;
        free.0 += tc;
        free.1 += tw;
    }
    Some(need)
}

/// How many demands the allocation `alloc` leaves short: below every option (a fixed
/// demand, a kept allocation or any frontier point) in some resource.
pub(super) fn unmet(demands: &[Demand], alloc: &[(u32, u32)]) -> usize {
    demands
        .iter()
        .zip(alloc)
        .filter(|(d, a)| short(d, **a))
        .count()
}

/// `a` is below every option of `d` in some resource.
fn short(d: &Demand, a: (u32, u32)) -> bool {
    let mut opts = d.options(false);
    opts.extend(d.keep);
    !opts
        .iter()
        .any(|o| o.0 <= a.0 && (d.shares_pool_ways || o.1 <= a.1))
}

/// What `alloc` costs the best-effort jobs: every service's cost, plus [`CHANGE_COST`] per
/// changed resource.
pub(super) fn total_cost(costs: &Costs, demands: &[Demand], alloc: &[(u32, u32)]) -> f64 {
    demands
        .iter()
        .zip(alloc)
        .map(|(d, &(c, w))| {
            let changes = u32::from(c != d.current.0) + u32::from(w != d.current.1);
            d.cost(costs, c, w) + CHANGE_COST * f64::from(changes)
        })
        .sum()
}

/// Nothing within reach: grow from `base` toward the cheapest point `need` as far as what
/// is free allows; a service over its target also gets a quarter more cores (at least one;
/// the ways it wants are taken), up to twice what its need has.
fn grow_toward(
    d: &Demand,
    need: (u32, u32),
    base: (u32, u32),
    free_c: u32,
    free_w: u32,
) -> (u32, u32) {
    let want = if d.violating {
        need.0.max((base.0 + (base.0 / 4).max(1)).min(need.0 * 2))
    } else {
        need.0
    };
    (
        want.max(base.0).min(base.0 + free_c),
        if d.shares_pool_ways {
            base.1
        } else {
            need.1.max(base.1).min(base.1 + free_w)
        },
    )
}

/// A borrower within this share over its target may take a way on measurements alone
/// ([`measured_donor`]): a service starved of ways some way over its target (moses on the
/// crowded Gold, on one way and most of the cores) is no worse off for one way a tick, read
/// back each time (the settings compared: docs/EXPERIMENTS.md, "A triage by the count").
const LEND_NEAR: f64 = 0.5;

/// A donor on measurements alone reads at most `1 - LEND_SLACK` of its target: within the
/// margin, so one the frontier would hold as it is. A wider slack, with a donor keeping two
/// ways, left a service short of ways beside neighbours just inside their margins
/// (docs/EXPERIMENTS.md, "Ways for a crowded host's service short of them").
const LEND_SLACK: f64 = 0.1;

/// When no donor's options vouch for fewer ways: a borrower over its target for a while
/// (persistent) but by no more than [`LEND_NEAR`] takes one way from the service of no higher
/// priority that measured the most slack, at least [`LEND_SLACK`], and keeps a way or more
/// after it. The model's spread can leave a service some way over its target for
/// good beside a neighbour at 0.6 of its own (a retrained model on the E5 `mba-stream`,
/// seed 0: moses at 1.04 of its target for the whole run, memcached at 0.61 on 11 ways);
/// one way a tick, read back each time, is the feedback step PARTIES would take. Far over
/// its target (a crowded host's service that misses whatever it gets), a borrower takes
/// nothing this way: the triage decides there. Returns the donor as [`lend_ways`] uses it:
/// its index, what it keeps, and `false` (the borrower takes the one way, not its need).
fn measured_donor(
    demands: &[Demand],
    i: usize,
    out: &[(u32, u32)],
) -> Option<(usize, (u32, u32), bool)> {
    let d = &demands[i];
    if !d.persistent || d.slack.is_none_or(|s| s < -LEND_NEAR) {
        return None;
    }
    (0..demands.len())
        .filter(|&j| j != i && out[j].1 >= 2)
        .filter(|&j| {
            let o = &demands[j];
            !o.violating
                && !o.shares_pool_ways
                && o.priority <= d.priority
                && o.slack.is_some_and(|s| s >= LEND_SLACK)
        })
        .max_by(|&a, &b| {
            let slack = |j: usize| demands[j].slack.unwrap_or(0.0);
            slack(a).total_cmp(&slack(b))
        })
        .map(|j| (j, (out[j].0, out[j].1 - 1), false))
}

/// A service over its target that still lacks the ways it wants (`cheapest`) takes them
/// from the service with the most measured slack whose options include one with fewer ways
/// (and the cores it then needs are free): one step's worth per interval; failing that, one
/// way on measurements alone ([`measured_donor`]). The cores the borrower holds beyond its
/// need count as free for a donor that gives it every way it lacks (it then holds exactly
/// its need): otherwise a service whose fallback grew its cores while its ways were gone
/// could block the only donor for good (a deadlock seen on the E5 `mba-stream`: memcached
/// on one way and every core, moses unable to give ways back for want of a core).
fn lend_ways(demands: &[Demand], cheapest: &[(u32, u32)], out: &mut [(u32, u32)], free_c: u32) {
    let mut free_c = free_c;
    for i in 0..demands.len() {
        if !demands[i].violating || demands[i].shares_pool_ways || out[i].1 >= cheapest[i].1 {
            continue;
        }
        let lack = cheapest[i].1 - out[i].1;
        let spare = out[i].0.saturating_sub(cheapest[i].0);
        let donor = (0..demands.len())
            .filter(|&j| j != i && !demands[j].violating && !demands[j].shares_pool_ways)
            .filter_map(|j| {
                let (fewer, whole) = demands[j]
                    .options(false)
                    .into_iter()
                    .filter_map(|(c, w)| {
                        if w >= out[j].1 {
                            None
                        } else if c <= out[j].0 + free_c {
                            Some(((c, w), false))
                        } else if w + lack <= out[j].1 && c <= out[j].0 + free_c + spare {
                            Some(((c, w), true))
                        } else {
                            None
                        }
                    })
                    .max_by_key(|&((_, w), whole)| (!whole, w))?;
                Some((j, fewer, whole, demands[j].slack.unwrap_or(0.0)))
            })
            .max_by(|a, b| a.3.total_cmp(&b.3))
            .map(|(j, fewer, whole, _)| (j, fewer, whole));
        let donor = donor.or_else(|| measured_donor(demands, i, out));
        if let Some((j, (c, w), whole)) = donor {
            let freed = out[j].1 - w;
            if whole {
                free_c = (free_c + spare + out[j].0).saturating_sub(c);
                out[i] = cheapest[i];
            } else {
                free_c = (free_c + out[j].0).saturating_sub(c);
                out[i].1 += freed.min(lack);
            }
            out[j] = (c, w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 36-core, 20-way host with one way kept for the pool; the whole LLC is worth a
    /// tenth of all cores.
    const ROOM: Room = Room {
        cores: 36,
        ways: 19,
        llc_ways: 20,
    };
    const COSTS: Costs = Costs {
        cores: 36,
        llc_ways: 20,
        way_cost: 0.1,
    };

    fn frontier(current: (u32, u32), points: &[(u32, u32)]) -> Demand {
        Demand {
            priority: 0,
            current,
            need: Need::Frontier {
                points: points.to_vec(),
            },
            keep: None,
            stay: None,
            shares_pool_ways: false,
            violating: false,
            persistent: false,
            yielded: false,
            slack: Some(0.2),
        }
    }

    fn fixed(current: (u32, u32), cores: u32, ways: u32) -> Demand {
        Demand {
            need: Need::Fixed { cores, ways },
            ..frontier(current, &[])
        }
    }

    fn violating(d: Demand) -> Demand {
        Demand {
            violating: true,
            slack: Some(-0.3),
            ..d
        }
    }

    #[test]
    fn cost_is_the_share_of_cores_plus_way_cost_times_the_share_of_ways() {
        // 9 / 36 + 0.1 * 10 / 20 = 0.25 + 0.05.
        assert!((COSTS.cost(9, 10) - 0.3).abs() < 1e-12);
    }

    #[test]
    fn the_packer_picks_each_services_cheapest_point_when_all_fit() {
        // a: (10, 2) costs 0.2878, (6, 8) costs 0.2067 (+0.02 for two changes from (8, 4)):
        // (6, 8). b: (4, 4) or (3, 9): 0.1311 vs 0.1283, each +0.02: (3, 9). 17 ways fit.
        let demands = [
            frontier((8, 4), &[(10, 2), (6, 8)]),
            frontier((5, 5), &[(4, 4), (3, 9)]),
        ];
        let p = pack(ROOM, &COSTS, &demands);
        assert_eq!(
            p,
            Packing {
                alloc: vec![(6, 8), (3, 9)],
                degraded: false,
                yielded: vec![],
                given_up: vec![],
            }
        );
    }

    #[test]
    fn the_packer_trades_ways_between_services_to_fit_the_llc() {
        // 19 ways. a and b each offer (4, 12) or (8, 6); both on (4, 12) would need 24 ways.
        // Costs: (4, 12) 0.1111 + 0.06 = 0.1711, (8, 6) 0.2222 + 0.03 = 0.2522. a moves from
        // (6, 9) either way (+0.02); b has (8, 6) in force, so staying costs it nothing more:
        // a (4, 12) + b (8, 6) costs 0.4233 + 0.02, a (8, 6) + b (4, 12) 0.4233 + 0.04.
        let demands = [
            frontier((6, 9), &[(4, 12), (8, 6)]),
            frontier((8, 6), &[(4, 12), (8, 6)]),
        ];
        let p = pack(ROOM, &COSTS, &demands);
        assert!(!p.degraded);
        assert_eq!(p.alloc, vec![(4, 12), (8, 6)]);
    }

    #[test]
    fn a_change_costs_a_little_so_a_near_tie_keeps_what_is_in_force() {
        // (9, 4): 0.25 + 0.02 = 0.27, in force. (8, 6): 0.2222 + 0.03 = 0.2522, two changes
        // (+0.02): 0.2722 > 0.27. Stays.
        let demands = [frontier((9, 4), &[(9, 4), (8, 6)])];
        assert_eq!(pack(ROOM, &COSTS, &demands).alloc, vec![(9, 4)]);
    }

    #[test]
    fn a_kept_allocation_is_offered_alone_while_it_fits() {
        // The frontier has a cheaper (4, 2); the hysteresis keeps (10, 6).
        let d = Demand {
            keep: Some((10, 6)),
            ..frontier((10, 6), &[(4, 2)])
        };
        assert_eq!(pack(ROOM, &COSTS, &[d]).alloc, vec![(10, 6)]);
    }

    #[test]
    fn a_service_over_its_target_outranks_a_neighbours_hysteresis() {
        // a is kept at (6, 8) though (5, 4) would do; b, over its target on (6, 6), could
        // get (10, 8) beside a's kept allocation, or (6, 12) with a moved to (5, 4), which
        // is cheaper: the kept allocation yields to the service in trouble.
        let a = Demand {
            keep: Some((6, 8)),
            ..frontier((6, 8), &[(5, 4)])
        };
        let b = violating(frontier((6, 6), &[(10, 8), (6, 12)]));
        let p = pack(ROOM, &COSTS, &[a.clone(), b.clone()]);
        assert!(!p.degraded);
        assert_eq!(p.alloc, vec![(5, 4), (6, 12)]);
        // With b within its target, a is kept.
        let calm = Demand {
            violating: false,
            ..b
        };
        assert_eq!(pack(ROOM, &COSTS, &[a, calm]).alloc, vec![(6, 8), (10, 8)]);
    }

    #[test]
    fn a_give_back_never_moves_a_kept_neighbour() {
        // a is kept at (21, 6); b, due to give back, wants (12, 18) (two cores fewer, five
        // ways more): only by moving a onto one way. b stays at what it has instead.
        let demands = [
            Demand {
                keep: Some((21, 6)),
                ..frontier((21, 6), &[(21, 1), (21, 6)])
            },
            Demand {
                stay: Some((14, 13)),
                ..frontier((14, 13), &[(12, 18)])
            },
        ];
        let p = pack(ROOM, &COSTS, &demands);
        assert!(!p.degraded);
        assert_eq!(p.alloc, vec![(21, 6), (14, 13)]);
        // Without the stay, the kept neighbour is moved: the rule is what keeps it.
        let moved = [
            demands[0].clone(),
            Demand {
                stay: None,
                ..demands[1].clone()
            },
        ];
        assert_eq!(pack(ROOM, &COSTS, &moved).alloc, vec![(21, 1), (12, 18)]);
    }

    #[test]
    fn a_kept_allocation_yields_when_keeping_it_leaves_no_room_for_the_others() {
        // a keeps (20, 10); b's only point is (20, 4): 40 cores > 36. Without the keep, a
        // takes (12, 10) from its frontier: 32 cores.
        let a = Demand {
            keep: Some((20, 10)),
            ..frontier((20, 10), &[(12, 10)])
        };
        let b = frontier((10, 4), &[(20, 4)]);
        let p = pack(ROOM, &COSTS, &[a, b]);
        assert_eq!(
            p,
            Packing {
                alloc: vec![(12, 10), (20, 4)],
                degraded: false,
                yielded: vec![],
                given_up: vec![],
            }
        );
    }

    /// `d` sharing the pool's ways.
    fn sharing(d: Demand) -> Demand {
        Demand {
            shares_pool_ways: true,
            ..d
        }
    }

    #[test]
    fn services_sharing_the_pools_ways_use_none_of_the_services_ways() {
        // a takes 15 of the 19 ways; b shares the pool's ways, sized for a pool of 5: the
        // 20 - 15 = 5 left are enough, and they are not a's.
        let a = fixed((10, 15), 10, 15);
        let b = sharing(fixed((4, 5), 4, 5));
        let p = pack(ROOM, &COSTS, &[a, b]);
        assert_eq!(p.alloc, vec![(10, 15), (4, 5)]);
        assert!(!p.degraded);
    }

    #[test]
    fn a_sharer_fits_only_where_the_isolated_services_leave_the_pool_its_ways() {
        // a offers (6, 16) or (9, 8); b shares the pool's ways and needs 12 cores with a pool
        // of 4 ways, or 6 with a pool of 12. a's (6, 16) costs 0.2467 (+0.02, two changes)
        // and leaves a pool of 4: b needs 12 cores, 0.3333 (+0.02). a's (9, 8) costs 0.29
        // and leaves 12: b needs 6 cores, 0.1667. 0.4567 < 0.62: a (9, 8), b (6, 12).
        let a = frontier((9, 8), &[(6, 16), (9, 8)]);
        let b = sharing(frontier((6, 12), &[(12, 4), (6, 12)]));
        let p = pack(ROOM, &COSTS, &[a.clone(), b.clone()]);
        assert_eq!(p.alloc, vec![(9, 8), (6, 12)]);
        // With a pool of 4 at most (a needs 16 ways), b takes its 12 cores.
        let a = frontier((9, 8), &[(6, 16)]);
        assert_eq!(pack(ROOM, &COSTS, &[a, b]).alloc, vec![(6, 16), (12, 4)]);
    }

    #[test]
    fn the_pool_keeps_its_top_way_when_the_isolated_services_take_every_way() {
        let room = Room {
            cores: 36,
            ways: 20,
            llc_ways: 20,
        };
        assert_eq!(pool_ways(room, 20), 1);
        assert_eq!(pool_ways(room, 19), 1);
        assert_eq!(pool_ways(room, 12), 8);
    }

    #[test]
    fn a_sharer_pays_for_its_cores_only() {
        // (10, 12) costs a sharer 10 / 36 = 0.2778, an isolated service 0.2778 + 0.06.
        let d = sharing(fixed((10, 12), 10, 12));
        assert!((d.cost(&COSTS, 10, 12) - 10.0 / 36.0).abs() < 1e-12);
        assert!((fixed((10, 12), 10, 12).cost(&COSTS, 10, 12) - 0.3378).abs() < 1e-4);
    }

    #[test]
    fn degrade_cuts_nobody_to_make_room_and_serves_the_smallest_growth_first() {
        // a has (20, 8) and needs (24, 8); b has (14, 8) and needs (16, 8): 40 cores > 36.
        // Nobody gives up what it has: 36 - 34 = 2 free cores. b needs only those 2 and
        // takes them (16, 8), meeting its target; a keeps (20, 8). (Before issue 14 the
        // first in configuration order grew by the 2 and neither met its target: the rule
        // now serves the smallest growth first, for the fewest violations.)
        let demands = [fixed((20, 8), 24, 8), fixed((14, 8), 16, 8)];
        let p = pack(ROOM, &COSTS, &demands);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(20, 8), (16, 8)]);
        assert_eq!(unmet(&demands, &p.alloc), 1);
    }

    #[test]
    fn degrade_serves_growers_smallest_growth_first_then_in_configuration_order() {
        // 36 cores: a (10, 4) and b (10, 4) want (14, 4); c (14, 4) wants (16, 4): 44 > 36.
        // 36 - 34 = 2 cores free. c needs just 2 and meets its target (16, 4); a and b,
        // tied, find nothing left and keep what they have.
        let demands = [
            fixed((10, 4), 14, 4),
            fixed((10, 4), 14, 4),
            fixed((14, 4), 16, 4),
        ];
        let p = pack(ROOM, &COSTS, &demands);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(10, 4), (10, 4), (16, 4)]);
        // 3 cores free; a and b need 2 each, c 3. a, first among the equals in
        // configuration order, meets its need; b grows by the one left; c is out of reach.
        let demands = [
            fixed((10, 4), 12, 4),
            fixed((10, 4), 12, 4),
            fixed((13, 4), 16, 4),
        ];
        let p = pack(ROOM, &COSTS, &demands);
        assert_eq!(p.alloc, vec![(12, 4), (11, 4), (13, 4)]);
    }

    /// `d` with overload priority `p`.
    fn prio(p: i32, d: Demand) -> Demand {
        Demand { priority: p, ..d }
    }

    #[test]
    fn a_saturated_service_outranks_its_neighbours_hysteresis() {
        // 36 cores: a holds (24, 8) kept by its hysteresis, its need (18, 8); b has (12, 8)
        // and needs (20, 8). While b is over its target but not saturated, a keeps 24.
        let a = Demand {
            keep: Some((24, 8)),
            ..frontier((24, 8), &[(18, 8)])
        };
        let over = Demand {
            persistent: true,
            ..violating(fixed((12, 8), 20, 8))
        };
        let p = pack(ROOM, &COSTS, &[a.clone(), over.clone()]);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(24, 8), (12, 8)]);
        // b saturated (20 times its target) for a while: a goes to its need now, and b
        // grows into the 6 cores that frees.
        let saturated = Demand {
            slack: Some(-19.0),
            ..over.clone()
        };
        let p = pack(ROOM, &COSTS, &[a.clone(), saturated.clone()]);
        assert_eq!(p.alloc, vec![(18, 8), (18, 8)]);
        // Not for a first saturated reading, nor for a service of lower priority.
        let first = Demand {
            persistent: false,
            ..saturated.clone()
        };
        assert_eq!(pack(ROOM, &COSTS, &[a.clone(), first]).alloc[0], (24, 8));
        let low = prio(-1, saturated);
        assert_eq!(pack(ROOM, &COSTS, &[a, low]).alloc[0], (24, 8));
    }

    #[test]
    fn a_higher_priority_service_takes_what_it_lacks_from_lower_priority_ones() {
        // 36 cores: a (priority 0, slack 0.2) holds (20, 4); b (priority 1, over its target)
        // has (14, 4) and needs (24, 6). 2 cores free, 11 ways: b lacks 8 cores, which a
        // yields (20 -> 12); b meets its need.
        let a = fixed((20, 4), 20, 4);
        let b = prio(1, violating(fixed((14, 4), 24, 6)));
        let demands = [a, b];
        let p = pack(ROOM, &COSTS, &demands);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(12, 4), (24, 6)]);
        assert_eq!(unmet(&demands, &p.alloc), 1);
        // At equal priority nobody is cut: b grows by what is free.
        let demands = [fixed((20, 4), 20, 4), violating(fixed((14, 4), 24, 6))];
        let p = pack(ROOM, &COSTS, &demands);
        assert_eq!(p.alloc[0], (20, 4));
        assert_eq!(p.alloc[1], (16, 6));
    }

    #[test]
    fn the_lowest_priority_yields_first_and_a_donor_keeps_a_core_and_a_way() {
        // c (priority 2) needs 10 more cores than are free; a (priority 0) has 6, b
        // (priority 1) has 12. a yields 5 (keeps 1), b the other 5.
        let a = fixed((6, 2), 6, 2);
        let b = prio(1, fixed((12, 2), 12, 2));
        let c = prio(2, fixed((18, 2), 28, 2));
        let p = pack(ROOM, &COSTS, &[a, b, c]);
        assert_eq!(p.alloc, vec![(1, 2), (7, 2), (28, 2)]);
        // Lower-priority services cannot free enough: nobody is cut, c grows into what is
        // free.
        let a = fixed((6, 2), 6, 2);
        let c = prio(2, fixed((30, 2), 40, 2));
        let p = pack(ROOM, &COSTS, &[a, c]);
        assert_eq!(p.alloc, vec![(6, 2), (30, 2)]);
    }

    #[test]
    fn triage_takes_from_a_service_that_misses_anyway_for_one_that_then_meets_its_target() {
        // 36 cores: a (6, 4) needs 10 cores, b (20, 10) needs 30 (out of reach), c (8, 4)
        // is kept. Two cores are free: a grows to 8 and is still short. Both a and b have
        // been over their targets for a while: b, which misses whatever it gets, gives a
        // the two cores it lacks (one violation fewer).
        let persistent = |d: Demand| Demand {
            persistent: true,
            ..violating(d)
        };
        let a = persistent(fixed((6, 4), 10, 4));
        let b = persistent(fixed((20, 10), 30, 10));
        let c = Demand {
            keep: Some((8, 4)),
            ..frontier((8, 4), &[(8, 4)])
        };
        let p = pack(ROOM, &COSTS, &[a.clone(), b.clone(), c.clone()]);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(10, 4), (18, 10), (8, 4)]);
        assert_eq!(p.yielded, vec![1]);
        // A service that gave in a recent triage takes nothing back in one.
        let a_gave = Demand {
            yielded: true,
            ..a.clone()
        };
        let p = pack(ROOM, &COSTS, &[a_gave, b.clone(), c.clone()]);
        assert_eq!(p.alloc, vec![(8, 4), (20, 10), (8, 4)]);
        // A miss that is not persistent on either side changes nothing: a grows into what
        // is free, b keeps what it has.
        let b_new = violating(fixed((20, 10), 30, 10));
        let p = pack(ROOM, &COSTS, &[a, b_new, c.clone()]);
        assert_eq!(p.alloc, vec![(8, 4), (20, 10), (8, 4)]);
        let a_new = violating(fixed((6, 4), 10, 4));
        let p = pack(ROOM, &COSTS, &[a_new, b, c]);
        assert_eq!(p.alloc, vec![(8, 4), (20, 10), (8, 4)]);
    }

    /// A service meeting its target (slack 0.1) on `held`, kept there, with no other
    /// option.
    fn holding(held: (u32, u32)) -> Demand {
        Demand {
            keep: Some(held),
            slack: Some(0.1),
            ..frontier(held, &[held])
        }
    }

    /// Over its target for a while, at 20 times it: hopeless ([`hopeless`]).
    fn saturated(d: Demand) -> Demand {
        Demand {
            persistent: true,
            slack: Some(-19.0),
            ..violating(d)
        }
    }

    /// k meets its target on (6, 10) at 0.9 of it (no way to spare on measurements alone),
    /// or on (9, 2); s, hopeless, needs (5, 9).
    fn ways_held_by_k() -> (Demand, Demand) {
        let k = Demand {
            keep: Some((6, 10)),
            slack: Some(0.1),
            ..frontier((6, 10), &[(6, 10), (9, 2)])
        };
        (k, saturated(frontier((2, 2), &[(5, 9)])))
    }

    #[test]
    fn the_triage_by_the_count_gives_up_a_hopeless_service_and_moves_ways_between_the_others() {
        // 36 cores, 19 ways; k and s as in [`ways_held_by_k`]; m, hopeless too, needs
        // (30, 10), out of reach. The degrade rule keeps k on its ten ways, so s cannot
        // have nine and only k meets its target. Moving k to (9, 2) serves s too, with m
        // kept on what it holds (nothing need be cut); m then grows with what is free.
        let (k, s) = ways_held_by_k();
        let m = saturated(fixed((10, 5), 30, 10));
        let p = pack(ROOM, &COSTS, &[k.clone(), s.clone(), m.clone()]);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(9, 2), (5, 9), (22, 8)]);
        assert_eq!(unmet(&[k.clone(), s.clone(), m.clone()], &p.alloc), 1);
        assert_eq!(p.given_up, vec![2]);
        assert_eq!(p.yielded, vec![2]);
        // Over its target but not hopeless (a third over it, and not given up lately): m
        // is not given up, and the degrade rule decides: k keeps its ten ways but the one m
        // borrows on measurements alone (k reads 0.9 of its target).
        let m_near = Demand {
            slack: Some(-0.3),
            ..m.clone()
        };
        let p = pack(ROOM, &COSTS, &[k.clone(), s.clone(), m_near.clone()]);
        assert!(p.given_up.is_empty());
        assert_eq!(p.alloc[0], (6, 9));
        // Given up lately and still over its target, it may be given up again.
        let m_gave = Demand {
            yielded: true,
            ..m_near
        };
        let p = pack(ROOM, &COSTS, &[k, s, m_gave]);
        assert_eq!(p.given_up, vec![2]);
        assert_eq!(p.alloc[..2], [(9, 2), (5, 9)]);
    }

    #[test]
    fn the_triage_by_the_count_cuts_a_hopeless_service_to_its_floor_where_it_must() {
        // As above, but m holds 25 cores: k on (9, 2) and s on (5, 9) leave it 22, so it
        // drops to its floor (a core and a way) and grows back with what is free.
        let (k, s) = ways_held_by_k();
        let m = saturated(fixed((25, 5), 30, 10));
        let p = pack(ROOM, &COSTS, &[k, s, m]);
        assert_eq!(p.alloc, vec![(9, 2), (5, 9), (22, 8)]);
        assert_eq!(p.given_up, vec![2]);
    }

    #[test]
    fn a_hopeless_service_given_up_lately_is_not_served_again_while_hopeless() {
        // Two hopeless services whose needs are fallback steps, room for one step beside
        // k (36 - 32 - 1 = 3 cores): a at (2, 2) wants (3, 3), b at its floor wants (2, 1),
        // the cheaper. b was given up last tick: the count serves a again and leaves b
        // given up (it grows into a free way), rather than the two trading places every
        // tick; had b not been given up lately, it would be served in a's place.
        let k = holding((32, 2));
        let a = saturated(fixed((2, 2), 3, 3));
        let fresh = saturated(fixed((1, 1), 2, 1));
        let b = Demand {
            yielded: true,
            ..fresh.clone()
        };
        let p = serve_most(ROOM, &COSTS, &[k.clone(), a.clone(), b]).expect("two hopeless");
        assert_eq!(p.alloc, vec![(32, 2), (3, 3), (1, 1)]);
        assert_eq!(p.given_up, vec![2]);
        let p = serve_most(ROOM, &COSTS, &[k, a, fresh]).expect("two hopeless");
        assert_eq!(p.alloc, vec![(32, 2), (2, 3), (2, 1)]);
        assert_eq!(p.given_up, vec![1]);
    }

    #[test]
    fn a_service_given_up_near_its_target_is_tried_again_when_its_hold_lapses() {
        // k holds most of the host and meets its target; a, b and c, each over its target
        // and given up lately, keep what they hold. The hold is renewed for b (a third over
        // its target) and c (saturated), not for a (a tenth over): a is tried again when its
        // hold lapses.
        let k = holding((27, 2));
        let held = |slack: f64| Demand {
            yielded: true,
            persistent: true,
            slack: Some(slack),
            ..violating(fixed((3, 2), 8, 4))
        };
        let (a, b) = (held(-0.1), held(-0.3));
        let c = Demand {
            yielded: true,
            ..saturated(fixed((3, 2), 8, 4))
        };
        assert!(hopeless(&a) && hopeless(&b) && !b.saturated() && c.saturated());
        let p = serve_most(ROOM, &COSTS, &[k, a.clone(), b, c.clone()]).expect("hopeless");
        // All grow into the free ways toward their needs; no core is free.
        assert_eq!(p.alloc, vec![(27, 2), (3, 4), (3, 4), (3, 4)]);
        assert_eq!(p.given_up, vec![1, 2, 3]);
        assert_eq!(p.yielded, vec![2, 3]);
        // Given up afresh (below c's priority, so that it may be; k holding three cores
        // more, so that a's need does not fit), a starts a hold.
        let fresh = Demand {
            yielded: false,
            priority: -1,
            ..a
        };
        let k = holding((30, 2));
        let p = serve_most(ROOM, &COSTS, &[k, fresh, c]).expect("hopeless");
        assert_eq!(p.given_up, vec![1, 2]);
        assert_eq!(p.yielded, vec![1, 2]);
    }

    #[test]
    fn a_higher_priority_service_outweighs_any_number_below_it_in_the_count() {
        let d = |p: i32| Demand {
            priority: p,
            ..frontier((1, 1), &[(1, 1)])
        };
        let w = priority_weights(&[d(0), d(0), d(5), d(0)]);
        assert_eq!(w, vec![1, 1, 5, 1]);
        assert!(w[2] > w[0] + w[1] + w[3]);
    }

    #[test]
    fn unmet_counts_the_services_below_every_option() {
        let demands = [frontier((8, 4), &[(10, 2), (6, 8)]), fixed((4, 4), 6, 4)];
        assert_eq!(unmet(&demands, &[(10, 3), (6, 4)]), 0);
        assert_eq!(unmet(&demands, &[(9, 7), (6, 4)]), 1);
        assert_eq!(unmet(&demands, &[(9, 7), (5, 9)]), 2);
    }

    #[test]
    fn total_cost_adds_each_services_cost_and_its_changes() {
        // (9, 10): 0.3, unchanged; (9, 4): 0.27, one change (+0.01).
        let demands = [fixed((9, 10), 9, 10), fixed((9, 5), 9, 4)];
        let got = total_cost(&COSTS, &demands, &[(9, 10), (9, 4)]);
        assert!((got - (0.3 + 0.27 + 0.01)).abs() < 1e-12, "{got}");
    }

    #[test]
    fn degrade_gives_back_a_need_smaller_in_every_resource_first() {
        // a had (20, 10) and now needs (8, 6); b has (10, 6) and needs (30, 6): 38 > 36.
        // a shrinks to its need first, so 36 - 8 - 10 = 18 cores are free; b's (30, 6) is
        // out of reach (30 > 10 + 18): it grows to 28.
        let demands = [fixed((20, 10), 8, 6), fixed((10, 6), 30, 6)];
        let p = pack(ROOM, &COSTS, &demands);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(8, 6), (28, 6)]);
    }

    #[test]
    fn degrade_picks_the_cheapest_point_within_reach() {
        // b (first) has (4, 4) and a frontier (12, 2), (5, 12), (6, 6); a has (30, 4) and
        // needs (34, 4): b's 5 cores at least + 34 > 36, so degrade. Free: 36 - 34 = 2 cores,
        // 19 - 8 = 11 ways. Within reach of b: (5, 12) costing 0.1389 + 0.06 = 0.1989 and
        // (6, 6) costing 0.1667 + 0.03 = 0.1967, not (12, 2). b takes (6, 6); a finds
        // nothing left and keeps (30, 4).
        let demands = [
            frontier((4, 4), &[(12, 2), (5, 12), (6, 6)]),
            fixed((30, 4), 34, 4),
        ];
        let p = pack(ROOM, &COSTS, &demands);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(6, 6), (30, 4)]);
    }

    #[test]
    fn degrade_gives_a_violating_service_short_of_ways_a_quarter_more_cores() {
        // a has (16, 4), is over its target and needs (17, 10); b holds (10, 13): 23 ways >
        // 19, so degrade. Free: 10 cores, 2 ways. a's need is out of reach (10 > 4 + 2): it
        // takes the 2 ways and max(17, min(16 + 4, 34)) = 20 cores: (20, 6).
        let demands = [violating(fixed((16, 4), 17, 10)), fixed((10, 13), 10, 13)];
        let p = pack(ROOM, &COSTS, &demands);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(20, 6), (10, 13)]);
        // Within its target, the same service grows to its need's cores only.
        let demands = [fixed((16, 4), 17, 10), fixed((10, 13), 10, 13)];
        assert_eq!(pack(ROOM, &COSTS, &demands).alloc, vec![(17, 6), (10, 13)]);
    }

    #[test]
    fn a_violating_service_wants_a_quarter_more_cores_than_its_need_up_to_twice_it() {
        // base (16, 4), need (17, 4): max(17, min(16 + 4, 34)) = 20, 30 cores free: 20.
        let d = violating(fixed((16, 4), 17, 4));
        assert_eq!(grow_toward(&d, (17, 4), (16, 4), 30, 0), (20, 4));
        // Not violating: just the need.
        let d = fixed((16, 4), 17, 4);
        assert_eq!(grow_toward(&d, (17, 4), (16, 4), 30, 0), (17, 4));
        // Up to twice the need's cores: base (16, 4), need (2, 4) -> max(2, min(20, 4)) = 4,
        // and never below what it has: 16.
        let d = violating(fixed((16, 4), 2, 4));
        assert_eq!(grow_toward(&d, (2, 4), (16, 4), 30, 0), (16, 4));
        // What is free caps it: 2 cores free -> 18.
        let d = violating(fixed((16, 4), 17, 4));
        assert_eq!(grow_toward(&d, (17, 4), (16, 4), 2, 0), (18, 4));
    }

    #[test]
    fn degrade_lends_ways_from_the_service_with_most_slack_that_can_spare_them() {
        // 18 ways: a (6, 8), b (6, 5), c (6, 5) use all of them. a is over its target and
        // needs (6, 12); b (slack 0.2) could go to (8, 3), c (slack 0.5, kept) to (9, 4):
        // 12 + 3 + 4 = 19 > 18, so degrade. a grows by a quarter (at least one core) to
        // (7, 8), no way being free; then c, with more slack, gives a way (5 -> 4, taking
        // 3 more of the 36 - 19 = 17 free cores) and a gets it: (7, 9).
        let demands = [
            violating(fixed((6, 8), 6, 12)),
            Demand {
                slack: Some(0.2),
                ..frontier((6, 5), &[(6, 5), (8, 3)])
            },
            Demand {
                slack: Some(0.5),
                keep: Some((6, 5)),
                ..frontier((6, 5), &[(9, 4)])
            },
        ];
        let room = Room {
            cores: 36,
            ways: 18,
            llc_ways: 20,
        };
        let p = pack(room, &COSTS, &demands);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(7, 9), (6, 5), (9, 4)]);
    }

    #[test]
    fn a_service_a_little_over_its_target_for_a_while_borrows_a_measured_spare_way() {
        // 36 cores and 19 ways, all held: a (17, 8) over its target for a while and wanting
        // (17, 12); b (19, 11) kept at 0.6 of its target, its options vouching for no fewer
        // ways. Nothing is free and nobody's options give a way.
        let a = Demand {
            persistent: true,
            slack: Some(-0.04),
            ..violating(fixed((17, 8), 17, 12))
        };
        let b = Demand {
            slack: Some(0.4),
            keep: Some((19, 11)),
            ..frontier((19, 11), &[(19, 11)])
        };
        // b measured the slack: one way goes to a, and one a tick after it.
        let p = pack(ROOM, &COSTS, &[a.clone(), b.clone()]);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(17, 9), (19, 10)]);
        // Half over its target still borrows: a crowded host's service starved of ways is
        // no worse off for a way a tick, read back each time.
        let half = Demand {
            slack: Some(-0.45),
            ..a.clone()
        };
        assert_eq!(pack(ROOM, &COSTS, &[half, b.clone()]).alloc[1], (19, 10));
        // Not from a donor with less slack, nor to a service far over its target (on a
        // crowded host it misses whatever it gets), nor to one over it for the first time.
        let tight = Demand {
            slack: Some(0.05),
            ..b.clone()
        };
        assert_eq!(pack(ROOM, &COSTS, &[a.clone(), tight]).alloc[1], (19, 11));
        let far = Demand {
            slack: Some(-0.6),
            ..a.clone()
        };
        assert_eq!(pack(ROOM, &COSTS, &[far, b.clone()]).alloc[1], (19, 11));
        let first = Demand {
            persistent: false,
            ..a.clone()
        };
        assert_eq!(pack(ROOM, &COSTS, &[first, b]).alloc[1], (19, 11));
        // A donor on two ways gives one and keeps one; on one way, none.
        let small = |ways: u32| Demand {
            slack: Some(0.4),
            keep: Some((19, ways)),
            ..frontier((19, ways), &[(19, ways)])
        };
        let a6 = Demand {
            current: (17, 6),
            ..a.clone()
        };
        let room = Room { ways: 8, ..ROOM };
        assert_eq!(
            pack(room, &COSTS, &[a6.clone(), small(2)]).alloc[1],
            (19, 1)
        );
        let room = Room { ways: 7, ..ROOM };
        assert_eq!(pack(room, &COSTS, &[a6, small(1)]).alloc[1], (19, 1));
    }

    #[test]
    fn a_borrower_holding_surplus_cores_trades_them_for_the_ways_it_lacks() {
        // a, over its target on one way, grew to 24 cores under the fallback and needs
        // (21, 6); b (12, 19), within its target, could give ways back only with three more
        // cores, and none is free: a's three surplus cores pay for them. a gets its need, b
        // its point with fewer ways (the 20 ways in force are still 20: nothing fits the 19
        // the room has, so the packing degrades and lends).
        let demands = [
            violating(fixed((24, 1), 21, 6)),
            Demand {
                slack: Some(0.3),
                keep: Some((12, 19)),
                ..frontier((12, 19), &[(12, 19), (15, 14)])
            },
        ];
        let p = pack(ROOM, &COSTS, &demands);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(21, 6), (15, 14)]);
        // Without the surplus (a needs its 24 cores) nothing can be lent: a keeps what it
        // has rather than anyone going without.
        let tight = [violating(fixed((24, 1), 24, 6)), demands[1].clone()];
        assert_eq!(pack(ROOM, &COSTS, &tight).alloc, vec![(24, 1), (12, 19)]);
    }

    #[test]
    fn degrade_never_lends_from_a_service_over_its_target_or_sharing_the_pools_ways() {
        // 14 ways: a (6, 9) over its target needs (6, 12); b (6, 5) is over its target
        // too; c shares the pool's ways. a grows to (7, 9), and nobody lends it a way.
        let demands = [
            violating(fixed((6, 9), 6, 12)),
            violating(frontier((6, 5), &[(6, 5), (8, 3)])),
            Demand {
                shares_pool_ways: true,
                ..frontier((6, 5), &[(9, 4)])
            },
        ];
        let room = Room {
            cores: 36,
            ways: 14,
            llc_ways: 20,
        };
        let p = pack(room, &COSTS, &demands);
        assert!(p.degraded);
        assert_eq!(p.alloc, vec![(7, 9), (6, 5), (9, 4)]);
    }
}
