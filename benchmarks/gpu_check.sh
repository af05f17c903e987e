#!/usr/bin/env bash
# One GPU, ≤ 10 minutes, no package index: the trainer's bf16 MFU (SmolLM2-135M, and
# Qwen2.5-Coder-0.5B when given), the transformers engine's generation rate, the refresh check on
# CUDA (in memory and from disk) and a ZeRO-2 step, into one JSON file (benchmarks/gpu_check.py).
#
# Usage (from the repository root):
#   benchmarks/gpu_check.sh [--wheels DIR] [--out FILE] MODEL [MODEL2]
#
#   MODEL   an HF checkpoint directory (e.g. the converted SmolLM2 under ~/.cache/pivotrl/models/,
#           copied along) or a .gguf file (converted on the spot; gguf + accelerate needed).
#   --wheels DIR  a wheelhouse carried with the repository: a fresh venv is made with
#           `pip install --no-index --find-links DIR` of torch (a CUDA build), transformers,
#           deepspeed, pydantic, pyyaml, pandas, safetensors, gguf, accelerate and this project;
#           nothing is fetched from an index. Without --wheels the current `python` (or $PYTHON)
#           is used as it is and must already import torch with CUDA, transformers and deepspeed.
#   --out FILE    the JSON file (default: gpu_check.json).
#
# The whole run is bounded by `timeout 600`; the Python part stops starting new parts after
# 540 s and writes what it has measured so far after every part.
set -euo pipefail

WHEELS=""
OUT="gpu_check.json"
MODELS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) MODELS+=("$1"); shift ;;
  esac
done
if [[ ${#MODELS[@]} -eq 0 ]]; then
  echo "gpu_check.sh: give at least one model (HF checkpoint directory or .gguf file)" >&2
  exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

PY="${PYTHON:-python3}"
if [[ -n "$WHEELS" ]]; then
  if [[ ! -d "$WHEELS" ]]; then echo "gpu_check.sh: no wheelhouse at $WHEELS" >&2; exit 2; fi
  VENV="$(mktemp -d)/venv"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" \
    torch transformers deepspeed pydantic pyyaml pandas pyarrow safetensors gguf accelerate
  "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" --no-deps --no-build-isolation -e .
  PY="$VENV/bin/python"
fi
"$PY" - <<'EOF'
import torch, sys
if not torch.cuda.is_available():
    sys.exit(f"gpu_check.sh: torch {torch.__version__} sees no CUDA device")
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
EOF
ARGS=()
for m in "${MODELS[@]}"; do ARGS+=(--model "$m"); done
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 600 "$PY" benchmarks/gpu_check.py "${ARGS[@]}" --out "$OUT" --budget-s 540
echo "gpu_check.sh: wrote $OUT"
