//! `/proc/<pid>/mountinfo`: the one parser for every mount cohabit looks for (the cgroup
//! hierarchies in [`crate::cgroup`], the resctrl mount in [`crate::resctrl`]).
//!
//! Kernel doc: `Documentation/filesystems/proc.rst` (3.5). A line is
//! `ID PARENT MAJ:MIN ROOT MOUNT_POINT MOUNT_OPTS [OPTIONAL…] - FSTYPE SOURCE SUPER_OPTS`;
//! the mount point escapes space, tab, newline and backslash as `\040`, `\011`, `\012` and
//! `\134`.
//!
//! Each line is parsed by the `procfs` crate (`MountInfo::from_line`, which reads text, so
//! it works on an injected root and through [`crate::kfs::KernelFs`]). A line it cannot parse
//! is skipped rather than failing the whole file: one odd mount must not hide the others.
//! The crate leaves the octal escapes in the mount point; [`unescape`] undoes them.

use std::path::PathBuf;

use procfs::process::MountInfo;

/// One mount, as cohabit needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Where it is mounted, unescaped.
    pub mount_point: PathBuf,
    /// Filesystem type, e.g. `cgroup`, `cgroup2`, `resctrl`.
    pub fs_type: String,
    /// Per-mount options (`rw`, `nosuid`, …), sorted; `key=value` where they have a value.
    pub mount_options: Vec<String>,
    /// Per-superblock options (v1 cgroup controllers, `mba_MBps`, `cdp`, …), sorted.
    pub super_options: Vec<String>,
}

impl Mount {
    /// True if `opt` is among the mount or superblock options.
    pub fn has_option(&self, opt: &str) -> bool {
        self.mount_options.iter().any(|o| o == opt) || self.super_options.iter().any(|o| o == opt)
    }
}

/// The mounts in mountinfo text, in file order.
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|l| MountInfo::from_line(l).ok())
        .map(|m| Mount {
            mount_point: PathBuf::from(unescape(&m.mount_point.to_string_lossy())),
            fs_type: m.fs_type,
            mount_options: options(m.mount_options),
            super_options: options(m.super_options),
        })
        .collect()
}

fn options(map: std::collections::HashMap<String, Option<String>>) -> Vec<String> {
    let mut out: Vec<String> = map
        .into_iter()
        .map(|(k, v)| match v {
            Some(v) => format!("{k}={v}"),
            None => k,
        })
        .collect();
    out.sort();
    out
}

/// Undoes the kernel's octal escapes (`\040` → space, and any other `\NNN`).
pub fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        match octal {
            Some(b) => {
                out.push(b);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_become_mounts_with_both_option_sets() {
        let text = "30 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:7 - cgroup cgroup rw,cpu,cpuacct\n\
                    40 25 0:35 / /sys/fs/resctrl rw,relatime - resctrl resctrl rw,mba_MBps\n";
        let m = parse(text);
        assert_eq!(m.len(), 2);
        assert_eq!(
            m[0].mount_point,
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct")
        );
        assert_eq!(m[0].fs_type, "cgroup");
        assert_eq!(m[0].super_options, vec!["cpu", "cpuacct", "rw"]);
        assert!(m[0].has_option("nosuid"));
        assert_eq!(m[1].fs_type, "resctrl");
        assert!(m[1].has_option("mba_MBps"));
    }

    #[test]
    fn escaped_mount_points_are_unescaped_and_bad_lines_skipped() {
        let text = "garbage line\n\
                    41 25 0:36 / /mnt/my\\040dir\\134x rw - tmpfs none rw\n";
        let m = parse(text);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].mount_point, PathBuf::from("/mnt/my dir\\x"));
        assert_eq!(unescape("a\\011b\\0"), "a\tb\\0");
    }
}
