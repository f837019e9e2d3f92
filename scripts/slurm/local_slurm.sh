#!/usr/bin/env bash
# A throw-away single-node SLURM on this machine (root, no systemd, no cgroups), for testing
# scripts/slurm/pretrain_hdp.sbatch:
#
#   bash scripts/slurm/local_slurm.sh start DIR   # munged, slurmctld, slurmd; state in DIR
#   export SLURM_CONF=DIR/slurm.conf              # then sbatch, squeue, scontrol ... as usual
#   bash scripts/slurm/local_slurm.sh stop DIR    # cancel its jobs, stop the three daemons
#
# Needs Debian's slurmctld, slurmd, slurm-client and munge (scripts/slurm/install_local_slurm.sh).
# Everything it writes is under DIR (own munge key and socket, free ports), so it does not touch
# a system SLURM or munge. `start` fails with the daemons' logs when the node is not up in time.
set -Eeuo pipefail   # -E: the ERR trap of start() also fires inside functions

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
ACTION="$1"
DIR="$(mkdir -p "$2" && cd "$2" && pwd)"
CONF="$DIR/slurm.conf"
export SLURM_CONF="$CONF"
export PATH="$PATH:/usr/sbin:/sbin"   # the daemons live in sbin, not always on PATH
TIMEOUT="${TIMEOUT:-60}"   # s to wait for the node to come up (start) or the jobs to end (stop)

# Print every log of DIR, for a failure message.
dump_logs() {
  for log in "$DIR"/log/*.log; do
    [ -s "$log" ] || continue
    echo "---- $log (last 40 lines)"
    tail -n 40 "$log"
  done
}

# A TCP port nothing listens on, from 20000-49999, other than $1 (if given).
free_port() {
  local port
  for _ in $(seq 200); do
    port=$((20000 + RANDOM % 30000))
    [ "$port" != "${1:-}" ] || continue
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      echo "$port"
      return
    fi
  done
  echo "no free port found" >&2
  return 1
}

# Send SIGTERM to the daemon whose pid file is $1, wait for it to exit, then SIGKILL it.
stop_pidfile() {
  local pidfile="$1" pid
  [ -f "$pidfile" ] || return 0
  pid="$(cat "$pidfile")"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

start() {
  for cmd in munged slurmctld slurmd sinfo; do
    command -v "$cmd" >/dev/null || { echo "$cmd not found: install SLURM first" >&2; exit 1; }
  done
  mkdir -p "$DIR"/{munge,state,spool,log}
  chmod 700 "$DIR/munge"
  trap 'echo "local_slurm.sh: start failed" >&2; dump_logs >&2' ERR

  # munge: a fresh key and a private socket (slurm reaches it through AuthInfo below)
  if [ ! -f "$DIR/munge/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$DIR/munge/munge.key"
  fi
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" \
    --log-file="$DIR/log/munged.log" </dev/null >"$DIR/log/munged.stderr.log" 2>&1

  # slurm.conf: this host as controller and only node, with what slurmd detects here
  local host node ctld_port
  host="$(hostname -s)"
  node="$(slurmd -C | head -n 1)"   # NodeName=<host> CPUs=... RealMemory=...
  ctld_port="$(free_port)"
  cat >"$CONF" <<EOF
ClusterName=hdplocal
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$(free_port "$ctld_port")
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no systemd or cgroups here: track processes through /proc, bind nothing
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
# schedule every second (a requeued job is eligible again after cred_expire=5 s, above)
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# requeue allowed; finished jobs stay known (for scontrol requeue) for 10 minutes
JobRequeue=1
MinJobAge=600
ReturnToService=2
KillWait=30
InactiveLimit=0
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

  # the two slurm daemons (they fork into the background and write their pid files);
  # their stdio goes to files so that no caller's pipe stays open
  slurmctld -f "$CONF" </dev/null >"$DIR/log/slurmctld.stderr.log" 2>&1
  slurmd -f "$CONF" </dev/null >"$DIR/log/slurmd.stderr.log" 2>&1

  # wait until the node accepts jobs
  local state="" deadline=$((SECONDS + TIMEOUT))
  while [ "$SECONDS" -lt "$deadline" ]; do
    state="$(timeout 10 sinfo -h -n "$host" -o %T 2>/dev/null || true)"
    if [ "$state" = "idle" ]; then
      echo "SLURM is up: export SLURM_CONF=$CONF"
      return 0
    fi
    sleep 0.5
  done
  echo "SLURM did not come up in ${TIMEOUT}s (node state: '${state}')" >&2
  dump_logs >&2
  exit 1
}

stop() {
  # cancel this cluster's jobs first, so no slurmstepd outlives slurmd
  if [ -f "$CONF" ] && [ -f "$DIR/slurmctld.pid" ]; then
    timeout 10 scancel --quiet --user="$(id -un)" 2>/dev/null || true
    local deadline=$((SECONDS + TIMEOUT))
    while [ "$SECONDS" -lt "$deadline" ]; do
      [ -z "$(timeout 10 squeue -h -o %i -t R,CG 2>/dev/null)" ] && break
      sleep 0.5
    done
  fi
  stop_pidfile "$DIR/slurmd.pid"
  stop_pidfile "$DIR/slurmctld.pid"
  stop_pidfile "$DIR/munge/munged.pid"
}

case "$ACTION" in
  start) start ;;
  stop) stop ;;
  *) usage ;;
esac
