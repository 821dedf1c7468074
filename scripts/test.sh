#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit and integration tests (real
# etcd, real sockets), the end-to-end suite (real llama-server nodes, the
# OpenAI Python client), the quickstart run end to end, and the container
# image's profile-optimised build of the data plane (scripts/pgo.sh).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# Each stage is named with the time it starts at, so a slow run shows
# where its time went.
started=$SECONDS
stage() {
  local at=$((SECONDS - started))
  printf '== [%d:%02d] %s\n' $((at / 60)) $((at % 60)) "$*" >&2
}

stage "dependencies"
"$root/scripts/deps.sh" test
stage "cargo fmt"
cargo fmt --all --check
stage "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
stage "unit and integration tests"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi
stage "fuzz: the request scanner, the upload form reader, the SSE tail, the snapshot decoder"
FUZZ_SECONDS=${FUZZ_SECONDS:-60} "$root/scripts/fuzz.sh"
stage "end to end: real llama-server nodes, the OpenAI client"
"$root/scripts/e2e.sh"
stage "quickstart"
"$root/scripts/smoke-quickstart.sh"
stage "the profile-optimised build: the image's recipe, on a small training load"
# Its training fleet runs on the debug binaries the end-to-end suite built:
# only the optimised data plane is built in release. Each of its two
# builds compiles every dependency anew (the profile is in the flags), and
# without the release profile's fat LTO across crates they take about
# 3 minutes less on 2 cores: the check proves the recipe (instrument,
# train, merge, build with the profile, serve), which the image's build
# then runs with the release profile whole.
target="${CARGO_TARGET_DIR:-$root/target}"
CARGO_PROFILE_RELEASE_LTO=off CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 PGO_DIR="$target/pgo-check" \
  "$root/scripts/pgo.sh" --packages dataplane --requests 300 --check --plain "$target/debug"
stage "done"
