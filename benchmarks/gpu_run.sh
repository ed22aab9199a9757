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
#
# Environment: FT_WHEELS (wheel dir, default wheels), PYTHON (default python3), OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${FT_WHEELS:-wheels}
# Versions the suite was written against (the dev machine's): keep them in step with it.
DEEPSPEED_SPEC=${FT_DEEPSPEED_SPEC:-deepspeed==0.19.8}
PYDANTIC_SPEC=${FT_PYDANTIC_SPEC:-pydantic>=2,<3}
# deepspeed's requirements besides torch/numpy/packaging/tqdm (transformers brings those), pydantic's.
PURE_DEPS=(hjson py-cpuinfo einops nvidia-ml-py annotated-types typing-inspection typing-extensions)
BINARY_DEPS=(pydantic-core msgpack psutil)
# The GPU tests' runner, in case the machine has no pytest (installing one it has changes nothing).
TEST_DEPS=(pytest iniconfig pluggy pygments)

if [ "${1:-}" = "prepare" ]; then
  WHEELS=${2:-$WHEELS}
  mkdir -p "$WHEELS"
  # deepspeed is an sdist on PyPI: build it into a pure-python wheel here (ops are JIT-built on
  # the GPU machine when used; DS_BUILD_OPS=0), without its dependencies.
  DS_BUILD_OPS=0 "$PY" -m pip wheel --no-deps --no-build-isolation -w "$WHEELS" "$DEEPSPEED_SPEC"
  "$PY" -m pip download --no-deps --only-binary=:all: -d "$WHEELS" "$PYDANTIC_SPEC" "${PURE_DEPS[@]}" "${TEST_DEPS[@]}"
  # Compiled wheels for every Python the GPU machine might have (its version is not known here).
  for v in ${PYVERS:-3.10 3.11 3.12 3.13}; do
    "$PY" -m pip download --no-deps --only-binary=:all: -d "$WHEELS" --python-version "$v" \
      --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 "${BINARY_DEPS[@]}" "$PYDANTIC_SPEC"
  done
  # pydantic pins pydantic-core exactly: fetch the pinned one for each Python as well.
  core=$("$PY" - "$WHEELS" <<'EOF'
import re, sys, zipfile, pathlib
w = sorted(pathlib.Path(sys.argv[1]).glob("pydantic-2*.whl"))[-1]
meta = zipfile.ZipFile(w).read(next(n for n in zipfile.ZipFile(w).namelist() if n.endswith("METADATA"))).decode()
print(re.search(r"Requires-Dist: pydantic-core\s*\(?==\s*([\w.]+)", meta).group(1))
EOF
)
  for v in ${PYVERS:-3.10 3.11 3.12 3.13}; do
    "$PY" -m pip download --no-deps --only-binary=:all: -d "$WHEELS" --python-version "$v" \
      --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      "pydantic-core==$core"
  done
  du -sh "$WHEELS"; ls "$WHEELS"
  exit 0
fi

# `gpu_run.sh install`: steps 1 and 2 only (benchmarks/gpu_run_next.sh runs the parts itself).
INSTALL_ONLY=
if [ "${1:-}" = "install" ]; then INSTALL_ONLY=1; shift; fi
OUT_DIR=${OUT:-gpu_results}
mkdir -p "$OUT_DIR"
echo "== python: $("$PY" -c 'import sys; print(sys.version.split()[0])'), torch: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())')"
nvidia-smi -L 2>/dev/null || true

# 1. what the machine lacks, from the carried wheels only (no index is reachable there)
if [ -d "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --no-build-isolation \
    "$PYDANTIC_SPEC" "$DEEPSPEED_SPEC" "${PURE_DEPS[@]}" "${BINARY_DEPS[@]}" "${TEST_DEPS[@]}"
else
  echo "warning: no wheel directory $WHEELS: the DeepSpeed tests and benchmarks will be skipped/fail" >&2
fi

# 2. our package and its C++ kernel, built against this machine's torch (kept: FT_TORCH_SPEC empty);
#    --no-deps: the index-only extras (datasets, ray, ...) are not needed to train or test here.
"$PY" -m pip install -q --no-build-isolation --no-deps --no-index -e .
"$PY" -c "from ft_framework.optim import cpu; print('ft_framework installed; CPU kernel SIMD level:', cpu.simd_level())"
[ -n "$INSTALL_ONLY" ] && exit 0

# 3. the suite: tests/gpu + benchmarks a, b, c; report and logs under $OUT_DIR
"$PY" benchmarks/gpu_suite.py --out "$OUT_DIR/gpu_results.md" "$@" 2>&1 | tee "$OUT_DIR/gpu_suite.log"
exit "${PIPESTATUS[0]}"
