#!/usr/bin/env bash
# Stop the Slurm test cluster of start_cluster.sh.
#
#   bash tests/cluster/stop_cluster.sh           # stop; keep state (job ids, DB, munge key)
#   bash tests/cluster/stop_cluster.sh --purge   # stop and delete $BASE entirely
#
# It stops only what start_cluster.sh started: the daemons named in $BASE's pid files (checked
# against the ORCH_SLURM_DAEMON_OF=$BASE marker in their environment), the processes left inside
# the node namespaces it recorded, and leftover slurmstepd/job tasks of this cluster. Running jobs
# are cancelled first. Every wait is bounded. Safe to run when nothing is running.
set -uo pipefail   # no -e: a stop must go on after any single failure

BASE=${BASE:-/tmp/orchestrator-slurm}
PURGE=0
for a in "$@"; do
  case "$a" in --purge) PURGE=1;; *) echo "usage: $0 [--purge]" >&2; exit 2;; esac
done
LOCK=/run/lock/orchestrator-slurm-cluster.lock

T0=$(date +%s%N)
log() { printf '[stop_cluster %5.1fs] %s\n' "$(( ($(date +%s%N) - T0) / 1000000 ))e-3" "$*"; }
# A pid file is "alive" when it names a running process that is ours: not a zombie (a killed
# daemon stays a zombie until PID 1 reaps it, and kill -0 still succeeds on it) and carrying the
# ORCH_SLURM_DAEMON_OF=$BASE marker every daemon we start has (a stale pid file whose number was
# reused by an unrelated process must not count, and must never be killed).
alive() {
  local pid state
  [ -s "$1" ] || return 1
  pid=$(cat "$1")
  state=$(ps -o stat= -p "$pid" 2>/dev/null) || return 1
  [[ "$state" != Z* ]] || return 1
  grep -qzx "ORCH_SLURM_DAEMON_OF=$BASE" "/proc/$pid/environ" 2>/dev/null
}

# Same machine-wide lock as start_cluster.sh (which holds it already when it calls us).
if [ "${ORCH_SLURM_LOCK_HELD:-0}" != 1 ]; then
  mkdir -p /run/lock
  exec 9>"$LOCK"
  flock -w 300 9 || { log "ERROR: $LOCK held for 5 minutes"; exit 1; }
fi

# True while a pid is a running process (a zombie has already let go of its ports and files).
running() { local st; st=$(ps -o stat= -p "$1" 2>/dev/null) && [[ "$st" != Z* ]]; }
wait_gone() {   # wait_gone SECONDS PID... -> 0 when all are gone
  local secs=$1 p left; shift
  local deadline=$(( $(date +%s%N) + secs * 1000000000 ))
  while :; do
    left=0
    for p in "$@"; do running "$p" && left=1; done
    [ $left = 0 ] && return 0
    [ "$(date +%s%N)" -lt "$deadline" ] || return 1
    sleep 0.1
  done
}
# SIGTERM the given pids together, wait up to SECONDS, then SIGKILL what is left.
term_then_kill() {   # term_then_kill SECONDS PID...
  local secs=$1; shift
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null
  wait_gone "$secs" "$@" && return 0
  log "SIGKILL after ${secs}s: $*"
  kill -KILL "$@" 2>/dev/null
  wait_gone 5 "$@"
  return 0
}
pids_from() { local f; for f in "$@"; do alive "$f" && cat "$f"; done; }

# 1. Cancel the jobs first, so that slurmd/slurmstepd clean up their tasks the normal way.
if alive "$BASE/run/slurmctld.pid"; then
  export SLURM_CONF=$BASE/etc/slurm.conf
  jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | sort -u | paste -sd' ')
  if [ -n "$jobs" ]; then
    log "cancelling jobs: $jobs"
    timeout 10 scancel $jobs 2>/dev/null
    # KillWait=10: tasks get SIGTERM, then SIGKILL 10 s later; give it a little more.
    deadline=$(( $(date +%s) + 15 ))
    while [ -n "$(timeout 5 squeue -h -o %A 2>/dev/null)" ] && [ "$(date +%s)" -lt "$deadline" ]; do
      sleep 0.2
    done
  fi
fi

# 2. The daemons, and their strays: ours by marker, command line or an open file under $BASE, but
# missing from the pid files after an unclean stop or a restart by hand.
strays() {
  local p
  for p in $(pgrep -x "$1"); do
    if grep -qzx "ORCH_SLURM_DAEMON_OF=$BASE" "/proc/$p/environ" 2>/dev/null ||
       tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -qF "$BASE/" ||
       ls -l "/proc/$p/fd" 2>/dev/null | grep -qF " $BASE/"; then
      echo "$p"
    fi
  done
}
stray_pids=$(for d in slurmd slurmctld slurmdbd mariadbd; do strays "$d"; done | paste -sd' ')
ours_munged=$(pids_from "$BASE/munge/munged.pid")
daemons=$(pids_from "$BASE"/run/slurmd-*.pid "$BASE/run/slurmctld.pid" "$BASE/run/slurmdbd.pid" \
                    "$BASE/run/mariadbd.pid" "$BASE/munge/munged.pid")
if [ "$PURGE" = 1 ]; then
  # The state is deleted next, so a graceful shutdown buys nothing, and it is slow: each of these
  # daemons takes 2-3 s to exit on SIGTERM (thread joins with timeouts, state saves).
  [ -n "$daemons" ] && kill -KILL $daemons 2>/dev/null
  wait_gone 10 $daemons
else
  # Graceful, in dependency order: slurmctld still reports to slurmdbd while it shuts down,
  # slurmdbd writes to MariaDB, and all of them authenticate through munged.
  term_then_kill 15 $(pids_from "$BASE"/run/slurmd-*.pid "$BASE/run/slurmctld.pid")
  term_then_kill 15 $(pids_from "$BASE/run/slurmdbd.pid")
  term_then_kill 15 $(pids_from "$BASE/run/mariadbd.pid" "$BASE/munge/munged.pid")
fi
# strays still running once the recorded daemons stopped
stray_pids=$(for p in $stray_pids; do running "$p" && echo "$p"; done | paste -sd' ')
if [ -n "$stray_pids" ]; then
  log "killing stray daemons of this cluster: $stray_pids"
  kill -KILL $stray_pids 2>/dev/null
  wait_gone 10 $stray_pids
fi

# A SIGKILLed munged leaves its socket behind, and munge clients then retry a dead socket for
# ~2 s before giving up; start_cluster.sh only started a munged when nobody served that socket,
# so when ours is gone the socket was ours.
if [ -n "$ours_munged" ] && ! running "$ours_munged"; then
  rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
fi

# 3. Leftovers: processes inside our node namespaces (job tasks whose slurmstepd died) ...
# The namespaces are the recorded ones plus any slurm-nI (this cluster's own names: a list lost in
# an unclean stop must not leave them behind), then the host sides vslI of their veth pairs.
{ cat "$BASE/run/netns.list" 2>/dev/null; ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^slurm-n[0-9]+$'; } |
  sort -u | while read -r ns; do
    [ -e "/run/netns/$ns" ] || continue
    left=$(ip netns pids "$ns" 2>/dev/null | paste -sd' ')
    [ -n "$left" ] && { log "killing leftovers in $ns: $left"; kill -KILL $left 2>/dev/null; }
    ip netns del "$ns" 2>/dev/null   # also removes the veth pair
  done
for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^vsl[0-9]+$'); do
  ip link del "$link" 2>/dev/null
done
ip link del slbr0 2>/dev/null
rm -f "$BASE/run/netns.list"
# ... and, outside namespaces (multislurmd mode), what is left of our jobs:
#  - slurmstepd: it overwrites its environment (process title), so no marker survives; but it
#    keeps its node's log, $BASE/logs/slurmd-nI.log, open.
#  - job tasks: Slurm puts SLURM_CONF=<our conf> and SLURMD_NODENAME into every task's
#    environment (the test runner may have SLURM_CONF too, but never SLURMD_NODENAME).
marked=()
for p in $(pgrep -x slurmstepd); do
  ls -l "/proc/$p/fd" 2>/dev/null | grep -q " $BASE/logs/slurmd-" && marked+=("$p")
done
# one grep over every /proc/PID/environ; -z: entries are NUL-separated
for env in $(grep -lzx "SLURM_CONF=$BASE/etc/slurm.conf" /proc/[0-9]*/environ 2>/dev/null); do
  p=${env#/proc/}; p=${p%/environ}
  [ "$p" != $$ ] && grep -qz '^SLURMD_NODENAME=' "$env" 2>/dev/null && running "$p" && marked+=("$p")
done
[ "${#marked[@]}" -gt 0 ] && { log "killing marked leftovers: ${marked[*]}"; kill -KILL "${marked[@]}" 2>/dev/null; }

# 4. Machine-wide edits: the /etc/hosts block and the /etc/slurm links (only if they are ours).
if grep -q '^# BEGIN orchestrator-slurm$' /etc/hosts; then
  # in place (cat >), /etc/hosts may be a bind mount
  sed '/^# BEGIN orchestrator-slurm$/,/^# END orchestrator-slurm$/d' /etc/hosts >"/tmp/.orch-hosts.$$" &&
    cat "/tmp/.orch-hosts.$$" >/etc/hosts
  rm -f "/tmp/.orch-hosts.$$"
fi
for f in slurm.conf slurmdbd.conf; do
  [ "$(readlink "/etc/slurm/$f" 2>/dev/null)" = "$BASE/etc/$f" ] && rm -f "/etc/slurm/$f"
done

rm -f "$BASE"/run/*.pid "$BASE/munge/munged.pid" "$BASE/cluster.env"

# 5. --purge: the whole state folder, but only one that start_cluster.sh created.
if [ "$PURGE" = 1 ] && [ -d "$BASE" ]; then
  if [ -e "$BASE/.orchestrator-slurm" ]; then
    rm -rf "$BASE"
  else
    log "not purging $BASE: no .orchestrator-slurm marker (not made by start_cluster.sh)"
  fi
fi
log "done${1:+ ($1)}"
