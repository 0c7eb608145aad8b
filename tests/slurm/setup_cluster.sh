#!/usr/bin/env bash
# A one-node Slurm cluster on localhost, for tests/slurm (CI runs this as root before pytest).
#
#   tests/slurm/setup_cluster.sh           install the packages if missing, then start
#   tests/slurm/setup_cluster.sh install   apt-get install munge, slurmctld, slurmd, the clients, shellcheck
#   tests/slurm/setup_cluster.sh start     write slurm.conf, start munged, slurmctld, slurmd; wait for the node
#   tests/slurm/setup_cluster.sh stop      stop the daemons this script started (munged too,
#                                          unless it was running before)
#   tests/slurm/setup_cluster.sh status    exit 0 if the cluster answers and the node is up
#
# Everything lives in $MHAR_SLURM_DIR (default /tmp/megatron_mhar_slurm): slurm.conf,
# state, spool, pid and log files; munged.pid there records a munged this script started. A Slurm configuration in /etc/slurm is never touched;
# clients reach this cluster through SLURM_CONF=$MHAR_SLURM_DIR/slurm.conf (the test
# sets it; jobs inherit it). The cluster is deliberately plain, for a sandbox or a CI
# container: no cgroups (proctrack/linuxproc, task/none), no accounting database,
# jobs run as root, and a requeued job may start again after 15 s (AuthInfo
# cred_expire; Slurm's default holds it back for 120 s).
set -euo pipefail

CLUSTER_DIR=${MHAR_SLURM_DIR:-/tmp/megatron_mhar_slurm}
CONF=$CLUSTER_DIR/slurm.conf
MUNGED_PID=$CLUSTER_DIR/munged.pid   # written only when this script starts munged
NODE=localhost                 # node name; slurmd is started with -N so it needs no DNS entry
PARTITION=debug
CTLD_PORT=${MHAR_SLURMCTLD_PORT:-16817}   # non-default ports: never collide with a real Slurm
SLURMD_PORT=${MHAR_SLURMD_PORT:-16818}
PACKAGES=(munge slurmctld slurmd slurm-client shellcheck)

log() { echo "setup_cluster: $*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() {
    [[ $(id -u) -eq 0 ]] || die "run as root (it installs packages and starts munged, slurmctld, slurmd)"
}

install_packages() {
    local missing=()
    command -v munged >/dev/null || missing+=(munge)
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v shellcheck >/dev/null || missing+=(shellcheck)
    if [[ ${#missing[@]} -eq 0 ]]; then
        log "packages present: ${PACKAGES[*]}"
        return
    fi
    need_root
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
}

start_munge() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        log "munged already running"
        return
    fi
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key
    fi
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
    chmod 0700 /etc/munge
    chmod 0400 /etc/munge/munge.key
    # munged (as user munge) writes its pid into /run/munge; $CLUSTER_DIR gets a copy once
    # it answers, which marks it as ours for `stop`.
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
    for _ in $(seq 50); do
        if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
            mkdir -p "$CLUSTER_DIR"
            cp /run/munge/munged.pid "$MUNGED_PID"
            return
        fi
        sleep 0.2
    done
    die "munged did not start (see /var/log/munge/munged.log)"
}

write_config() {
    mkdir -p "$CLUSTER_DIR"/{state,spool}
    # The node's real layout (CPUs, sockets, cores, threads), under our node name.
    local hardware
    hardware=$(slurmd -C | head -n 1 | sed -e "s/^NodeName=[^ ]*/NodeName=$NODE/" -e 's/ RealMemory=[0-9]*//')
    cat >"$CONF" <<EOF
# Written by tests/slurm/setup_cluster.sh: a one-node test cluster on localhost.
ClusterName=mhar-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
MailProg=/bin/true
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits cred_expire seconds before it may start again (default 120).
AuthInfo=cred_expire=15
StateSaveLocation=$CLUSTER_DIR/state
SlurmdSpoolDir=$CLUSTER_DIR/spool
SlurmctldPidFile=$CLUSTER_DIR/slurmctld.pid
SlurmdPidFile=$CLUSTER_DIR/slurmd.pid
SlurmctldLogFile=$CLUSTER_DIR/slurmctld.log
SlurmdLogFile=$CLUSTER_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups in a sandbox: track processes through /proc, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# Look at pending jobs every 5 s (default 60 s): a requeued job starts again promptly.
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Batch jobs may be requeued (sbatch --requeue, scontrol requeue).
JobRequeue=1
ReturnToService=2
# Keep finished jobs visible to scontrol for 10 minutes (no accounting database).
MinJobAge=600
KillWait=30
InactiveLimit=0
SlurmctldTimeout=60
SlurmdTimeout=60
$hardware State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
    log "wrote $CONF"
}

daemon_running() {  # pid file of a live process
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

node_up() {
    local state
    state=$(SLURM_CONF=$CONF sinfo -h -n "$NODE" -o '%T' 2>/dev/null) || return 1
    [[ $state =~ ^(idle|mixed|allocated|completing) ]]
}

start_cluster() {
    need_root
    command -v slurmctld >/dev/null || die "Slurm is not installed; run: $0 install"
    start_munge
    if node_up; then
        log "cluster already up (SLURM_CONF=$CONF)"
        return
    fi
    write_config
    if ! daemon_running "$CLUSTER_DIR/slurmctld.pid"; then
        slurmctld -f "$CONF" -c   # -c: cold start, forget jobs of an earlier cluster
    fi
    for _ in $(seq 30); do  # slurmd registers once at start: let the controller listen first
        SLURM_CONF=$CONF scontrol ping 2>/dev/null | grep -q UP && break
        sleep 1
    done
    if ! daemon_running "$CLUSTER_DIR/slurmd.pid"; then
        slurmd -f "$CONF" -N "$NODE"
    fi
    for _ in $(seq 60); do
        if node_up; then
            log "cluster up: $(SLURM_CONF=$CONF sinfo -h -o '%P %D %T %c CPUs')"
            log "use it with: export SLURM_CONF=$CONF"
            return
        fi
        sleep 1
    done
    SLURM_CONF=$CONF scontrol update nodename="$NODE" state=resume 2>/dev/null || true
    node_up || {
        tail -n 20 "$CLUSTER_DIR"/slurmctld.log "$CLUSTER_DIR"/slurmd.log >&2 || true
        die "the node did not come up within 60 s"
    }
}

stop_cluster() {
    local pidfile
    for pidfile in "$CLUSTER_DIR/slurmd.pid" "$CLUSTER_DIR/slurmctld.pid" "$MUNGED_PID"; do
        if daemon_running "$pidfile"; then
            kill "$(cat "$pidfile")"
            log "stopped $(basename "$pidfile" .pid)"
        fi
    done
    rm -f "$MUNGED_PID"   # a munged running before `start` has no such file: it stays up
}

case ${1:-all} in
    all) install_packages; start_cluster ;;
    install) install_packages ;;
    start) start_cluster ;;
    stop) stop_cluster ;;
    status) node_up ;;
    *) die "unknown command ${1}; use one of: all install start stop status" ;;
esac
