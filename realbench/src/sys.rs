//! The few system calls the benchmark needs that `std` lacks: signalling a process or a
//! process group, and the effective user id.

use std::io;

use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// `SIGTERM`: asks a process to stop (cohabit restores the host on it).
pub const SIGTERM: Signal = Signal::SIGTERM;
/// `SIGKILL`: stops a process that did not stop when asked.
pub const SIGKILL: Signal = Signal::SIGKILL;

/// Sends `sig` to process `pid` (`None`: only checks it exists); `Ok(false)` when there is
/// no such process.
pub fn kill(pid: u32, sig: impl Into<Option<Signal>>) -> io::Result<bool> {
    let pid = i32::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    signal(pid, sig)
}

/// Sends `sig` to every process of process group `pgid`; `Ok(false)` when the group is
/// empty.
pub fn kill_group(pgid: u32, sig: impl Into<Option<Signal>>) -> io::Result<bool> {
    let pgid = i32::try_from(pgid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    if pgid <= 1 {
        // 0 and 1 would signal this process's own group or init: never meant here.
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    signal(-pgid, sig)
}

/// kill(2): a negative `target` names a process group; no signal only checks it exists.
fn signal(target: i32, sig: impl Into<Option<Signal>>) -> io::Result<bool> {
    match nix::sys::signal::kill(Pid::from_raw(target), sig) {
        Ok(()) => Ok(true),
        Err(nix::errno::Errno::ESRCH) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// This process's effective uid (the user the processes it starts run as).
pub fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// Whether this process runs as root (cgroups and the daemon need it).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        .unwrap_or(false)
}

/// Whether process `pid` exists and is not a zombie (a zombie has exited; only its entry
/// waits for its parent).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let after = s.rfind(')')?;
            s[after + 1..].split_whitespace().next().map(|st| st != "Z")
        })
        .unwrap_or(false)
}

/// The `comm` (short executable name) of a process.
pub fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// The first argument `pid` was started with (`run` for `cohabit run`), if any.
pub fn first_arg(pid: u32) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let arg = raw.split(|b| *b == 0).nth(1)?;
    (!arg.is_empty()).then(|| String::from_utf8_lossy(arg).into_owned())
}

/// User + system CPU seconds a process has used so far.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = s.rfind(')')?;
    let f: Vec<&str> = s[after + 1..].split_whitespace().collect();
    // After the name: state is field 3 of stat(5), utime 14 and stime 15.
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks())
}

fn clock_ticks() -> f64 {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        #[allow(clippy::cast_precision_loss)] // a few hundred
        Ok(Some(t)) if t > 0 => t as f64,
        _ => 100.0,
    }
}

/// The process group of a process.
pub fn pgid(pid: u32) -> Option<u32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = s.rfind(')')?;
    // After the name: state, ppid, pgrp.
    s[after + 1..].split_whitespace().nth(2)?.parse().ok()
}

/// Pids of every process on the host.
pub fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|it| {
            it.filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_with_a_name_and_cpu_time() {
        let me = std::process::id();
        assert!(alive(me));
        assert!(comm(me).is_some());
        assert!(cpu_seconds(me).is_some());
        assert!(all_pids().contains(&me));
        assert!(pgid(me).is_some());
        assert!(!alive(u32::MAX));
    }

    #[test]
    fn first_arg_reads_what_a_process_was_started_with() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        // Until its exec is done, the child carries the test's command line, then none.
        let t = std::time::Instant::now();
        let mut got = first_arg(child.id());
        while got.as_deref() != Some("30") && t.elapsed().as_secs() < 5 {
            std::thread::sleep(std::time::Duration::from_millis(10));
            got = first_arg(child.id());
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(got.as_deref(), Some("30"));
        assert_eq!(first_arg(u32::MAX), None);
    }

    #[test]
    fn signalling_a_missing_process_is_not_an_error_and_group_1_is_refused() {
        // Pid numbers above pid_max never exist.
        assert!(!kill(4_000_000, None).unwrap());
        assert!(kill_group(1, None).is_err());
        assert!(kill_group(0, None).is_err());
        assert!(kill(std::process::id(), None).unwrap());
    }
}
