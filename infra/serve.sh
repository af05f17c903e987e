#!/usr/bin/env bash
# Starts a local Prefect server (UI on http://127.0.0.1:4200), creates the process work pool,
# deploys the nightly deployment of infra/prefect.yaml and runs a worker, in the foreground.
# Ctrl-C stops the worker, then the server, and waits for both to exit.
# PREFECT_SERVER_API_HOST / PREFECT_SERVER_API_PORT choose another address.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
HOST=${PREFECT_SERVER_API_HOST:-127.0.0.1}
PORT=${PREFECT_SERVER_API_PORT:-4200}
export PREFECT_API_URL=${PREFECT_API_URL:-http://$HOST:$PORT/api}
export PIVOTRL_HOME=${PIVOTRL_HOME:-$PWD}
# The server runs in its own session, so a Ctrl-C reaches this script and the worker only: the
# worker (in the foreground) stops first while the server still answers it, then the EXIT trap
# stops the server.
SERVER=
alive() {  # alive PID: running and not a zombie awaiting its exit status
  local stat
  stat=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
  [ "${stat:0:1}" != Z ]
}
stop_server() {  # SIGTERM, up to 30 s, then SIGKILL; reaps it
  trap - EXIT
  [ -n "$SERVER" ] || return 0
  kill -TERM "$SERVER" 2>/dev/null || return 0
  for _ in $(seq 1 60); do alive "$SERVER" || break; sleep 0.5; done
  if alive "$SERVER"; then kill -KILL "$SERVER" 2>/dev/null || true; fi
  wait "$SERVER" 2>/dev/null || true
}
trap stop_server EXIT
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
# In the foreground: a background job of a script would ignore SIGINT, and so would the worker's
# own child process, which then never stops.
"$BIN/prefect" worker start --pool pivotrl-process
