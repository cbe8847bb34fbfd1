//! The best-effort batch jobs: stress-ng stressors that each press on one resource, one
//! worker per CPU, for a fixed time. Their throughput is stress-ng's own count of work
//! done (bogo operations per second of wall time, `--metrics-brief --yaml`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::procs::{Lab, ProcId};
use crate::Error;

/// Which resource the batch job presses on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// Integer arithmetic on every CPU (`--cpu N --cpu-method int64`): CPU time only.
    Cpu,
    /// Sequential 64-bit writes over 512 MiB per worker (`--vm N --vm-method write64
    /// --vm-keep`): memory bandwidth, far beyond any LLC. stress-ng's `--stream` sizes its
    /// arrays from the LLC, and on a VM that reports a 260 MiB LLC one operation takes
    /// ~13 s, too coarse to count.
    Membw,
    /// Cache thrashing (`--cache N`): the shared LLC.
    Cache,
}

impl std::str::FromStr for Scenario {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Scenario::Cpu),
            "membw" => Ok(Scenario::Membw),
            "cache" => Ok(Scenario::Cache),
            _ => Err(format!("unknown scenario {s:?}: cpu, membw or cache")),
        }
    }
}

impl Scenario {
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Cpu => "cpu",
            Scenario::Membw => "membw",
            Scenario::Cache => "cache",
        }
    }

    /// The process name stress-ng gives its workers (`stress-ng-<stressor>`, at most 15
    /// characters), which cohabit's configuration matches.
    pub fn worker_name(self) -> &'static str {
        match self {
            Scenario::Cpu => "stress-ng-cpu",
            Scenario::Membw => "stress-ng-vm",
            Scenario::Cache => "stress-ng-cache",
        }
    }

    /// stress-ng's arguments for `workers` workers running `seconds`, metrics to `yaml`.
    pub fn args(self, workers: usize, seconds: u32, yaml: &Path) -> Vec<String> {
        let n = workers.max(1).to_string();
        let mut a: Vec<String> = match self {
            Scenario::Cpu => vec!["--cpu", &n, "--cpu-method", "int64"],
            Scenario::Membw => vec![
                "--vm",
                &n,
                "--vm-bytes",
                "512M",
                "--vm-method",
                "write64",
                "--vm-keep",
            ],
            Scenario::Cache => vec!["--cache", &n],
        }
        .into_iter()
        .map(String::from)
        .collect();
        a.extend([
            "--timeout".into(),
            format!("{seconds}s"),
            "--metrics-brief".into(),
            "--yaml".into(),
            yaml.display().to_string(),
        ]);
        a
    }
}

/// What one stressor did.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Throughput {
    /// stress-ng's stressor name.
    pub stressor: String,
    /// Bogo operations completed.
    pub bogo_ops: f64,
    /// Per second of wall time.
    pub ops_per_s: f64,
}

/// Reads the `metrics:` list of stress-ng's YAML report.
pub fn parse_yaml(text: &str) -> Vec<Throughput> {
    let mut out: Vec<Throughput> = Vec::new();
    let mut in_metrics = false;
    for line in text.lines() {
        let t = line.trim();
        if !line.starts_with(' ') && !t.is_empty() {
            in_metrics = t == "metrics:";
            continue;
        }
        if !in_metrics {
            continue;
        }
        let Some((k, v)) = t.trim_start_matches("- ").split_once(':') else {
            continue;
        };
        let v = v.trim();
        match k.trim() {
            "stressor" => out.push(Throughput {
                stressor: v.to_string(),
                bogo_ops: f64::NAN,
                ops_per_s: f64::NAN,
            }),
            "bogo-ops" => {
                if let (Some(last), Ok(x)) = (out.last_mut(), v.parse()) {
                    last.bogo_ops = x;
                }
            }
            "bogo-ops-per-second-real-time" => {
                if let (Some(last), Ok(x)) = (out.last_mut(), v.parse()) {
                    last.ops_per_s = x;
                }
            }
            _ => {}
        }
    }
    out.retain(|t| t.ops_per_s.is_finite());
    out
}

/// A batch job that is running.
#[derive(Debug)]
pub struct Batch {
    /// stress-ng's main process.
    pub proc: ProcId,
    /// Its cgroup.
    pub group: String,
    yaml: PathBuf,
}

/// The cgroup the batch jobs start in.
pub const GROUP: &str = "be";

/// Starts the scenario's stress-ng in cgroup [`GROUP`] (created beforehand, so the `cap`
/// and `idle` policies can already be written there).
pub fn start(
    lab: &mut Lab,
    scenario: Scenario,
    stress_ng: &Path,
    dir: &Path,
    workers: usize,
    seconds: u32,
) -> Result<Batch, Error> {
    let yaml = dir.join("stress-ng.yaml");
    let log = dir.join("stress-ng.log");
    let args = scenario.args(workers, seconds, &yaml);
    let proc = lab.spawn("stress-ng", GROUP, stress_ng, &args, &[], &log)?;
    Ok(Batch {
        proc,
        group: GROUP.to_string(),
        yaml,
    })
}

/// The names stress-ng's workers run under (they rename themselves `stress-ng-<stressor>`,
/// cut to 15 characters), once they are there; waits up to 5 s.
pub fn worker_names(lab: &mut Lab, b: &Batch) -> Result<Vec<String>, Error> {
    let leader = lab.get(b.proc).pid();
    for _ in 0..100 {
        let mut names: Vec<String> = lab
            .tree()
            .procs(&b.group)
            .into_iter()
            .filter(|p| *p != leader)
            .filter_map(crate::sys::comm)
            .filter(|c| c.starts_with("stress-ng-"))
            .collect();
        names.sort();
        names.dedup();
        if !names.is_empty() {
            return Ok(names);
        }
        if !lab.get(b.proc).running() {
            break;
        }
        crate::interrupt::sleep(Duration::from_millis(50))?;
    }
    Err(Error::Start {
        what: "stress-ng".into(),
        detail: format!(
            "no worker appeared; its log says:\n{}",
            lab.get(b.proc).log_tail(10)
        ),
    })
}

/// Waits for the job to end by itself (up to `wait`) and reads its throughput.
pub fn finish(lab: &mut Lab, b: &Batch, wait: Duration) -> Result<Vec<Throughput>, Error> {
    let code = lab.wait(b.proc, wait)?;
    let text = std::fs::read_to_string(&b.yaml).unwrap_or_default();
    let t = parse_yaml(&text);
    if code != Some(0) || t.is_empty() {
        return Err(Error::Start {
            what: "stress-ng".into(),
            detail: format!(
                "ended with {code:?} and no metrics in {}; its log says:\n{}",
                b.yaml.display(),
                lab.get(b.proc).log_tail(10)
            ),
        });
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    const YAML: &str = "---
system-info:
      stress-ng-version: 0.15.06
      cpus: 2

metrics:
    - stressor: cpu
      bogo-ops: 1520
      bogo-ops-per-second-usr-sys-time: 1635.389836
      bogo-ops-per-second-real-time: 506.055720
      wall-clock-time: 3.003622

    - stressor: cache
      bogo-ops: 20753
      bogo-ops-per-second-real-time: 6901.852576
...
";

    #[test]
    fn the_yaml_report_gives_each_stressors_rate() {
        let t = parse_yaml(YAML);
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].stressor, "cpu");
        assert_eq!(t[0].bogo_ops, 1520.0);
        assert!((t[0].ops_per_s - 506.05572).abs() < 1e-9);
        assert_eq!(t[1].stressor, "cache");
        assert!(parse_yaml("metrics:\n").is_empty());
    }

    #[test]
    fn arguments_per_scenario() {
        let a = Scenario::Membw.args(2, 30, Path::new("/tmp/s.yaml"));
        assert_eq!(a[..2], ["--vm".to_string(), "2".to_string()]);
        assert!(a.contains(&"30s".to_string()));
        assert!(a.contains(&"/tmp/s.yaml".to_string()));
        assert_eq!("cache".parse::<Scenario>().unwrap(), Scenario::Cache);
        assert!("disk".parse::<Scenario>().is_err());
    }
}
