//! NVIDIA MPS through its control program, `nvidia-cuda-mps-control`. This module owns the
//! interface: it reads the server and client lists and sets active-thread percentages and
//! pinned-memory limits.
//!
//! NVIDIA's MPS documentation: each command is written to the program's standard input
//! (`echo get_server_list | nvidia-cuda-mps-control`), which forwards it to the control
//! daemon found through `CUDA_MPS_PIPE_DIRECTORY`; lists come back one PID per line;
//! `set_*` commands print nothing when they succeed; without a running daemon the program
//! prints "Cannot find MPS control daemon process" and fails. We therefore treat a non-zero
//! exit, or any output from a `set_*` command, as a refusal and keep the text verbatim.
//!
//! A running client's share cannot be changed: a new share applies to clients started
//! afterwards. Publishing shares and restarting clients is the daemon's job; see
//! `controller::daemon::gpu`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Most bytes of an answer kept (lists are a few PIDs); the rest is read and dropped.
const ANSWER_CAP: usize = 1 << 20;

/// Reads a pipe to its end on a thread, so the program never blocks on a full pipe while
/// we wait for it; keeps the first [`ANSWER_CAP`] bytes.
fn drain(mut pipe: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let room = ANSWER_CAP - kept.len();
                    kept.extend_from_slice(&buf[..n.min(room)]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        kept
    })
}

/// What a drained pipe held: waits at most until `deadline` for it to close (a child the
/// program left behind may hold it open).
fn answer_of(pipe: Option<JoinHandle<Vec<u8>>>, deadline: Instant) -> String {
    let Some(h) = pipe else {
        return String::new();
    };
    while !h.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    if !h.is_finished() {
        return String::new();
    }
    String::from_utf8_lossy(&h.join().unwrap_or_default())
        .trim()
        .to_string()
}

/// Why a control command failed.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    /// The control program could not be run.
    #[error("running {binary}: {source}")]
    Spawn {
        /// The program.
        binary: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The control daemon answered with an error (or is not running).
    #[error("MPS control refused {command:?}: {answer}")]
    Refused {
        /// What was sent.
        command: String,
        /// What it said.
        answer: String,
    },
    /// The control program did not answer in time.
    #[error("MPS control did not answer {command:?} within {timeout_ms} ms")]
    Timeout {
        /// What was sent.
        command: String,
        /// The limit.
        timeout_ms: u128,
    },
    /// An answer that should have been a list of numbers was not.
    #[error("MPS control answered {command:?} with {answer:?}, expected PIDs or a number")]
    Unparsable {
        /// What was sent.
        command: String,
        /// What came back.
        answer: String,
    },
}

/// The MPS control program of one host.
#[derive(Debug, Clone)]
pub struct MpsControl {
    /// Path of `nvidia-cuda-mps-control`.
    pub binary: PathBuf,
    /// `CUDA_MPS_PIPE_DIRECTORY`, if not the default.
    pub pipe_dir: Option<PathBuf>,
    /// Longest a command may take.
    pub timeout: Duration,
}

impl MpsControl {
    /// The control program at `binary`, talking to the daemon behind `pipe_dir`.
    pub fn new(binary: impl Into<PathBuf>, pipe_dir: Option<PathBuf>) -> Self {
        Self {
            binary: binary.into(),
            pipe_dir,
            timeout: Duration::from_secs(5),
        }
    }

    /// Sends one command; returns what the daemon printed. Its output is read while it runs
    /// (an answer larger than a pipe's buffer cannot block it), and it is killed after
    /// [`Self::timeout`].
    pub fn run(&self, command: &str) -> Result<String, MpsError> {
        let mut cmd = Command::new(&self.binary);
        if let Some(dir) = &self.pipe_dir {
            cmd.env("CUDA_MPS_PIPE_DIRECTORY", dir);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| MpsError::Spawn {
                binary: self.binary.display().to_string(),
                source: e,
            })?;
        let stdout = child.stdout.take().map(drain);
        let stderr = child.stderr.take().map(drain);
        if let Some(mut stdin) = child.stdin.take() {
            // A closed pipe shows up as the program's own answer below.
            let _ = writeln!(stdin, "{command}");
        }
        let started = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if started.elapsed() < self.timeout => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(MpsError::Timeout {
                        command: command.into(),
                        timeout_ms: self.timeout.as_millis(),
                    });
                }
            }
        };
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut answer = answer_of(stdout, deadline);
        let err = answer_of(stderr, deadline);
        if !err.is_empty() {
            if !answer.is_empty() {
                answer.push('\n');
            }
            answer.push_str(&err);
        }
        if !status.success() {
            return Err(MpsError::Refused {
                command: command.into(),
                answer,
            });
        }
        Ok(answer)
    }

    fn pids(&self, command: &str) -> Result<Vec<u32>, MpsError> {
        let answer = self.run(command)?;
        answer
            .split_whitespace()
            .map(|t| t.parse::<u32>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| MpsError::Unparsable {
                command: command.into(),
                answer,
            })
    }

    fn set(&self, command: &str) -> Result<(), MpsError> {
        let answer = self.run(command)?;
        if answer.is_empty() {
            Ok(())
        } else {
            Err(MpsError::Refused {
                command: command.into(),
                answer,
            })
        }
    }

    /// PIDs of the running MPS servers.
    pub fn server_list(&self) -> Result<Vec<u32>, MpsError> {
        self.pids("get_server_list")
    }

    /// PIDs of the clients of one server.
    pub fn client_list(&self, server: u32) -> Result<Vec<u32>, MpsError> {
        self.pids(&format!("get_client_list {server}"))
    }

    /// The default active-thread percentage for new servers.
    pub fn default_active_thread_percentage(&self) -> Result<f64, MpsError> {
        let command = "get_default_active_thread_percentage";
        let answer = self.run(command)?;
        answer.trim().parse().map_err(|_| MpsError::Unparsable {
            command: command.into(),
            answer,
        })
    }

    /// Sets the default active-thread percentage for servers started from now on.
    pub fn set_default_active_thread_percentage(&self, pct: u8) -> Result<(), MpsError> {
        self.set(&format!("set_default_active_thread_percentage {pct}"))
    }

    /// Sets the active-thread percentage of one server (for clients it starts from now on).
    pub fn set_active_thread_percentage(&self, server: u32, pct: u8) -> Result<(), MpsError> {
        self.set(&format!("set_active_thread_percentage {server} {pct}"))
    }

    /// Sets the default pinned-memory limit of a device for new servers (e.g. `"8G"`).
    pub fn set_default_device_pinned_mem_limit(
        &self,
        device: u32,
        limit: &str,
    ) -> Result<(), MpsError> {
        if limit.is_empty() || !limit.chars().all(|c| c.is_ascii_alphanumeric() || c == '.') {
            return Err(MpsError::Refused {
                command: format!("set_default_device_pinned_mem_limit {device} {limit}"),
                answer: "cohabit refuses to send a limit that is not like 8G or 512M".into(),
            });
        }
        self.set(&format!(
            "set_default_device_pinned_mem_limit {device} {limit}"
        ))
    }

    /// The server whose clients include one of `pids`, if any.
    pub fn server_of(&self, pids: &[u32]) -> Result<Option<(u32, Vec<u32>)>, MpsError> {
        for server in self.server_list()? {
            let clients = self.client_list(server)?;
            if clients.iter().any(|c| pids.contains(c)) {
                return Ok(Some((server, clients)));
            }
        }
        Ok(None)
    }
}
