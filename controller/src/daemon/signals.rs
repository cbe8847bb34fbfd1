//! The signals that stop the daemon: SIGTERM, SIGINT, SIGHUP and SIGQUIT each end the loop,
//! after which the host is restored and the daemon exits 0 (security review rows 13, 15).
//!
//! Every stream is created once, at start, before anything touches the host: tokio drops a
//! signal that has no listener, and the default action of these four (terminate, or dump
//! core) is replaced as soon as a stream exists, so a stream created anew in each `select!`
//! loses the signals that arrive while a tick runs. SIGHUP ends the daemon too: logrotate's
//! usual `postrotate kill -HUP` must not kill it without a restore, and the decision log is
//! rotated by size instead of by signal.

use tokio::signal::unix::{signal, Signal, SignalKind};

/// Which signal asked the daemon to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM (the service manager's stop).
    Term,
    /// SIGINT (Ctrl-C).
    Int,
    /// SIGHUP.
    Hup,
    /// SIGQUIT.
    Quit,
}

impl Stop {
    /// The signal's name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            Stop::Term => "SIGTERM",
            Stop::Int => "SIGINT",
            Stop::Hup => "SIGHUP",
            Stop::Quit => "SIGQUIT",
        }
    }
}

/// The daemon's signal listeners, each registered once.
#[derive(Debug)]
pub struct Signals {
    term: Signal,
    int: Signal,
    hup: Signal,
    quit: Signal,
}

impl Signals {
    /// Registers the four listeners (inside a tokio runtime with I/O enabled).
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
            quit: signal(SignalKind::quit())?,
        })
    }

    /// The next stop signal (one that arrived since the last call, or the next to come).
    pub async fn recv(&mut self) -> Stop {
        tokio::select! {
            biased;
            Some(()) = self.term.recv() => Stop::Term,
            Some(()) = self.int.recv() => Stop::Int,
            Some(()) = self.hup.recv() => Stop::Hup,
            Some(()) = self.quit.recv() => Stop::Quit,
            else => std::future::pending().await,
        }
    }
}
