//! Files the root daemon writes outside the kernel's trees: the decision log and the GPU
//! clients' environment files.
//!
//! Root writing into a directory another user can write is how a symlink or a swapped file
//! turns a log line into `/etc/shadow` being truncated (security review rows 3 and 22). So
//! every such file:
//! - lives in a directory owned by root (or by the user cohabit runs as, for tests) that
//!   group and others cannot write ([`check_private_dir`]);
//! - is opened with `O_NOFOLLOW` and must be a regular file: a symlink at the path is an
//!   error and its target is never touched ([`read_regular`], [`open_log_file`]);
//! - when rewritten, is replaced whole: a temporary file in the same directory, `fsync`ed,
//!   then `rename(2)`d over it, so a reader sees the old content or the new, never a half
//!   ([`replace`]).
//!
//! Only the last directory is checked, not its ancestors: a group-writable `/var/log` (some
//! distributions) would otherwise stop the daemon.

use std::fs::{File, Metadata, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

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

/// Checks that `dir` is a directory owned by root (or by this process's user) that group and
/// others cannot write.
pub fn check_private_dir(dir: &Path) -> Result<(), FileError> {
    let meta = std::fs::metadata(dir).map_err(io_error("checking", dir))?;
    if !meta.is_dir() {
        return Err(FileError::Unsafe {
            path: dir.to_path_buf(),
            why: "not a directory".into(),
        });
    }
    match unsafe_dir(meta.uid(), meta.mode(), euid()) {
        Some(why) => Err(FileError::Unsafe {
            path: dir.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}

/// Creates `dir` (and missing parents) with `mode` if it is missing, then checks it
/// ([`check_private_dir`]).
pub fn ensure_private_dir(dir: &Path, mode: u32) -> Result<(), FileError> {
    use std::os::unix::fs::DirBuilderExt;
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(dir)
            .map_err(io_error("creating", dir))?;
    }
    check_private_dir(dir)
}

/// Opens with `O_NOFOLLOW` (and `O_NONBLOCK`, so a FIFO planted at the path cannot hang
/// the daemon) and checks the result is a regular file. A symlink is [`FileError::Unsafe`].
fn open_regular(path: &Path, opts: &mut OpenOptions) -> Result<Option<File>, FileError> {
    let file = match opts
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(FileError::Unsafe {
                path: path.to_path_buf(),
                why: "it is a symbolic link".into(),
            })
        }
        Err(e) => return Err(io_error("opening", path)(e)),
    };
    let meta = file.metadata().map_err(io_error("checking", path))?;
    if !meta.is_file() {
        return Err(FileError::Unsafe {
            path: path.to_path_buf(),
            why: "not a regular file".into(),
        });
    }
    Ok(Some(file))
}

/// Reads a regular file without following a symlink: its text and metadata, or `None` when
/// it does not exist.
pub fn read_regular(path: &Path) -> Result<Option<(String, Metadata)>, FileError> {
    let Some(file) = open_regular(path, OpenOptions::new().read(true))? else {
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
    let dir = parent_dir(path);
    check_private_dir(dir)?;
    // The file itself: refused when it is a symlink or not a regular file.
    open_regular(path, OpenOptions::new().read(true))?;
    let name = path.file_name().ok_or_else(|| FileError::Unsafe {
        path: path.to_path_buf(),
        why: "no file name".into(),
    })?;
    let tmp = dir.join(format!(".{}.cohabit-tmp", name.to_string_lossy()));
    // A leftover from a crash; the directory is root's, so it is ours.
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error("removing", &tmp)(e)),
    }
    let written = write_new(&tmp, contents, like).and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|e| FileError::Io {
            what: "renaming a new version over",
            path: path.to_path_buf(),
            source: e,
        })
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    // The rename is durable once the directory is; a failure here loses nothing written.
    if let Err(e) = File::open(dir).and_then(|d| d.sync_all()) {
        tracing::debug!(dir = %dir.display(), error = %e, "directory not synced");
    }
    Ok(())
}

fn write_new(tmp: &Path, contents: &[u8], like: Option<&Metadata>) -> Result<(), FileError> {
    let mode = like.map_or(0o644, |m| m.mode() & 0o7777);
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(tmp)
        .map_err(io_error("creating", tmp))?;
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
    check_private_dir(parent_dir(path))?;
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error("removing", path)(e)),
    }
}

/// Opens (creating with mode `0640` if missing) a log file for appending, without following
/// a symlink; an existing file loses group write and every permission of others. With
/// `create_new`, a file already at the path is an error.
pub fn open_log_file(path: &Path, create_new: bool) -> Result<File, FileError> {
    let mut opts = OpenOptions::new();
    opts.read(true).append(true).mode(0o640);
    if create_new {
        opts.create_new(true);
    } else {
        opts.create(true);
    }
    let file = open_regular(path, &mut opts)?.ok_or_else(|| FileError::Io {
        what: "opening",
        path: path.to_path_buf(),
        source: io::ErrorKind::NotFound.into(),
    })?;
    let mode = file.metadata().map_err(io_error("checking", path))?.mode() & 0o7777;
    if mode & !0o640 != 0 {
        file.set_permissions(Permissions::from_mode(mode & 0o640))
            .map_err(io_error("setting the mode of", path))?;
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
            eprintln!("skipped: mkfifo is not available");
            return;
        }
        let e = open_log_file(&path, false).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }
}
