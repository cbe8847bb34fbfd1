//! Helpers for tests of the host and of what drives it (`testutils`): specs with the
//! defaults the daemon's configuration gives a key it does not find, and network peers that
//! misbehave.

use std::path::Path;

use cohabit_collectors::latency::PushAddr;
use cohabit_collectors::users::UserRef;
use cohabit_collectors::HostPaths;

use crate::spec::{
    BestEffortCpus, HostSpec, LatencySource, ManagedService, Matcher, MpsSpec, Placement,
    ProcessConstraint, PushAccess, UnmanagedCache,
};

/// A host with its kernel interfaces at `paths` and these services.
pub fn host(paths: HostPaths, services: Vec<ManagedService>) -> HostSpec {
    HostSpec {
        host_name: "this host".into(),
        paths,
        cpus: None,
        mem_bw_gbps: None,
        gpus: None,
        unmanaged_cache: UnmanagedCache::default(),
        best_effort_cpus: BestEffortCpus::default(),
        mps: MpsSpec {
            control: "/usr/bin/nvidia-cuda-mps-control".into(),
            pipe_dir: None,
            pinned_mem_limit: None,
        },
        pods: false,
        collect_timeout_ms: 500,
        latency_window: 3,
        services,
    }
}

/// The standard paths, but resctrl and procfs at these (a fake's).
pub fn paths(resctrl: &Path, proc: &Path) -> HostPaths {
    HostPaths {
        proc: proc.into(),
        resctrl: Some(resctrl.into()),
        ..HostPaths::standard()
    }
}

/// A latency-critical service with a target of `p99_target_ms`, its processes found by
/// `matcher` among root's.
pub fn latency_critical(
    name: &str,
    p99_target_ms: f64,
    matcher: Matcher,
    latency: LatencySource,
) -> ManagedService {
    ManagedService {
        p99_target_ms: Some(p99_target_ms),
        latency: Some(latency),
        ..best_effort(name, matcher)
    }
}

/// A best-effort job, its processes found by `matcher` among root's.
pub fn best_effort(name: &str, matcher: Matcher) -> ManagedService {
    ManagedService {
        name: name.into(),
        p99_target_ms: None,
        matcher,
        constraint: ProcessConstraint {
            user: Some(UserRef::Id(0)),
            exe: None,
        },
        placement: Placement::default(),
        allow_unmanaged: false,
        latency: None,
        gpu: None,
        priority: 0,
    }
}

/// Samples pushed to a loopback UDP port the kernel picks.
pub fn udp_push() -> LatencySource {
    LatencySource::Push {
        addr: PushAddr::Udp("127.0.0.1:0".parse().expect("an address")),
        access: PushAccess::default(),
    }
}

/// A TCP endpoint that accepts every connection and never answers or closes.
pub fn mute_endpoint() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in l.incoming() {
            match s {
                Ok(s) => held.push(s),
                Err(_) => return,
            }
        }
    });
    port
}

/// Processes of group `pgid` running now (not zombies), from this machine's `/proc`.
pub fn running(pgid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // After the ")" that ends comm: state, ppid, pgrp.
            let rest: Vec<&str> = stat
                .rsplit_once(')')
                .map(|(_, r)| r.split_whitespace().collect())
                .unwrap_or_default();
            rest.len() > 2 && rest[0] != "Z" && rest[2] == pgid.to_string()
        })
        .collect()
}
