//! `parties`: the PARTIES feedback controller (Chen, Delimitrou, Martínez, ASPLOS 2019).
//!
//! Problem: keep every latency-critical service under its target with as few resources as
//! possible, without a model, from measured latency alone.
//!
//! Approach (the paper's, with its constants: Chen, Delimitrou and Martínez, "PARTIES",
//! ASPLOS 2019, section 4): every decision interval (500 ms, or each tick when
//! ticks are longer) compute each service's slack `(target - p99) / target`.
//! - If some slack is under 0.05, upsize the service with the least slack by one unit of
//!   its current resource (1 core, 1 way, 10 % GPU), taken from the best-effort pool, or
//!   else from the service with the most slack above 0.20.
//! - Otherwise, take one unit of its current resource from the service with the most slack
//!   if it has had more than 0.20 for two intervals, and give it to the pool.
//! - After an upsize that did not raise the slack, rotate that service to its next resource
//!   ("wrong direction"); after a downsize that pushed the slack under 0.05, revert it and
//!   bar cuts to that service for 30 s.
//!
//! CLOSID budget: a service beyond it shares the pool's ways ([`layout`]), so it is sized by
//! cores (and GPU share) only, and its nominal ways neither count as used nor can be taken.
//!
//! Overload (docs/DESIGN.md 5, the rule every policy follows): of the services under 0.05
//! slack, the one with the highest `priority` is upsized first (then the least slack); the
//! donors are the best-effort pool, then services with slack above 0.20 (lowest priority
//! first, then most slack), then, for a service with nothing else to take, any service of
//! lower priority whatever its slack. When nothing can be had for a CPU service, the pool's
//! MBA drops one platform step (down to the minimum); once every service has more than 0.20
//! slack it rises a step again before any service is cut. On a GPU, a service far over its
//! target (twice it, two intervals in a row) is not the one upsized while a co-runner of its
//! priority misses by less: the closest to its target is, and it may take GPU share from
//! the one far over (issue 49: on `gpu-llm-crowd` every service sat at an equal share of
//! the GPU, missing its target). These are additions to the paper, which has no priorities and (in
//! our reading) no MBA.
//!
//! Properties: one unit moves per interval, so convergence after a load change takes as
//! many intervals as units are missing. It knows nothing of MPS restarts; a GPU share
//! change shows its effect only after the client restarts.

use std::collections::BTreeMap;

use cohabit_core::{DecisionPath, Observation, Reason, Resource, BEST_EFFORT_GROUP, MBA_MAX_PCT};

use super::{
    carry_shares, downcast, fair_shares, layout, slack, unchanged_services, Adopted, Decision,
    HostContext, Policy, Share,
};

/// Slack under which a service is far over its target (a p99 over twice it): on a GPU, it
/// gives way to a co-runner that misses by less ([`PartiesPolicy::gpu_receiver`]).
const HOPELESS_SLACK: f64 = -1.0;

/// PARTIES' thresholds and timings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartiesConfig {
    /// Upsize when the least slack is below this.
    pub upsize_below: f64,
    /// Downsize a service whose slack stays above this.
    pub downsize_above: f64,
    /// How long a service is protected from cuts after a harmful one.
    pub bar_ms: u64,
    /// Shortest time between two actions.
    pub interval_ms: u64,
    /// Throttle the best-effort pool's MBA when no core or way can be had (overload rule,
    /// docs/DESIGN.md 5); `false` is the paper's controller without it.
    pub throttle_best_effort_mba: bool,
}

impl Default for PartiesConfig {
    fn default() -> Self {
        Self {
            upsize_below: 0.05,
            downsize_above: 0.20,
            bar_ms: 30_000,
            interval_ms: 500,
            throttle_best_effort_mba: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Up,
    Down,
}

#[derive(Debug, Clone, PartialEq)]
struct Action {
    service: String,
    resource: Resource,
    direction: Direction,
    slack_before: f64,
}

#[derive(Debug, Clone, Default)]
struct ServiceState {
    resource_idx: usize,
    prev_slack: Option<f64>,
    barred_until_ms: u64,
}

/// The PARTIES controller.
#[derive(Debug, Clone)]
pub struct PartiesPolicy {
    ctx: HostContext,
    cfg: PartiesConfig,
    shares: BTreeMap<String, Share>,
    state: BTreeMap<String, ServiceState>,
    last: Option<Action>,
    last_act_ms: Option<u64>,
    /// The best-effort pool's MBA percent (throttled only under overload).
    be_mba: u8,
}

impl PartiesPolicy {
    /// PARTIES managing the host in `ctx`, starting from a fair share (as the paper does).
    pub fn new(ctx: HostContext, cfg: PartiesConfig) -> Self {
        let shares = fair_shares(&ctx);
        let state = ctx
            .latency_critical()
            .map(|s| (s.name.clone(), ServiceState::default()))
            .collect();
        Self {
            ctx,
            cfg,
            shares,
            state,
            last: None,
            last_act_ms: None,
            be_mba: MBA_MAX_PCT,
        }
    }

    /// The shares `previous` planned, carried over to this policy's services by
    /// [`carry_shares`] (the daemon's rule for the plan in force): a service that stays keeps
    /// its share, a new one gets a fair part of what is free. The ways of a service sharing
    /// the pool's group count for nothing (it has none of its own); one that had none and
    /// now may have some is new as far as its share goes.
    fn carried_shares(&self, previous: &Self) -> BTreeMap<String, Share> {
        let kept: BTreeMap<String, Share> = previous
            .shares
            .iter()
            .filter(|(name, _)| {
                !previous.ctx.shares_pool_group(name) || self.ctx.shares_pool_group(name)
            })
            .map(|(name, s)| {
                let ways = if self.ctx.shares_pool_group(name) {
                    0
                } else {
                    s.ways
                };
                (name.clone(), Share { ways, ..*s })
            })
            .collect();
        let fair = fair_shares(&self.ctx);
        let mut shares = carry_shares(&self.ctx, &kept);
        for (name, s) in &mut shares {
            if self.ctx.shares_pool_group(name) {
                // Nominal: a service in the pool's group takes the pool's ways.
                s.ways = fair.get(name).map_or(1, |f| f.ways);
            }
        }
        shares
    }

    fn priority(&self, name: &str) -> i32 {
        self.ctx
            .specs
            .iter()
            .find(|s| s.name == name)
            .map_or(0, |s| s.priority)
    }

    /// One MBA step of the platform.
    fn mba_step(&self) -> u8 {
        self.ctx.host.mba_gran_pct.max(1)
    }

    fn resources(&self, name: &str) -> Vec<Resource> {
        let gpu = self
            .ctx
            .specs
            .iter()
            .any(|s| s.name == name && s.gpu.is_some());
        let mut r = vec![Resource::Cores];
        if !self.ctx.shares_pool_group(name) {
            r.push(Resource::LlcWays);
        }
        if gpu {
            r.push(Resource::GpuShare);
        }
        r
    }

    fn current_resource(&self, name: &str) -> Resource {
        let r = self.resources(name);
        r[self.state.get(name).map_or(0, |s| s.resource_idx) % r.len()]
    }

    fn rotate(&mut self, name: &str) {
        let n = self.resources(name).len();
        if let Some(s) = self.state.get_mut(name) {
            s.resource_idx = (s.resource_idx + 1) % n;
        }
    }

    fn unit(resource: Resource) -> u32 {
        if resource == Resource::GpuShare {
            10
        } else {
            1
        }
    }

    fn minimum(resource: Resource) -> u32 {
        if resource == Resource::GpuShare {
            10
        } else {
            1
        }
    }

    fn amount(share: &Share, r: Resource) -> u32 {
        match r {
            Resource::Cores => share.cores,
            Resource::LlcWays => share.ways,
            Resource::Mba => u32::from(share.mba_pct),
            Resource::GpuShare => share.gpu_pct.map_or(0, u32::from),
        }
    }

    fn adjust(&mut self, name: &str, r: Resource, delta: i64) {
        if let Some(s) = self.shares.get_mut(name) {
            let v = i64::from(Self::amount(s, r)) + delta;
            let v = u32::try_from(v.max(0)).unwrap_or(0);
            match r {
                Resource::Cores => s.cores = v,
                Resource::LlcWays => s.ways = v,
                Resource::Mba => s.mba_pct = u8::try_from(v.min(100)).unwrap_or(100),
                Resource::GpuShare => s.gpu_pct = Some(u8::try_from(v.min(100)).unwrap_or(100)),
            }
        }
    }

    /// Units of `r` the best-effort pool can give up without going below its minimum.
    fn pool_spare(&self, r: Resource, gpu: Option<u32>) -> u32 {
        let host = &self.ctx.host;
        match r {
            Resource::Cores => host
                .cores
                .saturating_sub(self.shares.values().map(|s| s.cores).sum()),
            Resource::LlcWays => {
                let used: u32 = self
                    .shares
                    .iter()
                    .filter(|(n, _)| !self.ctx.shares_pool_group(n))
                    .map(|(_, s)| s.ways)
                    .sum();
                // The pool keeps a way for its jobs and the services that share it.
                let keep = u32::from(
                    self.ctx.has_cpu_best_effort()
                        || self
                            .ctx
                            .latency_critical()
                            .any(|s| self.ctx.shares_pool_group(&s.name)),
                );
                host.llc_ways.saturating_sub(used + keep)
            }
            Resource::GpuShare => {
                let used: u32 = self
                    .ctx
                    .latency_critical()
                    .filter(|s| s.gpu == gpu && gpu.is_some())
                    .filter_map(|s| self.shares.get(&s.name))
                    .map(|s| s.gpu_pct.map_or(0, u32::from))
                    .sum();
                let keep = u32::from(self.ctx.has_gpu_best_effort());
                100u32.saturating_sub(used + keep)
            }
            Resource::Mba => 0,
        }
    }

    fn gpu_of(&self, name: &str) -> Option<u32> {
        self.ctx
            .specs
            .iter()
            .find(|s| s.name == name)
            .and_then(|s| s.gpu)
    }

    /// Gives `name` one unit of its current resource, rotating through its resources until
    /// one can be had. Returns the resource and where it came from.
    fn upsize(
        &mut self,
        name: &str,
        slacks: &BTreeMap<String, f64>,
        now_ms: u64,
    ) -> Option<(Resource, String)> {
        for _ in 0..self.resources(name).len() {
            let r = self.current_resource(name);
            let unit = Self::unit(r);
            if self.pool_spare(r, self.gpu_of(name)) >= unit {
                self.adjust(name, r, i64::from(unit));
                return Some((r, "best-effort pool".into()));
            }
            let victim = slacks
                .iter()
                .filter(|(v, s)| v.as_str() != name && **s > self.cfg.downsize_above)
                .filter(|(v, _)| {
                    self.state
                        .get(*v)
                        .is_none_or(|st| st.barred_until_ms <= now_ms)
                })
                .filter(|(v, _)| r != Resource::GpuShare || self.gpu_of(v) == self.gpu_of(name))
                .filter(|(v, _)| r != Resource::LlcWays || !self.ctx.shares_pool_group(v))
                .filter(|(v, _)| {
                    self.shares
                        .get(*v)
                        .is_some_and(|s| Self::amount(s, r) >= Self::minimum(r) + unit)
                })
                // Lowest priority first, then most slack.
                .max_by(|a, b| {
                    self.priority(b.0)
                        .cmp(&self.priority(a.0))
                        .then(a.1.total_cmp(b.1))
                })
                .map(|(v, _)| v.clone())
                .or_else(|| self.lower_priority_donor(name, r))
                .or_else(|| {
                    (r == Resource::GpuShare)
                        .then(|| self.hopeless_donor(name, slacks))
                        .flatten()
                });
            if let Some(v) = victim {
                self.adjust(&v, r, -i64::from(unit));
                self.adjust(name, r, i64::from(unit));
                return Some((r, v));
            }
            self.rotate(name);
        }
        None
    }

    /// A service of lower priority than `name` that can give a unit of `r`, whatever its
    /// slack (overload: it yields): the lowest priority first, then configuration order.
    fn lower_priority_donor(&self, name: &str, r: Resource) -> Option<String> {
        let mine = self.priority(name);
        let unit = Self::unit(r);
        self.ctx
            .latency_critical()
            .filter(|v| v.name != name && v.priority < mine)
            .filter(|v| r != Resource::GpuShare || self.gpu_of(&v.name) == self.gpu_of(name))
            .filter(|v| r != Resource::LlcWays || !self.ctx.shares_pool_group(&v.name))
            .filter(|v| {
                self.shares
                    .get(&v.name)
                    .is_some_and(|s| Self::amount(s, r) >= Self::minimum(r) + unit)
            })
            .min_by_key(|v| v.priority)
            .map(|v| v.name.clone())
    }

    /// Whether `name` has been far over its target ([`HOPELESS_SLACK`]) for two intervals.
    fn hopeless(&self, name: &str, slack: f64) -> bool {
        slack < HOPELESS_SLACK
            && self
                .state
                .get(name)
                .and_then(|st| st.prev_slack)
                .is_some_and(|p| p < HOPELESS_SLACK)
    }

    /// The service to upsize when the worst is a GPU service far over its target: a
    /// co-runner on its GPU of the same priority that misses its target by less, the
    /// closest to it first (the fewest violations, docs/DESIGN.md 5: more share for the
    /// worst buys nothing, and on `gpu-llm-crowd` every service sat at a third of the GPU
    /// missing its target); else the worst.
    fn gpu_receiver(
        &self,
        worst: &str,
        worst_slack: f64,
        slacks: &BTreeMap<String, f64>,
    ) -> (String, f64) {
        let gpu = self.gpu_of(worst);
        if gpu.is_none() || !self.hopeless(worst, worst_slack) {
            return (worst.to_string(), worst_slack);
        }
        slacks
            .iter()
            .filter(|(n, s)| {
                n.as_str() != worst
                    && self.gpu_of(n) == gpu
                    && self.priority(n) == self.priority(worst)
                    && **s < self.cfg.upsize_below
                    && !self.hopeless(n, **s)
            })
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or((worst.to_string(), worst_slack), |(n, s)| (n.clone(), *s))
    }

    /// A co-runner on `name`'s GPU, of no higher priority, far over its target for two
    /// intervals and further from it than `name` is, that can give a unit of GPU share:
    /// it misses whatever it gets (the lowest priority first, then the furthest over).
    fn hopeless_donor(&self, name: &str, slacks: &BTreeMap<String, f64>) -> Option<String> {
        let mine = slacks.get(name).copied()?;
        let r = Resource::GpuShare;
        slacks
            .iter()
            .filter(|(v, s)| {
                v.as_str() != name
                    && self.gpu_of(v) == self.gpu_of(name)
                    && self.priority(v) <= self.priority(name)
                    && **s < mine
                    && self.hopeless(v, **s)
                    && self
                        .shares
                        .get(*v)
                        .is_some_and(|sh| Self::amount(sh, r) >= Self::minimum(r) + Self::unit(r))
            })
            .min_by(|a, b| {
                self.priority(a.0)
                    .cmp(&self.priority(b.0))
                    .then(a.1.total_cmp(b.1))
            })
            .map(|(v, _)| v.clone())
    }

    fn act(&mut self, obs: &Observation, now_ms: u64, reasons: &mut BTreeMap<String, Reason>) {
        let slacks: BTreeMap<String, f64> = self
            .ctx
            .latency_critical()
            .filter_map(|s| slack(obs, &s.name).map(|v| (s.name.clone(), v)))
            .collect();
        if self.judge_last(&slacks, now_ms, reasons) {
            return;
        }
        // Overload order: of the services short of slack, the highest priority first.
        let Some((worst, &worst_slack)) = slacks
            .iter()
            .filter(|(_, s)| **s < self.cfg.upsize_below)
            .max_by(|a, b| {
                self.priority(a.0)
                    .cmp(&self.priority(b.0))
                    .then(b.1.total_cmp(a.1))
            })
            .or_else(|| slacks.iter().min_by(|a, b| a.1.total_cmp(b.1)))
        else {
            return;
        };
        let (worst, worst_slack) = self.gpu_receiver(worst, worst_slack, &slacks);
        if worst_slack < self.cfg.upsize_below {
            self.grow_the_worst(worst, worst_slack, &slacks, now_ms, reasons);
            return;
        }
        if self.give_back_mba(&slacks, now_ms, reasons) {
            return;
        }
        self.downsize(&slacks, now_ms, reasons);
    }

    /// Judges the previous action by the slack it left: an upsize that did not help
    /// rotates the service's resource; a harmful cut is reverted and the service barred
    /// from cuts for `bar_ms` (true: this interval's action is taken).
    fn judge_last(
        &mut self,
        slacks: &BTreeMap<String, f64>,
        now_ms: u64,
        reasons: &mut BTreeMap<String, Reason>,
    ) -> bool {
        if let Some(last) = self.last.take() {
            if let Some(&now) = slacks.get(&last.service) {
                match last.direction {
                    Direction::Up if now <= last.slack_before => {
                        self.rotate(&last.service);
                    }
                    Direction::Down if now < self.cfg.upsize_below => {
                        let unit = Self::unit(last.resource);
                        if self.pool_spare(last.resource, self.gpu_of(&last.service)) >= unit {
                            self.adjust(&last.service, last.resource, i64::from(unit));
                        }
                        if let Some(st) = self.state.get_mut(&last.service) {
                            st.barred_until_ms = now_ms + self.cfg.bar_ms;
                        }
                        reasons.insert(
                            last.service.clone(),
                            feedback(format!(
                                "revert harmful {} cut (slack {now:.2}); no cuts for {} s",
                                last.resource,
                                self.cfg.bar_ms / 1000
                            )),
                        );
                        self.last_act_ms = Some(now_ms);
                        return true;
                    }
                    _ => {}
                }
            }
        }
        false
    }

    /// `worst`, short of slack, gets a unit of its current resource (from the pool or a
    /// service of lower priority), or else the pool's memory bandwidth is throttled a step.
    fn grow_the_worst(
        &mut self,
        worst: String,
        worst_slack: f64,
        slacks: &BTreeMap<String, f64>,
        now_ms: u64,
        reasons: &mut BTreeMap<String, Reason>,
    ) {
        if let Some((r, from)) = self.upsize(&worst, slacks, now_ms) {
            reasons.insert(
                worst.clone(),
                feedback(format!(
                    "+{} {r} from {from} (slack {worst_slack:.2} < {})",
                    Self::unit(r),
                    self.cfg.upsize_below
                )),
            );
            self.last = Some(Action {
                service: worst,
                resource: r,
                direction: Direction::Up,
                slack_before: worst_slack,
            });
            self.last_act_ms = Some(now_ms);
        } else if self.cfg.throttle_best_effort_mba
            && self.be_mba > self.ctx.host.mba_min_pct
            && self.ctx.has_cpu_best_effort()
            && self.gpu_of(&worst).is_none()
        {
            // LC before BE on memory bandwidth too: throttle the pool one step.
            let step = self.mba_step();
            self.be_mba = self
                .be_mba
                .saturating_sub(step)
                .max(self.ctx.host.mba_min_pct);
            reasons.insert(
                worst,
                feedback(format!(
                    "no core or way to be had (slack {worst_slack:.2}): best-effort MBA \
                     down to {}%",
                    self.be_mba
                )),
            );
            self.last_act_ms = Some(now_ms);
        } else {
            reasons.insert(
                worst,
                feedback(format!(
                    "wants more (slack {worst_slack:.2}) but nothing can be had"
                )),
            );
        }
    }

    /// With every service's slack above `downsize_above`, memory bandwidth goes back to the
    /// pool a step before anyone is cut (true: this interval's action is taken).
    fn give_back_mba(
        &mut self,
        slacks: &BTreeMap<String, f64>,
        now_ms: u64,
        reasons: &mut BTreeMap<String, Reason>,
    ) -> bool {
        if self.be_mba < MBA_MAX_PCT && slacks.values().all(|s| *s > self.cfg.downsize_above) {
            self.be_mba = self.be_mba.saturating_add(self.mba_step()).min(MBA_MAX_PCT);
            reasons.insert(
                BEST_EFFORT_GROUP.to_string(),
                feedback(format!(
                    "every service has slack above {}: best-effort MBA up to {}%",
                    self.cfg.downsize_above, self.be_mba
                )),
            );
            self.last_act_ms = Some(now_ms);
            return true;
        }
        false
    }

    /// The service with the most slack, above `downsize_above` for two intervals and not
    /// barred, gives a unit of its current resource (rotating past those at their minimum)
    /// to the best-effort pool.
    fn downsize(
        &mut self,
        slacks: &BTreeMap<String, f64>,
        now_ms: u64,
        reasons: &mut BTreeMap<String, Reason>,
    ) {
        let candidate = slacks
            .iter()
            .filter(|(n, s)| {
                let st = self.state.get(*n);
                **s > self.cfg.downsize_above
                    && st.is_some_and(|st| {
                        st.prev_slack.is_some_and(|p| p > self.cfg.downsize_above)
                            && st.barred_until_ms <= now_ms
                    })
            })
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(n, s)| (n.clone(), *s));
        if let Some((name, s)) = candidate {
            for _ in 0..self.resources(&name).len() {
                let r = self.current_resource(&name);
                let unit = Self::unit(r);
                let have = self.shares.get(&name).map_or(0, |sh| Self::amount(sh, r));
                if have >= Self::minimum(r) + unit {
                    self.adjust(&name, r, -i64::from(unit));
                    reasons.insert(
                        name.clone(),
                        feedback(format!(
                            "-{unit} {r} to best effort (slack {s:.2} > {})",
                            self.cfg.downsize_above
                        )),
                    );
                    self.last = Some(Action {
                        service: name,
                        resource: r,
                        direction: Direction::Down,
                        slack_before: s,
                    });
                    self.last_act_ms = Some(now_ms);
                    return;
                }
                self.rotate(&name);
            }
        }
    }
}

impl Policy for PartiesPolicy {
    fn name(&self) -> &'static str {
        "parties"
    }

    fn initial(&mut self) -> Decision {
        let plan = layout(&self.ctx, &self.shares, MBA_MAX_PCT);
        let reasons = plan
            .groups()
            .map(|(g, _)| {
                (
                    g.to_string(),
                    Reason::new(DecisionPath::Static, "initial fair share"),
                )
            })
            .collect();
        Decision::new(plan, reasons)
    }

    fn decide(&mut self, obs: &Observation, now_ms: u64) -> Decision {
        let mut reasons = BTreeMap::new();
        let due = self
            .last_act_ms
            .is_none_or(|t| now_ms >= t + self.cfg.interval_ms);
        if due {
            self.act(obs, now_ms, &mut reasons);
        }
        for spec in self.ctx.latency_critical() {
            let s = slack(obs, &spec.name);
            if let Some(st) = self.state.get_mut(&spec.name) {
                if s.is_some() {
                    st.prev_slack = s;
                }
            }
            reasons.entry(spec.name.clone()).or_insert_with(|| match s {
                Some(v) => feedback(format!("hold (slack {v:.2})")),
                None => feedback("hold (no latency reading)"),
            });
        }
        let plan = layout(&self.ctx, &self.shares, self.be_mba);
        Decision::new(plan, reasons)
    }

    /// From another `parties`: the shares it planned, carried over ([`carry_shares`]);
    /// each unchanged service's phase (the resource it is on, its last slack, a bar on
    /// cuts); the last action, to be judged next interval, when its service is unchanged;
    /// the time of the last action and the pool's MBA.
    fn adopt(&mut self, previous: Box<dyn Policy>) -> Adopted {
        let Some(previous) = downcast::<Self>(previous) else {
            return Adopted::default();
        };
        let mut previous = *previous;
        let kept = unchanged_services(&previous.ctx, &self.ctx);
        self.shares = self.carried_shares(&previous);
        for name in &kept {
            if let Some(st) = previous.state.remove(name) {
                self.state.insert(name.clone(), st);
            }
        }
        self.last = previous.last.filter(|a| kept.contains(&a.service));
        self.last_act_ms = previous.last_act_ms;
        self.be_mba = previous
            .be_mba
            .clamp(self.ctx.host.mba_min_pct.min(MBA_MAX_PCT), MBA_MAX_PCT);
        Adopted {
            services: kept,
            host: true,
        }
    }
}

/// A reason on the feedback path.
fn feedback(text: impl Into<String>) -> Reason {
    Reason::new(DecisionPath::Feedback, text)
}

#[cfg(test)]
mod tests {
    use cohabit_core::{Sample, ServiceObservation, WayRange};

    use super::*;
    use crate::tests::ctx;

    fn obs(policy_plan: &cohabit_core::Plan, c: &HostContext, p99: &[(&str, f64)]) -> Observation {
        Observation {
            t_ms: 0,
            services: c
                .specs
                .iter()
                .map(|s| ServiceObservation {
                    spec: s.clone(),
                    sample: Sample {
                        p99_ms: p99.iter().find(|(n, _)| *n == s.name).map(|(_, v)| *v),
                        ..Sample::default()
                    },
                    gpu_mps_effective_pct: None,
                })
                .collect(),
            current: policy_plan.clone(),
        }
    }

    #[test]
    fn the_service_with_least_slack_gets_a_core_from_best_effort() {
        let c = ctx(2, true, false, 0);
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let start = p.initial().plan;
        // Targets are 1 ms: lc0 at 1.2 ms violates, lc1 at 0.9 ms has 0.1 slack.
        let d = p.decide(&obs(&start, &c, &[("lc0", 1.2), ("lc1", 0.9)]), 1000);
        assert_eq!(
            d.plan.services["lc0"].cores,
            start.services["lc0"].cores + 1
        );
        assert_eq!(d.plan.services["lc1"], start.services["lc1"]);
        assert_eq!(d.plan.best_effort.cores, start.best_effort.cores - 1);
        assert!(
            d.reasons["lc0"].text.contains("+1 cores"),
            "{:?}",
            d.reasons
        );
    }

    #[test]
    fn an_upsize_that_did_not_help_rotates_to_the_next_resource() {
        let c = ctx(1, true, false, 0);
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let start = p.initial().plan;
        let d1 = p.decide(&obs(&start, &c, &[("lc0", 1.5)]), 1000);
        let d2 = p.decide(&obs(&d1.plan, &c, &[("lc0", 1.6)]), 2000);
        assert_eq!(d2.plan.services["lc0"].cores, d1.plan.services["lc0"].cores);
        assert_eq!(
            d2.plan.services["lc0"].llc_ways.count,
            d1.plan.services["lc0"].llc_ways.count + 1
        );
    }

    #[test]
    fn a_harmful_cut_is_reverted_and_cuts_are_barred_for_30_s() {
        let c = ctx(1, true, false, 0);
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let start = p.initial().plan;
        // Two intervals of large slack: the second cuts a core.
        let d1 = p.decide(&obs(&start, &c, &[("lc0", 0.3)]), 1000);
        assert_eq!(d1.plan, start, "needs two intervals of slack first");
        let d2 = p.decide(&obs(&d1.plan, &c, &[("lc0", 0.3)]), 2000);
        assert_eq!(
            d2.plan.services["lc0"].cores + 1,
            start.services["lc0"].cores
        );
        // The cut hurt: revert it.
        let d3 = p.decide(&obs(&d2.plan, &c, &[("lc0", 0.99)]), 3000);
        assert_eq!(d3.plan.services["lc0"].cores, start.services["lc0"].cores);
        assert!(d3.reasons["lc0"].text.contains("revert"));
        // Lots of slack again, but cuts stay barred until 33 s.
        let mut plan = d3.plan.clone();
        for t in (4..33).map(|s| s * 1000) {
            plan = p.decide(&obs(&plan, &c, &[("lc0", 0.3)]), t).plan;
            assert_eq!(plan, d3.plan, "cut at {t} ms while barred");
        }
        let later = p.decide(&obs(&plan, &c, &[("lc0", 0.3)]), 34_000).plan;
        assert_ne!(later, d3.plan, "cuts resume after the bar");
    }

    #[test]
    fn without_a_latency_reading_nothing_moves() {
        let c = ctx(2, true, false, 0);
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let start = p.initial().plan;
        let d = p.decide(&obs(&start, &c, &[]), 1000);
        assert_eq!(d.plan, start);
        assert!(d.reasons["lc0"].text.contains("no latency reading"));
    }

    #[test]
    fn beyond_the_closid_budget_a_service_is_sized_by_cores_and_its_ways_are_not_taken() {
        // 3 CLOSIDs: the root, the pool and lc0; lc1 and lc2 share the pool's group.
        let mut c = ctx(3, true, false, 0);
        c.host.closids = 3;
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let start = p.initial().plan;
        assert_eq!(start.resctrl_groups(), 2);
        assert_eq!(p.resources("lc2"), vec![Resource::Cores]);
        // An upsize that did not help rotates back to cores, never to ways.
        let d1 = p.decide(&obs(&start, &c, &[("lc2", 1.5)]), 1000);
        let d2 = p.decide(&obs(&d1.plan, &c, &[("lc2", 1.6)]), 2000);
        assert!(d2.reasons["lc2"].text.contains("cores"), "{:?}", d2.reasons);
        // lc0 wants ways and none are spare: the most relaxed service (lc1) has only the
        // pool's ways, which are not its to give, so lc0 gets a core instead.
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        p.state.get_mut("lc0").unwrap().resource_idx = 1;
        p.shares.get_mut("lc0").unwrap().ways = 19;
        let before = p.initial().plan;
        let d = p.decide(&obs(&before, &c, &[("lc0", 1.3), ("lc1", 0.2)]), 1000);
        assert_eq!(d.plan.services["lc0"].llc_ways, WayRange::new(0, 19));
        assert_eq!(
            d.plan.services["lc0"].cores,
            before.services["lc0"].cores + 1
        );
        assert_eq!(d.plan.services["lc1"], before.services["lc1"]);
        for plan in [&d1.plan, &d2.plan, &d.plan] {
            plan.validate(&c.host, &c.specs).unwrap();
        }
    }

    #[test]
    fn with_no_spare_resources_it_takes_from_the_service_with_most_slack() {
        let c = ctx(2, false, false, 0);
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let start = p.initial().plan;
        assert_eq!(start.best_effort.cores, 0);
        let d = p.decide(&obs(&start, &c, &[("lc0", 1.3), ("lc1", 0.5)]), 1000);
        assert_eq!(
            d.plan.services["lc0"].cores,
            start.services["lc0"].cores + 1
        );
        assert_eq!(
            d.plan.services["lc1"].cores,
            start.services["lc1"].cores - 1
        );
        assert!(d.reasons["lc0"].text.contains("from lc1"));
    }

    #[test]
    fn of_two_services_short_of_slack_the_higher_priority_is_upsized_first() {
        let mut c = ctx(2, true, false, 0);
        c.specs[1].priority = 1;
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let start = p.initial().plan;
        // lc0 is further over its target, but lc1 has the higher priority.
        let d = p.decide(&obs(&start, &c, &[("lc0", 1.5), ("lc1", 1.1)]), 1000);
        assert_eq!(
            d.plan.services["lc1"].cores,
            start.services["lc1"].cores + 1
        );
        assert_eq!(d.plan.services["lc0"], start.services["lc0"]);
        // Without priorities the least slack wins, as in the paper.
        let c = ctx(2, true, false, 0);
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let d = p.decide(&obs(&start, &c, &[("lc0", 1.5), ("lc1", 1.1)]), 1000);
        assert_eq!(
            d.plan.services["lc0"].cores,
            start.services["lc0"].cores + 1
        );
    }

    #[test]
    fn the_donor_is_the_lowest_priority_service_with_slack_to_spare() {
        let mut c = ctx(3, false, false, 0);
        c.specs[1].priority = 1;
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let start = p.initial().plan;
        // lc1 has more slack, but lc2 has the lower priority: lc2 gives.
        let d = p.decide(
            &obs(&start, &c, &[("lc0", 1.3), ("lc1", 0.3), ("lc2", 0.6)]),
            1000,
        );
        assert!(
            d.reasons["lc0"].text.contains("from lc2"),
            "{:?}",
            d.reasons
        );
        assert_eq!(
            d.plan.services["lc2"].cores + 1,
            start.services["lc2"].cores
        );
    }

    #[test]
    fn a_higher_priority_service_takes_from_a_lower_one_without_slack_but_not_back() {
        let mut c = ctx(2, false, false, 0);
        c.specs[0].priority = 1;
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let start = p.initial().plan;
        // Both miss, no pool: lc0 (priority 1) takes a core from lc1, which yields.
        let d = p.decide(&obs(&start, &c, &[("lc0", 1.3), ("lc1", 1.2)]), 1000);
        assert_eq!(
            d.plan.services["lc0"].cores,
            start.services["lc0"].cores + 1
        );
        assert_eq!(
            d.plan.services["lc1"].cores + 1,
            start.services["lc1"].cores
        );
        // lc1 alone misses now: it cannot take from lc0, which has no slack to spare.
        let d2 = p.decide(&obs(&d.plan, &c, &[("lc0", 0.9), ("lc1", 1.4)]), 2000);
        assert_eq!(d2.plan.services["lc0"], d.plan.services["lc0"]);
        assert!(
            d2.reasons["lc1"].text.contains("nothing can be had"),
            "{:?}",
            d2.reasons
        );
        d2.plan.validate(&c.host, &c.specs).unwrap();
    }

    #[test]
    fn with_nothing_to_take_the_pool_is_throttled_by_mba_steps_and_given_back_first() {
        let c = ctx(1, true, false, 0);
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        // The service holds every core and every way the pool can give.
        p.shares.get_mut("lc0").unwrap().cores = 36;
        p.shares.get_mut("lc0").unwrap().ways = 19;
        let start = p.initial().plan;
        let mut plan = start.clone();
        let mut t = 1000;
        for expected in [90, 80] {
            plan = p.decide(&obs(&plan, &c, &[("lc0", 1.3)]), t).plan;
            assert_eq!(plan.best_effort.mba_pct, expected);
            assert_eq!(plan.services["lc0"].mba_pct, 100, "LC is never throttled");
            t += 1000;
        }
        // Slack everywhere: MBA goes back up a step before anything is cut.
        for expected in [90, 100] {
            plan = p.decide(&obs(&plan, &c, &[("lc0", 0.5)]), t).plan;
            assert_eq!(plan.best_effort.mba_pct, expected);
            assert_eq!(plan.services["lc0"].cores, 36);
            t += 1000;
        }
        let cut = p.decide(&obs(&plan, &c, &[("lc0", 0.5)]), t).plan;
        assert_eq!(cut.best_effort.mba_pct, 100);
        assert!(
            cut.services["lc0"] != plan.services["lc0"],
            "then cuts resume"
        );
        // Down to the platform's minimum, never below.
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        p.shares.get_mut("lc0").unwrap().cores = 36;
        p.shares.get_mut("lc0").unwrap().ways = 19;
        let mut plan = p.initial().plan;
        for k in 1..20 {
            plan = p.decide(&obs(&plan, &c, &[("lc0", 1.3)]), k * 1000).plan;
        }
        assert_eq!(plan.best_effort.mba_pct, c.host.mba_min_pct);
        plan.validate(&c.host, &c.specs).unwrap();
    }

    #[test]
    fn on_a_host_without_mba_the_pool_is_never_throttled() {
        let mut c = ctx(1, true, false, 0);
        c.host.mba_min_pct = 100;
        c.host.mba_gran_pct = 100;
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        p.shares.get_mut("lc0").unwrap().cores = 36;
        p.shares.get_mut("lc0").unwrap().ways = 19;
        let mut plan = p.initial().plan;
        for k in 1..6 {
            let d = p.decide(&obs(&plan, &c, &[("lc0", 1.3)]), k * 1000);
            plan = d.plan;
            assert_eq!(plan.best_effort.mba_pct, 100, "tick {k}");
            plan.validate(&c.host, &c.specs).unwrap();
        }
    }

    #[test]
    fn on_a_full_gpu_a_service_far_over_its_target_gives_way_to_one_closer_to_its_own() {
        // Three GPU services and a training job, no CPU job: lc0 is 20 times over its
        // target, lc1 a third over, lc2 half over. lc0, the worst, takes the pool's GPU
        // share first (LC before BE) and misses all the same; once nothing is left to
        // take, upsizing it buys nothing, and lc1, the closest to its target, takes GPU
        // share from it instead (the fewest violations).
        let c = ctx(3, false, true, 3);
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let start = p.initial().plan;
        let p99 = [("lc0", 20.0), ("lc1", 1.3), ("lc2", 1.5)];
        let gpu = |plan: &cohabit_core::Plan, n: &str| plan.services[n].gpu_mps_pct.unwrap();
        let mut plan = start.clone();
        let mut lc0_most = 0;
        for t in 1..16 {
            plan = p.decide(&obs(&plan, &c, &p99), t * 1000).plan;
            lc0_most = lc0_most.max(gpu(&plan, "lc0"));
        }
        assert!(plan.best_effort.gpu_mps_pct.unwrap() <= 10, "{plan:?}");
        assert!(gpu(&plan, "lc1") > gpu(&start, "lc1"), "{plan:?}");
        assert!(gpu(&plan, "lc0") < lc0_most, "{plan:?}");
        assert!(gpu(&plan, "lc2") <= gpu(&start, "lc2"));
    }

    /// `c` with `lc1`'s target moved to `target_ms` and a second best-effort job.
    fn with_lc1_changed(c: &HostContext, target_ms: f64) -> HostContext {
        let mut c = c.clone();
        c.specs[1].class = cohabit_core::ServiceClass::LatencyCritical {
            p99_target_ms: target_ms,
        };
        let mut job = c.specs[2].clone();
        job.name = "be2".into();
        c.specs.push(job);
        c
    }

    #[test]
    fn a_rebuilt_parties_keeps_the_unchanged_services_phase_and_share_and_drops_a_changed_ones() {
        // lc0 is upsized a core that does not help, so it rotates to ways (its phase); lc1 is
        // cut a core while it has slack to spare, and that cut awaits judgement.
        let c = ctx(2, true, false, 0);
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let mut plan = p.initial().plan;
        for (t, lc0, lc1) in [(1, 1.5, 0.5), (2, 1.6, 0.5), (3, 0.9, 0.5), (4, 0.9, 0.5)] {
            plan = p
                .decide(&obs(&plan, &c, &[("lc0", lc0), ("lc1", lc1)]), t * 1000)
                .plan;
        }
        assert_eq!(p.state["lc0"].resource_idx, 1, "lc0 rotated to ways");
        let fair = fair_shares(&c);
        assert_ne!(p.shares, fair, "the shares moved from the fair split");

        // The same services: the rebuilt policy decides exactly as the old one goes on to.
        let mut rebuilt = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let adopted = rebuilt.adopt(Box::new(p.clone()));
        assert_eq!(
            adopted,
            Adopted {
                services: ["lc0", "lc1"].map(String::from).into(),
                host: true
            }
        );
        let mut old = p.clone();
        for t in 5..9 {
            let o = obs(&plan, &c, &[("lc0", 1.2), ("lc1", 0.5)]);
            let (a, b) = (rebuilt.decide(&o, t * 1000), old.decide(&o, t * 1000));
            assert_eq!(a, b, "tick {t}");
            plan = a.plan;
        }

        // lc1's target changed: its phase and the action on it start over, lc0's stay; both
        // keep their shares (the allocation in force, as the daemon carries it over).
        let changed = with_lc1_changed(&c, 2.0);
        let mut rebuilt = PartiesPolicy::new(changed.clone(), PartiesConfig::default());
        let adopted = rebuilt.adopt(Box::new(old.clone()));
        assert_eq!(adopted.services, ["lc0".to_string()].into());
        assert_eq!(
            rebuilt.state["lc0"].resource_idx,
            old.state["lc0"].resource_idx
        );
        assert_eq!(rebuilt.state["lc0"].prev_slack, old.state["lc0"].prev_slack);
        assert_eq!(rebuilt.state["lc1"].prev_slack, None);
        assert_eq!(rebuilt.state["lc1"].resource_idx, 0);
        assert!(rebuilt.last.as_ref().is_none_or(|a| a.service != "lc1"));
        assert_eq!(rebuilt.shares, old.shares);
        rebuilt
            .initial()
            .plan
            .validate(&changed.host, &changed.specs)
            .unwrap();
    }

    #[test]
    fn a_rebuilt_parties_fits_the_kept_shares_to_a_new_service_and_adopts_no_other_policy() {
        let c = ctx(2, true, false, 0);
        let mut p = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        p.shares.get_mut("lc0").unwrap().cores = 20;
        // A third service arrives: lc0 and lc1 keep theirs, lc2 gets a fair part of what
        // is free (carry_shares), and the plan is valid.
        let more = ctx(3, true, false, 0);
        let mut rebuilt = PartiesPolicy::new(more.clone(), PartiesConfig::default());
        let adopted = rebuilt.adopt(Box::new(p.clone()));
        assert_eq!(adopted.services, ["lc0", "lc1"].map(String::from).into());
        assert_eq!(rebuilt.shares["lc0"], p.shares["lc0"]);
        assert_eq!(rebuilt.shares["lc1"], p.shares["lc1"]);
        assert!(rebuilt.shares["lc2"].cores >= 1);
        rebuilt
            .initial()
            .plan
            .validate(&more.host, &more.specs)
            .unwrap();
        // Another kind of policy has nothing parties can use.
        let mut fresh = PartiesPolicy::new(c.clone(), PartiesConfig::default());
        let other = crate::StaticPolicy::new(c.clone());
        assert_eq!(fresh.adopt(Box::new(other)), Adopted::default());
        assert_eq!(fresh.shares, fair_shares(&c));
    }
}
