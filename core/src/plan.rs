use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Allocation, CoreError, HostCapacity, Resource, ServiceSpec, WayRange};

/// One resctrl group a plan needs ([`Plan::resctrl_classes`]): the cache ways and memory
/// bandwidth its members share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResctrlClass<'a> {
    /// The LLC ways.
    pub llc_ways: WayRange,
    /// The MBA percentage.
    pub mba_pct: u8,
    /// The plan groups in it: services, then the pool, in [`Plan::groups`] order.
    pub members: Vec<&'a str>,
}

/// The desired allocation of a whole host: one [`Allocation`] per latency-critical service,
/// and one shared pool for all best-effort jobs (one resctrl group, one cpuset).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Latency-critical services by name.
    pub services: BTreeMap<String, Allocation>,
    /// The best-effort pool: its cores are shared by every best-effort job.
    pub best_effort: Allocation,
    /// Pinned device-memory limit of each GPU client (latency-critical services and
    /// best-effort jobs) by name, MiB: what the MPS client may allocate on its GPU from its
    /// next start (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`). Planned by the control loop from the
    /// clients' measured use (`cohabit_policy::gpu_memory`); empty where no GPU client's
    /// memory was measured (the simulator models none).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_memory_mib: BTreeMap<String, u64>,
}

/// One resource of one group that differs between two plans.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// Service name, or `best-effort` for the pool.
    pub group: String,
    /// Which resource changed.
    pub resource: Resource,
    /// The old value as an operator reads it (`4`, `0-3`, `70%`).
    pub from: String,
    /// The new value.
    pub to: String,
}

/// The group name of the best-effort pool in changes and logs.
pub const BEST_EFFORT_GROUP: &str = "best-effort";

impl Plan {
    /// The allocation of a group by name (`best-effort` for the pool).
    pub fn get(&self, group: &str) -> Option<&Allocation> {
        if group == BEST_EFFORT_GROUP {
            Some(&self.best_effort)
        } else {
            self.services.get(group)
        }
    }

    /// Each group with its allocation, latency-critical services first, the pool last.
    pub fn groups(&self) -> impl Iterator<Item = (&str, &Allocation)> {
        self.services
            .iter()
            .map(|(k, v)| (k.as_str(), v))
            .chain(std::iter::once((BEST_EFFORT_GROUP, &self.best_effort)))
    }

    /// Resource by resource, what `next` changes relative to `self`. A group present in only
    /// one of the plans shows every resource as changed.
    pub fn diff(&self, next: &Plan) -> Vec<Change> {
        let mut out = Vec::new();
        for (group, new) in next.groups() {
            let old = self.get(group);
            for r in Resource::ALL {
                let changed = match old {
                    Some(old) => match r {
                        Resource::Cores => old.cores != new.cores,
                        Resource::LlcWays => old.llc_ways != new.llc_ways,
                        Resource::Mba => old.mba_pct != new.mba_pct,
                        Resource::GpuShare => old.gpu_mps_pct != new.gpu_mps_pct,
                    },
                    None => r != Resource::GpuShare || new.gpu_mps_pct.is_some(),
                };
                if changed {
                    out.push(Change {
                        group: group.to_string(),
                        resource: r,
                        from: old.map_or_else(|| "none".into(), |o| o.describe(r)),
                        to: new.describe(r),
                    });
                }
            }
        }
        out
    }

    /// The resctrl groups the plan needs, each with its members (services, then the pool,
    /// in [`Self::groups`] order), ordered by way range (first way, then count) and MBA.
    ///
    /// Rule (the one place it is written; the real host's layout and the simulator use it):
    /// every group of the plan, the best-effort pool included, is placed in a resctrl group
    /// of its own unless another has the same LLC way range and MBA percentage; groups with
    /// equal (way range, MBA) share one group, and so one CLOSID. Cores and GPU shares do
    /// not matter (they are not resctrl resources). The pool never uses the default (root)
    /// group: the root keeps every task cohabit does not manage, so a plan may use
    /// `host.groups_available()` groups, `closids - 1`.
    pub fn resctrl_classes(&self) -> Vec<ResctrlClass<'_>> {
        let mut by_class: BTreeMap<(u32, u32, u8), Vec<&str>> = BTreeMap::new();
        for (group, a) in self.groups() {
            by_class
                .entry((a.llc_ways.first, a.llc_ways.count, a.mba_pct))
                .or_default()
                .push(group);
        }
        by_class
            .into_iter()
            .map(|((first, count, mba_pct), members)| ResctrlClass {
                llc_ways: WayRange::new(first, count),
                mba_pct,
                members,
            })
            .collect()
    }

    /// How many resctrl groups (CLOSIDs besides the default one) the plan needs; see
    /// [`Self::resctrl_classes`] for the rule.
    pub fn resctrl_groups(&self) -> usize {
        self.resctrl_classes().len()
    }

    /// Checks that the plan needs no more resctrl groups than the host's CLOSIDs allow
    /// (`closids - 1`; the kernel refuses the next group with `ENOSPC`).
    pub fn validate_closids(&self, host: &HostCapacity) -> Result<(), CoreError> {
        let needed = self.resctrl_groups();
        let available = host.groups_available();
        if needed > available as usize {
            return Err(CoreError::invalid(
                "plan.resctrl_groups",
                format!(
                    "needs {needed} resctrl groups (one per distinct way range and MBA) but \
                     the host has {} CLOSIDs: {available} besides the default group",
                    host.closids
                ),
            ));
        }
        Ok(())
    }

    /// Checks that the plan fits the host: every allocation valid, one allocation per
    /// latency-critical service, cores not oversubscribed, GPU shares on real GPUs, no more
    /// resctrl groups than the host's CLOSIDs allow.
    pub fn validate(&self, host: &HostCapacity, specs: &[ServiceSpec]) -> Result<(), CoreError> {
        for spec in specs.iter().filter(|s| s.is_latency_critical()) {
            let alloc = self.services.get(&spec.name).ok_or_else(|| {
                CoreError::invalid(format!("plan.{}", spec.name), "has no allocation")
            })?;
            if alloc.cores == 0 {
                return Err(CoreError::invalid(
                    format!("plan.{}.cores", spec.name),
                    "a latency-critical service needs at least one core",
                ));
            }
            if let (Some(gpu), Some(_)) = (spec.gpu, alloc.gpu_mps_pct) {
                if gpu as usize >= host.gpus.len() {
                    return Err(CoreError::invalid(
                        format!("plan.{}.gpu_mps_pct", spec.name),
                        format!("GPU {gpu} does not exist (host has {})", host.gpus.len()),
                    ));
                }
            }
        }
        for name in self.services.keys() {
            if !specs
                .iter()
                .any(|s| &s.name == name && s.is_latency_critical())
            {
                return Err(CoreError::invalid(
                    format!("plan.{name}"),
                    "is not a configured latency-critical service",
                ));
            }
        }
        for (group, alloc) in self.groups() {
            alloc.validate(host, &format!("plan.{group}"))?;
        }
        let used: u32 = self.groups().map(|(_, a)| a.cores).sum();
        if used > host.cores {
            return Err(CoreError::invalid(
                "plan.cores",
                format!("{used} cores allocated but the host has {}", host.cores),
            ));
        }
        self.validate_closids(host)
    }

    /// Cores left for best effort when the latency-critical services have theirs.
    pub fn lc_cores(&self) -> u32 {
        self.services.values().map(|a| a.cores).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ServiceClass, WayRange};

    fn host() -> HostCapacity {
        HostCapacity {
            name: "t".into(),
            cores: 8,
            freq_ghz: 2.0,
            llc_ways: 8,
            llc_way_bytes: 1 << 20,
            mem_bw_bytes_per_s: 1e10,
            gpus: vec![],
            closids: 16,
            mba_min_pct: 10,
            mba_gran_pct: 10,
            min_cbm_bits: 1,
            shareable_bits: 0,
        }
    }

    fn alloc(cores: u32, first: u32, ways: u32) -> Allocation {
        Allocation {
            cores,
            llc_ways: WayRange::new(first, ways),
            mba_pct: 100,
            gpu_mps_pct: None,
        }
    }

    fn lc(name: &str) -> ServiceSpec {
        ServiceSpec {
            name: name.into(),
            class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
            gpu: None,
            priority: 0,
        }
    }

    #[test]
    fn diff_lists_only_changed_resources() {
        let a = Plan {
            services: [("a".to_string(), alloc(2, 0, 2))].into(),
            best_effort: alloc(6, 2, 6),
            gpu_memory_mib: Default::default(),
        };
        let mut b = a.clone();
        b.services.get_mut("a").unwrap().cores = 3;
        b.best_effort.cores = 5;
        let d = a.diff(&b);
        assert_eq!(d.len(), 2);
        assert_eq!((d[0].group.as_str(), d[0].resource), ("a", Resource::Cores));
        assert_eq!((d[0].from.as_str(), d[0].to.as_str()), ("2", "3"));
        assert_eq!(d[1].group, BEST_EFFORT_GROUP);
        assert!(a.diff(&a).is_empty());
    }

    #[test]
    fn validate_rejects_oversubscribed_cores_and_missing_services() {
        let specs = [lc("a"), lc("b")];
        let p = Plan {
            services: [
                ("a".to_string(), alloc(4, 0, 2)),
                ("b".to_string(), alloc(4, 2, 2)),
            ]
            .into(),
            best_effort: alloc(1, 4, 4),
            gpu_memory_mib: Default::default(),
        };
        let e = p.validate(&host(), &specs).unwrap_err().to_string();
        assert!(e.contains("9 cores"), "{e}");
        let mut p2 = p.clone();
        p2.services.remove("b");
        p2.best_effort.cores = 0;
        let e = p2.validate(&host(), &specs).unwrap_err().to_string();
        assert!(e.contains("plan.b"), "{e}");
        let mut ok = p;
        ok.best_effort.cores = 0;
        ok.validate(&host(), &specs).unwrap();
    }

    #[test]
    fn equal_way_ranges_and_mba_share_a_resctrl_group_and_the_pool_counts() {
        let mut p = Plan {
            services: [
                ("a".to_string(), alloc(1, 0, 2)),
                ("b".to_string(), alloc(1, 2, 2)),
                ("c".to_string(), alloc(1, 4, 4)),
            ]
            .into(),
            best_effort: alloc(1, 4, 4),
            gpu_memory_mib: Default::default(),
        };
        let members: Vec<Vec<&str>> = p.resctrl_classes().into_iter().map(|c| c.members).collect();
        assert_eq!(
            members,
            vec![vec!["a"], vec!["b"], vec!["c", BEST_EFFORT_GROUP]]
        );
        assert_eq!(
            p.resctrl_classes()[2],
            ResctrlClass {
                llc_ways: WayRange::new(4, 4),
                mba_pct: 100,
                members: vec!["c", BEST_EFFORT_GROUP]
            }
        );
        assert_eq!(p.resctrl_groups(), 3);
        // Same ways, other MBA: a group of its own. Cores and GPU shares do not matter.
        p.services.get_mut("c").unwrap().mba_pct = 50;
        assert_eq!(p.resctrl_groups(), 4);
        p.services.get_mut("c").unwrap().mba_pct = 100;
        p.services.get_mut("c").unwrap().cores = 3;
        assert_eq!(p.resctrl_groups(), 3);
        // Overlapping but unequal ranges are distinct groups.
        p.services.get_mut("b").unwrap().llc_ways = WayRange::new(0, 3);
        assert_eq!(p.resctrl_groups(), 3);
        p.services.get_mut("b").unwrap().llc_ways = WayRange::new(0, 2);
        assert_eq!(p.resctrl_groups(), 2);
    }

    #[test]
    fn validate_rejects_more_groups_than_the_closids_allow_and_names_the_budget() {
        let specs = [lc("a"), lc("b"), lc("c")];
        let p = Plan {
            services: [
                ("a".to_string(), alloc(1, 0, 2)),
                ("b".to_string(), alloc(1, 2, 2)),
                ("c".to_string(), alloc(1, 4, 2)),
            ]
            .into(),
            best_effort: alloc(1, 6, 2),
            gpu_memory_mib: Default::default(),
        };
        let mut h = host();
        h.closids = 5;
        p.validate(&h, &specs).unwrap();
        h.closids = 4;
        let e = p.validate(&h, &specs).unwrap_err().to_string();
        assert!(
            e.contains("plan.resctrl_groups") && e.contains("needs 4") && e.contains("4 CLOSIDs"),
            "{e}"
        );
        assert!(e.contains("3 besides the default"), "{e}");
        // Sharing the pool's ways and MBA brings it back within the budget.
        let mut shared = p;
        shared.services.get_mut("c").unwrap().llc_ways = WayRange::new(6, 2);
        shared.validate(&h, &specs).unwrap();
    }

    #[test]
    fn validate_rejects_ways_beyond_the_host() {
        let p = Plan {
            services: [("a".to_string(), alloc(1, 6, 4))].into(),
            best_effort: alloc(1, 0, 1),
            gpu_memory_mib: Default::default(),
        };
        let e = p.validate(&host(), &[lc("a")]).unwrap_err().to_string();
        assert!(e.contains("plan.a.llc_ways"), "{e}");
    }
}
