#!/usr/bin/env bash
# The fuzz campaign: each target in fuzz/ (the request scanner, the upload
# form reader, the SSE tail reader, the snapshot decoder) for a bounded
# time, from its seeds
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
if ! cargo fuzz --version 2>/dev/null | grep -q '^cargo-fuzz 0\.13\.'; then
  cargo install --locked cargo-fuzz --version '~0.13'
fi
# Apart from the stable build's: another compiler, other flags.
target_dir=${CARGO_TARGET_DIR:+$CARGO_TARGET_DIR/fuzz}
target_dir=${target_dir:-$root/fuzz/target}

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  listed=$(cargo +nightly fuzz list)
  mapfile -t targets <<<"$listed"
fi
if [ ${#targets[@]} -eq 0 ] || [ -z "${targets[0]}" ]; then
  echo "no fuzz targets in fuzz/" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cargo +nightly fuzz build --target-dir "$target_dir" >/dev/null
# One target a core at once: each fuzzes as long, the run takes a share.
run_target() {
  local target=$1 corpus="$work/$1" log="$work/$1.log" status
  mkdir -p "$corpus"
  local inputs=("$corpus")
  for kept in "seeds/$target" "regressions/$target"; do
    [ -d "$kept" ] && inputs+=("$kept")
  done
  set +e
  cargo +nightly fuzz run --target-dir "$target_dir" "$target" "${inputs[@]}" -- \
    -max_total_time="$seconds" >"$log" 2>&1
  status=$?
  set -e
  echo "$status" >"$work/$target.status"
}
jobs=$(nproc)
running=0
for target in "${targets[@]}"; do
  echo "== fuzz $target (${seconds}s)" >&2
  run_target "$target" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n
    running=$((running - 1))
  fi
done
wait
failed=0
for target in "${targets[@]}"; do
  log="$work/$target.log"
  status=$(cat "$work/$target.status")
  echo "== $target" >&2
  grep -E '^(#[0-9]+ +DONE|Done)' "$log" >&2 || true
  if [ "$status" -ne 0 ]; then
    if grep -q 'Test unit written to' "$log"; then
      grep -E -A30 'panicked|ERROR: |SUMMARY' "$log" | head -25 >&2 || true
      grep 'Test unit written to' "$log" >&2
      echo "fuzz $target found an input that fails (exit $status)" >&2
    else
      tail -40 "$log" >&2
      echo "fuzz $target did not run (exit $status)" >&2
    fi
    failed=1
  fi
done
exit "$failed"
