//! The foreign scenarios in `lab/scenarios/foreign/` lie outside what the training data
//! generator draws (issue 45): each has a host parameter or a service parameter that
//! `cohabit_training::drawn` says the generator never draws, so `ml` is judged there on a
//! host it was not trained on.

use std::path::PathBuf;

use cohabit_sim::Scenario;
use cohabit_training::drawn::foreign_parameters;

fn foreign_scenarios() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../lab/scenarios/foreign");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    files
}

#[test]
fn each_foreign_scenario_has_a_parameter_the_generator_never_draws() {
    let files = foreign_scenarios();
    assert!((3..=6).contains(&files.len()), "{files:?}");
    for path in files {
        let sc = Scenario::load(path.to_str().unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let foreign = foreign_parameters(&sc);
        assert!(
            !foreign.is_empty(),
            "{}: every parameter lies within the generator's ranges",
            path.display()
        );
        // No built-in scenario is among them: each is a scenario file of its own.
        assert!(cohabit_sim::scenario::builtin_names().all(|n| n != sc.name));
    }
}
