#!/usr/bin/env bash
# Re-take the console screenshots in docs/ui/ from the browser tests (headless Chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
mkdir -p docs/ui
RAGBUDGET_UI_SCREENSHOTS="$PWD/docs/ui" RAGBUDGET_REQUIRE_BROWSER=1 python -m pytest -q tests/ui/test_browser.py "$@"
ls docs/ui
