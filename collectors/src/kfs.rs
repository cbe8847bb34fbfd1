//! The narrow waist between cohabit and kernel pseudo-filesystems (resctrl, cgroupfs).
//!
//! Production code goes through [`RealFs`] (plain `std::fs` calls on the real paths). Tests
//! can substitute a fake that validates writes the way the kernel does (see
//! `resctrl::fake`), which a plain directory cannot.

use std::fmt::Debug;
use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// An exclusive lock held until dropped.
pub trait LockGuard: Debug {}

/// The file operations cohabit performs on kernel pseudo-filesystems.
pub trait KernelFs: Debug + Send + Sync {
    /// Reads a whole file.
    fn read_to_string(&self, path: &Path) -> io::Result<String>;
    /// Writes `data` in one `write(2)`, as kernel files expect.
    fn write(&self, path: &Path, data: &str) -> io::Result<()>;
    /// `mkdir(2)`.
    fn create_dir(&self, path: &Path) -> io::Result<()>;
    /// `rmdir(2)`.
    fn remove_dir(&self, path: &Path) -> io::Result<()>;
    /// Names of the subdirectories of `path`.
    fn subdirs(&self, path: &Path) -> io::Result<Vec<String>>;
    /// An identity that changes when the object is recreated (the inode number).
    fn identity(&self, path: &Path) -> io::Result<u64>;
    /// Takes `flock(LOCK_EX)` on `path` (a directory).
    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn LockGuard>>;
}

/// The real kernel filesystems.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealFs;

#[derive(Debug)]
struct FileLock(#[allow(dead_code)] File);

impl LockGuard for FileLock {}

impl KernelFs for RealFs {
    fn read_to_string(&self, path: &Path) -> io::Result<String> {
        std::fs::read_to_string(path)
    }

    fn write(&self, path: &Path, data: &str) -> io::Result<()> {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(path)?;
        f.write_all(data.as_bytes())
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir(path)
    }

    fn remove_dir(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_dir(path)
    }

    fn subdirs(&self, path: &Path) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for entry in std::fs::read_dir(path)? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                out.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        out.sort();
        Ok(out)
    }

    fn identity(&self, path: &Path) -> io::Result<u64> {
        Ok(std::fs::metadata(path)?.ino())
    }

    fn lock_exclusive(&self, path: &Path) -> io::Result<Box<dyn LockGuard>> {
        let f = File::open(path)?;
        f.lock()?;
        Ok(Box::new(FileLock(f)))
    }
}
