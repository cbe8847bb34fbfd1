//! Processes from procfs: finding a service's processes and threads, and their statistics.
//!
//! Every path is under the injected proc root. A process that exits between two reads is
//! absence (`None` / skipped), never an error: services spawn and reap workers all the time.

use std::path::{Path, PathBuf};

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
    /// Resident set size in bytes.
    pub rss_bytes: u64,
    /// Threads.
    pub threads: u32,
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

    /// Every process id.
    pub fn pids(&self) -> Result<Vec<u32>, IoError> {
        let entries =
            std::fs::read_dir(&self.root).map_err(|e| IoError::new("listing", &self.root, e))?;
        let mut out: Vec<u32> = entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    /// The command name (`comm`), if the process still exists.
    pub fn comm(&self, pid: u32) -> Option<String> {
        std::fs::read_to_string(self.root.join(pid.to_string()).join("comm"))
            .ok()
            .map(|s| s.trim_end_matches('\n').to_string())
    }

    /// Processes whose `comm` is exactly `name`.
    pub fn pids_named(&self, name: &str) -> Result<Vec<u32>, IoError> {
        Ok(self
            .pids()?
            .into_iter()
            .filter(|p| self.comm(*p).as_deref() == Some(name))
            .collect())
    }

    /// Thread ids of a process (empty if it is gone).
    pub fn threads(&self, pid: u32) -> Vec<u32> {
        let dir = self.root.join(pid.to_string()).join("task");
        let mut out: Vec<u32> = std::fs::read_dir(dir)
            .map(|it| {
                it.filter_map(Result::ok)
                    .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
                    .collect()
            })
            .unwrap_or_default();
        out.sort_unstable();
        out
    }

    /// Statistics of a process, `None` if it is gone.
    pub fn stat(&self, pid: u32) -> Option<ProcStat> {
        let dir = self.root.join(pid.to_string());
        let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
        let status = std::fs::read_to_string(dir.join("status")).ok()?;
        parse_stat(&stat, &status)
    }

    /// The cgroup paths of a process: `(hierarchy id, controllers, path)` per line of
    /// `/proc/PID/cgroup`.
    pub fn cgroups(&self, pid: u32) -> Option<Vec<(u32, String, String)>> {
        let text = std::fs::read_to_string(self.root.join(pid.to_string()).join("cgroup")).ok()?;
        Some(parse_cgroup_file(&text))
    }

    /// Whether the process exists.
    pub fn alive(&self, pid: u32) -> bool {
        self.root.join(pid.to_string()).exists()
    }
}

/// Parses `/proc/PID/stat` (the command may contain spaces and parentheses) and the
/// `VmRSS` and `Threads` lines of `/proc/PID/status`.
pub fn parse_stat(stat: &str, status: &str) -> Option<ProcStat> {
    let after = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // After the command: state is field 3, utime 14 and stime 15 (1-based).
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    let field = |key: &str| {
        status.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
    };
    Some(ProcStat {
        cpu_ticks: utime + stime,
        rss_bytes: field("VmRSS:").unwrap_or(0) * 1024,
        threads: u32::try_from(field("Threads:").unwrap_or(1)).unwrap_or(1),
    })
}

/// Parses `/proc/PID/cgroup`.
pub fn parse_cgroup_file(text: &str) -> Vec<(u32, String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(3, ':');
            let id = it.next()?.parse().ok()?;
            Some((id, it.next()?.to_string(), it.next()?.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_survives_spaces_and_parens_in_the_command() {
        let stat = "1234 (my (odd) cmd) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 100 1000 200";
        let status = "Name:\tx\nThreads:\t3\nVmRSS:\t  2048 kB\n";
        let s = parse_stat(stat, status).unwrap();
        assert_eq!(
            s,
            ProcStat {
                cpu_ticks: 300,
                rss_bytes: 2048 * 1024,
                threads: 3
            }
        );
        assert!(parse_stat("garbage", status).is_none());
    }

    #[test]
    fn cgroup_lines_split_into_three_fields() {
        let v = parse_cgroup_file("3:cpuset:/\n0::/user.slice/a:b\n");
        assert_eq!(v[0], (3, "cpuset".into(), "/".into()));
        assert_eq!(v[1], (0, String::new(), "/user.slice/a:b".into()));
    }

    #[test]
    fn processes_are_found_by_name_in_a_fixture_tree() {
        let dir = tempfile::tempdir().unwrap();
        for (pid, comm) in [(10, "memcached"), (11, "bash"), (12, "memcached")] {
            let d = dir.path().join(pid.to_string());
            std::fs::create_dir_all(d.join("task").join(pid.to_string())).unwrap();
            std::fs::write(d.join("comm"), format!("{comm}\n")).unwrap();
        }
        std::fs::create_dir_all(dir.path().join("self")).unwrap();
        let p = Procfs::new(dir.path());
        assert_eq!(p.pids_named("memcached").unwrap(), vec![10, 12]);
        assert_eq!(p.threads(12), vec![12]);
        assert!(p.stat(99).is_none());
    }

    #[test]
    fn this_process_reads_from_the_real_proc() {
        let p = Procfs::new("/proc");
        let me = std::process::id();
        let s = p.stat(me).unwrap();
        assert!(s.rss_bytes > 0 && s.threads >= 1);
        assert!(p.threads(me).contains(&me));
    }
}
