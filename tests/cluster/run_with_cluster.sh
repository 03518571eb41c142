#!/usr/bin/env bash
# Run a command against a fresh Slurm test cluster, and stop + purge the cluster afterwards,
# whatever happens (command fails, Ctrl-C, SIGTERM from a CI timeout).
#
#   bash tests/cluster/run_with_cluster.sh python -m pytest -m slurm tests/
#
# The command sees ORCHESTRATOR_TEST_CLUSTER=1 plus every line of $BASE/cluster.env
# (ORCHESTRATOR_TEST_CLUSTER_MODE, _NODES, _BASE, ..., SLURM_CONF). The exit status is the
# command's (128+N if it was killed by signal N), or 1 if the cluster did not start.
# BASE, NODES, MODE, ACCOUNTING, CRED_EXPIRE are passed on to start_cluster.sh.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARG...]" >&2; exit 2; }
export BASE=${BASE:-/tmp/orchestrator-slurm}

# One cluster per machine: a second run would wipe the first one's state (FRESH=1) under it. Wait
# for the holder (bounded), whoever it is. Only this script holds fd 9 (children get it closed), so
# the lock goes with this process, however it ends, and never with a daemon the cluster started.
exec 9>"${BASE}.lock"
flock -w "${CLUSTER_LOCK_WAIT_S:-3600}" 9 || { echo "run_with_cluster: another run holds ${BASE}.lock" >&2; exit 1; }

child=""
timer=""
cleanup() {
  local rc=$?
  trap '' INT TERM          # the stop is bounded; do not let a second Ctrl-C cut it short
  trap - EXIT
  [ -n "$timer" ] && kill "$timer" 2>/dev/null
  if [ -n "$child" ] && kill -0 "$child" 2>/dev/null; then kill -KILL "$child" 2>/dev/null; fi
  bash "$HERE/stop_cluster.sh" --purge 9>&- >&2 || echo "run_with_cluster: stop_cluster.sh failed" >&2
  exit "$rc"
}
trap cleanup EXIT

# Signals that arrive before the command runs just end the script (and the EXIT trap stops
# whatever was started).
trap 'exit 130' INT
trap 'exit 143' TERM

FRESH=1 bash "$HERE/start_cluster.sh" 9>&- >&2 || { echo "run_with_cluster: the cluster did not start" >&2; exit 1; }

set -a                       # export every variable the env file sets
# shellcheck disable=SC1091
. "$BASE/cluster.env"
set +a
export ORCHESTRATOR_TEST_CLUSTER=1

# Trap: bash runs no trap while it waits for a *foreground* command, so a SIGTERM (CI timeout)
# would wait for pytest to finish by itself. The command therefore runs in the background and
# we `wait` for it; signals are forwarded. `set -m` puts it in its own process group with the
# default SIGINT action: without it bash starts background commands with SIGINT ignored, and
# Python then never raises KeyboardInterrupt. (Side effect: the command is not in the terminal's
# foreground group, so interactive use of stdin - pytest --pdb - does not work through this.)
forward() {
  kill -s "$1" "$child" 2>/dev/null
  # A command that ignores the signal is killed after 30 s, so the cluster is stopped anyway.
  if [ -z "$timer" ]; then
    ( trap 'kill "$s" 2>/dev/null; exit 0' TERM; sleep 30 & s=$!; wait "$s"; kill -KILL "$child" 2>/dev/null ) &
    timer=$!
  fi
}
set -m
"$@" 9>&- &
child=$!
set +m
trap 'forward INT' INT
trap 'forward TERM' TERM

while :; do
  wait "$child"
  rc=$?
  # `wait` also returns when a trapped signal arrives; the command is done only when it is gone
  # (a finished-but-unreaped child still answers kill -0, and the next wait reaps it).
  kill -0 "$child" 2>/dev/null || break
done
child=""
exit "$rc"
