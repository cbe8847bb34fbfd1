//! Directories the lab writes into (`simulate --out`, `compare --out`, `plot --out`,
//! `report --out`), reached without following a symbolic link another user owns.
//!
//! The lab's commands are often run as root with an output path under a directory other
//! users can write (`/tmp`). A symbolic link planted there as the directory, or as one on
//! the way to it, would send decision logs and reports wherever it points (security review
//! 2026-12 row 22). So an output directory is walked the way the daemon walks to its log
//! (`cohabit-host`'s `files::Dir`): from `/` (or the working directory, for a relative path)
//! one component at a time, each opened with `openat(O_NOFOLLOW | O_DIRECTORY)` relative to
//! the one before and made with `mkdirat` when missing ([`OutDir::create`]). A symbolic link
//! on the way is followed only when root or the caller owns it (a home directory linked
//! elsewhere by the administrator or the user): any other user's link is refused, naming
//! it, since that user may have planted it (a followed link's target is resolved by the
//! kernel: its owner chose it). Files are then created through the
//! directory's descriptor with `O_NOFOLLOW` ([`OutDir::create_file`]), never through the
//! path again, and a link in a file's place is refused whoever owns it.
//!
//! Written here, not shared with `cohabit-host`: the lab sits beside the controller, not
//! above the real host (DESIGN §2), and would otherwise build the host's collectors; core
//! does no I/O. Unlike the daemon's directories, no directory's owner or mode is checked:
//! the lab runs as whoever calls it, into directories they choose.

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
    /// `path`, a file to write, is a symbolic link, which the lab does not write through.
    #[error(
        "{}: it is a symbolic link; the lab writes no file through a link",
        path.display()
    )]
    Symlink {
        /// The link.
        path: PathBuf,
    },
    /// `path`, a directory on the way, is a symbolic link another user owns (they may have
    /// planted it).
    #[error(
        "{}: it is a symbolic link owned by another user; the lab follows only root's and the caller's links in an output path (give the path it leads to)",
        path.display()
    )]
    ForeignLink {
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

/// An output directory reached through no link another user owns, held open: the files
/// written in it are created through this descriptor.
#[derive(Debug)]
pub struct OutDir {
    fd: OwnedFd,
    path: PathBuf,
}

impl OutDir {
    /// Walks to `dir` one component at a time, following no link another user owns, making
    /// missing directories (mode 0777 less the umask, as `create_dir_all` does).
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

/// Opens the directory `name` in `parent` (at `at`), following a link only where
/// [`follow_or_refuse`] trusts it, making the directory when missing.
fn step(parent: &OwnedFd, name: &OsStr, at: &Path) -> Result<OwnedFd, OutDirError> {
    match nix::fcntl::openat(parent, name, DIR_FLAGS, Mode::empty()) {
        Ok(fd) => Ok(fd),
        Err(Errno::ENOENT) => {
            match nix::sys::stat::mkdirat(parent, name, Mode::from_bits_truncate(0o777)) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(errno("creating", at)(e)),
            }
            // A link swapped in since mkdirat is judged here like any other.
            nix::fcntl::openat(parent, name, DIR_FLAGS, Mode::empty())
                .or_else(|e| follow_or_refuse(parent, name, at, e))
        }
        Err(e) => follow_or_refuse(parent, name, at, e),
    }
}

/// `name` in `parent` could not be opened as a directory without following a link (`e`):
/// opened through the link when root or the caller owns it, else refused as a symbolic
/// link; refused as not a directory, or with the OS error `e`, when it is no link.
fn follow_or_refuse(
    parent: &OwnedFd,
    name: &OsStr,
    at: &Path,
    e: Errno,
) -> Result<OwnedFd, OutDirError> {
    if !matches!(e, Errno::ELOOP | Errno::ENOTDIR) {
        return Err(errno("opening", at)(e));
    }
    let st = nix::sys::stat::fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(errno("checking", at))?;
    match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFLNK if trusted_owner(st.st_uid) => {
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
            nix::fcntl::openat(parent, name, flags, Mode::empty()).map_err(|e| match e {
                Errno::ENOTDIR => OutDirError::Wrong {
                    path: at.to_path_buf(),
                    what: "a link to something that is not a directory",
                },
                e => errno("opening", at)(e),
            })
        }
        SFlag::S_IFLNK => Err(OutDirError::ForeignLink {
            path: at.to_path_buf(),
        }),
        SFlag::S_IFDIR => Err(errno("opening", at)(e)),
        _ => Err(OutDirError::Wrong {
            path: at.to_path_buf(),
            what: "not a directory",
        }),
    }
}

/// A link owner whose links are followed: root, or the caller (effective uid).
fn trusted_owner(uid: u32) -> bool {
    uid == 0 || uid == nix::unistd::geteuid().as_raw()
}

/// Makes `link` a symbolic link to `target` owned by another user (uid 65534, `nobody`),
/// as one planted by them would be: true when done; false, the test's skip recorded, where
/// this process is not root (only root gives a link away).
#[cfg(test)]
pub(crate) fn foreign_symlink(target: &Path, link: &Path) -> bool {
    if !cohabit_testkit::is_root() {
        cohabit_testkit::skip(
            cohabit_testkit::Need::Root,
            "a link owned by another user needs root to make",
        );
        return false;
    }
    std::os::unix::fs::symlink(target, link).unwrap();
    nix::unistd::fchownat(
        nix::fcntl::AT_FDCWD,
        link,
        Some(nix::unistd::Uid::from_raw(65534)),
        None,
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .unwrap();
    true
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn is_symlink_error(e: &OutDirError, path: &Path) -> bool {
        matches!(e, OutDirError::Symlink { path: p } if p == path)
            && e.to_string().contains("symbolic link")
    }

    fn is_foreign_link_error(e: &OutDirError, path: &Path) -> bool {
        matches!(e, OutDirError::ForeignLink { path: p } if p == path)
            && e.to_string().contains("owned by another user")
    }

    #[test]
    fn a_link_the_caller_owns_is_followed() {
        // A home directory linked elsewhere: the caller's (or root's) own link.
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        std::fs::create_dir(&target).unwrap();
        let link = tmp.path().join("home");
        symlink(&target, &link).unwrap();
        let out = OutDir::create(&link.join("runs").join("a")).unwrap();
        out.write("f.txt", b"x").unwrap();
        assert_eq!(
            std::fs::read_to_string(target.join("runs").join("a").join("f.txt")).unwrap(),
            "x"
        );
        // Even so, a link to a file on the way is not a directory.
        std::fs::write(tmp.path().join("file"), "").unwrap();
        symlink(tmp.path().join("file"), tmp.path().join("to-file")).unwrap();
        let e = OutDir::create(&tmp.path().join("to-file").join("run")).unwrap_err();
        assert!(matches!(e, OutDirError::Wrong { .. }), "{e}");
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
    fn another_users_link_as_the_directory_is_refused_and_nothing_is_written_through_it() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        std::fs::create_dir(&target).unwrap();
        let link = tmp.path().join("run");
        if !foreign_symlink(&target, &link) {
            return;
        }
        let e = OutDir::create(&link).unwrap_err();
        assert!(is_foreign_link_error(&e, &link), "{e}");
        assert!(e.to_string().contains(&link.display().to_string()), "{e}");
        assert_eq!(std::fs::read_dir(&target).unwrap().count(), 0);
        // A dangling link is refused too, and nothing is made where it points.
        let dangling = tmp.path().join("dangling");
        assert!(foreign_symlink(&tmp.path().join("nowhere"), &dangling));
        let e = OutDir::create(&dangling).unwrap_err();
        assert!(is_foreign_link_error(&e, &dangling), "{e}");
        assert!(!tmp.path().join("nowhere").exists());
    }

    #[test]
    fn another_users_link_on_the_way_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("target");
        std::fs::create_dir(&target).unwrap();
        let link = tmp.path().join("link");
        if !foreign_symlink(&target, &link) {
            return;
        }
        let e = OutDir::create(&link.join("sub").join("run")).unwrap_err();
        assert!(is_foreign_link_error(&e, &link), "{e}");
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
