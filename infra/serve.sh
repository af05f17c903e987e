#!/usr/bin/env bash
# Starts a local Prefect server (UI on http://127.0.0.1:4200), creates the process work pool,
# deploys the nightly deployment of infra/prefect.yaml and runs a worker, in the foreground.
# Ctrl-C (or SIGTERM to this script) stops the worker, then the server, and waits for both to exit.
# PREFECT_SERVER_API_HOST / PREFECT_SERVER_API_PORT choose another address.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
HOST=${PREFECT_SERVER_API_HOST:-127.0.0.1}
PORT=${PREFECT_SERVER_API_PORT:-4200}
export PREFECT_API_URL=${PREFECT_API_URL:-http://$HOST:$PORT/api}
export PIVOTRL_HOME=${PIVOTRL_HOME:-$PWD}
# The server and the worker run in sessions of their own, so a Ctrl-C reaches this script only;
# the script then stops the worker's whole process group first (the worker, its child and any
# flow run it started) while the server still answers, then the server's, and waits for both.
SERVER=
WORKER=
alive() {  # alive PID: running and not a zombie awaiting its exit status
  local stat
  stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [ "${stat:0:1}" != Z ]
}
stop_group() {  # stop_group PID: SIGTERM to its process group, up to 30 s, then SIGKILL; reaps it
  [ -n "$1" ] || return 0
  kill -TERM -- "-$1" 2>/dev/null || return 0
  for _ in $(seq 1 60); do alive "$1" || break; sleep 0.5; done
  kill -KILL -- "-$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}
stop() {
  trap - INT TERM EXIT
  stop_group "$WORKER"
  stop_group "$SERVER"
}
trap stop EXIT
trap 'exit 130' INT TERM
setsid "$BIN/prefect" server start --host "$HOST" --port "$PORT" &
SERVER=$!
for _ in $(seq 1 90); do
  "$BIN/python" -c "import urllib.request; urllib.request.urlopen('$PREFECT_API_URL/health')" 2>/dev/null && break
  sleep 1
done
"$BIN/prefect" work-pool create pivotrl-process --type process --overwrite >/dev/null
"$BIN/prefect" --no-prompt deploy --prefect-file infra/prefect.yaml --all
echo "deployed; trigger a run now with: $BIN/prefect deployment run 'pivotrl-nightly/nightly'"
setsid "$BIN/prefect" worker start --pool pivotrl-process &
WORKER=$!
wait "$WORKER"
