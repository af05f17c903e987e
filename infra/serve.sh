#!/usr/bin/env bash
# Starts a local Prefect server (UI on http://127.0.0.1:4200), creates the process work pool,
# deploys the nightly deployment of infra/prefect.yaml and runs a worker, in the foreground.
# Ctrl-C stops the worker and the server.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
export PREFECT_API_URL=${PREFECT_API_URL:-http://127.0.0.1:4200/api}
export PIVOTRL_HOME=${PIVOTRL_HOME:-$PWD}
"$BIN/prefect" server start --host 127.0.0.1 --port 4200 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 60); do
  "$BIN/python" -c "import urllib.request; urllib.request.urlopen('$PREFECT_API_URL/health')" 2>/dev/null && break
  sleep 1
done
"$BIN/prefect" work-pool create pivotrl-process --type process --overwrite >/dev/null
"$BIN/prefect" --no-prompt deploy --prefect-file infra/prefect.yaml --all
echo "deployed; trigger a run now with: $BIN/prefect deployment run 'pivotrl-nightly/nightly'"
"$BIN/prefect" worker start --pool pivotrl-process
