#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for the tests and for an instructor trying
# the grading recipe (examples/grade_class.sh) before the real cluster:
#
#   bash tools/slurm.sh start     install Slurm and munge if missing (Debian, as root), start
#                                 munged, slurmctld and slurmd, wait until the node is idle
#   bash tools/slurm.sh env       the line that points Slurm's commands at it:
#                                 eval "$(bash tools/slurm.sh env)"; sinfo
#   bash tools/slurm.sh stop      stop the three daemons
#
# Everything lives in $COURSE_SLURM_DIR (default /tmp/course-slurm): the configuration, munge's
# key and socket, the daemons' state, logs and pid files. Nothing under /etc is changed, and a
# cluster the machine already runs is left alone: its commands read /etc/slurm, ours
# $SLURM_CONF. The node is this machine as `slurmd -C` describes it; with no cgroups here (a
# container), processes are tracked by their parent and tasks are not fenced.
set -euo pipefail

DIR=${COURSE_SLURM_DIR:-/tmp/course-slurm}
CONF=$DIR/slurm.conf
SOCKET=$DIR/munge/munge.socket

need_root() { [ "$(id -u)" = 0 ] || { echo "tools/slurm.sh: run as root (the daemons start as root)" >&2; exit 1; }; }

install() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return
    need_root
    echo "installing slurm-wlm and munge (Debian packages, about a minute)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

configure() {
    mkdir -p "$DIR"/{state,spool,log,munge}
    chmod 755 "$DIR" "$DIR/munge" # munged refuses a socket folder others could write to
    [ -f "$DIR/munge.key" ] || { dd if=/dev/urandom bs=1 count=1024 of="$DIR/munge.key" 2>/dev/null; chmod 400 "$DIR/munge.key"; }
    local node host
    host=$(hostname)
    # "NodeName=vm CPUs=2 ... RealMemory=24105": the node line, as slurmd measures it (the
    # first line; UpTime is not a setting).
    node=$(slurmd -C | head -n 1)
    cat >"$CONF" <<EOF
# Written by tools/slurm.sh: a one-node cluster for the course's tests.
ClusterName=course
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
SlurmctldPort=${COURSE_SLURMCTLD_PORT:-16817}
SlurmdPort=${COURSE_SLURMD_PORT:-16818}
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
$node State=UNKNOWN
PartitionName=course Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

running() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

start() {
    install
    need_root
    configure
    export SLURM_CONF=$CONF
    if ! running munged; then
        munged --key-file="$DIR/munge.key" --socket="$SOCKET" --pid-file="$DIR/munged.pid" \
            --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge.seed" --force
    fi
    # -i: ignore a state a previous run left (jobs of a cluster that no longer exists).
    running slurmctld || slurmctld -i
    running slurmd || slurmd
    local state=""
    for _ in $(seq 1 60); do
        state=$(sinfo -h -N -o %t 2>/dev/null | head -n 1 || true)
        case $state in idle | mix | alloc) echo "slurm: node $(hostname) $state (SLURM_CONF=$CONF)"; return ;; esac
        sleep 0.5
    done
    echo "tools/slurm.sh: the node did not come up (state '${state:-none}'); logs in $DIR/log" >&2
    tail -n 20 "$DIR"/log/*.log >&2 || true
    exit 1
}

stop() {
    for daemon in slurmd slurmctld munged; do
        if running "$daemon"; then kill "$(cat "$DIR/$daemon.pid")"; fi
    done
}

case "${1:-}" in
start) start ;;
stop) stop ;;
env) echo "export SLURM_CONF=$CONF" ;;
*)
    echo "usage: bash $0 start|env|stop" >&2
    exit 2
    ;;
esac
