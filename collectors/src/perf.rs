//! Hardware performance counters (instructions, cycles, LLC misses) per cgroup.
//!
//! Built on `perf-event2` rather than `perfcnt`: it is maintained, it opens counters on a
//! cgroup (`PERF_FLAG_PID_CGROUP`, one counter per CPU, as the kernel requires for cgroup
//! events) and reads `time_enabled`/`time_running` so multiplexed counts can be scaled.
//!
//! Many VMs expose no hardware counters at all (`perf stat -e instructions true` says "not
//! supported"). [`probe`] tells once; callers then report counters as absent, never zero.

use std::fs::File;
use std::io;
use std::path::Path;

use perf_event::events::Hardware;
use perf_event::{Builder, Counter, ReadFormat};

/// Whether this host gives us hardware counters.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state", content = "reason", rename_all = "snake_case")]
pub enum PerfSupport {
    /// Instructions can be counted.
    Supported,
    /// They cannot; the reason says why (no PMU in a VM, `perf_event_paranoid`, …).
    Unsupported(String),
}

/// Tries to count this process's instructions once.
pub fn probe() -> PerfSupport {
    match Builder::new(Hardware::INSTRUCTIONS).observe_self().build() {
        Ok(_) => PerfSupport::Supported,
        Err(e) => PerfSupport::Unsupported(explain(&e)),
    }
}

fn explain(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ENOENT | libc::EOPNOTSUPP | libc::ENODEV) => {
            format!("hardware counters are not supported on this host ({e})")
        }
        Some(libc::EACCES | libc::EPERM) => {
            format!("not permitted to open hardware counters; check /proc/sys/kernel/perf_event_paranoid ({e})")
        }
        _ => format!("hardware counters unavailable ({e})"),
    }
}

/// A count corrected for multiplexing: `count × enabled / running`; `None` when the counter
/// never ran (its value would be a guess).
pub fn scale(count: u64, enabled_ns: u64, running_ns: u64) -> Option<f64> {
    if running_ns == 0 {
        return None;
    }
    Some(count as f64 * enabled_ns as f64 / running_ns as f64)
}

/// Cumulative, multiplexing-scaled totals of one cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PerfTotals {
    /// Instructions retired.
    pub instructions: f64,
    /// Core cycles.
    pub cycles: f64,
    /// Last-level-cache misses.
    pub llc_misses: f64,
}

impl PerfTotals {
    /// IPC and LLC misses per second between two totals.
    pub fn rates(prev: &PerfTotals, cur: &PerfTotals, dt_s: f64) -> (Option<f64>, Option<f64>) {
        let di = cur.instructions - prev.instructions;
        let dc = cur.cycles - prev.cycles;
        let dm = cur.llc_misses - prev.llc_misses;
        let ipc = (dc > 0.0 && di >= 0.0).then(|| di / dc);
        let mps = (dt_s > 0.0 && dm >= 0.0).then(|| dm / dt_s);
        (ipc, mps)
    }
}

/// Instructions, cycles and LLC misses of every task in one cgroup.
#[derive(Debug)]
pub struct CgroupCounters {
    _cgroup: File,
    per_cpu: Vec<[Counter; 3]>,
}

impl CgroupCounters {
    /// Opens and enables the counters on `cgroup_dir` (in the `perf_event` v1 hierarchy or
    /// the unified v2 one) for each CPU in `cpus`.
    pub fn open(cgroup_dir: &Path, cpus: &[usize]) -> io::Result<Self> {
        let cgroup = File::open(cgroup_dir)?;
        let mut per_cpu = Vec::with_capacity(cpus.len());
        for &cpu in cpus {
            let make = |event: Hardware| -> io::Result<Counter> {
                let mut c = Builder::new(event)
                    .observe_cgroup(&cgroup)
                    .one_cpu(cpu)
                    .read_format(ReadFormat::TOTAL_TIME_ENABLED | ReadFormat::TOTAL_TIME_RUNNING)
                    .build()?;
                c.enable()?;
                Ok(c)
            };
            per_cpu.push([
                make(Hardware::INSTRUCTIONS)?,
                make(Hardware::CPU_CYCLES)?,
                make(Hardware::CACHE_MISSES)?,
            ]);
        }
        Ok(Self {
            _cgroup: cgroup,
            per_cpu,
        })
    }

    /// Current totals, each scaled for multiplexing and summed over CPUs.
    pub fn read(&mut self) -> io::Result<PerfTotals> {
        let mut t = PerfTotals::default();
        for counters in &mut self.per_cpu {
            let mut vals = [0.0; 3];
            for (v, c) in vals.iter_mut().zip(counters.iter_mut()) {
                let ct = c.read_count_and_time()?;
                *v = scale(ct.count, ct.time_enabled, ct.time_running).unwrap_or(0.0);
            }
            t.instructions += vals[0];
            t.cycles += vals[1];
            t.llc_misses += vals[2];
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multiplexed_counts_are_scaled_and_unscheduled_ones_are_absent() {
        assert_eq!(scale(1000, 10, 5), Some(2000.0));
        assert_eq!(scale(1000, 10, 10), Some(1000.0));
        assert_eq!(scale(1000, 10, 0), None);
    }

    #[test]
    fn rates_come_from_differences() {
        let a = PerfTotals {
            instructions: 1e9,
            cycles: 2e9,
            llc_misses: 1e6,
        };
        let b = PerfTotals {
            instructions: 3e9,
            cycles: 3e9,
            llc_misses: 3e6,
        };
        assert_eq!(PerfTotals::rates(&a, &b, 2.0), (Some(2.0), Some(1e6)));
        assert_eq!(PerfTotals::rates(&b, &a, 2.0), (None, None));
    }

    #[test]
    fn the_probe_gives_a_reason_or_counts() {
        match probe() {
            PerfSupport::Unsupported(reason) => {
                println!("hardware counters absent here: {reason}");
                assert!(!reason.is_empty());
            }
            PerfSupport::Supported => {
                let mut c = Builder::new(Hardware::INSTRUCTIONS)
                    .observe_self()
                    .build()
                    .unwrap();
                c.enable().unwrap();
                let v: u64 = (0..100_000u64).map(std::hint::black_box).sum();
                assert!(v > 0);
                assert!(c.read().unwrap() > 0);
            }
        }
    }
}
