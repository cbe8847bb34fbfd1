//! The model artifact: weights in safetensors plus JSON metadata beside them.
//!
//! `NAME.json` holds the format and schema versions, the feature names and their
//! normalisation, the target's definition, the ensemble's shape, a digest of the training
//! data and the evaluation metrics; its `weights` field names the safetensors file (relative
//! to the JSON) with tensors `m{k}.l{i}.weight` (out × in, f32) and `m{k}.l{i}.bias` (out).
//! Loading checks everything against this build's feature schema and against itself, and
//! reports a wrong, truncated or mismatched artifact as a [`ModelError`] naming the file:
//! callers fall back to feedback control, never panic.
//!
//! An artifact is trained on one feature [`Schema`] ([`crate::schema`]): the CPU one
//! ([`CPU_SCHEMA`], `qos`, [`mod@crate::features`]) or the GPU one ([`GPU_SCHEMA`], `qos-gpu`,
//! [`mod@crate::gpu_features`]).
//! The metadata's `schema` field names it (absent: the CPU schema, so every CPU artifact
//! written before GPU models existed loads as it did); each loader expects one schema and
//! refuses an artifact of the other, or of another version, naming what it expected and
//! what it found.
//!
//! Files are read by [`read_model_file`] under [`LoadRules`]: each is looked at before it is
//! opened and checked again on the open descriptor (`fstat`), opened with `O_NONBLOCK` (a
//! FIFO at the path is refused, never waited on), and must be a regular file of at most
//! [`MAX_METADATA_BYTES`] or [`MAX_WEIGHTS_BYTES`]. The daemon's rules
//! ([`LoadRules::daemon`]) add `O_NOFOLLOW`, an owner (root or the daemon's user), no write
//! permission for group or others, and a `weights_digest` in the metadata.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ndarray::{Array1, Array2, ArrayView1, ArrayView2};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};

use crate::mlp::{Dense, Ensemble, Mlp};
pub use crate::schema::{Schema, CPU_SCHEMA, GPU_SCHEMA};

/// Artifact format tag.
pub const FORMAT: &str = "cohabit-qos-model";
/// Artifact format version.
pub const FORMAT_VERSION: u32 = 1;

/// Why a model could not be loaded or saved.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be read or written.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The metadata is not what a cohabit model needs.
    #[error("model metadata {path}: {message}")]
    Metadata {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The file is not one to read: not a regular file, too large, or (under the daemon's
    /// [`LoadRules`]) another user's or writable by others.
    #[error("model file {path}: {why}")]
    Refused {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The weights are unreadable or do not fit the metadata.
    #[error("model weights {path}: {message}")]
    Weights {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// The JSON metadata of a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelMetadata {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`FORMAT_VERSION`].
    pub format_version: u32,
    /// The feature schema the model was trained on, by name ([`Schema::name`]); absent
    /// in CPU artifacts (the CPU schema).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<String>,
    /// The feature schema version the model was trained on.
    pub schema_version: u32,
    /// Feature names in input order (must equal this build's schema).
    pub features: Vec<String>,
    /// Per-feature mean used for normalisation.
    pub norm_mean: Vec<f32>,
    /// Per-feature scale used for normalisation (positive).
    pub norm_std: Vec<f32>,
    /// What the output means.
    pub target: String,
    /// The safetensors file, relative to the metadata file.
    pub weights: String,
    /// Ensemble members.
    pub members: usize,
    /// Hidden layer widths of each member.
    pub hidden: Vec<usize>,
    /// Digest of the training data (e.g. `sha256:…`).
    #[serde(default)]
    pub training_data_digest: String,
    /// `sha256:<hex>` of the weights file, checked on load where present, so metadata is
    /// never paired with weights of another training run of the same shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_digest: Option<String>,
    /// Evaluation metrics recorded at training time.
    #[serde(default)]
    pub metrics: BTreeMap<String, f64>,
    /// Factor applied to the ensemble spread so that it is calibrated (fitted on validation
    /// data at training time; 1 when absent).
    #[serde(default = "one")]
    pub sigma_scale: f32,
    /// Factor applied to the members' disagreement on a *change* between two candidates
    /// of one service (see [`Model::score_change`]), calibrated on pairs of candidates
    /// (`cohabit-train calibrate`); `sigma_scale` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub change_sigma_scale: Option<f32>,
}

fn one() -> f32 {
    1.0
}

/// Most ensemble members an artifact may declare.
pub const MAX_MEMBERS: usize = 64;
/// Widest hidden layer an artifact may declare.
pub const MAX_WIDTH: usize = 4096;
/// Most hidden layers an artifact may declare.
pub const MAX_LAYERS: usize = 8;
/// Largest metadata file read.
pub const MAX_METADATA_BYTES: u64 = 16 << 20;
/// Largest weights file read: 64 MiB. The daemon runs in a pod limited to 1 GiB (the
/// shipped DaemonSet), and a reload holds three copies of the weights at its peak (the file's
/// bytes, the tensors parsed from them, and the model in force until the new one is swapped
/// in): 3 × 64 MiB leaves the daemon's own use ample room. The shipped models are 40 KB, a
/// ConfigMap (how the DaemonSet mounts one) holds at most 1 MiB, and 64 MiB is 16 million
/// weights, far past any ensemble this schema trains.
pub const MAX_WEIGHTS_BYTES: u64 = 64 << 20;
/// Most symbolic links followed to a model file (under [`LoadRules::owners`], only links
/// owned by a trusted user are followed at all).
const MAX_LINKS: usize = 8;

/// What a model's files must be before a byte of them is read. Every rule set refuses what
/// is not a regular file (a FIFO, a device, a directory) without reading it, and never
/// blocks on one (`O_NONBLOCK`); [`LoadRules::default`] is for tools reading a user's own
/// files, [`LoadRules::daemon`] for the daemon, which reads them as root.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadRules {
    /// When set: each file must be owned by one of these users and not be writable by group
    /// or others, and is opened with `O_NOFOLLOW`; a symbolic link at the path is followed
    /// only when one of these users owns it (a Kubernetes ConfigMap volume's files are links
    /// the kubelet made as root), so a user who can write the model's directory can neither
    /// plant a file nor point the daemon elsewhere.
    pub owners: Option<Vec<u32>>,
    /// Refuse metadata without `weights_digest` (every artifact `Model::save` writes has
    /// one): the daemon reloads a model when its files change, and without a digest, new
    /// metadata beside old weights of the same shape would load.
    pub require_weights_digest: bool,
}

impl LoadRules {
    /// The daemon's rules: files owned by root or by `euid` (the user it runs as), writable
    /// by nobody else, and a weights digest.
    pub fn daemon(euid: u32) -> Self {
        let mut owners = vec![0, euid];
        owners.dedup();
        Self {
            owners: Some(owners),
            require_weights_digest: true,
        }
    }
}

/// The kind of a file that is not a regular file, for errors.
fn kind_of(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

fn refused(path: &Path, why: String) -> ModelError {
    ModelError::Refused {
        path: path.to_path_buf(),
        why,
    }
}

/// Why a regular file with this owner and mode is not one `rules` trusts, if it is not.
fn untrusted(rules: &LoadRules, uid: u32, mode: u32) -> Option<String> {
    let owners = rules.owners.as_ref()?;
    if !owners.contains(&uid) {
        return Some(format!(
            "owned by uid {uid}; only files of root or of the user cohabit runs as are trusted"
        ));
    }
    (mode & 0o022 != 0).then(|| {
        format!(
            "mode {:04o}: group or others can write it; make it writable by its owner only",
            mode & 0o7777
        )
    })
}

/// Opens `path` for reading under `rules` (see [`LoadRules`]): the file it returns is a
/// regular file, checked on the open descriptor.
fn open_checked(path: &Path, rules: &LoadRules) -> Result<std::fs::File, ModelError> {
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let io = |e| ModelError::Io {
        what: "reading",
        path: path.to_path_buf(),
        source: e,
    };
    let strict = rules.owners.is_some();
    let mut at = path.to_path_buf();
    for _ in 0..=MAX_LINKS {
        // Looked at before it is opened, so that a FIFO or a device is not even opened.
        let seen = if strict {
            std::fs::symlink_metadata(&at)
        } else {
            std::fs::metadata(&at)
        }
        .map_err(io)?;
        if seen.file_type().is_symlink() {
            if !rules
                .owners
                .as_ref()
                .is_some_and(|o| o.contains(&seen.uid()))
            {
                return Err(refused(
                    &at,
                    format!(
                        "a symbolic link owned by uid {}; only links of root or of the user cohabit runs as are followed",
                        seen.uid()
                    ),
                ));
            }
            let target = std::fs::read_link(&at).map_err(io)?;
            at = at.parent().unwrap_or(Path::new("/")).join(target);
            continue;
        }
        if !seen.is_file() {
            let why = format!("not a regular file ({})", kind_of(seen.file_type()));
            return Err(refused(&at, why));
        }
        let mut flags = libc::O_NONBLOCK;
        if strict {
            flags |= libc::O_NOFOLLOW;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(flags)
            .open(&at)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => {
                    refused(&at, "replaced by a symbolic link while opened".into())
                }
                _ => io(e),
            })?;
        // What was opened is what counts: the path may have changed since it was looked at.
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            let why = format!("not a regular file ({})", kind_of(meta.file_type()));
            return Err(refused(&at, why));
        }
        if let Some(why) = untrusted(rules, meta.uid(), meta.mode()) {
            return Err(refused(&at, why));
        }
        return Ok(file);
    }
    Err(refused(
        path,
        format!("more than {MAX_LINKS} symbolic links to the file"),
    ))
}

/// `sha256:<hex>` of `bytes`.
pub fn digest(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    let hash = sha2::Sha256::digest(bytes);
    let mut s = String::with_capacity(7 + 64);
    s.push_str("sha256:");
    for b in hash {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// Reads a model file of at most `limit` bytes under `rules` ([`LoadRules`]): a root daemon
/// must not be pointed at `/dev/zero`, hang on a FIFO, or read what another user can write.
/// Errors name the path.
pub fn read_model_file(path: &Path, limit: u64, rules: &LoadRules) -> Result<Vec<u8>, ModelError> {
    use std::io::Read as _;
    let file = open_checked(path, rules)?;
    let io = |e| ModelError::Io {
        what: "reading",
        path: path.to_path_buf(),
        source: e,
    };
    let len = file.metadata().map_err(io)?.len();
    if len > limit {
        return Err(refused(path, format!("{len} bytes, larger than {limit}")));
    }
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(refused(path, format!("larger than {limit} bytes")));
    }
    Ok(bytes)
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename,
/// so a reader sees the old file or the new one, never a part.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    use std::io::Write as _;
    let io = |e| ModelError::Io {
        what: "writing",
        path: path.to_path_buf(),
        source: e,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io)?;
    tmp.write_all(bytes).map_err(io)?;
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    Ok(())
}

/// A loaded model: metadata and the ensemble.
#[derive(Debug, Clone)]
pub struct Model {
    /// Its metadata.
    pub meta: ModelMetadata,
    /// The ensemble.
    pub ensemble: Ensemble,
}

/// A model loaded from its files ([`Model::load_files`]).
#[derive(Debug, Clone)]
pub struct LoadedFiles {
    /// The model.
    pub model: Model,
    /// `sha256:<hex>` of the metadata's bytes, as read and parsed.
    pub meta_digest: String,
    /// The weights file the metadata named.
    pub weights_path: PathBuf,
}

fn tensor_name(member: usize, layer: usize, part: &str) -> String {
    format!("m{member}.l{layer}.{part}")
}

fn f32s(view: &TensorView<'_>) -> Vec<f32> {
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

impl Model {
    /// Loads `NAME.json` and the weights it names, a model of the CPU schema.
    ///
    /// Both files must be regular files of bounded size; the weights file must sit beside
    /// the metadata (a bare file name), and match `weights_digest` where the metadata has one.
    pub fn load(meta_path: &Path) -> Result<Model, ModelError> {
        Self::load_schema(meta_path, &CPU_SCHEMA)
    }

    /// [`Model::load`] for a model of the GPU schema.
    pub fn load_gpu(meta_path: &Path) -> Result<Model, ModelError> {
        Self::load_schema(meta_path, &GPU_SCHEMA)
    }

    /// [`Model::load`] for a model of `schema`: an artifact of another schema or version
    /// is refused, naming both.
    pub fn load_schema(meta_path: &Path, schema: &'static Schema) -> Result<Model, ModelError> {
        Self::load_files(meta_path, schema, &LoadRules::default()).map(|l| l.model)
    }

    /// [`Model::load_schema`] under `rules` ([`LoadRules`]), with what the watcher of a
    /// running daemon needs to tell versions apart: each file is read once.
    pub fn load_files(
        meta_path: &Path,
        schema: &'static Schema,
        rules: &LoadRules,
    ) -> Result<LoadedFiles, ModelError> {
        let bytes = read_model_file(meta_path, MAX_METADATA_BYTES, rules)?;
        let meta_digest = digest(&bytes);
        let text = String::from_utf8(bytes).map_err(|_| ModelError::Metadata {
            path: meta_path.to_path_buf(),
            message: "not UTF-8 text".into(),
        })?;
        let meta = Self::parse_metadata(&text, meta_path, schema)?;
        if rules.require_weights_digest && meta.weights_digest.is_none() {
            return Err(ModelError::Metadata {
                path: meta_path.to_path_buf(),
                message: "no weights_digest; cohabit run needs one (Model::save and cohabit-train record it)".into(),
            });
        }
        let weights_path = meta_path
            .parent()
            .unwrap_or(Path::new("."))
            .join(&meta.weights);
        let bytes = read_model_file(&weights_path, MAX_WEIGHTS_BYTES, rules)?;
        let model = Self::from_parts(meta, &bytes, &weights_path, schema)?;
        Ok(LoadedFiles {
            model,
            meta_digest,
            weights_path,
        })
    }

    /// A model of the CPU schema from metadata text and weight bytes already in memory
    /// (e.g. compiled into the binary); `origin` names them in errors.
    pub fn from_bytes(meta_text: &str, weights: &[u8], origin: &Path) -> Result<Model, ModelError> {
        Self::from_bytes_schema(meta_text, weights, origin, &CPU_SCHEMA)
    }

    /// [`Model::from_bytes`] for a model of `schema`.
    pub fn from_bytes_schema(
        meta_text: &str,
        weights: &[u8],
        origin: &Path,
        schema: &'static Schema,
    ) -> Result<Model, ModelError> {
        let meta = Self::parse_metadata(meta_text, origin, schema)?;
        let weights_path = origin.with_file_name(&meta.weights);
        Self::from_parts(meta, weights, &weights_path, schema)
    }

    /// The schema the model was trained on (checked on load).
    pub fn schema(&self) -> &'static Schema {
        self.meta
            .schema
            .as_deref()
            .and_then(Schema::by_name)
            .unwrap_or(&CPU_SCHEMA)
    }

    fn parse_metadata(
        text: &str,
        meta_path: &Path,
        schema: &'static Schema,
    ) -> Result<ModelMetadata, ModelError> {
        let meta_err = |message: String| ModelError::Metadata {
            path: meta_path.to_path_buf(),
            message,
        };
        let meta: ModelMetadata =
            serde_json::from_str(text).map_err(|e| meta_err(e.to_string()))?;
        Self::check_format_and_schema(&meta, schema)
            .and_then(|()| Self::check_shape(&meta))
            .map_err(meta_err)?;
        Ok(meta)
    }

    /// Whether `meta` is of this build's format and of `schema`, feature by feature; the
    /// error says what differs.
    fn check_format_and_schema(
        meta: &ModelMetadata,
        schema: &'static Schema,
    ) -> Result<(), String> {
        if meta.format != FORMAT || meta.format_version != FORMAT_VERSION {
            return Err(format!(
                "format {:?} version {} is not {FORMAT:?} version {FORMAT_VERSION}",
                meta.format, meta.format_version
            ));
        }
        let found = meta.schema.as_deref().unwrap_or(CPU_SCHEMA.name);
        if found != schema.name {
            let what = Schema::by_name(found).map_or_else(
                || format!("feature schema {found:?} (unknown to this build)"),
                |s| {
                    format!(
                        "feature schema {}-v{} ({})",
                        s.name, meta.schema_version, s.about
                    )
                },
            );
            return Err(format!(
                "trained on {what}, expected a model of feature schema {schema}"
            ));
        }
        if meta.schema_version != schema.version {
            return Err(format!(
                "trained on feature schema {} of {:?}, this build speaks {schema}",
                meta.schema_version, schema.name
            ));
        }
        let n = schema.width();
        if meta.features.len() != n
            || meta
                .features
                .iter()
                .zip(schema.features)
                .any(|(a, b)| a != b)
        {
            let first = meta
                .features
                .iter()
                .zip(schema.features)
                .position(|(a, b)| a != b)
                .unwrap_or(meta.features.len().min(n));
            return Err(format!(
                "features differ from the schema {schema} at position {first} ({} features, schema has {n})",
                meta.features.len()
            ));
        }
        Ok(())
    }

    /// Whether `meta`'s normalisation, spreads, ensemble shape and weights file are usable;
    /// the error says which is not.
    fn check_shape(meta: &ModelMetadata) -> Result<(), String> {
        let n = meta.features.len();
        if meta.norm_mean.len() != n || meta.norm_std.len() != n {
            return Err(format!("normalisation needs {n} means and scales"));
        }
        if meta.norm_mean.iter().any(|v| !v.is_finite())
            || meta.norm_std.iter().any(|v| !(v.is_finite() && *v > 0.0))
        {
            return Err("normalisation has a non-finite mean or a non-positive scale".into());
        }
        if !(meta.sigma_scale.is_finite() && meta.sigma_scale > 0.0) {
            return Err(format!(
                "sigma_scale must be positive, got {}",
                meta.sigma_scale
            ));
        }
        if meta
            .change_sigma_scale
            .is_some_and(|v| !(v.is_finite() && v > 0.0))
        {
            return Err(format!(
                "change_sigma_scale must be positive, got {:?}",
                meta.change_sigma_scale
            ));
        }
        if meta.members == 0 || meta.members > MAX_MEMBERS {
            return Err(format!(
                "members must be between 1 and {MAX_MEMBERS}, got {}",
                meta.members
            ));
        }
        if meta.hidden.len() > MAX_LAYERS || meta.hidden.iter().any(|w| *w == 0 || *w > MAX_WIDTH) {
            return Err(format!(
                "hidden must be at most {MAX_LAYERS} layers of 1 to {MAX_WIDTH} units, got {:?}",
                meta.hidden
            ));
        }
        let bare = Path::new(&meta.weights)
            .file_name()
            .is_some_and(|n| n == std::ffi::OsStr::new(&meta.weights));
        if !bare || meta.weights.starts_with('.') {
            return Err(format!(
                "weights must be a file name beside the metadata, got {:?}",
                meta.weights
            ));
        }
        Ok(())
    }

    fn from_parts(
        meta: ModelMetadata,
        bytes: &[u8],
        weights_path: &Path,
        schema: &'static Schema,
    ) -> Result<Model, ModelError> {
        let w_err = |message: String| ModelError::Weights {
            path: weights_path.to_path_buf(),
            message,
        };
        if let Some(want) = &meta.weights_digest {
            let got = digest(bytes);
            if &got != want {
                return Err(w_err(format!(
                    "digest {got} differs from the metadata's {want} (weights of another training run?)"
                )));
            }
        }
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| w_err(format!("not a safetensors file: {e}")))?;
        let widths: Vec<usize> = std::iter::once(schema.width())
            .chain(meta.hidden.iter().copied())
            .chain(std::iter::once(1))
            .collect();
        let mut members = Vec::with_capacity(meta.members);
        for k in 0..meta.members {
            let mut layers = Vec::new();
            for (i, pair) in widths.windows(2).enumerate() {
                let (inp, out) = (pair[0], pair[1]);
                let get = |part: &str, shape: &[usize]| -> Result<Vec<f32>, ModelError> {
                    let name = tensor_name(k, i, part);
                    let v = st
                        .tensor(&name)
                        .map_err(|_| w_err(format!("tensor {name} is missing")))?;
                    if v.dtype() != Dtype::F32 {
                        return Err(w_err(format!(
                            "tensor {name} is {:?}, expected F32",
                            v.dtype()
                        )));
                    }
                    if v.shape() != shape {
                        return Err(w_err(format!(
                            "tensor {name} has shape {:?}, expected {shape:?}",
                            v.shape()
                        )));
                    }
                    let data = f32s(&v);
                    if data.iter().any(|x| !x.is_finite()) {
                        return Err(w_err(format!("tensor {name} holds a non-finite value")));
                    }
                    Ok(data)
                };
                let weight = Array2::from_shape_vec((out, inp), get("weight", &[out, inp])?)
                    .map_err(|e| w_err(e.to_string()))?;
                let bias = Array1::from(get("bias", &[out])?);
                layers.push(Dense { weight, bias });
            }
            members.push(Mlp { layers });
        }
        let ensemble = Ensemble {
            members,
            mean: Array1::from(meta.norm_mean.clone()),
            std: Array1::from(meta.norm_std.clone()),
        };
        Ok(Model { meta, ensemble })
    }

    /// Writes `NAME.json` and `NAME.safetensors` into `dir`, each replaced atomically,
    /// weights first and metadata (with the weights' digest) last, so a reader that loads
    /// during a retrain gets the old model or the new one, never a mix.
    pub fn save(&self, dir: &Path, name: &str) -> Result<PathBuf, ModelError> {
        let weights_file = format!("{name}.safetensors");
        let weights_path = dir.join(&weights_file);
        let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for (k, m) in self.ensemble.members.iter().enumerate() {
            for (i, l) in m.layers.iter().enumerate() {
                let w: Vec<u8> = l.weight.iter().flat_map(|v| v.to_le_bytes()).collect();
                let b: Vec<u8> = l.bias.iter().flat_map(|v| v.to_le_bytes()).collect();
                owned.push((tensor_name(k, i, "weight"), l.weight.shape().to_vec(), w));
                owned.push((tensor_name(k, i, "bias"), vec![l.bias.len()], b));
            }
        }
        let views: Vec<(String, TensorView<'_>)> = owned
            .iter()
            .map(|(n, shape, data)| {
                TensorView::new(Dtype::F32, shape.clone(), data)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| ModelError::Weights {
                        path: weights_path.clone(),
                        message: e.to_string(),
                    })
            })
            .collect::<Result<_, _>>()?;
        let bytes = safetensors::serialize(views, &None).map_err(|e| ModelError::Weights {
            path: weights_path.clone(),
            message: e.to_string(),
        })?;
        write_atomic(&weights_path, &bytes)?;
        let mut meta = self.meta.clone();
        meta.weights = weights_file;
        meta.weights_digest = Some(digest(&bytes));
        let meta_path = dir.join(format!("{name}.json"));
        let text = serde_json::to_string_pretty(&meta).map_err(|e| ModelError::Metadata {
            path: meta_path.clone(),
            message: e.to_string(),
        })?;
        write_atomic(&meta_path, (text + "\n").as_bytes())?;
        Ok(meta_path)
    }

    /// Predicted ln(p99 / target) and its spread for each row of raw features.
    pub fn score(&self, rows: ArrayView2<'_, f32>) -> (Array1<f32>, Array1<f32>) {
        let (mean, spread) = self.ensemble.predict(rows);
        (mean, spread * self.meta.sigma_scale)
    }

    /// Predicted change of ln(p99 / target) from a `reference` row to each of `rows` (which
    /// must equal the reference outside [`crate::features::CANDIDATE_FEATURES`]: candidates
    /// of one service at one tick), and its calibrated spread: the members' disagreement on
    /// the *difference*, which is what matters when the reference's outcome has been
    /// measured (members that share an offset agree on differences even where their levels
    /// spread).
    pub fn score_change(
        &self,
        reference: ArrayView1<'_, f32>,
        rows: ArrayView2<'_, f32>,
    ) -> (Array1<f32>, Array1<f32>) {
        let (mean, spread, _) = self.score_change_basis(reference, rows);
        (mean, spread)
    }

    /// [`Model::score_change`] and the change of the members' mean basis (the input of
    /// their output layers, [`crate::mlp::Ensemble::basis_width`]) from the reference to
    /// each row, rows × width (`None` when the members' widths differ): what a per-host
    /// posterior on the output layer regresses a change on ([`crate::posterior`]).
    pub fn score_change_basis(
        &self,
        reference: ArrayView1<'_, f32>,
        rows: ArrayView2<'_, f32>,
    ) -> (Array1<f32>, Array1<f32>, Option<Array2<f32>>) {
        let n = rows.nrows();
        let mut all = Array2::<f32>::zeros((n + 1, rows.ncols()));
        all.row_mut(0).assign(&reference);
        all.slice_mut(ndarray::s![1.., ..]).assign(&rows);
        let (out, basis) = self
            .ensemble
            .members_predict_shared_basis(all.view(), self.schema().candidate);
        let delta = basis.map(|b| {
            let r = b.row(0).to_owned();
            b.slice(ndarray::s![1.., ..]).to_owned() - &r
        });
        let k = out.nrows().max(1) as f32;
        let mut mean = Array1::<f32>::zeros(n);
        let mut var = Array1::<f32>::zeros(n);
        for member in out.rows() {
            let d = member.slice(ndarray::s![1..]).mapv(|v| v - member[0]);
            mean += &d;
            var += &(&d * &d);
        }
        mean /= k;
        // E[d²] - E[d]², clamped against rounding.
        let spread = (var / k - &mean * &mean).mapv(|v| v.max(0.0).sqrt());
        let scale = self
            .meta
            .change_sigma_scale
            .unwrap_or(self.meta.sigma_scale);
        (mean, spread * scale, delta)
    }
}

impl Model {
    /// A model with pseudo-random weights (a fixed linear congruential sequence from `seed`)
    /// in the CPU schema. It predicts nothing meaningful; it exists for tests and speed
    /// benchmarks, and its metadata says so.
    pub fn synthetic(members: usize, hidden: &[usize], seed: u64) -> Model {
        Self::synthetic_schema(&CPU_SCHEMA, members, hidden, seed)
    }

    /// [`Model::synthetic`] in `schema`.
    pub fn synthetic_schema(
        schema: &'static Schema,
        members: usize,
        hidden: &[usize],
        seed: u64,
    ) -> Model {
        let n = schema.width();
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let mut next = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            // Top 24 bits to a float in [-0.5, 0.5).
            ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        };
        let widths: Vec<usize> = std::iter::once(n)
            .chain(hidden.iter().copied())
            .chain(std::iter::once(1))
            .collect();
        let members_v = (0..members)
            .map(|_| Mlp {
                layers: widths
                    .windows(2)
                    .map(|p| Dense {
                        weight: Array2::from_shape_fn((p[1], p[0]), |_| {
                            next() / (p[0] as f32).sqrt()
                        }),
                        bias: Array1::from_shape_fn(p[1], |_| next() * 0.1),
                    })
                    .collect(),
            })
            .collect();
        Model {
            meta: ModelMetadata {
                format: FORMAT.into(),
                format_version: FORMAT_VERSION,
                schema: (schema != &CPU_SCHEMA).then(|| schema.name.to_string()),
                schema_version: schema.version,
                features: schema.features.iter().map(|s| s.to_string()).collect(),
                norm_mean: vec![0.0; n],
                norm_std: vec![1.0; n],
                target: "synthetic weights for tests and benchmarks: not a trained model".into(),
                weights: String::new(),
                members,
                hidden: hidden.to_vec(),
                training_data_digest: String::new(),
                weights_digest: None,
                metrics: BTreeMap::new(),
                sigma_scale: 1.0,
                change_sigma_scale: None,
            },
            ensemble: Ensemble {
                members: members_v,
                mean: Array1::zeros(n),
                std: Array1::ones(n),
            },
        }
    }
}
