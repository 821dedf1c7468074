#!/usr/bin/env bash
# The data plane and the agent built with profile-guided optimisation, as
# the container image builds them: scripts/pgo.sh, the one recipe (see
# there). Measured on this project's machine: docs/performance.md.
#
#   ./scripts/build-pgo.sh              # binaries in target/pgo/use/release/
#   PGO_DIR=/tmp/pgo ./scripts/build-pgo.sh
#   ./scripts/build-pgo.sh --install-to DIR
#
# Then, side by side with the plain release build:
#   BIN=target/pgo/use/release ./scripts/bench-proxy.sh
set -euo pipefail
exec "$(dirname "$0")/pgo.sh" "$@"
