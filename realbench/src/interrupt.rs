//! `SIGINT` and `SIGTERM` end the benchmark cleanly: a thread waits for either and sets a
//! flag; every wait of the benchmark looks at the flag and returns
//! [`Error::Interrupted`], and unwinding to the top drops the [`crate::procs::Lab`], which
//! stops every process and removes every cgroup.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::Error;

static STOP: AtomicBool = AtomicBool::new(false);
static INSTALLED: OnceLock<()> = OnceLock::new();

/// Starts listening for `SIGINT` and `SIGTERM` (once per process).
pub fn install() -> Result<(), Error> {
    let mut failed = None;
    INSTALLED.get_or_init(|| {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                failed = Some(e.to_string());
                return;
            }
        };
        // Register the handlers now, so a signal that arrives before the thread runs is
        // not missed.
        let term = rt.block_on(async {
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        });
        let mut term = match term {
            Ok(t) => t,
            Err(e) => {
                failed = Some(e.to_string());
                return;
            }
        };
        let spawned = std::thread::Builder::new()
            .name("realbench-signals".into())
            .spawn(move || {
                rt.block_on(async {
                    loop {
                        tokio::select! {
                            _ = term.recv() => {}
                            _ = tokio::signal::ctrl_c() => {}
                        }
                        if STOP.swap(true, Ordering::SeqCst) {
                            eprintln!("cohabit-realbench: still cleaning up; please wait");
                        } else {
                            eprintln!(
                                "cohabit-realbench: interrupted; stopping everything it started"
                            );
                        }
                    }
                });
            });
        if let Err(e) = spawned {
            failed = Some(e.to_string());
        }
    });
    match failed {
        Some(e) => Err(Error::Host(format!("signal handling ({e})"))),
        None => Ok(()),
    }
}

/// Whether the benchmark was asked to stop.
pub fn requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// `Err(Interrupted)` once a stop was requested.
pub fn check() -> Result<(), Error> {
    if requested() {
        Err(Error::Interrupted)
    } else {
        Ok(())
    }
}

/// Sleeps `d`, waking early with `Err(Interrupted)` when a stop is requested.
pub fn sleep(d: Duration) -> Result<(), Error> {
    let end = Instant::now() + d;
    loop {
        check()?;
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        std::thread::sleep((end - now).min(Duration::from_millis(50)));
    }
}
