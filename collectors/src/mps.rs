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
//! Under the legacy (v2) interface a running client's share cannot be changed: a new share
//! applies to clients started afterwards. Publishing shares and restarting clients is the
//! daemon's job; see `cohabit_host::gpu`.
//!
//! What the host offers is found by [`MpsControl::probe`] ([`MpsCapabilities`]). The syntax
//! used, and where it comes from (NVIDIA's "Multi-Process Service" documentation, releases
//! 615/620, read through excerpts; the parts it did not spell out are marked *assumed*):
//! - `-v` prints the control program's version (documented).
//! - v3 is selected by the daemon (`-p 3` or `CUDA_MPS_PROTOCOL_VERSION=3`), and "any new
//!   `nvidia-cuda-mps-control` invocation automatically follows that daemon's protocol
//!   version"; v3 commands are arguments in a `module verb --option` form, e.g.
//!   `server list`, `client list --all`, `server create --uid=N` (documented). cohabit sends
//!   `server list` as arguments: a v3 daemon answers with servers, a v2 one refuses it
//!   (*assumed*: how v2 refuses arguments it does not know).
//! - v3 dynamic resource adjustment of a named server's running clients:
//!   `server update --name=<server> --active-thread-percentage=<pct>` (*assumed*: the
//!   documentation names the feature and the `--option=value` form, not this verb), silent
//!   on success like the v2 `set_*` commands (*assumed*). Namespaces: `namespace list`
//!   (*assumed*, same form).
//! - Static SM partitioning (daemon started with `-S`/`--static-partitioning`, documented):
//!   `lspart` lists partitions, `sm_partition add <GPU-UUID> <chunks>` answers
//!   `Partition <id> created`, `sm_partition rm <id>`; a client selects one with
//!   `CUDA_MPS_SM_PARTITION=<id>` at start (the command names and answer come from public
//!   scripts that drive the real program, not from NVIDIA's pages: *assumed*).
//!   A client's partition is fixed at its start, like a v2 percentage.
//! - `set_default_device_pinned_mem_limit <device> <limit>` and
//!   `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (documented in v2).

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

/// The control interface of a host's MPS daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// Legacy v2: one command per line on standard input.
    V2,
    /// v3: `module verb --option` arguments, named servers, namespaces, dynamic adjustment.
    V3,
}

/// What a host's MPS offers: the mechanisms a GPU share can be applied by.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MpsCapabilities {
    /// What `-v` printed, verbatim (absent when it printed nothing or failed).
    pub version: Option<String>,
    /// Whether a control daemon answered.
    pub daemon_running: bool,
    /// The interface the running daemon speaks (v2 when none runs).
    pub protocol: Protocol,
    /// v2 active-thread percentages (`set_active_thread_percentage`,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`): every MPS daemon since Volta.
    pub thread_percentage: bool,
    /// v3 named servers and namespaces.
    pub namespaces: bool,
    /// v3 dynamic resource adjustment: shares of running clients change without restart.
    pub dynamic_adjustment: bool,
    /// Static SM partitions (daemon started with `-S`): `lspart` answered.
    pub static_partitions: bool,
    /// The control program's words for each mechanism it refused while probing.
    pub refusals: Vec<String>,
}

/// Whether an answer to a query is a refusal in the control program's words: a v2 daemon
/// prints its refusals on standard output and exits 0 (documented for `set_*`; *assumed*
/// for queries), so a query's answer is taken as a refusal when it reads like one.
fn reads_as_refusal(answer: &str) -> bool {
    let a = answer.to_ascii_lowercase();
    [
        "unrecognized",
        "unknown",
        "invalid",
        "not enabled",
        "not supported",
        "usage",
    ]
    .iter()
    .any(|w| a.contains(w))
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
        self.exec(&[], Some(command), command)
    }

    /// Runs the program with `args` and no command on its standard input (MPS v3's
    /// `module verb --option=value` form, and `-v`).
    pub fn run_args(&self, args: &[&str]) -> Result<String, MpsError> {
        self.exec(args, None, &args.join(" "))
    }

    fn exec(&self, args: &[&str], input: Option<&str>, command: &str) -> Result<String, MpsError> {
        let mut cmd = Command::new(&self.binary);
        cmd.args(args);
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
            // A closed pipe shows up as the program's own answer below. Without input the
            // pipe is closed at once (the program must not wait for a command).
            if let Some(line) = input {
                let _ = writeln!(stdin, "{line}");
            }
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

    /// Probes what the host's MPS offers (for `cohabit probe` and for choosing how GPU
    /// shares are applied). Never fails: what did not answer is reported absent, with the
    /// program's words in [`MpsCapabilities::refusals`].
    pub fn probe(&self) -> MpsCapabilities {
        let mut refusals = Vec::new();
        let mut note = |what: &str, e: &MpsError| refusals.push(format!("{what}: {e}"));
        let version = match self.run_args(&["-v"]) {
            Ok(v) if !v.is_empty() => Some(v),
            Ok(_) => None,
            Err(e) => {
                note("version", &e);
                None
            }
        };
        let v3 = match self.run_args(&["server", "list"]) {
            Ok(a) if !reads_as_refusal(&a) => true,
            Ok(a) => {
                note(
                    "v3 interface",
                    &MpsError::Refused {
                        command: "server list".into(),
                        answer: a,
                    },
                );
                false
            }
            Err(e) => {
                note("v3 interface", &e);
                false
            }
        };
        let daemon_running = v3
            || match self.server_list() {
                Ok(_) => true,
                Err(e) => {
                    note("daemon", &e);
                    false
                }
            };
        let static_partitions = daemon_running
            && match self.list_partitions() {
                Ok(_) => true,
                Err(e) => {
                    note("static SM partitions", &e);
                    false
                }
            };
        let namespaces = v3
            && match self.run_args(&["namespace", "list"]) {
                Ok(a) if !reads_as_refusal(&a) => true,
                Ok(a) => {
                    note(
                        "v3 namespaces",
                        &MpsError::Refused {
                            command: "namespace list".into(),
                            answer: a,
                        },
                    );
                    false
                }
                Err(e) => {
                    note("v3 namespaces", &e);
                    false
                }
            };
        MpsCapabilities {
            version,
            daemon_running,
            protocol: if v3 { Protocol::V3 } else { Protocol::V2 },
            thread_percentage: daemon_running,
            namespaces,
            dynamic_adjustment: v3,
            static_partitions,
            refusals,
        }
    }

    /// v3 dynamic resource adjustment: sets the active-thread percentage of the named
    /// server's running clients (syntax *assumed*, see the module docs). A refusal carries
    /// the program's words.
    pub fn update_server_share(&self, server: &str, pct: u8) -> Result<(), MpsError> {
        let bad = server.is_empty()
            || !server
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        let name = format!("--name={server}");
        let share = format!("--active-thread-percentage={pct}");
        let args = ["server", "update", name.as_str(), share.as_str()];
        if bad || !(1..=100).contains(&pct) {
            return Err(MpsError::Refused {
                command: args.join(" "),
                answer: "cohabit refuses a server name other than letters, digits, - _ . or a share outside 1..=100".into(),
            });
        }
        let answer = self.run_args(&args)?;
        if answer.is_empty() {
            Ok(())
        } else {
            Err(MpsError::Refused {
                command: args.join(" "),
                answer,
            })
        }
    }

    /// Static SM partitions (`lspart`), one per line as the program prints them.
    pub fn list_partitions(&self) -> Result<Vec<String>, MpsError> {
        let answer = self.run("lspart")?;
        if reads_as_refusal(&answer) {
            return Err(MpsError::Refused {
                command: "lspart".into(),
                answer,
            });
        }
        Ok(answer.lines().map(str::to_string).collect())
    }

    /// Creates a static SM partition of `chunks` chunks on the GPU `uuid`; returns its id
    /// (the `<id>` of `Partition <id> created`), for a client's `CUDA_MPS_SM_PARTITION`.
    pub fn add_partition(&self, uuid: &str, chunks: u32) -> Result<String, MpsError> {
        let command = format!("sm_partition add {uuid} {chunks}");
        if uuid.is_empty() || !uuid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            return Err(MpsError::Refused {
                command,
                answer: "cohabit refuses a GPU UUID other than letters, digits and -".into(),
            });
        }
        let answer = self.run(&command)?;
        answer
            .lines()
            .find_map(|l| l.strip_prefix("Partition ")?.strip_suffix(" created"))
            .map(str::to_string)
            .ok_or(MpsError::Refused { command, answer })
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
