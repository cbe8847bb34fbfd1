//! The programs the benchmark runs, where they are, and which Debian package has each.

use std::path::{Path, PathBuf};

use crate::Error;

/// A program the benchmark needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tool {
    /// Executable name.
    pub binary: &'static str,
    /// The Debian package that installs it.
    pub package: &'static str,
}

/// memcached itself.
pub const MEMCACHED: Tool = Tool {
    binary: "memcached",
    package: "memcached",
};
/// nginx (the light flavour is enough: static files).
pub const NGINX: Tool = Tool {
    binary: "nginx",
    package: "nginx-light",
};
/// redis.
pub const REDIS: Tool = Tool {
    binary: "redis-server",
    package: "redis-server",
};
/// The antagonists.
pub const STRESS_NG: Tool = Tool {
    binary: "stress-ng",
    package: "stress-ng",
};
/// The shell that places each process in its cgroup before `exec`.
pub const SH: Tool = Tool {
    binary: "sh",
    package: "dash",
};

/// Finds `binary` in `PATH`, then in the usual system directories (`/usr/sbin` is not in
/// every user's `PATH`, and nginx lives there).
pub fn find(binary: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(binary))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Finds every tool or says which are missing and how to install them, all at once.
pub fn require(tools: &[Tool]) -> Result<Vec<PathBuf>, Error> {
    let mut found = Vec::new();
    let mut missing = Vec::new();
    for t in tools {
        match find(t.binary) {
            Some(p) => found.push(p),
            None => missing.push(*t),
        }
    }
    if missing.is_empty() {
        return Ok(found);
    }
    let names: Vec<String> = missing
        .iter()
        .map(|t| format!("{} (Debian package {})", t.binary, t.package))
        .collect();
    let mut packages: Vec<&str> = missing.iter().map(|t| t.package).collect();
    packages.dedup();
    Err(Error::MissingTools {
        list: names.join(", "),
        install: format!("apt-get install {}", packages.join(" ")),
    })
}

/// The cohabit daemon binary: the one given, else `cohabit` next to this executable (cargo
/// puts both in the same `target/<profile>`), else in `PATH`.
pub fn cohabit(given: Option<&Path>) -> Result<PathBuf, Error> {
    workspace_binary(
        given,
        "cohabit",
        "cargo build --release -p cohabit-controller",
        "--cohabit",
    )
}

/// `cohabit-train` (it trains the host model; it links libtorch, so it is a program of its
/// own): the one given, else next to this executable, else in `PATH`.
pub fn cohabit_train(given: Option<&Path>) -> Result<PathBuf, Error> {
    workspace_binary(
        given,
        "cohabit-train",
        "cargo build --release -p cohabit-training --bin cohabit-train",
        "--cohabit-train",
    )
}

/// A program of this workspace: `given`, else `name` beside this executable, else in `PATH`.
fn workspace_binary(
    given: Option<&Path>,
    name: &str,
    build: &str,
    flag: &str,
) -> Result<PathBuf, Error> {
    if let Some(p) = given {
        return if is_executable(p) {
            Ok(p.to_path_buf())
        } else {
            Err(Error::Host(format!(
                "the {name} binary at {} (it is not there or not executable)",
                p.display()
            )))
        };
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join(name)))
        .filter(|p| is_executable(p));
    beside.or_else(|| find(name)).ok_or_else(|| {
        Error::Host(format!(
            "the {name} binary: build it ({build}) or pass {flag} PATH"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tool_names_its_package_and_the_install_command() {
        let ghost = Tool {
            binary: "no-such-program-realbench",
            package: "ghost-pkg",
        };
        let e = require(&[SH, ghost]).unwrap_err().to_string();
        assert!(e.contains("no-such-program-realbench"), "{e}");
        assert!(e.contains("apt-get install ghost-pkg"), "{e}");
        assert_eq!(require(&[SH]).unwrap().len(), 1);
        assert!(cohabit(Some(Path::new("/nonexistent/cohabit")))
            .unwrap_err()
            .to_string()
            .contains("/nonexistent/cohabit"));
        let e = cohabit_train(Some(Path::new("/nonexistent/cohabit-train")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cohabit-train binary at /nonexistent"), "{e}");
    }
}
