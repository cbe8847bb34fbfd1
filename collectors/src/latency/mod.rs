//! Per-service tail latency: scraped from a Prometheus histogram, or pushed by the service.
//!
//! - [`PromHistogram`]: parses the text exposition format, keeps the cumulative buckets of
//!   one histogram as read, and computes the p99 of the requests *between two scrapes* from
//!   the bucket differences (linear interpolation inside the bucket, as Prometheus'
//!   `histogram_quantile` does). A counter reset (any bucket going down) makes the current
//!   buckets the difference; buckets present in only one scrape are ignored.
//! - [`PushListener`]: a loopback UDP or Unix datagram socket on which a service sends
//!   latencies, one per line, in microseconds. A thread records them in an HDR histogram;
//!   each tick takes the p99, the count and the histogram, and starts afresh.
//!
//! Both hand out each interval's requests as a histogram too ([`PromInterval`],
//! [`PushWindow::hist`]), which a [`crate::window::MergedWindow`] merges over several
//! intervals.
//!
//! What a scrape or a sender can do to the daemon is bounded:
//!
//! - **Scrapes.** One line is read in O(1) apart from a map of at most [`MAX_BOUNDS`]
//!   bounds; two scrapes are compared by one merge over their sorted bounds. A line that
//!   cannot be read is skipped and counted; a value that can be read but cannot be a count
//!   or a bound (NaN, infinite, negative) fails the histogram, as does a p99 ≤ 0. Redirects
//!   are not followed, and each scrape ends by a deadline the caller gives (the tick's
//!   collection budget; the daemon scrapes every endpoint at once, each with that whole
//!   budget, so one that hangs costs no other its scrape). [`PromHistogram`] is `Sync`:
//!   [`PromHistogram::fetch`] may run on another thread than the ingestion.
//! - **Unix push sockets** are authenticated: the kernel attaches the sender's pid, uid and
//!   gid to each datagram (`SO_PASSCRED`, `SCM_CREDENTIALS`), and a datagram is accepted
//!   only from one of the service's processes (the set the daemon passes each tick,
//!   [`PushListener::set_pids`]) or from a configured uid or gid ([`UnixAccess`]). The
//!   socket file gets its owner, group and mode ([`DEFAULT_MODE`]) right after bind, in a
//!   directory no other user can write, so nobody can swap it in between. A path that
//!   already exists is removed only when it is a stale socket (one that refuses a
//!   connection); a live socket or any other file is an error. On drop the file is removed
//!   only if it is still the socket this listener bound, and the socket is shut down first,
//!   which wakes the thread at once: dropping a listener (as the daemon does inside its
//!   tick when a pod's source changes) does not wait for the thread's read time-out.
//! - **UDP** cannot tell senders apart: any local user (or container sharing the host's
//!   network) can send. The configuration must say `unauthenticated = true` to use it.
//! - **Floods.** A datagram cut by the kernel (`MSG_TRUNC`) is dropped whole, not read as a
//!   shorter number. A window keeps at most [`MAX_SAMPLES_PER_WINDOW`] samples, and the
//!   thread reads at most [`MAX_DATAGRAMS_PER_S`] datagrams a second (more wait in the
//!   socket buffer, which the kernel bounds). Every refusal is counted by reason
//!   ([`PushRejections`]).

use std::io;

pub use crate::histogram::{interval_between, quantile_between, Buckets};
pub use prometheus::{
    parse_buckets, HistogramError, Parsed, PromHistogram, PromInterval, MAX_BOUNDS,
};
pub use push::{
    PushAddr, PushListener, PushRejections, PushWindow, UnixAccess, DEFAULT_MODE,
    MAX_DATAGRAMS_PER_S, MAX_SAMPLES_PER_WINDOW,
};

mod prometheus;
mod push;

/// Why a latency source could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LatencyError {
    /// The endpoint did not answer, or answered with an error.
    #[error("scraping {url}: {detail}")]
    Scrape {
        /// Where.
        url: String,
        /// What happened.
        detail: String,
    },
    /// The exposition text did not hold the histogram.
    #[error("histogram {metric} not found in the scrape of {url}")]
    Missing {
        /// Metric name.
        metric: String,
        /// Where.
        url: String,
    },
    /// The histogram was there but cannot be a latency distribution.
    #[error("histogram {metric} in the scrape of {url}: {detail}")]
    Invalid {
        /// Metric name.
        metric: String,
        /// Where.
        url: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The socket could not be bound.
    #[error("binding latency socket {addr}: {source}")]
    Bind {
        /// Address or path.
        addr: String,
        /// OS error.
        source: io::Error,
    },
}
