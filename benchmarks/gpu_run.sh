#!/usr/bin/env bash
# The GPU suite in one command on a GPU machine that has CUDA torch, transformers, pybind11,
# scikit-build-core, cmake and ninja but no deepspeed/pydantic and no package index:
#
#   bash benchmarks/gpu_run.sh                 # install from ./wheels, build, run everything
#   bash benchmarks/gpu_run.sh --only tests    # any gpu_suite.py arguments pass through
#
# It installs the missing packages from a carried wheel directory (no index), builds our C++
# extension against the machine's own torch (FT_TORCH_SPEC empty: torch is kept), and runs
# benchmarks/gpu_suite.py with the report under $OUT (or ./gpu_results when $OUT is unset).
#
# On the development machine (with an index), fill the wheel directory first:
#
#   bash benchmarks/gpu_run.sh prepare [DIR]   # default DIR=wheels; PYVERS="3.10 3.11 3.12 3.13"
#   bash benchmarks/gpu_run.sh check           # does ./wheels hold everything for this Python? (one line)
#
# Environment: FT_WHEELS (wheel dir, default wheels), PYTHON (default python3), OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${FT_WHEELS:-wheels}
# Versions the suite was written against (the dev machine's): keep them in step with it.
DEEPSPEED_SPEC=${FT_DEEPSPEED_SPEC:-deepspeed==0.19.8}
PYDANTIC_SPEC=${FT_PYDANTIC_SPEC:-pydantic>=2,<3}
# What the GPU machine lacks, in install groups: a group that fails (a wheel missing) leaves the
# others installed, and each says so in one line. The machine has CUDA torch (with its triton),
# transformers, numpy, pyyaml, scipy, pybind11, scikit-build-core, cmake and ninja;
# benchmarks/gpu_rehearsal.sh builds a CPU venv of that and installs these from the wheels alone.
CONFIG_WHEELS=("$PYDANTIC_SPEC" pydantic-core annotated-types typing-inspection typing-extensions)  # load_config
# deepspeed and its requirements besides torch/numpy/packaging/tqdm/pydantic (ninja: its JIT ops build with it)
DEEPSPEED_WHEELS=("$DEEPSPEED_SPEC" hjson py-cpuinfo einops nvidia-ml-py msgpack psutil ninja)
TEST_WHEELS=(pytest iniconfig pluggy pygments packaging)  # the GPU tests' runner
OTHER_WHEELS=(xxhash)                                      # run fingerprints (ft_framework.run)
# The ones with compiled code: fetched for every Python the GPU machine might have (PYVERS).
BINARY=(pydantic-core msgpack psutil xxhash ninja)
PLATFORMS=(manylinux_2_5_x86_64 manylinux1_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64)
ALL_WHEELS=("${CONFIG_WHEELS[@]}" "${DEEPSPEED_WHEELS[@]}" "${TEST_WHEELS[@]}" "${OTHER_WHEELS[@]}")
CARRY_HINT="on a machine with a package index run 'bash benchmarks/gpu_run.sh prepare wheels', then carry the folder: run(..., carry=[\"wheels\"])"

# `gpu_run.sh check`: whether $WHEELS holds a wheel of every package above for this machine's
# Python (pip resolves each against the folder alone and installs nothing). One line either way.
check_wheels() {
  if [ ! -d "$WHEELS" ]; then
    echo "wheels: no folder $WHEELS here (git-ignored: a copy of the checkout leaves it behind); $CARRY_HINT"
    return 2
  fi
  local out
  if out=$("$PY" -m pip install --dry-run --ignore-installed --no-deps --no-index --find-links "$WHEELS" \
             -q "${ALL_WHEELS[@]}" 2>&1); then
    echo "wheels: $WHEELS holds all ${#ALL_WHEELS[@]} packages for Python $("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  else
    echo "wheels: $WHEELS is incomplete for this Python ($(echo "$out" | grep -m1 -E 'No matching distribution|ERROR' | sed 's/^ERROR: //')); $CARRY_HINT"
    return 2
  fi
}

if [ "${1:-}" = "prepare" ]; then
  WHEELS=${2:-$WHEELS}
  mkdir -p "$WHEELS"
  rm -f "$WHEELS"/*.whl  # one version of each: a fresh set
  # deepspeed is an sdist on PyPI: build it into a pure-python wheel here (ops are JIT-built on
  # the GPU machine when used; DS_BUILD_OPS=0), without its dependencies.
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$DEEPSPEED_SPEC"
  pure=()
  for spec in "${ALL_WHEELS[@]}"; do
    case " ${BINARY[*]} " in *" $spec "*) ;; *) [[ $spec == deepspeed* ]] || pure+=("$spec") ;; esac
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "${pure[@]}"
  # Compiled wheels for every Python the GPU machine might have (3.12 when last seen there);
  # pydantic pins pydantic-core exactly: the pinned one.
  core=$("$PY" - "$WHEELS" <<'EOF'
import re, sys, zipfile, pathlib
w = sorted(pathlib.Path(sys.argv[1]).glob("pydantic-2*.whl"))[-1]
meta = zipfile.ZipFile(w).read(next(n for n in zipfile.ZipFile(w).namelist() if n.endswith("METADATA"))).decode()
print(re.search(r"Requires-Dist: pydantic-core\s*\(?==\s*([\w.]+)", meta).group(1))
EOF
)
  plat=(); for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  binary=("${BINARY[@]/#pydantic-core/pydantic-core==$core}")
  for v in ${PYVERS:-3.10 3.11 3.12 3.13}; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" --python-version "$v" \
      --implementation cp "${plat[@]}" "${binary[@]}"
  done
  du -sh "$WHEELS"; ls "$WHEELS"
  check_wheels
  exit $?
fi
if [ "${1:-}" = "check" ]; then
  check_wheels
  exit $?
fi

# `gpu_run.sh install`: steps 1 and 2 only (benchmarks/gpu_run_next.sh runs the parts itself).
INSTALL_ONLY=
if [ "${1:-}" = "install" ]; then INSTALL_ONLY=1; shift; fi
OUT_DIR=${OUT:-gpu_results}
mkdir -p "$OUT_DIR"
echo "== python: $("$PY" -c 'import sys; print(sys.version.split()[0])'), torch: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())')"
nvidia-smi -L 2>/dev/null || true

# 1. what the machine lacks, from the carried wheels only (no index is reachable there), a group at
#    a time: a group that fails says so and the rest still install (pip's output: $OUT_DIR/pip_<group>.log)
install_group() {  # install_group NAME SPEC...
  local name=$1; shift
  if "$PY" -m pip install --no-index --find-links "$WHEELS" --no-build-isolation "$@" > "$OUT_DIR/pip_$name.log" 2>&1; then
    echo "== wheels: $name installed ($*)"
  else
    echo "== wheels: $name FAILED: $(grep -m1 'ERROR' "$OUT_DIR/pip_$name.log" | sed 's/^ERROR: //') ($OUT_DIR/pip_$name.log)"
  fi
}
check_wheels || true
if [ -d "$WHEELS" ]; then
  install_group config "${CONFIG_WHEELS[@]}"
  install_group deepspeed "${DEEPSPEED_WHEELS[@]}"
  install_group tests "${TEST_WHEELS[@]}"
  install_group other "${OTHER_WHEELS[@]}"
fi

# 2. our package and its C++ kernel, built against this machine's torch (kept: FT_TORCH_SPEC empty);
#    --no-deps: the index-only extras (datasets, ray, ...) are not needed to train or test here.
"$PY" -m pip install -q --no-build-isolation --no-deps --no-index -e .
"$PY" -c "from ft_framework.optim import cpu; print('ft_framework installed; CPU kernel SIMD level:', cpu.simd_level())"
[ -n "$INSTALL_ONLY" ] && exit 0

# 3. the suite: tests/gpu + benchmarks a, b, c; report and logs under $OUT_DIR
"$PY" benchmarks/gpu_suite.py --out "$OUT_DIR/gpu_results.md" "$@" 2>&1 | tee "$OUT_DIR/gpu_suite.log"
exit "${PIPESTATUS[0]}"
