//! `state_dir/posterior.json`: what `ml` learnt of this host, kept across restarts (issue
//! 45, [`cohabit_models::posterior`]).
//!
//! Each latency-critical service's posterior on the model's output layer is written, keyed
//! by the host (its platform name, cores, ways and way size: what the model's features are
//! fractions of) and by the service (its name and its `match` as configured), with the
//! layout's [`POSTERIOR_SCHEMA_VERSION`]; each posterior also names the model it corrects.
//! The file is written every [`SAVE_EVERY_TICKS`] ticks and at exit, replaced atomically
//! (a temporary file in the state directory, fsync, rename), and read at start: a file of
//! another schema or host is ignored whole, a service whose name or match is no longer
//! configured (or whose model changed) starts from its prior, and an unreadable file is
//! logged and ignored — the posterior is an optimisation, never a reason not to start.
//!
//! Size: at most [`cohabit_models::posterior::MAX_DIM`]² + 2·`MAX_DIM` numbers per service
//! (about 90 KB of JSON at 65; 23 KB at the shipped models' 33), so a host of 8 services
//! writes under 1 MB; a file over [`MAX_POSTERIOR_BYTES`] is not read.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use cohabit_core::HostCapacity;
use cohabit_models::posterior::{PosteriorSet, PosteriorSnapshot, POSTERIOR_SCHEMA_VERSION};
use cohabit_policy::Policy;
use serde::{Deserialize, Serialize};

use super::config::ManagedService;

/// The file's name in the state directory.
pub const POSTERIOR_FILE: &str = "posterior.json";

/// Ticks between two saves (a crash loses at most this many ticks of learning).
pub const SAVE_EVERY_TICKS: u64 = 60;

/// A posterior file larger than this is not one cohabit wrote.
pub const MAX_POSTERIOR_BYTES: u64 = 8 << 20;

/// Why the posterior file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum PosteriorFileError {
    /// Reading or writing failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The content is not a posterior file.
    #[error("posterior file {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// What the posteriors were learnt on: the host's shape as the model's features see it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostKey {
    /// The platform's name.
    pub name: String,
    /// Cores.
    pub cores: u32,
    /// LLC ways.
    pub llc_ways: u32,
    /// Bytes per way.
    pub llc_way_bytes: u64,
}

impl HostKey {
    /// The key of `host`.
    pub fn of(host: &HostCapacity) -> Self {
        Self {
            name: host.name.clone(),
            cores: host.cores,
            llc_ways: host.llc_ways,
            llc_way_bytes: host.llc_way_bytes,
        }
    }
}

/// One service's posterior with the match it was learnt under.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedService {
    /// The service's `match` as configured ([`match_key`]).
    #[serde(rename = "match")]
    matcher: String,
    posterior: PosteriorSnapshot,
}

/// The file's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PosteriorFile {
    schema_version: u32,
    host: HostKey,
    services: BTreeMap<String, SavedService>,
}

/// What [`PosteriorStore::resume`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resumed {
    /// Services whose posterior the policy took back.
    pub services: Vec<String>,
    /// Why the file (or a service's part of it) was not used, in words for the log.
    pub dropped: Vec<String>,
}

/// The posterior file of one daemon: where it lives, what keys it, when it is saved.
#[derive(Debug, Clone)]
pub struct PosteriorStore {
    path: PathBuf,
    host: HostKey,
    /// Each configured service's [`match_key`], by name.
    matches: BTreeMap<String, String>,
    ticks: u64,
}

/// A service's match as the configuration states it (its kind and value): a changed match
/// may be another service under the same name.
pub fn match_key(s: &ManagedService) -> String {
    format!("{:?}", s.matcher)
}

impl PosteriorStore {
    /// The store in `state_dir` for `host` running `services`.
    pub fn new(state_dir: &Path, host: &HostCapacity, services: &[ManagedService]) -> Self {
        Self {
            path: state_dir.join(POSTERIOR_FILE),
            host: HostKey::of(host),
            matches: services
                .iter()
                .map(|s| (s.name.clone(), match_key(s)))
                .collect(),
            ticks: 0,
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the file (none yet: nothing to resume) and gives `policy` the posteriors of
    /// this host's services whose match is unchanged. A file that cannot be read is an
    /// error for the caller to log; the policy then starts from its priors.
    pub fn resume(&self, policy: &mut dyn Policy) -> Result<Resumed, PosteriorFileError> {
        let Some(file) = self.read()? else {
            return Ok(Resumed::default());
        };
        let (set, mut dropped) = self.usable(file);
        let services = policy.resume(&set);
        for name in set.services.keys().filter(|n| !services.contains(n)) {
            dropped.push(format!(
                "{name}: not the model in use, or not a CPU service"
            ));
        }
        Ok(Resumed { services, dropped })
    }

    /// The posteriors of `file` that this host and configuration may use, and why the
    /// others were dropped.
    fn usable(&self, file: PosteriorFile) -> (PosteriorSet, Vec<String>) {
        if file.schema_version != POSTERIOR_SCHEMA_VERSION {
            let why = format!(
                "schema version {} is not {POSTERIOR_SCHEMA_VERSION}",
                file.schema_version
            );
            return (PosteriorSet::default(), vec![why]);
        }
        if file.host != self.host {
            let why = format!("learnt on {:?}, this host is {:?}", file.host, self.host);
            return (PosteriorSet::default(), vec![why]);
        }
        let mut set = PosteriorSet::default();
        let mut dropped = Vec::new();
        for (name, saved) in file.services {
            match self.matches.get(&name) {
                Some(m) if *m == saved.matcher => {
                    set.services.insert(name, saved.posterior);
                }
                Some(_) => dropped.push(format!("{name}: its match changed")),
                None => dropped.push(format!("{name}: no longer configured")),
            }
        }
        (set, dropped)
    }

    /// Counts a tick and saves every [`SAVE_EVERY_TICKS`]: whether it saved.
    pub fn tick(&mut self, policy: &dyn Policy) -> Result<bool, PosteriorFileError> {
        self.ticks += 1;
        if !self.ticks.is_multiple_of(SAVE_EVERY_TICKS) {
            return Ok(false);
        }
        self.save(policy)
    }

    /// Writes what `policy` learnt of the configured services (nothing when it learns
    /// nothing): whether it wrote.
    pub fn save(&self, policy: &dyn Policy) -> Result<bool, PosteriorFileError> {
        let Some(set) = policy.learned() else {
            return Ok(false);
        };
        let services = set
            .services
            .into_iter()
            .filter_map(|(name, posterior)| {
                let matcher = self.matches.get(&name)?.clone();
                Some((name, SavedService { matcher, posterior }))
            })
            .collect();
        let file = PosteriorFile {
            schema_version: POSTERIOR_SCHEMA_VERSION,
            host: self.host.clone(),
            services,
        };
        let text = serde_json::to_vec(&file).map_err(|e| PosteriorFileError::Invalid {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        self.replace(&text)?;
        Ok(true)
    }

    /// The file's content, `None` when there is none.
    fn read(&self) -> Result<Option<PosteriorFile>, PosteriorFileError> {
        let io = |what, source| PosteriorFileError::Io {
            what,
            path: self.path.clone(),
            source,
        };
        let f = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&self.path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io("opening", e)),
        };
        let mut bytes = Vec::new();
        f.take(MAX_POSTERIOR_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| io("reading", e))?;
        if bytes.len() as u64 > MAX_POSTERIOR_BYTES {
            return Err(PosteriorFileError::Invalid {
                path: self.path.clone(),
                message: format!("larger than {MAX_POSTERIOR_BYTES} bytes"),
            });
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| PosteriorFileError::Invalid {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// Replaces the file with `bytes`: a temporary file beside it, fsync, rename.
    fn replace(&self, bytes: &[u8]) -> Result<(), PosteriorFileError> {
        let tmp = self
            .path
            .with_file_name(format!("{POSTERIOR_FILE}.{}.tmp", std::process::id()));
        let io = |what, path: &Path, source| PosteriorFileError::Io {
            what,
            path: path.to_path_buf(),
            source,
        };
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(|e| io("creating", &tmp, e))?;
        f.write_all(bytes)
            .and_then(|()| f.sync_all())
            .map_err(|e| io("writing", &tmp, e))?;
        drop(f);
        std::fs::rename(&tmp, &self.path).map_err(|e| io("replacing", &self.path, e))
    }
}

/// [`PosteriorStore::resume`] with its outcome logged (the daemon starts either way).
pub fn resume_logged(store: &PosteriorStore, policy: &mut dyn Policy) {
    match store.resume(policy) {
        Ok(r) => {
            if !r.services.is_empty() {
                tracing::info!(services = ?r.services, file = %store.path().display(), "resumed the posteriors learnt on this host");
            }
            for why in r.dropped {
                tracing::info!(file = %store.path().display(), "posterior not resumed: {why}");
            }
        }
        Err(e) => tracing::warn!(error = %e, "posteriors not resumed; starting from the model"),
    }
}

/// [`PosteriorStore::save`] with a failure logged (the next save tries again).
pub fn save_logged(store: &PosteriorStore, policy: &dyn Policy) {
    if let Err(e) = store.save(policy) {
        tracing::warn!(error = %e, "could not save the posteriors");
    }
}

/// [`PosteriorStore::tick`] with a failure logged.
pub fn tick_logged(store: &mut PosteriorStore, policy: &dyn Policy) {
    if let Err(e) = store.tick(policy) {
        tracing::warn!(error = %e, "could not save the posteriors");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use cohabit_core::{Sample, ServiceClass, ServiceObservation, ServiceSpec};
    use cohabit_policy::{HostContext, MlConfig, MlPolicy};

    use super::*;

    fn host() -> HostCapacity {
        HostCapacity {
            name: "test".into(),
            cores: 16,
            freq_ghz: 2.0,
            llc_ways: 12,
            llc_way_bytes: 1 << 20,
            mem_bw_bytes_per_s: 5e10,
            gpus: vec![],
            closids: 16,
            mba_min_pct: 10,
            mba_gran_pct: 10,
            min_cbm_bits: 1,
            shareable_bits: 0,
        }
    }

    fn services(process: &str) -> Vec<ManagedService> {
        let text = format!(
            "[[service]]\nname = \"kv\"\np99_target_ms = 1\nmatch = {{ process_name = \"{process}\" }}\nlatency = {{ push = \"127.0.0.1:9400\", unauthenticated = true }}\n"
        );
        super::super::config::DaemonConfig::parse(&text, "test")
            .expect("config")
            .services
    }

    /// An `ml` policy on `host()` that has run a few ticks (so its posterior for `kv` is
    /// fitted and has learnt).
    fn learnt_ml() -> MlPolicy {
        let ctx = HostContext {
            host: host(),
            specs: vec![ServiceSpec {
                name: "kv".into(),
                class: ServiceClass::LatencyCritical { p99_target_ms: 1.0 },
                gpu: None,
                priority: 0,
            }],
        };
        let model = Arc::new(cohabit_models::Model::synthetic(2, &[8], 1));
        let mut ml = MlPolicy::new(ctx.clone(), model, MlConfig::default());
        let mut plan = ml.initial().plan;
        for t in 1..=4 {
            let obs = cohabit_core::Observation {
                t_ms: t * 1000,
                services: vec![ServiceObservation {
                    spec: ctx.specs[0].clone(),
                    sample: Sample {
                        p99_ms: Some(0.6),
                        requests_per_s: Some(100.0),
                        cpu_busy_cores: Some(1.0),
                        ..Sample::default()
                    },
                    gpu_mps_effective_pct: None,
                }],
                current: plan.clone(),
            };
            plan = ml.decide(&obs, t * 1000).plan;
        }
        ml
    }

    #[test]
    fn posteriors_are_saved_and_resumed_on_the_same_host_and_match() {
        let dir = tempfile::tempdir().unwrap();
        let ml = learnt_ml();
        let learnt = ml.learned().unwrap();
        assert!(learnt.services.contains_key("kv"), "{learnt:?}");
        let store = PosteriorStore::new(dir.path(), &host(), &services("kv"));
        assert!(store.save(&ml).unwrap());
        let mut fresh = learnt_ml();
        // Another run's posterior: what was saved replaces it.
        let r = store.resume(&mut fresh).unwrap();
        assert_eq!(r.services, vec!["kv".to_string()]);
        assert_eq!(fresh.learned(), Some(learnt));
    }

    #[test]
    fn a_changed_match_host_or_schema_drops_the_posterior() {
        let dir = tempfile::tempdir().unwrap();
        let ml = learnt_ml();
        PosteriorStore::new(dir.path(), &host(), &services("kv"))
            .save(&ml)
            .unwrap();
        let other_match = PosteriorStore::new(dir.path(), &host(), &services("memcached"));
        let r = other_match.resume(&mut learnt_ml()).unwrap();
        assert!(r.services.is_empty());
        assert_eq!(r.dropped, vec!["kv: its match changed".to_string()]);
        let bigger = HostCapacity {
            cores: 32,
            ..host()
        };
        let r = PosteriorStore::new(dir.path(), &bigger, &services("kv"))
            .resume(&mut learnt_ml())
            .unwrap();
        assert!(r.services.is_empty() && r.dropped[0].starts_with("learnt on"));
        // Another schema version.
        let path = dir.path().join(POSTERIOR_FILE);
        let text = std::fs::read_to_string(&path).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["schema_version"] = (POSTERIOR_SCHEMA_VERSION + 1).into();
        std::fs::write(&path, v.to_string()).unwrap();
        let r = PosteriorStore::new(dir.path(), &host(), &services("kv"))
            .resume(&mut learnt_ml())
            .unwrap();
        assert!(r.services.is_empty() && r.dropped[0].starts_with("schema version"));
    }

    #[test]
    fn a_corrupt_file_is_an_error_naming_it_and_no_file_is_nothing_to_resume() {
        let dir = tempfile::tempdir().unwrap();
        let store = PosteriorStore::new(dir.path(), &host(), &services("kv"));
        assert_eq!(store.resume(&mut learnt_ml()).unwrap(), Resumed::default());
        std::fs::write(store.path(), "{not json").unwrap();
        let err = store.resume(&mut learnt_ml()).unwrap_err().to_string();
        assert!(err.contains(POSTERIOR_FILE), "{err}");
        // A posterior that does not check out (not positive definite) is dropped by the
        // policy, not used.
        let ml = learnt_ml();
        store.save(&ml).unwrap();
        let text = std::fs::read_to_string(store.path()).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["services"]["kv"]["posterior"]["blr"]["precision"][0] = (-1.0).into();
        std::fs::write(store.path(), v.to_string()).unwrap();
        let r = store.resume(&mut learnt_ml()).unwrap();
        assert!(r.services.is_empty(), "{r:?}");
    }

    #[test]
    fn the_file_is_saved_every_save_every_ticks() {
        let dir = tempfile::tempdir().unwrap();
        let ml = learnt_ml();
        let mut store = PosteriorStore::new(dir.path(), &host(), &services("kv"));
        for _ in 1..SAVE_EVERY_TICKS {
            assert!(!store.tick(&ml).unwrap());
        }
        assert!(!store.path().exists());
        assert!(store.tick(&ml).unwrap());
        assert!(store.path().exists());
    }
}
