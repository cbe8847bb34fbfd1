//! CPU facts from sysfs: which CPUs are online, their top frequency, the size of the
//! last-level cache. Read once at start; read-only.
//!
//! Kernel doc: `Documentation/ABI/testing/sysfs-devices-system-cpu`. Facts this module
//! relies on:
//! - `devices/system/cpu/online` is a CPU list (`0-3,8`);
//! - `devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq` is in kHz (absent in many VMs);
//! - `devices/system/cpu/cpu0/cache/index3/size` is the L3 size with a unit suffix
//!   (`32768K`); `index3` is the L3 on x86.
//!
//! Absence is `None`: the caller decides what to assume (the daemon's defaults live in its
//! discovery step, not here).

use std::path::{Path, PathBuf};

use crate::cgroup::CpuList;

/// The online CPUs' list, under the sysfs root.
const ONLINE: &str = "devices/system/cpu/online";

/// sysfs under one root (normally `/sys`).
#[derive(Debug, Clone)]
pub struct Sysfs {
    root: PathBuf,
}

impl Sysfs {
    /// sysfs at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    fn read(&self, rel: &str) -> Option<String> {
        std::fs::read_to_string(self.root.join(rel)).ok()
    }

    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the online CPUs are listed (`devices/system/cpu/online`).
    pub fn online_path(&self) -> PathBuf {
        self.root.join(ONLINE)
    }

    /// Online CPUs; `None` when the file is absent, unparsable or empty.
    pub fn online_cpus(&self) -> Option<Vec<u32>> {
        self.read(ONLINE)?
            .parse::<CpuList>()
            .ok()
            .map(|c| c.0)
            .filter(|c| !c.is_empty())
    }

    /// CPU 0's top frequency in GHz (`cpuinfo_max_freq`).
    pub fn max_freq_ghz(&self) -> Option<f64> {
        self.read("devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")?
            .trim()
            .parse::<f64>()
            .ok()
            .map(|khz| khz / 1e6)
    }

    /// The L3 size in bytes, as CPU 0 sees it.
    pub fn llc_bytes(&self) -> Option<u64> {
        parse_cache_size(&self.read("devices/system/cpu/cpu0/cache/index3/size")?)
    }
}

/// Parses a cache size as sysfs writes it: a number with an optional `K`, `M` or `G`.
pub fn parse_cache_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let (num, mult) = match t.chars().last()? {
        'K' => (&t[..t.len() - 1], 1u64 << 10),
        'M' => (&t[..t.len() - 1], 1 << 20),
        'G' => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<u64>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_carry_their_unit() {
        assert_eq!(parse_cache_size("32768K\n"), Some(32 << 20));
        assert_eq!(parse_cache_size("45M"), Some(45 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size(""), None);
        assert_eq!(parse_cache_size("lots"), None);
    }

    #[test]
    fn a_fixture_tree_is_read_and_absence_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let cpu = dir.path().join("devices/system/cpu");
        std::fs::create_dir_all(cpu.join("cpu0/cpufreq")).unwrap();
        std::fs::create_dir_all(cpu.join("cpu0/cache/index3")).unwrap();
        std::fs::write(cpu.join("online"), "0-3,8\n").unwrap();
        std::fs::write(cpu.join("cpu0/cpufreq/cpuinfo_max_freq"), "3500000\n").unwrap();
        std::fs::write(cpu.join("cpu0/cache/index3/size"), "30720K\n").unwrap();
        let s = Sysfs::new(dir.path());
        assert_eq!(s.online_cpus(), Some(vec![0, 1, 2, 3, 8]));
        assert_eq!(s.max_freq_ghz(), Some(3.5));
        assert_eq!(s.llc_bytes(), Some(30 << 20));
        let empty = Sysfs::new(dir.path().join("nothing"));
        assert_eq!(
            (empty.online_cpus(), empty.max_freq_ghz(), empty.llc_bytes()),
            (None, None, None)
        );
        std::fs::write(cpu.join("online"), "\n").unwrap();
        assert_eq!(s.online_cpus(), None, "an empty list is no list");
    }
}
