#!/usr/bin/env bash
# The whole test suite: formatting, lints, and every test of the workspace.
# Needs only the Rust toolchain (cargo, rustfmt, clippy).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
