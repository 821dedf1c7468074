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

# The official SDKs as a new user points them at the fleet: Anthropic's
# streams a two-turn conversation and counts its tokens; OpenAI's asks for
# a chat and a Responses answer; then every streaming helper of both.
venv=$("$root/scripts/venv.sh")
"$venv/bin/python" - <<'PY' || fail "the Anthropic and OpenAI SDKs"
import anthropic
import openai

model = "qwen2.5-7b-instruct"
claude = anthropic.Anthropic(base_url="http://127.0.0.1:8080", api_key="none", max_retries=0, timeout=60)
conversation = [{"role": "user", "content": "hello"}]
for _ in range(2):
    with claude.messages.stream(model=model, max_tokens=8, messages=conversation) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason == "max_tokens", final
    assert final.usage.output_tokens == 8, final.usage
    conversation += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]
assert claude.messages.count_tokens(model=model, messages=conversation).input_tokens > 0

client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none", max_retries=0, timeout=60)
chat = client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
assert chat.choices[0].message.content, chat
response = client.responses.create(model=model, max_output_tokens=4, input="hi")
assert response.output_text and response.usage.output_tokens == 4, response
PY
"$venv/bin/python" tests/e2e/sdk_helpers.py http://127.0.0.1:8080 qwen2.5-7b-instruct || fail "the SDKs' streaming helpers"

embed=$(curl -fsS http://127.0.0.1:8080/v1/embeddings -H 'content-type: application/json' \
  -d '{"model":"nomic-embed-text","input":"hello"}') || fail "embeddings"
grep -q '"embedding"' <<<"$embed" || fail "embeddings reply: $embed"

# The commands the printout gives for the fleet, run as printed: reading
# the fleet, explaining the last request, draining a node.
printed=$(sed -n '/^  # The fleet/,/^Logs in/p' "$out" | grep -v '^Logs in' | sed 's/^  //')
grep -q "inferyesctl explain" <<<"$printed" || fail "no inferyesctl commands in the printout"
said=$(bash -euo pipefail -c "$printed" 2>&1) || fail "the printed inferyesctl commands: $said"
grep -q '^gpu-a' <<<"$said" || fail "inferyesctl nodes lists no gpu-a: $said"
grep -q '^why: ' <<<"$said" || fail "inferyesctl explain says no why: $said"
grep -q 'node gpu-a draining' <<<"$said" || fail "inferyesctl drain: $said"

kill -TERM "$fleet"
status=0
wait "$fleet" || status=$?
[ "$status" -eq 0 ] || fail "fleet.sh exited with $status on SIGTERM"
if curl -fsS -o /dev/null http://127.0.0.1:8080/healthz 2>/dev/null; then
  fail "the data plane still answers after the fleet stopped"
fi
pgrep -f "deploy/local/" >/dev/null && fail "fleet processes left behind: $(pgrep -af deploy/local/)"
echo "quickstart smoke test: 1 passed, 0 failed"
