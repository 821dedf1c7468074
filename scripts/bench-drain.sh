#!/usr/bin/env bash
# The real-model drain benchmark (tests/e2e/bench_drain.py): conversations
# with long histories on one of three llama-server nodes serving Gemma 3
# 270M, the node drained with their caches moved and without, side by
# side. Builds the release binaries, llama-server and the Python
# environment once; fetches the model once. Arguments go to
# bench_drain.py (--help lists them).
#
#   ./scripts/bench-drain.sh                                  # 6 conversations of ~1,500 tokens
#   ./scripts/bench-drain.sh --conversations 12 --slots 8
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
"$root/scripts/deps.sh" real
llama=$("$root/scripts/llama-server.sh")
gguf=$("$root/scripts/real-model.sh")
venv=$("$root/scripts/venv.sh")
cargo build --release --bins --locked --quiet
INFERYES_BIN_DIR="${CARGO_TARGET_DIR:-$root/target}/release" INFERYES_LLAMA_SERVER="$llama" \
  INFERYES_REAL_MODEL="$gguf" "$venv/bin/python" tests/e2e/bench_drain.py "$@"
