//! The host-trained model: the explore runs' decision logs turned into a model by
//! `cohabit-train` (`logs`, then `fit --init` from the built-in model), for the `ml-host`
//! column. `cohabit-train` links libtorch, so it runs as a program of its own; its output
//! is kept beside the model.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::Error;

/// What the training made, or why it made nothing.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HostModel {
    /// The model's metadata file (`qos-host.json`), when training succeeded.
    pub model: Option<PathBuf>,
    /// The decision logs it learned from.
    pub logs: Vec<PathBuf>,
    /// Training rows.
    pub rows: usize,
    /// What `cohabit-train logs` said per host and file.
    pub logs_report: String,
    /// Seconds `logs` and `fit` took together.
    pub train_s: f64,
    /// Why there is no model.
    pub error: Option<String>,
}

/// How the model is fitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct FitSettings {
    /// Ensemble members.
    pub members: usize,
    /// Most epochs per member.
    pub epochs: usize,
}

/// Trains the host model into `dir` from `logs`, warm-started from `init`. A failure is
/// kept in the result (the `ml-host` runs are then skipped), not returned: the other
/// columns still run.
pub fn train(
    cohabit_train: &Path,
    logs: &[PathBuf],
    init: &Path,
    dir: &Path,
    fit: FitSettings,
) -> Result<HostModel, Error> {
    std::fs::create_dir_all(dir).map_err(crate::io_err("creating", dir))?;
    let started = Instant::now();
    let mut out = HostModel {
        model: None,
        logs: logs.to_vec(),
        rows: 0,
        logs_report: String::new(),
        train_s: 0.0,
        error: None,
    };
    let rows = dir.join("rows.jsonl");
    let mut cmd = Command::new(cohabit_train);
    cmd.arg("logs").args(logs).arg("--out").arg(&rows);
    match run(cmd, &dir.join("logs.txt"))? {
        Ok(said) => out.logs_report = said,
        Err(e) => {
            out.error = Some(format!("cohabit-train logs: {e}"));
            out.train_s = started.elapsed().as_secs_f64();
            return Ok(out);
        }
    }
    out.rows = std::fs::read_to_string(&rows)
        .map(|t| t.lines().filter(|l| !l.trim().is_empty()).count())
        .unwrap_or(0);
    let mut cmd = Command::new(cohabit_train);
    cmd.args(["fit", "--data"])
        .arg(&rows)
        .arg("--init")
        .arg(init)
        .arg("--out")
        .arg(dir)
        .args(["--name", "qos-host", "--no-held-out", "--members"])
        .arg(fit.members.to_string())
        .arg("--epochs")
        .arg(fit.epochs.to_string());
    let fitted = run(cmd, &dir.join("fit.txt"))?;
    out.train_s = started.elapsed().as_secs_f64();
    match fitted {
        Ok(_) => out.model = Some(dir.join("qos-host.json")),
        Err(e) => out.error = Some(format!("cohabit-train fit: {e}")),
    }
    Ok(out)
}

/// Runs `cmd`, keeping its output in `log`: its stdout when it succeeded, else the end of
/// what it said. The outer error is the benchmark's own (the output could not be kept, or
/// it was interrupted).
fn run(mut cmd: Command, log: &Path) -> Result<Result<String, String>, Error> {
    crate::interrupt::check()?;
    let output = match cmd.output() {
        Ok(o) => o,
        Err(e) => return Ok(Err(format!("cannot run it: {e}"))),
    };
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    std::fs::write(log, format!("{stdout}{stderr}")).map_err(crate::io_err("writing", log))?;
    crate::interrupt::check()?;
    if output.status.success() {
        return Ok(Ok(stdout));
    }
    let tail: Vec<&str> = stderr.lines().chain(stdout.lines()).collect();
    let tail = tail[tail.len().saturating_sub(8)..].join("\n");
    Ok(Err(format!(
        "{} ({}): {tail}",
        output.status,
        log.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trainer_that_fails_is_reported_with_what_it_said() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("cohabit-train");
        std::fs::write(
            &fake,
            "#!/bin/sh\necho \"no training rows in 1 file(s)\" >&2\nexit 1\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let m = train(
            &fake,
            &[dir.path().join("x/decisions.jsonl")],
            Path::new("/nonexistent/qos.json"),
            &dir.path().join("model"),
            FitSettings {
                members: 1,
                epochs: 1,
            },
        )
        .unwrap();
        assert_eq!(m.model, None);
        let e = m.error.unwrap();
        assert!(
            e.starts_with("cohabit-train logs:") && e.contains("no training rows"),
            "{e}"
        );
        assert!(std::fs::read_to_string(dir.path().join("model/logs.txt"))
            .unwrap()
            .contains("no training rows"));
    }
}
