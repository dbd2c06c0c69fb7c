#!/usr/bin/env bash
# Two workers on one host (A: HTTP 30000 / KVCR 47000, B: HTTP 30001 / KVCR 47100).
# Stops both on Ctrl-C. Extra arguments go to both launch_server commands.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PORT=${PORT_A:-30000} CONTROL_PORT=${CONTROL_A:-47000} "$here/launch_worker.sh" "$@" > worker_a.log 2>&1 &
a=$!
PORT=${PORT_B:-30001} CONTROL_PORT=${CONTROL_B:-47100} "$here/launch_worker.sh" "$@" > worker_b.log 2>&1 &
b=$!
trap 'kill $a $b 2>/dev/null; wait' INT TERM EXIT
echo "worker A pid $a (worker_a.log), worker B pid $b (worker_b.log)"
wait
