#!/usr/bin/env bash
# The test command: install if needed, make sure PostgreSQL is up, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export RAGBUDGET_REQUIRE_POSTGRES=${RAGBUDGET_REQUIRE_POSTGRES:-1}
if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  if [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start || true
  fi
  for _ in $(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null && break; sleep 1; done
fi
if ! pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
  echo "FATAL: PostgreSQL is not reachable at 127.0.0.1:5432; the PostgreSQL tests cannot run" >&2
  exit 1
fi
# The browser tests (tests/ui/test_browser.py) drive Debian's Chromium through its chromedriver.
# Install both when missing; if that is impossible the browser tests skip and say why.
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  log=$(mktemp -t ragbudget-browser-install.XXXXXX)
  if command -v apt-get >/dev/null 2>&1 && { $SUDO apt-get update -qq \
       && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -o DPkg::Lock::Timeout=600 \
            chromium chromium-driver; } >"$log" 2>&1; then
    echo "installed chromium and chromium-driver for the browser tests"
  else
    echo "warning: could not install chromium + chromium-driver (log: $log); the browser tests will skip" >&2
  fi
fi
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  # The browser is there: a browser test that cannot start it is a failure, not a skip.
  export RAGBUDGET_REQUIRE_BROWSER=${RAGBUDGET_REQUIRE_BROWSER:-1}
fi
# An independent RFC 8785 (JCS) implementation for the receipt tests: Node's `canonicalize`
# (by an author of the RFC), when node and npm are here. Without it those tests use the second
# Python implementation (`jcs`) only.
if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 \
    && [ ! -f .node/node_modules/canonicalize/package.json ]; then
  npm install --prefix .node --no-audit --no-fund --silent canonicalize@2.1.0 >/dev/null 2>&1 \
    || echo "note: npm could not install canonicalize; the Node JCS receipt test will be skipped" >&2
fi
# Arize Phoenix (its own venv, .venv-phoenix) for the trace export test (tests/answer/test_tracing.py,
# marker `tracing`). Installed when missing; once it is there, a trace test that cannot use it fails.
if log=$(mktemp -t ragbudget-phoenix-install.XXXXXX) && bash scripts/install_phoenix.sh >"$log" 2>&1; then
  export RAGBUDGET_REQUIRE_PHOENIX=${RAGBUDGET_REQUIRE_PHOENIX:-1}
else
  echo "warning: could not install Arize Phoenix (log: $log); the Phoenix trace test will skip" >&2
fi
# llama.cpp's servers (llama-cpp-python's and the native llama-server) for the engine tests
# (tests/engine, marker `engine`). Built once from PyPI's sdist and cached by version and
# CPU (about 15 min on 2 cores the first time, seconds after); once built, an engine test
# that cannot start its server fails instead of skipping.
if log=$(mktemp -t ragbudget-llama-install.XXXXXX) && bash scripts/install_llama_server.sh >"$log" 2>&1; then
  export RAGBUDGET_REQUIRE_ENGINE=${RAGBUDGET_REQUIRE_ENGINE:-1}
else
  echo "warning: could not build llama.cpp's server (log: $log); the engine tests will skip" >&2
fi
# The fleet tests make network namespaces (separate hosts on this machine); as root with `ip`
# they must run, so a namespace test that cannot make them fails instead of skipping.
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null 2>&1; then export RAGBUDGET_REQUIRE_NETNS=${RAGBUDGET_REQUIRE_NETNS:-1}; fi
ruff check .
mypy
python -m pytest "$@"
