//! Restart hooks: the shell command that restarts a GPU client so it picks up its new MPS
//! share (`systemctl restart llm.service`).
//!
//! A hook can take minutes (a unit's stop and start time-outs) or hang, so it never runs
//! inside a tick (security review row 7). [`run`] is the blocking part, run on a thread of
//! its own by the caller: `sh -c <command>` in a process group of its own, with stdin from
//! `/dev/null`, the working directory `/`, an environment holding only what [`environment`]
//! passes, and stdout and stderr captured up to [`OUTPUT_CAP`] bytes each (the rest is read
//! and dropped, so a chatty hook never blocks on a full pipe). When the time-out passes, or
//! the caller cancels, the whole group gets SIGKILL: a hook's children die with it.
//!
//! The pipes are read without blocking, on the caller's thread, between its checks of the
//! hook ([`Capture`]): no thread of their own waits on them. After the hook exits they are
//! read for at most [`OUTPUT_GRACE`] more, then closed: a background child that still holds
//! them (the 2026-12b review's L8) then meets a closed pipe when it writes, and nothing of
//! the daemon's waits for it.
//!
//! A hook that exits normally keeps its children: a hook may start the client itself in the
//! background.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, OFlag};
use nix::poll::{PollFd, PollFlags, PollTimeout};

/// Most bytes of a hook's stdout, and of its stderr, that are kept for the log.
pub const OUTPUT_CAP: usize = 64 * 1024;

/// How often a running hook is checked for exit, time-out and cancellation.
const POLL: Duration = Duration::from_millis(10);

/// How long output is still read after the hook exited (a background child it started may
/// hold the pipes open for ever); the pipes are closed then.
const OUTPUT_GRACE: Duration = Duration::from_millis(500);

/// `PATH` for a hook when the daemon has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// One hook to run.
#[derive(Debug, Clone)]
pub struct Hook {
    /// The shell command.
    pub command: String,
    /// Its whole environment (see [`environment`]).
    pub env: Vec<(OsString, OsString)>,
    /// Longest it may run before its process group is killed.
    pub timeout: Duration,
}

/// How a hook ended.
#[derive(Debug)]
pub enum Outcome {
    /// It exited (successfully or not) within its time.
    Exited {
        /// Its exit status.
        status: ExitStatus,
        /// What it printed (each at most [`OUTPUT_CAP`] bytes).
        output: Output,
    },
    /// It ran past its time-out, or was cancelled, and its process group was killed.
    Killed {
        /// True when cancelled (shutdown) rather than timed out.
        cancelled: bool,
        /// How long it ran.
        after: Duration,
        /// What it printed before.
        output: Output,
    },
    /// It could not be started.
    NotStarted(io::Error),
}

impl Outcome {
    /// True when the hook exited with status 0.
    pub fn succeeded(&self) -> bool {
        matches!(self, Outcome::Exited { status, .. } if status.success())
    }
}

/// What a hook printed, cut at [`OUTPUT_CAP`] bytes per stream.
#[derive(Debug, Default)]
pub struct Output {
    /// Standard output (lossy UTF-8, trimmed).
    pub stdout: String,
    /// Standard error (lossy UTF-8, trimmed).
    pub stderr: String,
    /// True when either stream was longer than the cap.
    pub truncated: bool,
}

/// A hook's environment: `PATH` and every `CUDA_*` variable of `daemon` (the daemon's own
/// environment), then `extra` (the share being applied). Nothing else of the daemon's
/// environment (`LD_PRELOAD`, credentials, `RUST_LOG`) reaches the hook.
pub fn environment(
    daemon: impl IntoIterator<Item = (OsString, OsString)>,
    extra: &[(&str, String)],
) -> Vec<(OsString, OsString)> {
    let mut env: Vec<(OsString, OsString)> = daemon
        .into_iter()
        .filter(|(k, _)| k == "PATH" || k.to_str().is_some_and(|k| k.starts_with("CUDA_")))
        .collect();
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), DEFAULT_PATH.into()));
    }
    for (k, v) in extra {
        env.retain(|(name, _)| name != k);
        env.push(((*k).into(), v.into()));
    }
    env
}

/// Runs `hook` to the end, its time-out, or `cancel` (checked every 10 ms). Blocks: call it
/// from a thread of its own.
pub fn run(hook: &Hook, cancel: &AtomicBool) -> Outcome {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(&hook.command)
        .env_clear()
        .envs(hook.env.iter().map(|(k, v)| (k, v)))
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return Outcome::NotStarted(e),
    };
    let mut out = Capture::new([
        child.stdout.take().map(OwnedFd::from),
        child.stderr.take().map(OwnedFd::from),
    ]);
    let started = Instant::now();
    let ended = wait(&mut child, &mut out, started + hook.timeout, cancel);
    let output = out.finish(Instant::now() + OUTPUT_GRACE);
    match ended {
        Ok(Ended::Exited(status)) => Outcome::Exited { status, output },
        Ok(Ended::Killed { cancelled }) => Outcome::Killed {
            cancelled,
            after: started.elapsed(),
            output,
        },
        Err(e) => Outcome::NotStarted(e),
    }
}

enum Ended {
    Exited(ExitStatus),
    Killed { cancelled: bool },
}

/// Waits for `child` until `deadline` or `cancel`, reading its output meanwhile; then kills
/// its process group.
fn wait(
    child: &mut Child,
    out: &mut Capture,
    deadline: Instant,
    cancel: &AtomicBool,
) -> io::Result<Ended> {
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Ended::Exited(status));
        }
        let cancelled = cancel.load(Ordering::Relaxed);
        if cancelled || Instant::now() >= deadline {
            // The child is not yet reaped, so its pid (the group's id) cannot have been
            // reused.
            if let Err(e) = kill_group(child.id()) {
                tracing::warn!(pgid = child.id(), error = %e, "could not kill a restart hook's process group");
                let _ = child.kill();
            }
            child.wait()?;
            return Ok(Ended::Killed { cancelled });
        }
        out.pump(POLL);
    }
}

/// SIGKILL to every process of the group `pgid` (the group the hook leads:
/// `process_group(0)` made its pid the group's id, and the caller has not reaped the
/// leader, so the id still names that group).
fn kill_group(pgid: u32) -> io::Result<()> {
    let pgid = i32::try_from(pgid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pgid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .map_err(io::Error::from)
}

/// A hook's stdout and stderr, read without blocking: the first [`OUTPUT_CAP`] bytes of
/// each are kept, the rest read and dropped.
struct Capture {
    streams: [Stream; 2],
}

#[derive(Default)]
struct Stream {
    /// Open until its end was read, or until [`Capture::finish`] closed it.
    pipe: Option<File>,
    kept: Vec<u8>,
    more: bool,
}

impl Stream {
    fn new(fd: Option<OwnedFd>) -> Self {
        let pipe = fd.and_then(|fd| {
            match nix::fcntl::fcntl(&fd, FcntlArg::F_SETFL(OFlag::O_NONBLOCK)) {
                Ok(_) => Some(File::from(fd)),
                Err(e) => {
                    // A blocking read could hang the caller: this stream is not read.
                    tracing::warn!(error = %e, "a restart hook's output is not captured");
                    None
                }
            }
        });
        Self {
            pipe,
            ..Self::default()
        }
    }

    /// Reads what is there now; at the end of the stream, or on an error, closes it.
    fn read_available(&mut self) {
        let Some(pipe) = &mut self.pipe else {
            return;
        };
        let mut buf = [0u8; 8192];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let room = OUTPUT_CAP - self.kept.len();
                    self.kept.extend_from_slice(&buf[..n.min(room)]);
                    self.more |= n > room;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => break,
            }
        }
        self.pipe = None;
    }

    /// The text kept, noting a pipe still open when it was closed.
    fn text(&self, closed_open: bool) -> String {
        let text = String::from_utf8_lossy(&self.kept).trim().to_string();
        match (closed_open, text.is_empty()) {
            (false, _) => text,
            (true, true) => "(output still open; not waited for)".into(),
            (true, false) => format!("{text}\n(output still open; not waited for)"),
        }
    }
}

impl Capture {
    fn new([out, err]: [Option<OwnedFd>; 2]) -> Self {
        Self {
            streams: [Stream::new(out), Stream::new(err)],
        }
    }

    fn open(&self) -> bool {
        self.streams.iter().any(|s| s.pipe.is_some())
    }

    /// Waits at most `timeout` for output (or the end of a stream), and reads what came.
    fn pump(&mut self, timeout: Duration) {
        if !self.open() {
            std::thread::sleep(timeout);
            return;
        }
        let ready = {
            let mut fds: Vec<PollFd<'_>> = self
                .streams
                .iter()
                .filter_map(|s| s.pipe.as_ref())
                .map(|p| PollFd::new(p.as_fd(), PollFlags::POLLIN))
                .collect();
            let t = PollTimeout::try_from(timeout).unwrap_or(PollTimeout::MAX);
            // EINTR and the like: read anyway (the pipes do not block).
            nix::poll::poll(&mut fds, t).map_or(1, |n| n)
        };
        if ready > 0 {
            for s in &mut self.streams {
                s.read_available();
            }
        }
    }

    /// Reads until both streams ended or `deadline`, then closes them: what it kept.
    fn finish(mut self, deadline: Instant) -> Output {
        loop {
            for s in &mut self.streams {
                s.read_available();
            }
            let now = Instant::now();
            if !self.open() || now >= deadline {
                break;
            }
            self.pump(POLL.min(deadline - now));
        }
        let [out, err] = &self.streams;
        Output {
            stdout: out.text(out.pipe.is_some()),
            stderr: err.text(err.pipe.is_some()),
            truncated: out.more || err.more,
        }
        // The pipes close here.
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::testing::running;

    fn hook(command: &str, timeout_ms: u64) -> Hook {
        Hook {
            command: command.into(),
            env: environment(std::env::vars_os(), &[]),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    /// Processes of group `pgid` still running after up to two seconds (zombies waiting
    /// for a reaper do not count). SIGKILL is delivered asynchronously: a killed process
    /// may still show its run state for a moment after `killpg` returns, longer on a loaded
    /// machine (a CI run beside two builds caught one).
    pub(crate) fn live_members(pgid: u32) -> Vec<u32> {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let left = running(pgid);
            if left.is_empty() || Instant::now() >= deadline {
                return left;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn the_environment_holds_only_path_cuda_and_the_share() {
        let daemon = [
            ("PATH", "/usr/bin"),
            ("HOME", "/root"),
            ("LD_PRELOAD", "/tmp/evil.so"),
            ("CUDA_VISIBLE_DEVICES", "0"),
            ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"),
            ("RUST_LOG", "debug"),
        ]
        .map(|(k, v)| (OsString::from(k), OsString::from(v)));
        let env = environment(
            daemon,
            &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40".to_string())],
        );
        let mut names: Vec<String> = env
            .iter()
            .map(|(k, v)| format!("{}={}", k.to_string_lossy(), v.to_string_lossy()))
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40",
                "CUDA_VISIBLE_DEVICES=0",
                "PATH=/usr/bin"
            ]
        );
        let without_path = environment(Vec::new(), &[]);
        assert_eq!(without_path, vec![("PATH".into(), DEFAULT_PATH.into())]);
    }

    #[test]
    fn a_hook_runs_with_that_environment_no_stdin_and_its_output_captured() {
        let h = Hook {
            command: "env; pwd; cat; echo oops >&2; exit 3".into(),
            env: environment(
                [("HOME".into(), "/root".into())],
                &[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40".to_string())],
            ),
            timeout: Duration::from_secs(10),
        };
        let Outcome::Exited { status, output } = run(&h, &AtomicBool::new(false)) else {
            panic!("the hook did not exit");
        };
        assert_eq!(status.code(), Some(3));
        let lines: Vec<&str> = output.stdout.lines().collect();
        assert!(
            lines.contains(&"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40"),
            "{lines:?}"
        );
        assert!(!output.stdout.contains("HOME="), "{lines:?}");
        // What the shell itself sets (PWD, SHLVL, `_`) aside, nothing else is there.
        for l in &lines {
            let name = l.split('=').next().unwrap_or_default();
            assert!(
                name == "PATH"
                    || name.starts_with("CUDA_")
                    || ["PWD", "SHLVL", "_", "OLDPWD"].contains(&name)
                    || !l.contains('='),
                "unexpected variable {l:?}"
            );
        }
        assert_eq!(lines.last(), Some(&"/"), "runs in /, stdin empty");
        assert_eq!(output.stderr, "oops");
        assert!(!output.truncated);
    }

    #[test]
    fn output_beyond_the_cap_is_dropped_without_blocking_the_hook() {
        let h = hook("head -c 1000000 /dev/zero | tr '\\0' x", 10_000);
        let Outcome::Exited { status, output } = run(&h, &AtomicBool::new(false)) else {
            panic!("the hook did not exit");
        };
        assert!(status.success());
        assert_eq!(output.stdout.len(), OUTPUT_CAP);
        assert!(output.truncated);
    }

    #[test]
    fn a_hook_past_its_time_out_is_killed_with_its_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let pgid_file = dir.path().join("pgid");
        let h = hook(
            &format!("echo $$ > {}; sleep 3600; echo never", pgid_file.display()),
            300,
        );
        let started = Instant::now();
        let outcome = run(&h, &AtomicBool::new(false));
        assert!(started.elapsed() < Duration::from_secs(5), "{outcome:?}");
        let Outcome::Killed {
            cancelled, after, ..
        } = outcome
        else {
            panic!("not killed: {outcome:?}");
        };
        assert!(!cancelled);
        assert!(after >= Duration::from_millis(300));
        let pgid: u32 = std::fs::read_to_string(&pgid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(live_members(pgid), Vec::<u32>::new(), "the group is gone");
    }

    #[test]
    fn output_pipes_a_background_child_holds_are_closed_once_the_grace_is_over() {
        let dir = tempfile::tempdir().unwrap();
        let status = dir.path().join("status");
        // The child left behind writes after the hook ended: it must find nobody reading.
        let h = hook(
            &format!(
                "( trap '' PIPE; sleep 2; echo late; echo $? > {} ) & echo early",
                status.display()
            ),
            10_000,
        );
        let started = Instant::now();
        let Outcome::Exited { status: st, output } = run(&h, &AtomicBool::new(false)) else {
            panic!("the hook did not exit");
        };
        assert!(st.success());
        assert!(
            started.elapsed() < OUTPUT_GRACE + Duration::from_millis(1500),
            "waited {:?} for a pipe a background child holds",
            started.elapsed()
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        let code = loop {
            match std::fs::read_to_string(&status) {
                Ok(t) if !t.trim().is_empty() => break t.trim().to_string(),
                _ => {}
            }
            assert!(
                Instant::now() < deadline,
                "the background child never wrote"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_ne!(code, "0", "a reader of the hook's pipe was still there");
        assert!(output.stdout.starts_with("early"), "{output:?}");
        assert!(output.stdout.contains("not waited for"), "{output:?}");
    }

    #[test]
    fn a_cancelled_hook_is_killed_at_once() {
        let cancel = AtomicBool::new(true);
        let started = Instant::now();
        let outcome = run(&hook("sleep 3600", 60_000), &cancel);
        assert!(
            matches!(
                outcome,
                Outcome::Killed {
                    cancelled: true,
                    ..
                }
            ),
            "{outcome:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
