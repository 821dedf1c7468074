#!/usr/bin/env bash
# Provides the Python environment of the end-to-end suite and the real-model
# benchmark (tests/e2e/requirements.txt) and prints its path. Made once and
# cached outside the clone, keyed by the requirements' hash.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cache=${INFERYES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/inferyes}
venv="$cache/venv-$(sha256sum "$root/tests/e2e/requirements.txt" | cut -c1-16)"
if [ ! -x "$venv/bin/pytest" ]; then
  "$root/scripts/deps.sh" python
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$root/tests/e2e/requirements.txt" >&2
fi
echo "$venv"
