//! How far a group's allocation reaches its processes, resource by resource.
//!
//! Problem: a plan says "memcached cores: 1 → 2", but whether any of memcached's processes
//! feels it depends on where they are (a bare process in a cgroup v1 root cannot be
//! narrowed in place) and on what the host offers (no resctrl, no cache ways). A daemon that
//! logs the plan as if it happened tells the operator something false (issue 48).
//!
//! Approach: one pure rule, [`service_control`], from what placement decided for the
//! service's processes ([`ServicePlacement`]) and what the host lets cohabit write
//! ([`HostControls`]) to a [`Control`] per resource the service is allocated. `cohabit
//! check` prints it, the decision log records it per plan group ([`merge`] folds the
//! best-effort jobs into the pool), and `cohabit run` refuses to start when a service with
//! processes would get [`Control::Unmanaged`] for every resource ([`uncontrolled`]),
//! unless its table says `allow_unmanaged = true`.
//!
//! Properties: a resource is `InPlace` or `Moved` only if every found process gets the
//! values; `Partial` when some do; `Unmanaged` (with the reason) when none does. A service
//! without processes is `Unmanaged` ("no process found") but never refused: it may start
//! later.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use cohabit_core::{Control, GroupControl, Resource};
use serde::Serialize;

use super::placement::{Decision, ProcessPlacement, ServicePlacement};

/// Why a resource reaches none of a service's processes because none was found.
pub const NO_PROCESS: &str = "no process found";

/// What the host lets cohabit write at all, whatever the processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostControls {
    /// The cpuset or the cpu controller is written.
    pub cgroups: bool,
    /// resctrl allocates L3 cache ways.
    pub llc: bool,
    /// resctrl allocates memory bandwidth.
    pub mba: bool,
}

impl HostControls {
    /// From the host's facts; `cgroups` is whether cohabit holds writable cgroup
    /// hierarchies.
    pub fn of(facts: &super::HostFacts, cgroups: bool) -> Self {
        let rdt = facts.resctrl.as_ref();
        Self {
            cgroups: cgroups && (facts.can_cpuset || facts.can_quota),
            llc: rdt.is_some_and(|r| r.l3.is_some()),
            mba: rdt.is_some_and(|r| r.mba.is_some()),
        }
    }
}

/// Each resource a service is allocated (the GPU share only where it has one: `gpu` is
/// `Some(managed)`), and how it reaches the service's `pids` given where `placement` puts
/// them.
pub fn service_control(
    pids: &BTreeSet<u32>,
    placement: &ServicePlacement,
    host: HostControls,
    gpu: Option<bool>,
) -> BTreeMap<Resource, Control> {
    let mut out = BTreeMap::new();
    out.insert(Resource::Cores, cores(pids, placement, host.cgroups));
    out.insert(
        Resource::LlcWays,
        resctrl(
            pids,
            host.llc,
            "the host has no resctrl cache allocation (L3 CAT)",
        ),
    );
    out.insert(
        Resource::Mba,
        resctrl(
            pids,
            host.mba,
            "the host has no resctrl memory bandwidth allocation (MBA)",
        ),
    );
    if let Some(managed) = gpu {
        out.insert(
            Resource::GpuShare,
            if managed {
                Control::InPlace
            } else {
                unmanaged("no MPS control daemon publishes this client's GPU share")
            },
        );
    }
    out
}

fn unmanaged(why: &str) -> Control {
    Control::Unmanaged { why: why.into() }
}

/// CPU sets and quotas: written in the processes' cgroups, or cohabit's own after a move.
fn cores(pids: &BTreeSet<u32>, placement: &ServicePlacement, writable: bool) -> Control {
    if !writable {
        return unmanaged("cohabit writes neither the cpuset nor the cpu controller on this host");
    }
    if pids.is_empty() || (placement.targets.is_empty() && placement.left.is_empty()) {
        return unmanaged(NO_PROCESS);
    }
    // Controllers left for the same reason are named together, the reason once.
    let mut reasons: Vec<(Vec<&str>, &str)> = Vec::new();
    for (c, why) in &placement.left {
        match reasons.iter_mut().find(|(_, w)| *w == why.as_str()) {
            Some((cs, _)) => cs.push(c.name()),
            None => reasons.push((vec![c.name()], why)),
        }
    }
    let why = reasons
        .iter()
        .map(|(cs, why)| format!("{}: {why}", cs.join(", ")))
        .collect::<Vec<_>>()
        .join("; ");
    if placement.targets.is_empty() {
        Control::Unmanaged { why }
    } else if !placement.left.is_empty() {
        Control::Partial { why }
    } else if placement.targets.iter().any(|t| t.own) || !placement.moves.is_empty() {
        Control::Moved
    } else {
        Control::InPlace
    }
}

/// Cache ways and memory bandwidth: the threads join cohabit's resctrl control group of
/// the plan group, wherever their cgroups are.
fn resctrl(pids: &BTreeSet<u32>, available: bool, missing: &str) -> Control {
    if !available {
        unmanaged(missing)
    } else if pids.is_empty() {
        unmanaged(NO_PROCESS)
    } else {
        Control::Moved
    }
}

/// One plan group's control from its members' (a latency-critical service alone; the
/// pool's jobs together). Members without processes count only when no member has any.
pub fn merge<'a>(members: impl IntoIterator<Item = (&'a str, &'a GroupControl)>) -> GroupControl {
    let members: Vec<(&str, &GroupControl)> = members.into_iter().collect();
    let found: Vec<(&str, &GroupControl)> = members
        .iter()
        .copied()
        .filter(|(_, m)| !m.pids.is_empty())
        .collect();
    let members = if found.is_empty() { members } else { found };
    if let [(_, only)] = members.as_slice() {
        return (*only).clone();
    }
    let mut out = GroupControl::default();
    for (_, m) in &members {
        out.pids.extend(&m.pids);
    }
    let resources: BTreeSet<Resource> = members
        .iter()
        .flat_map(|(_, m)| m.resources.keys().copied())
        .collect();
    for r in resources {
        let each: Vec<(&str, &Control)> = members
            .iter()
            .filter_map(|(n, m)| Some((*n, m.resources.get(&r)?)))
            .collect();
        out.resources.insert(r, merge_one(&each));
    }
    out
}

fn merge_one(each: &[(&str, &Control)]) -> Control {
    let why: Vec<String> = each
        .iter()
        .filter_map(|(n, c)| match c {
            Control::Partial { why } | Control::Unmanaged { why } => Some(format!("{n}: {why}")),
            _ => None,
        })
        .collect();
    let why = why.join("; ");
    if each.iter().all(|(_, c)| c.unmanaged().is_some()) {
        Control::Unmanaged { why }
    } else if !why.is_empty() {
        Control::Partial { why }
    } else if each.iter().any(|(_, c)| matches!(c, Control::Moved)) {
        Control::Moved
    } else {
        Control::InPlace
    }
}

/// Why a service whose processes were found would be controlled in no way: every resource
/// it is allocated is unmanaged (`None` when one reaches a process, or none was found).
pub fn uncontrolled(control: &GroupControl) -> Option<String> {
    if control.pids.is_empty() || control.resources.is_empty() {
        return None;
    }
    let mut why = Vec::new();
    for (r, c) in &control.resources {
        why.push(format!("{r}: {}", c.unmanaged()?));
    }
    Some(why.join("; "))
}

/// Services that `cohabit run` would start without controlling them in any way.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", render(.services))]
pub struct Uncontrolled {
    /// Each such service, and why each of its resources reaches none of its processes.
    pub services: Vec<(String, String)>,
}

fn render(services: &[(String, String)]) -> String {
    let each: Vec<String> = services
        .iter()
        .map(|(s, why)| {
            format!("service {s} would run unmanaged for every resource it is allocated ({why})")
        })
        .collect();
    format!(
        "{}; cohabit would log plans for it that change nothing. Set placement = \"move\" (or start it in a cgroup of its own), or set allow_unmanaged = true in its table if watching it is all you want; `cohabit check --config FILE` shows what run would do",
        each.join("; ")
    )
}

/// One configured service or job as `cohabit check` shows it: what `run` would do.
#[derive(Debug, Clone, Serialize)]
pub struct Survey {
    /// Its name.
    pub name: String,
    /// Its plan group (its own name, or `best-effort`).
    pub group: String,
    /// It has a p99 target.
    pub latency_critical: bool,
    /// `allow_unmanaged = true`.
    pub allow_unmanaged: bool,
    /// The processes its matcher finds now.
    pub processes: Vec<SurveyedProcess>,
    /// How each resource it is allocated would reach them.
    pub control: GroupControl,
    /// Why `run` would refuse to start with it (`None`: it would not).
    pub refused: Option<String>,
}

/// One matched process and what would be done in each cgroup hierarchy cohabit writes.
#[derive(Debug, Clone, Serialize)]
pub struct SurveyedProcess {
    /// Its pid.
    pub pid: u32,
    /// Its name (`comm`), if it could be read.
    pub comm: Option<String>,
    /// Per controller, its cgroup and what would be done there.
    pub cgroups: Vec<CgroupPlan>,
}

impl SurveyedProcess {
    /// A process `pid` named `comm`, with placement's decisions for it.
    pub fn new(pid: u32, comm: Option<String>, decisions: Vec<ProcessPlacement>) -> Self {
        let cgroups = decisions
            .into_iter()
            .map(|p| CgroupPlan {
                controller: p.controller.name().to_string(),
                cgroup: p.home,
                action: match p.decision {
                    Decision::Write(dir) => CgroupAction::Write { at: dir },
                    Decision::Move { to, .. } => CgroupAction::Move { to },
                    Decision::Leave(why) => CgroupAction::Leave { why },
                },
            })
            .collect();
        Self { pid, comm, cgroups }
    }
}

/// A process's cgroup in one controller's hierarchy, and what would be done there.
#[derive(Debug, Clone, Serialize)]
pub struct CgroupPlan {
    /// The controller (`cpuset`, `cpu`).
    pub controller: String,
    /// The process's cgroup (`None`: it could not be followed).
    pub cgroup: Option<PathBuf>,
    /// What would be done.
    #[serde(flatten)]
    pub action: CgroupAction,
}

/// What would be done with one process in one hierarchy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum CgroupAction {
    /// The values are written in this cgroup, where it is.
    Write {
        /// The cgroup.
        at: PathBuf,
    },
    /// It is moved into cohabit's group, where the values are written.
    Move {
        /// cohabit's group.
        to: PathBuf,
    },
    /// It is left alone.
    Leave {
        /// Why.
        why: String,
    },
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use cohabit_collectors::cgroup::Controller;

    use super::*;
    use crate::placement::Target;

    const ROOT: &str = "it is in the hierarchy's root, whose CPU controls cannot be narrowed; set placement = \"move\" to move it into cohabit's own group";

    fn bare() -> ServicePlacement {
        ServicePlacement {
            left: [
                (Controller::Cpuset, ROOT.into()),
                (Controller::Cpu, ROOT.into()),
            ]
            .into(),
            ..ServicePlacement::default()
        }
    }

    fn at(dir: &str, own: bool) -> ServicePlacement {
        ServicePlacement {
            targets: [Controller::Cpuset, Controller::Cpu]
                .into_iter()
                .map(|controller| Target {
                    controller,
                    dir: PathBuf::from(dir),
                    own,
                })
                .collect(),
            ..ServicePlacement::default()
        }
    }

    const NO_RDT: HostControls = HostControls {
        cgroups: true,
        llc: false,
        mba: false,
    };

    fn group(pids: &[u32], p: &ServicePlacement, host: HostControls) -> GroupControl {
        let pids: BTreeSet<u32> = pids.iter().copied().collect();
        GroupControl {
            resources: service_control(&pids, p, host, None),
            pids,
        }
    }

    #[test]
    fn a_bare_process_in_place_without_rdt_is_unmanaged_for_every_resource_and_refused() {
        let g = group(&[42], &bare(), NO_RDT);
        let cores = g.resources[&Resource::Cores].unmanaged().unwrap();
        assert!(
            cores.starts_with("cpuset, cpu: it is in the hierarchy's root")
                && cores.matches(ROOT).count() == 1,
            "one reason, said once: {cores}"
        );
        assert!(g.resources[&Resource::LlcWays]
            .unmanaged()
            .unwrap()
            .contains("L3 CAT"));
        let why = uncontrolled(&g).expect("refused");
        assert!(
            why.contains("cores: cpuset, cpu: it is in the hierarchy's root")
                && why.contains("mba: "),
            "{why}"
        );
        let e = Uncontrolled {
            services: vec![("memcached".into(), why)],
        };
        let text = e.to_string();
        assert!(
            text.starts_with("service memcached would run unmanaged")
                && text.contains("allow_unmanaged = true")
                && text.contains("placement = \"move\""),
            "{text}"
        );
    }

    #[test]
    fn rdt_reaches_a_bare_process_so_it_is_not_refused() {
        let host = HostControls {
            cgroups: true,
            llc: true,
            mba: false,
        };
        let g = group(&[42], &bare(), host);
        assert_eq!(g.resources[&Resource::LlcWays], Control::Moved);
        assert!(g.resources[&Resource::Cores].unmanaged().is_some());
        assert_eq!(uncontrolled(&g), None);
    }

    #[test]
    fn owners_cgroups_are_in_place_cohabits_own_are_moved_and_a_mix_is_partial() {
        let g = group(&[1], &at("/sys/fs/cgroup/cpuset/docker/x", false), NO_RDT);
        assert_eq!(g.resources[&Resource::Cores], Control::InPlace);
        let g = group(
            &[1],
            &at("/sys/fs/cgroup/cpuset/cohabit/lc-kv", true),
            NO_RDT,
        );
        assert_eq!(g.resources[&Resource::Cores], Control::Moved);
        let mut mixed = at("/sys/fs/cgroup/cpuset/docker/x", false);
        mixed.left.insert(Controller::Cpu, ROOT.into());
        let g = group(&[1, 2], &mixed, NO_RDT);
        assert!(
            matches!(&g.resources[&Resource::Cores], Control::Partial { why } if why.starts_with("cpu: "))
        );
        assert_eq!(uncontrolled(&g), None);
    }

    #[test]
    fn a_service_without_processes_is_unmanaged_but_never_refused() {
        let g = group(&[], &ServicePlacement::default(), NO_RDT);
        assert_eq!(g.resources[&Resource::Cores].unmanaged(), Some(NO_PROCESS));
        assert_eq!(uncontrolled(&g), None);
    }

    #[test]
    fn without_writable_cgroups_cores_are_unmanaged_and_a_gpu_share_still_counts() {
        let host = HostControls {
            cgroups: false,
            llc: false,
            mba: false,
        };
        let pids: BTreeSet<u32> = [7].into();
        let g = GroupControl {
            resources: service_control(&pids, &ServicePlacement::default(), host, Some(true)),
            pids,
        };
        assert!(g.resources[&Resource::Cores]
            .unmanaged()
            .unwrap()
            .contains("neither"));
        assert_eq!(g.resources[&Resource::GpuShare], Control::InPlace);
        assert_eq!(uncontrolled(&g), None, "the GPU share reaches it");
    }

    #[test]
    fn the_pool_is_unmanaged_only_when_every_job_with_processes_is() {
        let bare_job = group(&[10], &bare(), NO_RDT);
        let owned = group(&[11], &at("/sys/fs/cgroup/cpuset/batch", false), NO_RDT);
        let idle = group(&[], &ServicePlacement::default(), NO_RDT);
        let pool = merge([("a", &bare_job), ("b", &owned), ("c", &idle)]);
        assert_eq!(pool.pids, [10, 11].into());
        match &pool.resources[&Resource::Cores] {
            Control::Partial { why } => assert!(
                why.starts_with("a: cpuset, cpu: ") && !why.contains("c: "),
                "{why}"
            ),
            other => panic!("{other:?}"),
        }
        let pool = merge([("a", &bare_job), ("c", &idle)]);
        assert_eq!(pool, bare_job, "a job without processes does not count");
        assert!(uncontrolled(&pool).is_some());
        let pool = merge([("c", &idle)]);
        assert_eq!(
            pool.resources[&Resource::Cores].unmanaged(),
            Some(NO_PROCESS)
        );
    }
}
