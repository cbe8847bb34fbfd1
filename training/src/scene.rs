//! What the simulator's two dataset generators share ([`crate::gen`] for the CPU model,
//! [`crate::gen_gpu`] for the GPU one): the loop over random scenes, the interval each scene
//! is simulated for under the plan in force, what the controller would have measured of it,
//! and the rows of a service scored under candidates by the simulator's truth.
//!
//! A generator says what differs as a [`SceneKind`]: the services of a scene and what its
//! host can measure, the plan in force, the readings beyond latency that may be missing, and
//! how its services' candidates are drawn and turned into features. Every draw comes from one
//! generator seeded once, in a fixed order, so a seed gives the same dataset on every run.

use std::sync::Arc;

use cohabit_core::{Plan, Sample, ServiceSpec};
use cohabit_models::target;
use cohabit_sim::catalogue::SimHost;
use cohabit_sim::host::measure;
use cohabit_sim::scenario::{Noise, Scenario, SimService, Telemetry};
use cohabit_sim::TruthModel;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::dataset::{Dataset, Row};

/// Probability that a latency-critical service has no latency reading in a scene's
/// interval (no request completed, the probe lost its window): its p99 and request rate are
/// absent, as they come from the same probe.
pub const LATENCY_MISSING: f64 = 0.05;

/// What a scene's host can measure and partition.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostKind {
    /// What it can measure.
    pub telemetry: Telemetry,
    /// Whether it has RDT allocation (CAT and MBA). Without it (no resctrl: most VMs) the
    /// scene runs on [`HostCapacity::without_allocation`] of the platform: every group
    /// shares the whole LLC as one way and memory bandwidth is never throttled, as the
    /// daemon sees such a host.
    ///
    /// [`HostCapacity::without_allocation`]: cohabit_core::HostCapacity::without_allocation
    pub allocation: bool,
}

impl HostKind {
    /// A host with everything: counters, RDT monitoring and allocation.
    pub const BARE_METAL: HostKind = HostKind {
        telemetry: Telemetry {
            counters: true,
            rdt_monitoring: true,
        },
        allocation: true,
    };

    /// The platform `host` as this kind of host presents it.
    fn host(&self, host: &SimHost) -> SimHost {
        if self.allocation {
            return host.clone();
        }
        SimHost {
            capacity: host.capacity.without_allocation(),
            ..host.clone()
        }
    }
}

/// What one kind of dataset draws for each scene, called in this order.
pub(crate) trait SceneKind {
    /// The scenario's name.
    const NAME: &'static str;

    /// The services of a scene, and the kind of host it runs on.
    fn services(&self, rng: &mut ChaCha8Rng) -> (Vec<SimService>, HostKind);

    /// The plan in force during the scene's interval.
    fn plan(&self, rng: &mut ChaCha8Rng, sc: &Scenario) -> Plan;

    /// Drops the readings beyond latency that the controller missed in the interval from one
    /// service's sample (called for each service, after its latency reading was drawn);
    /// none by default.
    fn drop_readings(&self, _rng: &mut ChaCha8Rng, _spec: &ServiceSpec, _sample: &mut Sample) {}

    /// The rows of a scene: its services scored under candidates ([`Scene::score`]).
    fn rows(&self, rng: &mut ChaCha8Rng, scene: &Scene, rows: &mut Vec<Row>);
}

/// One simulated scene: a mix of services on the host, the plan in force, and what the
/// controller measured during one interval under it.
#[derive(Debug)]
pub(crate) struct Scene {
    /// The mix.
    pub(crate) sc: Arc<Scenario>,
    /// Its noise-free physics, for the candidates' outcomes.
    pub(crate) truth: TruthModel,
    /// The plan in force.
    pub(crate) plan: Plan,
    /// Each service's load.
    pub(crate) loads: Vec<f64>,
    /// The MPS share each service ran with under the plan (`None`: not on a GPU).
    pub(crate) shares: Vec<Option<u8>>,
    /// What the controller measured of each service, missing readings dropped.
    pub(crate) samples: Vec<Sample>,
}

/// Generates a dataset of `scenes` scenes of `kind` on the platform `host` (each as its
/// scene's [`HostKind`] presents it) from `seed`; `progress` is called with (done, total)
/// scenes.
pub(crate) fn generate_scenes<K: SceneKind>(
    kind: &K,
    host: &SimHost,
    seed: u64,
    scenes: usize,
    mut progress: impl FnMut(usize, usize),
) -> Dataset {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut rows = Vec::new();
    for done in 0..scenes {
        let (services, host_kind) = kind.services(&mut rng);
        let sc = Arc::new(Scenario {
            name: K::NAME.into(),
            description: String::new(),
            duration_s: 1.0,
            tick_ms: 1000,
            seed,
            host: host_kind.host(host),
            host_section: cohabit_sim::scenario::HostSection::default(),
            services,
            noise: Noise::default(),
            telemetry: host_kind.telemetry,
        });
        let scene = Scene::simulate(&mut rng, kind, sc);
        kind.rows(&mut rng, &scene, &mut rows);
        progress(done + 1, scenes);
    }
    Dataset { rows }
}

impl Scene {
    /// Simulates one interval of `sc` under the plan `kind` draws, at half of the trace
    /// (constant loads), and measures it as the controller would: noisy samples with what the
    /// host cannot measure stripped, a latency reading missing with probability
    /// [`LATENCY_MISSING`], and whatever else `kind` drops.
    fn simulate(rng: &mut ChaCha8Rng, kind: &impl SceneKind, sc: Arc<Scenario>) -> Scene {
        let truth = TruthModel::new(Arc::clone(&sc));
        let plan = kind.plan(rng, &sc);
        let loads = truth.loads_at(0.5);
        let shares = truth.gpu_shares(&plan);
        let (now, _) = truth.evaluate(&plan, &loads, &shares, &vec![0.0; loads.len()]);
        let mut samples: Vec<Sample> = now
            .outcomes
            .iter()
            .zip(&loads)
            .map(|(o, l)| sc.telemetry.strip(measure(rng, o, *l, &sc.noise, 1.0)))
            .collect();
        for (s, svc) in samples.iter_mut().zip(&sc.services) {
            if svc.spec.is_latency_critical() && rng.gen_bool(LATENCY_MISSING) {
                s.p99_ms = None;
                s.requests_per_s = None;
            }
            kind.drop_readings(rng, &svc.spec, s);
        }
        Scene {
            sc,
            truth,
            plan,
            loads,
            shares,
            samples,
        }
    }

    /// Adds the rows of service `i` (p99 target `target_ms`) under `candidates` candidates:
    /// `candidate` draws one, writes it into the copy of the plan in force it is given, and
    /// returns the service's features under it. A row's target is ln(p99 / target) of the
    /// service under that plan, its MPS clients running with their new shares; a candidate
    /// the truth gives no p99 for gives no row.
    // Targets are O(1) log-ratios; f32 is the model's precision.
    #[allow(clippy::cast_possible_truncation)]
    pub(crate) fn score(
        &self,
        rng: &mut ChaCha8Rng,
        i: usize,
        target_ms: f64,
        candidates: usize,
        rows: &mut Vec<Row>,
        mut candidate: impl FnMut(&mut ChaCha8Rng, &mut Plan) -> Vec<f32>,
    ) {
        let service = catalogue_name(&self.sc.services[i].spec.name);
        let zeros = vec![0.0; self.loads.len()];
        for _ in 0..candidates {
            let mut plan = self.plan.clone();
            let features = candidate(rng, &mut plan);
            let shares = self.truth.gpu_shares(&plan);
            let (after, _) = self.truth.evaluate(&plan, &self.loads, &shares, &zeros);
            let Some(y) = after.outcomes[i].p99_ms.and_then(|p| target(p, target_ms)) else {
                continue;
            };
            rows.push(Row {
                service: service.clone(),
                features,
                target: y as f32,
            });
        }
    }
}

/// The catalogue model a scene's service runs: its name up to the `#` that numbers it.
fn catalogue_name(service: &str) -> String {
    service.split('#').next().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_is_named_by_its_catalogue_model() {
        assert_eq!(catalogue_name("img-dnn#1"), "img-dnn");
        assert_eq!(catalogue_name("gpu-train#be"), "gpu-train");
        assert_eq!(catalogue_name("plain"), "plain");
    }
}
