#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every test of the workspace.
# Needs the Rust toolchain (cargo, rustfmt, clippy) and python3 with pip: the training crate
# links libtorch, which scripts/setup-libtorch.sh unpacks from PyPI once and caches.
set -euo pipefail
cd "$(dirname "$0")/.."
LIBTORCH="${LIBTORCH:-$(./scripts/setup-libtorch.sh)}"
export LIBTORCH
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
# On CI (root, a disposable machine; .ci/run sets it): the packages and the image.
if [ "${COHABIT_CHECK_PACKAGES:-}" = 1 ]; then
    ./scripts/check-package.sh
fi
