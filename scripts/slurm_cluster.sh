#!/usr/bin/env bash
# A real two-node SLURM cluster on this one machine, for the tests and for trying the SLURM runner:
#   bash scripts/slurm_cluster.sh up       start munged, slurmctld and two slurmd (nodes n1, n2)
#   bash scripts/slurm_cluster.sh status   the daemons' PIDs and sinfo
#   bash scripts/slurm_cluster.sh down     cancel the cluster's jobs, stop every daemon it started (by PID)
# Needs Debian's slurm-wlm and munge (bash scripts/install.sh --test installs them) and root (slurmd
# starts the jobs' processes). Everything - config, keys, spool, state, logs, PID files - lives under
# FT_SLURM_DIR (default /tmp/ft_slurm); the daemons listen on 127.0.0.1 only, on three free ports
# from FT_SLURM_PORT (default: picked free at `up`). Use the cluster with
#   export SLURM_CONF=$FT_SLURM_DIR/slurm.conf
# Both nodes are this host: Debian's build has MULTIPLE_SLURMD, so two slurmd (-N n1, -N n2) share it
# on their own ports, each offering 4 CPUs whatever the host has (SlurmdParameters=config_overrides:
# the tests run tiny jobs side by side). Requeued jobs start again within seconds (cred_expire=5, bf_interval=1,
# sched_interval=2; SLURM's defaults hold them for about two minutes). Accounting is off: sacct does
# not work, squeue shows a job until MinJobAge (300 s) after it ended.
set -euo pipefail
DIR=${FT_SLURM_DIR:-/tmp/ft_slurm}
CMD=${1:-}
PROG="scripts/slurm_cluster.sh"
DAEMONS=(slurmd-n2 slurmd-n1 slurmctld munged)   # the order `down` stops them in

die() { echo "$PROG: $*" >&2; exit 2; }

pid_of() {  # the PID a daemon's file names, if that process still lives
  local f="$DIR/run/$1.pid"
  [ -s "$f" ] || return 1
  local pid; pid=$(cat "$f")
  kill -0 "$pid" 2>/dev/null || return 1
  echo "$pid"
}

status() {
  local any=0
  for d in "${DAEMONS[@]}"; do
    if pid=$(pid_of "$d"); then echo "$d: running (pid $pid)"; any=1; else echo "$d: not running"; fi
  done
  if [ "$any" = 1 ] && [ -f "$DIR/slurm.conf" ]; then SLURM_CONF="$DIR/slurm.conf" sinfo -N 2>&1 || true; fi
}

stop_daemons() {
  if [ -f "$DIR/slurm.conf" ] && pid_of slurmctld >/dev/null; then
    # The cluster's jobs (and their slurmstepd) end before their slurmd goes.
    SLURM_CONF="$DIR/slurm.conf" scancel --full --quiet --partition=debug 2>/dev/null || true
    for _ in $(seq 1 40); do
      [ -z "$(SLURM_CONF="$DIR/slurm.conf" squeue -h -t R,CG,S,CF -o %i 2>/dev/null)" ] && break
      sleep 0.25
    done
  fi
  local pids=()
  for d in "${DAEMONS[@]}"; do
    if pid=$(pid_of "$d"); then kill -TERM "$pid" 2>/dev/null || true; pids+=("$pid"); fi
  done
  for _ in $(seq 1 50); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -f "$DIR"/run/*.pid
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...: until COMMAND succeeds
  local seconds=$1 what=$2; shift 2
  local end=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $end ]; then
      echo "$PROG: $what did not come up within ${seconds} s; its log:" >&2
      tail -n 5 "$DIR"/log/*.log >&2 2>/dev/null || true
      stop_daemons
      exit 1
    fi
    sleep 0.2
  done
}

up() {
  for bin in munged slurmctld slurmd sbatch; do
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || \
      die "$bin is not installed (apt-get install slurm-wlm munge, or bash scripts/install.sh --test as root)"
  done
  [ "$(id -u)" = 0 ] || die "must run as root (slurmd starts the jobs' processes as their users)"
  if pid_of slurmctld >/dev/null; then echo "$PROG: already up under $DIR"; status; return 0; fi
  stop_daemons  # whatever a crashed `up` left
  rm -rf "$DIR/spool" "$DIR/state" "$DIR/log"
  mkdir -p "$DIR"/{munge,run,log,state,spool/n1,spool/n2}
  chmod 700 "$DIR/munge"
  local port=${FT_SLURM_PORT:-}
  if [ -z "$port" ]; then
    port=$(python3 - <<'EOF'
import socket
for base in range(20000, 30000, 7):   # three consecutive free ports on 127.0.0.1
    try:
        socks = [socket.socket() for _ in range(3)]
        for i, s in enumerate(socks):
            s.bind(("127.0.0.1", base + i))
    except OSError:
        continue
    finally:
        for s in socks:
            s.close()
    print(base)
    break
EOF
)
  fi
  local host; host=$(hostname -s)
  [ -f "$DIR/munge/munge.key" ] || { head -c 1024 /dev/urandom > "$DIR/munge/munge.key"; }
  chmod 400 "$DIR/munge/munge.key"
  cat > "$DIR/slurm.conf" <<EOF
# Written by $PROG up; two nodes on this host.
ClusterName=ftci
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname=$host Port=$((port + 1)) CPUs=4 RealMemory=2000 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 NodeHostname=$host Port=$((port + 2)) CPUs=4 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
  : > "$DIR/plugstack.conf"
  echo "PlugStackConfig=$DIR/plugstack.conf" >> "$DIR/slurm.conf"
  export SLURM_CONF="$DIR/slurm.conf"
  munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed"
  wait_for 10 munged test -S "$DIR/munge/munge.socket"
  # -i: ignore state a previous cluster in this directory saved.
  slurmctld -i
  wait_for 20 slurmctld scontrol ping
  slurmd -N n1
  slurmd -N n2
  wait_for 30 "the nodes" sh -c "[ \"\$(sinfo -h -N -t idle -o %N | sort -u | wc -l)\" = 2 ]"
  echo "$PROG: up under $DIR (SLURM_CONF=$SLURM_CONF, slurmctld on 127.0.0.1:$port, nodes n1 n2)"
}

case "$CMD" in
  up) up ;;
  down) stop_daemons; echo "$PROG: down ($DIR)" ;;
  status) status ;;
  *) die "unknown command '${CMD}'; valid: up, down, status" ;;
esac
