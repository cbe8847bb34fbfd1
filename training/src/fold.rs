//! `cohabit-train fold`: a fleet's per-host posteriors written back into the shared model's
//! output layer ([`cohabit_models::posterior::fold`]).
//!
//! Each host's daemon keeps `state_dir/posterior.json` (`controller::daemon::posterior`):
//! per latency-critical service, a posterior on the correction of the model's output layer
//! learnt from that host's readings, naming the model it corrects. This reads any number of
//! those files, folds every posterior of the given model (the precision-weighted average of
//! their mean corrections, so a host with little evidence moves the layer little) and
//! writes the corrected model as a new artifact. Hosts then start their posteriors afresh
//! on it (a posterior names the model it corrects, and the new model is another).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use cohabit_models::posterior::{fold, FoldReport, PosteriorSnapshot};
use cohabit_models::Model;
use serde::Deserialize;

/// Largest posterior file read.
const MAX_FILE_BYTES: u64 = 8 << 20;

/// Why a fold could not be done.
#[derive(Debug, thiserror::Error)]
pub enum FoldError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A file is not a posterior file.
    #[error("posterior file {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The model could not be read or written.
    #[error(transparent)]
    Model(#[from] cohabit_models::ModelError),
    /// The posteriors do not fold (a snapshot that is not positive definite).
    #[error("folding: {0}")]
    Posterior(#[from] cohabit_models::posterior::PosteriorError),
}

/// What of a daemon's posterior file a fold reads: each service's posterior (the host and
/// match keys are the daemon's business).
#[derive(Debug, Deserialize)]
struct FileView {
    services: BTreeMap<String, ServiceView>,
}

#[derive(Debug, Deserialize)]
struct ServiceView {
    posterior: PosteriorSnapshot,
}

/// Every service's posterior in the daemon posterior files `paths`.
pub fn read_posteriors(paths: &[PathBuf]) -> Result<Vec<PosteriorSnapshot>, FoldError> {
    let mut out = Vec::new();
    for path in paths {
        let io = |source| FoldError::Io {
            path: path.clone(),
            source,
        };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_FILE_BYTES {
            return Err(FoldError::Invalid {
                path: path.clone(),
                message: format!("larger than {MAX_FILE_BYTES} bytes"),
            });
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        let view: FileView = serde_json::from_str(&text).map_err(|e| FoldError::Invalid {
            path: path.clone(),
            message: e.to_string(),
        })?;
        out.extend(view.services.into_values().map(|s| s.posterior));
    }
    Ok(out)
}

/// Folds the posteriors in `files` into the model `model_json` and writes the result into
/// `out_dir` as `name`: the report and the new artifact's metadata path.
pub fn fold_files(
    model_json: &Path,
    files: &[PathBuf],
    out_dir: &Path,
    name: &str,
) -> Result<(FoldReport, PathBuf), FoldError> {
    let model = Model::load(model_json)?;
    let posteriors = read_posteriors(files)?;
    let (folded, report) = fold(&model, &posteriors)?;
    let path = folded.save(out_dir, name)?;
    Ok((report, path))
}

#[cfg(test)]
mod tests {
    use cohabit_models::posterior::{model_digest, Blr};

    use super::*;

    #[test]
    fn a_fleets_posterior_files_fold_into_a_new_artifact() {
        let dir = tempfile::tempdir().unwrap();
        let model = Model::synthetic(2, &[3], 9);
        let model_json = model.save(dir.path(), "shared").unwrap();
        // Two hosts, one service each, that both learnt the same correction.
        let truth = [0.3, -0.2, 0.1];
        let mut files = Vec::new();
        for host in 0..2u32 {
            let mut blr = Blr::new(&[1.0, 1.0, 1.0, 0.01]).unwrap();
            for i in 0..50u32 {
                let x = f64::from(i * 7 + host) / 50.0;
                let z = [x.sin(), x.cos(), (2.0 * x).sin(), 1.0];
                let y: f64 = z.iter().zip(&truth).map(|(a, b)| a * b).sum();
                blr.observe(&z, y, 1e-4, 1.0).unwrap();
            }
            let file = serde_json::json!({
                "schema_version": 1,
                "host": {"name": format!("h{host}"), "cores": 8, "llc_ways": 4, "llc_way_bytes": 1},
                "services": {"kv": {"match": "ProcessName(\"kv\")", "posterior": PosteriorSnapshot {
                    model: model_digest(&model),
                    blr: blr.snapshot(),
                }}}
            });
            let path = dir.path().join(format!("posterior-{host}.json"));
            std::fs::write(&path, file.to_string()).unwrap();
            files.push(path);
        }
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        let (report, path) = fold_files(&model_json, &files, &out, "folded").unwrap();
        assert_eq!(report.folded, 2);
        for (c, t) in report.correction.iter().zip(&truth) {
            assert!((c - t).abs() < 0.01, "{:?}", report.correction);
        }
        let folded = Model::load(&path).unwrap();
        let before = model.ensemble.members[0].layers[1].weight.clone();
        let after = &folded.ensemble.members[0].layers[1].weight;
        for j in 0..3 {
            let moved = f64::from(after[[0, j]] - before[[0, j]]);
            assert!((moved - report.correction[j]).abs() < 1e-5);
        }
        // Not a posterior file: named.
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "[]").unwrap();
        let err = read_posteriors(&[bad]).unwrap_err().to_string();
        assert!(err.contains("bad.json"), "{err}");
    }
}
