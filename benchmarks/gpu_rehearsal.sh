#!/usr/bin/env bash
# The next GPU window, rehearsed on a CPU: run it before any GPU run (issue 41). Run it from a clean
# clone with the carried wheels beside it, as the GPU machine gets them:
#
#   d=$(mktemp -d); git clone -q /path/to/ft_framework $d/repo; cp -r wheels $d/repo/
#   cd $d/repo && bash benchmarks/gpu_rehearsal.sh          # OUT=... for the results (default $d/repo/rehearsal_out)
#
# 1. A fresh venv holding only what the GPU machine has and we use: torch (CPU 2.13.0 here; CUDA
#    there), transformers, pybind11, scikit-build-core, cmake, ninja, and from its image scipy and
#    Triton (the newest here, for the interpreter; the machine's 3.6.0 compiles in step 3). Nothing
#    else: pydantic, DeepSpeed, pytest and the rest must come from the carried wheels.
# 2. benchmarks/gpu_run.sh install with that venv's python: the wheels' check, their install by
#    group with --no-index, our package built against this torch (as on the GPU machine).
# 3. The Triton kernel compiled for sm_90 by the GPU machine's Triton version (its PTX tests) and
#    the ast scan of its source.
# 4. benchmarks/gpu_run_next.sh itself, under its own time limits, every part as its CPU dry run
#    (FT_SUITE_ARGS=--tiny; the GPU tests' case on the CPU: FT_GPU_TESTS_DEVICE=cpu, the same -k),
#    then checks of what it left in $OUT: the joined report, the archive, every part's rows.
#
# Prints one line per check, PASS or FAIL, and the seconds each step took; exit 0 when all pass.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT_DIR=${OUT:-$REPO/rehearsal_out}
VENV=${REHEARSAL_VENV:-$(mktemp -d)/venv}
BASE_PY=${PYTHON:-python3}
TORCH_SPEC=${FT_REHEARSAL_TORCH:-torch==2.13.0}
# The GPU machine's Triton (3.6.0 when last seen) compiles the kernel in step 3; the venv holds the
# newest for the dry run's interpreter (Triton 3.6's interpreter cannot run the kernel's loop:
# its scalar loads are 1-element arrays, which range() refuses; the GPU compiles, never interprets).
GPU_TRITON_SPEC=${FT_REHEARSAL_TRITON:-triton==3.6.0}
mkdir -p "$OUT_DIR"
# DeepSpeedCPUAdam's JIT build lands here, not in the user's torch extension cache (which the
# machine's own environment shares: a build against this venv's torch would replace its op)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(dirname "$VENV")/torch_extensions}
# A CPU rehearsal: DeepSpeed's CPU accelerator, the GPU tests' cases on the CPU (gloo), one thread each
export DS_ACCELERATOR=cpu FT_GPU_TESTS_DEVICE=cpu OMP_NUM_THREADS=1
LOG=$OUT_DIR/rehearsal.log
: > "$LOG"
START=$(date +%s)
FAILED=0
step_start=$START
step() { local now; now=$(date +%s); echo "== $1 ($(( now - step_start )) s, $(( now - START )) s in all)" | tee -a "$LOG"; step_start=$now; }
check() {  # check DESCRIPTION COMMAND...
  local what=$1; shift
  if "$@" >> "$LOG" 2>&1; then echo "PASS $what" | tee -a "$LOG"; else echo "FAIL $what" | tee -a "$LOG"; FAILED=1; fi
}

# 1. the GPU machine's packages, nothing more
"$BASE_PY" -m venv "$VENV" >> "$LOG" 2>&1
PY=$VENV/bin/python
"$PY" -m pip install -q "$TORCH_SPEC" transformers pybind11 scikit-build-core cmake ninja scipy "triton>=3.4" >> "$LOG" 2>&1
# A newer transformers than the GPU machine's brings pydantic along (through typer): out again, so
# that only the carried wheels can bring what the machine lacks.
"$PY" -m pip uninstall -y -q pydantic pydantic-core annotated-types typing-inspection >> "$LOG" 2>&1
check "venv with only the GPU machine's packages ($("$PY" -c 'import torch, sys; print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")' 2>/dev/null))" \
  "$PY" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('pydantic', 'deepspeed', 'pytest', 'xxhash')))"
step "venv built"

# 2. the carried wheels and the build, as on the GPU machine
check "gpu_run.sh install: every wheel group installed from wheels/ alone, package built" \
  bash -c "OUT='$OUT_DIR/install' PYTHON='$PY' bash benchmarks/gpu_run.sh install | tee '$OUT_DIR/install.txt' && ! grep -q FAILED '$OUT_DIR/install.txt'"
check "the package loads its config (pydantic) and its C++ kernel" \
  "$PY" -c "import deepspeed, pydantic; from ft_framework.optim import cpu; from ft_framework.config import load_config; print(cpu.simd_level())"
step "installed"
# DeepSpeedCPUAdam's op, built here first: this host compiles it in minutes on 2 cores, which the
# window's budget (FT_TOTAL, from the window's start) would take from part a; the window's own build
# step then finds it built, as on a GPU host that compiles it in seconds. Its time is in the log.
check "DeepSpeedCPUAdam's op built (JIT, outside the window)" \
  "$PY" -c "import torch; from deepspeed.ops.adam import DeepSpeedCPUAdam; DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])"
step "DeepSpeedCPUAdam built"

# 3. the Triton kernel as the GPU machine's Triton compiles it (no device needed to compile)
GPU_TRITON=$(dirname "$VENV")/gpu_triton
"$PY" -m pip install -q --no-deps --target "$GPU_TRITON" "$GPU_TRITON_SPEC" >> "$LOG" 2>&1
check "Triton kernel source and PTX for sm_90 ($(PYTHONPATH=$GPU_TRITON "$PY" -c 'import triton; print("triton", triton.__version__)' 2>/dev/null))" \
  env PYTHONPATH="$GPU_TRITON" "$PY" -m pytest -q -p no:cacheprovider tests/unit/optim/test_triton_kernel_source.py \
  tests/unit/optim/test_triton_step.py -k "source or scan or compiled_kernel or aligned"
step "Triton checked"

# 4. the window's script itself, every part its CPU dry run, under the script's own limits
WINDOW_OUT=$OUT_DIR/window
rm -rf "$WINDOW_OUT" "$OUT_DIR/work"
OUT="$WINDOW_OUT" FT_WORK="$OUT_DIR/work" PYTHON="$PY" FT_SUITE_ARGS=--tiny \
  bash benchmarks/gpu_run_next.sh > "$OUT_DIR/window.txt" 2>&1
echo "gpu_run_next.sh exit $?" >> "$OUT_DIR/window.txt"
step "gpu_run_next.sh ran"
W=$OUT_DIR/work
check "window: the -k selection plans the one case" \
  bash -c "FT_GPU_TESTS_DEVICE=cpu '$PY' -m pytest tests/gpu --collect-only -q -p no:cacheprovider -k single_offload_lean | grep -qx 'gpu launches: python: single_offload_lean'"
check "window: wheels checked, every group installed" bash -c "grep -q 'holds all' '$W/wheels_check.log' && ! grep -q FAILED '$W/install.log'"
check "window: part f, three rows measured, none failed" "$PY" - "$W/part_f.json" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["f"]["rows"]
assert len(rows) == 3 and all(r.get("iter_ms") and not r.get("error") for r in rows), rows
assert all(r["cap"]["largest_batch"] for r in rows), [r["cap"] for r in rows]
EOF
check "window: tests/gpu -k single_offload_lean passed in its limit, its launch log kept" \
  bash -c "tail -1 '$W/tests_lean.log' | grep -qE '^[0-9]+ passed' && ! tail -1 '$W/tests_lean.log' | grep -qE 'failed|error' && test -s '$W/launch_python.log'"
check "window: part a, bits first, every check bit-equal, every timing row" "$PY" - "$W/part_a.json" <<'EOF'
import json, sys
a = json.load(open(sys.argv[1]))["a"]
assert len(a["bit_equality"]) == 16 and all(x.get("equal") for x in a["bit_equality"]), a["bit_equality"]
assert len(a["candidates"]) >= 6 and not a.get("error"), (a.get("error"), [c["name"] for c in a["candidates"]])
EOF
check "window: part g, three candidates trained to the end, none failed" "$PY" - "$W" <<'EOF'
import json, pathlib, sys
files = sorted(pathlib.Path(sys.argv[1]).glob("part_g_g*.rows.jsonl"))
last = [[json.loads(line) for line in f.read_text().splitlines()][-1] for f in files]
assert len(last) == 3 and all(r["stage"] == "done" and r.get("tokens_per_s") and not r.get("error") for r in last), last
EOF
check "window: \$OUT holds the joined report and one archive (the device tool brings back 8 files)" \
  bash -c "grep -q '## f. ' '$WINDOW_OUT/gpu_results.md' && grep -q '## a. ' '$WINDOW_OUT/gpu_results.md' \
           && tar tzf '$WINDOW_OUT/gpu_run.tar.gz' | grep -q part_f.json && [ \$(ls -A '$WINDOW_OUT' | wc -l) -le 8 ]"
step "checked"
grep '^== ' "$OUT_DIR/window.txt" | tee -a "$LOG"
if [ "$FAILED" = 0 ]; then echo "REHEARSAL PASSED in $(( $(date +%s) - START )) s" | tee -a "$LOG"; else
  echo "REHEARSAL FAILED in $(( $(date +%s) - START )) s (details: $LOG, $OUT_DIR/window.txt)" | tee -a "$LOG"; fi
exit "$FAILED"
