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

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

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

    /// Sends one command; returns what the daemon printed.
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
        if let Some(mut stdin) = child.stdin.take() {
            // A closed pipe shows up as the program's own answer below.
            let _ = writeln!(stdin, "{command}");
        }
        let started = Instant::now();
        loop {
            match child.try_wait() {
                Ok(Some(_)) => break,
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
        }
        let out = child.wait_with_output().map_err(|e| MpsError::Spawn {
            binary: self.binary.display().to_string(),
            source: e,
        })?;
        let mut answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if !err.is_empty() {
            if !answer.is_empty() {
                answer.push('\n');
            }
            answer.push_str(&err);
        }
        if !out.status.success() {
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
