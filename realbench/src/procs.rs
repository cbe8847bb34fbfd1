//! Every process the benchmark starts, and the guarantee that they all stop.
//!
//! Each process starts in its own process group, inside one of the benchmark's cgroups
//! (a shell writes itself into the group, then `exec`s the program, so children start
//! inside too). Stopping is `SIGTERM` to the group, a grace period, then `SIGKILL` to the
//! group and to anything still listed in the benchmark's cgroups. [`Lab`] owns the
//! processes and the cgroup tree and cleans both when dropped, so an error, a panic or an
//! interruption (see [`crate::interrupt`]) leaves the host as it was.
//!
//! Only `SIGKILL` of the benchmark itself escapes that. For it, the lab keeps a list of its
//! process groups in a state directory (`/run/cohabit-realbench`), and
//! [`cleanup_leftovers`] (`cohabit-realbench cleanup`) stops them: the daemon first, with
//! `SIGTERM` so it restores the host, then the rest; the processes cohabit moved out of
//! the benchmark's cgroups are found by their process group.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cgroups::Tree;
use crate::sys;
use crate::Error;

/// A process the benchmark started.
#[derive(Debug)]
pub struct Proc {
    /// What it is, for messages.
    pub name: String,
    child: Child,
    /// Its stdout and stderr.
    pub log: PathBuf,
}

impl Proc {
    /// Its pid (also its process group).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it is still running (reaps it if not).
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The last lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }
}

/// The last `lines` lines of a file (empty if unreadable).
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Handle to a started process inside a [`Lab`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcId(usize);

/// The benchmark's processes and cgroups; dropping it stops and removes all of them.
#[derive(Debug)]
pub struct Lab {
    tree: Tree,
    state: PathBuf,
    procs: Vec<Proc>,
    /// Top-level cohabit cgroup directories that did not exist when the lab opened: if a
    /// daemon is killed before it restores the host, they are removed here.
    cohabit_dirs: Vec<PathBuf>,
    cleaned: bool,
}

/// How long a process group has between `SIGTERM` and `SIGKILL`.
const GRACE: Duration = Duration::from_secs(3);

impl Lab {
    /// Opens the lab: refuses if a previous run's groups still hold processes, removes
    /// empty leftovers, and creates the parent group. The list of process groups is kept
    /// in `state` (normally [`STATE_DIR`]).
    pub fn open(tree: Tree, state: &Path) -> Result<Self, Error> {
        if tree.parent_exists() || !recorded_groups(state).is_empty() {
            let mut left = live(&tree.all_procs());
            left.extend(recorded_groups(state).iter().flat_map(|(g, _)| members(*g)));
            if !left.is_empty() {
                return Err(Error::Host(format!(
                    "no other benchmark running: processes {left:?} are in the {} cgroups (another run, or a killed one: `cohabit-realbench cleanup` stops them)",
                    crate::cgroups::PARENT
                )));
            }
            tree.remove_all()?;
        }
        let cohabit_dirs = cohabit_parents(&tree)
            .into_iter()
            .filter(|d| !d.exists())
            .collect();
        tree.create_parent()?;
        std::fs::create_dir_all(state).map_err(crate::io_err("creating", state))?;
        let list = state.join(GROUPS_FILE);
        std::fs::write(&list, "").map_err(crate::io_err("writing", &list))?;
        Ok(Self {
            tree,
            state: state.to_path_buf(),
            procs: Vec::new(),
            cohabit_dirs,
            cleaned: false,
        })
    }

    /// The cgroup tree.
    pub fn tree(&self) -> &Tree {
        &self.tree
    }

    /// Starts `program args…` in its own process group inside cgroup `group` (created if
    /// needed), with stdout and stderr to `log`.
    pub fn spawn(
        &mut self,
        name: &str,
        group: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
        log: &Path,
    ) -> Result<ProcId, Error> {
        self.tree.create(group)?;
        let out = File::create(log).map_err(|source| Error::Io {
            what: "creating log",
            path: log.to_path_buf(),
            source,
        })?;
        let err = out.try_clone().map_err(|source| Error::Io {
            what: "creating log",
            path: log.to_path_buf(),
            source,
        })?;
        let script = format!("{} && exec \"$0\" \"$@\"", self.tree.join_command(group));
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(script)
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().map_err(|e| Error::Start {
            what: name.to_string(),
            detail: format!("{}: {e}", program.display()),
        })?;
        let list = self.state.join(GROUPS_FILE);
        let line = format!("{}\t{name}\n", child.id());
        let recorded = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&list)
            .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
        if let Err(e) = recorded {
            // The process runs; let cleanup stop it with the others.
            self.procs.push(Proc {
                name: name.to_string(),
                child,
                log: log.to_path_buf(),
            });
            return Err(crate::io_err("writing", &list)(e));
        }
        self.procs.push(Proc {
            name: name.to_string(),
            child,
            log: log.to_path_buf(),
        });
        Ok(ProcId(self.procs.len() - 1))
    }

    /// A started process.
    pub fn get(&mut self, id: ProcId) -> &mut Proc {
        &mut self.procs[id.0]
    }

    /// Sends `SIGTERM` to one process only (not its group) and waits up to `wait` for it to
    /// exit; `Some(exit code)` if it did. For the cohabit daemon, which restores the host on
    /// `SIGTERM`.
    pub fn terminate(&mut self, id: ProcId, wait: Duration) -> Option<i32> {
        let p = &mut self.procs[id.0];
        let _ = sys::kill(p.pid(), sys::SIGTERM);
        let t = Instant::now();
        loop {
            if let Ok(Some(status)) = p.child.try_wait() {
                return Some(status.code().unwrap_or(-1));
            }
            if t.elapsed() > wait {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits up to `wait` for a process to exit by itself; its exit code if it did.
    pub fn wait(&mut self, id: ProcId, wait: Duration) -> Result<Option<i32>, Error> {
        let t = Instant::now();
        loop {
            if let Ok(Some(status)) = self.procs[id.0].child.try_wait() {
                return Ok(Some(status.code().unwrap_or(-1)));
            }
            if t.elapsed() > wait {
                return Ok(None);
            }
            crate::interrupt::sleep(Duration::from_millis(50))?;
        }
    }

    /// Stops a process's whole group: `SIGTERM`, then `SIGKILL` after the grace period.
    pub fn stop(&mut self, id: ProcId) {
        stop_group(&mut self.procs[id.0]);
    }

    /// Stops every process in `group` and removes the group.
    pub fn stop_group_and_remove(&mut self, group: &str) -> Result<(), Error> {
        let in_group = self.tree.procs(group);
        for p in self.procs.iter_mut() {
            if in_group.contains(&p.pid()) {
                stop_group(p);
            }
        }
        kill_listed(&self.tree.procs(group));
        remove_when_empty(&self.tree, group)
    }

    /// Stops everything and removes every group; safe to call more than once. Returns what
    /// could not be cleaned.
    pub fn cleanup(&mut self) -> Vec<String> {
        if self.cleaned {
            return vec![];
        }
        self.cleaned = true;
        let mut problems = Vec::new();
        for p in self.procs.iter_mut().rev() {
            stop_group(p);
        }
        kill_listed(&self.tree.all_procs());
        for g in self.tree.groups() {
            if let Err(e) = remove_when_empty(&self.tree, &g) {
                problems.push(e.to_string());
            }
        }
        if let Err(e) = self.tree.remove_all() {
            problems.push(e.to_string());
        }
        for d in &self.cohabit_dirs {
            if let Err(e) = remove_tree(d) {
                problems.push(format!("removing {}: {e}", d.display()));
            }
        }
        let _ = std::fs::remove_file(self.state.join(GROUPS_FILE));
        let _ = std::fs::remove_dir(&self.state);
        problems
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for p in self.cleanup() {
            eprintln!("cohabit-realbench: cleanup: {p}");
        }
    }
}

/// Processes still alive among `pids`.
fn live(pids: &[u32]) -> Vec<u32> {
    pids.iter().copied().filter(|p| sys::alive(*p)).collect()
}

fn stop_group(p: &mut Proc) {
    let pgid = p.pid();
    if let Ok(Some(_)) = p.child.try_wait() {
        // The leader is gone; members of its group may not be.
        let _ = sys::kill_group(pgid, sys::SIGKILL);
        return;
    }
    let _ = sys::kill_group(pgid, sys::SIGTERM);
    let t = Instant::now();
    while t.elapsed() < GRACE {
        if let Ok(Some(_)) = p.child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = sys::kill_group(pgid, sys::SIGKILL);
    let _ = p.child.kill();
    let _ = p.child.wait();
}

fn kill_listed(pids: &[u32]) {
    for &pid in pids {
        if pid != std::process::id() {
            let _ = sys::kill(pid, sys::SIGKILL);
        }
    }
}

/// Removes a group once the kernel has emptied it (killed tasks leave it as they exit).
fn remove_when_empty(tree: &Tree, group: &str) -> Result<(), Error> {
    let t = Instant::now();
    loop {
        match tree.remove(group) {
            Ok(()) => return Ok(()),
            Err(e) if t.elapsed() > Duration::from_secs(5) => return Err(e),
            Err(_) => {
                kill_listed(&tree.procs(group));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// cohabit's own parent group in each cgroup hierarchy.
fn cohabit_parents(tree: &Tree) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = tree.mounts().iter().map(|m| m.join("cohabit")).collect();
    v.sort();
    v.dedup();
    v
}

/// Removes an empty cgroup directory tree, children first.
fn remove_tree(dir: &Path) -> std::io::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)?.filter_map(Result::ok) {
        if e.path().is_dir() {
            remove_tree(&e.path())?;
        }
    }
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Where the lab keeps its list of process groups.
pub const STATE_DIR: &str = "/run/cohabit-realbench";
const GROUPS_FILE: &str = "groups";

/// The process groups a lab recorded: (pgid, name).
fn recorded_groups(state: &Path) -> Vec<(u32, String)> {
    std::fs::read_to_string(state.join(GROUPS_FILE))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (g, n) = l.split_once('\t')?;
            Some((g.parse().ok()?, n.to_string()))
        })
        .collect()
}

/// Live members of process group `pgid`.
fn members(pgid: u32) -> Vec<u32> {
    sys::all_pids()
        .into_iter()
        .filter(|p| sys::pgid(*p) == Some(pgid) && sys::alive(*p))
        .collect()
}

/// Whether a process name is one the benchmark's processes run under.
fn ours(comm: &str) -> bool {
    comm.starts_with("rb-") || comm.starts_with("stress-ng") || comm == "cohabit"
}

/// Removes what a killed run left: stops the recorded daemon (`SIGTERM`, so it restores
/// the host), then every recorded process group whose members all carry the benchmark's
/// process names (a recycled group id is left alone), then anything in the benchmark's
/// cgroups; removes the cgroups and the list. Returns how many processes were stopped.
pub fn cleanup_leftovers(tree: &Tree, state: &Path) -> Result<usize, Error> {
    let groups = recorded_groups(state);
    let mut stopped: Vec<u32> = Vec::new();
    let safe = |g: u32| {
        let m = members(g);
        let all_ours = m.iter().all(|p| sys::comm(*p).is_some_and(|c| ours(&c)));
        (all_ours, m.len())
    };
    for (g, name) in groups.iter().filter(|(_, n)| n == "cohabit") {
        if let (true, n) = safe(*g) {
            if n > 0 {
                stopped.extend(members(*g));
                let _ = sys::kill_group(*g, sys::SIGTERM);
                let t = Instant::now();
                while !members(*g).is_empty() && t.elapsed() < Duration::from_secs(15) {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        } else {
            eprintln!(
                "cohabit-realbench: group {g} ({name}) now holds other processes; left alone"
            );
        }
    }
    for (g, name) in &groups {
        match safe(*g) {
            (true, n) if n > 0 => {
                stopped.extend(members(*g));
                let _ = sys::kill_group(*g, sys::SIGKILL);
            }
            (true, _) => {}
            (false, _) => {
                eprintln!(
                    "cohabit-realbench: group {g} ({name}) now holds other processes; left alone"
                );
            }
        }
    }
    let left = live(&tree.all_procs());
    kill_listed(&left);
    stopped.extend(left);
    stopped.sort_unstable();
    stopped.dedup();
    for g in tree.groups() {
        remove_when_empty(tree, &g)?;
    }
    tree.remove_all()?;
    let _ = std::fs::remove_file(state.join(GROUPS_FILE));
    let _ = std::fs::remove_dir(state);
    Ok(stopped.len())
}
