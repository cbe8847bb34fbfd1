//! Where a plan group's CPU values are written: for each process of a service and each
//! controller cohabit writes (cpuset, cpu), the cgroup that gets the values.
//!
//! Problem: a process belongs to whoever started it (systemd, a container runtime,
//! kubelet). Moving it into a cgroup of cohabit's takes it out of its unit's memory, pids,
//! device and IO limits, and its owner loses track of it (security review row 5). But some
//! processes (bare ones, in a hierarchy's root) cannot be narrowed where they are.
//!
//! Approach: control the cgroup the process is in ("in place"), and move a process only
//! where that is impossible and the configuration asks for it (`placement = "move"`). The
//! kernel facts come from [`Cgroups::in_place`]; the rule is the pure [`decide`]:
//!
//! | the process's cgroup (per controller) | `in_place` (default) | `move` |
//! |---|---|---|
//! | its owner's, with the controller's files (v1: any but the root; v2: the parent delegates the controller) | write there | write there |
//! | one of cohabit's own groups (moved earlier, or forked there) | write there | write there |
//! | the hierarchy root (v1: a bare process; v2: the root cgroup) | left as it is, logged once | moved to `cohabit/<group>` |
//! | v2: a cgroup whose parent does not delegate the controller | left as it is, logged once | moved to `cohabit/<group>` |
//!
//! Never moved, whatever the configuration: pid 1, kernel threads (no executable), cohabit
//! itself. On v1 a move touches only the cpuset and cpu hierarchies, so the process keeps
//! its memory, pids and other cgroups; on v2 there is one hierarchy, so a move leaves them
//! too, which is why it is never the default. cohabit never enables a controller in a
//! cgroup it did not create (that would change its owner's tree, and below the root it is
//! refused while the cgroup has processes), so a child cgroup under the owner's is never
//! needed: where the owner's cgroup lacks the files, a child of it would lack them too.
//!
//! Properties: a service's processes never leave their owner's cgroups unless configured;
//! every cgroup written is a process's own (or cohabit's); a cgroup claimed by two plan
//! groups (two services matching processes of one cgroup) gets the first group's values
//! (latency-critical before the pool) and a log line.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use cohabit_collectors::cgroup::{Cgroups, Controller, InPlace};
use cohabit_collectors::procfs::Procfs;

use crate::spec::Placement;

/// One cgroup a plan group's values are written to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Target {
    /// The controller whose files are written there.
    pub controller: Controller,
    /// The cgroup directory.
    pub dir: PathBuf,
    /// One of cohabit's own groups (created, and removed on restore, by cohabit).
    pub own: bool,
}

/// Every cgroup each plan group's values are written to.
pub type Targets = BTreeMap<String, BTreeSet<Target>>;

/// What to do with one process in the hierarchy of one controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Write the group's values in this cgroup, where the process is.
    Write(PathBuf),
    /// Move the process from `from` into cohabit's group `to`, and write the values there.
    Move {
        /// Where it is.
        from: PathBuf,
        /// cohabit's group.
        to: PathBuf,
    },
    /// Leave the process and its cgroup alone, for this reason.
    Leave(String),
}

/// The rule of the module doc: `at` is what the kernel allows in `home`, the process's
/// cgroup; `own` cohabit's group for the process's plan group; `movable` whether the process
/// may ever be moved (the reason when not).
pub fn decide(
    at: InPlace,
    home: &Path,
    own: Option<&Path>,
    placement: Placement,
    movable: Result<(), String>,
) -> Decision {
    let why = match at {
        InPlace::Writable => return Decision::Write(home.to_path_buf()),
        InPlace::OwnGroup if own == Some(home) => return Decision::Write(home.to_path_buf()),
        InPlace::OwnGroup => return Decision::Leave("it is in another of cohabit's groups".into()),
        InPlace::HierarchyRoot => "it is in the hierarchy's root, whose CPU controls cannot be narrowed",
        InPlace::NotDelegated => "its cgroup's parent does not delegate the controller, and cohabit does not change its owner's tree",
    };
    match (placement, movable, own) {
        (Placement::Move, Ok(()), Some(to)) => Decision::Move {
            from: home.to_path_buf(),
            to: to.to_path_buf(),
        },
        (Placement::Move, Err(refused), _) => Decision::Leave(format!("{why}; and {refused}")),
        (Placement::Move, Ok(()), None) => {
            Decision::Leave(format!("{why}; and cohabit has no group of its own there"))
        }
        (Placement::InPlace, _, _) => Decision::Leave(format!(
            "{why}; set placement = \"move\" to move it into cohabit's own group"
        )),
    }
}

/// A process to move, with the hierarchies it moves in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    /// The process.
    pub pid: u32,
    /// Its start time (field 22 of `/proc/PID/stat`), which tells a reused pid apart.
    pub start_time: u64,
    /// `(from, to)` per hierarchy.
    pub hops: Vec<(PathBuf, PathBuf)>,
}

/// Where one service's processes get their values.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServicePlacement {
    /// The cgroups its plan group's values go to.
    pub targets: BTreeSet<Target>,
    /// Processes to move first (only with `placement = "move"`).
    pub moves: Vec<Move>,
    /// Controllers for which some process is left alone, and why.
    pub left: BTreeMap<Controller, String>,
}

/// Why a process may never be moved: pid 1, a kernel thread (it has no executable),
/// cohabit itself.
fn movable(procfs: &Procfs, pid: u32, cohabit_pid: u32) -> Result<(), String> {
    if pid == 1 || pid == 2 {
        return Err("pid 1 and kthreadd are never moved".into());
    }
    if pid == cohabit_pid {
        return Err("cohabit never moves itself".into());
    }
    let exe = procfs.root().join(pid.to_string()).join("exe");
    if std::fs::symlink_metadata(&exe).is_err() {
        return Err("kernel threads are never moved".into());
    }
    Ok(())
}

/// One process's cgroup in one controller's hierarchy, and what is done there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessPlacement {
    /// The controller.
    pub controller: Controller,
    /// The process's cgroup in its hierarchy (`None`: it could not be followed).
    pub home: Option<PathBuf>,
    /// What is done.
    pub decision: Decision,
}

/// Decides, for process `pid` and each of `controllers`, where the values of plan group
/// `own_name` (cohabit's group name for it) go; `None` when the process is gone.
pub fn explain(
    cg: &Cgroups,
    procfs: &Procfs,
    pid: u32,
    own_name: &str,
    placement: Placement,
    controllers: &[Controller],
) -> Option<Vec<ProcessPlacement>> {
    let lines = procfs.cgroups(pid)?;
    let me = std::process::id();
    Some(
        controllers
            .iter()
            .map(|&c| {
                let Some(home) = cg.home(c.name(), &lines) else {
                    return ProcessPlacement {
                        controller: c,
                        home: None,
                        decision: Decision::Leave("its cgroup could not be followed".into()),
                    };
                };
                let own = cg.own_dir(c, own_name).ok().flatten();
                let at = cg.in_place(c, &home);
                let decision = decide(
                    at,
                    &home,
                    own.as_deref(),
                    placement,
                    movable(procfs, pid, me),
                );
                ProcessPlacement {
                    controller: c,
                    home: Some(home),
                    decision,
                }
            })
            .collect(),
    )
}

/// Decides, for each of `pids` and each of `controllers`, where the values of plan group
/// `own_name` (cohabit's group name for it) go.
pub fn place(
    cg: &Cgroups,
    procfs: &Procfs,
    pids: &BTreeSet<u32>,
    own_name: &str,
    placement: Placement,
    controllers: &[Controller],
) -> ServicePlacement {
    let mut out = ServicePlacement::default();
    for &pid in pids {
        let Some(stat) = procfs.stat(pid) else {
            continue; // gone meanwhile
        };
        let Some(each) = explain(cg, procfs, pid, own_name, placement, controllers) else {
            continue;
        };
        let mut hops = Vec::new();
        for p in each {
            match p.decision {
                Decision::Write(dir) => {
                    let own = cg.is_own(&dir);
                    out.targets.insert(Target {
                        controller: p.controller,
                        dir,
                        own,
                    });
                }
                Decision::Move { from, to } => {
                    out.targets.insert(Target {
                        controller: p.controller,
                        dir: to.clone(),
                        own: true,
                    });
                    hops.push((from, to));
                }
                Decision::Leave(why) => {
                    out.left.insert(p.controller, why);
                }
            }
        }
        if !hops.is_empty() {
            out.moves.push(Move {
                pid,
                start_time: stat.start_ticks,
                hops,
            });
        }
    }
    out
}

/// The targets of each plan group from its services' placements (given in configuration
/// order, latency-critical first). A cgroup already claimed by an earlier group stays with
/// it; each such conflict is returned as `(cgroup, kept by, wanted by)`.
pub fn group_targets<'a>(
    services: impl IntoIterator<Item = (&'a str, &'a ServicePlacement)>,
) -> (Targets, Vec<(PathBuf, String, String)>) {
    let mut out = Targets::new();
    let mut owner: BTreeMap<PathBuf, String> = BTreeMap::new();
    let mut conflicts = Vec::new();
    for (group, p) in services {
        for t in &p.targets {
            match owner.get(&t.dir) {
                Some(g) if g != group => {
                    conflicts.push((t.dir.clone(), g.clone(), group.to_string()));
                    continue;
                }
                _ => {
                    owner.insert(t.dir.clone(), group.to_string());
                }
            }
            out.entry(group.to_string()).or_default().insert(t.clone());
        }
    }
    (out, conflicts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    #[test]
    fn a_process_in_its_owners_cgroup_is_controlled_there_whatever_the_placement() {
        let home = p("/sys/fs/cgroup/cpuset/docker/abc");
        for placement in [Placement::InPlace, Placement::Move] {
            assert_eq!(
                decide(
                    InPlace::Writable,
                    &home,
                    Some(&p("/own")),
                    placement,
                    Ok(())
                ),
                Decision::Write(home.clone())
            );
        }
        let own = p("/sys/fs/cgroup/cpuset/cohabit/lc-kv");
        assert_eq!(
            decide(
                InPlace::OwnGroup,
                &own,
                Some(&own),
                Placement::InPlace,
                Ok(())
            ),
            Decision::Write(own.clone()),
            "a child forked in cohabit's group stays controlled"
        );
        assert!(matches!(
            decide(
                InPlace::OwnGroup,
                &own,
                Some(&p("/other")),
                Placement::Move,
                Ok(())
            ),
            Decision::Leave(_)
        ));
    }

    #[test]
    fn a_bare_process_moves_only_when_configured_and_allowed() {
        let root = p("/sys/fs/cgroup/cpuset");
        let own = p("/sys/fs/cgroup/cpuset/cohabit/best-effort");
        let Decision::Leave(why) = decide(
            InPlace::HierarchyRoot,
            &root,
            Some(&own),
            Placement::InPlace,
            Ok(()),
        ) else {
            panic!("moved without being asked");
        };
        assert!(why.contains("placement = \"move\""), "{why}");
        assert_eq!(
            decide(
                InPlace::HierarchyRoot,
                &root,
                Some(&own),
                Placement::Move,
                Ok(())
            ),
            Decision::Move {
                from: root.clone(),
                to: own.clone()
            }
        );
        let Decision::Leave(why) = decide(
            InPlace::NotDelegated,
            &p("/sys/fs/cgroup/user.slice/x.scope"),
            Some(&own),
            Placement::Move,
            Err("kernel threads are never moved".into()),
        ) else {
            panic!("a refused process was moved");
        };
        assert!(
            why.contains("does not delegate") && why.contains("kernel threads"),
            "{why}"
        );
        assert!(matches!(
            decide(InPlace::HierarchyRoot, &root, None, Placement::Move, Ok(())),
            Decision::Leave(_)
        ));
    }

    #[test]
    fn a_cgroup_claimed_by_two_groups_stays_with_the_first() {
        let t = |d: &str| Target {
            controller: Controller::Cpuset,
            dir: p(d),
            own: false,
        };
        let kv = ServicePlacement {
            targets: [t("/a"), t("/shared")].into(),
            ..Default::default()
        };
        let batch = ServicePlacement {
            targets: [t("/shared"), t("/b")].into(),
            ..Default::default()
        };
        let kv2 = ServicePlacement {
            targets: [t("/a")].into(),
            ..Default::default()
        };
        let (targets, conflicts) =
            group_targets([("kv", &kv), ("kv", &kv2), ("best-effort", &batch)]);
        assert_eq!(targets["kv"], [t("/a"), t("/shared")].into());
        assert_eq!(targets["best-effort"], [t("/b")].into());
        assert_eq!(
            conflicts,
            vec![(p("/shared"), "kv".into(), "best-effort".into())]
        );
    }
}
