#!/usr/bin/env bash
# llama.cpp's OpenAI-compatible servers for the remote-engine tests and benchmarks:
#   - llama-cpp-python[server] in its own virtual environment, .venv-llama;
#   - llama.cpp's native `llama-server` (parallel slots, /slots, /props, /metrics), built
#     from the llama.cpp sources vendored in the same llama-cpp-python sdist, linked
#     statically, at .venv-llama/bin/llama-server.
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
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
# Native code for this CPU, except Intel AMX: ggml's AMX matmul crashes on the first
# multi-token decode on Sapphire Rapids class CPUs (seen with 0.3.36; upstream
# ggml-org/llama.cpp#20824). Where the CPU has AMX, the instruction sets are named one
# by one from /proc/cpuinfo instead of -march=native, AMX left out.
ISA_FLAGS="-DGGML_NATIVE=ON"
if [[ " $flags " == *" amx_int8 "* || " $flags " == *" amx_tile "* ]]; then
  has() { [[ " $flags " == *" $1 "* ]] && echo ON || echo OFF; }
  ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)"
  ISA_FLAGS+=" -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2) -DGGML_AVX512=$(has avx512f)"
  ISA_FLAGS+=" -DGGML_AVX512_VBMI=$(has avx512vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
  ISA_FLAGS+=" -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=$(has avx_vnni)"
  ISA_FLAGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
# No multimodal library (ragbudget sends text only), no tests or examples.
CMAKE_FLAGS="$ISA_FLAGS -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
key=$(printf '%s\n' "$VERSION" "$(uname -m)" "$(cc --version 2>/dev/null | head -1)" "$flags" "$CMAKE_FLAGS" \
      | sha256sum | cut -c1-16)
wheel_dir="$CACHE/llama-cpp-python-$VERSION-$key"

mkdir -p "$CACHE"
exec 9>"$CACHE/.llama-cpp-python.lock"
flock 9    # one build at a time per machine; a second waits, then finds the wheel
if ! ls "$wheel_dir"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1 || [ ! -x "$wheel_dir/llama-server" ]; then
  tmp=$(mktemp -d "$CACHE/.build-XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "building llama-cpp-python $VERSION from source (compiles llama.cpp; several minutes)" >&2
  start=$(date +%s)
  # --no-cache-dir: pip's own wheel cache is keyed by the sdist alone, not by CMAKE_ARGS.
  CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$PY" -m pip wheel -q --no-cache-dir --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$VERSION" -w "$tmp"
  echo "built the wheel in $(( $(date +%s) - start )) s" >&2
  # The native server from the same sources (vendor/llama.cpp in the sdist).
  start=$(date +%s)
  "$PY" -m pip download -q --no-cache-dir --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp/sdist"
  tar -xzf "$tmp"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  src="$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp"
  cmake -S "$src" -B "$tmp/server-build" -DCMAKE_BUILD_TYPE=Release $ISA_FLAGS \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF >"$tmp/server-cmake.log" 2>&1 \
    || { cat "$tmp/server-cmake.log" >&2; exit 1; }
  cmake --build "$tmp/server-build" --target llama-server -j "$(nproc)" >"$tmp/server-build.log" 2>&1 \
    || { tail -50 "$tmp/server-build.log" >&2; exit 1; }
  cp "$tmp/server-build/bin/llama-server" "$tmp/llama-server"
  rm -rf "$tmp/sdist" "$tmp/llama_cpp_python-$VERSION" "$tmp/server-build"
  echo "built llama-server in $(( $(date +%s) - start )) s" >&2
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
ln -sf "$wheel_dir/llama-server" "$venv/bin/llama-server"
"$venv/bin/llama-server" --version >/dev/null 2>&1 || { echo "llama-server does not run" >&2; exit 1; }
echo "$(pwd)/$venv/bin/python"
