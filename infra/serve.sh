#!/usr/bin/env bash
# Starts a local Prefect server (UI on http://127.0.0.1:4200), creates the process work pool,
# deploys the nightly deployment of infra/prefect.yaml and runs a worker, in the foreground.
# Ctrl-C (or SIGTERM to this script) stops the worker, then the server, and waits for both to exit.
#
# The terminal shows what a person needs: the URLs, the deployment (schedule and config), where the
# logs are, and each flow run's start, stages, report and end (errors included). The server's and
# the worker's full output (every flow run's own log lines too) goes to files under
# $PIVOTRL_SERVE_LOGS (default runs/serve/): server.log, worker.log, deploy.log. The pinned server's
# SQLite "database is locked" tracebacks (a known race it retries, see infra/README.md) stay there.
#
# PREFECT_SERVER_API_HOST / PREFECT_SERVER_API_PORT choose another address; PIVOTRL_CONFIG (make
# serve CONFIG=...) the config the deployment's runs use (default configs/default.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
HOST=${PREFECT_SERVER_API_HOST:-127.0.0.1}
PORT=${PREFECT_SERVER_API_PORT:-4200}
export PREFECT_API_URL=${PREFECT_API_URL:-http://$HOST:$PORT/api}
export PIVOTRL_HOME=${PIVOTRL_HOME:-$PWD}
CONFIG=${PIVOTRL_CONFIG:-configs/default.yaml}
LOGS=${PIVOTRL_SERVE_LOGS:-runs/serve}
mkdir -p "$LOGS"
say() { printf '%s  %s\n' "$(date +%H:%M:%S)" "$*"; }
# The server and the worker run in sessions of their own, so a Ctrl-C reaches this script only;
# the script then stops the worker's whole process group first (the worker, its child and any
# flow run it started) while the server still answers, then the server's, and waits for both.
SERVER=
WORKER=
WATCH=
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
  [ -z "$SERVER" ] || say "stopping the worker and the server"
  stop_group "$WORKER"
  stop_group "$SERVER"
  stop_group "$WATCH"
  [ -z "$SERVER" ] || say "stopped (logs: $LOGS/)"
}
trap stop EXIT
trap 'exit 130' INT TERM

say "starting the Prefect server on http://$HOST:$PORT (log: $LOGS/server.log)"
setsid "$BIN/prefect" server start --host "$HOST" --port "$PORT" >>"$LOGS/server.log" 2>&1 &
SERVER=$!
ready=
for _ in $(seq 1 90); do
  if "$BIN/python" -c "import urllib.request; urllib.request.urlopen('$PREFECT_API_URL/health', timeout=2)" 2>/dev/null; then
    ready=1; break
  fi
  alive "$SERVER" || break
  sleep 1
done
if [ -z "$ready" ]; then
  say "the server did not come up; the end of $LOGS/server.log:"
  tail -n 20 "$LOGS/server.log"
  exit 1
fi
if ! { "$BIN/prefect" work-pool create pivotrl-process --type process --overwrite &&
       "$BIN/prefect" --no-prompt deploy --prefect-file infra/prefect.yaml --all --param "config_path=$CONFIG"; } \
       >>"$LOGS/deploy.log" 2>&1; then
  say "deploying failed; the end of $LOGS/deploy.log:"
  tail -n 20 "$LOGS/deploy.log"
  exit 1
fi
CRON=$(sed -n 's/^ *cron: *"\(.*\)".*/\1/p' infra/prefect.yaml | head -n 1)
cat <<EOF
$(date +%H:%M:%S)  ready
  UI          http://$HOST:$PORT   (runs: http://$HOST:$PORT/runs)
  API         $PREFECT_API_URL
  deployment  pivotrl-nightly/nightly: cron "$CRON" UTC, config_path=$CONFIG, work pool pivotrl-process
  run now     $BIN/prefect deployment run 'pivotrl-nightly/nightly'
  logs        $LOGS/server.log, $LOGS/worker.log (everything the server, the worker and its runs print)
  stop        Ctrl-C
EOF
setsid "$BIN/prefect" worker start --pool pivotrl-process >>"$LOGS/worker.log" 2>&1 &
WORKER=$!
say "worker started; waiting for runs (each run's start, stages, report and end are shown here)"
# What the terminal shows of the worker's log: a flow run's start and its link, the pipeline's stage
# lines, the report, the final state, errors, a crashed or failed process; time stamps shortened.
setsid bash -c "tail -n 0 -F '$LOGS/worker.log' 2>/dev/null | grep --line-buffered -E \
\"Flow run '[^']*' - (Beginning flow run|View at|report: |Finished in state)|\\[pivotrl\\] |\
\\| (ERROR|CRITICAL) +\\| Flow run|Reported flow run .* as crashed|exited with status code [1-9]\" \
| sed -u -E 's/^([0-9]{2}:[0-9]{2}:[0-9]{2})\\.[0-9]+ \\| [A-Z]+ +\\| /\\1  /; s/^\\[pivotrl\\] /          /'" &
WATCH=$!
wait "$WORKER"
