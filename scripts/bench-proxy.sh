#!/usr/bin/env bash
# Proxy overhead, side by side in one run: wrk against a fast fake backend
# (nginx serving fixed JSON and a fixed SSE body), directly, through an
# nginx reverse proxy (upstream keepalive; one worker, and a worker per
# core), through a bare hyper proxy (the stack's floor), through an
# Inferyes agent's proxy, through a data plane alone (to a node whose
# advertised proxy URL is the backend itself), the same with API keys
# checked, and through a data plane and an agent: the path requests take
# in a fleet. Then the data plane again, with 1,000 simulated agents
# joined. Reports req/s at 32 connections, latency percentiles at 1 and
# 32, the proxy's CPU per request, and its RSS.
#
#   ./scripts/bench-proxy.sh            # 5 s per run
#   DURATION=10s ./scripts/bench-proxy.sh
#   HOLD=1 ./scripts/bench-proxy.sh     # set up, print pids and wrk lines, wait (for profiling)
#   FLEET=0 ./scripts/bench-proxy.sh    # without the last part: the data plane with 1,000 more nodes
#   BIN=target/pgo/use/release ./scripts/bench-proxy.sh
#                                       # the data plane and agent of that directory (with
#                                       # BASELINE=target/release: the PGO build beside the plain one)
#   BASELINE=/path/to/earlier/release ./scripts/bench-proxy.sh
#                                       # adds rows for an earlier build's data plane and agent
#                                       # (and its floor, where the directory has a bare_proxy)
#   ROUNDS=3 ./scripts/bench-proxy.sh   # every row three times, apart in time, and each row's median
#   INSTRUCTIONS=1 ./scripts/bench-proxy.sh
#                                       # instead: user-space instructions per request (callgrind)
#   CALLGRIND_DIR=/tmp/cg INSTRUCTIONS=1 ./scripts/bench-proxy.sh
#                                       # and keep the profiles there (callgrind_annotate --inclusive=yes)
#   ONLY=dataplane INSTRUCTIONS=1 ./scripts/bench-proxy.sh
#                                       # count only the proxies whose name starts so
#   ONLY=nginx-auto,dp+keys ./scripts/bench-proxy.sh
#                                       # time only the rows whose name starts with one of these
#                                       # (the timed rows' names: dp+keys, not dataplane+keys)
#   KIND=sse INSTRUCTIONS=1 ./scripts/bench-proxy.sh
#                                       # count streamed completions, not JSON chat
#   HEADERS=openai ./scripts/bench-proxy.sh
#                                       # every request with the 17 headers the OpenAI Python
#                                       # client sends, not wrk's few
#   PROXY_CPUS=0-1 ./scripts/bench-proxy.sh
#                                       # on a machine with cores to spare: every proxy on
#                                       # these CPUs alone, wrk, the backend and the rest on
#                                       # the others (a proxy's rate is then its own CPU's)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
duration=${DURATION:-5s}
need=()
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v nginx >/dev/null 2>&1 || need+=(nginx-light)
[ "${INSTRUCTIONS:-}" != 1 ] || command -v valgrind >/dev/null 2>&1 || need+=(valgrind)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
"$root/scripts/deps.sh"
cargo build --release --bins -q
cargo build --release -q -p inferyes-net --example bare_proxy
fleet_size=${FLEET:-1000}
if [ "$fleet_size" -gt 0 ]; then
  # Simulated agents (the controller-scale harness's), joined later to route
  # with a fleet-sized snapshot.
  fleet_bin=$(cargo bench -q -p inferyes-tests --bench controller_scale --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "controller_scale":
        print(m["executable"])')
fi
plain="${CARGO_TARGET_DIR:-$root/target}/release"
# The data plane and agent measured: this tree's release build, or BIN's
# (e.g. the profile-optimised build, scripts/pgo.sh); the controller, ctl
# and the floor are always the release build's.
bin=${BIN:-$plain}

# Where processes run: with PROXY_CPUS, the proxies measured on those CPUs
# and everything else (this script's children inherit its affinity) on the
# rest, with a worker per proxy CPU for nginx, and the backend and wrk given
# enough workers not to be what limits the rate. Without it, all share all.
on_proxy=()
proxy_workers=auto backend_workers=1 wrk_threads=2
if [ -n "${PROXY_CPUS:-}" ]; then
  read -r rest proxy_count < <(python3 - "$PROXY_CPUS" <<'PY'
import os, sys
chosen = set()
try:
    for part in sys.argv[1].split(","):
        low, _, high = part.partition("-")
        chosen.update(range(int(low), int(high or low) + 1))
except ValueError:
    sys.exit(f"PROXY_CPUS={sys.argv[1]} is not a CPU list (0-1, 2,3)")
rest = sorted(os.sched_getaffinity(0) - chosen)
if not rest or not chosen <= os.sched_getaffinity(0):
    sys.exit(f"PROXY_CPUS={sys.argv[1]} must name some, not all, of CPUs {sorted(os.sched_getaffinity(0))}")
print(",".join(map(str, rest)), len(chosen))
PY
  )
  taskset -c -p "$rest" $$ >/dev/null
  on_proxy=(taskset -c "$PROXY_CPUS")
  proxy_workers=$proxy_count
  rest_count=$(tr , '\n' <<<"$rest" | wc -l)
  backend_workers=$(( rest_count / 2 > 4 ? 4 : (rest_count / 2 > 0 ? rest_count / 2 : 1) ))
  wrk_threads=$backend_workers
fi

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

# Free ports, none given before (into the variables named): the kernel may
# hand a closed probe's port out again, and two services on one port leave
# one of them dead.
given_ports=" "
port() {
  local var p
  for var in "$@"; do
    while :; do
      p=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
      [[ "$given_ports" == *" $p "* ]] || break
    done
    given_ports+="$p "
    printf -v "$var" %s "$p"
  done
}
port backend nginx_proxy etcd_client etcd_peer grpc http agent dataplane dataplane_admin direct_proxy
# Metrics and health on ports of their own, wherever: only the first data
# plane's are read (older builds have no admin port and ignore this).
export INFERYES_ADMIN_LISTEN=127.0.0.1:0

json='{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}'
# A stream as llama-server sends one: each event, the last too, ends with
# a blank line (printf -v keeps the trailing newlines that $(...) strips).
printf -v sse 'data: {"id":"cmpl-bench","object":"text_completion","choices":[{"index":0,"text":"hello","finish_reason":null}]}\n\ndata: {"id":"cmpl-bench","object":"text_completion","choices":[{"index":0,"text":" there","finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
# nginx processes of their own: the fake backend (one worker), and the
# reverse proxies compared with the data plane (so each one's CPU can be
# read apart).
mkdir -p "$work/nginx"
cat > "$work/nginx/nginx.conf" <<CONF
worker_processes $backend_workers;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $work/nginx/body;
  server {
    listen 127.0.0.1:$backend;
    location = /health { default_type application/json; return 200 '{"status":"ok"}'; }
    location = /v1/models { default_type application/json; return 200 '{"object":"list","data":[{"id":"bench"}]}'; }
    location = /v1/chat/completions { default_type application/json; return 200 '$json'; }
    location = /v1/completions { default_type text/event-stream; return 200 '$sse'; }
    location = /direct/health { default_type application/json; return 200 '{"status":"ok"}'; }
    location = /direct/v1/models { default_type application/json; return 200 '{"object":"list","data":[{"id":"bench-direct"}]}'; }
    location = /base/health { default_type application/json; return 200 '{"status":"ok"}'; }
    location = /base/v1/models { default_type application/json; return 200 '{"object":"list","data":[{"id":"bench-base"}]}'; }
    location = /base/v1/chat/completions { default_type application/json; return 200 '$json'; }
    location = /base/v1/completions { default_type text/event-stream; return 200 '$sse'; }
    location / { return 404; }
  }
}
CONF
# The reverse proxy twice: with one worker, and with a worker per core as
# the data plane and the agent have (nginx's `worker_processes auto`, the
# configuration Debian ships). The second is the like-for-like comparison.
port nginx_proxy_auto
for variant in nginx-proxy:1:$nginx_proxy nginx-proxy-auto:$proxy_workers:$nginx_proxy_auto; do
  IFS=: read -r dir workers listen <<<"$variant"
  mkdir -p "$work/$dir"
  cat > "$work/$dir/nginx.conf" <<CONF
worker_processes $workers;
pid $work/$dir/nginx.pid;
error_log $work/$dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $work/$dir/body;
  proxy_temp_path $work/$dir/proxy;
  upstream fake { server 127.0.0.1:$backend; keepalive 64; }
  server {
    listen 127.0.0.1:$listen;
    location / { proxy_pass http://fake; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; }
  }
}
CONF
done
nginx -c "$work/nginx/nginx.conf" -g 'daemon off;' & pids+=($!)
backend_pid=$!
"${on_proxy[@]}" nginx -c "$work/nginx-proxy/nginx.conf" -g 'daemon off;' & pids+=($!)
nginx_pid=$!
"${on_proxy[@]}" nginx -c "$work/nginx-proxy-auto/nginx.conf" -g 'daemon off;' & pids+=($!)
nginx_auto_pid=$!
# The floor: a proxy with nothing but the HTTP stack the data plane and the
# agent are built on (net/examples/bare_proxy.rs).
port bare
"${on_proxy[@]}" "$plain/examples/bare_proxy" "127.0.0.1:$bare" "http://127.0.0.1:$backend" >"$work/bare.log" 2>&1 & pids+=($!)
bare_pid=$!
base_bare=""
if [ -x "${BASELINE:-}/bare_proxy" ]; then
  port base_bare
  "${on_proxy[@]}" "$BASELINE/bare_proxy" "127.0.0.1:$base_bare" "http://127.0.0.1:$backend" >"$work/bare-base.log" 2>&1 & pids+=($!)
  base_bare_pid=$!
fi

etcd --name bench --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$etcd_client" \
  --advertise-client-urls "http://127.0.0.1:$etcd_client" --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
  --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" --initial-cluster "bench=http://127.0.0.1:$etcd_peer" \
  --auto-compaction-mode=periodic --auto-compaction-retention=5m --quota-backend-bytes=2147483648 \
  >"$work/etcd.log" 2>&1 & pids+=($!)
until curl -fsS "http://127.0.0.1:$etcd_client/health" >/dev/null 2>&1; do sleep 0.1; done

# The fleet's tokens, read by every component from the environment.
export INFERYES_ADMIN_TOKEN=bench-admin-token-0123456789 INFERYES_JOIN_TOKEN=bench-join-token-0123456789
# One token for agents and data planes, so that a BASELINE build (which has
# no token of the data planes' own) joins the same fleet.
export INFERYES_DATAPLANE_TOKEN=$INFERYES_JOIN_TOKEN
"$plain/inferyes-controller" --etcd-endpoints "http://127.0.0.1:$etcd_client" \
  --grpc-listen "127.0.0.1:$grpc" --http-listen "127.0.0.1:$http" >"$work/controller.log" 2>&1 & pids+=($!)
cat > "$work/agent.toml" <<CONF
version = 1
node_id = "bench-node"
controllers = ["http://127.0.0.1:$grpc"]
proxy_listen = "127.0.0.1:$agent"
[gpu]
source = "none"
[[backends]]
id = "main"
url = "http://127.0.0.1:$backend"
kind = "llama-server"
CONF
"${on_proxy[@]}" "$bin/inferyes-agent" --config "$work/agent.toml" >"$work/agent.log" 2>&1 & pids+=($!)
agent_pid=$!
# A second node whose advertised proxy is the backend itself: requests for
# its model go from the data plane straight to the backend.
cat > "$work/direct.toml" <<CONF
version = 1
node_id = "bench-direct"
controllers = ["http://127.0.0.1:$grpc"]
proxy_listen = "127.0.0.1:$direct_proxy"
advertise_url = "http://127.0.0.1:$backend"
[gpu]
source = "none"
[[backends]]
id = "main"
url = "http://127.0.0.1:$backend/direct"
kind = "llama-server"
CONF
"$bin/inferyes-agent" --config "$work/direct.toml" >"$work/direct.log" 2>&1 & pids+=($!)
# The data planes speak HTTP/1.1 to agents (the default; for the rows
# measured alone the "agent" of their node is nginx); a third speaks HTTP/2
# to agents that take it, for the data plane + agent path.
RUST_LOG=warn INFERYES_ADMIN_LISTEN="127.0.0.1:$dataplane_admin" "${on_proxy[@]}" "$bin/inferyes-dataplane" --listen "127.0.0.1:$dataplane" --controllers "http://127.0.0.1:$grpc" \
  --auth none --dataplane-id bench-open >"$work/dataplane.log" 2>&1 & pids+=($!)
dp_pid=$!
port keyed
RUST_LOG=warn "${on_proxy[@]}" "$bin/inferyes-dataplane" --listen "127.0.0.1:$keyed" --controllers "http://127.0.0.1:$grpc" \
  --dataplane-id bench-keys >"$work/dataplane-keys.log" 2>&1 & pids+=($!)
keyed_pid=$!
port fleet_dp
RUST_LOG=warn "${on_proxy[@]}" "$bin/inferyes-dataplane" --listen "127.0.0.1:$fleet_dp" --controllers "http://127.0.0.1:$grpc" \
  --auth none --agent-protocol http2 --dataplane-id bench-h2 >"$work/dataplane-h2.log" 2>&1 & pids+=($!)
fleet_dp_pid=$!
if [ -n "${BASELINE:-}" ]; then
  # An earlier build's data plane and agent, in the same fleet: its agent is
  # a node of its own (model bench-base), so the other rows are unchanged.
  port base
  RUST_LOG=warn "${on_proxy[@]}" "$BASELINE/inferyes-dataplane" --listen "127.0.0.1:$base" --controllers "http://127.0.0.1:$grpc" \
    --auth none --dataplane-id bench-baseline >"$work/dataplane-base.log" 2>&1 & pids+=($!)
  base_pid=$!
  port base_keyed
  RUST_LOG=warn "${on_proxy[@]}" "$BASELINE/inferyes-dataplane" --listen "127.0.0.1:$base_keyed" --controllers "http://127.0.0.1:$grpc" \
    --dataplane-id bench-baseline-keys >"$work/dataplane-base-keys.log" 2>&1 & pids+=($!)
  base_keyed_pid=$!
  port base_agent
  sed -e "s/bench-node/bench-base/" -e "s/127.0.0.1:$agent/127.0.0.1:$base_agent/" \
    -e "s|127.0.0.1:$backend\"|127.0.0.1:$backend/base\"|" "$work/agent.toml" >"$work/base.toml"
  "${on_proxy[@]}" "$BASELINE/inferyes-agent" --config "$work/base.toml" >"$work/agent-base.log" 2>&1 & pids+=($!)
  base_agent_pid=$!
  until curl -fsS "http://127.0.0.1:$base/v1/models" 2>/dev/null | grep -q bench-base; do sleep 0.2; done
fi
until curl -fsS "http://127.0.0.1:$dataplane/v1/models" 2>/dev/null | grep -q bench-direct; do sleep 0.2; done
until curl -fsS "http://127.0.0.1:$fleet_dp/v1/models" 2>/dev/null | grep -q bench-direct; do sleep 0.2; done
key=$("$plain/inferyesctl" --controller "http://127.0.0.1:$grpc" keys create bench -o json |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["secret"])')
for listen in "$keyed" ${BASELINE:+"$base_keyed"}; do
  until curl -fsS -H "Authorization: Bearer $key" "http://127.0.0.1:$listen/v1/models" 2>/dev/null | grep -q bench-direct; do
    sleep 0.2
  done
done

cat > "$work/chat.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["x-inferyes-backend"] = "main"
wrk.body = '{"model":"bench","messages":[{"role":"user","content":"hello"}],"max_tokens":2}'
LUA
if [ "${HEADERS:-}" = openai ]; then
  # The headers the OpenAI Python client (3.x) sends, with Host and
  # Content-Length (wrk's own): what a proxy parses, copies and forwards
  # with every request.
  cat >> "$work/chat.lua" <<'LUA'
wrk.headers["Accept-Encoding"] = "gzip, deflate"
wrk.headers["Connection"] = "keep-alive"
wrk.headers["Authorization"] = "Bearer sk-no-key"
wrk.headers["Accept"] = "application/json"
wrk.headers["User-Agent"] = "OpenAI/Python 3.57.0"
wrk.headers["X-Stainless-Lang"] = "python"
wrk.headers["X-Stainless-Package-Version"] = "3.57.0"
wrk.headers["X-Stainless-OS"] = "Linux"
wrk.headers["X-Stainless-Arch"] = "x64"
wrk.headers["X-Stainless-Runtime"] = "CPython"
wrk.headers["X-Stainless-Runtime-Version"] = "3.11.7"
wrk.headers["X-Stainless-Async"] = "false"
wrk.headers["x-stainless-retry-count"] = "0"
wrk.headers["x-stainless-read-timeout"] = "600"
LUA
fi
# Agents take requests that carry the credential data planes send them:
# what the controller issued their node's agent once it joined, derived
# from the fleet key the controllers keep in etcd, the node's id and its
# agent's instance (a data plane with keys off takes it as a client's and
# drops it). Agents of a baseline build from before take the join token's.
node_credential() { # node id, once its agent holds its credential
  local node
  until node=$("$plain/inferyesctl" --controller "http://127.0.0.1:$grpc" node "$1" -o json 2>/dev/null) &&
    grep -q '"awaiting_credential": false' <<<"$node"; do sleep 0.5; done
  python3 -c 'import base64, hashlib, hmac, json, sys, urllib.request
key = base64.b64encode(b"/inferyes/v1/secrets/fleet-key").decode()
request = urllib.request.Request(sys.argv[1] + "/v3/kv/range", data=json.dumps({"key": key}).encode())
fleet = base64.b64decode(json.load(urllib.request.urlopen(request))["kvs"][0]["value"]).hex()
instance = json.loads(sys.argv[3])["instance_digest"]
node_key = hmac.new(fleet.encode(), b"inferyes node proxy key v3", hashlib.sha256).hexdigest()
text = "inferyes node proxy v3 " + sys.argv[2] + " " + instance
print(hmac.new(node_key.encode(), text.encode(), hashlib.sha256).hexdigest())' \
    "http://127.0.0.1:$etcd_client" "$1" "$node"
}
join_derived_credential() { # node id: what a baseline agent from before issued credentials takes
  python3 -c 'import hashlib, hmac, sys
key = hmac.new(sys.argv[1].encode(), b"inferyes agent proxy key v2", hashlib.sha256).hexdigest()
print(hmac.new(key.encode(), ("inferyes agent proxy v2 " + sys.argv[2]).encode(), hashlib.sha256).hexdigest())' \
    "$INFERYES_JOIN_TOKEN" "$1"
}
with_credential() { # lua-script credential: a copy of the script that sends it
  local out="${1%.lua}-$RANDOM.lua"
  { cat "$1"; echo "wrk.headers[\"Authorization\"] = \"Bearer $2\""; } >"$out"
  echo "$out"
}
echo "wrk.headers[\"Authorization\"] = \"Bearer $(node_credential bench-node)\"" >> "$work/chat.lua"
sed 's/"messages":\[{"role":"user","content":"hello"}\]/"prompt":"hello","stream":true/' "$work/chat.lua" > "$work/stream.lua"
sed 's/"model":"bench"/"model":"bench-direct"/' "$work/chat.lua" > "$work/chat-direct.lua"
sed 's/"model":"bench"/"model":"bench-direct"/' "$work/stream.lua" > "$work/stream-direct.lua"
for kind in chat stream; do
  { cat "$work/$kind-direct.lua"; echo "wrk.headers[\"Authorization\"] = \"Bearer $key\""; } > "$work/$kind-direct-key.lua"
  # An agent's requests as a data plane sends them: the model and the
  # session named, so the agent keeps the session's residency.
  { cat "$work/$kind.lua"; echo 'wrk.headers["x-inferyes-model"] = "bench"'
    echo 'wrk.headers["x-inferyes-session"] = "bench-session"'; } > "$work/$kind-routed.lua"
  sed 's/"model":"bench"/"model":"bench-base"/' "$work/$kind.lua" > "$work/$kind-base.lua"
  # The baseline's agent is a node of its own, with its own credential.
  { cat "$work/$kind.lua"; echo "wrk.headers[\"Authorization\"] = \"Bearer $(join_derived_credential bench-base)\""; } \
    > "$work/$kind-base-agent.lua"
done

# Whether a row is one ONLY names: a comma-separated list of name prefixes
# (all rows where ONLY is unset).
chosen() {
  local prefix prefixes
  [ -z "${ONLY:-}" ] && return 0
  IFS=, read -ra prefixes <<<"$ONLY"
  for prefix in "${prefixes[@]}"; do
    [[ "$1" == "$prefix"* ]] && return 0
  done
  return 1
}

if [ "${HOLD:-}" = 1 ]; then
  # Keep the fleet up for profiling, e.g. perf record -g -p <data plane>.
  echo "data plane $dp_pid (keys: $keyed_pid), agent $agent_pid, nginx proxy $nginx_pid (a worker per core: $nginx_auto_pid), backend $backend_pid"
  echo "wrk -c 32 -d 10s -s $work/chat-direct.lua http://127.0.0.1:$dataplane/v1/chat/completions"
  echo "wrk -c 32 -d 10s -s $work/chat.lua http://127.0.0.1:$dataplane/v1/chat/completions   # through the agent"
  echo "wrk -c 32 -d 10s -s $work/chat.lua http://127.0.0.1:$nginx_proxy/v1/chat/completions"
  echo "wrk -c 32 -d 10s -s $work/chat.lua http://127.0.0.1:$nginx_proxy_auto/v1/chat/completions   # nginx, a worker per core"
  echo "Ctrl-C ends it."
  wait
fi

if [ "${INSTRUCTIONS:-}" = 1 ]; then
  # Instructions are exact where times are noisy: each proxy again, one
  # worker, under callgrind; counted over 8 s of two connections after a
  # warm-up, divided by the requests served. User space only.
  count() { # name port wrk-script command...
    local name=$1 port=$2 script=$3
    shift 3
    chosen "$name" || return 0
    valgrind --tool=callgrind --callgrind-out-file="$work/cg.$name" "$@" >"$work/cg.$name.log" 2>&1 &
    local pid=$!
    until curl -s -o /dev/null "http://127.0.0.1:$port/"; do sleep 0.5; done
    # An agent takes requests once its controller issued it a credential,
    # which names the agent's instance: known once it joined.
    if [ -n "${ISSUED_NODE:-}" ]; then
      script=$(with_credential "$script" "$(node_credential "$ISSUED_NODE")")
    fi
    wrk -t 1 -c 2 -d 3s -s "$script" "http://127.0.0.1:$port$path" >/dev/null
    callgrind_control -z "$pid" >/dev/null 2>&1
    local requests
    requests=$(wrk -t 1 -c 2 -d 8s -s "$script" "http://127.0.0.1:$port$path" |
      awk '/requests in/ {print $1}')
    callgrind_control -d "$pid" >/dev/null 2>&1
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    local profile
    profile=$(ls -S "$work"/cg."$name".* | grep -v log | head -1)
    if [ -n "${CALLGRIND_DIR:-}" ]; then
      mkdir -p "$CALLGRIND_DIR"
      cp "$profile" "$CALLGRIND_DIR/$name.callgrind"
    fi
    awk -v name="$name" -v n="$requests" '/^summary:/ { printf "%-14s %8.0f instructions/request (%d requests)\n", name, $2 / n, n }' \
      "$profile"
  }
  export RUST_LOG=warn
  if [ "${KIND:-json}" = sse ]; then
    path=/v1/completions chat=stream
  else
    path=/v1/chat/completions chat=chat
  fi
  echo "user-space instructions per request, ${KIND:-json}, callgrind"
  port floor
  count hyper-floor "$floor" "$work/$chat.lua" "$plain/examples/bare_proxy" "127.0.0.1:$floor" "http://127.0.0.1:$backend"
  if [ -n "$base_bare" ]; then
    port floor
    count hyper-floor@base "$floor" "$work/$chat.lua" "$BASELINE/bare_proxy" "127.0.0.1:$floor" "http://127.0.0.1:$backend"
  fi
  for build in "$bin" ${BASELINE:+"$BASELINE"}; do
    suffix=""
    [ "$build" = "$bin" ] || suffix=@base
    port proxy
    sed -e "s/^node_id = .*/node_id = \"bench-instructions-$proxy\"/" \
      -e "s/^proxy_listen = .*/proxy_listen = \"127.0.0.1:$proxy\"/" "$work/agent.toml" >"$work/agent-$proxy.toml"
    if [ -z "$suffix" ]; then
      issued="bench-instructions-$proxy" chat_script=$work/$chat.lua routed_script=$work/$chat-routed.lua
    else
      issued=""
      chat_script=$(with_credential "$work/$chat.lua" "$INFERYES_JOIN_TOKEN")
      routed_script=$(with_credential "$work/$chat-routed.lua" "$INFERYES_JOIN_TOKEN")
    fi
    ISSUED_NODE=$issued count "agent$suffix" "$proxy" "$chat_script" \
      "$build/inferyes-agent" --config "$work/agent-$proxy.toml" --workers 1
    ISSUED_NODE=$issued count "agent+session$suffix" "$proxy" "$routed_script" "$build/inferyes-agent" \
      --config "$work/agent-$proxy.toml" --workers 1
    name=dataplane$suffix
    port listen
    count "$name" "$listen" "$work/$chat-direct.lua" "$build/inferyes-dataplane" --listen "127.0.0.1:$listen" \
      --controllers "http://127.0.0.1:$grpc" --auth none --dataplane-id "bench-instructions-$listen" --workers 1
    port listen
    count "dataplane+keys$suffix" "$listen" "$work/$chat-direct-key.lua" "$build/inferyes-dataplane" \
      --listen "127.0.0.1:$listen" --controllers "http://127.0.0.1:$grpc" --dataplane-id "bench-instructions-$listen" \
      --workers 1
  done
  # The model on two replicas, as models are in a fleet: a second node
  # advertising the backend. Routing weighs both, and a stream may list
  # the other for continuation.
  chosen dataplane+replicas || exit 0
  port replica
  sed -e 's/^node_id = .*/node_id = "bench-direct-2"/' -e "s/^proxy_listen = .*/proxy_listen = \"127.0.0.1:$replica\"/" \
    "$work/direct.toml" >"$work/direct-2.toml"
  "$bin/inferyes-agent" --config "$work/direct-2.toml" >"$work/direct-2.log" 2>&1 & pids+=($!)
  until curl -fsS "http://127.0.0.1:$dataplane/v1/models" 2>/dev/null | python3 -c 'import json, sys
models = json.load(sys.stdin)["data"]
sys.exit(not any(m["id"] == "bench-direct" and m["inferyes"]["nodes"] == 2 for m in models))'; do
    sleep 0.2
  done
  for build in "$bin" ${BASELINE:+"$BASELINE"}; do
    suffix=""
    [ "$build" = "$bin" ] || suffix=@base
    port listen
    count "dataplane+replicas$suffix" "$listen" "$work/$chat-direct.lua" "$build/inferyes-dataplane" --listen "127.0.0.1:$listen" \
      --controllers "http://127.0.0.1:$grpc" --auth none --dataplane-id "bench-instructions-$listen" --workers 1
  done
  exit 0
fi

# CPU time (user + system, in clock ticks) of processes and their threads
# and children (an nginx master's worker).
ticks() {
  local total=0 pid
  for pid in "$@" $(for p in "$@"; do pgrep -P "$p"; done); do
    total=$((total + $(awk '{print $14 + $15}' "/proc/$pid/stat")))
  done
  echo $total
}
hz=$(getconf CLK_TCK)

run() { # name url script connections kind pids-on-the-path...
  local name=$1 url=$2 script=$3 conns=$4 kind=$5
  shift 5
  chosen "$name" || return 0
  local out before after
  before=$(ticks "$@")
  out=$(wrk -t "$([ "$conns" -eq 1 ] && echo 1 || echo "$wrk_threads")" -c "$conns" -d "$duration" --latency -s "$script" "$url" 2>&1)
  after=$(ticks "$@")
  local rps p50 p99 requests failed cpu
  rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  p50=$(awk '$1=="50%" {print $2}' <<<"$out")
  p99=$(awk '$1=="99%" {print $2}' <<<"$out")
  requests=$(awk '/requests in/ {print $1}' <<<"$out")
  failed=$(awk '/Non-2xx/ {print $NF}' <<<"$out")
  cpu=$(awk -v t=$((after - before)) -v hz="$hz" -v n="$requests" 'BEGIN { printf "%.1f", (n > 0 ? t / hz * 1e6 / n : 0) }')
  printf '%-14s %-5s %3s conns %10s req/s   p50 %9s   p99 %9s   CPU %6s µs/req%s\n' "$name" "$kind" "$conns" \
    "$rps" "$p50" "$p99" "$cpu" "${failed:+   FAILED RESPONSES: $failed}"
}

rounds=${ROUNDS:-1}
echo "wrk, $duration per run, on $(nproc) cores${PROXY_CPUS:+ (proxies on CPUs $PROXY_CPUS alone)}; CPU is the proxy's (the backend's for direct), per request"
for round in $(seq "$rounds"); do
[ "$rounds" -eq 1 ] || echo "round $round of $rounds"
for kind in json sse; do
  if [ $kind = json ]; then path=/v1/chat/completions; script=$work/chat.lua; else path=/v1/completions; script=$work/stream.lua; fi
  for conns in 1 32; do
    run direct "http://127.0.0.1:$backend$path" "$script" $conns $kind "$backend_pid"
    run nginx "http://127.0.0.1:$nginx_proxy$path" "$script" $conns $kind "$nginx_pid"
    run nginx-auto "http://127.0.0.1:$nginx_proxy_auto$path" "$script" $conns $kind "$nginx_auto_pid"
    run hyper-floor "http://127.0.0.1:$bare$path" "$script" $conns $kind "$bare_pid"
    run agent "http://127.0.0.1:$agent$path" "$script" $conns $kind "$agent_pid"
    run dataplane "http://127.0.0.1:$dataplane$path" "${script%.lua}-direct.lua" $conns $kind "$dp_pid"
    run dp+keys "http://127.0.0.1:$keyed$path" "${script%.lua}-direct-key.lua" $conns $kind "$keyed_pid"
    run dp+agent "http://127.0.0.1:$dataplane$path" "$script" $conns $kind "$dp_pid" "$agent_pid"
    run dp+agent/h2 "http://127.0.0.1:$fleet_dp$path" "$script" $conns $kind "$fleet_dp_pid" "$agent_pid"
    if [ -n "$base_bare" ]; then
      run floor@base "http://127.0.0.1:$base_bare$path" "$script" $conns $kind "$base_bare_pid"
    fi
    if [ -n "${BASELINE:-}" ]; then
      run agent@base "http://127.0.0.1:$base_agent$path" "${script%.lua}-base-agent.lua" $conns $kind "$base_agent_pid"
      run dp@base "http://127.0.0.1:$base$path" "${script%.lua}-direct.lua" $conns $kind "$base_pid"
      run dp+keys@base "http://127.0.0.1:$base_keyed$path" "${script%.lua}-direct-key.lua" $conns $kind "$base_keyed_pid"
      run dp+agent@base "http://127.0.0.1:$base$path" "${script%.lua}-base.lua" $conns $kind "$base_pid" "$base_agent_pid"
    fi
  done
done
done | tee "$work/runs.txt"
if [ "$rounds" -gt 1 ]; then
  # A disturbance on a shared machine hits the rows running at that moment:
  # the median of each row over the rounds, which ran apart in time.
  echo "median of $rounds rounds:"
  python3 - "$work/runs.txt" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\S+)\s+(\S+)\s+(\d+) conns\s+([\d.]+) req/s\s+p50\s+(\S+)\s+p99\s+(\S+)\s+CPU\s+([\d.]+)", line)
    if m:
        rows.setdefault(m.group(1, 2, 3), []).append(m.groups()[3:])
def seconds(t):
    value = float(re.match(r"[\d.]+", t).group())
    return value * {"us": 1e-6, "ms": 1e-3, "s": 1}[re.search(r"[a-z]+$", t).group()]
def shown(s):
    return f"{s * 1e6:.0f}us" if s < 1e-3 else f"{s * 1e3:.2f}ms"
for (name, kind, conns), runs in rows.items():
    rps, p50, p99, cpu = (statistics.median(float(r[0]) for r in runs), statistics.median(seconds(r[1]) for r in runs),
                          statistics.median(seconds(r[2]) for r in runs), statistics.median(float(r[3]) for r in runs))
    print(f"{name:<14} {kind:<5} {conns:>3} conns {rps:10.0f} req/s   p50 {shown(p50):>9}   p99 {shown(p99):>9}   CPU {cpu:6.1f} µs/req")
PY
fi
echo "data plane RSS after the runs: $(( $(ps -o rss= -p "$dp_pid") / 1024 )) MiB"

if [ "$fleet_size" -gt 0 ]; then
  # The same data plane with a fleet-sized snapshot: $fleet_size more nodes,
  # 32 sessions each; FLEET_NEW new sessions a second per node (default 0)
  # make the data plane apply live deltas and decode too.
  CONTROLLER="http://127.0.0.1:$grpc" JOIN_TOKEN="$INFERYES_JOIN_TOKEN" AGENTS=$fleet_size SESSIONS=32 \
    NEW=${FLEET_NEW:-0} REPEATS=${FLEET_NEW:-0} SECONDS=3600 \
    "$fleet_bin" >"$work/fleet.log" 2>&1 & pids+=($!)
  nodes=$((fleet_size + 2))
  for _ in $(seq 300); do
    held=$(curl -fsS "http://127.0.0.1:$dataplane_admin/metrics" 2>/dev/null | grep -c '^inferyes_dataplane_node_in_flight{' || true)
    [ "$held" -ge "$nodes" ] && break
    sleep 1
  done
  [ "$held" -ge "$nodes" ] || { echo "the data plane holds $held of $nodes nodes"; cat "$work/fleet.log"; exit 1; }
  echo "with $nodes nodes in the snapshot:"
  run dataplane "http://127.0.0.1:$dataplane/v1/chat/completions" "$work/chat-direct.lua" 1 json "$dp_pid"
  run dataplane "http://127.0.0.1:$dataplane/v1/chat/completions" "$work/chat-direct.lua" 32 json "$dp_pid"
  run dp+agent "http://127.0.0.1:$dataplane/v1/chat/completions" "$work/chat.lua" 32 json "$dp_pid" "$agent_pid"
  echo "data plane RSS with $nodes nodes: $(( $(ps -o rss= -p "$dp_pid") / 1024 )) MiB"
fi
