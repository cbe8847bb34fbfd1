//! Which found processes are a service's (security review rows 2 and 24).
//!
//! Each tick `/proc` is scanned once ([`Procfs::scan`]); a `process_name` matcher looks its
//! name up in that index, a `pid_file` matcher reads its file ([`Vetting::pid_file`]), the
//! cgroup matchers list their cgroup. Every candidate is then vetted
//! ([`Vetting::keep`]): never pid 1, a kernel thread or cohabit itself, and, when the
//! service sets `match.user` or `match.exe`, only a process running as that user and
//! executable. A pid file is believed only if it is a private regular file owned by root
//! or the service's user, only for a process that was running when it was written, and
//! only for a process of `match.user` (without one, of the file's owner).
//!
//! A name or pid-file matcher without `match.user` is refused at start, except with
//! `--dry-run`, where it is a warning ([`require_users`]): any user can name a process.
//!
//! Each refusal is logged once, when it first happens, and again only if it stopped and
//! came back ([`Vetting::log`]).

use std::collections::BTreeSet;
use std::path::Path;

use cohabit_collectors::procfs::{
    read_pid_file, started_after, Constraint, PidFileRefusal, ProcIndex, Procfs, Refusal,
};
use cohabit_collectors::users::UserError;

use crate::spec::{ManagedService, ProcessConstraint, UnboundMatcher};

/// Refuses a service found by process name or pid file without `match.user`
/// ([`ManagedService::unbound_matcher`]); with `dry_run`, where nothing is changed, each is
/// a warning instead.
pub(super) fn require_users(
    services: &[ManagedService],
    dry_run: bool,
) -> Result<(), UnboundMatcher> {
    for unbound in services.iter().filter_map(ManagedService::unbound_matcher) {
        if !dry_run {
            return Err(unbound);
        }
        tracing::warn!(service = %unbound.service, "{unbound} (dry run: watching anyway)");
    }
    Ok(())
}

/// What one tick's vetting reads.
#[derive(Debug)]
pub(super) struct Tick<'a> {
    /// The proc root.
    pub procfs: &'a Procfs,
    /// This tick's scan.
    pub index: &'a ProcIndex,
    /// cohabit's own pid.
    pub cohabit_pid: u32,
    /// The unit of start times.
    pub clk_tck: u64,
}

/// Something not taken as a service's process.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Refused {
    /// A process, and why.
    Process(u32, Refusal),
    /// A pid file, and why.
    PidFile(PidFileRefusal),
}

/// One service's vetting: what its processes must be, and the refusals already logged.
#[derive(Debug)]
pub(super) struct Vetting {
    want: Constraint,
    logged: BTreeSet<Refused>,
    now: BTreeSet<Refused>,
}

impl Vetting {
    /// Resolves `match.user` (a name is looked up now, at start).
    pub fn new(c: &ProcessConstraint) -> Result<Self, UserError> {
        let uid = c.user.as_ref().map(|u| u.resolve()).transpose()?;
        Ok(Self {
            want: Constraint {
                uid,
                exe: c.exe.clone(),
            },
            logged: BTreeSet::new(),
            now: BTreeSet::new(),
        })
    }

    /// The pid in the pid file at `path`, if the file is to be believed and its process
    /// was running when it was written.
    pub fn pid_file(&mut self, path: &Path, t: &Tick<'_>) -> Vec<u32> {
        let file = match read_pid_file(path, self.want.uid) {
            Ok(f) => f,
            Err(PidFileRefusal::Unreadable { .. }) if !path.exists() => return vec![],
            Err(r) => {
                self.now.insert(Refused::PidFile(r));
                return vec![];
            }
        };
        let Some(p) = t
            .index
            .get(file.pid)
            .cloned()
            .or_else(|| t.procfs.entry(file.pid))
        else {
            return vec![]; // no such process (yet): nothing to refuse
        };
        // Without a boot time (a fixture tree without `stat`) staleness cannot be told.
        if let Some(boot) = t.procfs.boot_time() {
            if started_after(&file, p.start_ticks, t.clk_tck, boot) {
                self.now.insert(Refused::PidFile(PidFileRefusal::Stale));
                return vec![];
            }
        }
        if let Err(r) = file.check_process_owner(t.procfs.euid(file.pid), self.want.uid) {
            self.now.insert(Refused::PidFile(r));
            return vec![];
        }
        vec![file.pid]
    }

    /// The candidates that may be taken as the service's processes.
    pub fn keep(&mut self, candidates: Vec<u32>, t: &Tick<'_>) -> BTreeSet<u32> {
        let mut out = BTreeSet::new();
        for pid in candidates {
            let entry = t.index.get(pid).cloned().or_else(|| t.procfs.entry(pid));
            let Some(entry) = entry else {
                continue; // gone
            };
            match t.procfs.vet(&entry, t.cohabit_pid, &self.want) {
                Ok(()) => {
                    out.insert(pid);
                }
                Err(r) => {
                    self.now.insert(Refused::Process(pid, r));
                }
            }
        }
        out
    }

    /// Logs the refusals of this tick not logged before, and forgets those that ended.
    pub fn log(&mut self, service: &str, pid_file: Option<&Path>) {
        for r in self.now.difference(&self.logged) {
            match r {
                Refused::Process(pid, why) => {
                    tracing::warn!(service, pid, reason = %why, "process not taken as the service's");
                }
                Refused::PidFile(why) => {
                    let file = pid_file
                        .map(|p| p.display().to_string())
                        .unwrap_or_default();
                    tracing::warn!(service, pid_file = %file, reason = %why, "pid file not believed");
                }
            }
        }
        self.logged = std::mem::take(&mut self.now);
    }

    /// The refusals in force, as text.
    #[cfg(test)]
    pub fn refused(&self) -> Vec<String> {
        self.logged
            .iter()
            .map(|r| match r {
                Refused::Process(pid, why) => format!("pid {pid}: {why}"),
                Refused::PidFile(why) => format!("pid file: {why}"),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use cohabit_collectors::procfs::fake::{write_boot_time, FakeProcess};
    use cohabit_collectors::users::UserRef;

    use super::*;
    use crate::spec::Matcher;

    /// A fixture proc tree: `memcached` 10 run by uid 1000, `memcached` 11 by nobody
    /// (65534), pid 1, a kernel thread, and cohabit as pid 4242; booted at 1 000 000 s.
    fn tree() -> (tempfile::TempDir, Procfs, ProcIndex) {
        let dir = tempfile::tempdir().unwrap();
        let proc_root = dir.path().join("proc");
        let mut theirs = FakeProcess::new(10, "memcached");
        theirs.uid = 1000;
        let mut ours = FakeProcess::new(11, "memcached");
        ours.uid = 65534;
        for p in [
            theirs,
            ours,
            FakeProcess::new(1, "systemd"),
            FakeProcess::kernel_thread(20, "memcached"),
            FakeProcess::new(4242, "cohabit"),
        ] {
            p.write(&proc_root).unwrap();
        }
        write_boot_time(&proc_root, 1_000_000).unwrap();
        let procfs = Procfs::new(&proc_root);
        let index = procfs.scan().unwrap();
        (dir, procfs, index)
    }

    fn tick<'a>(procfs: &'a Procfs, index: &'a ProcIndex) -> Tick<'a> {
        Tick {
            procfs,
            index,
            cohabit_pid: 4242,
            clk_tck: 100,
        }
    }

    fn vetting(user: Option<&str>) -> Vetting {
        let c = ProcessConstraint {
            user: user.map(|u| UserRef::Name(u.into())),
            exe: None,
        };
        Vetting::new(&c).unwrap()
    }

    #[test]
    fn a_memcached_of_another_user_is_not_matched() {
        let (_dir, procfs, index) = tree();
        let t = tick(&procfs, &index);
        let named = |ix: &ProcIndex| ix.named("memcached").map(|p| p.pid).collect::<Vec<_>>();
        // Without a user, any memcached but the kernel thread.
        let mut any = vetting(None);
        assert_eq!(any.keep(named(&index), &t), BTreeSet::from([10, 11]));
        // user = "nobody" (65534): not uid 1000's.
        let mut v = vetting(Some("nobody"));
        assert_eq!(v.keep(named(&index), &t), BTreeSet::from([11]));
        v.log("kv", None);
        let refused = v.refused();
        assert!(
            refused
                .iter()
                .any(|r| r.contains("pid 10: it runs as uid 1000")),
            "{refused:?}"
        );
        assert!(refused
            .iter()
            .any(|r| r.contains("pid 20: it is a kernel thread")));
        // An unknown user stops the start.
        let e = Vetting::new(&ProcessConstraint {
            user: Some(UserRef::Name("no-such-user-cohabit".into())),
            exe: None,
        })
        .unwrap_err();
        assert!(e.to_string().contains("no-such-user-cohabit"));
    }

    fn pid_file(dir: &Path, text: &str, mode: u32) -> std::path::PathBuf {
        let path = dir.join("kv.pid");
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn a_pid_file_naming_init_or_cohabit_or_open_to_others_is_refused() {
        let (dir, procfs, index) = tree();
        let t = tick(&procfs, &index);
        let mut v = vetting(None);
        // pid 1: the file is fine, the process is refused, with the reason.
        let f = pid_file(dir.path(), "1\n", 0o644);
        let c = v.pid_file(&f, &t);
        assert_eq!(c, vec![1]);
        assert!(v.keep(c, &t).is_empty());
        v.log("kv", Some(&f));
        assert_eq!(
            v.refused(),
            vec!["pid 1: it is pid 1 (init), which is never moved"]
        );
        // cohabit itself.
        let f = pid_file(dir.path(), "4242\n", 0o644);
        let c = v.pid_file(&f, &t);
        assert!(v.keep(c, &t).is_empty());
        // Mode 0666: anyone could write any pid there.
        let mut v = vetting(Some("nobody"));
        let f = pid_file(dir.path(), "11\n", 0o666);
        assert!(v.pid_file(&f, &t).is_empty());
        v.log("kv", Some(&f));
        assert!(
            v.refused().iter().any(|r| r.contains("mode 666")),
            "{:?}",
            v.refused()
        );
        // A private file naming memcached 11, nobody's: taken.
        let f = pid_file(dir.path(), "11\n", 0o644);
        let c = v.pid_file(&f, &t);
        assert_eq!(v.keep(c, &t), BTreeSet::from([11]));
        v.log("kv", Some(&f));
        assert!(v.refused().is_empty(), "a refusal that ended is forgotten");
    }

    #[test]
    fn a_pid_file_older_than_its_process_is_stale() {
        let (dir, procfs, index) = tree();
        let t = tick(&procfs, &index);
        let mut v = vetting(Some("nobody"));
        let f = pid_file(dir.path(), "11\n", 0o644);
        // The fixture's processes started 10 s after a boot at 1 000 000 s; the file was
        // written long after: believed.
        assert_eq!(v.pid_file(&f, &t), vec![11]);
        // Written before the process started: its pid was reused.
        let before = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_001);
        std::fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(before)
            .unwrap();
        assert!(v.pid_file(&f, &t).is_empty());
        v.log("kv", Some(&f));
        assert!(v.refused()[0].contains("started after the file was written"));
        // A missing file is no refusal: the service is just not running.
        assert!(v.pid_file(&dir.path().join("none.pid"), &t).is_empty());
    }

    #[test]
    fn a_pid_file_naming_a_process_of_another_user_is_refused() {
        if !nix::unistd::geteuid().is_root() {
            cohabit_testkit::skip(
                cohabit_testkit::Need::Root,
                "needs root to own a pid file as root",
            );
            return;
        }
        let (dir, procfs, index) = tree();
        let t = tick(&procfs, &index);
        // Root's file (this test runs as root) naming memcached 11, nobody's: without
        // match.user the process must be the file's owner's, and it is not.
        let f = pid_file(dir.path(), "11\n", 0o644);
        let mut v = vetting(None);
        assert!(v.pid_file(&f, &t).is_empty());
        v.log("kv", Some(&f));
        assert_eq!(
            v.refused(),
            vec!["pid file: its process runs as uid 65534, not uid 0 (match.user, else the file's owner)"]
        );
        // With match.user = nobody, root's file may name nobody's process.
        assert_eq!(vetting(Some("nobody")).pid_file(&f, &t), vec![11]);
        // The service user's file naming an old process of another user (an sshd; here
        // memcached 10, uid 1000, older than the file): refused whatever the user.
        let f10 = pid_file(dir.path(), "10\n", 0o644);
        std::os::unix::fs::chown(&f10, Some(65534), Some(65534)).unwrap();
        let mut v = vetting(Some("nobody"));
        assert!(v.pid_file(&f10, &t).is_empty());
        v.log("kv", Some(&f10));
        assert!(
            v.refused()[0].contains("runs as uid 1000, not uid 65534"),
            "{:?}",
            v.refused()
        );
    }

    fn service(name: &str, matcher: Matcher, user: Option<u32>) -> ManagedService {
        ManagedService {
            name: name.into(),
            p99_target_ms: Some(1.0),
            matcher,
            constraint: ProcessConstraint {
                user: user.map(UserRef::Id),
                exe: None,
            },
            placement: crate::spec::Placement::InPlace,
            allow_unmanaged: false,
            latency: None,
            gpu: None,
            priority: 0,
        }
    }

    #[test]
    fn a_name_or_pid_file_matcher_without_a_user_is_refused_unless_dry_run() {
        use crate::spec::MatcherKey;
        let by_name = service("kv", Matcher::ProcessName("kv".into()), None);
        let by_file = service("web", Matcher::PidFile("/run/web.pid".into()), None);
        let by_unit = service("db", Matcher::SystemdUnit("db.service".into()), None);
        let bound = service("kv", Matcher::ProcessName("kv".into()), Some(999));
        let e = require_users(&[by_unit.clone(), by_name.clone()], false).unwrap_err();
        assert_eq!((e.service.as_str(), e.key), ("kv", MatcherKey::ProcessName));
        assert!(
            e.to_string()
                .starts_with("service kv: match.process_name without match.user"),
            "{e}"
        );
        let e = require_users(std::slice::from_ref(&by_file), false).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("service web: match.pid_file without match.user"),
            "{e}"
        );
        // Cgroup-like matchers need no user; a bound one passes; dry run only warns.
        require_users(&[by_unit, bound], false).unwrap();
        require_users(&[by_name, by_file], true).unwrap();
    }

    #[test]
    fn a_host_with_a_name_matcher_without_a_user_opens_only_for_a_dry_run() {
        let dir = tempfile::tempdir().unwrap();
        let cpu = dir.path().join("sys/devices/system/cpu");
        std::fs::create_dir_all(&cpu).unwrap();
        std::fs::write(cpu.join("online"), "0-1\n").unwrap();
        // No cgroups, no resctrl: nothing on this machine can be touched.
        let paths = cohabit_collectors::HostPaths {
            sys: dir.path().join("sys"),
            cgroup: dir.path().join("no-cgroup"),
            resctrl: Some(dir.path().join("no-resctrl")),
            ..cohabit_collectors::HostPaths::standard()
        };
        let kv = ManagedService {
            constraint: ProcessConstraint::default(),
            ..crate::testing::latency_critical(
                "kv",
                1.0,
                Matcher::ProcessName("kv".into()),
                crate::testing::udp_push(),
            )
        };
        let cfg = crate::testing::host(paths, vec![kv]);
        let e = crate::RealHost::open(cfg.clone(), false).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("service kv: match.process_name without match.user"),
            "{e}"
        );
        crate::RealHost::open(cfg, true).unwrap();
    }
}
