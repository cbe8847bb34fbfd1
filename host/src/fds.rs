//! A reserve of open-file slots kept for restoring the host.
//!
//! Restoring writes control files, removes directories, reads `/proc` and saves the record
//! of changes: every write opens a file, so directory descriptors opened at start would not
//! be enough at `EMFILE` (an `openat` relative to them still needs a free slot for the file
//! it opens). Instead the daemon holds [`RESTORE_RESERVE`] descriptors of `/dev/null` from
//! the start and closes them just before it restores, after the metrics listener (which
//! would take freed slots for new connections) is stopped. Restoring opens one control
//! file at a time, and saving the record a few (its temporary file, the directory), so it
//! has free slots however many the daemon had in use (a flood of connections, hardware
//! counters). The Kubernetes watch, when configured, still runs and could take one.

use std::fs::File;
use std::path::Path;

/// How many slots the daemon keeps for restoring.
pub const RESTORE_RESERVE: usize = 16;

/// Descriptors held only to be closed when their slots are needed.
#[derive(Debug, Default)]
pub struct FdReserve {
    held: Vec<File>,
}

impl FdReserve {
    /// Holds `n` descriptors of `/dev/null`.
    pub fn open(n: usize) -> std::io::Result<Self> {
        Self::open_of(Path::new("/dev/null"), n)
    }

    /// Holds `n` descriptors of `path` (opened read-only, close-on-exec).
    pub fn open_of(path: &Path, n: usize) -> std::io::Result<Self> {
        let held = (0..n)
            .map(|_| File::open(path))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("reserving {n} descriptors of {}: {e}", path.display()),
                )
            })?;
        Ok(Self { held })
    }

    /// How many descriptors are held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Closes every held descriptor, freeing their slots; returns how many.
    pub fn release(&mut self) -> usize {
        let n = self.held.len();
        self.held.clear();
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_holds_its_descriptors_until_released() {
        use std::os::fd::AsRawFd;
        let mut r = FdReserve::open(RESTORE_RESERVE).unwrap();
        assert_eq!(r.len(), RESTORE_RESERVE);
        for f in &r.held {
            let link = std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd())).unwrap();
            assert_eq!(link, Path::new("/dev/null"));
        }
        assert_eq!(r.release(), RESTORE_RESERVE);
        assert!(r.is_empty());
        assert_eq!(r.release(), 0);
    }

    #[test]
    fn a_reserve_that_cannot_be_opened_names_the_path() {
        let e = FdReserve::open_of(Path::new("/nonexistent/cohabit-null"), 2).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/cohabit-null"), "{e}");
    }
}
