#!/usr/bin/env bash
# The next GPU run, in ONE call of at most 9 minutes on one GPU (issue 35's part f first, then the
# device-lean offload's GPU test, then issue 36's part a), each part under a time limit of its own so
# that a slow part cannot starve the next one. Rehearsed on a CPU by benchmarks/gpu_rehearsal.sh.
#
#   OUT=/some/dir bash benchmarks/gpu_run_next.sh          # docs/gpu.md: the device call that runs it
#
# 0. wheels/ must be here (git-ignored: carry it); without it, one line says what to do, exit 2;
# 1. install and build (benchmarks/gpu_run.sh install: carried wheels in groups, our C++ kernel);
# 2. DeepSpeedCPUAdam's JIT build, outside any limit: killed half-way, torch's build lock would
#    stay behind and block every later build;
# 3. part f (FT_LIMIT_F seconds, default 235; each of its three workers has its own share:
#    benchmarks/gpu_part_f.py F_BUDGET_S, counted from its launch), then tests/gpu's
#    single_offload_lean case alone (FT_LIMIT_T, default 75: the lean offload's CUDA path, side
#    streams and record_stream included), then part a with what is left of FT_TOTAL (default
#    530 s, at most FT_LIMIT_A, default 180); then part g (FT_LIMIT_G, default 210, outside FT_TOTAL:
#    benchmarks/gpu_part_g.py, issue 43).
#
# Every part writes its rows as it measures them, and its output as it comes, into a work folder
# ($FT_WORK, default /tmp/gpu_run_work). Every SYNC_S seconds (default 10) and at the end the work
# folder is packed into $OUT/gpu_run.tar.gz (atomically: a kill leaves the last whole one) and the
# parts' reports are joined into $OUT/gpu_results.md; memory snapshots go to $OUT gzipped, one file
# each. So $OUT holds few files (the device tool brings back 8), and a kill at any moment loses at
# most the last SYNC_S seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-gpu_results}
WORK=${FT_WORK:-/tmp/gpu_run_work}
SYNC_S=${SYNC_S:-10}
mkdir -p "$OUT_DIR" "$WORK"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

sync_out() {  # the work folder into $OUT: one archive, the joined report, the snapshots
  tar czf "$OUT_DIR/.gpu_run.tar.gz.tmp" --exclude='*.pickle' -C "$WORK" . 2>/dev/null \
    && mv -f "$OUT_DIR/.gpu_run.tar.gz.tmp" "$OUT_DIR/gpu_run.tar.gz"
  cat "$WORK"/part_*.md > "$OUT_DIR/.gpu_results.md.tmp" 2>/dev/null \
    && mv -f "$OUT_DIR/.gpu_results.md.tmp" "$OUT_DIR/gpu_results.md"
  for snap in "$WORK"/*.pickle; do
    [ -f "$snap" ] && [ ! -f "$OUT_DIR/$(basename "$snap").gz" ] && gzip -c "$snap" > "$OUT_DIR/$(basename "$snap").gz"
  done
  return 0
}
( while sleep "$SYNC_S"; do sync_out; done ) &
SYNCER=$!
finish() { kill "$SYNCER" 2>/dev/null; wait "$SYNCER" 2>/dev/null; sync_out; }
trap finish EXIT

if ! CHECK=$(PYTHON="$PY" bash benchmarks/gpu_run.sh check); then
  echo "== $CHECK" | tee "$WORK/wheels_check.log"
  echo "== stopped: nothing runs without the carried wheels (pydantic for the configs, DeepSpeed)"
  exit 2
fi
echo "== $CHECK" | tee "$WORK/wheels_check.log"
OUT="$WORK" PYTHON="$PY" bash benchmarks/gpu_run.sh install 2>&1 | tee "$WORK/install.log" | grep -E '^== |error|Error' | tail -12
echo "== installed after $(elapsed) s"
"$PY" - <<'PYEOF' 2>&1 | tee "$WORK/cpu_adam_build.log" | tail -3
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
  # timeout's TERM reaches gpu_suite.py, which kills its running worker's process group and
  # writes the report of what it had; every row is on disk as it comes anyway.
  # shellcheck disable=SC2086  # FT_SUITE_ARGS: more arguments (the CPU rehearsal's --tiny)
  timeout -k 15 "$limit" "$PY" benchmarks/gpu_suite.py --only "$name" --out "$WORK/part_$name.md" ${FT_SUITE_ARGS:-} \
    > "$WORK/part_$name.log" 2>&1
  echo "== part $name: exit $? after $(elapsed) s"
  tail -40 "$WORK/part_$name.log"
  sync_out
}
part f "${FT_LIMIT_F:-235}"
LIMIT_T=${FT_LIMIT_T:-75}
echo "== tests/gpu -k single_offload_lean: limit $LIMIT_T s, $(elapsed) s elapsed"
# The launch's own limit ends before `timeout`'s, so pytest reports with the launch's log.
FT_GPU_TESTS_LOG_DIR="$WORK" FT_GPU_TESTS_TIMEOUT=$(( LIMIT_T > 30 ? LIMIT_T - 15 : LIMIT_T )) \
  timeout -k 10 "$LIMIT_T" "$PY" -m pytest tests/gpu -ra -q -p no:cacheprovider -k single_offload_lean \
  > "$WORK/tests_lean.log" 2>&1
echo "== tests_lean: exit $? after $(elapsed) s"; tail -15 "$WORK/tests_lean.log"
sync_out
LEFT=$(( ${FT_TOTAL:-530} - $(elapsed) ))
part a $(( LEFT < ${FT_LIMIT_A:-180} ? LEFT : ${FT_LIMIT_A:-180} ))
# Part g (issue 43): a 1B decoder, the device-lean offload against DeepSpeed ZeRO-2 and ZeRO-3
# offload (benchmarks/gpu_part_g.py), FT_LIMIT_G seconds (default 210; under 30 skips it), outside
# FT_TOTAL: with it the call takes up to about 12.5 minutes (FT_LIMIT_F=0 FT_LIMIT_A=0 leave room).
LIMIT_G=${FT_LIMIT_G:-210}
if [ "$LIMIT_G" -ge 30 ]; then
  echo "== part g: limit $LIMIT_G s, $(elapsed) s elapsed"
  # shellcheck disable=SC2086  # FT_SUITE_ARGS: the CPU rehearsal's --tiny
  timeout -k 15 "$LIMIT_G" "$PY" benchmarks/gpu_part_g.py --out "$WORK/part_g.md" ${FT_SUITE_ARGS:-} \
    > "$WORK/part_g.log" 2>&1
  echo "== part g: exit $? after $(elapsed) s"; tail -20 "$WORK/part_g.log"
  sync_out
else
  echo "== part g: skipped (FT_LIMIT_G=$LIMIT_G)"
fi
echo "== done after $(elapsed) s: $OUT_DIR/gpu_results.md, everything in $OUT_DIR/gpu_run.tar.gz"
