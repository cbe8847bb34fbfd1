//! `[[service]]` and `[[best_effort]]`: what each managed service or job is, how its
//! processes are found (`match`) and how its CPU controls are applied (`placement`), and
//! the checks across services (names, and nothing two of them would fight over).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use cohabit_collectors::latency::PushAddr;
use cohabit_collectors::users::{GroupRef, UserRef};
use serde::Deserialize;

use cohabit_host::spec::{
    GpuClient, LatencySource, ManagedService, Matcher, Placement, ProcessConstraint,
};

use super::error::ConfigError;
use super::gpu::GpuFile;
use super::latency::LatencyFile;

/// A `[[service]]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ServiceFile {
    name: String,
    p99_target_ms: f64,
    #[serde(rename = "match")]
    matcher: MatchFile,
    #[serde(default)]
    placement: Placement,
    #[serde(default)]
    allow_unmanaged: bool,
    latency: LatencyFile,
    gpu: Option<GpuFile>,
    #[serde(default)]
    priority: i64,
}

/// A `[[best_effort]]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct BestEffortFile {
    name: String,
    #[serde(rename = "match")]
    matcher: MatchFile,
    #[serde(default)]
    placement: Placement,
    #[serde(default)]
    allow_unmanaged: bool,
    gpu: Option<GpuFile>,
}

/// `match = { … }` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MatchFile {
    process_name: Option<String>,
    cgroup: Option<String>,
    systemd_unit: Option<String>,
    pid_file: Option<PathBuf>,
    user: Option<IdFile>,
    exe: Option<PathBuf>,
}

/// A user or group as written: a name or a number.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum IdFile {
    Id(i64),
    Name(String),
}

impl TryFrom<ServiceFile> for ManagedService {
    type Error = ConfigError;

    /// A latency-critical service; errors name fields within it, and it by name.
    fn try_from(s: ServiceFile) -> Result<Self, ConfigError> {
        let named = |e: ConfigError| e.in_item(&s.name);
        if !(s.p99_target_ms.is_finite() && s.p99_target_ms > 0.0) {
            return Err(named(ConfigError::invalid(
                "p99_target_ms",
                format!("must be a positive number, got {}", s.p99_target_ms),
            )));
        }
        let priority = i32::try_from(s.priority)
            .ok()
            .filter(|p| (-1000..=1000).contains(p))
            .ok_or_else(|| {
                named(ConfigError::range(
                    "priority",
                    Some(-1000.0),
                    Some(1000.0),
                    s.priority as f64,
                ))
            })?;
        let latency =
            LatencySource::try_from(&s.latency).map_err(|e| named(e.within("latency")))?;
        let mut service = common(&s.name, &s.matcher, s.gpu.as_ref()).map_err(named)?;
        service.placement = s.placement;
        service.allow_unmanaged = s.allow_unmanaged;
        service.latency = Some(latency);
        service.p99_target_ms = Some(s.p99_target_ms);
        service.priority = priority;
        Ok(service)
    }
}

impl TryFrom<BestEffortFile> for ManagedService {
    type Error = ConfigError;

    /// A best-effort job; errors name fields within it, and it by name.
    fn try_from(b: BestEffortFile) -> Result<Self, ConfigError> {
        let mut job =
            common(&b.name, &b.matcher, b.gpu.as_ref()).map_err(|e| e.in_item(&b.name))?;
        job.placement = b.placement;
        job.allow_unmanaged = b.allow_unmanaged;
        Ok(job)
    }
}

/// What a service and a job share: the name, `match` and `gpu` (without latency, target or
/// priority, in place, not allowed unmanaged).
fn common(name: &str, m: &MatchFile, gpu: Option<&GpuFile>) -> Result<ManagedService, ConfigError> {
    let matcher = matcher(m).map_err(|e| e.within("match"))?;
    check_matcher(&matcher).map_err(|e| e.within("match"))?;
    Ok(ManagedService {
        name: name.to_string(),
        p99_target_ms: None,
        matcher,
        constraint: constraint(m).map_err(|e| e.within("match"))?,
        placement: Placement::InPlace,
        allow_unmanaged: false,
        latency: None,
        gpu: gpu
            .map(GpuClient::try_from)
            .transpose()
            .map_err(|e| e.within("gpu"))?,
        priority: 0,
    })
}

/// The TOML path of the `i`th of `services`, the `[[service]]`s (`latency_critical` of
/// them) then the `[[best_effort]]`s.
pub(super) fn item_field(i: usize, latency_critical: usize) -> String {
    match i.checked_sub(latency_critical) {
        None => format!("service[{i}]"),
        Some(j) => format!("best_effort[{j}]"),
    }
}

/// Every name is a valid service name, none is the pool's, and none is used twice
/// (`services`: the `[[service]]`s, `latency_critical` of them, then the `[[best_effort]]`s).
pub(super) fn check_names(
    services: &[ManagedService],
    latency_critical: usize,
) -> Result<(), ConfigError> {
    let mut seen = BTreeSet::new();
    for (i, s) in services.iter().enumerate() {
        let at = |e: ConfigError| e.within(&item_field(i, latency_critical));
        let name = &s.name;
        cohabit_core::name::check_service_name(name).map_err(|e| {
            at(ConfigError::invalid(
                "name",
                format!(
                    "is not a service name: {e} (a name is 1-{} characters of [A-Za-z0-9._-])",
                    cohabit_core::name::SERVICE_NAME_MAX
                ),
            ))
        })?;
        if name == cohabit_core::BEST_EFFORT_GROUP {
            return Err(at(ConfigError::invalid(
                "name",
                format!("{name:?} is reserved for the best-effort pool"),
            )));
        }
        if !seen.insert(name.clone()) {
            return Err(at(ConfigError::conflict(
                "name",
                format!("{name:?} is used twice"),
            )));
        }
    }
    Ok(())
}

/// The matcher of `match`: exactly one of its keys. Errors name fields within `match`.
fn matcher(m: &MatchFile) -> Result<Matcher, ConfigError> {
    let mut found = Vec::new();
    if let Some(n) = &m.process_name {
        found.push(Matcher::ProcessName(n.clone()));
    }
    if let Some(c) = &m.cgroup {
        found.push(Matcher::Cgroup(c.clone()));
    }
    if let Some(u) = &m.systemd_unit {
        if u.contains('/') {
            return Err(ConfigError::invalid(
                "systemd_unit",
                format!("{u:?} must be a unit name, not a path"),
            ));
        }
        found.push(Matcher::SystemdUnit(u.clone()));
    }
    if let Some(p) = &m.pid_file {
        found.push(Matcher::PidFile(p.clone()));
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(ConfigError::missing(
            "",
            "needs one of process_name, cgroup, systemd_unit, pid_file",
        )),
        _ => Err(ConfigError::conflict(
            "",
            "must have exactly one of process_name, cgroup, systemd_unit, pid_file",
        )),
    }
}

/// A user as written, at `field`: a name, or a uid.
pub(super) fn user_ref(field: &str, v: &IdFile) -> Result<UserRef, ConfigError> {
    id_ref(field, v, "a user name or a uid", UserRef::Id, UserRef::Name)
}

/// A group as written, at `field`: a name, or a gid.
pub(super) fn group_ref(field: &str, v: &IdFile) -> Result<GroupRef, ConfigError> {
    id_ref(
        field,
        v,
        "a group name or a gid",
        GroupRef::Id,
        GroupRef::Name,
    )
}

/// A user or group as written: `by_id` of a number that fits a u32, `by_name` of a name that
/// is not empty; `what` names both forms in the error.
fn id_ref<T>(
    field: &str,
    v: &IdFile,
    what: &str,
    by_id: fn(u32) -> T,
    by_name: fn(String) -> T,
) -> Result<T, ConfigError> {
    match v {
        IdFile::Id(id) => u32::try_from(*id)
            .map(by_id)
            .map_err(|_| ConfigError::invalid(field, format!("must be {what} >= 0, got {id}"))),
        IdFile::Name(n) if !n.is_empty() => Ok(by_name(n.clone())),
        IdFile::Name(_) => Err(ConfigError::invalid(field, "must not be empty")),
    }
}

/// `match.user` and `match.exe`. Errors name fields within `match`.
fn constraint(m: &MatchFile) -> Result<ProcessConstraint, ConfigError> {
    if let Some(exe) = m.exe.as_ref().filter(|e| !e.is_absolute()) {
        return Err(ConfigError::invalid(
            "exe",
            format!("{} must be an absolute path", exe.display()),
        ));
    }
    Ok(ProcessConstraint {
        user: m.user.as_ref().map(|u| user_ref("user", u)).transpose()?,
        exe: m.exe.clone(),
    })
}

/// The longest `comm`: the kernel keeps 15 bytes of a process's name (`TASK_COMM_LEN`).
const COMM_MAX: usize = 15;

/// Checks a matcher's value alone (what `matcher` could not). Errors name fields within
/// `match`.
fn check_matcher(m: &Matcher) -> Result<(), ConfigError> {
    match m {
        Matcher::ProcessName(n) if n.is_empty() || n.len() > COMM_MAX => Err(ConfigError::invalid(
            "process_name",
            format!("{n:?} is {} bytes; the kernel keeps at most {COMM_MAX} bytes of a process name, so it would never match (use the first {COMM_MAX})", n.len()),
        )),
        Matcher::Cgroup(c) => {
            let parts: Vec<&str> = c.split('/').filter(|p| !p.is_empty()).collect();
            if !c.starts_with('/') || parts.is_empty() {
                Err(ConfigError::invalid(
                    "cgroup",
                    format!("{c:?} must be a cgroup path below the root, such as /system.slice/x.service (the root holds every process)"),
                ))
            } else if parts.iter().any(|p| *p == ".." || *p == ".") {
                Err(ConfigError::invalid(
                    "cgroup",
                    format!("{c:?} must not contain . or .."),
                ))
            } else {
                Ok(())
            }
        }
        _ => Ok(()),
    }
}

/// What a service holds that no other may: its matcher, its push address or socket path,
/// its environment file; as (field, value).
fn own_keys(s: &ManagedService) -> Vec<(&'static str, String)> {
    let mut keys = vec![match &s.matcher {
        Matcher::ProcessName(n) => ("match.process_name", format!("{n:?}")),
        Matcher::Cgroup(c) => ("match.cgroup", format!("{c:?}")),
        Matcher::SystemdUnit(u) => ("match.systemd_unit", format!("{u:?}")),
        Matcher::PidFile(p) => ("match.pid_file", format!("{:?}", p.display().to_string())),
        Matcher::Pod { uid, .. } => ("match", format!("pod {uid}")),
    }];
    match &s.latency {
        Some(LatencySource::Push {
            addr: PushAddr::Udp(a),
            ..
        }) if a.port() != 0 => keys.push(("latency.push", format!("\"{a}\""))),
        Some(LatencySource::Push {
            addr: PushAddr::Unix(p),
            ..
        }) => keys.push(("latency.unix", format!("{:?}", p.display().to_string()))),
        _ => {}
    }
    if let Some(g) = &s.gpu {
        keys.push((
            "gpu.env_file",
            format!("{:?}", g.env_file.display().to_string()),
        ));
    }
    keys
}

/// Checks across services: nothing that two services would fight over (a matcher, a push
/// address or socket path, an environment file), and hooks spaced at least a tick apart
/// (`services` as for [`check_names`]).
pub(super) fn check_shared(
    services: &[ManagedService],
    latency_critical: usize,
    interval_ms: u64,
) -> Result<(), ConfigError> {
    let mut seen: BTreeMap<String, String> = BTreeMap::new();
    for (i, s) in services.iter().enumerate() {
        let at = |e: ConfigError| e.within(&item_field(i, latency_critical)).in_item(&s.name);
        if let Some(g) = s
            .gpu
            .as_ref()
            .filter(|g| g.min_restart_interval_ms < interval_ms)
        {
            return Err(at(ConfigError::conflict(
                "gpu.min_restart_interval_ms",
                format!(
                    "({}) must be at least interval_ms ({interval_ms}), or a failing hook reruns every tick",
                    g.min_restart_interval_ms
                ),
            )));
        }
        for (field, value) in own_keys(s) {
            if let Some(first) = seen.insert(format!("{field} {value}"), s.name.clone()) {
                return Err(at(ConfigError::conflict(
                    field,
                    format!(
                        "{value} is used by both {first} and {}; each service needs its own",
                        s.name
                    ),
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err, MIN};
    use super::super::*;
    use super::*;

    #[test]
    fn a_service_priority_is_read_and_bounded() {
        let c = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!(c.services[0].priority, 0, "default");
        let c = DaemonConfig::parse(&MIN.replace("match =", "priority = 5\nmatch ="), "t.toml")
            .unwrap();
        assert_eq!(c.services[0].priority, 5);
        let e = err(&MIN.replace("match =", "priority = 5000\nmatch ="));
        assert!(
            e.contains("service kv: priority") && e.contains("5000"),
            "{e}"
        );
    }

    #[test]
    fn placement_is_in_place_unless_move_is_asked_for() {
        let c = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!(c.services[0].placement, Placement::InPlace);
        let text = MIN.replace("match =", "placement = \"move\"\nmatch =");
        let c = DaemonConfig::parse(&text, "t.toml").unwrap();
        assert_eq!(c.services[0].placement, Placement::Move);
        let e = err(&MIN.replace("match =", "placement = \"elsewhere\"\nmatch ="));
        assert!(e.contains("elsewhere") && e.contains("in_place"), "{e}");
    }

    #[test]
    fn bad_matchers_are_named() {
        let matcher = |m: &str| MIN.replace("{ process_name = \"kv\" }", m);
        for (m, why) in [
            ("{ cgroup = \"/\" }", "below the root"),
            ("{ cgroup = \"\" }", "below the root"),
            ("{ cgroup = \"//\" }", "below the root"),
            ("{ cgroup = \"system.slice/x\" }", "below the root"),
            (
                "{ cgroup = \"/system.slice/../x\" }",
                "must not contain . or ..",
            ),
            (
                "{ process_name = \"nvidia-cuda-mps-control\" }",
                "is 23 bytes; the kernel keeps at most 15",
            ),
            ("{ process_name = \"\" }", "process_name"),
            ("{ process_name = \"kv\", user = -3 }", "match.user"),
            ("{ process_name = \"kv\", exe = \"bin/kv\" }", "match.exe"),
        ] {
            let e = err(&matcher(m));
            assert!(e.contains(why) && e.contains("kv"), "{m}: {e}");
        }
        let c = DaemonConfig::parse(
            &matcher("{ process_name = \"memcached\", user = \"memcache\", exe = \"/usr/bin/memcached\" }"),
            "t.toml",
        )
        .unwrap();
        assert_eq!(
            c.services[0].constraint,
            ProcessConstraint {
                user: Some(UserRef::Name("memcache".into())),
                exe: Some("/usr/bin/memcached".into()),
            }
        );
        let c = DaemonConfig::parse(
            &matcher("{ pid_file = \"/run/kv.pid\", user = 999 }"),
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.services[0].constraint.user, Some(UserRef::Id(999)));
    }

    #[test]
    fn shared_and_oversized_values_are_named() {
        let two = |a: &str, b: &str| {
            format!(
                "{MIN}[[best_effort]]\nname = \"batch\"\nmatch = {a}\n[[service]]\nname = \"web\"\np99_target_ms = 5\nmatch = {{ process_name = \"web\" }}\nlatency = {b}\n"
            )
        };
        let push = "{ push = \"127.0.0.1:9401\", unauthenticated = true }";
        for (text, why) in [
            (
                two("{ process_name = \"kv\" }", push),
                "match.process_name \"kv\" is used by both kv and batch",
            ),
            (
                two("{ process_name = \"b\" }", "{ push = \"127.0.0.1:9400\", unauthenticated = true }"),
                "latency.push \"127.0.0.1:9400\" is used by both kv and web",
            ),
            (
                two("{ pid_file = \"/run/a.pid\" }", push).replace("process_name = \"web\"", "pid_file = \"/run/a.pid\""),
                "match.pid_file \"/run/a.pid\" is used by both web and batch",
            ),
            (
                two("{ cgroup = \"/a\" }", push).replace("process_name = \"web\"", "cgroup = \"/a\""),
                "match.cgroup",
            ),
            (
                MIN.replace("127.0.0.1:9400\", unauthenticated = true", "/run/kv.sock\"")
                    .replace("push =", "unix =")
                    + &MIN
                        .replace("name = \"kv\"", "name = \"kv2\"")
                        .replace("process_name = \"kv\"", "process_name = \"kv2\"")
                        .replace("push = \"127.0.0.1:9400\", unauthenticated = true", "unix = \"/run/kv.sock\""),
                "latency.unix \"/run/kv.sock\" is used by both kv and kv2",
            ),
            (
                format!("{MIN}gpu = {{ env_file = \"/run/x.env\", restart = \"true\" }}\n[[best_effort]]\nname = \"b\"\nmatch = {{ process_name = \"b\" }}\ngpu = {{ env_file = \"/run/x.env\", restart = \"true\" }}\n"),
                "gpu.env_file \"/run/x.env\" is used by both kv and b",
            ),
            (
                format!("interval_ms = 2000\n{MIN}gpu = {{ env_file = \"/run/x.env\", restart = \"true\", min_restart_interval_ms = 1000 }}\n"),
                "kv: gpu.min_restart_interval_ms (1000) must be at least interval_ms (2000)",
            ),
            (
                format!("[host]\ncpus = \"0-4294967295\"\n{MIN}"),
                "host.cpus \"0-4294967295\" lists more than 4096 CPUs",
            ),
            (
                format!("[host]\ncpus = \"0-2047,4096-6143,8000\"\n{MIN}"),
                "more than 4096",
            ),
            (format!("[host]\ngpus = 65\n{MIN}"), "host.gpus must be between 0 and 64, got 65"),
            (
                format!("[mps]\npinned_mem_limit = \"0=8G\\nLD_PRELOAD=/tmp/x.so\"\n{MIN}"),
                "mps.pinned_mem_limit",
            ),
        ] {
            let e = err(&text);
            assert!(e.contains(why), "{why}: {e}");
        }
        for limit in ["0=8G", "1=512M", "12=1024K"] {
            DaemonConfig::parse(
                &format!("[mps]\npinned_mem_limit = \"{limit}\"\n{MIN}"),
                "t.toml",
            )
            .unwrap();
        }
        DaemonConfig::parse(
            &format!("[host]\ncpus = \"0-4095\"\ngpus = 64\n{MIN}"),
            "t.toml",
        )
        .unwrap();
        // Ephemeral ports may repeat (tests bind several services on port 0).
        let zero = "{ push = \"127.0.0.1:0\", unauthenticated = true }";
        DaemonConfig::parse(
            &two("{ process_name = \"b\" }", zero).replace("127.0.0.1:9400", "127.0.0.1:0"),
            "t.toml",
        )
        .unwrap();
    }
}
