#!/usr/bin/env bash
# The next GPU run, in ONE call of at most 9 minutes on one GPU (issue 35's part f first, then the
# device-lean offload's GPU test, then issue 36's part a), each part under a time limit of its own so
# that a slow part cannot starve the next one:
#
#   OUT=/some/dir bash benchmarks/gpu_run_next.sh
#
# 1. install and build (benchmarks/gpu_run.sh install: carried wheels, our C++ kernel);
# 2. DeepSpeedCPUAdam's JIT build, outside any limit: killed half-way, torch's build lock would
#    stay behind and block every later build;
# 3. part f (FT_LIMIT_F seconds, default 235; each of its three workers has its own share:
#    benchmarks/gpu_part_f.py F_BUDGET_S), then tests/gpu's single_offload_lean case (FT_LIMIT_T,
#    default 75: the lean offload's CUDA path, side streams and record_stream included), then part
#    a with what is left of FT_TOTAL (default 530 s, at most FT_LIMIT_A, default 180).
# Each part writes $OUT/part_<p>.md, .json and .log; $OUT/gpu_results.md joins the reports.
# Memory snapshots of rows the plan misses by > 10% land in $OUT too (pytorch.org/memory_viz).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-gpu_results}
mkdir -p "$OUT_DIR"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

OUT="$OUT_DIR" bash benchmarks/gpu_run.sh install 2>&1 | tee "$OUT_DIR/install.log" | tail -5
echo "== installed after $(elapsed) s"
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT_DIR/cpu_adam_build.log" | tail -3
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam

DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])
print("DeepSpeedCPUAdam built and loaded")
PYEOF
echo "== DeepSpeedCPUAdam ready after $(elapsed) s"

part() {  # part NAME LIMIT_SECONDS
  local name=$1 limit=$2
  if [ "$limit" -lt 30 ]; then echo "== part $name: skipped, ${limit} s left"; return; fi
  echo "== part $name: limit ${limit} s, $(elapsed) s elapsed"
  # timeout's TERM reaches gpu_suite.py, which kills its running worker's process group first.
  timeout -k 15 "$limit" "$PY" benchmarks/gpu_suite.py --only "$name" --out "$OUT_DIR/part_$name.md" \
    > "$OUT_DIR/part_$name.log" 2>&1
  echo "== part $name: exit $? after $(elapsed) s"
  tail -40 "$OUT_DIR/part_$name.log"
}
part f "${FT_LIMIT_F:-235}"
echo "== tests/gpu -k single_offload_lean: limit ${FT_LIMIT_T:-75} s, $(elapsed) s elapsed"
timeout -k 10 "${FT_LIMIT_T:-75}" "$PY" -m pytest tests/gpu -ra -q -p no:cacheprovider -k single_offload_lean \
  > "$OUT_DIR/tests_lean.log" 2>&1
echo "== tests_lean: exit $? after $(elapsed) s"; tail -15 "$OUT_DIR/tests_lean.log"
LEFT=$(( ${FT_TOTAL:-530} - $(elapsed) ))
part a $(( LEFT < ${FT_LIMIT_A:-180} ? LEFT : ${FT_LIMIT_A:-180} ))
cat "$OUT_DIR"/part_*.md > "$OUT_DIR/gpu_results.md" 2>/dev/null
echo "== done after $(elapsed) s: $OUT_DIR/gpu_results.md"
