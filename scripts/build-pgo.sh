#!/usr/bin/env bash
# The data plane and the agent built with profile-guided optimisation: an
# instrumented build is run through the proxy benchmark's traffic (JSON and
# streamed answers, one and 32 connections, each proxy alone and the two
# together), and the release build then lays its code out by what ran.
# Measured on this project's machine: 17-19% less CPU per request at 32
# connections, 20-40 µs less p50 at one (docs/performance.md, round seven).
# About 13 minutes on 2 cores.
#
#   ./scripts/build-pgo.sh              # binaries in target/pgo/use/release/
#   PGO_DIR=/tmp/pgo ./scripts/build-pgo.sh
#
# Needs the llvm-profdata of rustc's own LLVM (Debian's llvm-NN, installed
# when missing) and what scripts/bench-proxy.sh needs.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dir=${PGO_DIR:-$root/target/pgo}
llvm=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
profdata=llvm-profdata-$llvm
if ! command -v "$profdata" >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "llvm-$llvm" >/dev/null
fi
packages=(-p inferyes-dataplane -p inferyes-agent)

echo "== instrumented build"
CARGO_TARGET_DIR="$dir/generate" RUSTFLAGS="-Cprofile-generate=$dir/profiles" \
  cargo build --release --bins -q "${packages[@]}"
# Build scripts ran instrumented too: only the proxies' runs are kept.
rm -rf "$dir/profiles"

echo "== training: the proxy benchmark through the instrumented build"
BASELINE="$dir/generate/release" FLEET=0 DURATION=${DURATION:-3s} ./scripts/bench-proxy.sh >"$dir/training.txt"
shopt -s nullglob
profiles=("$dir"/profiles/*.profraw)
if [ ${#profiles[@]} -eq 0 ]; then
  echo "the instrumented proxies wrote no profile" >&2
  exit 1
fi
"$profdata" merge -o "$dir/merged.profdata" "${profiles[@]}"

echo "== optimised build"
CARGO_TARGET_DIR="$dir/use" RUSTFLAGS="-Cprofile-use=$dir/merged.profdata" \
  cargo build --release --bins -q "${packages[@]}"
echo "data plane and agent: $dir/use/release/inferyes-dataplane, $dir/use/release/inferyes-agent"
echo "compare: BASELINE=$dir/use/release ./scripts/bench-proxy.sh   (the @base rows)"
