#!/usr/bin/env bash
# llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) in its own virtual
# environment, .venv-llama, for the remote-engine tests and benchmarks.
#
# llama-cpp-python is built from its source distribution on PyPI (it compiles
# llama.cpp for this CPU: about 9 min on 2 cores, see docs/engines.md). The built wheel is kept in
# $RAGBUDGET_WHEEL_CACHE (default ~/.cache/ragbudget/wheels), keyed by the version, the
# machine, the compiler and the CPU flags, so later runs install in seconds. A build
# runs in a temporary directory that is renamed into place: an interrupted build
# leaves nothing behind. Idempotent; prints the server's Python on the last line.
#
#   bash scripts/install_llama_server.sh          # build once, then reuse
#   .venv-llama/bin/python -m llama_cpp.server --help
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
CACHE=${RAGBUDGET_WHEEL_CACHE:-$HOME/.cache/ragbudget/wheels}
# Native code for this CPU; no multimodal library (ragbudget sends text only).
CMAKE_FLAGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
key=$(printf '%s\n' "$VERSION" "$(uname -m)" "$(cc --version 2>/dev/null | head -1)" "$flags" "$CMAKE_FLAGS" \
      | sha256sum | cut -c1-16)
wheel_dir="$CACHE/llama-cpp-python-$VERSION-$key"

mkdir -p "$CACHE"
exec 9>"$CACHE/.llama-cpp-python.lock"
flock 9    # one build at a time per machine; a second waits, then finds the wheel
if ! ls "$wheel_dir"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d "$CACHE/.build-XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "building llama-cpp-python $VERSION from source (compiles llama.cpp; several minutes)" >&2
  start=$(date +%s)
  CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$PY" -m pip wheel -q --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$VERSION" -w "$tmp"
  echo "built in $(( $(date +%s) - start )) s" >&2
  rm -rf "$wheel_dir"
  mv "$tmp" "$wheel_dir"
  trap - EXIT
fi
flock -u 9

venv=.venv-llama
stamp="$venv/.installed"
want="$VERSION $key"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q --find-links "$wheel_dir" --only-binary llama-cpp-python \
    "llama-cpp-python[server]==$VERSION"
  "$venv/bin/python" -c "import llama_cpp, llama_cpp.server.app; print('llama_cpp', llama_cpp.__version__)" >&2
  echo "$want" > "$stamp"
fi
echo "$(pwd)/$venv/bin/python"
