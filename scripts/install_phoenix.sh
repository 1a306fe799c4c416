#!/usr/bin/env bash
# Arize Phoenix's local trace server in its own virtual environment, .venv-phoenix, for the
# trace export test (tests/answer/test_tracing.py, marker `tracing`) and the tracing overhead
# benchmark. Phoenix is an OTLP receiver with a REST API to read the spans back; it is kept
# out of the project's environment (its dependency set is large and pinned apart).
#
# Idempotent: a stamp file records the installed version; a run with the stamp in place
# does nothing. An interrupted install leaves no stamp, so the next run installs again.
# Prints the server's Python on the last line.
#
#   bash scripts/install_phoenix.sh
#   .venv-phoenix/bin/python -m phoenix.server.main serve     # PHOENIX_PORT, PHOENIX_WORKING_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=20.26.1
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
venv=.venv-phoenix
stamp="$venv/.installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$VERSION" ]; then
  rm -f "$stamp"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  start=$(date +%s)
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "arize-phoenix==$VERSION"
  "$venv/bin/python" -c "import phoenix, phoenix.server.main; print('phoenix', phoenix.__version__)" >&2
  echo "installed in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
  echo "$VERSION" > "$stamp"
fi
echo "$(pwd)/$venv/bin/python"
