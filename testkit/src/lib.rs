//! The one skip gate for tests that need something a machine may lack: root with writable
//! cgroups, a program (memcached, nginx, redis-server, stress-ng, Chromium), or a fact of
//! the machine (a kernel feature, `mkfifo`).
//!
//! Problem: a test that returns early when its host lacks something passes green, so a green
//! run does not say whether it ran.
//!
//! Approach: every such test asks [`skip`] (or a finder that calls it). A skip
//! - prints `skipped: why`;
//! - appends one line to the file named by [`SKIP_LOG_ENV`], when set, so that
//!   `scripts/test.sh` can say at the end how many tests skipped and why;
//! - panics instead where the environment declares the thing present: [`REQUIRE_ROOT_ENV`]`=1`
//!   for [`Need::Root`], the comma-separated [`REQUIRE_PROGRAMS_ENV`] for
//!   [`Need::Program`]. `.ci/run` sets both from what it checked and installed, so in CI a
//!   green run means those tests ran. [`Need::Machine`] is never required: CI promises no
//!   kernel version or tool beyond those it names.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Set to `1` where the tests run as root with a writable cgroup tree (cgroup v1 with
/// cpuset and cpu on the project's machines): a [`Need::Root`] skip then fails.
pub const REQUIRE_ROOT_ENV: &str = "COHABIT_REQUIRE_ROOT_TESTS";
/// Programs the environment declares installed, comma-separated (`chromium,memcached`): a
/// [`Need::Program`] skip for one of them then fails.
pub const REQUIRE_PROGRAMS_ENV: &str = "COHABIT_REQUIRE_PROGRAMS";
/// A file to which each skip appends a line: `need<TAB>test<TAB>why`.
pub const SKIP_LOG_ENV: &str = "COHABIT_SKIP_LOG";

/// What a skipped test lacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Root with writable cgroups (and what comes with it on CI's machines: cgroup v1,
    /// two CPUs, a host free of a previous run's leftovers).
    Root,
    /// A program, by the name [`REQUIRE_PROGRAMS_ENV`] lists it under.
    Program(&'static str),
    /// A fact of this machine no environment promises (a kernel feature, `mkfifo`, no
    /// service-account token): always a skip, counted like the others.
    Machine,
}

impl Need {
    /// The word the skip log and the summary use.
    pub fn label(self) -> String {
        match self {
            Need::Root => "root".into(),
            Need::Program(p) => format!("program:{p}"),
            Need::Machine => "machine".into(),
        }
    }
}

/// What the environment declares present, and where skips are recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gate {
    /// [`REQUIRE_ROOT_ENV`] is `1`.
    pub root: bool,
    /// The programs [`REQUIRE_PROGRAMS_ENV`] lists.
    pub programs: Vec<String>,
    /// [`SKIP_LOG_ENV`], when set.
    pub log: Option<PathBuf>,
}

impl Gate {
    /// Reads the three variables.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Builds the gate from a lookup of the three variables (the environment's, or a test's).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let programs = var(REQUIRE_PROGRAMS_ENV)
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect();
        Self {
            root: var(REQUIRE_ROOT_ENV).is_some_and(|v| v == "1"),
            programs,
            log: var(SKIP_LOG_ENV)
                .filter(|p| !p.is_empty())
                .map(PathBuf::from),
        }
    }

    /// The variable that declares `need` present, when this gate does.
    pub fn requires(&self, need: Need) -> Option<&'static str> {
        match need {
            Need::Root => self.root.then_some(REQUIRE_ROOT_ENV),
            Need::Program(p) => self
                .programs
                .iter()
                .any(|q| q == p)
                .then_some(REQUIRE_PROGRAMS_ENV),
            Need::Machine => None,
        }
    }

    /// Records a skip of `test` for lacking `need`: `Err` with the failure message where the
    /// environment declares `need` present; otherwise prints, appends to the log and `Ok`.
    pub fn record(&self, need: Need, test: &str, why: &str) -> Result<(), String> {
        if let Some(var) = self.requires(need) {
            return Err(format!(
                "{var} declares {} present, but: {why}",
                need.label()
            ));
        }
        println!("skipped: {why}");
        if let Some(log) = &self.log {
            append(log, &skip_line(need, test, why))
                .unwrap_or_else(|e| panic!("recording a skip in {}: {e}", log.display()));
        }
        Ok(())
    }
}

/// One line of the skip log: tabs and newlines in the parts become spaces.
pub fn skip_line(need: Need, test: &str, why: &str) -> String {
    let clean = |s: &str| s.replace(['\t', '\n', '\r'], " ");
    format!("{}\t{}\t{}\n", need.label(), clean(test), clean(why))
}

fn append(log: &Path, line: &str) -> std::io::Result<()> {
    // One `write` of a short line under O_APPEND: test binaries running at once do not
    // interleave their lines.
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?
        .write_all(line.as_bytes())
}

/// The running test, as `binary::test` (libtest names a test's thread after it; with one
/// test thread it is `main` and only the binary is known).
pub fn current_test() -> String {
    let exe = std::env::current_exe().ok();
    let binary = exe
        .as_deref()
        .and_then(Path::file_stem)
        .and_then(|s| s.to_str())
        .map(|s| s.rsplit_once('-').map_or(s, |(name, _hash)| name))
        .unwrap_or("?")
        .to_string();
    match std::thread::current().name() {
        Some(t) if t != "main" => format!("{binary}::{t}"),
        _ => binary,
    }
}

/// Reports that the running test cannot run here for lacking `need`: prints and records
/// `why`, or panics where the environment declares `need` present.
#[track_caller]
pub fn skip(need: Need, why: &str) {
    if let Err(failure) = Gate::from_env().record(need, &current_test(), why) {
        panic!("{failure}");
    }
}

/// True when this process runs as root (effective uid 0).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
}

/// `true` when root; otherwise [`skip`]s with `Need::Root` and `why`.
#[track_caller]
pub fn root_or_skip(why: &str) -> bool {
    let root = is_root();
    if !root {
        skip(Need::Root, &format!("not root: {why}"));
    }
    root
}

/// The first of `names` found on `PATH` or in the system directories (`/usr/sbin` holds
/// nginx and memcached on Debian, outside a user's `PATH`).
pub fn find_program(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/bin"].map(PathBuf::from))
        .collect();
    names
        .iter()
        .flat_map(|n| dirs.iter().map(move |d| d.join(n)))
        .find(|p| p.is_file())
}

/// The program `name` (found under any of `names`), or `None` after a
/// [`Need::Program`]`(name)` skip naming the Debian `package` that installs it.
#[track_caller]
pub fn program(name: &'static str, names: &[&str], package: &str) -> Option<PathBuf> {
    let found = find_program(names);
    if found.is_none() {
        skip(
            Need::Program(name),
            &format!("{name} is not installed (apt-get install {package})"),
        );
    }
    found
}

/// A headless-capable Chromium, or `None` after a skip (`Need::Program("chromium")`).
#[track_caller]
pub fn chromium() -> Option<PathBuf> {
    program(
        "chromium",
        &["chromium", "chromium-browser", "google-chrome"],
        "chromium",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(root: &str, programs: &str, log: Option<&Path>) -> Gate {
        let log = log.map(|p| p.display().to_string());
        Gate::from_vars(|k| match k {
            REQUIRE_ROOT_ENV => Some(root.to_string()),
            REQUIRE_PROGRAMS_ENV => Some(programs.to_string()),
            SKIP_LOG_ENV => log.clone(),
            _ => None,
        })
    }

    #[test]
    fn a_declared_need_turns_the_skip_into_a_failure_naming_the_variable() {
        let g = gate("1", "memcached, chromium", None);
        let e = g.record(Need::Root, "t", "not root").unwrap_err();
        assert!(
            e.contains(REQUIRE_ROOT_ENV) && e.contains("not root"),
            "{e}"
        );
        let e = g
            .record(Need::Program("chromium"), "t", "no chromium")
            .unwrap_err();
        assert!(e.contains(REQUIRE_PROGRAMS_ENV), "{e}");
    }

    #[test]
    fn an_undeclared_need_skips_and_a_machine_fact_is_never_required() {
        let g = gate("0", "memcached", None);
        assert_eq!(g.record(Need::Root, "t", "not root"), Ok(()));
        assert_eq!(g.record(Need::Program("nginx"), "t", "no nginx"), Ok(()));
        let all = gate("1", "memcached,nginx", None);
        assert_eq!(all.record(Need::Machine, "t", "no cpu.idle"), Ok(()));
    }

    #[test]
    fn each_skip_appends_one_line_with_its_need_test_and_reason() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("skips");
        let g = gate("", "", Some(&log));
        g.record(Need::Root, "quick::a", "not root").unwrap();
        g.record(Need::Program("nginx"), "probe::b", "no\tnginx\n")
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "root\tquick::a\tnot root\nprogram:nginx\tprobe::b\tno nginx \n"
        );
    }

    #[test]
    fn a_failure_is_not_recorded_as_a_skip() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("skips");
        let g = gate("1", "", Some(&log));
        assert!(g.record(Need::Root, "t", "not root").is_err());
        assert!(!log.exists());
    }

    #[test]
    fn the_current_test_is_named_after_its_thread() {
        let t = current_test();
        assert!(
            t.ends_with("::tests::the_current_test_is_named_after_its_thread") || !t.contains("::"),
            "{t}"
        );
    }
}
