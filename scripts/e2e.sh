#!/usr/bin/env bash
# The Python suites: end to end (real llama-server nodes with tiny generated
# models behind the real Inferyes binaries, driven by the official OpenAI
# Python client) and the deployment checks (Kubernetes manifests against the
# API schemas, compose, systemd, example configs, the configuration
# reference against the code). llama-server and the Python environment are
# built once and cached outside the clone, keyed by version.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
"$root/scripts/deps.sh" test

llama=$("$root/scripts/llama-server.sh")
cache=${INFERYES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/inferyes}
venv="$cache/venv-$(sha256sum tests/e2e/requirements.txt | cut -c1-16)"
if [ ! -x "$venv/bin/pytest" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r tests/e2e/requirements.txt
fi

cargo build --bins --locked --quiet
INFERYES_LLAMA_SERVER="$llama" "$venv/bin/python" -m pytest -p no:cacheprovider -q tests/e2e tests/deploy "$@"
