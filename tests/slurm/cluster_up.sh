#!/usr/bin/env bash
# Bring up a local single-node SLURM cluster, with accounting, on this machine.
#
#   partition=$(bash tests/slurm/cluster_up.sh | tail -1)
#
# Needs root and Debian (12). Installs slurm-wlm, slurmdbd, munge and mariadb-server if they are
# missing, writes /etc/slurm/slurm.conf and /etc/slurm/slurmdbd.conf for this host (every address
# 127.0.0.1), then starts munged, mariadbd, slurmdbd, slurmctld and slurmd by hand (no systemd),
# recording each daemon's pid in $RLCOMM_SLURM_STATE/pids/<name>.pid. Stop them with
# tests/slurm/cluster_down.sh. Running it again while the cluster is up is harmless and fast.
#
# The partition name is the last (and only) line written to stdout; all chatter goes to stderr.
#
# Environment:
#   RLCOMM_SLURM_STATE      state dir (pids, logs, slurmctld state, slurmd spool)
#                           default /var/lib/rlcomm-slurm
#   RLCOMM_SLURM_PARTITION  partition name, default debug
#   RLCOMM_SLURM_CPUS       CPUs the node advertises, default max(8, nproc)
#   RLCOMM_SLURM_FORCE=1    overwrite an /etc/slurm config this script did not write
set -euo pipefail
set +m # no job control: background children must stay out of their own process groups

STATE=${RLCOMM_SLURM_STATE:-/var/lib/rlcomm-slurm}
PARTITION=${RLCOMM_SLURM_PARTITION:-debug}
CLUSTER=rlcomm
CONF_DIR=/etc/slurm
MARKER="# Managed by rlcomm tests/slurm/cluster_up.sh; rewritten on every run."
PIDS=$STATE/pids    # our records: <name>.pid, one per daemon we started
RUN=$STATE/run      # the slurm daemons' own pid files (they cannot remove them: root-owned)
LOG=$STATE/log
DB_NAME=slurm_acct_db
export SLURM_CONF=$CONF_DIR/slurm.conf
T0=$(date +%s.%N)

elapsed() { awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
log() { printf '[cluster_up %5ss] %s\n' "$(elapsed)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "must run as root (try: sudo -E bash $0)"
[[ $PARTITION =~ ^[A-Za-z0-9_-]+$ ]] || die "bad RLCOMM_SLURM_PARTITION: $PARTITION"

# --------------------------------------------------------------------------------------------
# Packages
# --------------------------------------------------------------------------------------------
need_install=0
for b in /usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/slurmdbd /usr/bin/sinfo /usr/bin/sacct \
    /usr/sbin/munged /usr/bin/munge /usr/sbin/mariadbd /usr/bin/mariadb /usr/bin/mariadb-admin; do
    [[ -x $b ]] || { need_install=1; break; }
done
if ((need_install)); then
    command -v apt-get >/dev/null || die "SLURM is not installed and there is no apt-get"
    log "installing slurm-wlm slurmdbd munge mariadb-server (apt-get)"
    # Block service starts during the install (a host with systemd would start them): we start the
    # daemons ourselves. Debian docker images already have such a policy-rc.d; leave theirs alone.
    policy=/usr/sbin/policy-rc.d
    made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        made_policy=1
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    export DEBIAN_FRONTEND=noninteractive
    rc=0
    {
        apt-get -q update &&
            apt-get -q install -y --no-install-recommends -o DPkg::Lock::Timeout=120 \
                slurm-wlm slurmdbd munge mariadb-server mariadb-client
    } >&2 || rc=$?
    if ((made_policy)); then rm -f "$policy"; trap - EXIT; fi
    ((rc == 0)) || die "apt-get failed (rc=$rc)"
    log "installed"
fi

HOST=$(hostname -s)
[[ -n $HOST ]] || die "empty hostname"
getent hosts "$HOST" >/dev/null ||
    log "warning: '$HOST' does not resolve; jobs that use the node name as MASTER_ADDR need it in /etc/hosts"

# --------------------------------------------------------------------------------------------
# Process helpers: our daemons are identified by recorded pid + /proc/<pid>/exe, never by name.
# --------------------------------------------------------------------------------------------
# shellcheck source=tests/slurm/pids.sh
source "$(dirname "${BASH_SOURCE[0]}")/pids.sh"


# stop <name>: SIGTERM our daemon, SIGKILL after a bounded wait.
stop() {
    local pid i
    if pid=$(our_pid "$1"); then
        log "stopping $1 (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 300; i++)); do alive "$1" || break; sleep 0.05; done
        if alive "$1"; then
            kill -KILL "$pid" 2>/dev/null || true
            for ((i = 0; i < 100; i++)); do alive "$1" || break; sleep 0.05; done
        fi
        alive "$1" && die "could not stop $1 (pid $pid)"
    fi
    rm -f "$PIDS/$1.pid"
}

port_open() { timeout 1 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# write_conf <path> <mode> <owner> <content>: returns 0 when the file changed.
write_conf() {
    local path=$1 mode=$2 owner=$3 content=$4 tmp
    if [[ -e $path ]] && ! grep -qxF "$MARKER" "$path" && [[ ${RLCOMM_SLURM_FORCE:-0} != 1 ]]; then
        die "$path exists and was not written by this script; set RLCOMM_SLURM_FORCE=1 to overwrite it"
    fi
    if [[ -e $path ]] && [[ $(<"$path") == "$content" ]]; then
        chmod "$mode" "$path"
        chown "$owner" "$path"
        return 1
    fi
    tmp=$(mktemp "$path.XXXXXX")
    printf '%s\n' "$content" >"$tmp"
    chmod "$mode" "$tmp"
    chown "$owner" "$tmp"
    mv -f "$tmp" "$path"
    log "wrote $path"
    return 0
}

# --------------------------------------------------------------------------------------------
# Directories and configuration
# --------------------------------------------------------------------------------------------
mkdir -p "$STATE" "$PIDS" "$RUN" "$LOG" "$STATE/slurmctld" "$STATE/slurmd" "$CONF_DIR" \
    /run/munge /run/mysqld
chmod 755 "$STATE" "$LOG"
chmod 700 "$PIDS"
chown slurm:slurm "$LOG" "$STATE/slurmctld"
chown munge:munge /run/munge
chown mysql:mysql /run/mysqld

real_mem=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)
[[ $real_mem =~ ^[0-9]+$ ]] || die "could not read RealMemory from 'slurmd -C'"
ncpu=$(nproc)
CPUS=${RLCOMM_SLURM_CPUS:-$((ncpu > 8 ? ncpu : 8))}
[[ $CPUS =~ ^[0-9]+$ ]] || die "bad RLCOMM_SLURM_CPUS: $CPUS"

SLURM_CONF_TEXT="$MARKER
# A local single-node cluster for tests. State: $STATE
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The node advertises CPUS=$CPUS whatever the hardware has (this host: $ncpu), so multi-rank
# jobs fit on a small machine; config_overrides makes slurmd report the configured topology.
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=300
MailProg=/bin/true
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmdSpoolDir=$STATE/slurmd
StateSaveLocation=$STATE/slurmctld
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 NodeHostname=$HOST CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$real_mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP"

db_pass=""
[[ -r $CONF_DIR/slurmdbd.conf ]] && db_pass=$(sed -n 's/^StoragePass=//p' "$CONF_DIR/slurmdbd.conf" | head -1)
if [[ ! $db_pass =~ ^[A-Za-z0-9]{16,}$ ]]; then
    db_pass=$(head -c 64 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 24)
fi
SLURMDBD_CONF_TEXT="$MARKER
AuthType=auth/munge
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=slurm
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$db_pass
StorageLoc=$DB_NAME"

slurm_conf_changed=0
dbd_conf_changed=0
write_conf "$CONF_DIR/slurm.conf" 644 root:root "$SLURM_CONF_TEXT" && slurm_conf_changed=1
write_conf "$CONF_DIR/slurmdbd.conf" 600 slurm:slurm "$SLURMDBD_CONF_TEXT" && dbd_conf_changed=1

# A changed config needs a restart of the daemons that read it (slurmd refuses to talk to a
# slurmctld with a different slurm.conf).
if ((slurm_conf_changed)) && { alive slurmctld || alive slurmd; }; then
    log "slurm.conf changed: restarting slurmctld and slurmd"
    stop slurmd
    stop slurmctld
fi
if ((dbd_conf_changed)) && alive slurmdbd; then
    log "slurmdbd.conf changed: restarting slurmdbd"
    stop slurmdbd
fi

# --------------------------------------------------------------------------------------------
# munged
# --------------------------------------------------------------------------------------------
# munge_ok [seconds]: a munged answers. The client retries for seconds on a stale socket: bound it.
munge_ok() {
    [[ -S /run/munge/munge.socket.2 ]] && timeout "${1:-5}" munge -n </dev/null | timeout "${1:-5}" unmunge >/dev/null
}
if alive munged; then
    :
elif munge_ok 1 2>/dev/null; then
    log "using a munged this script did not start (it will not stop it)"
    rm -f "$PIDS/munged.pid"
else
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key --force >&2
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
    fi
    chown -R munge:munge /etc/munge
    chmod 700 /etc/munge
    chmod 400 /etc/munge/munge.key
    mkdir -p /var/lib/munge /var/log/munge
    chown munge:munge /var/lib/munge /var/log/munge
    rm -f /run/munge/munged.pid # stale: no munged answers
    spawn munged setpriv --reuid=munge --regid=munge --init-groups -- /usr/sbin/munged --foreground
    wait_for 15 munge munge_ok || die "munged does not answer (see $LOG/munged.out)"
fi

# --------------------------------------------------------------------------------------------
# MariaDB (unix socket only)
# --------------------------------------------------------------------------------------------
start_mariadb

# --------------------------------------------------------------------------------------------
# slurmdbd (accounting: submitit needs sacct to notice jobs that died without a result)
# --------------------------------------------------------------------------------------------
for d in slurmdbd:6819 slurmctld:6817 slurmd:6818; do
    if ! alive "${d%%:*}" && port_open "${d##*:}"; then
        die "port ${d##*:} (${d%%:*}) is in use by a process this script did not start: another SLURM running?"
    fi
done

if ! alive slurmdbd; then
    accounting_db "$DB_NAME" slurm "$db_pass" || die "could not create the accounting database and user"
    rm -f "$RUN/slurmdbd.pid"
    spawn slurmdbd /usr/sbin/slurmdbd -D
    wait_for 60 slurmdbd port_open 6819 || die "slurmdbd does not listen (see $LOG/slurmdbd.log)"
fi
cluster_listed() { sacctmgr -n -P list cluster format=Cluster 2>/dev/null | grep -qxF "$CLUSTER"; }
if ! cluster_listed; then
    wait_for 30 "slurmdbd answers" sacctmgr -n -P list cluster ||
        die "sacctmgr cannot reach slurmdbd (see $LOG/slurmdbd.log)"
    if ! cluster_listed; then
        log "registering cluster $CLUSTER in slurmdbd"
        sacctmgr -i add cluster "$CLUSTER" >&2 || cluster_listed || die "sacctmgr add cluster failed"
    fi
fi

# --------------------------------------------------------------------------------------------
# slurmctld, slurmd
# --------------------------------------------------------------------------------------------
if ! alive slurmctld; then
    rm -f "$RUN/slurmctld.pid" # slurmctld would signal the pid in a stale one
    spawn slurmctld /usr/sbin/slurmctld -D
    wait_for 30 slurmctld scontrol ping || die "slurmctld does not answer (see $LOG/slurmctld.log)"
fi
if ! alive slurmd; then
    rm -f "$RUN/slurmd.pid"
    spawn slurmd /usr/sbin/slurmd -D
fi

node_state() { sinfo -h -N -n "$HOST" -o %T 2>/dev/null | head -1; }
node_usable() { [[ $(node_state) =~ ^(idle|mixed|allocated|completing)$ ]]; }
resumed=0
end=$(($(date +%s) + 30))
until node_usable; do
    state=$(node_state)
    if ((!resumed)) && [[ $state =~ ^(drain|drained|draining|down)$ ]]; then
        log "node $HOST is $state: resuming it"
        scontrol update nodename="$HOST" state=resume >&2 || true
        resumed=1
    fi
    (($(date +%s) < end)) || die "node $HOST is '$state', not idle (see $LOG/slurmd.log, $LOG/slurmctld.log)"
    alive slurmd || die "slurmd exited (see $LOG/slurmd.log, $LOG/slurmd.out)"
    sleep 0.1
done

# sacct must work and slurmctld must have registered with slurmdbd (ControlHost set)
registered() {
    [[ $(sacctmgr -n -P list cluster format=Cluster,ControlHost 2>/dev/null | grep "^$CLUSTER|") == "$CLUSTER|127.0.0.1" ]]
}
wait_for 30 "cluster registered" registered ||
    die "slurmctld did not register with slurmdbd (see $LOG/slurmctld.log, $LOG/slurmdbd.log)"
sacct -n -X -S now-1minutes -o JobID >/dev/null || die "sacct does not work"

log "cluster $CLUSTER up: node $HOST ($(node_state), CPUs=$CPUS), partition $PARTITION"
echo "$PARTITION"
