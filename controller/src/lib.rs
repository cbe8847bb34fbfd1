//! cohabit on a real host and the `cohabit` command line.
//!
//! - [`daemon`]: `cohabit run` on a real host, and `cohabit probe`.
//! - [`cli`]: the `cohabit` command: parses arguments and dispatches to the daemon or to
//!   the lab (`cohabit-lab`).

pub mod cli;
pub mod daemon;
