//! cohabit's decisions: pure functions from what was observed to the next plan, and the
//! loop that drives a host with them.
//!
//! A [`Policy`] receives an [`Observation`] and the time explicitly; it keeps its own state
//! between ticks and does no I/O and reads no clock, so the simulator, the daemon and tests
//! share one code path (docs/STYLE.md 4). The one clock read in this crate is in
//! [`control::step`], which times each `decide` call with `Instant` to record how long the
//! decision took (the record's `decision_us`); no decision depends on it. This crate
//! depends on `cohabit-core` and `cohabit-models` only: no simulator, no collectors, no
//! async runtime, no filesystem (docs/DESIGN.md 2).
//!
//! - [`StaticPolicy`], [`PartiesPolicy`], [`ClitePolicy`], [`MlPolicy`]: the policies a
//!   host can run, named by [`PolicyKind`], which also builds them.
//! - [`layout`] and its helpers: shares laid out as a [`Plan`].
//! - [`control`]: the loop that collects, decides, applies and records.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use cohabit_core::{
    Allocation, HostCapacity, Observation, Plan, Prediction, Reason, ServiceSpec, WayRange,
    MBA_MAX_PCT,
};
use cohabit_models::posterior::PosteriorSet;
use cohabit_models::Model;

mod clite;
pub mod control;
mod explore;
pub mod gpu_memory;
mod kind;
mod ml;
mod parties;
mod static_share;

pub use clite::{CliteConfig, ClitePolicy};
pub use explore::{Explore, ExploreConfig, ExploreRule};
pub use kind::{BuildError, PolicyKind};
pub use ml::{MlConfig, MlPolicy};
pub use parties::{PartiesConfig, PartiesPolicy};
pub use static_share::StaticPolicy;

/// What a policy decided at one tick, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The allocation of the whole host from now on.
    pub plan: Plan,
    /// Per group, how it was decided and why, in words an operator can read.
    pub reasons: BTreeMap<String, Reason>,
    /// Model predictions, for policies that use a model.
    pub predictions: BTreeMap<String, Prediction>,
}

impl Decision {
    /// A decision without predictions.
    pub fn new(plan: Plan, reasons: BTreeMap<String, Reason>) -> Self {
        Self {
            plan,
            reasons,
            predictions: BTreeMap::new(),
        }
    }
}

/// A resource-allocation policy.
pub trait Policy: Send + AsAny {
    /// Short name (`static`, `parties`, `ml`, `oracle`).
    fn name(&self) -> &'static str;
    /// The allocation services start with.
    fn initial(&mut self) -> Decision;
    /// The plan for the interval starting at `now_ms`, given what the last interval showed.
    fn decide(&mut self, obs: &Observation, now_ms: u64) -> Decision;
    /// Decides with `model` from now on (a model reloaded from disk), keeping the rest of
    /// the policy's state. False when the policy uses no model (the default).
    fn replace_model(&mut self, model: Arc<Model>) -> bool {
        let _ = model;
        false
    }
    /// Takes over what `previous` learnt: called on a policy just built for a new set of
    /// services (pods came, went or changed under `[kubernetes]`), before it first decides,
    /// with the policy it replaces. The rule (docs/DESIGN.md 7): the online state of a
    /// latency-critical service whose spec is the same in both ([`unchanged_services`]:
    /// name, target, priority, GPU) carries over; a new or changed service starts afresh,
    /// and state that depends on the whole set is kept only where that set did not change
    /// (each policy's `adopt` says what). Pure: no I/O. The default keeps nothing (a
    /// policy without online state, or `previous` of another kind).
    fn adopt(&mut self, previous: Box<dyn Policy>) -> Adopted {
        let _ = previous;
        Adopted::default()
    }
    /// What the policy learnt of this host that is worth keeping across restarts (`ml`'s
    /// per-service posteriors); `None` when it learns nothing of the kind (the default).
    fn learned(&self) -> Option<PosteriorSet> {
        None
    }
    /// Resumes from what an earlier run on this host learnt ([`Policy::learned`]): the
    /// services taken back, by name (none by default).
    fn resume(&mut self, learned: &PosteriorSet) -> Vec<String> {
        let _ = learned;
        Vec::new()
    }
}

/// A policy seen as [`Any`], so that [`Policy::adopt`] can find its predecessor's type
/// (implemented for every policy).
pub trait AsAny: Any {
    /// This policy as `&dyn Any`.
    fn as_any(&self) -> &dyn Any;
    /// This policy as `&mut dyn Any` (a wrapper that drives its base: [`Explore`]).
    fn as_any_mut(&mut self) -> &mut dyn Any;
    /// This policy as `Box<dyn Any>`, to take it apart.
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<T: Any> AsAny for T {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// `previous` as the policy type `P`, or `None` when it is another kind.
pub(crate) fn downcast<P: Policy>(previous: Box<dyn Policy>) -> Option<Box<P>> {
    // Called by path: `previous.into_any()` could be the blanket impl's for the box.
    AsAny::into_any(previous).downcast::<P>().ok()
}

/// Whether `policy` is a `P`.
pub(crate) fn is<P: Policy>(policy: &dyn Policy) -> bool {
    AsAny::as_any(policy).is::<P>()
}

/// What a policy built for a new set of services took over from the one it replaced
/// ([`Policy::adopt`]), for the log line and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Adopted {
    /// The latency-critical services whose online state carried over.
    pub services: BTreeSet<String>,
    /// Whether the state that depends on the whole set carried over too (`clite`'s
    /// search, `ml`'s readings of the best-effort pool, `parties`' last action).
    pub host: bool,
}

/// The latency-critical services of `next` whose spec (target, priority, GPU) is the same
/// in `previous`: the ones whose online state a policy built for `next` takes over.
pub fn unchanged_services(previous: &HostContext, next: &HostContext) -> BTreeSet<String> {
    next.latency_critical()
        .filter(|s| previous.latency_critical().any(|p| p == *s))
        .map(|s| s.name.clone())
        .collect()
}

/// Whether `previous` and `next` have the same host and the same best-effort jobs (by name
/// and GPU: a best-effort job's priority means nothing), so that what was learnt of the
/// best-effort pool still holds.
pub fn same_pool(previous: &HostContext, next: &HostContext) -> bool {
    let pool = |c: &HostContext| -> Vec<(String, Option<u32>)> {
        c.specs
            .iter()
            .filter(|s| !s.is_latency_critical())
            .map(|s| (s.name.clone(), s.gpu))
            .collect()
    };
    previous.host == next.host && pool(previous) == pool(next)
}

/// What every policy knows of the host it manages.
#[derive(Debug, Clone, PartialEq)]
pub struct HostContext {
    /// The host's capacities.
    pub host: HostCapacity,
    /// Every service and job, latency-critical first.
    pub specs: Vec<ServiceSpec>,
}

impl HostContext {
    /// The latency-critical services, in configuration order.
    pub fn latency_critical(&self) -> impl Iterator<Item = &ServiceSpec> {
        self.specs.iter().filter(|s| s.is_latency_critical())
    }

    /// How many latency-critical services may have a resctrl group (a way range and MBA)
    /// of their own: every group the host's CLOSIDs allow, less the best-effort pool's;
    /// none on a host whose LLC cannot be partitioned (no CAT: every group shares the whole
    /// cache, [`HostCapacity::partitions_llc`]), so no policy plans ways there.
    ///
    /// [`HostCapacity::partitions_llc`]: cohabit_core::HostCapacity::partitions_llc
    pub fn isolated_services(&self) -> usize {
        if !self.host.partitions_llc() {
            return 0;
        }
        usize::try_from(self.host.groups_available().saturating_sub(1)).unwrap_or(usize::MAX)
    }

    /// True if the latency-critical service `name` is beyond the CLOSID budget (after the
    /// first [`Self::isolated_services`] in configuration order) and so shares the pool's
    /// way range and MBA, and its resctrl group.
    pub fn shares_pool_group(&self, name: &str) -> bool {
        self.latency_critical()
            .position(|s| s.name == name)
            .is_some_and(|i| i >= self.isolated_services())
    }

    /// True if some best-effort job runs on the CPU (and so needs at least one LLC way).
    pub fn has_cpu_best_effort(&self) -> bool {
        self.specs
            .iter()
            .any(|s| !s.is_latency_critical() && s.gpu.is_none())
    }

    /// True if some best-effort job runs on a GPU.
    pub fn has_gpu_best_effort(&self) -> bool {
        self.specs
            .iter()
            .any(|s| !s.is_latency_critical() && s.gpu.is_some())
    }
}

/// The amounts one latency-critical service gets, before they are laid out on the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// Cores.
    pub cores: u32,
    /// Number of LLC ways (laid out as a contiguous range of its own; ignored for a service
    /// beyond the CLOSID budget, which takes the pool's range, see [`layout`]). 0: no range
    /// of its own: the service's group takes the best-effort pool's range, shared, and keeps
    /// its own MBA (where the host partitions the LLC; a cache-insensitive service's way
    /// goes back to the pool).
    pub ways: u32,
    /// MBA percent.
    pub mba_pct: u8,
    /// GPU MPS percent, for GPU services.
    pub gpu_pct: Option<u8>,
}

/// Lays shares out on the host as a [`Plan`].
///
/// Rule: latency-critical services get disjoint way ranges from way 0 upwards, in
/// configuration order; the best-effort pool gets the ways above them, or shares the top
/// way when none are left (CAT needs at least one way per group), and every core not given
/// to a latency-critical service. Its GPU share is what the latency-critical services on the
/// busiest GPU leave (at least 1 %). Shares that do not fit are the caller's bug: the plan
/// would fail validation.
///
/// CLOSID budget: only the first [`HostContext::isolated_services`] services get a way
/// range of their own; the ones after them (the last in configuration order) take the
/// pool's way range and MBA, and so share its resctrl group, whatever their `ways` and
/// `mba_pct` say (their cores and GPU shares are theirs). The plan then needs at most
/// `host.groups_available()` groups. When the budget does not bind, nothing changes.
///
/// A service within the budget whose share has 0 ways gets the pool's way range too, at its
/// own MBA: one resctrl group with the pool when the pool is at the same MBA, else one
/// shared by every such service (never more groups than they had with ranges of their own;
/// overlapping capacity bitmasks are allowed by CAT unless a group is exclusive, which
/// cohabit never asks for).
pub fn layout(ctx: &HostContext, shares: &BTreeMap<String, Share>, be_mba_pct: u8) -> Plan {
    let mut services = BTreeMap::new();
    let mut in_pool = Vec::new();
    let mut on_pool_ways = Vec::new();
    let mut next_way = 0;
    let mut cores = 0;
    let mut gpu_used = vec![0u32; ctx.host.gpus.len().max(1)];
    let isolated = ctx.isolated_services();
    for (i, spec) in ctx.latency_critical().enumerate() {
        let Some(s) = shares.get(&spec.name) else {
            continue;
        };
        let (first, ways) = if i < isolated && s.ways == 0 && ctx.host.partitions_llc() {
            // Set to the pool's range below.
            on_pool_ways.push(spec.name.clone());
            (0, 1)
        } else if i < isolated {
            let ways = s
                .ways
                .max(1)
                .min(ctx.host.llc_ways.saturating_sub(next_way).max(1));
            let first = next_way.min(ctx.host.llc_ways - ways);
            next_way = first + ways;
            (first, ways)
        } else {
            // Set to the pool's range below.
            in_pool.push(spec.name.clone());
            (0, 1)
        };
        cores += s.cores;
        if let (Some(g), Some(p)) = (spec.gpu, s.gpu_pct) {
            if let Some(u) = gpu_used.get_mut(g as usize) {
                *u += u32::from(p);
            }
        }
        services.insert(
            spec.name.clone(),
            Allocation {
                cores: s.cores,
                llc_ways: WayRange::new(first, ways),
                mba_pct: s.mba_pct,
                gpu_mps_pct: spec.gpu.and(s.gpu_pct),
            },
        );
    }
    let w = ctx.host.llc_ways;
    let be_ways = if next_way < w {
        WayRange::new(next_way, w - next_way)
    } else {
        WayRange::new(w - 1, 1)
    };
    let busiest = gpu_used.iter().copied().max().unwrap_or(0);
    let be_gpu = ctx
        .has_gpu_best_effort()
        .then(|| u8::try_from(100u32.saturating_sub(busiest).max(1)).unwrap_or(100));
    for name in in_pool {
        if let Some(a) = services.get_mut(&name) {
            a.llc_ways = be_ways;
            a.mba_pct = be_mba_pct;
        }
    }
    for name in on_pool_ways {
        if let Some(a) = services.get_mut(&name) {
            a.llc_ways = be_ways;
        }
    }
    Plan {
        services,
        best_effort: Allocation {
            cores: ctx.host.cores.saturating_sub(cores),
            llc_ways: be_ways,
            mba_pct: be_mba_pct,
            gpu_mps_pct: be_gpu,
        },
        gpu_memory_mib: Default::default(),
    }
}

/// The shares of a plan (inverse of [`layout`] for the latency-critical services): a
/// service whose range is the pool's has 0 ways (none of its own).
pub fn shares_of(plan: &Plan) -> BTreeMap<String, Share> {
    plan.services
        .iter()
        .map(|(name, a)| {
            (
                name.clone(),
                Share {
                    cores: a.cores,
                    ways: if a.llc_ways == plan.best_effort.llc_ways {
                        0
                    } else {
                        a.llc_ways.count
                    },
                    mba_pct: a.mba_pct,
                    gpu_pct: a.gpu_mps_pct,
                },
            )
        })
        .collect()
}

/// Equal shares for every group: each latency-critical service and, if there are
/// best-effort jobs, the pool. Remainders go to the latency-critical services in order.
/// The ways of services beyond the CLOSID budget go to the pool's range, which they share
/// (see [`layout`]).
pub fn fair_shares(ctx: &HostContext) -> BTreeMap<String, Share> {
    let lc: Vec<&ServiceSpec> = ctx.latency_critical().collect();
    let n_lc = u32::try_from(lc.len()).unwrap_or(u32::MAX).max(1);
    let cpu_groups = n_lc + u32::from(ctx.has_cpu_best_effort());
    let split = |total: u32, groups: u32, i: u32| total / groups + u32::from(i < total % groups);
    // The pool always keeps at least one way.
    let ways_for_lc = if ctx.has_cpu_best_effort() {
        ctx.host.llc_ways - ctx.host.llc_ways / cpu_groups.max(1)
    } else {
        ctx.host.llc_ways
    };
    let gpu_groups = |g: u32| {
        let n = lc.iter().filter(|s| s.gpu == Some(g)).count();
        u32::try_from(n).unwrap_or(1) + u32::from(ctx.has_gpu_best_effort())
    };
    lc.iter()
        .enumerate()
        .map(|(i, spec)| {
            let i = u32::try_from(i).unwrap_or(0);
            let gpu_pct = spec
                .gpu
                .map(|g| u8::try_from(100 / gpu_groups(g).max(1)).unwrap_or(100));
            (
                spec.name.clone(),
                Share {
                    cores: split(ctx.host.cores, cpu_groups, i).max(1),
                    ways: split(ways_for_lc, n_lc, i).max(1),
                    mba_pct: MBA_MAX_PCT,
                    gpu_pct,
                },
            )
        })
        .collect()
}

/// The plan to put in force when the services change while the daemon runs (pods come and
/// go under `[kubernetes]`): what is in force for the services that stay, a fair start for
/// the new ones, nothing for the ones that left.
///
/// Problem: a policy built for a new set of services starts from its fair-share initial
/// plan. Applied on every change of the set, it would take every latency-critical service
/// from the allocation that met its target to an equal split each time a batch pod starts
/// or ends, on a node where that happens all day.
///
/// Rule: a service that stays keeps its cores, way count, MBA and GPU share. A new one
/// gets its fair share ([`fair_shares`]) of what is free: cores the pool holds beyond one
/// (at least one core: when nothing is free, the service that stays with the most cores
/// gives one); ways likewise, the pool keeping one when CPU jobs run. If the host shrank
/// (the kubelet gave CPUs to single containers), services are cut in proportion, at least
/// one core and one way each. GPU shares that would oversubscribe a GPU become the fair
/// ones for that GPU. The pool keeps its MBA. Laid out with [`layout`]; if the result
/// does not validate, the fair-share plan is returned.
///
/// The new policy's first decision then starts from this plan; it takes over the old one's
/// online state for the services whose spec did not change ([`Policy::adopt`]).
pub fn carry_over(ctx: &HostContext, in_force: &Plan) -> Plan {
    let shares = carry_shares(ctx, &shares_of(in_force));
    let plan = layout(ctx, &shares, in_force.best_effort.mba_pct);
    if plan.validate(&ctx.host, &ctx.specs).is_ok() {
        plan
    } else {
        layout(ctx, &fair_shares(ctx), MBA_MAX_PCT)
    }
}

/// [`carry_over`]'s rule on shares: the shares of `ctx`'s latency-critical services when
/// those in `kept` (by name; a share of 0 ways: on the pool's ways, counted for none) stay
/// and the others are new. Used by the daemon on the plan in force and by a policy that
/// keeps shares of its own ([`Policy::adopt`]).
pub fn carry_shares(ctx: &HostContext, kept: &BTreeMap<String, Share>) -> BTreeMap<String, Share> {
    let fair = fair_shares(ctx);
    let lc: Vec<&ServiceSpec> = ctx.latency_critical().collect();
    let mut shares: BTreeMap<String, Share> = BTreeMap::new();
    let mut new: Vec<&str> = Vec::new();
    for spec in &lc {
        match kept.get(&spec.name) {
            Some(k) => {
                shares.insert(spec.name.clone(), *k);
            }
            None => new.push(&spec.name),
        }
    }
    let cores = ctx.host.cores;
    let lc_ways = ctx
        .host
        .llc_ways
        .saturating_sub(u32::from(ctx.has_cpu_best_effort()))
        .max(1);
    // The host may have shrunk: cut the services that stay in proportion.
    fit_total(&mut shares, cores, |s| &mut s.cores);
    fit_total(&mut shares, lc_ways, |s| &mut s.ways);
    for name in new {
        let f = fair[name];
        let used_c: u32 = shares.values().map(|s| s.cores).sum();
        let used_w: u32 = shares.values().map(|s| s.ways).sum();
        let mut s = Share {
            cores: f.cores.min(cores.saturating_sub(used_c)).max(1),
            ways: f.ways.min(lc_ways.saturating_sub(used_w)).max(1),
            ..f
        };
        if used_c + s.cores > cores {
            take_one(&mut shares, |x| &mut x.cores);
        }
        if used_w + s.ways > lc_ways {
            take_one(&mut shares, |x| &mut x.ways);
        }
        s.cores = s.cores.max(1);
        shares.insert(name.to_string(), s);
    }
    for spec in &lc {
        let Some(g) = spec.gpu else { continue };
        let on_g: u32 = lc
            .iter()
            .filter(|o| o.gpu == Some(g))
            .filter_map(|o| shares.get(&o.name)?.gpu_pct)
            .map(u32::from)
            .sum();
        if on_g > 100 {
            for o in lc.iter().filter(|o| o.gpu == Some(g)) {
                if let (Some(s), Some(f)) = (shares.get_mut(&o.name), fair.get(&o.name)) {
                    s.gpu_pct = f.gpu_pct;
                }
            }
        }
    }
    shares
}

/// Cuts the amounts `field` selects in proportion until their sum is at most `total`
/// (each at least 1).
fn fit_total(shares: &mut BTreeMap<String, Share>, total: u32, field: fn(&mut Share) -> &mut u32) {
    let sum: u32 = shares.values_mut().map(|s| *field(s)).sum();
    if sum <= total || sum == 0 {
        return;
    }
    for s in shares.values_mut() {
        let v = field(s);
        if *v == 0 {
            // None to cut (a service on the pool's ways).
            continue;
        }
        // At most *v (total < sum), so it fits.
        let cut = u64::from(*v) * u64::from(total) / u64::from(sum);
        *v = u32::try_from(cut).unwrap_or(*v).max(1);
    }
    while shares.values_mut().map(|s| *field(s)).sum::<u32>() > total {
        if !take_one(shares, field) {
            break;
        }
    }
}

/// Takes one unit of `field` from the share with the most (keeping at least 1); false
/// when every share is down to 1.
fn take_one(shares: &mut BTreeMap<String, Share>, field: fn(&mut Share) -> &mut u32) -> bool {
    let Some(most) = shares
        .iter_mut()
        .map(|(k, s)| (k.clone(), *field(s)))
        .filter(|(_, v)| *v > 1)
        .max_by_key(|(_, v)| *v)
        .map(|(k, _)| k)
    else {
        return false;
    };
    if let Some(s) = shares.get_mut(&most) {
        *field(s) -= 1;
    }
    true
}

/// Measured slack of a latency-critical service: `(target - p99) / target`; `None` when
/// the p99 was not measured.
pub fn slack(obs: &Observation, name: &str) -> Option<f64> {
    obs.qos_ratio(name).map(|r| 1.0 - r)
}

#[cfg(test)]
pub(crate) mod tests {
    use cohabit_core::ServiceClass;

    use super::*;

    pub(crate) fn ctx(n_lc: usize, be_cpu: bool, be_gpu: bool, gpus: usize) -> HostContext {
        let mut specs: Vec<ServiceSpec> = (0..n_lc)
            .map(|i| ServiceSpec {
                name: format!("lc{i}"),
                class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
                gpu: (i < gpus).then_some(0),
                priority: 0,
            })
            .collect();
        if be_cpu {
            specs.push(ServiceSpec {
                name: "be".into(),
                class: ServiceClass::BestEffort,
                gpu: None,
                priority: 0,
            });
        }
        if be_gpu {
            specs.push(ServiceSpec {
                name: "train".into(),
                class: ServiceClass::BestEffort,
                gpu: Some(0),
                priority: 0,
            });
        }
        HostContext {
            host: HostCapacity {
                name: "t".into(),
                cores: 36,
                freq_ghz: 2.3,
                llc_ways: 20,
                llc_way_bytes: 1 << 20,
                mem_bw_bytes_per_s: 7e10,
                gpus: vec![
                    cohabit_core::GpuCapacity {
                        name: "g".into(),
                        sms: 100,
                        share_change: cohabit_core::ShareChange::Restart,
                    };
                    usize::from(gpus > 0 || be_gpu)
                ],
                closids: 16,
                mba_min_pct: 10,
                mba_gran_pct: 10,
                min_cbm_bits: 1,
                shareable_bits: 0,
            },
            specs,
        }
    }

    /// The fail-safe puts the fair share in force: it must validate on every host that can
    /// hold its services at all (one core each), whatever the cores, ways, CLOSIDs, MBA,
    /// GPUs, priorities and best-effort jobs.
    #[test]
    fn the_fair_share_validates_whenever_every_service_can_have_a_core() {
        let mut checked = 0;
        for cores in 1..=9 {
            for n_lc in 1..=cores as usize {
                for ways in [1, 2, 3, 11, 20] {
                    for closids in [2, 3, 4, 16] {
                        for (be_cpu, be_gpu, gpus) in [
                            (false, false, 0),
                            (true, false, 0),
                            (true, true, 1),
                            (false, true, 3),
                        ] {
                            let mut c = ctx(n_lc, be_cpu, be_gpu, gpus.min(n_lc));
                            c.host.cores = cores;
                            c.host.llc_ways = ways;
                            c.host.closids = closids;
                            if ways == 1 {
                                c.host = c.host.without_allocation();
                            }
                            for (i, s) in c.specs.iter_mut().enumerate() {
                                s.priority = i32::try_from(i % 3).unwrap() - 1;
                            }
                            let plan = layout(&c, &fair_shares(&c), MBA_MAX_PCT);
                            if let Err(e) = plan.validate(&c.host, &c.specs) {
                                panic!("{cores} cores, {n_lc} services, {ways} ways, {closids} CLOSIDs, be {be_cpu}/{be_gpu}, gpus {gpus}: {e}\n{plan:?}");
                            }
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 1000, "{checked}");
    }

    #[test]
    fn a_service_is_unchanged_only_with_the_same_target_priority_and_gpu() {
        let before = ctx(3, true, false, 0);
        let mut after = before.clone();
        after.specs[1].priority = 1;
        after.specs[2].class = ServiceClass::LatencyCritical { p99_target_ms: 2.0 };
        after.specs.insert(
            3,
            ServiceSpec {
                name: "lc3".into(),
                ..before.specs[0].clone()
            },
        );
        assert_eq!(
            unchanged_services(&before, &after),
            ["lc0".to_string()].into()
        );
        assert!(same_pool(&before, &after), "the pool's jobs are the same");
        // A best-effort job's priority means nothing; its name and the host do.
        after.specs[4].priority = 5;
        assert!(same_pool(&before, &after));
        after.specs[4].name = "other".into();
        assert!(!same_pool(&before, &after));
        let mut smaller = before.clone();
        smaller.host.cores -= 2;
        assert!(!same_pool(&before, &smaller));
        assert_eq!(unchanged_services(&before, &smaller).len(), 3);
    }

    #[test]
    fn fair_share_is_valid_and_even() {
        for (n, be) in [(1, true), (2, true), (3, true), (4, false), (7, true)] {
            let c = ctx(n, be, false, 0);
            let plan = layout(&c, &fair_shares(&c), MBA_MAX_PCT);
            plan.validate(&c.host, &c.specs)
                .unwrap_or_else(|e| panic!("{n} {be}: {e}"));
            let cores: Vec<u32> = plan.services.values().map(|a| a.cores).collect();
            assert!(
                cores.iter().max().unwrap() - cores.iter().min().unwrap() <= 1,
                "{cores:?}"
            );
            assert_eq!(plan.lc_cores() + plan.best_effort.cores, 36);
            let ranges: Vec<WayRange> = plan.groups().map(|(_, a)| a.llc_ways).collect();
            for (i, a) in ranges.iter().enumerate() {
                for b in &ranges[i + 1..] {
                    assert!(
                        !a.overlaps(b) || !be,
                        "disjoint ways with a pool that has spare ways"
                    );
                }
            }
        }
    }

    #[test]
    fn a_share_of_no_ways_takes_the_pools_range_in_a_group_of_its_own() {
        let c = ctx_with_closids(2, 16);
        let mut shares = fair_shares(&c);
        shares.get_mut("lc0").unwrap().ways = 0;
        let plan = layout(&c, &shares, 40);
        let (a, pool) = (plan.services["lc0"], plan.best_effort);
        // lc1's range starts at way 0 (lc0 takes none), the pool has the rest, lc0 shares
        // it at its own MBA.
        assert_eq!(plan.services["lc1"].llc_ways.first, 0);
        assert_eq!(
            (a.llc_ways, a.mba_pct, pool.mba_pct),
            (pool.llc_ways, 100, 40)
        );
        assert_eq!(plan.resctrl_groups(), 3);
        // Without CAT (one way), no range is anyone's: the share takes way 0 as before.
        let mut flat = c.clone();
        flat.host = flat.host.without_allocation();
        let plan = layout(&flat, &shares, 100);
        assert_eq!(plan.services["lc0"].llc_ways, WayRange::new(0, 1));
    }

    #[test]
    fn layout_gives_the_pool_the_top_way_when_services_take_them_all() {
        let c = ctx(2, true, false, 0);
        let shares: BTreeMap<String, Share> = [
            (
                "lc0".to_string(),
                Share {
                    cores: 10,
                    ways: 12,
                    mba_pct: 100,
                    gpu_pct: None,
                },
            ),
            (
                "lc1".to_string(),
                Share {
                    cores: 10,
                    ways: 8,
                    mba_pct: 100,
                    gpu_pct: None,
                },
            ),
        ]
        .into();
        let plan = layout(&c, &shares, 100);
        assert_eq!(plan.services["lc0"].llc_ways, WayRange::new(0, 12));
        assert_eq!(plan.services["lc1"].llc_ways, WayRange::new(12, 8));
        assert_eq!(plan.best_effort.llc_ways, WayRange::new(19, 1));
        assert_eq!(plan.best_effort.cores, 16);
        assert_eq!(shares_of(&plan), shares);
    }

    /// `ctx` on a host with `closids` CLOSIDs.
    fn ctx_with_closids(n_lc: usize, closids: u32) -> HostContext {
        let mut c = ctx(n_lc, true, false, 0);
        c.host.closids = closids;
        c
    }

    #[test]
    fn beyond_the_closid_budget_the_last_services_share_the_pool_group() {
        // 4 CLOSIDs: the root, the pool, and two services of their own.
        let c = ctx_with_closids(5, 4);
        assert_eq!(c.isolated_services(), 2);
        assert!(!c.shares_pool_group("lc1") && c.shares_pool_group("lc2"));
        let plan = layout(&c, &fair_shares(&c), 100);
        plan.validate(&c.host, &c.specs).unwrap();
        assert_eq!(plan.resctrl_groups(), 3);
        let pool = plan.best_effort;
        // Fair shares: 17 ways for the services (4, 4, 3, 3, 3), 3 for the pool.
        assert_eq!(plan.services["lc0"].llc_ways, WayRange::new(0, 4));
        assert_eq!(plan.services["lc1"].llc_ways, WayRange::new(4, 4));
        // The ways fair shares gave the last three are the pool's now, and theirs too.
        assert_eq!(pool.llc_ways, WayRange::new(8, 12));
        for name in ["lc2", "lc3", "lc4"] {
            let a = plan.services[name];
            assert_eq!(
                (a.llc_ways, a.mba_pct),
                (pool.llc_ways, pool.mba_pct),
                "{name}"
            );
            assert!(a.cores >= 1, "{name} keeps its cores");
        }
        assert_eq!(plan.lc_cores() + pool.cores, c.host.cores);
    }

    #[test]
    fn without_cat_no_service_has_ways_of_its_own_and_every_group_has_the_whole_llc() {
        let mut c = ctx(3, true, false, 0);
        c.host = c.host.without_allocation();
        assert_eq!(c.isolated_services(), 0);
        assert!(c.latency_critical().all(|s| c.shares_pool_group(&s.name)));
        let plan = layout(&c, &fair_shares(&c), 100);
        plan.validate(&c.host, &c.specs).unwrap();
        assert!(plan
            .groups()
            .all(|(_, a)| a.llc_ways == WayRange::new(0, 1) && a.mba_pct == 100));
        assert_eq!(plan.lc_cores() + plan.best_effort.cores, c.host.cores);
    }

    #[test]
    fn services_sharing_the_pool_group_take_its_mba_too() {
        let c = ctx_with_closids(3, 3);
        let plan = layout(&c, &fair_shares(&c), 40);
        assert_eq!(plan.services["lc0"].mba_pct, 100);
        for name in ["lc1", "lc2"] {
            assert_eq!(plan.services[name].mba_pct, 40, "{name}");
            assert_eq!(plan.services[name].llc_ways, plan.best_effort.llc_ways);
        }
        assert_eq!(plan.resctrl_groups(), 2);
        plan.validate(&c.host, &c.specs).unwrap();
    }

    #[test]
    fn with_two_closids_every_service_shares_the_pool_group() {
        let c = ctx_with_closids(3, 2);
        let plan = layout(&c, &fair_shares(&c), 100);
        assert_eq!(plan.best_effort.llc_ways, WayRange::new(0, 20));
        assert_eq!(plan.resctrl_groups(), 1);
        plan.validate(&c.host, &c.specs).unwrap();
    }

    #[test]
    fn the_layout_does_not_change_while_the_budget_does_not_bind() {
        for n in 1..=7 {
            let roomy = ctx_with_closids(n, 64);
            let expected = layout(&roomy, &fair_shares(&roomy), 100);
            // n services, the pool and the root: exactly enough.
            let u = u32::try_from(n).unwrap();
            for closids in [16, u + 2] {
                let c = ctx_with_closids(n, closids);
                assert_eq!(
                    layout(&c, &fair_shares(&c), 100),
                    expected,
                    "{n} services, {closids} CLOSIDs"
                );
            }
            // One CLOSID fewer: the last service moves into the pool's group.
            let tight = ctx_with_closids(n, u + 1);
            let plan = layout(&tight, &fair_shares(&tight), 100);
            assert_ne!(plan, expected, "{n} services");
            assert_eq!(
                plan.services[&format!("lc{}", n - 1)].llc_ways,
                plan.best_effort.llc_ways
            );
            plan.validate(&tight.host, &tight.specs).unwrap();
        }
    }

    #[test]
    fn the_gpu_pool_gets_what_services_leave() {
        let c = ctx(2, true, true, 2);
        let plan = layout(&c, &fair_shares(&c), 100);
        assert_eq!(plan.services["lc0"].gpu_mps_pct, Some(33));
        assert_eq!(plan.best_effort.gpu_mps_pct, Some(34));
        plan.validate(&c.host, &c.specs).unwrap();
    }

    fn share(cores: u32, ways: u32, gpu_pct: Option<u8>) -> Share {
        Share {
            cores,
            ways,
            mba_pct: MBA_MAX_PCT,
            gpu_pct,
        }
    }

    /// (cores, ways) of every latency-critical service, and the pool's cores.
    fn counts(p: &Plan) -> (BTreeMap<String, (u32, u32)>, u32) {
        (
            p.services
                .iter()
                .map(|(k, a)| (k.clone(), (a.cores, a.llc_ways.count)))
                .collect(),
            p.best_effort.cores,
        )
    }

    #[test]
    fn services_that_stay_keep_their_allocations_and_a_new_one_gets_a_fair_part_of_the_rest() {
        let before = ctx(2, true, false, 0);
        let shares = [
            ("lc0".to_string(), share(20, 9, None)),
            ("lc1".to_string(), share(4, 2, None)),
        ]
        .into();
        let mut in_force = layout(&before, &shares, 50);
        // Unchanged services: the plan in force, MBA included.
        assert_eq!(carry_over(&before, &in_force), in_force);
        // lc2 arrives: lc0 and lc1 keep theirs; lc2 takes its fair 9 cores of the pool's 12
        // and its fair ways (4 groups: 15 LC ways / 3 = 5) of the 8 free.
        let after = ctx(3, true, false, 0);
        let p = carry_over(&after, &in_force);
        p.validate(&after.host, &after.specs).unwrap();
        let (lc, pool) = counts(&p);
        assert_eq!(lc["lc0"], (20, 9));
        assert_eq!(lc["lc1"], (4, 2));
        assert_eq!(lc["lc2"], (9, 5));
        assert_eq!(pool, 3);
        assert_eq!(p.best_effort.mba_pct, 50);
        // lc1 leaves again: gone from the plan, its cores back in the pool.
        in_force = p;
        let mut gone = after.clone();
        gone.specs.retain(|s| s.name != "lc1");
        let p = carry_over(&gone, &in_force);
        p.validate(&gone.host, &gone.specs).unwrap();
        let (lc, pool) = counts(&p);
        assert_eq!(lc.keys().cloned().collect::<Vec<_>>(), vec!["lc0", "lc2"]);
        assert_eq!((lc["lc0"], lc["lc2"], pool), ((20, 9), (9, 5), 7));
    }

    #[test]
    fn a_service_on_the_pools_ways_stays_there_and_costs_the_others_no_ways() {
        // lc1 runs on the pool's 11 ways; lc0 has 9 of its own. A new service comes: lc1
        // is not counted for 11 ways (which would cut lc0 in proportion), it stays on the
        // pool's, and the newcomer gets its fair 5 ways of what is free.
        let before = ctx(2, true, false, 0);
        let shares = [
            ("lc0".to_string(), share(20, 9, None)),
            ("lc1".to_string(), share(4, 0, None)),
        ]
        .into();
        let in_force = layout(&before, &shares, 100);
        assert_eq!(
            in_force.services["lc1"].llc_ways,
            in_force.best_effort.llc_ways
        );
        assert_eq!(shares_of(&in_force), shares);
        let after = ctx(3, true, false, 0);
        let p = carry_over(&after, &in_force);
        p.validate(&after.host, &after.specs).unwrap();
        assert_eq!(p.services["lc0"].llc_ways, WayRange::new(0, 9));
        assert_eq!(p.services["lc2"].llc_ways.count, 5);
        assert_eq!(p.services["lc1"].llc_ways, p.best_effort.llc_ways);
    }

    #[test]
    fn with_nothing_free_a_new_service_gets_a_core_and_a_way_from_the_largest() {
        let before = ctx(2, true, false, 0);
        let shares = [
            ("lc0".to_string(), share(30, 15, None)),
            ("lc1".to_string(), share(6, 4, None)),
        ]
        .into();
        let in_force = layout(&before, &shares, MBA_MAX_PCT);
        assert_eq!(in_force.best_effort.cores, 0);
        let after = ctx(3, true, false, 0);
        let p = carry_over(&after, &in_force);
        p.validate(&after.host, &after.specs).unwrap();
        let (lc, _) = counts(&p);
        assert_eq!(lc["lc0"], (29, 14));
        assert_eq!(lc["lc1"], (6, 4));
        assert_eq!(lc["lc2"], (1, 1));
    }

    #[test]
    fn on_a_host_that_shrank_the_services_are_cut_in_proportion() {
        let before = ctx(2, true, false, 0);
        let shares = [
            ("lc0".to_string(), share(24, 9, None)),
            ("lc1".to_string(), share(8, 3, None)),
        ]
        .into();
        let in_force = layout(&before, &shares, MBA_MAX_PCT);
        // The kubelet gave 20 of the 36 CPUs to single containers.
        let mut after = before.clone();
        after.host.cores = 16;
        let p = carry_over(&after, &in_force);
        p.validate(&after.host, &after.specs).unwrap();
        let (lc, pool) = counts(&p);
        assert_eq!((lc["lc0"].0, lc["lc1"].0, pool), (12, 4, 0));
        assert_eq!((lc["lc0"].1, lc["lc1"].1), (9, 3), "ways still fit");
    }

    #[test]
    fn gpu_shares_that_would_oversubscribe_become_the_fair_ones() {
        let before = ctx(1, false, false, 1);
        let shares = [("lc0".to_string(), share(8, 4, Some(90)))].into();
        let in_force = layout(&before, &shares, MBA_MAX_PCT);
        let after = ctx(2, false, false, 2);
        let p = carry_over(&after, &in_force);
        p.validate(&after.host, &after.specs).unwrap();
        let gpu: Vec<Option<u8>> = p.services.values().map(|a| a.gpu_mps_pct).collect();
        assert_eq!(gpu, vec![Some(50), Some(50)]);
        // Alone again, lc0 keeps what it had.
        assert_eq!(carry_over(&before, &in_force), in_force);
    }
}
