#!/usr/bin/env bash
# Start the project's real Slurm test cluster on this one machine (run as root).
#
# What it starts (every daemon from Debian's Slurm 22.05 packages, all state under $BASE):
#   munged      authentication for every Slurm message (default socket /run/munge/munge.socket.2)
#   mariadbd    a throw-away database for slurmdbd (127.0.0.1:16033, no fsync)
#   slurmdbd    accounting, so `sacct` works
#   slurmctld   the controller (10.77.0.1 in netns mode)
#   slurmd      one per node n1..nN
#
# Modes (MODE=auto picks netns when the kernel lets us create namespaces):
#   netns        every node has its own network + UTS namespace: hostname nI, address 10.77.0.(10+I)
#                on bridge slbr0 (controller 10.77.0.1), so a multi-node job really crosses a network.
#   multislurmd  fallback: several slurmd on loopback (127.0.0.11, ...; ports 17001, ...); every node
#                has the machine's hostname, use $SLURMD_NODENAME to tell them apart.
#
# Environment:
#   BASE=/tmp/orchestrator-slurm  state folder (configs, logs, spool, database, munge key)
#   NODES=3        nodes in partition `debug` (3: a 2-node job plus a spare node for requeue tests)
#   MODE=auto      auto | netns | multislurmd
#   ACCOUNTING=1   1: MariaDB + slurmdbd (sacct works); 0: no accounting (faster, no sacct)
#   FRESH=0        1: stop the cluster and wipe its state first (job ids restart at 1)
#   NODE_CPUS      CPUs declared per node (default max(8, 2 x real cores), see "CPUs" below)
#   NODE_MEM_MB=4096  RealMemory declared per node
#   CRED_EXPIRE=10 AuthInfo cred_expire in seconds; "default" leaves AuthInfo out (Slurm's 120 s,
#                  what a production cluster has: bench/bench_requeue.py measures both)
#   GPU_NODES=2    the last GPU_NODES nodes (at most NODES; 0: none) declare GRES GPUs that are no
#                  GPU: Gres=gpu:$GPU_TYPE:$GPUS_PER_NODE in slurm.conf, gres.conf's File= names
#                  placeholder devices (see "GPUs" below). Slurm schedules --gres/--gpus-per-node
#                  jobs there; the nodes still have no GPU (what profiles init and the doctor are
#                  tested against). Jobs that ask for no GPU are placed and run as on other nodes.
#   GPU_TYPE=a100  GPUS_PER_NODE=2  the GRES type and count of those nodes
#
# Idempotent: running it again leaves running daemons alone and (re)starts what is missing, e.g. a
# slurmd a test killed. If the generated slurm.conf or gres.conf changed (other NODES, MODE or
# GPU_NODES...), the cluster is stopped (jobs cancelled) and started again with the new config.
#
# On success it writes $BASE/cluster.env (ORCHESTRATOR_TEST_CLUSTER_* lines, SLURM_CONF) for tests.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BASE=${BASE:-/tmp/orchestrator-slurm}
NODES=${NODES:-3}
MODE=${MODE:-auto}
ACCOUNTING=${ACCOUNTING:-1}
FRESH=${FRESH:-0}
NODE_MEM_MB=${NODE_MEM_MB:-4096}
CRED_EXPIRE=${CRED_EXPIRE:-10}
GPU_NODES=${GPU_NODES:-2}
GPU_TYPE=${GPU_TYPE:-a100}
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
NET=10.77.0            # netns mode: bridge slbr0 = $NET.1, node nI = $NET.(10+I)
DB_PORT=16033          # our MariaDB; never the system's 3306
CLUSTER_NAME=orchestrator
PARTITION=debug
LOCK=/run/lock/orchestrator-slurm-cluster.lock

T0=$(date +%s%N)
log() { printf '[start_cluster %5.1fs] %s\n' "$(( ($(date +%s%N) - T0) / 1000000 ))e-3" "$*"; }
die() { log "ERROR: $*"; exit 1; }
# `set -e` ends the script at a failed command without a word; say which one it was.
trap 'log "ERROR: line $LINENO: \"$BASH_COMMAND\" failed (exit $?)"' ERR
show_log() { echo "--- last lines of $1:"; tail -n 20 "$1" 2>/dev/null || true; }
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
# Poll a condition with a deadline (seconds); never sleep as synchronisation.
wait_until() {
  local secs=$1 what=$2; shift 2
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || { log "timed out after ${secs}s waiting for $what"; return 1; }
    sleep 0.1
  done
}
port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }
# strays NAME PIDFILE: pids of running NAME processes that belong to this cluster but are not the
# one in its pid file (an unclean stop lost the pid file, or a daemon was restarted by hand). Ours
# means: the ORCH_SLURM_DAEMON_OF=$BASE marker, a command line naming $BASE, or an open file under
# $BASE (every daemon keeps its log there). Anybody else's daemon of the same name never matches.
strays() {
  local p
  for p in $(pgrep -x "$1"); do
    [ "$(cat "$2" 2>/dev/null)" = "$p" ] && continue
    if grep -qzx "ORCH_SLURM_DAEMON_OF=$BASE" "/proc/$p/environ" 2>/dev/null ||
       tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -qF "$BASE/" ||
       ls -l "/proc/$p/fd" 2>/dev/null | grep -qF " $BASE/"; then
      echo "$p"
    fi
  done
}
# Before (re)starting a daemon: end its strays, which would hold its port or files and make it exit
# at start-up ("slurmdbd exited during start-up" while an orphaned slurmdbd still ran).
end_strays() {   # end_strays NAME PIDFILE
  local left deadline
  left=$(strays "$1" "$2" | paste -sd' ')
  [ -n "$left" ] || return 0
  log "ending stray $1 of this cluster: $left"
  kill -KILL $left 2>/dev/null || true
  # Wait for the killed pids themselves, not for strays() to stop naming them: a dying process loses
  # its memory (so /proc/PID/environ, which strays() reads) before it closes its files, and in that
  # window it still holds its port; the new daemon then "exited during start-up". A process has closed
  # everything once it is gone or a zombie.
  deadline=$(( $(date +%s) + 10 ))
  while [ "$(date +%s)" -lt "$deadline" ] && ! all_ended $left; do sleep 0.1; done
}
all_ended() {   # all_ended PID...: each is gone or a zombie (its files and sockets closed)
  local p state
  for p in "$@"; do
    state=$(ps -o stat= -p "$p" 2>/dev/null) || continue
    [[ "$state" == Z* ]] || return 1
  done
}
# Start a daemon in the foreground (-D) in its own session (setsid: a Ctrl-C aimed at the test run
# must not reach it) and record its pid ourselves, so that a daemon dying during start-up (bad
# config, port taken) is reported at once with its log instead of after a timeout.
# Trap: "9>&-" - daemons inherit open file descriptors, and one holding fd 9 (the lock below)
# would hold the lock for as long as it runs.
launch() {   # launch PIDFILE OUTFILE COMMAND...
  local pidfile=$1 out=$2; shift 2
  rm -f "$pidfile"   # a stale one (its daemon SIGKILLed) must not name a reused pid meanwhile
  # The marker lets alive() and stop_cluster.sh tell our daemons from anybody else's (see
  # alive()); it is set on the daemons only, never exported to this script.
  ORCH_SLURM_DAEMON_OF=$BASE setsid "$@" </dev/null >>"$out" 2>&1 9>&- &
  echo $! >"$pidfile"
}
# The pid we just launched ourselves: running and not a zombie. Not alive(): until the forked shell
# has exec'd the daemon, /proc/PID/environ is still the shell's, without the marker, and a loaded
# machine made that window long enough to report "exited during start-up" for a daemon that ran.
running() {
  local state
  [ -s "$1" ] || return 1
  state=$(ps -o stat= -p "$(cat "$1")" 2>/dev/null) || return 1
  [[ "$state" != Z* ]]
}
wait_daemon() {   # wait_daemon SECONDS NAME PIDFILE LOGFILE CONDITION...
  local secs=$1 what=$2 pidfile=$3 logf=$4; shift 4
  local deadline=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    # The daemon's own output (LOGFILE with .out) holds what it printed before it opened its log.
    running "$pidfile" || { show_log "$logf"; show_log "${logf%.log}.out"; die "$what exited during start-up (log: $logf)"; }
    [ "$(date +%s)" -lt "$deadline" ] || { show_log "$logf"; die "$what not ready after ${secs}s (log: $logf)"; }
    sleep 0.1
  done
}

[ "$(id -u)" = 0 ] || die "must run as root (it creates namespaces, edits /etc/hosts, starts daemons)"
[[ "$NODES" =~ ^[0-9]+$ ]] && [ "$NODES" -ge 1 ] && [ "$NODES" -le 40 ] || die "NODES must be 1..40"
case "$MODE" in auto|netns|multislurmd) ;; *) die "MODE must be auto, netns or multislurmd";; esac
[[ "$CRED_EXPIRE" =~ ^([0-9]+|default)$ ]] || die "CRED_EXPIRE must be a number of seconds or 'default'"
[[ "$GPU_NODES" =~ ^[0-9]+$ ]] || die "GPU_NODES must be a number of nodes (0: none)"
[[ "$GPU_TYPE" =~ ^[a-z0-9_]+$ ]] || die "GPU_TYPE must be a GRES type name (lower case letters, digits, _)"
[[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]?$ ]] || die "GPUS_PER_NODE must be 1..99"
[ "$GPU_NODES" -le "$NODES" ] || GPU_NODES=$NODES
FIRST_GPU_NODE=$(( NODES - GPU_NODES + 1 ))   # nodes FIRST_GPU_NODE..NODES have the GRES
if [ "$CRED_EXPIRE" = default ]; then AUTH_LINE="# AuthInfo left at Slurm's default (cred_expire=120)"
else AUTH_LINE="AuthInfo=cred_expire=$CRED_EXPIRE"; fi

# BASE is deleted by `stop_cluster.sh --purge` (FRESH=1): only ever use a folder that is new,
# empty, or already ours (it has the marker file), never e.g. BASE=/tmp.
if [ -d "$BASE" ] && [ ! -e "$BASE/.orchestrator-slurm" ] && [ -n "$(ls -A "$BASE")" ]; then
  die "BASE=$BASE exists, is not empty and was not made by this script; pick another BASE"
fi

# One cluster per machine: the Slurm ports, the bridge and the namespace names are global, so
# concurrent start/stop calls (the lead's and a test's) are serialised by a machine-wide lock.
# stop_cluster.sh, when called from here, knows that we already hold it.
mkdir -p /run/lock
exec 9>"$LOCK"
flock -w 300 9 || die "another start/stop_cluster.sh holds $LOCK for 5 minutes"
export ORCH_SLURM_LOCK_HELD=1

if [ "$FRESH" = 1 ]; then
  log "FRESH=1: stopping and wiping $BASE"
  BASE=$BASE bash "$HERE/stop_cluster.sh" --purge
fi

# ---------------------------------------------------------------------------------------------
# 1. Packages. A fresh CI machine has none of them; this machine image already has them.
# ---------------------------------------------------------------------------------------------
PKGS=(slurmctld slurmd slurm-client munge)
[ "$ACCOUNTING" = 1 ] && PKGS+=(slurmdbd mariadb-server)
command -v ip >/dev/null || PKGS+=(iproute2)   # minimal images lack these two
command -v ps >/dev/null || PKGS+=(procps)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
mkdir -p "$BASE/logs"
touch "$BASE/.orchestrator-slurm"   # marker: stop_cluster.sh --purge only deletes folders with it
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]} (log: $BASE/logs/apt.log)"
  export DEBIAN_FRONTEND=noninteractive
  # Trap: the packages' postinst scripts would start the *system* munge/mariadb/slurm daemons
  # (default ports, /etc/munge key) and they would then collide with ours. A policy-rc.d that
  # exits 101 tells invoke-rc.d / deb-systemd-invoke "do not start services". If the machine
  # already has one (Docker images do), it is left exactly as it is.
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\n# temporary, from orchestrator tests/cluster/start_cluster.sh\nexit 101\n' \
      >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    own_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  apt_install() {
    apt-get install -yq --no-install-recommends "${missing[@]}" </dev/null >>"$BASE/logs/apt.log" 2>&1
  }
  # The package lists of a fresh image are often empty or stale: update only when needed.
  if ! apt_install; then
    log "install failed; running apt-get update and retrying"
    apt-get update -q </dev/null >>"$BASE/logs/apt.log" 2>&1 || true
    apt_install || { show_log "$BASE/logs/apt.log"; die "apt-get install failed"; }
  fi
  if [ "$own_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
  log "installed"
fi

# ---------------------------------------------------------------------------------------------
# 2. Refuse to fight a Slurm that is not ours.
# ---------------------------------------------------------------------------------------------
# Our controller listens on 6817 on all addresses. If something answers there while our pid file
# is dead, it is someone else's cluster (e.g. /work/shared/slurm/start-cluster.sh, BASE=/tmp/slurm).
if ! alive "$BASE/run/slurmctld.pid" && port_open 127.0.0.1 6817; then
  die "port 6817 is in use by a Slurm controller that is not ours (BASE=$BASE); stop it first"
fi
if [ -e /etc/slurm/slurm.conf ] && [ ! -L /etc/slurm/slurm.conf ]; then
  die "/etc/slurm/slurm.conf is a real file (a real Slurm install?); refusing to replace it"
fi

mkdir -p "$BASE"/{etc,logs,run,state/ctld,munge,mysql}
for i in $(seq "$NODES"); do mkdir -p "$BASE/state/spool/n$i"; done

# ---------------------------------------------------------------------------------------------
# 3. Mode.
# ---------------------------------------------------------------------------------------------
if [ "$MODE" = auto ]; then
  # netns needs CAP_NET_ADMIN (netns, bridge, veth) and CAP_SYS_ADMIN (unshare --uts). Probe all
  # three; unprivileged containers usually allow none of them.
  if [ -e /run/netns/slurm-n1 ] ||
     { ip netns add slurm-probe && ip link add slbr-probe type bridge && unshare --uts true; } 2>/dev/null
  then MODE=netns; else MODE=multislurmd; fi
  { ip link del slbr-probe; ip netns del slurm-probe; } 2>/dev/null || true
fi

# Addresses: the controller is where slurmd and the clients connect; nI is node I.
if [ "$MODE" = netns ]; then
  CTL_ADDR=$NET.1
  node_addr() { echo "$NET.$((10 + $1))"; }
else
  CTL_ADDR=127.0.0.1
  node_addr() { echo "127.0.0.$((10 + $1))"; }   # all of 127/8 is loopback
fi

# ---------------------------------------------------------------------------------------------
# 4. Configuration.
# ---------------------------------------------------------------------------------------------
# CPUs: a node declares more CPUs than the machine has, so that two 2-node jobs with
# --cpus-per-task=2 run at the same time on n1,n2 (cons_tres + CR_Core counts cores; it does not
# oversubscribe by itself). Memory is not a consumable resource with CR_Core, so --mem only has to
# be <= RealMemory; 4096 lets --mem=2G fit everywhere, far below the physical memory.
# Trap: slurmd reports the real hardware, and a node with fewer CPUs/less memory than its config is
# drained ("Low socket*core*thread count"); SlurmdParameters=config_overrides makes Slurm trust the
# config instead.
REAL_CPUS=$(nproc)
NODE_CPUS=${NODE_CPUS:-$(( 2 * REAL_CPUS > 8 ? 2 * REAL_CPUS : 8 ))}
if [ "$ACCOUNTING" = 1 ]; then
  # netns mode: slurmdbd is reached at 10.77.0.1, so `sacct` works inside jobs too (a node
  # namespace cannot reach the host's 127.0.0.1).
  # job_comment: sacct shows a job's --comment, the token orchestrator finds an orphaned submission by.
  ACCT_LINES="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$CTL_ADDR
AccountingStoreFlags=job_comment"
else
  ACCT_LINES="AccountingStorageType=accounting_storage/none"
fi
{ cat <<EOF
# Generated by tests/cluster/start_cluster.sh (MODE=$MODE NODES=$NODES) - edits are overwritten.
ClusterName=$CLUSTER_NAME
# "localhost" matches any machine name; the address in brackets is where everyone connects.
SlurmctldHost=localhost($CTL_ADDR)
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$BASE/state/ctld
SlurmdSpoolDir=$BASE/state/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/logs/slurmctld.log
SlurmdLogFile=$BASE/logs/slurmd-%n.log
# No cgroups: they are not available (or not delegated) in containers and CI VMs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
# Schedule every 2 s instead of every 60 s / 30 s (backfill).
SchedulerParameters=sched_interval=2,bf_interval=2
# Trap: a requeued job cannot start again until its old job credential expires (default 120 s);
# with cred_expire=10 and KillWait=10 a requeue round trip takes tens of seconds, not minutes.
# CRED_EXPIRE=default measures what a production cluster (120 s) does.
$AUTH_LINE
KillWait=10
# Batch jobs of a node that fails are requeued; a DOWN node returns as soon as its slurmd registers.
JobRequeue=1
ReturnToService=2
# A job asking for more nodes (or time...) than the partition allows is rejected at submission
# ("Node count specification invalid") instead of pending forever with reason PartitionNodeLimit.
EnforcePartLimits=ALL
# Finished jobs stay visible in "squeue -t all" and scontrol for 5 minutes. A plain "squeue -j ID"
# lists pending, running and completing jobs only: an ended job is answered by sacct at once.
MinJobAge=300
# A dead slurmd is noticed within ~SlurmdTimeout (pinged every SlurmdTimeout/3 s): ~20-30 s.
SlurmdTimeout=20
SlurmctldTimeout=10
MessageTimeout=10
InactiveLimit=0
# Preemption by partition priority, as clusters with a scavenger partition have it: a job of a
# partition with a higher PriorityTier preempts the jobs of lower ones whose PreemptMode allows it.
# The default partition's jobs are never preempted (PreemptMode=OFF on it); a test that preempts
# creates its own partitions with the PreemptMode and GraceTime it means.
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
$ACCT_LINES
EOF
  # GRES GPUs (GPU_NODES): slurmd reads them from gres.conf beside this file ("GPUs" below).
  if [ "$GPU_NODES" -gt 0 ]; then echo "GresTypes=gpu"; fi
  for i in $(seq "$NODES"); do
    if [ "$MODE" = netns ]; then extra=""
    else extra="NodeHostname=localhost Port=$((17000 + i))"; fi
    if [ "$i" -ge "$FIRST_GPU_NODE" ]; then extra+=" Gres=gpu:$GPU_TYPE:$GPUS_PER_NODE"; fi
    echo "NodeName=n$i NodeAddr=$(node_addr "$i") $extra CPUs=$NODE_CPUS Boards=1 SocketsPerBoard=1" \
         "CoresPerSocket=$NODE_CPUS ThreadsPerCore=1 RealMemory=$NODE_MEM_MB State=UNKNOWN"
  done
  echo "PartitionName=$PARTITION Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP PreemptMode=OFF"
} >"$BASE/etc/slurm.conf.new"
# GPUs: gres.conf gives the GPU nodes' GRES. Trap: Slurm 22.05's slurmd drops a GPU without File=
# ("Removing file-less GPU gpu:a100 from final GRES list", debug log), and the node is then INVALID
# ("gres/gpu count reported lower than configured"). So each GPU has a placeholder File=: a character
# device with /dev/null's numbers (1,3) under $BASE/gpus, which nothing opens (no cgroup device
# rules here, task/none); without mknod rights an empty file, which slurmd accepts with an error
# line ("not a valid character or block device"). Slurm numbers the devices from the file names,
# so a GPU job gets CUDA_VISIBLE_DEVICES=0,1 and torch still sees no GPU.
# Always written (only a comment without GPU nodes): the gres.conf of an earlier start never
# outlives its GPU nodes.
{ echo "# Generated by tests/cluster/start_cluster.sh (GPU_NODES=$GPU_NODES) - edits are overwritten."
  if [ "$GPU_NODES" -gt 0 ]; then
    if [ "$FIRST_GPU_NODE" = "$NODES" ]; then names=n$NODES; else names="n[$FIRST_GPU_NODE-$NODES]"; fi
    if [ "$GPUS_PER_NODE" = 1 ]; then files=gpu0; else files="gpu[0-$((GPUS_PER_NODE - 1))]"; fi
    echo "NodeName=$names Name=gpu Type=$GPU_TYPE File=$BASE/gpus/$files"
  fi
} >"$BASE/etc/gres.conf.new"
if [ "$GPU_NODES" -gt 0 ]; then
  mkdir -p "$BASE/gpus"
  for g in $(seq 0 $((GPUS_PER_NODE - 1))); do
    [ -e "$BASE/gpus/gpu$g" ] || mknod "$BASE/gpus/gpu$g" c 1 3 2>/dev/null || touch "$BASE/gpus/gpu$g"
  done
fi

# A changed config (other NODES, MODE or GPU nodes) needs a full restart. Trap: `scontrol reconfigure`
# after a node-count change makes slurmctld exit, and a node's GRES are read by its slurmd at start,
# so we do not even try.
if [ -e "$BASE/etc/slurm.conf" ] && alive "$BASE/run/slurmctld.pid" &&
   { ! cmp -s "$BASE/etc/slurm.conf" "$BASE/etc/slurm.conf.new" ||
     ! cmp -s "$BASE/etc/gres.conf" "$BASE/etc/gres.conf.new"; }; then
  log "slurm.conf or gres.conf changed: restarting the cluster (running jobs are cancelled)"
  BASE=$BASE bash "$HERE/stop_cluster.sh"
fi
mv "$BASE/etc/slurm.conf.new" "$BASE/etc/slurm.conf"
mv "$BASE/etc/gres.conf.new" "$BASE/etc/gres.conf"

cat >"$BASE/etc/slurmdbd.conf" <<EOF
# Generated by tests/cluster/start_cluster.sh
DbdHost=localhost
LogFile=$BASE/logs/slurmdbd.log
PidFile=$BASE/run/slurmdbd.pid
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurmpw
EOF
chmod 600 "$BASE/etc/slurmdbd.conf"   # slurmdbd refuses a world-readable file (it holds a password)

# ---------------------------------------------------------------------------------------------
# 5. Network (netns mode) and names.
# ---------------------------------------------------------------------------------------------
# Trap: if slbr0 is missing, 10.77.0.1 is not a local address and connections to it leave through
# the default route; in a sandbox an HTTP proxy may answer there, and Slurm then fails with
# "Insane message length" (it read "HTTP" as a message length). So the network is set up after
# any restart above, on every run, and before any daemon.
if [ "$MODE" = netns ]; then
  if ! ip link show slbr0 >/dev/null 2>&1; then
    ip link add slbr0 type bridge
  fi
  # replace, not add: a bridge left by an unclean stop may or may not still have the address
  ip addr replace "$CTL_ADDR/24" dev slbr0
  ip link set slbr0 up
  for i in $(seq "$NODES"); do
    ns=slurm-n$i
    # A node's network is whole (namespace, its eth0 with the address, host side vslI on slbr0) or
    # rebuilt: an unclean stop can leave any part of it ("RTNETLINK answers: File exists" when a
    # leftover vslI meets a new namespace). The names slurm-nI and vslI are this script's own.
    if [ -e "/run/netns/$ns" ] && { ! ip -n "$ns" -4 addr show dev eth0 2>/dev/null | grep -qF " $(node_addr "$i")/" ||
         ! ip link show "vsl$i" 2>/dev/null | grep -q "master slbr0"; }; then
      log "rebuilding the network of n$i (left half-made by an unclean stop)"
      left=$(ip netns pids "$ns" 2>/dev/null | paste -sd' ')
      # `|| true`: a listed process may be gone by now (a daemon SIGKILLed just before, reaped on a
      # busy machine between the two commands); kill then fails, and `set -e` ended this script
      # right after the line above, with no word (issue 47).
      [ -n "$left" ] && { kill -KILL $left 2>/dev/null || true; }
      ip netns del "$ns" 2>/dev/null || true
    fi
    if [ ! -e "/run/netns/$ns" ]; then
      ip link del "vsl$i" 2>/dev/null || true   # the host side of an earlier pair
      ip netns add "$ns"
      # host side vslI on the bridge, node side is called eth0 inside the namespace
      ip link add "vsl$i" type veth peer name eth0 netns "$ns"
      ip link set "vsl$i" master slbr0 up
      ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
      ip -n "$ns" link set eth0 up
      # Trap: a new namespace has its own loopback, and it is down. Many tools (and torch's
      # TCPStore on "localhost") need it.
      ip -n "$ns" link set lo up
    fi
    grep -qx "$ns" "$BASE/run/netns.list" 2>/dev/null || echo "$ns" >>"$BASE/run/netns.list"
  done
fi

# Node names resolve through /etc/hosts (a marked block), for the host and for jobs alike: the
# nodes share the host's mount namespace. Trap: /etc/hosts is often a bind mount (Docker), so it
# is rewritten in place (cat >) and never replaced (mv/sed -i fail with "Device or resource busy").
{ sed '/^# BEGIN orchestrator-slurm$/,/^# END orchestrator-slurm$/d' /etc/hosts
  echo "# BEGIN orchestrator-slurm"
  for i in $(seq "$NODES"); do echo "$(node_addr "$i") n$i"; done
  echo "# END orchestrator-slurm"; } >"$BASE/run/hosts"
cat "$BASE/run/hosts" >/etc/hosts

# Client commands (sbatch, srun, sacct, ...) read /etc/slurm/slurm.conf unless SLURM_CONF is set;
# link ours there so plain `sbatch` works for the code under test. slurmdbd has no -f option and
# only reads /etc/slurm/slurmdbd.conf.
mkdir -p /etc/slurm
ln -sfn "$BASE/etc/slurm.conf" /etc/slurm/slurm.conf
ln -sfn "$BASE/etc/slurmdbd.conf" /etc/slurm/slurmdbd.conf
export SLURM_CONF=$BASE/etc/slurm.conf


# ---------------------------------------------------------------------------------------------
# 6. munge
# ---------------------------------------------------------------------------------------------
# Trap: munged must serve the *default* socket (/run/munge/munge.socket.2). slurmctld honours
# AuthInfo=socket=..., but its connection to slurmdbd does not, so a private socket breaks
# accounting. Consequently one munged serves the whole machine: if a munged that is not ours
# already answers there (a system one), we use it; it then decides the key, and we leave it alone.
mkdir -p /run/munge
chown munge: /run/munge "$BASE/munge"
chmod 755 /run/munge
chmod 700 "$BASE/munge"
[ -s "$BASE/munge/munge.key" ] || runuser -u munge -- mungekey -c -k "$BASE/munge/munge.key"
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! alive "$BASE/munge/munged.pid"; then
  # (munge retries a stale socket for ~2 s, so only probe a socket that exists, and bounded)
  if [ -S /run/munge/munge.socket.2 ] && timeout 5 bash -c "$(declare -f munge_ok); munge_ok"; then
    log "a munged that is not ours serves /run/munge/munge.socket.2: using it"
  else
    runuser -u munge -- env ORCH_SLURM_DAEMON_OF="$BASE" munged --force \
      --key-file="$BASE/munge/munge.key" --pid-file="$BASE/munge/munged.pid" \
      --log-file="$BASE/munge/munged.log" --seed-file="$BASE/munge/munged.seed" </dev/null 9>&-
    wait_until 10 munged munge_ok || { show_log "$BASE/munge/munged.log"; die "munged"; }
    log "munged up"
  fi
fi

# ---------------------------------------------------------------------------------------------
# 7. MariaDB + slurmdbd (only with ACCOUNTING=1)
# ---------------------------------------------------------------------------------------------
if [ "$ACCOUNTING" = 1 ]; then
  M=$BASE/mysql
  mkdir -p "$M/data"
  chown -R mysql: "$M"
  if [ ! -d "$M/data/mysql" ]; then
    # --no-defaults everywhere: never read /etc/mysql (system datadir, port 3306, socket).
    mariadb-install-db --no-defaults --datadir="$M/data" --user=mysql \
      --auth-root-authentication-method=socket --skip-test-db --innodb-log-file-size=16M \
      </dev/null >"$BASE/logs/mariadb-install.log" 2>&1 ||
      { show_log "$BASE/logs/mariadb-install.log"; die "mariadb-install-db"; }
  fi
  db_ping() { mariadb-admin --no-defaults -S "$M/sock" ping; }
  if ! alive "$BASE/run/mariadbd.pid"; then
    # A throw-away database: no fsync, no doublewrite; it is wiped by FRESH=1 / --purge anyway.
    # Trap: flush-log-at-trx-commit=0 loses the last second of commits when mariadbd is SIGKILLed
    # (test_cluster_restart.py does); 2 writes each commit to the OS, so only a host crash loses it.
    # slurmdbd's first start creates its tables under long locks, hence the lock wait timeout.
    # mariadbd switches to user mysql itself, so everything it writes lives in $M (owned by
    # mysql); the pid we record is in run/ (mariadbd cannot overwrite a root-owned file).
    end_strays mariadbd "$BASE/run/mariadbd.pid"
    launch "$BASE/run/mariadbd.pid" "$BASE/logs/mariadb.out" mariadbd --no-defaults \
      --datadir="$M/data" --user=mysql --socket="$M/sock" --pid-file="$M/mysqld.pid" \
      --bind-address=127.0.0.1 --port=$DB_PORT --log-error="$M/mariadb.log" --skip-name-resolve \
      --innodb-buffer-pool-size=64M --innodb-log-file-size=16M --innodb-lock-wait-timeout=900 \
      --innodb-flush-log-at-trx-commit=2 --innodb-doublewrite=0 --innodb-flush-method=nosync
    wait_daemon 60 mariadb "$BASE/run/mariadbd.pid" "$M/mariadb.log" db_ping
    mariadb --no-defaults -S "$M/sock" -e "
      CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw';
      GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
    log "mariadb up (127.0.0.1:$DB_PORT)"
  fi
  if ! alive "$BASE/run/slurmdbd.pid"; then
    end_strays slurmdbd "$BASE/run/slurmdbd.pid"
    launch "$BASE/run/slurmdbd.pid" "$BASE/logs/slurmdbd.out" slurmdbd -D
    wait_daemon 60 slurmdbd "$BASE/run/slurmdbd.pid" "$BASE/logs/slurmdbd.log" port_open 127.0.0.1 6819
    log "slurmdbd up"
  fi
fi

# ---------------------------------------------------------------------------------------------
# 8. slurmctld
# ---------------------------------------------------------------------------------------------
if ! alive "$BASE/run/slurmctld.pid"; then
  end_strays slurmctld "$BASE/run/slurmctld.pid"
  launch "$BASE/run/slurmctld.pid" "$BASE/logs/slurmctld.out" slurmctld -D -f "$BASE/etc/slurm.conf"
  wait_daemon 60 slurmctld "$BASE/run/slurmctld.pid" "$BASE/logs/slurmctld.log" scontrol ping
  log "slurmctld up ($CTL_ADDR)"
fi

# ---------------------------------------------------------------------------------------------
# 9. One slurmd per node
# ---------------------------------------------------------------------------------------------
for i in $(seq "$NODES"); do
  alive "$BASE/run/slurmd-n$i.pid" && continue
  # a slurmd of this node that lost its pid file: the one with n$i's log open
  for p in $(strays slurmd "$BASE/run/slurmd-n$i.pid"); do
    ls -l "/proc/$p/fd" 2>/dev/null | grep -qF " $BASE/logs/slurmd-n$i.log" && { kill -KILL "$p" 2>/dev/null || true; }
  done
  if [ "$MODE" = netns ]; then
    # Trap: NOT `ip netns exec`: it also unshares the mount namespace and remounts /sys, and then
    # slurmd dies with "No filesystem mounted on /sys/fs/cgroup". nsenter --net only switches the
    # network; unshare --uts gives the node its own hostname; the filesystem stays shared, which
    # is exactly the "shared filesystem" a real cluster has.
    # nsenter and unshare exec (no fork) and sh execs slurmd, so the recorded pid is slurmd's.
    launch "$BASE/run/slurmd-n$i.pid" "$BASE/logs/slurmd-n$i.out" \
      nsenter --net="/run/netns/slurm-n$i" unshare --uts \
      sh -c "hostname n$i && exec slurmd -D -f '$BASE/etc/slurm.conf' -N n$i"
  else
    launch "$BASE/run/slurmd-n$i.pid" "$BASE/logs/slurmd-n$i.out" \
      slurmd -D -f "$BASE/etc/slurm.conf" -N "n$i"
  fi
done

# Wait until every node has registered and is usable (idle, or busy with jobs on a re-run).
ready_nodes() { sinfo -h -N -p "$PARTITION" -t idle,mixed,allocated,completing -o %N | sort -u | wc -l; }
all_ready() { [ "$(ready_nodes)" -ge "$NODES" ]; }
if ! wait_until 30 "nodes to register" all_ready; then
  # Left DOWN/DRAINED by an earlier run (e.g. a test killed a node): a start means a usable cluster.
  bad=$(sinfo -h -N -p "$PARTITION" -t down,drain,draining,fail -o %N | sort -u | paste -sd,)
  [ -n "$bad" ] && { log "resuming $bad"; scontrol update NodeName="$bad" State=RESUME || true; }
  wait_until 30 "nodes to register" all_ready || { sinfo -N -l; for f in "$BASE"/logs/slurmd-*.log; do show_log "$f"; done; die "nodes"; }
fi
log "$NODES slurmd up"

if [ "$ACCOUNTING" = 1 ]; then
  # slurmctld registers the cluster in slurmdbd shortly after it starts; before that, sacct and
  # the first job records can be lost/refused.
  cluster_registered() { sacctmgr -nP list cluster format=cluster,controlport | grep -q "^$CLUSTER_NAME|6817$"; }
  wait_until 30 "cluster registration in slurmdbd" cluster_registered || die "slurmdbd registration"
  sacct -nX -j 1 >/dev/null || die "sacct does not work"
fi

# ---------------------------------------------------------------------------------------------
# 10. The env file for the tests
# ---------------------------------------------------------------------------------------------
node_list=""; addr_list=""; gpu_list=""
for i in $(seq "$NODES"); do node_list+="${node_list:+,}n$i"; addr_list+="${addr_list:+,}$(node_addr "$i")"; done
for i in $(seq "$FIRST_GPU_NODE" "$NODES"); do gpu_list+="${gpu_list:+,}n$i"; done
cat >"$BASE/cluster.env.tmp" <<EOF
ORCHESTRATOR_TEST_CLUSTER_MODE=$MODE
ORCHESTRATOR_TEST_CLUSTER_NODES=$NODES
ORCHESTRATOR_TEST_CLUSTER_BASE=$BASE
ORCHESTRATOR_TEST_CLUSTER_PARTITION=$PARTITION
ORCHESTRATOR_TEST_CLUSTER_NODE_NAMES=$node_list
ORCHESTRATOR_TEST_CLUSTER_NODE_ADDRS=$addr_list
ORCHESTRATOR_TEST_CLUSTER_CONTROLLER_ADDR=$CTL_ADDR
ORCHESTRATOR_TEST_CLUSTER_ACCOUNTING=$ACCOUNTING
ORCHESTRATOR_TEST_CLUSTER_CRED_EXPIRE=$CRED_EXPIRE
ORCHESTRATOR_TEST_CLUSTER_NODE_CPUS=$NODE_CPUS
ORCHESTRATOR_TEST_CLUSTER_NODE_MEM_MB=$NODE_MEM_MB
ORCHESTRATOR_TEST_CLUSTER_GPU_NODES=$gpu_list
SLURM_CONF=$BASE/etc/slurm.conf
EOF
mv "$BASE/cluster.env.tmp" "$BASE/cluster.env"
log "ready: MODE=$MODE NODES=$NODES ACCOUNTING=$ACCOUNTING BASE=$BASE (env file: $BASE/cluster.env)"
sinfo -N -o '%N %T %c %m %P'
