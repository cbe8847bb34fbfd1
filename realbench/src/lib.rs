//! cohabit on real services: a co-location benchmark judged by an independent client.
//!
//! It starts memcached and nginx (and redis on request) from Debian packages on loopback,
//! drives them at fixed request rates with its own open-loop client ([`client`]), runs a
//! stress-ng batch job that presses on one resource ([`antagonists`]), and does so under
//! each policy ([`policies`]): no control, a cap set by hand, the kernel's idle class set
//! by hand, and cohabit's `static`, `parties` and `ml` run by the real `cohabit run`
//! daemon, whose latency source is its own probe; with `ml-host`, an explore phase (`cohabit run --explore`) first collects
//! decision logs that train a host model ([`host_model`]) run beside the simulator-trained
//! one. The client's latencies, never cohabit's, decide: per one-second window,
//! whether the p99 met the target ([`report`]). The batch job's throughput is compared
//! with the same job alone.
//!
//! Every process starts in its own process group inside the benchmark's cgroups
//! ([`cgroups`], [`procs`]); an error, a panic, `SIGINT` or `SIGTERM` ([`interrupt`])
//! stops all of them and removes every cgroup. `cohabit-realbench cleanup` removes what a
//! `SIGKILL`ed run left.

pub mod antagonists;
pub mod bench;
pub mod cgroups;
pub mod client;
pub mod host_model;
pub mod interrupt;
pub mod policies;
pub mod procs;
pub mod report;
pub mod services;
pub mod sys;
pub mod tools;

use std::path::PathBuf;

/// Why the benchmark could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Programs are missing.
    #[error("missing programs: {list}; install them with `{install}`")]
    MissingTools {
        /// What is missing, with packages.
        list: String,
        /// The command that installs them.
        install: String,
    },
    /// The host lacks something the benchmark needs.
    #[error("this benchmark needs {0}")]
    Host(String),
    /// A file or cgroup operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On what.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A service, the client or a batch job did not start.
    #[error("starting {what}: {detail}")]
    Start {
        /// What.
        what: String,
        /// Why, with the end of its log.
        detail: String,
    },
    /// The cohabit daemon failed.
    #[error("cohabit with policy {policy}: {detail}")]
    Cohabit {
        /// The policy.
        policy: String,
        /// What happened, with the end of its output.
        detail: String,
    },
    /// `SIGINT` or `SIGTERM`.
    #[error(
        "interrupted; every process the benchmark started was stopped and its cgroups removed"
    )]
    Interrupted,
}

/// Maps an I/O error to [`Error::Io`] with what was being done and on which path.
pub(crate) fn io_err<'a>(
    what: &'static str,
    path: &'a std::path::Path,
) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Rounds a non-negative finite number to a whole `u64` (negative and NaN give 0).
pub fn whole(x: f64) -> u64 {
    if x.is_finite() && x > 0.0 {
        // Values here are far below 2^53; the cast is exact after rounding.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let v = x.round() as u64;
        v
    } else {
        0
    }
}
