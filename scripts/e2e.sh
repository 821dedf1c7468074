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

llama=$("$root/scripts/llama-server.sh")
gguf=$("$root/scripts/real-model.sh")
venv=$("$root/scripts/venv.sh")

# With the examples, the dev-dependencies' features count as they do for
# the tests (criterion turns on serde's `alloc`): the binaries then link
# against the libraries the test build made, not a second build of them.
cargo build --workspace --bins --examples --locked --quiet
INFERYES_LLAMA_SERVER="$llama" INFERYES_REAL_MODEL="$gguf" "$venv/bin/python" -m pytest -p no:cacheprovider -q tests/e2e tests/deploy "$@"
