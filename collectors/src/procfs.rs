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
//! `ID:CONTROLLERS:PATH` line per hierarchy; `<pid>/status` the effective uid (second
//! field of `Uid:`); `<pid>/exe` links to the executable (a kernel thread has none, an
//! unlinked one ends in ` (deleted)`); `<proc>/stat` holds the boot time (`btime`).
//!
//! Matching helpers ([`ProcIndex`], [`Procfs::vet`], [`read_pid_file`]): the daemon scans
//! `/proc` once per tick ([`Procfs::scan`]) and every `process_name` matcher looks names
//! up in that index. A found process is refused when it is pid 1, a kernel thread or
//! cohabit itself, or when it does not run as the configured user or executable
//! ([`Refusal`]). A pid file is believed only if it is a regular file owned by root or the
//! service's user that group and others cannot write, and only for a process that was
//! already running when the file was last written ([`PidFileRefusal`]).

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use procfs::process::{Process, Stat};
use procfs::{FromBufRead, FromRead, FromReadSI, ProcError, WithCurrentSystemInfo};
use procfs::{KernelStats, ProcessCGroups};

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

    /// Every process now, indexed by command name: one pass over the proc root that serves
    /// every matcher of a tick. A process that has exited and waits to be reaped (a
    /// zombie) is left out: it runs nothing, and the kernel shows it in every hierarchy's
    /// root, so a matcher that found one would take the service for one cohabit cannot
    /// manage (a batch job's killed worker, not yet reaped, stopped a daemon's start).
    pub fn scan(&self) -> Result<ProcIndex, IoError> {
        let mut index = ProcIndex::default();
        for p in self.processes()? {
            let (Ok(stat), Ok(pid)) = (p.stat(), u32::try_from(p.pid())) else {
                continue; // gone while listing
            };
            if !exited(&stat) {
                index.insert(proc_entry(pid, stat));
            }
        }
        Ok(index)
    }

    /// [`Self::scan`], reusing `previous`'s entries for pids it already had: one directory
    /// listing plus a `stat` read for each *new* pid, instead of a read per process. A
    /// reused pid has a new start time, but its entry is only reused while the pid stays
    /// listed; a process that `exec`s keeps its pid and its old `comm` here until the next
    /// full [`Self::scan`], so callers rescan in full now and then (the daemon: every
    /// second).
    pub fn scan_since(&self, previous: &ProcIndex) -> Result<ProcIndex, IoError> {
        let listing =
            std::fs::read_dir(&self.root).map_err(|e| IoError::new("listing", &self.root, e))?;
        let mut index = ProcIndex::default();
        for entry in listing.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            match previous.get(pid) {
                Some(known) => index.insert(known.clone()),
                None => {
                    if let Some(e) = self.entry(pid) {
                        index.insert(e);
                    }
                }
            }
        }
        Ok(index)
    }

    /// One process as [`Self::scan`] would index it, if it exists (for a pid found elsewhere,
    /// such as in a cgroup, after the scan).
    pub fn entry(&self, pid: u32) -> Option<ProcEntry> {
        let stat = self.process(pid)?.stat().ok()?;
        (!exited(&stat)).then(|| proc_entry(pid, stat))
    }

    /// The effective uid of a process (`Uid:` in `status`), if it still exists.
    pub fn euid(&self, pid: u32) -> Option<u32> {
        self.process(pid)?.status().ok().map(|s| s.euid)
    }

    /// The executable of a process, without the ` (deleted)` the kernel appends once the
    /// file was replaced; `None` for a kernel thread or a process that is gone.
    pub fn exe(&self, pid: u32) -> Option<PathBuf> {
        let exe = self.process(pid)?.exe().ok()?;
        let text = exe.to_str()?;
        Some(PathBuf::from(
            text.strip_suffix(" (deleted)").unwrap_or(text),
        ))
    }

    /// When the host booted (`btime` in `<proc>/stat`).
    pub fn boot_time(&self) -> Option<SystemTime> {
        let path = self.root.join("stat");
        let stats = KernelStats::from_file(&path, procfs::current_system_info()).ok()?;
        SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(stats.btime))
    }

    /// Whether a found process may be taken as the service's: never pid 1, a kernel thread
    /// or `cohabit_pid` (cohabit itself); and, when `want` says so, only one running as its
    /// user and executable. Reads `status` and `exe` only for what `want` asks.
    pub fn vet(&self, p: &ProcEntry, cohabit_pid: u32, want: &Constraint) -> Result<(), Refusal> {
        never_moved(p, cohabit_pid)?;
        if let Some(uid) = want.uid {
            match self.euid(p.pid) {
                Some(actual) if actual == uid => {}
                actual => return Err(Refusal::WrongUser { uid: actual }),
            }
        }
        if let Some(exe) = &want.exe {
            match self.exe(p.pid) {
                Some(actual) if actual == *exe => {}
                actual => return Err(Refusal::WrongExe { exe: actual }),
            }
        }
        Ok(())
    }
}

/// The kernel's flag for a kernel thread in `stat` field 9 (`PF_KTHREAD`,
/// `include/linux/sched.h`).
const PF_KTHREAD: u32 = 0x0020_0000;

/// Whether `stat` is that of a process that has exited (`Z`, a zombie waiting to be
/// reaped; `X`/`x`, dead): listed in the proc root, running nothing.
fn exited(stat: &Stat) -> bool {
    matches!(stat.state, 'Z' | 'X' | 'x')
}

fn proc_entry(pid: u32, stat: Stat) -> ProcEntry {
    ProcEntry {
        pid,
        ppid: u32::try_from(stat.ppid).unwrap_or(0),
        start_ticks: stat.starttime,
        kernel_thread: stat.flags & PF_KTHREAD != 0,
        comm: stat.comm,
    }
}

/// One process as a scan saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcEntry {
    /// Process id.
    pub pid: u32,
    /// Parent process id (2, `kthreadd`, for kernel threads).
    pub ppid: u32,
    /// Command name (`comm`, at most 15 bytes).
    pub comm: String,
    /// Start time after boot, in clock ticks.
    pub start_ticks: u64,
    /// Whether the kernel flags it as a kernel thread.
    pub kernel_thread: bool,
}

/// Every process at one instant, by pid and by command name.
#[derive(Debug, Clone, Default)]
pub struct ProcIndex {
    by_pid: BTreeMap<u32, ProcEntry>,
    by_comm: HashMap<String, Vec<u32>>,
}

impl ProcIndex {
    /// Adds a process.
    pub fn insert(&mut self, p: ProcEntry) {
        self.by_comm.entry(p.comm.clone()).or_default().push(p.pid);
        self.by_pid.insert(p.pid, p);
    }

    /// The process `pid`, if it was there.
    pub fn get(&self, pid: u32) -> Option<&ProcEntry> {
        self.by_pid.get(&pid)
    }

    /// The processes whose command name is exactly `comm`.
    pub fn named<'a>(&'a self, comm: &str) -> impl Iterator<Item = &'a ProcEntry> + 'a {
        self.by_comm
            .get(comm)
            .into_iter()
            .flatten()
            .filter_map(|pid| self.by_pid.get(pid))
    }

    /// How many processes there were.
    pub fn len(&self) -> usize {
        self.by_pid.len()
    }

    /// Whether there were none.
    pub fn is_empty(&self) -> bool {
        self.by_pid.is_empty()
    }
}

/// What a matched process must also be, besides found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Constraint {
    /// Its effective uid.
    pub uid: Option<u32>,
    /// Its executable.
    pub exe: Option<PathBuf>,
}

/// Why a found process is not taken as the service's.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Refusal {
    /// pid 1: init is never moved.
    Init,
    /// A kernel thread.
    KernelThread,
    /// cohabit itself.
    Cohabit,
    /// It runs as another user (`None`: it could not be read).
    WrongUser {
        /// Its effective uid.
        uid: Option<u32>,
    },
    /// It runs another executable (`None`: it has none, or it could not be read).
    WrongExe {
        /// Its executable.
        exe: Option<PathBuf>,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Init => f.write_str("it is pid 1 (init), which is never moved"),
            Refusal::KernelThread => f.write_str("it is a kernel thread"),
            Refusal::Cohabit => f.write_str("it is cohabit itself"),
            Refusal::WrongUser { uid: Some(u) } => {
                write!(f, "it runs as uid {u}, not the configured user")
            }
            Refusal::WrongUser { uid: None } => f.write_str("its user could not be read"),
            Refusal::WrongExe { exe: Some(e) } => {
                write!(f, "it runs {}, not the configured exe", e.display())
            }
            Refusal::WrongExe { exe: None } => f.write_str("its executable could not be read"),
        }
    }
}

/// The processes no matcher may take, whatever the configuration: pid 1, kernel threads
/// (the flag, or `kthreadd` and its children) and cohabit itself.
pub fn never_moved(p: &ProcEntry, cohabit_pid: u32) -> Result<(), Refusal> {
    if p.pid == 1 {
        Err(Refusal::Init)
    } else if p.kernel_thread || p.pid == 2 || p.ppid == 2 {
        Err(Refusal::KernelThread)
    } else if p.pid == cohabit_pid {
        Err(Refusal::Cohabit)
    } else {
        Ok(())
    }
}

/// A believed pid file: the pid it holds, who owns it and when it was last written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PidFile {
    /// The pid.
    pub pid: u32,
    /// The file's owner (root or the service's user: [`read_pid_file`]).
    pub owner: u32,
    /// Its modification time.
    pub written: SystemTime,
}

impl PidFile {
    /// Whether the process it names may be taken: it must run as `user` (`match.user`)
    /// when one is configured, else as the file's owner. A file's owner can write any pid
    /// in it, so without this a service's user could hand cohabit another user's process
    /// (an old sshd, older than the file, passes the staleness check).
    pub fn check_process_owner(
        &self,
        process_uid: Option<u32>,
        user: Option<u32>,
    ) -> Result<(), PidFileRefusal> {
        let expected = user.unwrap_or(self.owner);
        if process_uid == Some(expected) {
            Ok(())
        } else {
            Err(PidFileRefusal::ProcessOwner {
                uid: process_uid,
                expected,
            })
        }
    }
}

/// Why a pid file is not believed.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PidFileRefusal {
    /// It cannot be opened (absent, or a symbolic link).
    Unreadable {
        /// The OS error.
        error: String,
    },
    /// Not a regular file.
    NotRegular,
    /// Owned by someone other than root and the service's user.
    Owner {
        /// Its owner.
        uid: u32,
    },
    /// Group or others may write it.
    Writable {
        /// Its permission bits.
        mode: u32,
    },
    /// It does not hold one pid.
    NotAPid,
    /// The process started after the file was written: the pid was reused.
    Stale,
    /// The process it names runs as another user than the one expected (`match.user`, else
    /// the file's owner; `None`: its user could not be read).
    ProcessOwner {
        /// The process's effective uid.
        uid: Option<u32>,
        /// The uid it had to run as.
        expected: u32,
    },
}

impl std::fmt::Display for PidFileRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PidFileRefusal::Unreadable { error } => write!(f, "it cannot be opened ({error})"),
            PidFileRefusal::NotRegular => f.write_str("it is not a regular file"),
            PidFileRefusal::Owner { uid } => write!(
                f,
                "it is owned by uid {uid}, not root or the service's user"
            ),
            PidFileRefusal::Writable { mode } => {
                write!(f, "its mode {mode:o} lets group or others write it")
            }
            PidFileRefusal::NotAPid => f.write_str("it does not hold a pid"),
            PidFileRefusal::Stale => {
                f.write_str("its process started after the file was written (a reused pid)")
            }
            PidFileRefusal::ProcessOwner {
                uid: Some(uid),
                expected,
            } => write!(
                f,
                "its process runs as uid {uid}, not uid {expected} (match.user, else the file's owner)"
            ),
            PidFileRefusal::ProcessOwner { uid: None, .. } => {
                f.write_str("the user of its process could not be read")
            }
        }
    }
}

/// Reads a pid file without following a symbolic link at its path: a regular file owned
/// by root or by `user`, that group and others cannot write, holding one pid.
pub fn read_pid_file(path: &Path, user: Option<u32>) -> Result<PidFile, PidFileRefusal> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| PidFileRefusal::Unreadable {
            error: e.to_string(),
        })?;
    let meta = file.metadata().map_err(|e| PidFileRefusal::Unreadable {
        error: e.to_string(),
    })?;
    if !meta.file_type().is_file() {
        return Err(PidFileRefusal::NotRegular);
    }
    if meta.uid() != 0 && Some(meta.uid()) != user {
        return Err(PidFileRefusal::Owner { uid: meta.uid() });
    }
    if meta.mode() & 0o022 != 0 {
        return Err(PidFileRefusal::Writable {
            mode: meta.mode() & 0o7777,
        });
    }
    let mut text = String::new();
    file.take(64)
        .read_to_string(&mut text)
        .map_err(|_| PidFileRefusal::NotAPid)?;
    let pid = text
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or(PidFileRefusal::NotAPid)?;
    let written = meta.modified().map_err(|e| PidFileRefusal::Unreadable {
        error: e.to_string(),
    })?;
    Ok(PidFile {
        pid,
        owner: meta.uid(),
        written,
    })
}

/// Slack for comparing a process's start with a pid file's time: the boot time is whole
/// seconds, and the clock may be adjusted after boot.
const START_SLACK: Duration = Duration::from_secs(2);

/// Whether the process started after `file` was written, which means the pid was reused
/// after the service that wrote the file died. `start_ticks` is the process's start after
/// `boot`, in `clk_tck` ticks. A clock step forward larger than [`START_SLACK`] since the
/// service started makes its file look stale too.
pub fn started_after(file: &PidFile, start_ticks: u64, clk_tck: u64, boot: SystemTime) -> bool {
    let tck = clk_tck.max(1);
    let since_boot = Duration::from_secs(start_ticks / tck)
        + Duration::from_nanos((start_ticks % tck) * 1_000_000_000 / tck);
    boot + since_boot > file.written + START_SLACK
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
    use std::path::{Path, PathBuf};

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
        /// Parent process id.
        pub ppid: u32,
        /// Real, effective, saved and filesystem uid (one value for all four).
        pub uid: u32,
        /// The `exe` link's target (`None`: no link, as for a kernel thread).
        pub exe: Option<PathBuf>,
        /// Sets the kernel-thread flag in `stat`.
        pub kernel_thread: bool,
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
                ppid: 1,
                uid: 0,
                exe: Some(PathBuf::from(format!("/usr/bin/{comm}"))),
                kernel_thread: false,
            }
        }

        /// A kernel thread `pid` named `comm`: child of `kthreadd`, flagged, no `exe`.
        pub fn kernel_thread(pid: u32, comm: &str) -> Self {
            Self {
                ppid: 2,
                exe: None,
                kernel_thread: true,
                ..Self::new(pid, comm)
            }
        }

        /// The `stat` line the kernel would write (52 fields, Linux 5.x).
        pub fn stat_line(&self) -> String {
            let n = 1 + self.threads.len();
            format!(
                "{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 {flags} 100 0 0 0 {u} {s} 0 0 20 0 {n} 0 {start} 10000000 {rss} 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n",
                pid = self.pid,
                comm = self.comm,
                ppid = self.ppid,
                flags = 0x0040_0100 | if self.kernel_thread { super::PF_KTHREAD } else { 0 },
                u = self.utime,
                s = self.stime,
                start = self.start_ticks,
                rss = self.rss_pages,
            )
        }

        /// The `status` text the kernel would write (the fields the `procfs` crate needs).
        pub fn status_text(&self) -> String {
            let (pid, uid) = (self.pid, self.uid);
            format!(
                "Name:\t{comm}\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t{pid}\nNgid:\t0\nPid:\t{pid}\nPPid:\t{ppid}\nTracerPid:\t0\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{uid}\t{uid}\t{uid}\t{uid}\nFDSize:\t64\nGroups:\t\nThreads:\t{n}\nSigQ:\t0/63412\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\nSigCgt:\t0000000000000000\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapBnd:\t000001ffffffffff\nCapAmb:\t0000000000000000\nNoNewPrivs:\t0\nSeccomp:\t0\n",
                comm = self.comm,
                ppid = self.ppid,
                n = 1 + self.threads.len(),
            )
        }

        /// Writes `<proc_root>/<pid>/{stat,status,comm,cgroup,exe,task/<tid>/stat}`.
        pub fn write(&self, proc_root: &Path) -> io::Result<()> {
            let dir = proc_root.join(self.pid.to_string());
            for tid in std::iter::once(self.pid).chain(self.threads.iter().copied()) {
                let t = dir.join("task").join(tid.to_string());
                std::fs::create_dir_all(&t)?;
                std::fs::write(t.join("stat"), self.stat_line())?;
            }
            std::fs::write(dir.join("stat"), self.stat_line())?;
            std::fs::write(dir.join("comm"), format!("{}\n", self.comm))?;
            std::fs::write(dir.join("status"), self.status_text())?;
            let exe = dir.join("exe");
            match std::fs::remove_file(&exe) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            if let Some(target) = &self.exe {
                std::os::unix::fs::symlink(target, &exe)?;
            }
            std::fs::write(dir.join("cgroup"), &self.cgroup)
        }
    }

    /// Writes `<proc_root>/stat` with the boot time `btime` (seconds since the epoch).
    pub fn write_boot_time(proc_root: &Path, btime: u64) -> io::Result<()> {
        std::fs::create_dir_all(proc_root)?;
        std::fs::write(
            proc_root.join("stat"),
            format!("cpu  0 0 0 0 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\nctxt 0\nbtime {btime}\nprocesses 1\nprocs_running 1\nprocs_blocked 0\n"),
        )
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
    fn an_incremental_scan_reads_only_new_pids_and_drops_gone_ones() {
        let dir = tempfile::tempdir().unwrap();
        for (pid, comm) in [(10, "memcached"), (11, "bash")] {
            FakeProcess::new(pid, comm).write(dir.path()).unwrap();
        }
        let p = Procfs::new(dir.path());
        let first = p.scan().unwrap();
        // 10 renames itself (seen only by a full scan), 11 exits, 12 appears.
        std::fs::remove_dir_all(dir.path().join("11")).unwrap();
        std::fs::remove_dir_all(dir.path().join("10")).unwrap();
        FakeProcess::new(10, "renamed").write(dir.path()).unwrap();
        FakeProcess::new(12, "nginx").write(dir.path()).unwrap();
        let next = p.scan_since(&first).unwrap();
        assert_eq!(next.len(), 2);
        assert_eq!(
            next.get(10).unwrap().comm,
            "memcached",
            "known pids are reused"
        );
        assert!(next.get(11).is_none(), "gone pids are dropped");
        assert_eq!(next.get(12).unwrap().comm, "nginx", "new pids are read");
        assert_eq!(p.scan().unwrap().get(10).unwrap().comm, "renamed");
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

    fn tree(procs: &[FakeProcess]) -> (tempfile::TempDir, Procfs) {
        let dir = tempfile::tempdir().unwrap();
        for p in procs {
            p.write(dir.path()).unwrap();
        }
        let procfs = Procfs::new(dir.path());
        (dir, procfs)
    }

    #[test]
    fn a_zombie_is_not_indexed() {
        // A killed worker not yet reaped: the kernel lists it, in every hierarchy's root.
        let mut zombie = FakeProcess::new(11, "stress-ng-cpu");
        zombie.cgroup = "4:cpuset:/\n0::/\n".into();
        let (dir, p) = tree(&[FakeProcess::new(10, "stress-ng-cpu"), zombie]);
        let stat = dir.path().join("11").join("stat");
        let line = std::fs::read_to_string(&stat).unwrap();
        std::fs::write(&stat, line.replacen(") S ", ") Z ", 1)).unwrap();
        let index = p.scan().unwrap();
        let named: Vec<u32> = index.named("stress-ng-cpu").map(|e| e.pid).collect();
        assert_eq!(named, vec![10]);
        assert!(p.entry(11).is_none() && p.entry(10).is_some());
        // The incremental scan reads a new pid the same way.
        let next = p.scan_since(&ProcIndex::default()).unwrap();
        assert!(next.get(11).is_none() && next.get(10).is_some());
    }

    #[test]
    fn one_scan_indexes_every_process_by_name() {
        let mut other = FakeProcess::new(12, "memcached");
        other.ppid = 11;
        let (_dir, p) = tree(&[
            FakeProcess::new(10, "memcached"),
            FakeProcess::new(11, "bash"),
            other,
            FakeProcess::kernel_thread(13, "kworker/0:1"),
        ]);
        let index = p.scan().unwrap();
        assert_eq!(index.len(), 4);
        let named: Vec<(u32, u32)> = index.named("memcached").map(|e| (e.pid, e.ppid)).collect();
        assert_eq!(named, vec![(10, 1), (12, 11)]);
        assert_eq!(index.named("nginx").count(), 0);
        let k = index.get(13).unwrap();
        assert!(k.kernel_thread && k.ppid == 2, "{k:?}");
        assert_eq!(index.get(10).unwrap().start_ticks, 1000);
    }

    #[test]
    fn a_process_of_another_user_or_executable_is_refused() {
        let mut theirs = FakeProcess::new(10, "memcached");
        theirs.uid = 1000;
        theirs.exe = Some("/home/mallory/memcached".into());
        let mut ours = FakeProcess::new(11, "memcached");
        ours.uid = 999;
        let mut replaced = FakeProcess::new(12, "memcached");
        replaced.uid = 999;
        replaced.exe = Some("/usr/bin/memcached (deleted)".into());
        let (_dir, p) = tree(&[theirs, ours, replaced]);
        let index = p.scan().unwrap();
        let want = Constraint {
            uid: Some(999),
            exe: Some("/usr/bin/memcached".into()),
        };
        let vet = |pid| p.vet(index.get(pid).unwrap(), 4242, &want);
        assert_eq!(vet(10), Err(Refusal::WrongUser { uid: Some(1000) }));
        assert_eq!(vet(11), Ok(()));
        assert_eq!(vet(12), Ok(()), "an upgraded binary is still the same path");
        let only_exe = Constraint {
            uid: None,
            exe: Some("/usr/bin/memcached".into()),
        };
        assert_eq!(
            p.vet(index.get(10).unwrap(), 4242, &only_exe),
            Err(Refusal::WrongExe {
                exe: Some("/home/mallory/memcached".into())
            })
        );
        assert!(vet(10).unwrap_err().to_string().contains("uid 1000"));
    }

    #[test]
    fn init_kernel_threads_and_cohabit_are_never_moved() {
        let (_dir, p) = tree(&[
            FakeProcess::new(1, "memcached"),
            FakeProcess::kernel_thread(2, "kthreadd"),
            FakeProcess::kernel_thread(50, "memcached"),
            FakeProcess::new(77, "memcached"),
            FakeProcess::new(78, "memcached"),
        ]);
        let index = p.scan().unwrap();
        let any = Constraint::default();
        let vet = |pid| p.vet(index.get(pid).unwrap(), 77, &any);
        assert_eq!(vet(1), Err(Refusal::Init));
        assert_eq!(vet(2), Err(Refusal::KernelThread));
        assert_eq!(vet(50), Err(Refusal::KernelThread));
        assert_eq!(vet(77), Err(Refusal::Cohabit));
        assert_eq!(vet(78), Ok(()));
        // A child of kthreadd without the flag (an older kernel) is one too.
        let mut child = index.get(78).unwrap().clone();
        child.ppid = 2;
        assert_eq!(never_moved(&child, 77), Err(Refusal::KernelThread));
    }

    fn pid_file(dir: &Path, text: &str, mode: u32) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("svc.pid");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn a_pid_file_must_be_a_private_regular_file_holding_a_pid() {
        let dir = tempfile::tempdir().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        let ok = pid_file(dir.path(), "1234\n", 0o644);
        let read = read_pid_file(&ok, Some(me)).unwrap();
        assert_eq!((read.pid, read.owner), (1234, me));
        let open = pid_file(dir.path(), "1234\n", 0o666);
        assert_eq!(
            read_pid_file(&open, Some(me)),
            Err(PidFileRefusal::Writable { mode: 0o666 })
        );
        let group = pid_file(dir.path(), "1234\n", 0o664);
        assert!(matches!(
            read_pid_file(&group, Some(me)),
            Err(PidFileRefusal::Writable { .. })
        ));
        for junk in ["", "12 13", "-5", "0", "pid"] {
            let f = pid_file(dir.path(), junk, 0o644);
            assert_eq!(
                read_pid_file(&f, Some(me)),
                Err(PidFileRefusal::NotAPid),
                "{junk:?}"
            );
        }
        let link = dir.path().join("link.pid");
        let target = pid_file(dir.path(), "1234", 0o644);
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(matches!(
            read_pid_file(&link, Some(me)),
            Err(PidFileRefusal::Unreadable { .. })
        ));
        assert_eq!(
            read_pid_file(dir.path(), Some(me)),
            Err(PidFileRefusal::NotRegular)
        );
        assert!(PidFileRefusal::Writable { mode: 0o666 }
            .to_string()
            .contains("666"));
    }

    #[test]
    fn a_pid_file_of_another_user_is_refused_as_root() {
        if !nix::unistd::geteuid().is_root() {
            cohabit_testkit::skip(
                cohabit_testkit::Need::Root,
                "needs root to give the pid file another owner",
            );
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let f = pid_file(dir.path(), "1234", 0o644);
        std::os::unix::fs::chown(&f, Some(1000), Some(1000)).unwrap();
        assert_eq!(
            read_pid_file(&f, Some(999)),
            Err(PidFileRefusal::Owner { uid: 1000 })
        );
        assert_eq!(
            read_pid_file(&f, None),
            Err(PidFileRefusal::Owner { uid: 1000 })
        );
        assert_eq!(read_pid_file(&f, Some(1000)).unwrap().pid, 1234);
        std::os::unix::fs::chown(&f, Some(0), Some(0)).unwrap();
        assert_eq!(
            read_pid_file(&f, Some(999)).unwrap().pid,
            1234,
            "root's is fine"
        );
    }

    #[test]
    fn a_process_that_started_after_its_pid_file_was_written_is_stale() {
        let boot = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let file = PidFile {
            pid: 10,
            owner: 0,
            written: boot + Duration::from_secs(60),
        };
        // 100 ticks a second: started 59.5 s after boot, wrote the file at 60 s.
        assert!(!started_after(&file, 5_950, 100, boot));
        // Within the slack.
        assert!(!started_after(&file, 6_150, 100, boot));
        // Started 10 minutes later: the pid was reused.
        assert!(started_after(&file, 66_000, 100, boot));
    }

    #[test]
    fn a_pid_file_names_only_a_process_of_its_owner_or_the_configured_user() {
        let file = PidFile {
            pid: 10,
            owner: 1000,
            written: SystemTime::UNIX_EPOCH,
        };
        // Its owner's process; an old sshd (root's) it names is not taken.
        assert_eq!(file.check_process_owner(Some(1000), None), Ok(()));
        assert_eq!(
            file.check_process_owner(Some(0), None),
            Err(PidFileRefusal::ProcessOwner {
                uid: Some(0),
                expected: 1000
            })
        );
        // With match.user, that user's process, whoever (root or the user) owns the file.
        let roots = PidFile { owner: 0, ..file };
        assert_eq!(roots.check_process_owner(Some(999), Some(999)), Ok(()));
        assert!(roots.check_process_owner(Some(0), Some(999)).is_err());
        assert!(file.check_process_owner(Some(1000), Some(999)).is_err());
        // A process whose user cannot be read is not taken.
        assert!(file.check_process_owner(None, None).is_err());
        assert!(PidFileRefusal::ProcessOwner {
            uid: Some(0),
            expected: 1000
        }
        .to_string()
        .contains("runs as uid 0, not uid 1000"));
    }

    #[test]
    fn the_boot_time_comes_from_the_stat_file() {
        let dir = tempfile::tempdir().unwrap();
        super::fake::write_boot_time(dir.path(), 1_700_000_000).unwrap();
        assert_eq!(
            Procfs::new(dir.path()).boot_time(),
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        assert!(Procfs::new("/proc").boot_time().is_some());
        assert!(Procfs::new(dir.path().join("none")).boot_time().is_none());
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
