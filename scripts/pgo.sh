#!/usr/bin/env bash
# The profile-optimised build of the data plane and the agent, the one
# recipe the container image, build-pgo.sh and CI run: an instrumented
# build serves a fixed load on a local training fleet, and the release
# build then lays its code out by what ran. The fleet is etcd, a plain
# controller and two simulated llama-servers, on 127.0.0.1 only (no
# network after the packages); the load is JSON and streamed answers at 1
# and 32 connections through a data plane alone, with API keys checked,
# and through an agent over HTTP/1.1 and HTTP/2, then with the OpenAI
# client's headers, keys off and on. Same release profile, same sources as a plain
# `cargo build --release`, which stays as it is.
#
#   scripts/pgo.sh                          # data plane and agent in $PGO_DIR/use/release/
#   scripts/pgo.sh --install-to /out        # and the four binaries copied there
#   scripts/pgo.sh --packages dataplane --requests 300 --check --plain target/debug
#                                           # CI: a small run, and proof the recipe works
#
# --plain DIR: run the training fleet's other parts (controller, ctl, the
# simulator, the load; and whichever of data plane and agent is not
# optimised) from DIR, built already (debug will do: they are not what is
# measured), instead of a plain release build;
# --requests N: requests per run at 32 connections (a tenth at one);
# --check: also check the profile covers the request path, the optimised
# binary carries no instrumentation, and the build took the profile whole.
# Either way the optimised binaries serve a few requests on the training
# fleet before the script succeeds. PGO_DIR: where builds and profiles go
# (default: the cargo target dir's pgo/). About 20 minutes on 2 cores.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
packages=dataplane,agent
requests=2000
install_to=""
plain=""
check=0
while [ $# -gt 0 ]; do
  case "$1" in
    --packages) packages=$2; shift 2 ;;
    --requests) requests=$2; shift 2 ;;
    --install-to) install_to=$2; shift 2 ;;
    --check) check=1; shift ;;
    --plain) plain=$2; shift 2 ;;
    *) echo "pgo.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
optimised=()
[ -n "$packages" ] || { echo "pgo.sh: --packages names none" >&2; exit 2; }
for package in ${packages//,/ }; do
  case "$package" in
    dataplane|agent) optimised+=("$package") ;;
    *) echo "pgo.sh: only dataplane and agent are profile-optimised, not '$package'" >&2; exit 2 ;;
  esac
done
built() { [[ " ${optimised[*]} " == *" $1 "* ]]; }

"$root/scripts/deps.sh" pgo
target=${CARGO_TARGET_DIR:-$root/target}
dir=${PGO_DIR:-$target/pgo}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
llvm=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
profdata=llvm-profdata-$llvm
cargo_packages=()
for package in "${optimised[@]}"; do cargo_packages+=(-p "inferyes-$package"); done

if [ -z "$plain" ]; then
  echo "== plain release build (controller, ctl, the simulator, the load)" >&2
  cargo build --release --bins --locked -q
  cargo build --release --locked -q -p inferyes-net --example load
  plain=$target/release
elif [ -n "$install_to" ]; then
  echo "pgo.sh: --install-to copies plain release binaries: leave out --plain" >&2
  exit 2
fi
for binary in inferyes-controller inferyes-agent inferyes-dataplane inferyesctl examples/load; do
  [ -x "$plain/$binary" ] || { echo "pgo.sh: no $plain/$binary (build it, or leave out --plain)" >&2; exit 1; }
done

echo "== instrumented build: ${optimised[*]}" >&2
CARGO_TARGET_DIR="$dir/generate" RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$dir/raw" \
  cargo build --release --bins --locked -q "${cargo_packages[@]}"
instrumented=$dir/generate/release
# Build scripts ran instrumented too: only the training's profiles count.
rm -rf "$dir/raw"
mkdir -p "$dir/raw"

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
taken=" "
port() { # VAR...: each a port nothing listens on, none given before (bash alone: the image has no Python)
  local var p
  for var in "$@"; do
    while :; do
      p=$((10000 + RANDOM % 22000))
      [[ "$taken" != *" $p "* ]] && ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && break
    done
    taken+="$p "
    printf -v "$var" %s "$p"
  done
}
wait_for() { # what url pattern: until the URL's answer holds the pattern, 60 s at most
  for _ in $(seq 300); do
    if [[ "$(curl -fsS "${@:4}" "$2" 2>/dev/null)" == *"$3"* ]]; then return 0; fi
    sleep 0.2
  done
  echo "pgo.sh: $1 not up ($2)" >&2
  tail -n 20 "$work"/*.log >&2
  exit 1
}
binary() { # the component's build for the training: instrumented where it is optimised
  if built "$1"; then echo "$instrumented/inferyes-$1"; else echo "$plain/inferyes-$1"; fi
}

port etcd_client etcd_peer grpc http
etcd --name pgo --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$etcd_client" \
  --advertise-client-urls "http://127.0.0.1:$etcd_client" --listen-peer-urls "http://127.0.0.1:$etcd_peer" \
  --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" --initial-cluster "pgo=http://127.0.0.1:$etcd_peer" \
  --auto-compaction-mode=periodic --auto-compaction-retention=5m --quota-backend-bytes=2147483648 \
  >"$work/etcd.log" 2>&1 & pids+=($!)
wait_for etcd "http://127.0.0.1:$etcd_client/health" true
export INFERYES_ADMIN_TOKEN=pgo-admin-token-0123456789 INFERYES_JOIN_TOKEN=pgo-join-token-0123456789
export INFERYES_DATAPLANE_TOKEN=pgo-dataplane-token-0123456789 INFERYES_ADMIN_LISTEN=127.0.0.1:0 RUST_LOG=warn
"$plain/inferyes-controller" --etcd-endpoints "http://127.0.0.1:$etcd_client" \
  --grpc-listen "127.0.0.1:$grpc" --http-listen "127.0.0.1:$http" >"$work/controller.log" 2>&1 & pids+=($!)
wait_for controller "http://127.0.0.1:$http/readyz" ""

# Two simulated llama-servers answering at once: one behind an agent, one
# a node advertises as its own proxy (the data plane's requests go to it
# straight, the data plane's work alone).
for sim in train train-direct; do
  cat >"$work/$sim.toml" <<CONF
slots = 64
prefill_tokens_per_second = 1e9
decode_tokens_per_second = 1e9
[[models]]
id = "$sim"
CONF
  var=${sim//-/_}
  port "$var"
  listen=${!var}
  "$plain/inferyes-agent" simulate --listen "127.0.0.1:$listen" --sim-config "$work/$sim.toml" \
    >"$work/sim-$sim.log" 2>&1 & pids+=($!)
  wait_for "simulator $sim" "http://127.0.0.1:$listen/health" ok
done
port agent_proxy direct_proxy
cat >"$work/agent.toml" <<CONF
version = 1
node_id = "pgo-node"
controllers = ["http://127.0.0.1:$grpc"]
proxy_listen = "127.0.0.1:$agent_proxy"
[gpu]
source = "none"
[[backends]]
id = "main"
url = "http://127.0.0.1:$train"
kind = "llama-server"
CONF
LLVM_PROFILE_FILE="$dir/raw/agent-%p.profraw" "$(binary agent)" --config "$work/agent.toml" \
  >"$work/agent.log" 2>&1 & pids+=($!)
# The processes whose profiles count, stopped before the merge; a plain
# agent stays: the optimised data plane is checked through it.
trained=()
! built agent || trained+=($!)
cat >"$work/direct.toml" <<CONF
version = 1
node_id = "pgo-direct"
controllers = ["http://127.0.0.1:$grpc"]
proxy_listen = "127.0.0.1:$direct_proxy"
advertise_url = "http://127.0.0.1:$train_direct"
[gpu]
source = "none"
[[backends]]
id = "main"
url = "http://127.0.0.1:$train_direct"
kind = "llama-server"
CONF
"$plain/inferyes-agent" --config "$work/direct.toml" >"$work/direct.log" 2>&1 & pids+=($!)

dataplane() { # name build-dir port args...: a data plane of the training fleet
  local name=$1 build=$2 listen=$3
  shift 3
  LLVM_PROFILE_FILE="$dir/raw/dataplane-%p.profraw" "$build" --listen "127.0.0.1:$listen" \
    --controllers "http://127.0.0.1:$grpc" --dataplane-id "pgo-$name" "$@" >"$work/dataplane-$name.log" 2>&1 &
  pids+=($!)
}
port open keyed h2
dataplane open "$(binary dataplane)" "$open" --auth none; trained+=($!)
dataplane keys "$(binary dataplane)" "$keyed" ; trained+=($!)
dataplane h2 "$(binary dataplane)" "$h2" --auth none --agent-protocol http2; trained+=($!)
key=$("$plain/inferyesctl" --controller "http://127.0.0.1:$grpc" keys create pgo -o json |
  sed -n 's/.*"secret": *"\([^"]*\)".*/\1/p')
[ -n "$key" ] || { echo "pgo.sh: no key created" >&2; exit 1; }
for listen in "$open" "$h2"; do
  wait_for "data plane on $listen" "http://127.0.0.1:$listen/v1/models" '"train-direct"'
  wait_for "data plane on $listen" "http://127.0.0.1:$listen/v1/models" '"train"'
done
wait_for "keyed data plane" "http://127.0.0.1:$keyed/v1/models" '"train-direct"' -H "authorization: Bearer $key"

printf '{"model":"%s","messages":[{"role":"user","content":"hello"}],"max_tokens":2}' train >"$work/chat.json"
printf '{"model":"%s","prompt":"hello","max_tokens":2,"stream":true}' train >"$work/stream.json"
for kind in chat stream; do sed 's/"train"/"train-direct"/' "$work/$kind.json" >"$work/$kind-direct.json"; done
openai=(
  "accept-encoding: gzip, deflate" "accept: application/json" "user-agent: OpenAI/Python 3.57.0"
  "x-stainless-lang: python" "x-stainless-package-version: 3.57.0" "x-stainless-os: Linux"
  "x-stainless-arch: x64" "x-stainless-runtime: CPython" "x-stainless-runtime-version: 3.11.7"
  "x-stainless-async: false" "x-stainless-retry-count: 0" "x-stainless-read-timeout: 600"
)
load() { # port json requests connections headers...
  local listen=$1 body=$2 count=$3 connections=$4
  shift 4
  local path=/v1/chat/completions
  [[ "$body" != stream* ]] || path=/v1/completions
  "$plain/examples/load" "http://127.0.0.1:$listen$path" "$count" "$connections" "$work/$body" "$@" >&2
}
each() { # port body-suffix headers...: JSON and streamed, at 32 connections and at one
  local listen=$1 suffix=$2
  shift 2
  for body in chat stream; do
    load "$listen" "$body$suffix.json" "$requests" 32 "$@"
    load "$listen" "$body$suffix.json" $(( (requests + 9) / 10 )) 1 "$@"
  done
}
echo "== training: $requests requests a run" >&2
each "$open" -direct
each "$keyed" -direct "authorization: Bearer $key"
each "$open" ""
each "$h2" ""
each "$open" -direct "${openai[@]}" "authorization: Bearer sk-no-key"
each "$keyed" -direct "${openai[@]}" "authorization: Bearer $key"

# Profiles are written as a process exits cleanly: SIGTERM, and wait.
kill -TERM "${trained[@]}" 2>/dev/null || true
for pid in "${trained[@]}"; do wait "$pid" || true; done
shopt -s nullglob
for component in "${optimised[@]}"; do
  written=("$dir/raw/$component"-*.profraw)
  if [ ${#written[@]} -eq 0 ] || [ ! -s "${written[0]}" ]; then
    echo "pgo.sh: the instrumented $component wrote no profile" >&2
    exit 1
  fi
done
"$profdata" merge -o "$dir/merged.profdata" "$dir"/raw/*.profraw
# Named by its content: a new profile is a new flag, which cargo rebuilds for.
profile="$dir/merged-$(sha256sum "$dir/merged.profdata" | cut -c1-16).profdata"
mv "$dir/merged.profdata" "$profile"
find "$dir" -maxdepth 1 -name 'merged-*.profdata' ! -path "$profile" -delete

echo "== optimised build" >&2
CARGO_TARGET_DIR="$dir/use" RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$profile" \
  cargo build --release --bins --locked -q "${cargo_packages[@]}" 2>"$work/use.log" || { cat "$work/use.log" >&2; exit 1; }
use=$dir/use/release

# The optimised binaries on the same fleet: a build that does not serve
# fails here, not in a user's deployment.
echo "== the optimised build serves" >&2
if built agent; then
  "$use/inferyes-agent" --config "$work/agent.toml" >"$work/agent-use.log" 2>&1 & pids+=($!)
fi
port served
if built dataplane; then
  dataplane use "$use/inferyes-dataplane" "$served"
else
  dataplane use "$plain/inferyes-dataplane" "$served"
fi
wait_for "optimised data plane" "http://127.0.0.1:$served/v1/models" '"train-direct"' -H "authorization: Bearer $key"
wait_for "optimised data plane" "http://127.0.0.1:$served/v1/models" '"train"' -H "authorization: Bearer $key"
for body in chat stream chat-direct stream-direct; do load "$served" "$body.json" 20 4 "authorization: Bearer $key"; done

if [ "$check" = 1 ]; then
  echo "== checks" >&2
  # The profile's hottest functions include the request path's, not only
  # start-up's: the data plane's pipeline, the agent's proxy.
  "$profdata" show --topn=500 "$profile" >"$work/hottest.txt"
  for component in "${optimised[@]}"; do
    path=pipeline
    [ "$component" = dataplane ] || path=proxy
    grep -qE "inferyes_$component.*$path" "$work/hottest.txt" \
      || { echo "pgo.sh: the $component's request path is not among the profile's hottest" >&2; exit 1; }
  done
  for component in "${optimised[@]}"; do
    # Instrumentation in the training build, none in the optimised one
    # (symbols read whole: `nm | grep -q` fails on SIGPIPE under pipefail).
    symbols=$(nm "$instrumented/inferyes-$component")
    [[ "$symbols" == *__llvm_profile_begin_counters* ]] \
      || { echo "pgo.sh: the instrumented $component has no profiling runtime" >&2; exit 1; }
    symbols=$(nm "$use/inferyes-$component")
    if [[ "$symbols" == *__llvm_profile_begin_counters* ]]; then
      echo "pgo.sh: the optimised $component is instrumented" >&2
      exit 1
    fi
  done
  # Every function's profile matched its code: LLVM warns of those whose
  # code changed since (a profile of other sources).
  if grep -iE "hash mismatch|control flow change|profile data may be|malformed|no profile data" "$work/use.log"; then
    echo "pgo.sh: the optimised build did not take the profile whole" >&2
    exit 1
  fi
fi

if [ -n "$install_to" ]; then
  mkdir -p "$install_to"
  for component in controller dataplane agent; do
    if built "$component"; then cp "$use/inferyes-$component" "$install_to/"; else cp "$plain/inferyes-$component" "$install_to/"; fi
  done
  cp "$plain/inferyesctl" "$install_to/"
fi
echo "profile-optimised: ${optimised[*]/#/$use/inferyes-}" >&2
