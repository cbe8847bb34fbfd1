//! The policies compared: no control, two settings an operator would make by hand (a cap,
//! the kernel's idle class), and cohabit's policies run by the real daemon with a
//! generated configuration.

use std::fmt::Write as _;
use std::path::Path;

use crate::cgroups::Tree;
use crate::services::{Kind, RunAs};
use crate::Error;

/// One way of sharing the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Nothing: services and batch jobs share every CPU at equal weight.
    None,
    /// By hand: the batch jobs pinned to the upper half of the CPUs with the lowest CPU
    /// weight; the services left alone.
    Cap,
    /// By hand with the kernel alone: the batch jobs' cgroup in the idle scheduling class
    /// (`cpu.idle = 1`, Linux 5.15 or later) on every CPU; the services left alone.
    Idle,
    /// `cohabit run` with `policy = "static"`.
    Static,
    /// `cohabit run` with `policy = "parties"`.
    Parties,
    /// `cohabit run` with `policy = "clite"` (opt-in: one search takes up to 90 intervals,
    /// longer than the full benchmark's runs).
    Clite,
    /// `cohabit run` with `policy = "ml"` and the built-in model, trained on the simulator.
    Ml,
    /// `cohabit run` with `policy = "ml"` and a model trained on this host's own logs: the
    /// benchmark's explore phase (`cohabit run --explore`) collects them, and
    /// `cohabit-train logs` + `fit --init` warm-start it from the built-in one.
    #[serde(rename = "ml-host")]
    MlHost,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Policy::None),
            "cap" => Ok(Policy::Cap),
            "idle" => Ok(Policy::Idle),
            "static" => Ok(Policy::Static),
            "parties" => Ok(Policy::Parties),
            "clite" => Ok(Policy::Clite),
            "ml" => Ok(Policy::Ml),
            "ml-host" => Ok(Policy::MlHost),
            _ => Err(format!(
                "unknown policy {s:?}: none, cap, idle, static, parties, clite, ml or ml-host"
            )),
        }
    }
}

impl Policy {
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::None => "none",
            Policy::Cap => "cap",
            Policy::Idle => "idle",
            Policy::Static => "static",
            Policy::Parties => "parties",
            Policy::Clite => "clite",
            Policy::Ml => "ml",
            Policy::MlHost => "ml-host",
        }
    }

    /// The `policy` of cohabit's configuration, if cohabit runs.
    pub fn cohabit(self) -> Option<&'static str> {
        match self {
            Policy::None | Policy::Cap | Policy::Idle => None,
            Policy::Static => Some("static"),
            Policy::Parties => Some("parties"),
            Policy::Clite => Some("clite"),
            Policy::Ml | Policy::MlHost => Some("ml"),
        }
    }
}

/// Online CPUs from a list like `0-3,6`.
pub fn parse_cpu_list(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    out.extend(a..=b);
                }
            }
            None => out.extend(part.parse::<u32>().ok()),
        }
    }
    out
}

/// The CPUs of this host.
pub fn online_cpus() -> Vec<u32> {
    let cpus = parse_cpu_list(
        &std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default(),
    );
    if cpus.is_empty() {
        let n = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        (0..u32::try_from(n).unwrap_or(1)).collect()
    } else {
        cpus
    }
}

/// The hand-set cap's CPUs: the upper half of `cpus` (at least one).
pub fn cap_cpus(cpus: &[u32]) -> Vec<u32> {
    let keep = cpus.len().div_ceil(2).max(1);
    cpus[cpus.len().saturating_sub(keep)..].to_vec()
}

/// A CPU list as cpuset writes it.
pub fn cpu_list(cpus: &[u32]) -> String {
    cpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Writes the hand-set cap on the batch jobs' cgroup.
pub fn apply_cap(tree: &Tree, group: &str, cpus: &[u32]) -> Result<(), Error> {
    tree.set_cpus(group, &cpu_list(&cap_cpus(cpus)))?;
    tree.set_lowest_weight(group)
}

/// Puts the batch jobs' cgroup in the kernel's idle class; its CPUs stay all of them.
pub fn apply_idle(tree: &Tree, group: &str) -> Result<(), Error> {
    tree.set_idle(group)
}

/// cohabit's `[host] best_effort_cpus`: which CPUs its best-effort group gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BestEffortCpus {
    /// The CPUs no latency-critical service holds.
    Spare,
    /// Every CPU.
    All,
}

impl std::str::FromStr for BestEffortCpus {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "spare" => Ok(BestEffortCpus::Spare),
            "all" => Ok(BestEffortCpus::All),
            _ => Err(format!("unknown best-effort CPUs {s:?}: spare or all")),
        }
    }
}

impl BestEffortCpus {
    /// Its name, as cohabit's configuration writes it.
    pub fn name(self) -> &'static str {
        match self {
            BestEffortCpus::Spare => "spare",
            BestEffortCpus::All => "all",
        }
    }
}

/// One latency-critical service in cohabit's configuration.
#[derive(Debug, Clone)]
pub struct LcEntry {
    /// Which service.
    pub kind: Kind,
    /// Its port.
    pub port: u16,
    /// Its p99 target.
    pub p99_target_ms: f64,
    /// The user it runs as (`match.user`).
    pub user: RunAs,
}

/// One of `ml`'s tunables, `KEY=VALUE` (`--ml margin=0.95`), as the `key = value` entry
/// cohabit's `ml = { … }` table takes: a name of lower-case letters and `_`, a number. Which
/// names and values are allowed is cohabit's to say: it refuses a bad one at start, by name.
pub fn ml_pair(s: &str) -> Result<String, String> {
    let (key, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected KEY=VALUE, like margin=0.95"))?;
    let (key, value) = (key.trim(), value.trim());
    if key.is_empty() || !key.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
        return Err(format!("{s:?}: {key:?} is not a tunable's name"));
    }
    if value.parse::<f64>().map_or(true, |v| !v.is_finite()) {
        return Err(format!("{s:?}: {value:?} is not a number"));
    }
    Ok(format!("{key} = {value}"))
}

/// What cohabit's configuration says.
#[derive(Debug, Clone)]
pub struct CohabitConfig<'a> {
    /// `static`, `parties`, `clite` or `ml`.
    pub policy: &'a str,
    /// Control interval.
    pub interval_ms: u64,
    /// The model, for `ml`.
    pub model: Option<&'a Path>,
    /// The decision log.
    pub log: &'a Path,
    /// The daemon's lock and record of changes (kept in the run directory, so nothing is
    /// left in `/run/cohabit`).
    pub state_dir: &'a Path,
    /// The services.
    pub services: &'a [LcEntry],
    /// Process names of the batch jobs' workers.
    pub batch_names: &'a [String],
    /// The user the batch jobs run as (`match.user`).
    pub batch_user: RunAs,
    /// Probe requests per second.
    pub probe_rate_hz: u32,
    /// Probe time-out.
    pub probe_timeout_ms: u64,
    /// `[host] best_effort_cpus`; `None` leaves cohabit's default.
    pub best_effort_cpus: Option<BestEffortCpus>,
    /// `ml`'s tunables as `key = value` entries ([`ml_pair`]; `ml = { … }`; empty: none
    /// written).
    pub ml: &'a [String],
    /// Writes `explore = { rule = "walk" }`: the explore runs collect training logs, for
    /// which the bounded walk's wider spread of allocations is the point (the informative
    /// rule, `--explore`'s default around `ml`, steps only where the model certifies a
    /// step safe, which on a 2-CPU VM is rarely).
    pub explore_walk: bool,
}

fn quoted(s: &str) -> String {
    // TOML basic strings: escape backslashes and quotes (paths and names have nothing else).
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// cohabit's configuration: the services found by process name, their latency from
/// cohabit's own probe, the batch jobs by their workers' names.
pub fn cohabit_toml(c: &CohabitConfig<'_>) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "# Written by cohabit-realbench.");
    let _ = writeln!(t, "interval_ms = {}", c.interval_ms);
    let _ = writeln!(t, "policy = {}", quoted(c.policy));
    if let Some(m) = c.model {
        let _ = writeln!(t, "model = {}", quoted(&m.display().to_string()));
    }
    if !c.ml.is_empty() {
        let _ = writeln!(t, "ml = {{ {} }}", c.ml.join(", "));
    }
    if c.explore_walk {
        let _ = writeln!(t, "explore = {{ rule = \"walk\" }}");
    }
    let _ = writeln!(t, "log = {}", quoted(&c.log.display().to_string()));
    let _ = writeln!(t, "metrics_addr = \"\"");
    let _ = writeln!(t, "\n[host]\nname = \"realbench\"");
    if let Some(b) = c.best_effort_cpus {
        let _ = writeln!(t, "best_effort_cpus = {}", quoted(b.name()));
    }
    let _ = writeln!(
        t,
        "\n[paths]\nstate_dir = {}",
        quoted(&c.state_dir.display().to_string())
    );
    for s in c.services {
        let _ = writeln!(
            t,
            "\n[[service]]\nname = {}\np99_target_ms = {}\nmatch = {{ process_name = {}, user = {} }}\nlatency = {{ probe = {}, rate_hz = {}, timeout_ms = {} }}",
            quoted(s.kind.name()),
            s.p99_target_ms,
            quoted(s.kind.comm()),
            s.user.toml(),
            quoted(&s.kind.probe_url(s.port)),
            c.probe_rate_hz,
            c.probe_timeout_ms,
        );
    }
    for (i, n) in c.batch_names.iter().enumerate() {
        let _ = writeln!(
            t,
            "\n[[best_effort]]\nname = \"batch-{i}\"\nmatch = {{ process_name = {}, user = {} }}",
            quoted(n),
            c.batch_user.toml()
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_takes_the_upper_half_of_the_cpus() {
        assert_eq!(parse_cpu_list("0-3,6\n"), vec![0, 1, 2, 3, 6]);
        assert_eq!(cap_cpus(&[0, 1]), vec![1]);
        assert_eq!(cap_cpus(&[0, 1, 2, 3, 4]), vec![2, 3, 4]);
        assert_eq!(cap_cpus(&[5]), vec![5]);
        assert_eq!(cpu_list(&[2, 3]), "2,3");
    }

    #[test]
    fn the_generated_config_names_probes_and_process_names() {
        let services = [LcEntry {
            kind: Kind::Memcached,
            port: 11311,
            p99_target_ms: 1.5,
            user: RunAs::Name("nobody"),
        }];
        let names = ["stress-ng-cpu".to_string()];
        let t = cohabit_toml(&CohabitConfig {
            policy: "parties",
            interval_ms: 500,
            model: None,
            log: Path::new("/tmp/run/decisions.jsonl"),
            state_dir: Path::new("/tmp/run/cohabit-state"),
            services: &services,
            batch_names: &names,
            batch_user: RunAs::Uid(1000),
            probe_rate_hz: 200,
            probe_timeout_ms: 100,
            best_effort_cpus: None,
            ml: &[],
            explore_walk: false,
        });
        assert!(t.contains("policy = \"parties\""));
        assert!(t.contains(
            "latency = { probe = \"memcached://127.0.0.1:11311\", rate_hz = 200, timeout_ms = 100 }"
        ));
        // Every name matcher says whose processes count (cohabit refuses one without).
        assert!(t.contains("match = { process_name = \"rb-memcached\", user = \"nobody\" }"));
        assert!(t.contains("match = { process_name = \"stress-ng-cpu\", user = 1000 }"));
        assert!(t.contains("p99_target_ms = 1.5"));
        assert!(t.contains("[paths]\nstate_dir = \"/tmp/run/cohabit-state\""));
        assert!(!t.contains("model"));
        assert!(!t.contains("best_effort_cpus"));
        assert!(!t.contains("explore"));
        assert_eq!("ml".parse::<Policy>().unwrap().cohabit(), Some("ml"));
        assert_eq!("ml-host".parse::<Policy>().unwrap().cohabit(), Some("ml"));
        assert_eq!(Policy::MlHost.name(), "ml-host");
        assert_eq!("clite".parse::<Policy>().unwrap().cohabit(), Some("clite"));
        assert_eq!("cap".parse::<Policy>().unwrap().cohabit(), None);
    }

    /// The services of realbench's configuration as cohabit's parser read them for
    /// `policy`: names, targets, matchers, users and probes.
    fn services_read_as_meant(c: &cohabit_controller::daemon::config::DaemonConfig, policy: &str) {
        use cohabit_collectors::users::UserRef;
        use cohabit_controller::daemon::config::{LatencySource, Matcher};
        let seen: Vec<_> = c
            .services
            .iter()
            .map(|s| {
                let url = match &s.latency {
                    Some(LatencySource::Probe {
                        url,
                        rate_hz: 200,
                        timeout_ms: 100,
                    }) => Some(url.to_string()),
                    None => None,
                    other => panic!("{}: {other:?}", s.name),
                };
                (
                    s.name.as_str(),
                    s.p99_target_ms,
                    &s.matcher,
                    &s.constraint.user,
                    url,
                )
            })
            .collect();
        let comm = |n: &str| Matcher::ProcessName(n.into());
        let name = UserRef::Name("nobody".into());
        let (root, batch) = (UserRef::Id(0), UserRef::Id(1000));
        let (mc, ng) = (comm("rb-memcached"), comm("rb-nginx"));
        let (cpu, vm) = (comm("stress-ng-cpu"), comm("stress-ng-vm"));
        let mc_url = Some("memcached://127.0.0.1:11311".to_string());
        let ng_url = Some("http://127.0.0.1:8081/index.html".to_string());
        assert_eq!(
            seen,
            [
                ("memcached", Some(1.5), &mc, &Some(name), mc_url),
                ("nginx", Some(4.0), &ng, &Some(root), ng_url),
                ("batch-0", None, &cpu, &Some(batch.clone()), None),
                ("batch-1", None, &vm, &Some(batch), None),
            ],
            "{policy}"
        );
    }

    /// The configuration as cohabit's own parser reads it (the daemon refuses at start what
    /// this refuses): every cohabit policy, with and without a model, tunables and
    /// best-effort CPUs.
    #[test]
    fn cohabits_parser_reads_the_generated_config_as_meant() {
        use cohabit_controller::daemon::config::{BestEffortCpus as Cpus, DaemonConfig};
        use cohabit_policy::PolicyKind;
        let services = [
            LcEntry {
                kind: Kind::Memcached,
                port: 11311,
                p99_target_ms: 1.5,
                user: RunAs::Name("nobody"),
            },
            LcEntry {
                kind: Kind::Nginx,
                port: 8081,
                p99_target_ms: 4.0,
                user: RunAs::Uid(0),
            },
        ];
        let names = ["stress-ng-cpu".to_string(), "stress-ng-vm".to_string()];
        let ml = [ml_pair("margin=0.95").unwrap()];
        for (policy, kind) in [
            ("static", PolicyKind::Static),
            ("parties", PolicyKind::Parties),
            ("clite", PolicyKind::Clite),
            ("ml", PolicyKind::Ml),
        ] {
            let is_ml = kind == PolicyKind::Ml;
            let text = cohabit_toml(&CohabitConfig {
                policy,
                interval_ms: 500,
                model: is_ml.then_some(Path::new("/tmp/run/qos-host.safetensors")),
                log: Path::new("/tmp/run/decisions.jsonl"),
                state_dir: Path::new("/tmp/run/cohabit-state"),
                services: &services,
                batch_names: &names,
                batch_user: RunAs::Uid(1000),
                probe_rate_hz: 200,
                probe_timeout_ms: 100,
                best_effort_cpus: is_ml.then_some(BestEffortCpus::All),
                ml: if is_ml { &ml } else { &[] },
                explore_walk: is_ml,
            });
            let c = DaemonConfig::parse(&text, "realbench")
                .unwrap_or_else(|e| panic!("{policy}: {e}\n{text}"));
            assert_eq!((c.policy, c.interval_ms), (kind, 500), "{policy}");
            assert_eq!(c.host_name, "realbench");
            assert_eq!(c.metrics_addr, None, "no metrics endpoint");
            assert_eq!(
                c.log.as_deref(),
                Some(Path::new("/tmp/run/decisions.jsonl"))
            );
            assert_eq!(c.state_dir, Path::new("/tmp/run/cohabit-state"));
            assert_eq!(
                c.model.as_deref(),
                is_ml.then_some(Path::new("/tmp/run/qos-host.safetensors"))
            );
            assert_eq!(c.ml.margin == 0.95, is_ml, "{policy}: tunables");
            // The explore runs' table: the walk, as cohabit reads it.
            assert_eq!(
                c.explore.as_ref().map(|e| e.rule),
                is_ml.then_some(cohabit_policy::ExploreRule::Walk),
                "{policy}: explore"
            );
            let pool = if is_ml { Cpus::All } else { Cpus::default() };
            assert_eq!(c.best_effort_cpus, pool, "{policy}");
            services_read_as_meant(&c, policy);
        }
        // `--alone`: no batch job, the services alone under the policy.
        let text = cohabit_toml(&CohabitConfig {
            policy: "parties",
            interval_ms: 1000,
            model: None,
            log: Path::new("/tmp/run/decisions.jsonl"),
            state_dir: Path::new("/tmp/run/cohabit-state"),
            services: &services,
            batch_names: &[],
            batch_user: RunAs::Uid(1000),
            probe_rate_hz: 200,
            probe_timeout_ms: 100,
            best_effort_cpus: None,
            ml: &[],
            explore_walk: false,
        });
        let c = DaemonConfig::parse(&text, "realbench").unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(
            c.services.len(),
            2,
            "the two services and no batch job: {text}"
        );
    }

    #[test]
    fn mls_tunables_are_written_into_an_ml_table_only_when_given() {
        assert_eq!(ml_pair(" margin=0.95"), Ok("margin = 0.95".into()));
        assert!(ml_pair("margin")
            .unwrap_err()
            .contains("expected KEY=VALUE"));
        assert!(ml_pair("margin=high").unwrap_err().contains("not a number"));
        assert!(ml_pair("margin=0.9 }")
            .unwrap_err()
            .contains("not a number"));
        assert!(ml_pair("log.path=1")
            .unwrap_err()
            .contains("not a tunable's name"));
        let pairs = [
            ml_pair("margin=0.95").unwrap(),
            ml_pair("shrink_after=3").unwrap(),
        ];
        let config = |ml| {
            cohabit_toml(&CohabitConfig {
                policy: "ml",
                interval_ms: 1000,
                model: None,
                log: Path::new("/tmp/run/decisions.jsonl"),
                state_dir: Path::new("/tmp/run/cohabit-state"),
                services: &[],
                batch_names: &[],
                batch_user: RunAs::Uid(0),
                probe_rate_hz: 200,
                probe_timeout_ms: 100,
                best_effort_cpus: None,
                ml,
                explore_walk: true,
            })
        };
        assert!(config(&pairs).contains("\nml = { margin = 0.95, shrink_after = 3 }\n"));
        assert!(!config(&[]).contains("ml = {"));
        // The explore runs ask for the walk (training logs want a spread of allocations).
        assert!(config(&[]).contains("\nexplore = { rule = \"walk\" }\n"));
    }

    #[test]
    fn the_idle_policy_parses_and_runs_no_daemon() {
        let p: Policy = "idle".parse().unwrap();
        assert_eq!(p, Policy::Idle);
        assert_eq!(p.name(), "idle");
        assert_eq!(p.cohabit(), None);
        assert_eq!(serde_json::to_string(&p).unwrap(), "\"idle\"");
        assert!("idel"
            .parse::<Policy>()
            .unwrap_err()
            .contains("none, cap, idle, static"));
    }

    #[test]
    fn best_effort_cpus_are_written_into_host_only_when_asked() {
        assert_eq!("all".parse::<BestEffortCpus>(), Ok(BestEffortCpus::All));
        assert_eq!("spare".parse::<BestEffortCpus>(), Ok(BestEffortCpus::Spare));
        assert!("half"
            .parse::<BestEffortCpus>()
            .unwrap_err()
            .contains("spare or all"));
        let config = |b| {
            cohabit_toml(&CohabitConfig {
                policy: "ml",
                interval_ms: 1000,
                model: None,
                log: Path::new("/tmp/run/decisions.jsonl"),
                state_dir: Path::new("/tmp/run/cohabit-state"),
                services: &[],
                batch_names: &[],
                batch_user: RunAs::Uid(0),
                probe_rate_hz: 200,
                probe_timeout_ms: 100,
                best_effort_cpus: b,
                ml: &[],
                explore_walk: false,
            })
        };
        assert!(!config(None).contains("best_effort_cpus"));
        for (b, line) in [
            (BestEffortCpus::All, "best_effort_cpus = \"all\""),
            (BestEffortCpus::Spare, "best_effort_cpus = \"spare\""),
        ] {
            let t = config(Some(b));
            // Inside [host], before the next table.
            let host = &t[t.find("[host]").unwrap()..t.find("[paths]").unwrap()];
            assert_eq!(host, format!("[host]\nname = \"realbench\"\n{line}\n\n"));
        }
    }
}
