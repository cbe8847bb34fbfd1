//! Processes from procfs: finding a service's processes and threads, and their statistics.
//!
//! Parsing is the `procfs` crate's, pointed at the injected root (`all_processes_with_root`,
//! `Process::new_with_root`), so fixture trees and the real `/proc` go through the same
//! code. A process that exits between two reads is absence (`None` / skipped), never an
//! error: services spawn and reap workers all the time. The crate needs what the kernel
//! writes: a fixture's `<pid>/stat` must be a complete line ([`fake::FakeProcess`] writes
//! one).
//!
//! Kernel doc: `Documentation/filesystems/proc.rst`, `man 5 proc`. Facts this module relies
//! on: `<pid>/stat` holds the command (up to 15 bytes, what `comm` holds), utime and stime
//! in clock ticks, the thread count, the start time (which tells a reused pid apart) and
//! the RSS in pages; `<pid>/task/` lists the thread ids; `<pid>/cgroup` has one
//! `ID:CONTROLLERS:PATH` line per hierarchy.

use std::path::{Path, PathBuf};

use procfs::process::{Process, Stat};
use procfs::ProcessCGroups;
use procfs::{FromBufRead, FromRead, ProcError, WithCurrentSystemInfo};

use crate::IoError;

/// Reads processes under one proc root.
#[derive(Debug, Clone)]
pub struct Procfs {
    root: PathBuf,
}

/// CPU time and memory of one process, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcStat {
    /// User plus system time, in clock ticks (`/proc/PID/stat` fields 14 and 15).
    pub cpu_ticks: u64,
    /// Resident set size in bytes (field 24, in pages, times the page size).
    pub rss_bytes: u64,
    /// Threads (field 20).
    pub threads: u32,
    /// When the process started, in clock ticks after boot (field 22): with the pid, it
    /// identifies the process (a reused pid has another start time).
    pub start_ticks: u64,
}

/// The kernel's clock tick rate (`sysconf(_SC_CLK_TCK)`, through the `procfs` crate, which
/// asks `rustix` and needs no `unsafe` here): the unit of [`ProcStat::cpu_ticks`].
pub fn clock_ticks_per_second() -> u64 {
    procfs::ticks_per_second()
}

fn io_error(what: &'static str, path: &Path, e: ProcError) -> IoError {
    let source = match e {
        ProcError::Io(e, _) => e,
        ProcError::NotFound(_) => std::io::ErrorKind::NotFound.into(),
        ProcError::PermissionDenied(_) => std::io::ErrorKind::PermissionDenied.into(),
        other => std::io::Error::other(other.to_string()),
    };
    IoError::new(what, path, source)
}

impl Procfs {
    /// procfs at `root` (normally `/proc`).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn process(&self, pid: u32) -> Option<Process> {
        Process::new_with_root(self.root.join(pid.to_string())).ok()
    }

    fn processes(&self) -> Result<Vec<Process>, IoError> {
        let all = procfs::process::all_processes_with_root(&self.root)
            .map_err(|e| io_error("listing", &self.root, e))?;
        // A process that vanished while listing is simply not there.
        Ok(all.filter_map(Result::ok).collect())
    }

    /// Every process id.
    pub fn pids(&self) -> Result<Vec<u32>, IoError> {
        let mut out: Vec<u32> = self
            .processes()?
            .iter()
            .filter_map(|p| u32::try_from(p.pid()).ok())
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    /// The command name (`comm`, as `stat` holds it), if the process still exists.
    pub fn comm(&self, pid: u32) -> Option<String> {
        self.process(pid)?.stat().ok().map(|s| s.comm)
    }

    /// Processes whose `comm` is exactly `name`.
    pub fn pids_named(&self, name: &str) -> Result<Vec<u32>, IoError> {
        let mut out: Vec<u32> = self
            .processes()?
            .iter()
            .filter(|p| p.stat().is_ok_and(|s| s.comm == name))
            .filter_map(|p| u32::try_from(p.pid()).ok())
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    /// Thread ids of a process (empty if it is gone).
    pub fn threads(&self, pid: u32) -> Vec<u32> {
        let mut out: Vec<u32> = self
            .process(pid)
            .and_then(|p| p.tasks().ok())
            .map(|tasks| {
                tasks
                    .filter_map(Result::ok)
                    .filter_map(|t| u32::try_from(t.tid).ok())
                    .collect()
            })
            .unwrap_or_default();
        out.sort_unstable();
        out
    }

    /// Statistics of a process, `None` if it is gone.
    pub fn stat(&self, pid: u32) -> Option<ProcStat> {
        self.process(pid)?.stat().ok().map(|s| proc_stat(&s))
    }

    /// The cgroup paths of a process: `(hierarchy id, controllers, path)` per line of
    /// `/proc/PID/cgroup`, controllers joined by `,` (empty on v2).
    pub fn cgroups(&self, pid: u32) -> Option<Vec<(u32, String, String)>> {
        self.process(pid)?.cgroups().ok().map(|c| cgroup_lines(&c))
    }

    /// Whether the process exists.
    pub fn alive(&self, pid: u32) -> bool {
        self.process(pid).is_some()
    }
}

fn proc_stat(s: &Stat) -> ProcStat {
    ProcStat {
        cpu_ticks: s.utime.saturating_add(s.stime),
        rss_bytes: s.rss_bytes().get(),
        threads: u32::try_from(s.num_threads).unwrap_or(1).max(1),
        start_ticks: s.starttime,
    }
}

fn cgroup_lines(c: &ProcessCGroups) -> Vec<(u32, String, String)> {
    c.0.iter()
        .map(|g| (g.hierarchy, g.controllers.join(","), g.pathname.clone()))
        .collect()
}

/// Parses `/proc/PID/stat` text (the command may contain spaces and parentheses).
pub fn parse_stat(stat: &str) -> Option<ProcStat> {
    Stat::from_read(stat.as_bytes()).ok().map(|s| proc_stat(&s))
}

/// Parses `/proc/PID/cgroup` text.
pub fn parse_cgroup_file(text: &str) -> Vec<(u32, String, String)> {
    ProcessCGroups::from_buf_read(text.as_bytes())
        .map(|c| cgroup_lines(&c))
        .unwrap_or_default()
}

/// Fixture processes for tests: a `/proc/<pid>` directory with what the kernel (and so the
/// `procfs` crate) has there.
#[cfg(any(test, feature = "testutils"))]
pub mod fake {
    use std::io;
    use std::path::Path;

    /// One fake process. Unlike the kernel: nothing changes unless a test writes it again.
    #[derive(Debug, Clone)]
    pub struct FakeProcess {
        /// Process id.
        pub pid: u32,
        /// Command name.
        pub comm: String,
        /// Thread ids besides the main one.
        pub threads: Vec<u32>,
        /// User time, in clock ticks.
        pub utime: u64,
        /// System time, in clock ticks.
        pub stime: u64,
        /// Start time after boot, in clock ticks.
        pub start_ticks: u64,
        /// Resident set, in pages.
        pub rss_pages: u64,
        /// `/proc/<pid>/cgroup` text.
        pub cgroup: String,
    }

    impl FakeProcess {
        /// A process `pid` named `comm`, idle, in the root cgroup.
        pub fn new(pid: u32, comm: &str) -> Self {
            Self {
                pid,
                comm: comm.to_string(),
                threads: vec![],
                utime: 0,
                stime: 0,
                start_ticks: 1000,
                rss_pages: 0,
                cgroup: "0::/\n".into(),
            }
        }

        /// The `stat` line the kernel would write (52 fields, Linux 5.x).
        pub fn stat_line(&self) -> String {
            let n = 1 + self.threads.len();
            format!(
                "{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560 100 0 0 0 {u} {s} 0 0 20 0 {n} 0 {start} 10000000 {rss} 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n",
                pid = self.pid,
                comm = self.comm,
                u = self.utime,
                s = self.stime,
                start = self.start_ticks,
                rss = self.rss_pages,
            )
        }

        /// Writes `<proc_root>/<pid>/{stat,comm,cgroup,task/<tid>/stat}`.
        pub fn write(&self, proc_root: &Path) -> io::Result<()> {
            let dir = proc_root.join(self.pid.to_string());
            for tid in std::iter::once(self.pid).chain(self.threads.iter().copied()) {
                let t = dir.join("task").join(tid.to_string());
                std::fs::create_dir_all(&t)?;
                std::fs::write(t.join("stat"), self.stat_line())?;
            }
            std::fs::write(dir.join("stat"), self.stat_line())?;
            std::fs::write(dir.join("comm"), format!("{}\n", self.comm))?;
            std::fs::write(dir.join("cgroup"), &self.cgroup)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fake::FakeProcess;
    use super::*;

    #[test]
    fn stat_survives_spaces_and_parens_in_the_command() {
        let mut p = FakeProcess::new(1234, "my (odd) cmd");
        p.utime = 250;
        p.stime = 50;
        p.threads = vec![1235, 1236];
        p.rss_pages = 2;
        p.start_ticks = 777;
        let s = parse_stat(&p.stat_line()).unwrap();
        assert_eq!(
            s,
            ProcStat {
                cpu_ticks: 300,
                rss_bytes: 2 * procfs::page_size(),
                threads: 3,
                start_ticks: 777,
            }
        );
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn cgroup_lines_split_into_three_fields() {
        let v = parse_cgroup_file("3:cpuset:/\n4:cpu,cpuacct:/x\n0::/user.slice/a:b\n");
        assert_eq!(v[0], (3, "cpuset".into(), "/".into()));
        assert_eq!(v[1], (4, "cpu,cpuacct".into(), "/x".into()));
        assert_eq!(v[2], (0, String::new(), "/user.slice/a:b".into()));
    }

    #[test]
    fn processes_are_found_by_name_in_a_fixture_tree() {
        let dir = tempfile::tempdir().unwrap();
        for (pid, comm) in [(10, "memcached"), (11, "bash"), (12, "memcached")] {
            let mut p = FakeProcess::new(pid, comm);
            p.threads = vec![pid + 100];
            p.cgroup = "4:cpuset:/cohabit/lc-kv\n0::/\n".into();
            p.write(dir.path()).unwrap();
        }
        std::fs::create_dir_all(dir.path().join("self")).unwrap();
        let p = Procfs::new(dir.path());
        assert_eq!(p.pids().unwrap(), vec![10, 11, 12]);
        assert_eq!(p.pids_named("memcached").unwrap(), vec![10, 12]);
        assert_eq!(p.comm(11).as_deref(), Some("bash"));
        assert_eq!(p.threads(12), vec![12, 112]);
        assert_eq!(p.stat(12).unwrap().threads, 2);
        assert_eq!(
            p.cgroups(10).unwrap()[0],
            (4, "cpuset".into(), "/cohabit/lc-kv".into())
        );
        assert!(p.alive(10) && !p.alive(99));
        assert!(p.stat(99).is_none());
        assert!(p.threads(99).is_empty());
        assert!(Procfs::new(dir.path().join("none")).pids().is_err());
    }

    #[test]
    fn this_process_reads_from_the_real_proc() {
        let p = Procfs::new("/proc");
        let me = std::process::id();
        let s = p.stat(me).unwrap();
        assert!(s.rss_bytes > 0 && s.threads >= 1 && s.start_ticks > 0);
        assert!(p.threads(me).contains(&me));
        assert!(clock_ticks_per_second() > 0);
    }
}
