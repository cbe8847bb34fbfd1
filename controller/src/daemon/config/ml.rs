//! The policy and its tunables: `policy` (with the `model` `ml` needs), `ml = { … }` (the
//! tunables of `ml`, also `cohabit simulate --ml KEY=VALUE`) and `explore = { … }` (safe
//! exploration around the policy's plans).

use std::collections::BTreeMap;

use cohabit_policy::{ExploreConfig, ExploreRule, MlConfig, PolicyKind};
use serde::Deserialize;

use super::error::{ConfigError, Problem};

/// `explore = { … }`: every field optional, defaults from [`ExploreConfig::default`].
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ExploreFile {
    margin: Option<f64>,
    max_cores: Option<u32>,
    max_ways: Option<u32>,
    max_mba_steps: Option<u32>,
    min_cores: Option<u32>,
    min_ways: Option<u32>,
    seed: Option<u64>,
    /// `"informative"` (default) or `"walk"`.
    rule: Option<String>,
    beta: Option<f64>,
    min_information: Option<f64>,
    settle_ticks: Option<u32>,
}

impl TryFrom<&ExploreFile> for ExploreConfig {
    type Error = ConfigError;

    /// Errors name fields within `explore`.
    fn try_from(e: &ExploreFile) -> Result<Self, ConfigError> {
        let d = ExploreConfig::default();
        let rule = match e.rule.as_deref() {
            None => d.rule,
            Some("informative") => ExploreRule::Informative,
            Some("walk") => ExploreRule::Walk,
            Some(other) => {
                return Err(ConfigError::invalid(
                    "rule",
                    format!("must be \"informative\" or \"walk\", not {other:?}"),
                ))
            }
        };
        let cfg = ExploreConfig {
            margin: e.margin.unwrap_or(d.margin),
            max_cores: e.max_cores.unwrap_or(d.max_cores),
            max_ways: e.max_ways.unwrap_or(d.max_ways),
            max_mba_steps: e.max_mba_steps.unwrap_or(d.max_mba_steps),
            min_cores: e.min_cores.unwrap_or(d.min_cores),
            min_ways: e.min_ways.unwrap_or(d.min_ways),
            seed: e.seed.unwrap_or(d.seed),
            rule,
            beta: e.beta.unwrap_or(d.beta),
            min_information: e.min_information.unwrap_or(d.min_information),
            settle_ticks: e.settle_ticks.unwrap_or(d.settle_ticks),
        };
        cfg.validate().map_err(|m| from_policy("explore", &m))?;
        Ok(cfg)
    }
}

/// `cohabit simulate --ml KEY=VALUE`: `ml`'s tunables from `KEY=VALUE` pairs, read as the
/// daemon reads its `ml = { … }` table ([`MlConfig::with_tunables`]: the same names,
/// defaults and checks; a later pair over an earlier one).
///
/// Errors are named `--ml` (their `path`) and the tunable (`ml.margin`).
pub fn ml_settings(pairs: &[String]) -> Result<MlConfig, ConfigError> {
    let mut settings = Vec::with_capacity(pairs.len());
    for pair in pairs {
        let (key, value) = pair.split_once('=').ok_or_else(|| {
            ConfigError::new(
                "",
                Problem::WrongType(format!("{pair:?}: expected KEY=VALUE, like margin=0.95")),
            )
            .in_file("--ml")
        })?;
        let value: f64 = value.trim().parse().map_err(|_| {
            ConfigError::new(
                format!("ml.{}", key.trim()),
                Problem::WrongType(format!("{:?} is not a number", value.trim())),
            )
            .in_file("--ml")
        })?;
        settings.push((key.trim(), value));
    }
    MlConfig::with_tunables(settings)
        .map_err(|m| from_policy("ml", &m).within("ml").in_file("--ml"))
}

/// An error of the policy crate's checks (`ExploreConfig::validate`,
/// `MlConfig::with_tunables`), which name the field first (`ml.margin must be …`), as a
/// problem at that field within `section`.
fn from_policy(section: &str, message: &str) -> ConfigError {
    let (first, rest) = message.split_once(' ').unwrap_or((message, ""));
    match first
        .strip_prefix(section)
        .and_then(|f| f.strip_prefix('.'))
    {
        Some(field) => ConfigError::invalid(field.trim_end_matches(':'), rest),
        None => ConfigError::invalid("", message),
    }
}

/// `policy`, checked against what it needs (`ml`: a `model`) and what only it reads (the
/// `ml` table), with `ml`'s tunables (the defaults when there is no table). Errors name
/// top-level fields.
pub(super) fn policy(
    name: &str,
    has_model: bool,
    ml: Option<&BTreeMap<String, f64>>,
) -> Result<(PolicyKind, MlConfig), ConfigError> {
    if name == "oracle" {
        return Err(ConfigError::invalid(
            "policy",
            "oracle needs the simulator's ground truth; use static or parties on a real host",
        ));
    }
    let policy: PolicyKind = name
        .parse()
        .map_err(|e: String| ConfigError::new("policy", Problem::WrongType(e)))?;
    if policy == PolicyKind::Ml && !has_model {
        return Err(ConfigError::missing(
            "model",
            "is missing: policy ml needs model = \"path/to/model.json\" (see cohabit-train fit)",
        ));
    }
    // A table that would do nothing is a mistake, not a setting: say so.
    if ml.is_some() && policy != PolicyKind::Ml {
        return Err(ConfigError::conflict(
            "ml",
            format!(
                "holds the tunables of policy = \"ml\", but the policy is {policy:?}; remove the ml table or set policy = \"ml\"",
                policy = policy.name()
            ),
        ));
    }
    let ml = match ml {
        Some(table) => MlConfig::with_tunables(table.iter().map(|(k, v)| (k.as_str(), *v)))
            .map_err(|m| from_policy("ml", &m).within("ml"))?,
        None => MlConfig::default(),
    };
    Ok((policy, ml))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err, MIN};
    use super::super::*;
    use super::*;

    #[test]
    fn ml_takes_an_optional_gpu_model_beside_its_model() {
        let ml = "policy = \"ml\"\nmodel = \"/etc/cohabit/qos.json\"\n";
        let c = DaemonConfig::parse(&format!("{ml}{MIN}"), "t.toml").unwrap();
        assert_eq!(c.gpu_model, None, "optional");
        let c = DaemonConfig::parse(
            &format!("{ml}gpu_model = \"/etc/cohabit/qos-gpu.json\"\n{MIN}"),
            "t.toml",
        )
        .unwrap();
        assert_eq!(
            c.gpu_model.as_deref(),
            Some(Path::new("/etc/cohabit/qos-gpu.json"))
        );
        assert_eq!(c.model.as_deref(), Some(Path::new("/etc/cohabit/qos.json")));
        // A GPU model is no CPU model: ml still needs `model`.
        let e = err(&format!(
            "policy = \"ml\"\ngpu_model = \"/etc/cohabit/qos-gpu.json\"\n{MIN}"
        ));
        assert!(e.contains("needs model"), "{e}");
        // Misspelt: refused, naming the key.
        let e = err(&format!(
            "{ml}gpu-model = \"/etc/cohabit/qos-gpu.json\"\n{MIN}"
        ));
        assert!(e.contains("gpu-model"), "{e}");
    }

    #[test]
    fn exploration_and_the_model_check_have_defaults_and_are_checked() {
        let d = DaemonConfig::parse(MIN, "t.toml").unwrap();
        assert_eq!((d.explore.clone(), d.model_check_every_ticks), (None, 10));
        let c = DaemonConfig::parse(
            &format!(
                "model_check_every_ticks = 0\nexplore = {{ margin = 0.4, max_ways = 0, seed = 9 }}\n{MIN}"
            ),
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.model_check_every_ticks, 0);
        assert_eq!(
            c.explore,
            Some(ExploreConfig {
                margin: 0.4,
                max_ways: 0,
                seed: 9,
                ..ExploreConfig::default()
            })
        );
        let e = err(&format!("explore = {{ margin = 1.5 }}\n{MIN}"));
        assert!(e.contains("explore.margin"), "{e}");
        let e = err(&format!("explore = {{ margins = 0.3 }}\n{MIN}"));
        assert!(e.contains("margins"), "{e}");
        let c = DaemonConfig::parse(
            &format!("explore = {{ rule = \"walk\", beta = 1.5 }}\n{MIN}"),
            "t.toml",
        )
        .unwrap();
        let e = c.explore.unwrap();
        assert_eq!((e.rule, e.beta), (ExploreRule::Walk, 1.5));
        let e = err(&format!("explore = {{ rule = \"random\" }}\n{MIN}"));
        assert!(e.contains("explore.rule") && e.contains("random"), "{e}");
        let e = err(&format!("explore = {{ beta = -1 }}\n{MIN}"));
        assert!(e.contains("explore.beta"), "{e}");
        let e = err(&format!("model_check_every_ticks = -1\n{MIN}"));
        assert!(e.contains("model_check_every_ticks"), "{e}");
    }

    #[test]
    fn mls_tunables_from_key_value_pairs_are_read_as_the_table_is() {
        let pairs = |p: &[&str]| ml_settings(&p.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(pairs(&[]), Ok(MlConfig::default()));
        assert_eq!(
            pairs(&["margin=0.95", " shrink_after = 3", "margin=.9"]),
            Ok(MlConfig {
                margin: 0.9,
                shrink_after: 3,
                ..MlConfig::default()
            }),
            "the later margin wins"
        );
        let refused = |p: &[&str], want: &str| {
            let e = pairs(p).unwrap_err().to_string();
            assert!(e.contains(want), "{p:?}: {e}");
        };
        refused(&["margin"], "expected KEY=VALUE");
        refused(&["margin=high"], "\"high\" is not a number");
        refused(&["margin = 0.9, z_limit=9.0"], "is not a number");
        refused(&["margins=0.95"], "--ml: ml.margins is not a tunable");
        refused(&["z_limit=9"], "--ml: ml.z_limit is not a tunable");
        refused(
            &["margin=1.5"],
            "--ml: ml.margin must be between 0.5 and 0.99, got 1.5",
        );
        refused(&["margin=NaN"], "--ml: ml.margin must be between");
        refused(
            &["shrink_after=2.5"],
            "--ml: ml.shrink_after must be a whole number, got 2.5",
        );
        refused(
            &["gpu_hysteresis_pct=300"],
            "--ml: ml.gpu_hysteresis_pct must be between 1 and 50, got 300",
        );
    }

    #[test]
    fn mls_tunables_default_as_measured_and_are_checked_by_name() {
        let ml = "policy = \"ml\"\nmodel = \"/etc/cohabit/qos.json\"\n";
        let d = DaemonConfig::parse(&format!("{ml}{MIN}"), "t.toml").unwrap();
        assert_eq!(d.ml, MlConfig::default());
        // Every tunable, inline or as a table, reaches its own field; the same through --ml.
        let all = "margin = 0.8, k_sigma = 0.4, k_sigma_give_back = 0.6, give_back_headroom = 0.25, unsure_sigma = 1.5, shrink_after = 7, way_cost = 0.2, explore_step = 0.1, explore_below = 0.7, gpu_hysteresis_pct = 20, gpu_shrink_after_ms = 60000";
        // Which field each name sets is pinned by the policy's own test; here, that the
        // table hands every name and value on (all moved from the defaults).
        let want = MlConfig::with_tunables(all.split(", ").map(|p| {
            let (k, v) = p.split_once(" = ").unwrap();
            (k, v.parse::<f64>().unwrap())
        }))
        .unwrap();
        assert_eq!(want.moved_tunables().len(), 11);
        let table = all.replace(", ", "\n");
        for text in [
            format!("{ml}ml = {{ {all} }}\n{MIN}"),
            format!("{ml}{MIN}\n[ml]\n{table}\n"),
        ] {
            assert_eq!(
                DaemonConfig::parse(&text, "t.toml").unwrap().ml,
                want,
                "{text}"
            );
        }
        let pairs: Vec<String> = all.split(", ").map(|p| p.replace(' ', "")).collect();
        assert_eq!(ml_settings(&pairs), Ok(want));
        // Refused by name, with the words --ml uses.
        let e = err(&format!("{ml}ml = {{ margin = 1.2 }}\n{MIN}"));
        assert!(
            e.contains("ml.margin must be between 0.5 and 0.99, got 1.2"),
            "{e}"
        );
        let e = err(&format!(
            "{ml}ml = {{ margin = 0.7, explore_step = 0.1 }}\n{MIN}"
        ));
        assert!(e.contains("ml.explore_below"), "{e}");
        let e = err(&format!("{ml}ml = {{ margins = 0.95 }}\n{MIN}"));
        assert!(e.contains("ml.margins is not a tunable"), "{e}");
        let e = err(&format!("{ml}ml = {{ z_limit = 9.0 }}\n{MIN}"));
        assert!(e.contains("ml.z_limit is not a tunable"), "{e}");
        let e = err(&format!("{ml}ml = {{ shrink_after = 2.5 }}\n{MIN}"));
        assert!(e.contains("ml.shrink_after must be a whole number"), "{e}");
        let e = err(&format!("{ml}ml = {{ margin = \"high\" }}\n{MIN}"));
        assert!(e.contains("high"), "{e}");
        // Beside another policy the table would do nothing: refused.
        let e = err(&format!(
            "policy = \"parties\"\nml = {{ margin = 0.95 }}\n{MIN}"
        ));
        assert!(
            e.contains("ml holds the tunables of policy = \"ml\"") && e.contains("\"parties\""),
            "{e}"
        );
    }
}
