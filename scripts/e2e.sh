#!/usr/bin/env bash
# The Python suites: end to end (real llama-server nodes with tiny generated
# models, and with the real Gemma 3 270M, behind the real Inferyes binaries,
# driven by the official OpenAI Python client) and the deployment checks
# (Kubernetes manifests against the API schemas, compose, systemd, example
# configs, the configuration reference against the code, scripts/deps.sh).
# llama-server, the model and the Python environment are made once and
# cached outside the clone, keyed by version.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
"$root/scripts/deps.sh" test

# The agents these suites start refuse to save or take a conversation's
# slot with less than 4 GiB free where they keep it (moves.min_free_bytes,
# here the temporary directory): on a fuller disk the move and KV tier
# tests would fail without saying why.
tmp=${TMPDIR:-/tmp}
free_kib=$(df -Pk "$tmp" | awk 'NR == 2 { print $4 }')
if [ "$free_kib" -lt $((5 * 1024 * 1024)) ]; then
  echo "e2e: $tmp has $((free_kib / 1024)) MiB free; the agents need 4 GiB to move and keep conversations' caches," \
    "and the suites 1 GiB more: free some space (or set TMPDIR) and run again" >&2
  exit 1
fi

llama=$("$root/scripts/llama-server.sh")
gguf=$("$root/scripts/real-model.sh")
venv=$("$root/scripts/venv.sh")

# With the examples, the dev-dependencies' features count as they do for
# the tests (criterion turns on serde's `alloc`): the binaries then link
# against the libraries the test build made, not a second build of them.
cargo build --workspace --bins --examples --locked --quiet
INFERYES_LLAMA_SERVER="$llama" INFERYES_REAL_MODEL="$gguf" "$venv/bin/python" -m pytest -p no:cacheprovider -q tests/e2e tests/deploy "$@"
