#!/usr/bin/env bash
# The main job, end to end on the real corpus: install, fetch and ingest the
# PostgreSQL 15.18 docs, calibrate, answer within a TTFT budget, ingest 15.20,
# replay an earlier receipt. Re-running skips what is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/ragbudget demo "$@"
