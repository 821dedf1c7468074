#!/usr/bin/env bash
# Runs the README's quickstart (scripts/fleet.sh) as a user would, checks
# that it serves the OpenAI API on 127.0.0.1:8080, and that it stops cleanly.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=$(mktemp)
INFERYES_PROFILE=${INFERYES_PROFILE:-debug} ./scripts/fleet.sh >"$out" 2>&1 &
fleet=$!

fail() {
  echo "quickstart smoke test FAILED: $1" >&2
  echo "--- fleet.sh output:" >&2; cat "$out" >&2
  for f in .fleet/logs/*.log; do echo "--- $f (tail)" >&2; tail -20 "$f" >&2; done
  kill -TERM "$fleet" 2>/dev/null || true
  wait "$fleet" 2>/dev/null || true
  exit 1
}

for _ in $(seq 1 900); do
  grep -q "Ctrl-C stops the fleet" "$out" && break
  kill -0 "$fleet" 2>/dev/null || fail "fleet.sh exited early"
  sleep 0.2
done
grep -q "Ctrl-C stops the fleet" "$out" || fail "the fleet did not come up"

models=$(curl -fsS http://127.0.0.1:8080/v1/models) || fail "/v1/models"
for id in qwen2.5-7b-instruct llama-3.1-8b-instruct nomic-embed-text; do
  grep -q "\"$id\"" <<<"$models" || fail "/v1/models lacks $id: $models"
done

headers=$(mktemp)
reply=$(curl -fsS -D "$headers" http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \
  -H 'x-session-id: smoke' \
  -d '{"model":"qwen2.5-7b-instruct","messages":[{"role":"user","content":"hello"}],"max_tokens":4}') || fail "chat"
grep -q '"chat.completion"' <<<"$reply" || fail "chat reply: $reply"
grep -qi '^x-inferyes-node: gpu-' "$headers" || fail "no x-inferyes-node header"

stream=$(curl -fsS -N http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \
  -d '{"model":"qwen2.5-7b-instruct","stream":true,"messages":[{"role":"user","content":"hi"}],"max_tokens":4}') || fail "stream"
grep -q 'data: \[DONE\]' <<<"$stream" || fail "stream did not end with [DONE]: $stream"

embed=$(curl -fsS http://127.0.0.1:8080/v1/embeddings -H 'content-type: application/json' \
  -d '{"model":"nomic-embed-text","input":"hello"}') || fail "embeddings"
grep -q '"embedding"' <<<"$embed" || fail "embeddings reply: $embed"

kill -TERM "$fleet"
status=0
wait "$fleet" || status=$?
[ "$status" -eq 0 ] || fail "fleet.sh exited with $status on SIGTERM"
if curl -fsS -o /dev/null http://127.0.0.1:8080/healthz 2>/dev/null; then
  fail "the data plane still answers after the fleet stopped"
fi
pgrep -f "deploy/local/" >/dev/null && fail "fleet processes left behind: $(pgrep -af deploy/local/)"
echo "quickstart smoke test: 1 passed, 0 failed"
