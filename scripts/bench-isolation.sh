#!/usr/bin/env bash
# The real-model isolation benchmark (tests/e2e/bench_isolation.py): one
# tenant floods real llama-server nodes serving Gemma 3 270M, another sends
# one short chat at a time, through a data plane with its queue on and one
# with it off. Builds the release binaries, llama-server and the Python
# environment once; fetches the model once. Arguments go to
# bench_isolation.py (--help lists them).
#
#   ./scripts/bench-isolation.sh                       # 2 nodes x 2 slots, 16 streams, 60 s
#   ./scripts/bench-isolation.sh --streams 32 --seconds 120
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
"$root/scripts/deps.sh" real
llama=$("$root/scripts/llama-server.sh")
gguf=$("$root/scripts/real-model.sh")
venv=$("$root/scripts/venv.sh")
cargo build --release --bins --locked --quiet
INFERYES_BIN_DIR="${CARGO_TARGET_DIR:-$root/target}/release" INFERYES_LLAMA_SERVER="$llama" \
  INFERYES_REAL_MODEL="$gguf" "$venv/bin/python" tests/e2e/bench_isolation.py "$@"
