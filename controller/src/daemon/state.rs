//! The daemon's state directory (`[paths] state_dir`, default `/run/cohabit`): one instance
//! per host, and the record of every change in force, so that a crash never leaves a host
//! worse than before (docs/DESIGN.md 7, security review row 9).
//!
//! - `lock`: `flock(LOCK_EX|LOCK_NB)` held for the life of the process, with the holder's
//!   pid inside for the message a second instance prints ("another cohabit is running (pid
//!   N)"). The kernel drops the lock when the process dies, however it dies.
//! - `changes.json`: the [`HostChanges`] record, replaced atomically (a temporary file in the
//!   same directory, fsync, rename, fsync of the directory) each time it changes, before the
//!   write it describes. The next start puts the host back from it.
//!
//! The directory holds what root will write back into the kernel, so it is trusted only when
//! it is a real directory (not a symbolic link), owned by the user cohabit runs as, and
//! writable by nobody else; it is created `0700`. Files in it are opened without following
//! symbolic links.
//!
//! What a start cannot restore goes to quarantine, and the start goes on (2026-12b review,
//! N8): a node agent that refuses every start over one stale entry leaves the node
//! unmanaged in a crash loop, with every other change of the record still in force.
//! - `quarantine.json`: the changes of a record that could not be undone (the kernel
//!   refused an old `cpuset.cpus` once the kubelet narrowed the pod's cgroup), each with the
//!   time and the pid of the run that recorded it, appended at each start, the newest
//!   [`MAX_QUARANTINED`] kept ([`StateDir::quarantine`]). An operator puts them back by
//!   hand; the daemon never reads the file.
//! - `changes.json.unreadable.<unix s>.<pid>.<n>`: a state file this build cannot read
//!   (corrupt, another version, too large, not a regular file), moved aside unread; the
//!   newest [`KEEP_UNREADABLE`] are kept ([`StateDir::quarantine_file`]). It may hold the
//!   only copy of a process's original cgroup: a change it recorded and that is still in
//!   force is seen by the new run as the original.
//!
//! `--discard-state` (or `COHABIT_DISCARD_STATE=1`) moves the state file aside unread
//! without trying to restore from it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use cohabit_collectors::IoError;
use serde::{Deserialize, Serialize};

use cohabit_host::changes::{Change, ChangeLog, HostChanges};

/// Where the state lives unless `[paths] state_dir` says otherwise.
pub const DEFAULT_STATE_DIR: &str = "/run/cohabit";
/// The lock file's name in the state directory.
pub const LOCK_FILE: &str = "lock";
/// The state file's name in the state directory.
pub const CHANGES_FILE: &str = "changes.json";
/// Where `--discard-state` moves a state file it does not use.
pub const DISCARDED_FILE: &str = "changes.json.discarded";
/// The quarantine file's name in the state directory.
pub const QUARANTINE_FILE: &str = "quarantine.json";
/// How the state files moved aside unread begin (then `<unix s>.<pid>.<n>`).
pub const UNREADABLE_PREFIX: &str = "changes.json.unreadable.";
/// Most entries the quarantine file keeps (the oldest go first).
pub const MAX_QUARANTINED: usize = 4096;
/// State files moved aside unread that are kept (the oldest go first).
pub const KEEP_UNREADABLE: usize = 4;
/// The quarantine file format.
const QUARANTINE_VERSION: u32 = 1;
/// The state file format this build writes and reads.
pub const STATE_VERSION: u32 = 1;
/// How the temporary files of [`replace_atomically`] end; a crash can leave one, which the
/// next instance removes once it holds the lock.
const TMP_SUFFIX: &str = ".tmp";
/// A state file larger than this is not a record cohabit wrote.
const MAX_STATE_BYTES: u64 = 64 << 20;

/// Why the state directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// A file could not be read or written.
    #[error(transparent)]
    Io(#[from] IoError),
    /// The directory is not safe to trust.
    #[error("state directory {path}: {why}; cohabit will not keep root's state there (set [paths] state_dir or fix it)")]
    Insecure {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// Another instance holds the lock.
    #[error("another cohabit is running (pid {pid}); it holds {lock}")]
    Locked {
        /// The holder's pid as it wrote it, or `unknown`.
        pid: String,
        /// The lock file.
        lock: PathBuf,
    },
    /// The state file is not one this build can read.
    #[error("state file {path}: {why}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

/// The state file's content (version 1), as written:
///
/// ```json
/// {"cohabit_state": 1, "pid": 4242, "changes": [{"kind": "created_cgroup", "dir": "..."}]}
/// ```
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    /// Format version; always [`STATE_VERSION`] when written by this build.
    cohabit_state: u32,
    /// The daemon that wrote it (for people; restoring does not depend on it).
    pid: u32,
    /// [`HostChanges::changes`], oldest first.
    changes: Vec<Change>,
}

/// A record loaded from the state file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedState {
    /// The daemon that wrote it.
    pub pid: u32,
    /// The changes it had in force.
    pub changes: HostChanges,
}

/// The locked state directory; the lock is held until this value is dropped.
#[derive(Debug)]
pub struct StateDir {
    dir: PathBuf,
    /// Held open (and so locked) for the life of the value.
    _lock: File,
}

impl StateDir {
    /// Creates the directory if missing (`0700`), checks that it is safe to trust for the
    /// user cohabit runs as (root, for a daemon that writes cgroups), and takes the lock.
    pub fn open(dir: &Path) -> Result<Self, StateError> {
        Self::open_owned_by(dir, cohabit_host::files::euid())
    }

    /// [`Self::open`] for a directory that must belong to `uid`.
    pub fn open_owned_by(dir: &Path, uid: u32) -> Result<Self, StateError> {
        ensure_private_dir(dir, uid)?;
        let path = dir.join(LOCK_FILE);
        let mut lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| IoError::new("opening the lock file", &path, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StateError::Locked {
                    pid: holder(&mut lock),
                    lock: path,
                });
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(IoError::new("locking", &path, e).into());
            }
        }
        let mut write = || -> std::io::Result<()> {
            lock.set_len(0)?;
            lock.write_all(format!("{}\n", std::process::id()).as_bytes())
        };
        write().map_err(|e| IoError::new("writing", &path, e))?;
        remove_temporaries(dir);
        Ok(Self {
            dir: dir.to_path_buf(),
            _lock: lock,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The state file.
    pub fn changes_path(&self) -> PathBuf {
        self.dir.join(CHANGES_FILE)
    }

    /// The record a previous run left, `None` when there is no state file.
    pub fn load(&self) -> Result<Option<SavedState>, StateError> {
        let path = self.changes_path();
        let text = match read_private(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(StateError::Unreadable {
                    path,
                    why: e.to_string(),
                })
            }
        };
        parse(&text)
            .map(Some)
            .map_err(|why| StateError::Unreadable { path, why })
    }

    /// Moves the state file aside (to [`DISCARDED_FILE`], replacing an older one); returns
    /// where it went, or `None` when there was none.
    pub fn discard(&self) -> Result<Option<PathBuf>, StateError> {
        let from = self.changes_path();
        let to = self.dir.join(DISCARDED_FILE);
        match std::fs::rename(&from, &to) {
            Ok(()) => {
                sync_dir(&self.dir)?;
                Ok(Some(to))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(IoError::new("moving aside", &from, e).into()),
        }
    }

    /// Replaces the state file with `changes` (atomically).
    pub fn save(&self, changes: &HostChanges) -> Result<(), StateError> {
        FileChangeLog::new(self).write(changes)
    }

    /// The [`ChangeLog`] that keeps the host's record in this directory.
    pub fn change_log(&self) -> FileChangeLog {
        FileChangeLog::new(self)
    }
}

/// One change a start could not undo, as the quarantine file keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quarantined {
    /// When it was quarantined (Unix seconds).
    pub at_unix_s: u64,
    /// The daemon that recorded the change.
    pub recorded_by_pid: u32,
    /// The change, as the state file held it.
    pub change: Change,
}

/// The quarantine file's content.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuarantineFile {
    cohabit_quarantine: u32,
    entries: Vec<Quarantined>,
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl StateDir {
    /// The quarantine file.
    pub fn quarantine_path(&self) -> PathBuf {
        self.dir.join(QUARANTINE_FILE)
    }

    /// Adds `changes` (recorded by `pid`, not undone at this start) to the quarantine file,
    /// which keeps the newest [`MAX_QUARANTINED`]; a quarantine file this build cannot read
    /// is moved aside first (to `quarantine.json.unreadable`). Returns the file.
    pub fn quarantine(&self, pid: u32, changes: &[Change]) -> Result<PathBuf, StateError> {
        let path = self.quarantine_path();
        let mut entries = match read_private(&path) {
            Ok(text) => match serde_json::from_str::<QuarantineFile>(&text) {
                Ok(q) if q.cohabit_quarantine == QUARANTINE_VERSION => q.entries,
                _ => self.set_aside_quarantine(&path)?,
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(_) => self.set_aside_quarantine(&path)?,
        };
        let at_unix_s = unix_now();
        entries.extend(changes.iter().map(|c| Quarantined {
            at_unix_s,
            recorded_by_pid: pid,
            change: c.clone(),
        }));
        if entries.len() > MAX_QUARANTINED {
            let dropped = entries.len() - MAX_QUARANTINED;
            tracing::warn!(dropped, file = %path.display(), "the quarantine file is full; its oldest entries were dropped");
            entries.drain(..dropped);
        }
        let file = QuarantineFile {
            cohabit_quarantine: QUARANTINE_VERSION,
            entries,
        };
        let mut text = serde_json::to_string_pretty(&file)
            .map_err(|e| IoError::new("serialising", &path, std::io::Error::other(e)))?;
        text.push('\n');
        replace_atomically(&self.dir, QUARANTINE_FILE, text.as_bytes())?;
        Ok(path)
    }

    fn set_aside_quarantine(&self, path: &Path) -> Result<Vec<Quarantined>, StateError> {
        let to = self.dir.join(format!("{QUARANTINE_FILE}.unreadable"));
        std::fs::rename(path, &to).map_err(|e| IoError::new("moving aside", path, e))?;
        tracing::warn!(file = %path.display(), to = %to.display(), "the quarantine file cannot be read; moved aside, a new one starts");
        Ok(Vec::new())
    }

    /// The entries of the quarantine file (none when there is none).
    pub fn quarantined(&self) -> Result<Vec<Quarantined>, StateError> {
        let path = self.quarantine_path();
        match read_private(&path) {
            Ok(text) => serde_json::from_str::<QuarantineFile>(&text)
                .map(|q| q.entries)
                .map_err(|e| StateError::Unreadable {
                    path,
                    why: e.to_string(),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(StateError::Unreadable {
                path,
                why: e.to_string(),
            }),
        }
    }

    /// Moves a state file this build cannot read aside, unread, to
    /// `changes.json.unreadable.<unix s>.<pid>.<n>`, and drops all but the newest
    /// [`KEEP_UNREADABLE`] such files. Returns where it went (`None`: there was none).
    pub fn quarantine_file(&self) -> Result<Option<PathBuf>, StateError> {
        let from = self.changes_path();
        static MOVED: AtomicU64 = AtomicU64::new(0);
        let n = MOVED.fetch_add(1, Ordering::Relaxed);
        let to = self.dir.join(format!(
            "{UNREADABLE_PREFIX}{:012}.{}.{n:06}",
            unix_now(),
            std::process::id()
        ));
        match std::fs::rename(&from, &to) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(IoError::new("moving aside", &from, e).into()),
        }
        sync_dir(&self.dir)?;
        let mut kept: Vec<PathBuf> = std::fs::read_dir(&self.dir)
            .map_err(|e| IoError::new("listing", &self.dir, e))?
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(UNREADABLE_PREFIX)
            })
            .map(|e| e.path())
            .collect();
        kept.sort();
        for old in kept.iter().rev().skip(KEEP_UNREADABLE) {
            if let Err(e) = std::fs::remove_file(old) {
                tracing::warn!(file = %old.display(), error = %e, "could not remove an old unreadable state file");
            }
        }
        Ok(Some(to))
    }
}

/// A [`ChangeLog`] writing the state file atomically. Only meaningful while the
/// [`StateDir`] it came from is held (the lock guards the file).
#[derive(Debug, Clone)]
pub struct FileChangeLog {
    dir: PathBuf,
    pid: u32,
}

impl FileChangeLog {
    fn new(state: &StateDir) -> Self {
        Self {
            dir: state.dir.clone(),
            pid: std::process::id(),
        }
    }

    fn write(&self, changes: &HostChanges) -> Result<(), StateError> {
        let file = StateFile {
            cohabit_state: STATE_VERSION,
            pid: self.pid,
            changes: changes.changes.clone(),
        };
        let target = self.dir.join(CHANGES_FILE);
        let mut text = serde_json::to_string_pretty(&file).map_err(|e| {
            // Only a path that is not UTF-8 gets here.
            IoError::new("serialising", &target, std::io::Error::other(e))
        })?;
        text.push('\n');
        replace_atomically(&self.dir, CHANGES_FILE, text.as_bytes())
    }
}

impl ChangeLog for FileChangeLog {
    fn save(&mut self, changes: &HostChanges) -> std::io::Result<()> {
        self.write(changes).map_err(|e| match e {
            StateError::Io(io) => std::io::Error::new(io.source.kind(), io.to_string()),
            other => std::io::Error::other(other.to_string()),
        })
    }
}

/// Parses a state file's text; the error says what is wrong.
fn parse(text: &str) -> Result<SavedState, String> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not valid JSON ({e})"))?;
    match value
        .get("cohabit_state")
        .and_then(serde_json::Value::as_u64)
    {
        Some(v) if v == u64::from(STATE_VERSION) => {}
        Some(v) => {
            return Err(format!(
                "format version {v}, but this build reads version {STATE_VERSION}"
            ))
        }
        None => return Err("not a cohabit state file (no \"cohabit_state\" version)".into()),
    }
    let file: StateFile =
        serde_json::from_value(value).map_err(|e| format!("malformed record ({e})"))?;
    Ok(SavedState {
        pid: file.pid,
        changes: HostChanges {
            changes: file.changes,
        },
    })
}

/// Creates `dir` (`0700`) if missing and checks that it can be trusted.
fn ensure_private_dir(dir: &Path, uid: u32) -> Result<(), StateError> {
    let insecure = |why: String| StateError::Insecure {
        path: dir.to_path_buf(),
        why,
    };
    match std::fs::symlink_metadata(dir) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| IoError::new("creating", dir, e))?;
        }
        Err(e) => return Err(IoError::new("reading", dir, e).into()),
    }
    let m = std::fs::symlink_metadata(dir).map_err(|e| IoError::new("reading", dir, e))?;
    if m.file_type().is_symlink() {
        return Err(insecure("is a symbolic link".into()));
    }
    if !m.is_dir() {
        return Err(insecure("is not a directory".into()));
    }
    if m.uid() != uid {
        return Err(insecure(format!(
            "is owned by uid {}, not by uid {uid} that cohabit runs as",
            m.uid()
        )));
    }
    if m.mode() & 0o022 != 0 {
        return Err(insecure(format!(
            "is writable by group or others (mode {:o})",
            m.mode() & 0o7777
        )));
    }
    Ok(())
}

/// The pid the lock holder wrote, or `unknown` (it may not have written it yet).
fn holder(lock: &mut File) -> String {
    let mut text = String::new();
    let read = lock.take(32).read_to_string(&mut text);
    match (read, text.trim().parse::<u32>()) {
        (Ok(_), Ok(pid)) => pid.to_string(),
        _ => "unknown".into(),
    }
}

/// Reads a regular file (not through a symbolic link) of at most [`MAX_STATE_BYTES`].
fn read_private(path: &Path) -> std::io::Result<String> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let m = f.metadata()?;
    if !m.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if m.len() > MAX_STATE_BYTES {
        return Err(std::io::Error::other(format!(
            "{} bytes, more than a state file can hold ({MAX_STATE_BYTES})",
            m.len()
        )));
    }
    let mut text = String::new();
    f.take(MAX_STATE_BYTES).read_to_string(&mut text)?;
    Ok(text)
}

/// Replaces `dir/name` with `bytes` so that a reader (or a crash) sees the old content or
/// the new, never a mix: a temporary file in the same directory, fsync, rename, fsync of
/// the directory. Each write has a temporary file of its own, so two writers (a tick that
/// outlived shutdown's wait, and shutdown) never write into the same one; the last rename
/// wins, whole.
fn replace_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), StateError> {
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!("{name}.{}.{n}{TMP_SUFFIX}", std::process::id()));
    let target = dir.join(name);
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(|e| IoError::new("creating", &tmp, e))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| IoError::new("writing", &tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, &target).map_err(|e| IoError::new("replacing", &target, e))?;
    sync_dir(dir)
}

/// Removes the temporary files a crashed writer left (only while holding the lock).
fn remove_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(CHANGES_FILE) && name.ends_with(TMP_SUFFIX) {
            if let Err(err) = std::fs::remove_file(e.path()) {
                tracing::warn!(file = %e.path().display(), error = %err, "could not remove a temporary state file");
            }
        }
    }
}

fn sync_dir(dir: &Path) -> Result<(), StateError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| IoError::new("syncing", dir, e).into())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn me(dir: &Path) -> u32 {
        std::fs::metadata(dir).unwrap().uid()
    }

    fn record() -> HostChanges {
        let mut r = HostChanges::default();
        r.note(Change::CgroupFile {
            dir: "/sys/fs/cgroup/cpuset/system.slice/kv.service".into(),
            file: "cpuset.cpus".into(),
            original: "0-7".into(),
        });
        r.note(Change::CreatedCgroup {
            dir: "/sys/fs/cgroup/cpu/cohabit/best-effort".into(),
        });
        r.note(Change::MovedProcess {
            pid: 42,
            start_time: 1234,
            from: vec!["/sys/fs/cgroup/cpu/user.slice".into()],
        });
        r
    }

    #[test]
    fn a_missing_directory_is_created_private_and_a_second_instance_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run/cohabit");
        let uid = me(tmp.path());
        let first = StateDir::open_owned_by(&dir, uid).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "private: {mode:o}");
        let e = StateDir::open_owned_by(&dir, uid).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "another cohabit is running (pid {}); it holds {}",
                std::process::id(),
                dir.join(LOCK_FILE).display()
            )
        );
        drop(first);
        StateDir::open_owned_by(&dir, uid).expect("the lock goes with its holder");
    }

    #[test]
    fn a_directory_others_could_write_or_a_symlink_or_another_owner_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let uid = me(tmp.path());
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = StateDir::open_owned_by(&open, uid).unwrap_err().to_string();
        assert!(e.contains("writable by group or others (mode 777)"), "{e}");

        let private = tmp.path().join("private");
        std::fs::create_dir(&private).unwrap();
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&private, &link).unwrap();
        let e = StateDir::open_owned_by(&link, uid).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");

        let e = StateDir::open_owned_by(&private, uid.wrapping_add(1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not by uid"), "{e}");

        let file = tmp.path().join("file");
        std::fs::write(&file, "").unwrap();
        let e = StateDir::open_owned_by(&file, uid).unwrap_err().to_string();
        assert!(e.contains("is not a directory"), "{e}");
    }

    #[test]
    fn the_record_round_trips_through_the_state_file_and_no_temporary_is_left() {
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::open_owned_by(tmp.path(), me(tmp.path())).unwrap();
        assert_eq!(state.load().unwrap(), None, "no file: nothing to restore");
        let mut log = state.change_log();
        log.save(&record()).unwrap();
        let saved = state.load().unwrap().unwrap();
        assert_eq!(saved.changes, record());
        assert_eq!(saved.pid, std::process::id());
        state.save(&HostChanges::default()).unwrap();
        assert!(state.load().unwrap().unwrap().changes.is_empty());
        let names: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
        let mode = std::fs::metadata(state.changes_path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
    }

    #[test]
    fn a_temporary_file_a_crash_left_is_removed_by_the_next_instance() {
        let tmp = tempfile::tempdir().unwrap();
        let left = tmp.path().join("changes.json.4242.7.tmp");
        std::fs::write(&left, "{\"cohabit_state\": 1, \"pi").unwrap();
        let _state = StateDir::open_owned_by(tmp.path(), me(tmp.path())).unwrap();
        assert!(!left.exists());
    }

    #[test]
    fn the_written_format_is_versioned_and_tagged() {
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::open_owned_by(tmp.path(), me(tmp.path())).unwrap();
        state.save(&record()).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(state.changes_path()).unwrap()).unwrap();
        assert_eq!(v["cohabit_state"], 1);
        assert_eq!(v["changes"][0]["kind"], "cgroup_file");
        assert_eq!(v["changes"][0]["original"], "0-7");
        assert_eq!(v["changes"][2]["start_time"], 1234);
    }

    #[test]
    fn a_corrupt_or_unknown_state_file_is_named_and_can_be_moved_to_quarantine_unread() {
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::open_owned_by(tmp.path(), me(tmp.path())).unwrap();
        let path = state.changes_path();
        let cases = [
            (
                "{\"cohabit_state\": 1, \"pid\": 1, \"chan",
                "not valid JSON",
            ),
            (
                "{\"cohabit_state\": 2, \"pid\": 1, \"changes\": []}",
                "format version 2, but this build reads version 1",
            ),
            ("{\"changes\": []}", "not a cohabit state file"),
            (
                "{\"cohabit_state\": 1, \"pid\": 1, \"changes\": [{\"kind\": \"reboot\"}]}",
                "malformed record",
            ),
            (
                "{\"cohabit_state\": 1, \"pid\": 1, \"changes\": [{\"kind\": \"reboot\"}]} ",
                "malformed record",
            ),
        ];
        for (text, why) in cases {
            std::fs::write(&path, text).unwrap();
            let e = state.load().unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
            assert!(e.contains(&path.display().to_string()), "{e}");
            let aside = state.quarantine_file().unwrap().unwrap();
            assert!(aside
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(UNREADABLE_PREFIX));
            assert_eq!(
                std::fs::read_to_string(&aside).unwrap(),
                text,
                "moved unread"
            );
            assert_eq!(state.load().unwrap(), None);
        }
        // Only the newest few are kept.
        let aside = std::fs::read_dir(tmp.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with(UNREADABLE_PREFIX)
            })
            .count();
        assert_eq!(aside, KEEP_UNREADABLE.min(cases.len()));
        assert_eq!(state.quarantine_file().unwrap(), None, "none left to move");

        // --discard-state moves it aside unread too.
        std::fs::write(&path, "{").unwrap();
        let to = state.discard().unwrap().unwrap();
        assert_eq!(to, tmp.path().join(DISCARDED_FILE));
        assert_eq!(state.load().unwrap(), None);
        assert_eq!(state.discard().unwrap(), None);
    }

    #[test]
    fn changes_that_could_not_be_undone_accumulate_in_the_quarantine_file() {
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::open_owned_by(tmp.path(), me(tmp.path())).unwrap();
        assert!(state.quarantined().unwrap().is_empty());
        let changes = record().changes;
        let path = state.quarantine(4242, &changes[..1]).unwrap();
        assert_eq!(path, tmp.path().join(QUARANTINE_FILE));
        state.quarantine(4343, &changes[1..]).unwrap();
        let q = state.quarantined().unwrap();
        assert_eq!(
            q.iter()
                .map(|e| (e.recorded_by_pid, e.change.clone()))
                .collect::<Vec<_>>(),
            vec![
                (4242, changes[0].clone()),
                (4343, changes[1].clone()),
                (4343, changes[2].clone())
            ]
        );
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        // A quarantine file this build cannot read is set aside, never a reason to stop.
        std::fs::write(&path, "garbage").unwrap();
        state.quarantine(1, &changes[..1]).unwrap();
        assert_eq!(state.quarantined().unwrap().len(), 1);
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("quarantine.json.unreadable")).unwrap(),
            "garbage"
        );
    }

    #[test]
    fn a_state_file_that_is_a_symlink_is_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let state = StateDir::open_owned_by(tmp.path(), me(tmp.path())).unwrap();
        let elsewhere = tmp.path().join("elsewhere.json");
        std::fs::write(&elsewhere, "{}").unwrap();
        std::os::unix::fs::symlink(&elsewhere, state.changes_path()).unwrap();
        let e = state.load().unwrap_err().to_string();
        assert!(e.contains(CHANGES_FILE), "{e}");
        // Saving replaces the link itself (rename), never writes through it.
        state.save(&record()).unwrap();
        assert_eq!(std::fs::read_to_string(&elsewhere).unwrap(), "{}");
        assert_eq!(state.load().unwrap().unwrap().changes, record());
    }
}
