#!/usr/bin/env bash
# Installs the system packages Inferyes builds and tests with, if missing:
# etcd (the fleet store), protoc (needed by the etcd client's build), curl,
# Python's venv (the end-to-end suite), and Chromium with its WebDriver (the
# dashboard test).
# Debian/Ubuntu only; everything else comes from crates.io.
set -euo pipefail

need=()
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
command -v curl >/dev/null 2>&1 || need+=(curl)
python3 -m venv --help >/dev/null 2>&1 || need+=(python3-venv python3-pip)
# `deps.sh test`: the dashboard test drives a real headless Chromium over
# WebDriver; the fleet itself does not need it.
if [ "${1:-}" = test ]; then
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
fi
[ ${#need[@]} -eq 0 ] && exit 0

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing: ${need[*]}" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# Debian's package may start a system etcd on 2379; the project never uses
# that port, so the two do not meet.
