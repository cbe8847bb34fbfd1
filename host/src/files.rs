//! Files the root daemon writes outside the kernel's trees: the decision log and the GPU
//! clients' environment files.
//!
//! Root writing into a directory another user can write is how a symlink or a swapped file
//! turns a log line into `/etc/shadow` being truncated (security review rows 3 and 22, and
//! L4 of the 2026-12b review). So every such file:
//! - is reached by walking its path from `/` (or the working directory, for a relative
//!   path) one directory at a time, each opened with `openat(O_NOFOLLOW | O_DIRECTORY)`
//!   relative to the one before ([`Dir::open`]): a symbolic link anywhere in the path is
//!   refused, naming it, and every later step (open, rename, unlink, sync) goes through the
//!   directory descriptor the walk ended on, never through the path again;
//! - lives in a directory owned by root (or by the user cohabit runs as, for tests) that
//!   group and others cannot write ([`check_private_dir`]);
//! - is opened with `O_NOFOLLOW | O_NONBLOCK` and must be a regular file: a symlink at the
//!   path is an error and its target is never touched, a FIFO never blocks the daemon
//!   ([`read_regular`], [`open_log_file`]);
//! - when rewritten, is replaced whole: a temporary file in the same directory, `fsync`ed,
//!   then `renameat(2)`d over it, so a reader sees the old content or the new, never a half
//!   ([`replace`]).
//!
//! Ownership and mode are checked on the last directory only, not on its ancestors: a
//! group-writable `/var/log` (some distributions) would otherwise stop the daemon. A link in
//! the path is refused even where root made it (`/var/run` → `/run`): configure the path it
//! leads to.

use std::ffi::OsStr;
use std::fs::{File, Metadata, Permissions};
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag};

/// Largest environment file cohabit reads (they hold a few variables).
const MAX_READ_BYTES: u64 = 1 << 20;

/// A file or directory cohabit will not write, or an I/O error naming its path.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// An operation on `path` failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. "opening".
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// The path is unsafe for root to write.
    #[error("{}: {why}; cohabit runs as root and refuses to write there", path.display())]
    Unsafe {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
}

fn io_error<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> FileError + 'a {
    move |source| FileError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

fn errno<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(Errno) -> FileError + 'a {
    move |e| io_error(what, path)(io::Error::from(e))
}

fn unsafe_path(path: &Path, why: &str) -> FileError {
    FileError::Unsafe {
        path: path.to_path_buf(),
        why: why.into(),
    }
}

/// The directory a file path is in (`.` for a bare file name).
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// The effective user id of this process.
pub fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Why a directory with this owner and mode is unsafe for root to write into, if it is.
/// Pure, so the rule is tested without being root.
fn unsafe_dir(uid: u32, mode: u32, me: u32) -> Option<String> {
    if uid != 0 && uid != me {
        return Some(format!(
            "the directory is owned by uid {uid}, not root, who could swap the file"
        ));
    }
    if mode & 0o022 != 0 {
        return Some(format!(
            "the directory has mode {:04o}: group or others can write it",
            mode & 0o7777
        ));
    }
    None
}

/// A directory reached without following a symbolic link, held open: what is done in it
/// goes through this descriptor (see the module doc).
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

impl Dir {
    /// Walks to `dir` one component at a time without following a link; with `create`,
    /// missing directories are made with that mode. Nothing about owners is checked.
    fn walk(dir: &Path, create: Option<u32>) -> Result<Dir, FileError> {
        let start = if dir.is_absolute() { "/" } else { "." };
        let mut at = PathBuf::from(start);
        let mut fd = nix::fcntl::openat(nix::fcntl::AT_FDCWD, start, DIR_FLAGS, Mode::empty())
            .map_err(errno("opening", &at))?;
        for c in dir.components() {
            let name = match c {
                Component::RootDir | Component::CurDir | Component::Prefix(_) => continue,
                Component::ParentDir => OsStr::new(".."),
                Component::Normal(n) => n,
            };
            at.push(name);
            fd = step(&fd, name, &at, create)?;
        }
        Ok(Dir { fd, path: at })
    }

    /// [`Self::walk`] to `dir`, then checks it is owned by root (or this process's user) and
    /// that group and others cannot write it.
    pub fn open(dir: &Path) -> Result<Dir, FileError> {
        Self::checked(Self::walk(dir, None)?)
    }

    /// [`Self::open`], making missing directories (with `mode`) on the way.
    pub fn ensure(dir: &Path, mode: u32) -> Result<Dir, FileError> {
        Self::checked(Self::walk(dir, Some(mode))?)
    }

    fn checked(d: Dir) -> Result<Dir, FileError> {
        let st = nix::sys::stat::fstat(&d.fd).map_err(errno("checking", &d.path))?;
        match unsafe_dir(st.st_uid, st.st_mode, euid()) {
            Some(why) => Err(FileError::Unsafe { path: d.path, why }),
            None => Ok(d),
        }
    }

    /// The path the walk took.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens `name` in this directory with `O_NOFOLLOW | O_NONBLOCK` and checks the result
    /// is a regular file; `None` when it does not exist (and `flags` do not create it).
    fn open_file(&self, name: &OsStr, flags: OFlag, mode: u32) -> Result<Option<File>, FileError> {
        let path = self.path.join(name);
        let flags = flags | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
        let fd = match nix::fcntl::openat(&self.fd, name, flags, Mode::from_bits_truncate(mode)) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(None),
            Err(Errno::ELOOP) => return Err(unsafe_path(&path, "it is a symbolic link")),
            Err(e) => return Err(errno("opening", &path)(e)),
        };
        let file = File::from(fd);
        let meta = file.metadata().map_err(io_error("checking", &path))?;
        if !meta.is_file() {
            return Err(unsafe_path(&path, "not a regular file"));
        }
        Ok(Some(file))
    }

    /// Renames `from` to `to`, both in this directory.
    pub fn rename(&self, from: &OsStr, to: &OsStr) -> io::Result<()> {
        nix::fcntl::renameat(&self.fd, from, &self.fd, to).map_err(io::Error::from)
    }

    /// Removes the file `name` (a symlink is removed itself, never its target).
    pub fn remove(&self, name: &OsStr) -> io::Result<()> {
        nix::unistd::unlinkat(&self.fd, name, nix::unistd::UnlinkatFlags::NoRemoveDir)
            .map_err(io::Error::from)
    }

    /// Makes renames and new files in this directory durable.
    fn sync(&self) -> io::Result<()> {
        File::from(self.fd.try_clone()?).sync_all()
    }
}

/// Opens the directory `name` in `parent` (at `at`) without following a link, making it
/// with `create`'s mode when missing.
fn step(
    parent: &OwnedFd,
    name: &OsStr,
    at: &Path,
    create: Option<u32>,
) -> Result<OwnedFd, FileError> {
    match nix::fcntl::openat(parent, name, DIR_FLAGS, Mode::empty()) {
        Ok(fd) => Ok(fd),
        Err(Errno::ENOENT) if create.is_some() => {
            let mode = Mode::from_bits_truncate(create.unwrap_or(0o700));
            match nix::sys::stat::mkdirat(parent, name, mode) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(errno("creating", at)(e)),
            }
            nix::fcntl::openat(parent, name, DIR_FLAGS, Mode::empty()).map_err(errno("opening", at))
        }
        Err(e @ (Errno::ELOOP | Errno::ENOTDIR)) => {
            let st = nix::sys::stat::fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW)
                .map_err(errno("checking", at))?;
            let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
            if kind == SFlag::S_IFLNK {
                Err(unsafe_path(
                    at,
                    "a symbolic link in the path (give the path it leads to)",
                ))
            } else if kind == SFlag::S_IFDIR {
                Err(errno("opening", at)(e))
            } else {
                Err(unsafe_path(at, "not a directory"))
            }
        }
        Err(e) => Err(errno("opening", at)(e)),
    }
}

/// The file name of `path`, or an error naming it.
fn file_name(path: &Path) -> Result<&OsStr, FileError> {
    path.file_name()
        .ok_or_else(|| unsafe_path(path, "no file name"))
}

/// Checks that `dir` is a directory reached without a symbolic link, owned by root (or by
/// this process's user), that group and others cannot write.
pub fn check_private_dir(dir: &Path) -> Result<(), FileError> {
    Dir::open(dir).map(drop)
}

/// Creates `dir` (and missing parents) with `mode` if it is missing, then checks it
/// ([`check_private_dir`]).
pub fn ensure_private_dir(dir: &Path, mode: u32) -> Result<(), FileError> {
    Dir::ensure(dir, mode).map(drop)
}

/// Reads a regular file without following a symlink: its text and metadata, or `None` when
/// it does not exist. Its directory is walked ([`Dir`]) but not checked for owner and mode.
pub fn read_regular(path: &Path) -> Result<Option<(String, Metadata)>, FileError> {
    let dir = match Dir::walk(parent_dir(path), None) {
        Ok(d) => d,
        Err(FileError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(None)
        }
        Err(e) => return Err(e),
    };
    let Some(file) = dir.open_file(file_name(path)?, OFlag::O_RDONLY, 0)? else {
        return Ok(None);
    };
    let meta = file.metadata().map_err(io_error("checking", path))?;
    if meta.len() > MAX_READ_BYTES {
        return Err(FileError::Unsafe {
            path: path.to_path_buf(),
            why: format!("larger than {MAX_READ_BYTES} bytes"),
        });
    }
    let mut text = String::new();
    file.take(MAX_READ_BYTES)
        .read_to_string(&mut text)
        .map_err(io_error("reading", path))?;
    Ok(Some((text, meta)))
}

/// Replaces `path` with `contents` atomically: a temporary file beside it (owner and mode
/// copied from `like`, the file being replaced, or `0644` for a new file) is written,
/// `fsync`ed and renamed over it; the directory is then synced. The directory must pass
/// [`check_private_dir`], and a symlink at `path` is refused.
pub fn replace(path: &Path, contents: &[u8], like: Option<&Metadata>) -> Result<(), FileError> {
    let dir = Dir::open(parent_dir(path))?;
    let name = file_name(path)?;
    // The file itself: refused when it is a symlink or not a regular file.
    dir.open_file(name, OFlag::O_RDONLY, 0)?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(".cohabit-tmp");
    let tmp = dir.path().join(&tmp_name);
    // A leftover from a crash; the directory is root's, so it is ours.
    match dir.remove(&tmp_name) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error("removing", &tmp)(e)),
    }
    let written = write_new(&dir, &tmp_name, &tmp, contents, like).and_then(|()| {
        dir.rename(&tmp_name, name).map_err(|e| FileError::Io {
            what: "renaming a new version over",
            path: path.to_path_buf(),
            source: e,
        })
    });
    if written.is_err() {
        let _ = dir.remove(&tmp_name);
    }
    written?;
    // The rename is durable once the directory is; a failure here loses nothing written.
    if let Err(e) = dir.sync() {
        tracing::debug!(dir = %dir.path().display(), error = %e, "directory not synced");
    }
    Ok(())
}

fn write_new(
    dir: &Dir,
    name: &OsStr,
    tmp: &Path,
    contents: &[u8],
    like: Option<&Metadata>,
) -> Result<(), FileError> {
    let mode = like.map_or(0o644, |m| m.mode() & 0o7777);
    let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL;
    let mut f = dir
        .open_file(name, flags, 0o600)?
        .ok_or_else(|| io_error("creating", tmp)(io::ErrorKind::NotFound.into()))?;
    if let Some(m) = like {
        std::os::unix::fs::fchown(&f, Some(m.uid()), Some(m.gid()))
            .map_err(io_error("setting the owner of", tmp))?;
    }
    f.set_permissions(Permissions::from_mode(mode))
        .map_err(io_error("setting the mode of", tmp))?;
    f.write_all(contents).map_err(io_error("writing", tmp))?;
    f.sync_all().map_err(io_error("syncing", tmp))
}

/// Removes `path` if it is there. The directory must pass [`check_private_dir`]; a symlink
/// is removed itself, never its target (unlink does not follow).
pub fn remove(path: &Path) -> Result<(), FileError> {
    let dir = Dir::open(parent_dir(path))?;
    match dir.remove(file_name(path)?) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error("removing", path)(e)),
    }
}

/// Opens (creating with mode `0640` if missing) a log file for appending, without following
/// a symlink; an existing file loses group write and every permission of others. With
/// `create_new`, a file already at the path is an error. The directory must pass
/// [`check_private_dir`].
pub fn open_log_file(path: &Path, create_new: bool) -> Result<File, FileError> {
    let dir = Dir::open(parent_dir(path))?;
    open_log_in(&dir, file_name(path)?, create_new)
}

/// [`open_log_file`] for `name` in `dir`.
pub fn open_log_in(dir: &Dir, name: &OsStr, create_new: bool) -> Result<File, FileError> {
    let path = dir.path().join(name);
    let mut flags = OFlag::O_RDWR | OFlag::O_APPEND | OFlag::O_CREAT;
    if create_new {
        flags |= OFlag::O_EXCL;
    }
    let file = dir
        .open_file(name, flags, 0o640)?
        .ok_or_else(|| FileError::Io {
            what: "opening",
            path: path.clone(),
            source: io::ErrorKind::NotFound.into(),
        })?;
    let mode = file.metadata().map_err(io_error("checking", &path))?.mode() & 0o7777;
    if mode & !0o640 != 0 {
        file.set_permissions(Permissions::from_mode(mode & 0o640))
            .map_err(io_error("setting the mode of", &path))?;
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_others_can_write_or_own_is_unsafe() {
        assert_eq!(unsafe_dir(0, 0o40755, 0), None);
        assert_eq!(unsafe_dir(1000, 0o40700, 1000), None, "our own, in tests");
        assert!(unsafe_dir(0, 0o41777, 0).unwrap().contains("1777"));
        assert!(unsafe_dir(0, 0o40775, 0)
            .unwrap()
            .contains("group or others"));
        assert!(unsafe_dir(1000, 0o40700, 0).unwrap().contains("uid 1000"));
    }

    #[test]
    fn a_world_writable_directory_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), Permissions::from_mode(0o777)).unwrap();
        let e = replace(&dir.path().join("x.env"), b"A=1\n", None).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
        assert!(msg.contains("0777"), "{msg}");
        assert!(!dir.path().join("x.env").exists());
    }

    #[test]
    fn a_symlink_is_refused_and_its_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("shadow");
        std::fs::write(&target, "secret\n").unwrap();
        let link = dir.path().join("x.env");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for e in [
            replace(&link, b"A=1\n", None).unwrap_err(),
            read_regular(&link).unwrap_err(),
            open_log_file(&link, false).unwrap_err(),
        ] {
            assert!(e.to_string().contains("symbolic link"), "{e}");
        }
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "secret\n");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[test]
    fn a_path_through_a_symlinked_directory_is_refused_and_nothing_there_is_touched() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::fs::write(real.join("x.env"), "A=1\n").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let env = link.join("x.env");
        for e in [
            replace(&env, b"A=2\n", None).unwrap_err(),
            read_regular(&env).unwrap_err(),
            remove(&env).unwrap_err(),
            open_log_file(&link.join("d.jsonl"), false).unwrap_err(),
            ensure_private_dir(&link.join("sub"), 0o755).unwrap_err(),
            check_private_dir(&link.join(".")).unwrap_err(),
        ] {
            let msg = e.to_string();
            assert!(
                msg.contains("a symbolic link in the path")
                    && msg.contains(&link.display().to_string()),
                "{msg}"
            );
        }
        // Deeper: a link two levels up is met the same way.
        std::fs::create_dir(real.join("inner")).unwrap();
        let e = replace(&link.join("inner/y.env"), b"B=1\n", None).unwrap_err();
        assert!(e.to_string().contains("a symbolic link in the path"), "{e}");
        let names: Vec<_> = std::fs::read_dir(&real)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert_eq!(
            std::fs::read_to_string(real.join("x.env")).unwrap(),
            "A=1\n"
        );
        // The same directory reached by its own path is fine.
        replace(&real.join("x.env"), b"A=2\n", None).unwrap();
        assert_eq!(
            std::fs::read_to_string(real.join("x.env")).unwrap(),
            "A=2\n"
        );
    }

    #[test]
    fn a_replaced_file_keeps_its_mode_and_no_temporary_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.env");
        std::fs::write(&path, "A=1\n").unwrap();
        std::fs::set_permissions(&path, Permissions::from_mode(0o600)).unwrap();
        let (_, meta) = read_regular(&path).unwrap().unwrap();
        replace(&path, b"A=2\n", Some(&meta)).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "A=2\n");
        let mode = std::fs::metadata(&path).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o600);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("x.env")]);
        assert!(read_regular(&dir.path().join("absent")).unwrap().is_none());
    }

    #[test]
    fn a_fifo_at_a_log_path_is_refused_without_hanging() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("decisions.jsonl");
        let made = std::process::Command::new("mkfifo")
            .arg(&path)
            .status()
            .is_ok_and(|s| s.success());
        if !made {
            cohabit_testkit::skip(cohabit_testkit::Need::Machine, "mkfifo is not available");
            return;
        }
        let e = open_log_file(&path, false).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
}
