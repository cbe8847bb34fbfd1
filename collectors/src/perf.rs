//! Hardware performance counters (instructions, cycles, LLC misses) per cgroup.
//!
//! Built on `perf-event2` rather than `perfcnt`: it is maintained, it opens counters on a
//! cgroup (`PERF_FLAG_PID_CGROUP`, one counter per CPU, as the kernel requires for cgroup
//! events) and reads `time_enabled`/`time_running` so multiplexed counts can be scaled.
//!
//! Many VMs expose no hardware counters at all (`perf stat -e instructions true` says "not
//! supported"). [`probe`] tells once; callers then report counters as absent, never zero.
//!
//! File descriptors: a group's counters cost [`FDS_PER_CPU`] descriptors on every CPU it is
//! counted on, so a large host reaches the soft `RLIMIT_NOFILE` (often 1 024) quickly. The
//! daemon raises the soft limit to the hard one at start ([`raise_fd_limit`]) and hands out
//! descriptors from an [`FdBudget`] that keeps a reserve for ordinary opens. Counters are
//! opened through a [`CounterOpener`] ([`KernelCounters`] on a real host; a fake in tests).

use std::fmt;
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

/// Descriptors one group's counters take on each CPU (instructions, cycles, LLC misses).
pub const FDS_PER_CPU: usize = 3;

/// Descriptors always left for ordinary opens (files, sockets, cgroup and resctrl reads),
/// whatever the limit: at least this many, or an eighth of the limit if that is more.
pub const FD_RESERVE_MIN: u64 = 256;

/// One group's open counters, as the sampler uses them.
pub trait CounterSet: Send + fmt::Debug {
    /// Current totals, each scaled for multiplexing and summed over CPUs.
    fn read(&mut self) -> io::Result<PerfTotals>;
}

/// Opens a group's counters (the kernel's on a real host, a fake in tests).
pub trait CounterOpener: Send + Sync + fmt::Debug {
    /// Opens and enables the counters of `cgroup_dir` on each CPU in `cpus`.
    fn open(&self, cgroup_dir: &Path, cpus: &[usize]) -> io::Result<Box<dyn CounterSet>>;
}

/// The kernel's counters ([`CgroupCounters`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct KernelCounters;

impl CounterOpener for KernelCounters {
    fn open(&self, cgroup_dir: &Path, cpus: &[usize]) -> io::Result<Box<dyn CounterSet>> {
        Ok(Box::new(CgroupCounters::open(cgroup_dir, cpus)?))
    }
}

impl CounterSet for CgroupCounters {
    fn read(&mut self) -> io::Result<PerfTotals> {
        CgroupCounters::read(self)
    }
}

/// Descriptors a group's counters need on `cpus` CPUs.
pub fn fds_needed(cpus: usize) -> usize {
    cpus.saturating_mul(FDS_PER_CPU)
}

/// The descriptors counters may take: the limit less a reserve for ordinary opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FdBudget {
    available: usize,
    used: usize,
}

/// A group's counters would take more descriptors than the budget has left.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("counters need {needed} file descriptors, only {left} of the budget are left (the rest of RLIMIT_NOFILE is kept for ordinary opens)")]
pub struct OverBudget {
    /// Descriptors asked for.
    pub needed: usize,
    /// Descriptors left.
    pub left: usize,
}

impl FdBudget {
    /// A budget under an open-files limit of `limit`: the limit less its reserve
    /// (`max(FD_RESERVE_MIN, limit / 8)`); nothing at all under a limit that small.
    pub fn for_limit(limit: u64) -> Self {
        let reserve = FD_RESERVE_MIN.max(limit / 8);
        Self::with_available(usize::try_from(limit.saturating_sub(reserve)).unwrap_or(usize::MAX))
    }

    /// A budget of exactly `available` descriptors.
    pub fn with_available(available: usize) -> Self {
        Self { available, used: 0 }
    }

    /// The budget under this process's soft `RLIMIT_NOFILE` (unreadable: the common default
    /// of 1 024).
    pub fn from_rlimit() -> Self {
        use nix::sys::resource::{getrlimit, Resource};
        let soft = getrlimit(Resource::RLIMIT_NOFILE).map_or(1024, |(soft, _)| soft);
        Self::for_limit(soft)
    }

    /// Takes `n` descriptors, or says why not (nothing is taken then).
    pub fn take(&mut self, n: usize) -> Result<(), OverBudget> {
        let left = self.left();
        if n > left {
            return Err(OverBudget { needed: n, left });
        }
        self.used += n;
        Ok(())
    }

    /// Gives `n` descriptors back.
    pub fn give_back(&mut self, n: usize) {
        self.used = self.used.saturating_sub(n);
    }

    /// Descriptors not taken.
    pub fn left(&self) -> usize {
        self.available.saturating_sub(self.used)
    }

    /// Descriptors taken.
    pub fn used(&self) -> usize {
        self.used
    }
}

/// The kernel's default `fs.nr_open`: the most open files a process may have.
const NR_OPEN_DEFAULT: u64 = 1 << 20;

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit; returns the soft limit
/// before and after. An error names the call that failed.
pub fn raise_fd_limit() -> Result<(u64, u64), String> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) =
        getrlimit(Resource::RLIMIT_NOFILE).map_err(|e| format!("getrlimit(RLIMIT_NOFILE): {e}"))?;
    // An unlimited hard limit cannot be the soft one (the kernel caps open files at
    // `fs.nr_open`, 1 048 576 by default): aim for that default then.
    let target = if hard == nix::libc::RLIM_INFINITY {
        NR_OPEN_DEFAULT.max(soft)
    } else {
        hard
    };
    if soft >= target {
        return Ok((soft, soft));
    }
    setrlimit(Resource::RLIMIT_NOFILE, target, hard)
        .map_err(|e| format!("setrlimit(RLIMIT_NOFILE, {target}, {hard}): {e}"))?;
    Ok((soft, target))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_keeps_a_reserve_and_refuses_what_does_not_fit() {
        // A soft limit of 128 leaves nothing for counters.
        let mut tiny = FdBudget::for_limit(128);
        assert_eq!(tiny.left(), 0);
        assert_eq!(tiny.take(3), Err(OverBudget { needed: 3, left: 0 }));
        // 1 024: 256 kept back; a 112-CPU group takes 336, so two fit and a third does not.
        let mut b = FdBudget::for_limit(1024);
        assert_eq!(b.left(), 768);
        let group = fds_needed(112);
        assert_eq!(group, 336);
        b.take(group).unwrap();
        b.take(group).unwrap();
        let e = b.take(group).unwrap_err();
        assert_eq!((e.needed, e.left), (336, 96));
        assert!(e.to_string().contains("336 file descriptors"), "{e}");
        assert_eq!(b.used(), 672, "a refused request takes nothing");
        b.give_back(group);
        b.take(group).unwrap();
        // A large limit keeps an eighth back.
        assert_eq!(FdBudget::for_limit(1 << 20).left(), (1 << 20) - (1 << 17));
    }

    #[test]
    fn raising_the_limit_never_lowers_it() {
        use nix::sys::resource::{getrlimit, Resource};
        let (before_soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        let (was, now) = raise_fd_limit().unwrap();
        assert_eq!(was, before_soft);
        assert_eq!(now, hard.max(before_soft));
        assert_eq!(getrlimit(Resource::RLIMIT_NOFILE).unwrap().0, now);
    }

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
