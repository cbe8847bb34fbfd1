//! Plan → host writes: every value cohabit writes for one plan, computed without touching
//! the host.
//!
//! Problem: a plan speaks of groups and amounts (cores, a way range, an MBA percentage, a
//! GPU share). The kernel wants concrete objects: resctrl control groups (one CLOSID each)
//! with schemata lines, cgroups with CPU lists and CFS limits, and MPS environment files.
//!
//! Approach: one pure function, [`layout`], from (plan, host facts, services) to
//! [`HostWrites`], the complete desired state. `crate::apply` compares it with what the
//! kernel holds and writes the difference in a safe order; this module reads and writes
//! nothing, so every rule here is tested without a kernel.
//!
//! Algorithm:
//! 1. resctrl: groups with equal allocations (way range and MBA percentage) share one
//!    control group, so one CLOSID, named `cohabit-<first member>` (members in plan order:
//!    latency-critical services by name, the pool last). More distinct allocations than the
//!    CLOSIDs left after the root group's is [`TooManyGroups`], before anything is written.
//!    A host without RDT allocation gets no groups.
//!
//!    Each group's cache mask is its way range, except where the range is narrower than
//!    the host's `min_cbm_bits` ([`HostCapacity::min_cbm_bits`]): the kernel refuses such a
//!    mask, so it is widened ([`cache_masks`]). Widening can reach into a neighbour's ways
//!    that the plan keeps apart, so the widened mask is placed where it overlaps no other
//!    group beyond what the plans' ranges already share (first upwards, as
//!    [`contiguous_mask`] does, then downwards, always covering the range itself). Where no
//!    such place exists the default one is kept and the overlap is reported
//!    ([`HostWrites::overlaps`], logged by the host), as is a mask that covers ways the
//!    hardware shares with I/O (`shareable_bits`): plans and logs show disjoint ranges, so
//!    the sharing is said out loud rather than hidden.
//! 2. CPUs ([`cpu_layout`]): latency-critical services get consecutive blocks of the host's
//!    CPU list in configuration order, at least one CPU each; the pool gets every CPU left.
//!    When none is left, the pool shares the last CPU as an *idle class* where the host can
//!    weight cgroups (the cpu controller is writable): no quota, so it takes the cycles the
//!    service there leaves idle. It is kept to that one CPU, not spread over all of them,
//!    because unmanaged processes (the clients of the services themselves, on a small host;
//!    system daemons) need somewhere to run: spread over every CPU at the lowest weight, the
//!    batch job still left the benchmark's own client waiting (README "Real services").
//!    When the CPUs run out, later services share the last one too. With
//!    [`BestEffortCpus::All`] and the kernel's idle class, the pool gets every managed CPU
//!    instead (the services' sets stay as they are, disjoint): for hosts whose idle CPUs
//!    wake slowly (VMs whose idle vCPUs halt), where a CPU kept busy by a pool that yields
//!    at once serves a service faster than its own idle one.
//! 3. CPU limit ([`cpu_limit`], written only where the cpu controller is): with CPU sets
//!    the set is the limit; without them the quota is the allocation, and none for a pool
//!    with no cores (the idle class). Class: the pool is put in the kernel's idle class
//!    (`cpu.idle`, Linux 5.15), where it runs only on cycles its siblings leave and is
//!    preempted at once when one of them wakes, and its CPUs count as idle when the kernel
//!    places a waking thread; latency-critical groups are kept out of it. Weight
//!    ([`CpuWeight`]): the highest for latency-critical groups, so unmanaged processes on
//!    their CPUs get little of them; the lowest for the pool where the kernel has no idle
//!    class (the kernel refuses a weight for a group in the class).
//!
//!    Why an idle class and not a quota: on a real host (2 CPUs, memcached and nginx beside
//!    a CPU-bound batch job, README "Real services") a pool confined to one service's CPU
//!    with a 5 % CFS quota at normal weight spent its quota in millisecond bursts that the
//!    service waited behind, and the service's p99 sat at 2–6× its target while the batch
//!    job kept a tenth of its throughput. At the lowest weight the batch job is preempted
//!    on every wake-up of a latency-critical thread instead, and uses the idle time.
//! 4. GPU: each managed GPU client gets its group's MPS share, where the plan sets one.
//!
//! The layout is always computed whole, for every group, and `crate::apply` writes every
//! cgroup whose CPU list differs from the kernel's, not only groups whose count changed (a
//! service that grows shifts every later block). [`cpu_steps`] orders those writes: first
//! every set shrinks to what it keeps, then each group takes its new set, those whose new
//! CPUs nobody holds first, then those that would share only with the pool, so that two
//! latency-critical groups never hold the same CPU in between unless they already did
//! before or will after.
//!
//! Properties: deterministic; one set of values per plan group (written to every cgroup
//! the group's processes are in, see `crate::placement`); at most `num_closids - 1` resctrl
//! groups; blocks of latency-critical services are pairwise disjoint and, with the pool,
//! cover exactly the managed CPUs while the CPUs last (each service at least one).

use std::collections::{BTreeMap, BTreeSet};

use cohabit_collectors::cgroup::{CpuList, CpuMax, CpuWeight};
use cohabit_collectors::resctrl::{contiguous_mask, Schemata, GROUP_PREFIX};
use cohabit_core::{HostCapacity, Plan, ServiceSpec, WayRange, BEST_EFFORT_GROUP};

use super::discover::HostFacts;

/// The plan needs more resctrl groups than the host has CLOSIDs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the plan needs {needed} resctrl groups but the host has {available} CLOSIDs for cohabit")]
pub struct TooManyGroups {
    /// Distinct allocations.
    pub needed: usize,
    /// CLOSIDs left after the root group.
    pub available: u32,
}

// `[host] unmanaged_cache` and `best_effort_cpus`: the configuration owns them; the layout
// reads them ([`Choices`]).
pub use crate::spec::{BestEffortCpus, UnmanagedCache};

/// What the configuration chose for the layout; discovery finds the rest ([`HostFacts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Choices {
    /// Which cache unmanaged processes may use (`[host] unmanaged_cache`).
    pub unmanaged_cache: UnmanagedCache,
    /// Where the pool may run (`[host] best_effort_cpus`).
    pub best_effort_cpus: BestEffortCpus,
}

impl Choices {
    /// The choices of a host's configuration.
    pub fn of(spec: &crate::spec::HostSpec) -> Self {
        Self {
            unmanaged_cache: spec.unmanaged_cache,
            best_effort_cpus: spec.best_effort_cpus,
        }
    }
}

/// Everything cohabit writes to the host for one plan.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HostWrites {
    /// resctrl control groups (one CLOSID each).
    pub resctrl: Vec<ResctrlGroup>,
    /// The cache lines of the root group's schemata, when unmanaged processes share the
    /// pool's ways ([`UnmanagedCache::Pool`]).
    pub root_cache: Option<Schemata>,
    /// One cgroup per plan group.
    pub cgroups: Vec<CgroupValues>,
    /// MPS shares of managed GPU clients.
    pub gpu: Vec<GpuShare>,
    /// Cache ways the masks share although the plan's ranges do not (see the module doc).
    pub overlaps: Vec<WayOverlap>,
}

/// Ways two resctrl groups' masks share that their plan ranges do not (a mask widened to
/// `min_cbm_bits` with nowhere free to go), or that a group shares with I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WayOverlap {
    /// The group's members (plan groups, `+`-joined).
    pub group: String,
    /// The other group's members, or `None`: the host's I/O (`shareable_bits`).
    pub with: Option<String>,
    /// The shared ways, as a bit mask.
    pub ways: u64,
}

impl std::fmt::Display for WayOverlap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.with {
            Some(other) => write!(
                f,
                "the cache masks of {} and {} share ways {:#x} that the plan keeps apart (min_cbm_bits widened a narrower range)",
                self.group, other, self.ways
            ),
            None => write!(
                f,
                "the cache mask of {} covers ways {:#x} that the host shares with I/O (shareable_bits)",
                self.group, self.ways
            ),
        }
    }
}

/// One resctrl control group: a directory under the resctrl mount.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResctrlGroup {
    /// Directory name (`cohabit-<first member>`).
    pub name: String,
    /// Its masks and MBA values.
    pub schemata: Schemata,
    /// Plan groups whose threads belong in it.
    pub members: Vec<String>,
}

/// The CPU values of one plan group, written to every cgroup its processes are in (their
/// owners' cgroups, or cohabit's own group `cohabit/<name>` for processes it moved).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupValues {
    /// The plan group (service name or `best-effort`).
    pub group: String,
    /// The directory name of cohabit's own group for it ([`cgroup_name`]).
    pub name: String,
    /// `cpuset.cpus`, when CPU sets are written.
    pub cpus: Option<CpuList>,
    /// The CFS limit, when CPU quotas are written.
    pub cpu_max: Option<CpuMax>,
    /// The weight against sibling cgroups, when the cpu controller is written; for a
    /// group in the idle class, where the kernel has no idle class.
    pub weight: Option<CpuWeight>,
    /// The idle class (`cpu.idle`), where the kernel has it and the cpu controller is
    /// written: in it for the pool, out of it for latency-critical groups.
    pub idle: Option<bool>,
}

/// The MPS share published for one GPU client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuShare {
    /// Service.
    pub service: String,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`.
    pub pct: u8,
}

impl HostWrites {
    /// The resctrl group that holds plan group `group`'s threads.
    pub fn resctrl_group_of(&self, group: &str) -> Option<&str> {
        self.resctrl
            .iter()
            .find(|g| g.members.iter().any(|m| m == group))
            .map(|g| g.name.as_str())
    }

    /// The cgroup values of plan group `group`.
    pub fn cgroup(&self, group: &str) -> Option<&CgroupValues> {
        self.cgroups.iter().find(|c| c.group == group)
    }
}

/// The cgroup directory of a plan group: `best-effort` for the pool, `lc-<name>` for a
/// latency-critical service.
pub fn cgroup_name(group: &str) -> String {
    if group == BEST_EFFORT_GROUP {
        BEST_EFFORT_GROUP.to_string()
    } else {
        format!("lc-{group}")
    }
}

/// The plan group a service belongs to: its own for a latency-critical one, the pool for a
/// best-effort job.
pub fn plan_group(spec: &ServiceSpec) -> &str {
    if spec.is_latency_critical() {
        &spec.name
    } else {
        BEST_EFFORT_GROUP
    }
}

/// Every write for `plan` on a host with `facts` as configured (`choices`); `services` in
/// configuration order, `gpu_clients` the services whose GPU share cohabit manages.
pub fn layout(
    plan: &Plan,
    facts: &HostFacts,
    choices: &Choices,
    services: &[ServiceSpec],
    gpu_clients: &BTreeSet<String>,
) -> Result<HostWrites, TooManyGroups> {
    let (resctrl, overlaps) = match facts.resctrl.as_ref().filter(|r| r.allocates()) {
        Some(info) => {
            let cbm_mask = info.l3.as_ref().map_or(0, |l| l.cbm_mask);
            resctrl_groups(
                plan,
                info.num_closids().saturating_sub(1),
                &facts.capacity,
                cbm_mask,
                |mask, mba| info.schemata_for_mask(mask, mba),
            )?
        }
        None => (vec![], vec![]),
    };
    let root_cache = match choices.unmanaged_cache {
        UnmanagedCache::Pool => resctrl
            .iter()
            .find(|g| g.members.iter().any(|m| m == BEST_EFFORT_GROUP))
            .map(|g| g.schemata.cache_only())
            .filter(|s| !s.is_empty()),
        UnmanagedCache::Shared => None,
    };
    let mut cpus = cpu_layout(plan, services, &facts.cpus);
    if facts.pool_on_every_cpu(choices.best_effort_cpus) {
        cpus.insert(BEST_EFFORT_GROUP.to_string(), CpuList(facts.cpus.clone()));
    }
    let cgroups = plan
        .groups()
        .map(|(group, alloc)| CgroupValues {
            group: group.to_string(),
            name: cgroup_name(group),
            cpus: cpus.get(group).cloned().filter(|_| facts.can_cpuset),
            cpu_max: facts
                .can_quota
                .then(|| CpuMax::for_cores(cpu_limit(facts.can_cpuset, alloc.cores))),
            weight: facts.can_quota.then_some(if group == BEST_EFFORT_GROUP {
                CpuWeight::Lowest
            } else {
                CpuWeight::Highest
            }),
            idle: (facts.can_quota && facts.idle_class).then_some(group == BEST_EFFORT_GROUP),
        })
        .collect();
    let gpu = services
        .iter()
        .filter(|s| gpu_clients.contains(&s.name))
        .filter_map(|s| {
            let pct = plan.get(plan_group(s))?.gpu_mps_pct?;
            Some(GpuShare {
                service: s.name.clone(),
                pct,
            })
        })
        .collect();
    Ok(HostWrites {
        resctrl,
        root_cache,
        cgroups,
        gpu,
        overlaps,
    })
}

/// Groups with equal allocations share one control group; `available` CLOSIDs at most.
/// Masks come from [`cache_masks`]; the overlaps it could not avoid are returned too.
fn resctrl_groups(
    plan: &Plan,
    available: u32,
    host: &HostCapacity,
    cbm_mask: u64,
    schemata_for: impl Fn(u64, u8) -> Schemata,
) -> Result<(Vec<ResctrlGroup>, Vec<WayOverlap>), TooManyGroups> {
    // The grouping rule is the plan's own (`Plan::resctrl_classes`).
    let classes = plan.resctrl_classes();
    if classes.len() > available as usize {
        return Err(TooManyGroups {
            needed: classes.len(),
            available,
        });
    }
    let ranges: Vec<WayRange> = classes.iter().map(|c| c.llc_ways).collect();
    let masks = cache_masks(&ranges, host.min_cbm_bits, cbm_mask);
    let groups: Vec<ResctrlGroup> = classes
        .into_iter()
        .zip(&masks)
        .filter_map(|(class, mask)| {
            let first = *class.members.first()?;
            Some(ResctrlGroup {
                name: format!("{GROUP_PREFIX}{first}"),
                schemata: schemata_for(*mask, class.mba_pct),
                members: class.members.into_iter().map(str::to_string).collect(),
            })
        })
        .collect();
    let mut overlaps = Vec::new();
    for (i, a) in groups.iter().enumerate() {
        for (j, b) in groups.iter().enumerate().skip(i + 1) {
            let hidden = masks[i]
                & masks[j]
                & !(range_mask(ranges[i], cbm_mask) & range_mask(ranges[j], cbm_mask));
            if hidden != 0 {
                overlaps.push(WayOverlap {
                    group: a.members.join("+"),
                    with: Some(b.members.join("+")),
                    ways: hidden,
                });
            }
        }
        if masks[i] & host.shareable_bits != 0 {
            overlaps.push(WayOverlap {
                group: a.members.join("+"),
                with: None,
                ways: masks[i] & host.shareable_bits,
            });
        }
    }
    Ok((groups, overlaps))
}

/// The mask of a way range as the plan means it (no widening), within `cbm_mask`.
fn range_mask(r: WayRange, cbm_mask: u64) -> u64 {
    let ones = if r.count >= 64 {
        u64::MAX
    } else {
        (1u64 << r.count) - 1
    };
    ones.checked_shl(r.first).unwrap_or(0) & cbm_mask
}

/// The cache mask of each way range in `ranges` on a host with `min_cbm_bits` and
/// `cbm_mask` (see the module doc): a range at least `min_cbm_bits` wide is its own mask;
/// a narrower one is widened to `min_cbm_bits` ways, covering the range, where it adds
/// no overlap with another mask that the ranges themselves do not have, if there is such a
/// place (upwards first), else where [`contiguous_mask`] puts it.
pub fn cache_masks(ranges: &[WayRange], min_cbm_bits: u32, cbm_mask: u64) -> Vec<u64> {
    let all = 64 - cbm_mask.leading_zeros();
    let plain: Vec<u64> = ranges.iter().map(|r| range_mask(*r, cbm_mask)).collect();
    let mut masks: Vec<Option<u64>> = ranges
        .iter()
        .map(|r| {
            (r.count >= min_cbm_bits)
                .then(|| contiguous_mask(r.first, r.count, min_cbm_bits, cbm_mask))
        })
        .collect();
    for i in 0..ranges.len() {
        if masks[i].is_some() {
            continue;
        }
        let r = ranges[i];
        let default = contiguous_mask(r.first, r.count, min_cbm_bits, cbm_mask);
        let width = r.count.max(min_cbm_bits).min(all);
        let adds_overlap = |m: u64, masks: &[Option<u64>]| {
            masks
                .iter()
                .enumerate()
                .any(|(j, o)| j != i && o.is_some_and(|o| m & o & !(plain[i] & plain[j]) != 0))
        };
        let lowest = (r.first + r.count).saturating_sub(width);
        let chosen = (lowest..=r.first)
            .rev()
            .filter(|start| start + width <= all)
            .map(|start| contiguous_mask(start, width, min_cbm_bits, cbm_mask))
            .find(|m| !adds_overlap(*m, &masks))
            .unwrap_or(default);
        masks[i] = Some(chosen);
    }
    masks.into_iter().map(|m| m.unwrap_or(0)).collect()
}

/// The CPU list of each group (see the module doc, step 2).
pub fn cpu_layout(
    plan: &Plan,
    services: &[ServiceSpec],
    cpus: &[u32],
) -> BTreeMap<String, CpuList> {
    let mut out = BTreeMap::new();
    let mut next = 0usize;
    for s in services.iter().filter(|s| s.is_latency_critical()) {
        let n = plan.services.get(&s.name).map_or(0, |a| a.cores as usize);
        let end = (next + n.max(1)).min(cpus.len());
        out.insert(
            s.name.clone(),
            CpuList(cpus[next.min(end.saturating_sub(1))..end].to_vec()),
        );
        next = end;
    }
    let rest: Vec<u32> = if next < cpus.len() {
        cpus[next..].to_vec()
    } else {
        cpus.last().copied().into_iter().collect()
    };
    out.insert(BEST_EFFORT_GROUP.to_string(), CpuList(rest));
    out
}

/// The CPU time limit of a group with `cores` (see the module doc, step 3); `None`: none.
/// A group with no cores is the idle class: no quota, the lowest weight.
pub fn cpu_limit(with_cpu_sets: bool, cores: u32) -> Option<f64> {
    match (with_cpu_sets, cores) {
        (_, 0) => None,
        (true, _) => None,
        (false, c) => Some(f64::from(c)),
    }
}

/// The CPU-set writes that take each group from `current` to `desired`, in an order where
/// no two groups hold the same CPU in between unless that cannot be helped: first every
/// group drops the CPUs it loses (keeping those it keeps), then the groups take their new
/// sets, each as soon as no other group holds any of its new CPUs. When none can, a group
/// goes next whose new CPUs are held only by groups outside `latency_critical` (the pool),
/// or that is outside it itself, so two latency-critical groups never share a CPU in
/// between; only a cycle among them (two swapping CPUs) leaves one unavoidable overlap.
/// A group that keeps none of its CPUs cannot shrink first (an empty set is refused while
/// it has tasks) and goes straight to its new set. Groups missing from `current` (just
/// created) only get their new set.
pub fn cpu_steps(
    current: &BTreeMap<String, CpuList>,
    desired: &BTreeMap<String, CpuList>,
    latency_critical: &BTreeSet<String>,
) -> Vec<(String, CpuList)> {
    let mut now = current.clone();
    let mut steps = Vec::new();
    for (g, want) in desired {
        let Some(have) = current.get(g) else { continue };
        let keep: Vec<u32> = have
            .0
            .iter()
            .copied()
            .filter(|c| want.0.contains(c))
            .collect();
        if keep.len() < have.0.len() && !keep.is_empty() {
            steps.push((g.clone(), CpuList(keep.clone())));
            now.insert(g.clone(), CpuList(keep));
        }
    }
    // Then each group takes its new set: those whose new CPUs nobody else holds first,
    // then those that would share only with the pool.
    let mut pending: Vec<&String> = desired
        .iter()
        .filter(|(g, want)| now.get(*g) != Some(*want))
        .map(|(g, _)| g)
        .collect();
    while !pending.is_empty() {
        let holders = |g: &String, now: &BTreeMap<String, CpuList>| -> Vec<String> {
            now.iter()
                .filter(|(other, held)| *other != g && held.overlaps(&desired[g]))
                .map(|(other, _)| other.clone())
                .collect()
        };
        let lc = |g: &String| latency_critical.contains(g);
        let pos = pending
            .iter()
            .position(|g| holders(g, &now).is_empty())
            .or_else(|| {
                pending
                    .iter()
                    .position(|g| !lc(g) || holders(g, &now).iter().all(|h| !lc(h)))
            })
            .unwrap_or(0);
        let g = pending.remove(pos);
        steps.push((g.clone(), desired[g].clone()));
        now.insert(g.clone(), desired[g].clone());
    }
    steps
}

#[cfg(test)]
mod tests {
    use cohabit_collectors::perf::PerfSupport;
    use cohabit_collectors::resctrl::{CacheInfo, MbaInfo, MbaUnits, ResctrlInfo};
    use cohabit_core::{Allocation, HostCapacity, ServiceClass, WayRange};

    use super::*;

    fn lc(name: &str) -> ServiceSpec {
        ServiceSpec {
            name: name.into(),
            class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
            gpu: None,
            priority: 0,
        }
    }

    fn be(name: &str) -> ServiceSpec {
        ServiceSpec {
            name: name.into(),
            class: ServiceClass::BestEffort,
            gpu: None,
            priority: 0,
        }
    }

    fn alloc(cores: u32, first: u32, count: u32, mba: u8) -> Allocation {
        Allocation {
            cores,
            llc_ways: WayRange::new(first, count),
            mba_pct: mba,
            gpu_mps_pct: None,
        }
    }

    fn plan(services: &[(&str, Allocation)], pool: Allocation) -> Plan {
        Plan {
            services: services
                .iter()
                .map(|(n, a)| ((*n).to_string(), *a))
                .collect(),
            best_effort: pool,
            gpu_memory_mib: Default::default(),
        }
    }

    /// 12 ways, one cache and MB domain, `closids` CLOSIDs, MBA in 10 % steps.
    fn rdt(closids: u32) -> ResctrlInfo {
        ResctrlInfo {
            root: "/sys/fs/resctrl".into(),
            l3: Some(CacheInfo {
                cbm_mask: 0xfff,
                min_cbm_bits: 1,
                shareable_bits: 0,
                num_closids: closids,
                cdp: false,
            }),
            mba: Some(MbaInfo {
                units: MbaUnits::Percent { min: 10, gran: 10 },
                num_closids: closids,
                delay_linear: true,
                min_bandwidth: 10,
                bandwidth_gran: 10,
            }),
            mon: None,
            l3_domains: vec![0],
            mb_domains: vec![0],
        }
    }

    /// 8 CPUs (0-7), CPU sets and quotas writable, RDT with `closids`.
    fn facts(closids: Option<u32>) -> HostFacts {
        HostFacts {
            capacity: HostCapacity {
                name: "test".into(),
                cores: 8,
                freq_ghz: 2.0,
                llc_ways: 12,
                llc_way_bytes: 1 << 20,
                mem_bw_bytes_per_s: 1e10,
                gpus: vec![],
                closids: closids.unwrap_or(16),
                mba_min_pct: 10,
                mba_gran_pct: 10,
                min_cbm_bits: 1,
                shareable_bits: 0,
            },
            cpus: (0..8).collect(),
            writable: vec!["cpuset".into(), "cpu".into()],
            can_cpuset: true,
            can_quota: true,
            resctrl: closids.map(rdt),
            perf: PerfSupport::Unsupported("test".into()),
            clk_tck: 100.0,
            idle_class: true,
        }
    }

    /// The writes for `p` on `facts`, configured as by default, with no GPU clients.
    fn writes(p: &Plan, facts: &HostFacts, services: &[ServiceSpec]) -> HostWrites {
        layout(p, facts, &Choices::default(), services, &BTreeSet::new()).unwrap()
    }

    fn three() -> Vec<ServiceSpec> {
        vec![lc("kv"), lc("web"), lc("db"), be("batch")]
    }

    fn cpus_of(w: &HostWrites, group: &str) -> String {
        w.cgroup(group).unwrap().cpus.as_ref().unwrap().to_string()
    }

    #[test]
    fn three_services_get_blocks_in_configuration_order_and_the_pool_the_rest() {
        // kv 2, web 1, db 2 in configuration order: 0-1, 2, 3-4; the pool 5-7.
        let p = plan(
            &[
                ("kv", alloc(2, 0, 4, 100)),
                ("web", alloc(1, 4, 2, 100)),
                ("db", alloc(2, 6, 2, 100)),
            ],
            alloc(3, 8, 4, 50),
        );
        let w = writes(&p, &facts(None), &three());
        assert_eq!(cpus_of(&w, "kv"), "0-1");
        assert_eq!(cpus_of(&w, "web"), "2");
        assert_eq!(cpus_of(&w, "db"), "3-4");
        assert_eq!(cpus_of(&w, "best-effort"), "5-7");
        assert_eq!(w.cgroup("kv").unwrap().name, "lc-kv");
        assert_eq!(w.cgroup("best-effort").unwrap().name, "best-effort");
        assert!(w.resctrl.is_empty(), "no RDT, no resctrl groups");
    }

    #[test]
    fn a_growing_service_shifts_the_later_blocks_and_shrinks_the_pool() {
        let specs = three();
        let before = plan(
            &[
                ("kv", alloc(2, 0, 4, 100)),
                ("web", alloc(1, 4, 2, 100)),
                ("db", alloc(2, 6, 2, 100)),
            ],
            alloc(3, 8, 4, 100),
        );
        let mut after = before.clone();
        after.services.get_mut("kv").unwrap().cores = 4; // kv grows by 2
        after.services.get_mut("db").unwrap().cores = 1; // db shrinks by 1
        let a = writes(&before, &facts(None), &specs);
        let b = writes(&after, &facts(None), &specs);
        // kv 0-3, web 4 (moved though its size did not change), db 5, pool 6-7.
        assert_eq!(cpus_of(&b, "kv"), "0-3");
        assert_eq!(cpus_of(&b, "web"), "4");
        assert_eq!(cpus_of(&b, "db"), "5");
        assert_eq!(cpus_of(&b, "best-effort"), "6-7");
        assert_ne!(
            a.cgroup("web"),
            b.cgroup("web"),
            "web's set is rewritten too"
        );
    }

    #[test]
    fn when_cpus_run_out_later_services_and_the_idle_pool_share_the_last_one() {
        let p = plan(
            &[
                ("kv", alloc(6, 0, 4, 100)),
                ("web", alloc(4, 4, 2, 100)),
                ("db", alloc(0, 6, 2, 100)),
            ],
            alloc(0, 8, 4, 100),
        );
        let w = writes(&p, &facts(None), &three());
        assert_eq!(cpus_of(&w, "kv"), "0-5");
        assert_eq!(cpus_of(&w, "web"), "6-7", "what is left");
        assert_eq!(cpus_of(&w, "db"), "7", "0 cores still get one CPU");
        assert_eq!(cpus_of(&w, "best-effort"), "7");
        let pool = w.cgroup("best-effort").unwrap();
        assert_eq!(pool.weight, Some(CpuWeight::Lowest), "an idle class");
        assert_eq!(pool.cpu_max.unwrap().quota_us, None, "without a quota");
    }

    #[test]
    fn the_pool_is_in_the_idle_class_and_on_every_cpu_only_when_asked() {
        let p = plan(
            &[("kv", alloc(2, 0, 4, 100)), ("web", alloc(1, 4, 2, 100))],
            alloc(3, 6, 6, 100),
        );
        let specs = &three()[..2];
        let idle = |w: &HostWrites, g: &str| w.cgroup(g).unwrap().idle;
        // Default: the spare CPUs, in the idle class (services explicitly out of it).
        let spare = writes(&p, &facts(None), specs);
        assert_eq!(cpus_of(&spare, "best-effort"), "3-7");
        assert_eq!(idle(&spare, "best-effort"), Some(true));
        assert_eq!(idle(&spare, "kv"), Some(false));
        // All: every managed CPU for the pool; the services' sets stay disjoint.
        let mut f = facts(None);
        let asked = Choices {
            best_effort_cpus: BestEffortCpus::All,
            ..Choices::default()
        };
        let all = layout(&p, &f, &asked, specs, &BTreeSet::new()).unwrap();
        assert_eq!(cpus_of(&all, "best-effort"), "0-7");
        assert_eq!(
            (cpus_of(&all, "kv"), cpus_of(&all, "web")),
            ("0-1".into(), "2".into())
        );
        // Without the kernel's idle class, neither: the lowest weight on the spare CPUs.
        f.idle_class = false;
        let old = layout(&p, &f, &asked, specs, &BTreeSet::new()).unwrap();
        assert_eq!(cpus_of(&old, "best-effort"), "3-7");
        assert_eq!(idle(&old, "best-effort"), None);
        assert_eq!(
            old.cgroup("best-effort").unwrap().weight,
            Some(CpuWeight::Lowest)
        );
        // Nor without a writable cpu controller (the class is a cpu controller file).
        f.idle_class = true;
        f.can_quota = false;
        let no_cpu = layout(&p, &f, &asked, specs, &BTreeSet::new()).unwrap();
        assert_eq!(cpus_of(&no_cpu, "best-effort"), "3-7");
        assert_eq!(idle(&no_cpu, "best-effort"), None);
    }

    #[test]
    fn equal_allocations_share_a_closid_named_after_the_first_member() {
        // kv and web have the same ways and MBA: one group; db and the pool differ.
        let p = plan(
            &[
                ("kv", alloc(2, 0, 4, 100)),
                ("web", alloc(1, 0, 4, 100)),
                ("db", alloc(2, 4, 4, 100)),
            ],
            alloc(3, 8, 4, 50),
        );
        let w = writes(&p, &facts(Some(16)), &three());
        let names: Vec<(&str, &[String])> = w
            .resctrl
            .iter()
            .map(|g| (g.name.as_str(), g.members.as_slice()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("cohabit-kv", &["kv".to_string(), "web".to_string()][..]),
                ("cohabit-db", &["db".to_string()][..]),
                ("cohabit-best-effort", &["best-effort".to_string()][..]),
            ],
            "ordered by (first way, count, MBA); members in plan order (by name, pool last)"
        );
        assert_eq!(w.resctrl_group_of("web"), Some("cohabit-kv"));
        let kv = &w.resctrl[0].schemata;
        assert_eq!(kv.to_string(), "L3:0=f\nMB:0=100\n");
        assert_eq!(w.resctrl[2].schemata.to_string(), "L3:0=f00\nMB:0=50\n");
        // Same ways, different MBA: separate groups.
        let mut p2 = p.clone();
        p2.services.get_mut("web").unwrap().mba_pct = 60;
        let w2 = writes(&p2, &facts(Some(16)), &three());
        assert_eq!(w2.resctrl.len(), 4);
    }

    /// [`facts`] on a host whose masks need at least `min_cbm_bits` ways.
    fn facts_min_bits(min_cbm_bits: u32, shareable_bits: u64) -> HostFacts {
        let mut f = facts(Some(16));
        f.capacity.min_cbm_bits = min_cbm_bits;
        f.capacity.shareable_bits = shareable_bits;
        if let Some(l3) = f.resctrl.as_mut().and_then(|r| r.l3.as_mut()) {
            l3.min_cbm_bits = min_cbm_bits;
            l3.shareable_bits = shareable_bits;
        }
        f
    }

    fn l3_mask(w: &HostWrites, group: &str) -> u64 {
        let name = w.resctrl_group_of(group).unwrap();
        let g = w.resctrl.iter().find(|g| g.name == name).unwrap();
        g.schemata.get("L3", 0).unwrap()
    }

    #[test]
    fn a_one_way_service_widened_to_min_cbm_bits_goes_where_it_hides_no_overlap() {
        // min_cbm_bits 2. kv has way 5 alone; way 4 is free, way 6 is the pool's. Widened
        // upwards (ways 5-6) it would share the pool's way 6 while the plan shows disjoint
        // ranges; downwards (4-5) it shares nothing.
        let p = plan(
            &[("web", alloc(1, 0, 4, 100)), ("kv", alloc(1, 5, 1, 100))],
            alloc(1, 6, 6, 100),
        );
        let specs = vec![lc("web"), lc("kv"), be("batch")];
        let w = writes(&p, &facts_min_bits(2, 0), &specs);
        assert_eq!(l3_mask(&w, "kv"), 0b11_0000);
        assert_eq!(l3_mask(&w, "web"), 0xf);
        assert_eq!(l3_mask(&w, "best-effort"), 0xfc0);
        assert!(w.overlaps.is_empty(), "{:?}", w.overlaps);
        // The masks are pairwise disjoint, as the plan's ranges are.
        let masks: Vec<u64> = ["web", "kv", "best-effort"]
            .iter()
            .map(|g| l3_mask(&w, g))
            .collect();
        for (i, a) in masks.iter().enumerate() {
            for b in &masks[i + 1..] {
                assert_eq!(a & b, 0, "{masks:x?}");
            }
        }
        // Without min_cbm_bits the range is its own mask.
        let w = writes(&p, &facts_min_bits(1, 0), &specs);
        assert_eq!(l3_mask(&w, "kv"), 0b10_0000);
    }

    #[test]
    fn an_overlap_that_cannot_be_avoided_is_reported_not_hidden() {
        // Every way is taken: kv's way 5 widened to 2 ways must share one with a neighbour.
        let p = plan(
            &[("web", alloc(1, 0, 5, 100)), ("kv", alloc(1, 5, 1, 100))],
            alloc(1, 6, 6, 100),
        );
        let specs = vec![lc("web"), lc("kv"), be("batch")];
        let w = writes(&p, &facts_min_bits(2, 0), &specs);
        assert_eq!(l3_mask(&w, "kv"), 0b110_0000, "the kernel's default place");
        assert_eq!(
            w.overlaps,
            vec![WayOverlap {
                group: "kv".into(),
                with: Some("best-effort".into()),
                ways: 0b100_0000,
            }]
        );
        let text = w.overlaps[0].to_string();
        assert!(
            text.contains("kv and best-effort share ways 0x40"),
            "{text}"
        );
        // Ways the hardware shares with I/O are reported for whoever holds them.
        let w = writes(&p, &facts_min_bits(1, 0xc00), &specs);
        assert_eq!(
            w.overlaps,
            vec![WayOverlap {
                group: "best-effort".into(),
                with: None,
                ways: 0xc00,
            }]
        );
        assert!(w.overlaps[0].to_string().contains("I/O"));
    }

    #[test]
    fn ranges_the_plan_already_shares_are_not_reported() {
        // Two services given the same two ways on purpose: no hidden overlap.
        let p = plan(
            &[("web", alloc(1, 0, 2, 100)), ("kv", alloc(1, 0, 2, 50))],
            alloc(1, 2, 10, 100),
        );
        let specs = vec![lc("web"), lc("kv"), be("batch")];
        let w = writes(&p, &facts_min_bits(2, 0), &specs);
        assert!(w.overlaps.is_empty(), "{:?}", w.overlaps);
    }

    #[test]
    fn too_many_distinct_allocations_are_refused_before_any_write() {
        let p = plan(
            &[
                ("kv", alloc(2, 0, 4, 100)),
                ("web", alloc(1, 4, 4, 100)),
                ("db", alloc(2, 8, 2, 100)),
            ],
            alloc(3, 10, 2, 50),
        );
        // 4 CLOSIDs: the root's and 3 for cohabit; the plan needs 4.
        let e = layout(
            &p,
            &facts(Some(4)),
            &Choices::default(),
            &three(),
            &BTreeSet::new(),
        )
        .unwrap_err();
        assert_eq!(
            e,
            TooManyGroups {
                needed: 4,
                available: 3
            }
        );
        assert!(e.to_string().contains("needs 4 resctrl groups"));
        // Sharing brings it within the limit.
        let mut shared = p.clone();
        shared.services.insert("db".into(), alloc(2, 4, 4, 100));
        assert_eq!(writes(&shared, &facts(Some(4)), &three()).resctrl.len(), 3);
    }

    #[test]
    fn quotas_follow_the_rule_with_and_without_cpu_sets() {
        let p = plan(
            &[
                ("kv", alloc(2, 0, 4, 100)),
                ("web", alloc(1, 4, 2, 100)),
                ("db", alloc(2, 6, 2, 100)),
            ],
            alloc(0, 8, 4, 100),
        );
        let q = |w: &HostWrites, g: &str| w.cgroup(g).unwrap().cpu_max.unwrap().quota_us;
        let with_sets = writes(&p, &facts(None), &three());
        assert_eq!(q(&with_sets, "kv"), None, "the set is the limit");
        assert_eq!(
            q(&with_sets, "best-effort"),
            None,
            "a pool with no cores is an idle class, not a quota"
        );
        assert_eq!(
            with_sets.cgroup("best-effort").unwrap().weight,
            Some(CpuWeight::Lowest)
        );
        let mut f = facts(None);
        f.can_cpuset = false;
        let quotas = writes(&p, &f, &three());
        assert_eq!(q(&quotas, "kv"), Some(200_000));
        assert_eq!(q(&quotas, "web"), Some(100_000));
        assert_eq!(q(&quotas, "best-effort"), None);
        assert!(
            quotas.cgroup("kv").unwrap().cpus.is_none(),
            "no CPU sets written"
        );
        f.can_quota = false;
        let neither = writes(&p, &f, &three());
        assert!(neither
            .cgroups
            .iter()
            .all(|c| c.cpus.is_none() && c.cpu_max.is_none()));
        assert_eq!(cpu_limit(true, 3), None);
        assert_eq!(cpu_limit(false, 3), Some(3.0));
        assert_eq!(cpu_limit(true, 0), None, "an idle class has no quota");
    }

    #[test]
    fn gpu_clients_get_their_groups_share() {
        let mut kv = alloc(2, 0, 4, 100);
        kv.gpu_mps_pct = Some(60);
        let mut pool = alloc(3, 4, 8, 100);
        pool.gpu_mps_pct = Some(40);
        let p = plan(
            &[
                ("kv", kv),
                ("web", alloc(1, 4, 2, 100)),
                ("db", alloc(2, 6, 2, 100)),
            ],
            pool,
        );
        let clients: BTreeSet<String> = ["kv", "batch", "web"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let w = layout(&p, &facts(None), &Choices::default(), &three(), &clients).unwrap();
        assert_eq!(
            w.gpu,
            vec![
                GpuShare {
                    service: "kv".into(),
                    pct: 60
                },
                GpuShare {
                    service: "batch".into(),
                    pct: 40
                },
            ],
            "web has no share in the plan; db is no client"
        );
    }

    fn sets(v: &[(&str, &str)]) -> BTreeMap<String, CpuList> {
        v.iter()
            .map(|(g, c)| ((*g).to_string(), c.parse().unwrap()))
            .collect()
    }

    fn steps(current: &[(&str, &str)], desired: &[(&str, &str)]) -> Vec<(String, String)> {
        cpu_steps(&sets(current), &sets(desired), &BTreeSet::new())
            .into_iter()
            .map(|(g, c)| (g, c.to_string()))
            .collect()
    }

    #[test]
    fn cpu_sets_shrink_before_they_grow() {
        // kv grows 0-1 → 0-3 at the pool's expense (2-7 → 4-7): the pool shrinks first.
        assert_eq!(
            steps(
                &[("kv", "0-1"), ("pool", "2-7")],
                &[("kv", "0-3"), ("pool", "4-7")]
            ),
            vec![("pool".into(), "4-7".into()), ("kv".into(), "0-3".into())]
        );
        // A block that shifts (web 2 → 4) keeps nothing: it moves once the pool released
        // CPU 4, and only then does kv take CPU 2.
        assert_eq!(
            steps(
                &[("kv", "0-1"), ("web", "2"), ("pool", "3-7")],
                &[("kv", "0-3"), ("web", "4"), ("pool", "5-7")]
            ),
            vec![
                ("pool".into(), "5-7".into()),
                ("web".into(), "4".into()),
                ("kv".into(), "0-3".into()),
            ]
        );
        // A swap overlaps once, then settles.
        assert_eq!(
            steps(&[("a", "0"), ("b", "1")], &[("a", "1"), ("b", "0")]),
            vec![("a".into(), "1".into()), ("b".into(), "0".into())]
        );
        // Nothing changes: nothing written. A new group only gets its set.
        assert!(steps(&[("kv", "0-1")], &[("kv", "0-1")]).is_empty());
        assert_eq!(
            steps(&[], &[("kv", "0-1")]),
            vec![("kv".into(), "0-1".into())]
        );
    }

    #[test]
    fn without_a_cycle_no_two_groups_ever_hold_the_same_cpu() {
        let cases = [
            (
                &[("a", "0-3"), ("b", "4-5"), ("c", "6-7")][..],
                &[("a", "0-1"), ("b", "2-5"), ("c", "6-7")][..],
            ),
            (
                &[("kv", "0-1"), ("web", "2-3"), ("db", "4"), ("be", "5-7")][..],
                &[("kv", "0"), ("web", "1-2"), ("db", "3-5"), ("be", "6-7")][..],
            ),
            (
                &[("kv", "0-3"), ("web", "4"), ("be", "5-7")][..],
                &[("kv", "0-1"), ("web", "2"), ("be", "3-7")][..],
            ),
        ];
        for (current, desired) in cases {
            let (current, desired) = (sets(current), sets(desired));
            let mut now = current.clone();
            for (g, c) in cpu_steps(&current, &desired, &BTreeSet::new()) {
                now.insert(g, c);
                let all: Vec<u32> = now.values().flat_map(|c| c.0.clone()).collect();
                let unique: BTreeSet<u32> = all.iter().copied().collect();
                assert_eq!(all.len(), unique.len(), "overlap in {now:?}");
            }
            assert_eq!(now, desired);
        }
    }

    /// Latency-critical groups in `sets` that share a CPU.
    fn lc_overlap(
        sets: &BTreeMap<String, CpuList>,
        lc: &BTreeSet<String>,
    ) -> Option<(String, String)> {
        let lcs: Vec<(&String, &CpuList)> = sets.iter().filter(|(g, _)| lc.contains(*g)).collect();
        for (i, (a, ca)) in lcs.iter().enumerate() {
            for (b, cb) in &lcs[i + 1..] {
                if ca.overlaps(cb) {
                    return Some(((*a).clone(), (*b).clone()));
                }
            }
        }
        None
    }

    #[test]
    fn latency_critical_groups_wait_for_the_pool_rather_than_for_each_other() {
        // kv grows over web's CPUs while web moves onto the CPU it will share with the pool:
        // web must go first, overlapping the pool for a moment, never kv.
        let lc: BTreeSet<String> = ["kv".to_string(), "web".to_string()].into();
        let (current, desired) = (
            sets(&[("kv", "0"), ("web", "1-2"), ("pool", "3")]),
            sets(&[("kv", "0-2"), ("web", "3"), ("pool", "3")]),
        );
        let steps = cpu_steps(&current, &desired, &lc);
        let mut now = current.clone();
        for (g, c) in &steps {
            now.insert(g.clone(), c.clone());
            assert_eq!(lc_overlap(&now, &lc), None, "after {g} = {c}: {now:?}");
        }
        assert_eq!(now, desired);
        assert_eq!(steps[0].0, "web");
    }

    proptest::proptest! {
        /// Random plan sequences on 2 to 16 CPUs with 1 to 4 latency-critical services that
        /// fit (each at least one CPU): every layout has pairwise disjoint latency-critical
        /// sets that, with the pool, cover exactly the managed CPUs; and stepping from one
        /// layout to the next with [`cpu_steps`], no two of them ever share a CPU.
        #[test]
        fn layouts_stay_disjoint_through_any_plan_sequence(
            n in 2u32..=16,
            services in 1usize..=4,
            raw in proptest::collection::vec(proptest::collection::vec(0u32..=16, 4), 1..8),
        ) {
            let services = services.min(n as usize);
            let names: Vec<String> = (0..services).map(|i| format!("s{i}")).collect();
            let mut specs: Vec<ServiceSpec> = names.iter().map(|n| lc(n)).collect();
            specs.push(be("batch"));
            let lc_set: BTreeSet<String> = names.iter().cloned().collect();
            let cpus: Vec<u32> = (0..n).map(|c| c * 2).collect(); // not 0..n: any ids
            let mut previous: Option<BTreeMap<String, CpuList>> = None;
            for cores in raw {
                // Make the plan fit: shrink the largest until every service has a CPU.
                let mut cores: Vec<u32> = cores.into_iter().take(services).collect();
                while cores.iter().map(|c| (*c).max(1)).sum::<u32>() > n {
                    let max = cores.iter().copied().max().unwrap_or(0);
                    if let Some(c) = cores.iter_mut().find(|c| **c == max) {
                        *c -= 1;
                    }
                }
                let used: u32 = cores.iter().map(|c| (*c).max(1)).sum();
                let p = plan(
                    &names
                        .iter()
                        .zip(&cores)
                        .map(|(n, c)| (n.as_str(), alloc(*c, 0, 1, 100)))
                        .collect::<Vec<_>>(),
                    alloc(n - used, 1, 1, 100),
                );
                let sets = cpu_layout(&p, &specs, &cpus);
                proptest::prop_assert_eq!(lc_overlap(&sets, &lc_set), None);
                let union: BTreeSet<u32> = sets.values().flat_map(|c| c.0.clone()).collect();
                proptest::prop_assert_eq!(union, cpus.iter().copied().collect::<BTreeSet<u32>>());
                let pool = &sets[BEST_EFFORT_GROUP];
                let lc_cpus: usize = names.iter().map(|n| sets[n].0.len()).sum();
                proptest::prop_assert_eq!(lc_cpus, used as usize, "each gets what it asked");
                if used < n {
                    proptest::prop_assert!(names.iter().all(|s| !sets[s].overlaps(pool)));
                }
                if let Some(before) = previous.replace(sets.clone()) {
                    let mut now = before.clone();
                    for (g, c) in cpu_steps(&before, &sets, &lc_set) {
                        now.insert(g, c);
                        proptest::prop_assert_eq!(lc_overlap(&now, &lc_set), None, "{:?} → {:?}", before, sets);
                    }
                    proptest::prop_assert_eq!(now, sets);
                }
            }
        }
    }
}
