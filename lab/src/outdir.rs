//! Directories the lab writes into (`simulate --out`, `compare --out`, `plot --out`,
//! `report --out`), reached without following a symbolic link.
//!
//! The lab's commands are often run as root with an output path under a directory other
//! users can write (`/tmp`). A symbolic link planted there as the directory, or as one on
//! the way to it, would send decision logs and reports wherever it points (security review
//! 2026-12 row 22). So an output directory is walked the way the daemon walks to its log
//! (`cohabit-host`'s `files::Dir`): from `/` (or the working directory, for a relative path)
//! one component at a time, each opened with `openat(O_NOFOLLOW | O_DIRECTORY)` relative to
//! the one before and made with `mkdirat` when missing ([`OutDir::create`]). A symbolic link
//! anywhere in the path is refused, naming it, even one root made (`/var/run`): give the
//! path it leads to. Files are then created through the directory's descriptor with
//! `O_NOFOLLOW` ([`OutDir::create_file`]), never through the path again.
//!
//! Written here, not shared with `cohabit-host`: the lab sits beside the controller, not
//! above the real host (DESIGN §2), and would otherwise build the host's collectors; core
//! does no I/O. Unlike the daemon's directories, no owner or mode is checked: the lab runs
//! as whoever calls it, into directories they choose.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag};

/// An output directory or file the lab will not write, or an I/O error naming its path.
#[derive(Debug, thiserror::Error)]
pub enum OutDirError {
    /// An operation on `path` failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. "creating".
        what: &'static str,
        /// The directory or file.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
    /// `path` is a symbolic link, which the lab does not write through.
    #[error(
        "{}: it is a symbolic link; the lab writes through no link in an output path (give the path it leads to)",
        path.display()
    )]
    Symlink {
        /// The link.
        path: PathBuf,
    },
    /// `path` exists and is not what was expected.
    #[error("{}: {what}", path.display())]
    Wrong {
        /// The directory or file.
        path: PathBuf,
        /// What is wrong, e.g. "not a directory".
        what: &'static str,
    },
}

fn errno<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(Errno) -> OutDirError + 'a {
    move |e| OutDirError::Io {
        what,
        path: path.to_path_buf(),
        source: io::Error::from(e),
    }
}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

/// An output directory reached without following a symbolic link, held open: the files
/// written in it are created through this descriptor.
#[derive(Debug)]
pub struct OutDir {
    fd: OwnedFd,
    path: PathBuf,
}

impl OutDir {
    /// Walks to `dir` one component at a time without following a link, making missing
    /// directories (mode 0777 less the umask, as `create_dir_all` does).
    pub fn create(dir: &Path) -> Result<OutDir, OutDirError> {
        let start = if dir.is_absolute() { "/" } else { "." };
        let mut fd = nix::fcntl::openat(nix::fcntl::AT_FDCWD, start, DIR_FLAGS, Mode::empty())
            .map_err(errno("opening", Path::new(start)))?;
        let mut at = PathBuf::new();
        for c in dir.components() {
            at.push(c);
            let name = match c {
                Component::RootDir | Component::CurDir | Component::Prefix(_) => continue,
                Component::ParentDir => OsStr::new(".."),
                Component::Normal(n) => n,
            };
            fd = step(&fd, name, &at)?;
        }
        Ok(OutDir {
            fd,
            path: dir.to_path_buf(),
        })
    }

    /// The directory's path, as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates (or truncates) the regular file `name` in this directory for writing, with
    /// `O_NOFOLLOW`: a symbolic link at its place is refused and its target never touched.
    pub fn create_file(&self, name: &str) -> Result<File, OutDirError> {
        let path = self.path.join(name);
        let flags = OFlag::O_WRONLY
            | OFlag::O_CREAT
            | OFlag::O_TRUNC
            | OFlag::O_NOFOLLOW
            | OFlag::O_NONBLOCK
            | OFlag::O_CLOEXEC;
        let fd = match nix::fcntl::openat(&self.fd, name, flags, Mode::from_bits_truncate(0o666)) {
            Ok(fd) => fd,
            Err(Errno::ELOOP) => return Err(OutDirError::Symlink { path }),
            Err(e) => return Err(errno("creating", &path)(e)),
        };
        let file = File::from(fd);
        let meta = file.metadata().map_err(|source| OutDirError::Io {
            what: "checking",
            path: path.clone(),
            source,
        })?;
        if !meta.is_file() {
            return Err(OutDirError::Wrong {
                path,
                what: "not a regular file",
            });
        }
        Ok(file)
    }

    /// Writes `contents` to the file `name` in this directory ([`Self::create_file`]);
    /// returns its path.
    pub fn write(&self, name: &str, contents: &[u8]) -> Result<PathBuf, OutDirError> {
        let mut file = self.create_file(name)?;
        let path = self.path.join(name);
        match file.write_all(contents) {
            Ok(()) => Ok(path),
            Err(source) => Err(OutDirError::Io {
                what: "writing",
                path,
                source,
            }),
        }
    }
}

/// Opens the directory `name` in `parent` (at `at`) without following a link, making it
/// when missing.
fn step(parent: &OwnedFd, name: &OsStr, at: &Path) -> Result<OwnedFd, OutDirError> {
    match nix::fcntl::openat(parent, name, DIR_FLAGS, Mode::empty()) {
        Ok(fd) => Ok(fd),
        Err(Errno::ENOENT) => {
            match nix::sys::stat::mkdirat(parent, name, Mode::from_bits_truncate(0o777)) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(errno("creating", at)(e)),
            }
            // A link swapped in since mkdirat is refused here like any other.
            nix::fcntl::openat(parent, name, DIR_FLAGS, Mode::empty())
                .map_err(|e| refusal(parent, name, at, e))
        }
        Err(e) => Err(refusal(parent, name, at, e)),
    }
}

/// Why `name` in `parent` could not be opened as a directory: a symbolic link, something
/// else than a directory, or the OS error `e`.
fn refusal(parent: &OwnedFd, name: &OsStr, at: &Path, e: Errno) -> OutDirError {
    if !matches!(e, Errno::ELOOP | Errno::ENOTDIR) {
        return errno("opening", at)(e);
    }
    let st = match nix::sys::stat::fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(e) => return errno("checking", at)(e),
    };
    match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFLNK => OutDirError::Symlink {
            path: at.to_path_buf(),
        },
        SFlag::S_IFDIR => errno("opening", at)(e),
        _ => OutDirError::Wrong {
            path: at.to_path_buf(),
            what: "not a directory",
        },
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn is_symlink_error(e: &OutDirError, path: &Path) -> bool {
        matches!(e, OutDirError::Symlink { path: p } if p == path)
            && e.to_string().contains("symbolic link")
    }

    #[test]
    fn a_nested_path_is_created_and_a_file_written_in_it() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a").join("b").join("c");
        let out = OutDir::create(&dir).unwrap();
        assert_eq!(out.path(), dir);
        let path = out.write("f.txt", b"hello\n").unwrap();
        assert_eq!(path, dir.join("f.txt"));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "hello\n");
        // Again over what is there: the directories are opened, the file truncated.
        OutDir::create(&dir).unwrap().write("f.txt", b"x").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "x");
    }

    #[test]
    fn a_relative_path_with_dot_dot_is_walked_from_the_working_directory() {
        // Under `cargo test` the working directory is the crate's; nothing is written.
        let out = OutDir::create(Path::new("src/../src")).unwrap();
        assert_eq!(out.path(), Path::new("src/../src"));
    }

    #[test]
    fn a_symlink_as_the_directory_is_refused_and_nothing_is_written_through_it() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        std::fs::create_dir(&target).unwrap();
        let link = tmp.path().join("run");
        symlink(&target, &link).unwrap();
        let e = OutDir::create(&link).unwrap_err();
        assert!(is_symlink_error(&e, &link), "{e}");
        assert!(e.to_string().contains(&link.display().to_string()), "{e}");
        assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
        // A dangling link is refused too, and nothing is made where it points.
        let dangling = tmp.path().join("dangling");
        symlink(tmp.path().join("nowhere"), &dangling).unwrap();
        let e = OutDir::create(&dangling).unwrap_err();
        assert!(is_symlink_error(&e, &dangling), "{e}");
        assert!(!tmp.path().join("nowhere").exists());
    }

    #[test]
    fn a_symlink_on_the_way_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        std::fs::create_dir(&target).unwrap();
        let link = tmp.path().join("link");
        symlink(&target, &link).unwrap();
        let e = OutDir::create(&link.join("sub").join("run")).unwrap_err();
        assert!(is_symlink_error(&e, &link), "{e}");
        assert!(!target.join("sub").exists());
    }

    #[test]
    fn a_symlink_or_a_directory_in_place_of_a_file_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        let dir = tmp.path().join("run");
        std::fs::create_dir(&dir).unwrap();
        symlink(&victim, dir.join("decisions.jsonl")).unwrap();
        let out = OutDir::create(&dir).unwrap();
        let e = out.create_file("decisions.jsonl").unwrap_err();
        assert!(is_symlink_error(&e, &dir.join("decisions.jsonl")), "{e}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        std::fs::create_dir(dir.join("sub")).unwrap();
        assert!(out.create_file("sub").is_err());
    }

    #[test]
    fn a_file_on_the_way_is_not_a_directory() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("file"), "").unwrap();
        let e = OutDir::create(&tmp.path().join("file").join("run")).unwrap_err();
        assert!(
            matches!(
                &e,
                OutDirError::Wrong {
                    what: "not a directory",
                    ..
                }
            ),
            "{e}"
        );
    }
}
