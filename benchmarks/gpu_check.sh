#!/usr/bin/env bash
# One GPU, ≤ 10 minutes in all, no package index: the trainer's bf16 MFU (SmolLM2-135M, and
# Qwen2.5-Coder-0.5B when given), the transformers engine's generation rate, the refresh check on
# CUDA (in memory and from disk), the vLLM GPU engine (its start, its generation rate, and the
# trainer's weights pushed into the running engine in memory, its log-probs then checked against the
# trainer's) and a ZeRO-2 step, into one JSON file (benchmarks/gpu_check.py). Where `import vllm`
# fails, the vLLM step is skipped with one line saying so.
#
# Usage (from the repository root):
#   benchmarks/gpu_check.sh [--wheels DIR] [--out FILE] [MODEL [MODEL2]]
#
#   MODEL   an HF checkpoint directory (e.g. the converted SmolLM2 under ~/.cache/pivotrl/models/,
#           copied along), a .gguf file (converted on the spot; gguf + accelerate needed) or
#           shape:NAME (the architecture with random weights, no file needed; NAME = smollm2-135m
#           or qwen2.5-coder-0.5b). Default: shape:smollm2-135m.
#   --wheels DIR  a wheelhouse carried with the repository: a fresh venv is made with
#           `pip install --no-index --find-links DIR` of torch (a CUDA build), transformers,
#           deepspeed, pydantic, pyyaml, pandas, safetensors, gguf, accelerate (and vllm when the
#           wheelhouse has it) and this project; nothing is fetched from an index. Without --wheels
#           the current `python` (or $PYTHON) is used as it is (after `make install EXTRA=gpu`:
#           PYTHON=.venv/bin/python) and must already import torch with CUDA, transformers and deepspeed.
#   --out FILE    the JSON file (default: gpu_check.json).
#
# Exit status: 0 every part ran and every check passed; 1 a part failed or a check did not pass
# (named on the last line); 2 bad arguments; 3 a GPU is there but torch cannot use it;
# 77 no GPU on this machine (one line, nothing checked); 124 the 10-minute limit was reached
# (the JSON file holds what was measured until then).
#
# The whole run is bounded by GPU_CHECK_LIMIT_S (600 s) from its start: the Python part runs under
# `timeout` for what is left, and stops starting new parts 60 s before that.
set -euo pipefail
START=$SECONDS
LIMIT=${GPU_CHECK_LIMIT_S:-600}
left() { local n=$((LIMIT - (SECONDS - START))); echo $((n > 1 ? n : 1)); }  # timeout 0 = none

WHEELS=""
OUT="gpu_check.json"
MODELS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift 2 ;;
    --out) OUT="${2:?--out needs a file}"; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) MODELS+=("$1"); shift ;;
  esac
done
[[ ${#MODELS[@]} -gt 0 ]] || MODELS=("shape:smollm2-135m")
PY="${PYTHON:-python3}"

# No GPU: one line, exit 77, before anything is installed or imported.
no_gpu() { echo "gpu_check.sh: no GPU on this machine ($1); nothing checked" >&2; exit 77; }
case "${CUDA_VISIBLE_DEVICES-unset}" in
  ""|-1) no_gpu "CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES}' hides every device" ;;
esac
if command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  [[ "${GPUS:-0}" -gt 0 ]] || no_gpu "nvidia-smi lists no GPU"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
  GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || true)
  [[ "${GPUS:-0}" =~ ^[0-9]+$ && "${GPUS:-0}" -gt 0 ]] || no_gpu "no nvidia-smi, and $PY's torch sees no CUDA device"
fi

if [[ -n "$WHEELS" ]]; then
  if [[ ! -d "$WHEELS" ]]; then echo "gpu_check.sh: no wheelhouse at $WHEELS" >&2; exit 2; fi
  VENV="$(mktemp -d)/venv"
  python3 -m venv "$VENV"
  PKGS=(torch transformers deepspeed pydantic pyyaml pandas pyarrow safetensors gguf accelerate)
  compgen -G "$WHEELS/vllm-*.whl" >/dev/null && PKGS+=(vllm)
  timeout "$(left)" "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" "${PKGS[@]}"
  timeout "$(left)" "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" --no-deps --no-build-isolation -e .
  PY="$VENV/bin/python"
fi
"$PY" - <<'EOF' || exit 3
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"gpu_check.sh: a GPU is there but torch {torch.__version__} cannot use it (a CPU build, or no driver)")
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
EOF
ARGS=()
for m in "${MODELS[@]}"; do ARGS+=(--model "$m"); done
REMAINING=$(left)
BUDGET=$((REMAINING > 120 ? REMAINING - 60 : REMAINING / 2))
rc=0
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout -k 20 "$REMAINING" "$PY" benchmarks/gpu_check.py \
  "${ARGS[@]}" --out "$OUT" --budget-s "$BUDGET" || rc=$?
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
  echo "gpu_check.sh: stopped at the ${LIMIT}-s limit; what was measured until then is in $OUT" >&2
  exit 124
fi
echo "gpu_check.sh: wrote $OUT in $((SECONDS - START)) s"
exit $rc
