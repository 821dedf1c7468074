#!/usr/bin/env bash
# The real-model routing benchmark (tests/e2e/bench_chat.py): multi-turn
# chats on real llama-server nodes serving Gemma 3 270M, through a policy, a
# round-robin and a least-outstanding data plane side by side. Builds the
# release binaries, llama-server and the Python environment once; fetches
# the model once. Arguments go to bench_chat.py (--help lists them).
#
#   ./scripts/bench-chat.sh                                   # 7 conversations, one request at a time
#   ./scripts/bench-chat.sh --nodes 2 --conversations 16 --concurrent   # twice as many as slots
#   ./scripts/bench-chat.sh --nodes 2 --conversations 16 --concurrent --strategies policy,smg --repeat 5
#                                                             # against SMG 1.13, alternating which goes first
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
"$root/scripts/deps.sh" real
llama=$("$root/scripts/llama-server.sh")
gguf=$("$root/scripts/real-model.sh")
venv=$("$root/scripts/venv.sh")
# SMG, for its row beside Inferyes's (--strategies ...,smg), into the
# benchmark's environment only.
if [[ " $* " == *smg* ]] && [ ! -x "$venv/bin/smg" ]; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check smg==1.13.0 >&2
fi
cargo build --release --bins --locked --quiet
INFERYES_BIN_DIR="${CARGO_TARGET_DIR:-$root/target}/release" INFERYES_LLAMA_SERVER="$llama" \
  INFERYES_REAL_MODEL="$gguf" "$venv/bin/python" tests/e2e/bench_chat.py "$@"
