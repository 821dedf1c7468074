#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit and integration tests (real
# etcd, real sockets), the end-to-end suite (real llama-server nodes, the
# OpenAI Python client), the quickstart run end to end, and the container
# image's profile-optimised build of the data plane (scripts/pgo.sh).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
"$root/scripts/deps.sh" test

echo "== cargo fmt" >&2
cargo fmt --all --check
echo "== cargo clippy" >&2
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== unit and integration tests" >&2
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi
echo "== fuzz: the request scanner, the upload form reader, the SSE tail, the snapshot decoder" >&2
FUZZ_SECONDS=${FUZZ_SECONDS:-60} "$root/scripts/fuzz.sh"
echo "== end to end: real llama-server nodes, the OpenAI client" >&2
"$root/scripts/e2e.sh"
echo "== quickstart" >&2
"$root/scripts/smoke-quickstart.sh"
echo "== the profile-optimised build: the image's recipe, on a small training load" >&2
# Its training fleet runs on the debug binaries the end-to-end suite built:
# only the optimised data plane is built in release.
target="${CARGO_TARGET_DIR:-$root/target}"
PGO_DIR="$target/pgo-check" "$root/scripts/pgo.sh" --packages dataplane --requests 300 --check --plain "$target/debug"
