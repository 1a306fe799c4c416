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
ruff check .
mypy
python -m pytest "$@"
