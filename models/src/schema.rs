//! What every feature schema has, and the rules the two schemas ([`mod@crate::features`] for CPU
//! services, [`mod@crate::gpu_features`] for GPU services' MPS shares) share.
//!
//! A [`Schema`] is the description written into and checked against every artifact: a name
//! and version, the feature names in input order, the columns that depend on the candidate,
//! and the readings that may be absent, each paired with its presence flag.
//!
//! Absent is absent, in both schemas: a reading the host cannot take, or one outside its
//! plausible range, is 0 with its flag 0 (`plausible`, then `flag`), and such a value is
//! never compared with the training range ([`Schema::present`]).

use crate::features::{CANDIDATE_FEATURES, FEATURE_NAMES, FEATURE_SCHEMA_VERSION, PRESENCE_FLAGS};
use crate::gpu_features::{
    GPU_CANDIDATE_FEATURES, GPU_FEATURE_NAMES, GPU_FEATURE_SCHEMA_VERSION, GPU_PRESENCE_FLAGS,
    GPU_SCHEMA_NAME,
};

/// A feature schema a model can be trained on: its name and version (written into the
/// artifact), its feature names in input order, the columns that depend on the candidate,
/// and its presence flags.
#[derive(Debug, PartialEq, Eq)]
pub struct Schema {
    /// Name written into the artifact's metadata (`schema`).
    pub name: &'static str,
    /// Version (`schema_version`).
    pub version: u32,
    /// What it describes, for messages.
    pub about: &'static str,
    /// Feature names, in input order.
    pub features: &'static [&'static str],
    /// Input columns that depend on the candidate allocation.
    pub candidate: &'static [usize],
    /// The readings that may be absent, each with its presence flag: (value, flag). A value
    /// whose flag is 0 was not measured (it is 0 in the vector).
    pub presence: &'static [(&'static str, &'static str)],
}

impl Schema {
    /// Input width.
    pub fn width(&self) -> usize {
        self.features.len()
    }

    /// The schema of this build called `name`.
    pub fn by_name(name: &str) -> Option<&'static Schema> {
        [&CPU_SCHEMA, &GPU_SCHEMA]
            .into_iter()
            .find(|s| s.name == name)
    }

    /// Index of feature `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.features.iter().position(|n| *n == name)
    }

    /// True if feature `i` of the vector `f` carries a measured value: false for a presence
    /// flag itself and for a reading whose flag is 0 (see [`Schema::presence`]), and for an
    /// index outside the schema; true for everything else.
    pub fn present(&self, f: &[f32], i: usize) -> bool {
        let Some(name) = self.features.get(i) else {
            return false;
        };
        if self.presence.iter().any(|(_, flag)| flag == name) {
            return false;
        }
        self.presence
            .iter()
            .find(|(value, _)| value == name)
            .and_then(|(_, flag)| self.index(flag))
            .is_none_or(|j| f.get(j).is_some_and(|v| *v > 0.5))
    }
}

impl std::fmt::Display for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-v{} ({})", self.name, self.version, self.about)
    }
}

/// The CPU schema ([`mod@crate::features`]): what every CPU artifact is trained on.
pub const CPU_SCHEMA: Schema = Schema {
    name: "qos",
    version: FEATURE_SCHEMA_VERSION,
    about: "CPU services",
    features: &FEATURE_NAMES,
    candidate: &CANDIDATE_FEATURES,
    presence: &PRESENCE_FLAGS,
};

/// The GPU schema ([`mod@crate::gpu_features`]): MPS shares of GPU services.
pub const GPU_SCHEMA: Schema = Schema {
    name: GPU_SCHEMA_NAME,
    version: GPU_FEATURE_SCHEMA_VERSION,
    about: "GPU services' MPS shares",
    features: &GPU_FEATURE_NAMES,
    candidate: &GPU_CANDIDATE_FEATURES,
    presence: &GPU_PRESENCE_FLAGS,
};

/// `v` if it is a plausible reading: finite and within `0..=max`; `None` (absent) otherwise.
pub(crate) fn plausible(v: Option<f64>, max: f64) -> Option<f64> {
    v.filter(|x| x.is_finite() && *x >= 0.0 && *x <= max)
}

/// A reading as its pair of features (value, presence flag): (`x`, 1) when measured, (0, 0)
/// when absent.
// Features are bounded, O(1) values; f32 is the model's precision.
#[allow(clippy::cast_possible_truncation)]
pub(crate) fn flag(v: Option<f64>) -> (f32, f32) {
    match v {
        Some(x) => (x as f32, 1.0),
        None => (0.0, 0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_of_each_schema_is_paired_with_one_value_and_both_names_exist() {
        for schema in [&CPU_SCHEMA, &GPU_SCHEMA] {
            let flags: Vec<&str> = schema
                .features
                .iter()
                .copied()
                .filter(|n| n.starts_with("has_"))
                .collect();
            let paired: Vec<&str> = schema.presence.iter().map(|(_, f)| *f).collect();
            assert_eq!(flags, paired, "{schema}: every has_* flag, in schema order");
            for (value, flag) in schema.presence {
                assert!(
                    schema.index(value).is_some() && schema.index(flag).is_some(),
                    "{schema}: {value} {flag}"
                );
            }
            assert!(
                schema.candidate.iter().all(|&i| i < schema.width()),
                "{schema}: candidate columns {:?}",
                schema.candidate
            );
        }
    }

    #[test]
    fn a_reading_is_present_only_with_its_flag_set_and_a_flag_is_never_a_reading() {
        let s = &GPU_SCHEMA;
        let gpu_util = s.index("gpu_util").unwrap();
        let has = s.index("has_gpu_util").unwrap();
        let share = s.index("share_now").unwrap();
        let mut f = vec![0.0; s.width()];
        assert!(!s.present(&f, gpu_util));
        assert!(
            s.present(&f, share),
            "a value without a flag is always a reading"
        );
        f[has] = 1.0;
        assert!(s.present(&f, gpu_util));
        assert!(!s.present(&f, has));
        assert!(!s.present(&f, s.width()), "outside the schema");
        // A vector too short to hold the flag: the reading is not taken as measured.
        assert!(!s.present(&f[..has], gpu_util));
    }

    #[test]
    fn implausible_readings_are_absent_and_present_ones_carry_their_flag() {
        assert_eq!(plausible(Some(3.0), 3.0), Some(3.0));
        for bad in [
            Some(-0.1),
            Some(3.1),
            Some(f64::NAN),
            Some(f64::INFINITY),
            None,
        ] {
            assert_eq!(plausible(bad, 3.0), None, "{bad:?}");
        }
        assert_eq!(flag(Some(0.25)), (0.25, 1.0));
        assert_eq!(flag(None), (0.0, 0.0));
    }
}
