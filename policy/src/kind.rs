//! The policies a host can run, by name, and the one place they are built.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use cohabit_models::Model;

use crate::{
    CliteConfig, ClitePolicy, HostContext, MlConfig, MlPolicy, PartiesConfig, PartiesPolicy,
    Policy, StaticPolicy,
};

/// The policies that can drive a host (real or simulated). The lab's oracle is not one of
/// them: it needs the simulator's ground truth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PolicyKind {
    /// Fair share, never changed.
    Static,
    /// The PARTIES feedback controller.
    Parties,
    /// CLITE's Bayesian optimisation of the whole host's allocation, sampled on the host.
    Clite,
    /// Model-predictive allocation.
    Ml,
}

/// Why a policy could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// `ml` was asked for without a model.
    #[error("policy ml needs a model")]
    NoModel,
    /// `ml`'s GPU model is of another feature schema than the GPU services' one (schemas
    /// as `<name>-v<version>`).
    #[error("policy ml: the GPU model must be of feature schema {expected}, got {got}")]
    GpuModelSchema {
        /// The schema the GPU services' shares are planned with (`qos-gpu-v1`).
        expected: String,
        /// The given model's.
        got: String,
    },
}

impl PolicyKind {
    /// Every policy, in the order comparisons print them.
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::Static,
        PolicyKind::Parties,
        PolicyKind::Clite,
        PolicyKind::Ml,
    ];

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Static => "static",
            PolicyKind::Parties => "parties",
            PolicyKind::Clite => "clite",
            PolicyKind::Ml => "ml",
        }
    }

    /// Builds the policy for `ctx` with default settings; `ml` needs `model`.
    pub fn build(
        self,
        ctx: HostContext,
        model: Option<Arc<Model>>,
    ) -> Result<Box<dyn Policy>, BuildError> {
        self.build_with_gpu(ctx, model, None, MlConfig::default())
    }

    /// [`PolicyKind::build`], and `ml` with the tunables `ml` and with `gpu_model` (schema
    /// `qos-gpu`) for the GPU services' shares when one is given ([`PolicyKind::build_ml`]).
    /// The other policies use no model and their default settings.
    pub fn build_with_gpu(
        self,
        ctx: HostContext,
        model: Option<Arc<Model>>,
        gpu_model: Option<Arc<Model>>,
        ml: MlConfig,
    ) -> Result<Box<dyn Policy>, BuildError> {
        Ok(match self {
            PolicyKind::Static => Box::new(StaticPolicy::new(ctx)),
            PolicyKind::Parties => Box::new(PartiesPolicy::new(ctx, PartiesConfig::default())),
            PolicyKind::Clite => Box::new(ClitePolicy::new(ctx, CliteConfig::default())),
            PolicyKind::Ml => Box::new(Self::build_ml(ctx, model, gpu_model, ml)?),
        })
    }

    /// The tunables this policy runs with that an operator moved from their defaults, given
    /// `ml`'s (the only policy with operator tunables; empty for the others): what a
    /// decision log's header records ([`cohabit_core::LogHeader::with_tunables`]).
    pub fn moved_tunables(self, ml: &MlConfig) -> Vec<(&'static str, f64)> {
        match self {
            PolicyKind::Ml => ml.moved_tunables(),
            PolicyKind::Static | PolicyKind::Parties | PolicyKind::Clite => Vec::new(),
        }
    }

    /// `ml` for `ctx` with `model` (required), the tunables `cfg` and, when one is given,
    /// `gpu_model` for the GPU services' shares ([`MlPolicy::with_gpu_model`]; a model of
    /// another schema is refused).
    pub fn build_ml(
        ctx: HostContext,
        model: Option<Arc<Model>>,
        gpu_model: Option<Arc<Model>>,
        cfg: MlConfig,
    ) -> Result<MlPolicy, BuildError> {
        let ml = MlPolicy::new(ctx, model.ok_or(BuildError::NoModel)?, cfg);
        match gpu_model {
            Some(gpu) => ml.with_gpu_model(gpu),
            None => Ok(ml),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        PolicyKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = PolicyKind::ALL.iter().map(|p| p.name()).collect();
                format!("unknown policy {s:?}; choose from {}", names.join(", "))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_choices() {
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>().unwrap(), k);
        }
        let e = "oracle".parse::<PolicyKind>().unwrap_err();
        assert!(
            e.contains("oracle") && e.contains("static, parties, clite, ml"),
            "{e}"
        );
    }

    #[test]
    fn ml_without_a_model_is_refused() {
        let ctx = crate::tests::ctx(2, true, false, 0);
        assert_eq!(
            PolicyKind::Ml.build(ctx, None).err(),
            Some(BuildError::NoModel)
        );
    }

    #[test]
    fn ml_takes_a_gpu_model_and_refuses_a_cpu_one_in_its_place() {
        let ctx = crate::tests::ctx(2, true, false, 0);
        let cpu = Arc::new(Model::synthetic(1, &[], 0));
        let gpu = Arc::new(Model::synthetic_schema(
            &cohabit_models::GPU_SCHEMA,
            1,
            &[],
            0,
        ));
        let e = PolicyKind::Ml
            .build_with_gpu(
                ctx.clone(),
                Some(Arc::clone(&cpu)),
                Some(Arc::clone(&cpu)),
                MlConfig::default(),
            )
            .err();
        assert!(
            matches!(&e, Some(BuildError::GpuModelSchema { expected, .. }) if expected == "qos-gpu-v1"),
            "{e:?}"
        );
        PolicyKind::Ml
            .build_with_gpu(
                ctx.clone(),
                Some(cpu),
                Some(Arc::clone(&gpu)),
                MlConfig::default(),
            )
            .unwrap();
        // The other policies use no model, a GPU one included.
        PolicyKind::Parties
            .build_with_gpu(ctx, None, Some(gpu), MlConfig::default())
            .unwrap();
    }

    #[test]
    fn only_ml_reports_moved_tunables() {
        let tuned = MlConfig {
            margin: 0.95,
            ..MlConfig::default()
        };
        assert_eq!(PolicyKind::Ml.moved_tunables(&tuned), [("margin", 0.95)]);
        assert!(PolicyKind::Ml
            .moved_tunables(&MlConfig::default())
            .is_empty());
        for other in [PolicyKind::Static, PolicyKind::Parties, PolicyKind::Clite] {
            assert!(other.moved_tunables(&tuned).is_empty(), "{other}");
        }
    }

    #[test]
    fn ml_runs_with_the_tunables_it_is_given() {
        let ctx = crate::tests::ctx(2, true, false, 0);
        let cpu = Arc::new(Model::synthetic(1, &[], 0));
        let cfg = MlConfig {
            margin: 0.95,
            shrink_after: 3,
            ..MlConfig::default()
        };
        let ml = PolicyKind::build_ml(ctx.clone(), Some(Arc::clone(&cpu)), None, cfg).unwrap();
        assert_eq!(ml.config(), &cfg);
        let ml = PolicyKind::build_ml(ctx, Some(cpu), None, MlConfig::default()).unwrap();
        assert_eq!(ml.config(), &MlConfig::default());
    }
}
