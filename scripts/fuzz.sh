#!/usr/bin/env bash
# The fuzz campaign: each target in fuzz/ (the request scanner, the SSE
# tail reader, the snapshot decoder) for a bounded time, from its seeds
# (fuzz/seeds/<target>) and every input kept from an earlier crash
# (fuzz/regressions/<target>), which run first. A crash fails the run and
# libFuzzer writes its input to fuzz/artifacts/<target>/: once it is fixed,
# keep that file in fuzz/regressions/<target>/.
#
#   ./scripts/fuzz.sh                  # 60 s per target
#   FUZZ_SECONDS=600 ./scripts/fuzz.sh request_scanner
#
# Needs the nightly toolchain and cargo-fuzz (sanitizers are nightly's);
# installs either where missing.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/fuzz"
seconds=${FUZZ_SECONDS:-60}

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install --locked cargo-fuzz
fi
# Apart from the stable build's: another compiler, other flags.
target_dir=${CARGO_TARGET_DIR:+$CARGO_TARGET_DIR/fuzz}
target_dir=${target_dir:-$root/fuzz/target}

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi
cargo +nightly fuzz build --target-dir "$target_dir" >/dev/null
for target in "${targets[@]}"; do
  corpus=$(mktemp -d)
  inputs=("$corpus")
  for kept in "seeds/$target" "regressions/$target"; do
    [ -d "$kept" ] && inputs+=("$kept")
  done
  echo "== fuzz $target (${seconds}s)" >&2
  set +e
  cargo +nightly fuzz run --target-dir "$target_dir" "$target" "${inputs[@]}" -- \
    -max_total_time="$seconds" >"$corpus.log" 2>&1
  status=$?
  set -e
  grep -E '^(#[0-9]+ +DONE|Done)' "$corpus.log" >&2 || true
  if [ $status -ne 0 ]; then
    grep -E -A30 'panicked|ERROR: |SUMMARY' "$corpus.log" | head -25 >&2 || tail -40 "$corpus.log" >&2
    echo "fuzz $target found an input that fails (exit $status): fuzz/artifacts/$target/" >&2
    exit 1
  fi
  rm -rf "$corpus" "$corpus.log"
done
