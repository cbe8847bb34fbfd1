#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every test of the workspace.
# Needs the Rust toolchain (cargo, rustfmt, clippy) and python3 with pip: the training crate
# links libtorch, which scripts/setup-libtorch.sh unpacks from PyPI once and caches.
set -euo pipefail
cd "$(dirname "$0")/.."
LIBTORCH="${LIBTORCH:-$(./scripts/setup-libtorch.sh)}"
export LIBTORCH
# The controller's `kubernetes` feature (the node agent, off in a plain `cargo build`) is on,
# as in the Debian package and the image: the lints and tests cover the full daemon.
features=(--features cohabit-controller/kubernetes)
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked "${features[@]}" -- -D warnings
# Each test that skips (root, a program, a machine fact it lacks) appends a line to this file
# (cohabit-testkit); the summary below says how many skipped and why. A variable the caller
# set is kept, so CI can keep the file.
if [ -z "${COHABIT_SKIP_LOG:-}" ]; then
    COHABIT_SKIP_LOG="$(mktemp -t cohabit-skips.XXXXXX)"
    trap 'rm -f "$COHABIT_SKIP_LOG"' EXIT
fi
export COHABIT_SKIP_LOG
: >"$COHABIT_SKIP_LOG"
# The daemon and the trainer as the Debian packages hold them, built once: the real-services
# tests run these (REALBENCH_COHABIT, REALBENCH_COHABIT_TRAIN) instead of building their own
# with other features, and scripts/build-deb.sh, with the same command, then builds nothing.
# Each differently featured build is another copy of most dependencies on disk.
cargo build --locked "${features[@]}" -p cohabit-controller --bin cohabit \
    -p cohabit-training --bin cohabit-train
bin_dir="$(cd "${CARGO_TARGET_DIR:-target}/debug" && pwd)"
export REALBENCH_COHABIT="${REALBENCH_COHABIT:-$bin_dir/cohabit}"
export REALBENCH_COHABIT_TRAIN="${REALBENCH_COHABIT_TRAIN:-$bin_dir/cohabit-train}"
status=0
cargo test --workspace --locked "${features[@]}" || status=$?
./scripts/skip-summary.sh "$COHABIT_SKIP_LOG"
# On CI (root, a disposable machine; .ci/run sets it): the packages and the image.
if [ "$status" = 0 ] && [ "${COHABIT_CHECK_PACKAGES:-}" = 1 ]; then
    ./scripts/check-package.sh || status=$?
fi
exit "$status"
