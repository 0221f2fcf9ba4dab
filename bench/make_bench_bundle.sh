#!/usr/bin/env bash
# The packages the GPU machines lack for the offline benches that need no Ray (bench.structured_outputs,
# tests/gpu): xgrammar and its tvm-ffi, pydantic, gguf; for their Python 3.12, as a tarball to carry.
#
#   bash bench/make_bench_bundle.sh .benchbundle      # then carry [".benchbundle"] and start the command with
#   tar -xJf .benchbundle/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
dest=$(realpath -m "${1:-.benchbundle}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plats=()
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 any; do
  plats+=(--platform "$p")
done
python3 -m pip install -q --target "$work/site" --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plats[@]}" --no-deps "xgrammar>=0.2.8,<0.3" apache-tvm-ffi pydantic pydantic-core annotated-types \
  typing-inspection "gguf>=0.19" 2>&1 | grep -v -e '^WARNING' || true
find "$work/site" -name '__pycache__' -prune -exec rm -rf {} +
mkdir -p "$dest"
tar -C "$work" -cJf "$dest/site.tar.xz" site
du -sh "$dest/site.tar.xz"
