#!/usr/bin/env bash
# A multi-node SLURM cluster on this machine: the hosts of tests/hosts/hosts_up.sh as nodes.
#
#   partition=$(bash tests/slurm/multinode_up.sh 2 | tail -1)
#   SLURM_CONF=/etc/rlcomm-slurm-multinode/slurm.conf \
#       bash tests/hosts/on_host.sh head salloc -N2 -n4 srun python -m app layout=2x2 loop=commcheck
#   bash tests/slurm/multinode_down.sh
#
# slurmctld runs on the "head" node (198.18.0.1), one slurmd per host namespace (NodeName hostN,
# NodeAddr 198.18.0.1N) with that host's hostname and /etc/hosts; users submit from the head
# node (tests/hosts/on_host.sh head ...). Its own config dir (SLURM_CONF, never /etc/slurm) and
# state dir, so the single-node cluster of cluster_up.sh is left alone (and may even run at the
# same time: every daemon here listens inside the namespaces). Accounting: slurmdbd on the head
# node, in its own database of the machine's MariaDB (reached through its unix socket; started
# here when none runs), so sacct, and submitit through it, see jobs that died without a result.
# A host whose slurmd stops answering is DOWN after 10 s (SlurmdTimeout) and back once it
# registers again (running this script again restarts it). Needs root and SLURM installed
# (cluster_up.sh installs it). Prints the partition name last on stdout.
set -euo pipefail
set +m
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HOSTS=$HERE/../hosts
N=${1:-2}
STATE=${RLCOMM_SLURM_MN_STATE:-/var/lib/rlcomm-slurm-multinode}
CONF_DIR=/etc/rlcomm-slurm-multinode
PARTITION=multinode
PIDS=$STATE/pids
LOG=$STATE/log
CLUSTER=rlcommmn
DB_NAME=slurm_acct_multinode
DB_USER=slurm_mn
export SLURM_CONF=$CONF_DIR/slurm.conf

log() { printf '[multinode_up] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
[[ $(id -u) == 0 ]] || die "must run as root"
[[ -x /usr/sbin/slurmctld && -x /usr/sbin/slurmd ]] || die "SLURM is not installed (run tests/slurm/cluster_up.sh once)"
# shellcheck source=tests/slurm/pids.sh
source "$HERE/pids.sh"

bash "$HOSTS/hosts_up.sh" "$N"
mkdir -p "$PIDS" "$LOG" "$STATE/run" "$STATE/slurmctld" "$CONF_DIR"
chown slurm:slurm "$LOG" "$STATE/slurmctld" "$STATE/run"


# The hosts share this machine's memory; each node offers all of it (nothing enforces a share,
# and a 3-node partition must still fit a job's 4 GB per rank).
real_mem=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)
nodes=""
node_lines=""
for ((i = 1; i <= N; i++)); do
    nodes+="${nodes:+,}host$i"
    node_lines+="NodeName=host$i NodeAddr=198.18.0.$((10 + i)) NodeHostname=host$i CPUs=4 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 ThreadsPerCore=1 RealMemory=$real_mem State=UNKNOWN"$'\n'
done
conf="# Managed by rlcomm tests/slurm/multinode_up.sh; rewritten on every run.
ClusterName=$CLUSTER
SlurmctldHost=head(198.18.0.1)
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
AccountingStorageHost=198.18.0.1
AccountingStoragePort=6819
SlurmdTimeout=10
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=300
MailProg=/bin/true
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmdSpoolDir=$STATE/slurmd-%n
StateSaveLocation=$STATE/slurmctld
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
${node_lines}PartitionName=$PARTITION Nodes=$nodes Default=YES MaxTime=INFINITE State=UP"
db_pass=""
[[ -r $CONF_DIR/slurmdbd.conf ]] && db_pass=$(sed -n 's/^StoragePass=//p' "$CONF_DIR/slurmdbd.conf")
[[ $db_pass =~ ^[A-Za-z0-9]{16,}$ ]] || db_pass=$(head -c 64 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 24)
dbd_conf="AuthType=auth/munge
DbdHost=head
DbdAddr=198.18.0.1
DbdPort=6819
SlurmUser=slurm
LogFile=$LOG/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$db_pass
StorageLoc=$DB_NAME"
changed=0
if [[ ! -e $SLURM_CONF || $(<"$SLURM_CONF") != "$conf" ]]; then
    printf '%s\n' "$conf" >"$SLURM_CONF"
    changed=1
fi
if [[ ! -e $CONF_DIR/slurmdbd.conf || $(<"$CONF_DIR/slurmdbd.conf") != "$dbd_conf" ]]; then
    (umask 077 && printf '%s\n' "$dbd_conf" >"$CONF_DIR/slurmdbd.conf")
    changed=1
fi
chown slurm:slurm "$CONF_DIR/slurmdbd.conf"
chmod 600 "$CONF_DIR/slurmdbd.conf"
if ((changed)); then
    for name in "$PIDS"/*.pid; do
        [[ -e $name ]] || continue
        name=$(basename "$name" .pid)
        [[ $name == munged || $name == mariadbd ]] && continue
        pid=$(our_pid "$name") && kill -TERM "$pid" && log "config changed: stopped $name"
        for ((t = 0; t < 100; t++)); do alive "$name" || break; sleep 0.1; done
        rm -f "$PIDS/$name.pid"
    done
fi

munge_ok() { timeout 5 munge -n </dev/null | timeout 5 unmunge >/dev/null 2>&1; }
if ! munge_ok; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    spawn munged setpriv --reuid=munge --regid=munge --init-groups -- /usr/sbin/munged --foreground
    for ((t = 0; t < 100; t++)); do munge_ok && break; sleep 0.1; done
fi

on_head() { bash "$HOSTS/on_host.sh" head "$@"; }
start_mariadb
if ! alive slurmdbd; then
    accounting_db "$DB_NAME" "$DB_USER" "$db_pass" || die "could not create the accounting database"
    rm -f "$STATE/run/slurmdbd.pid"
    spawn slurmdbd bash "$HOSTS/on_host.sh" head /usr/sbin/slurmdbd -D
    wait_for 60 slurmdbd on_head sacctmgr -n -P list cluster || die "slurmdbd does not answer (see $LOG/slurmdbd.log)"
fi
if ! on_head sacctmgr -n -P list cluster format=Cluster | grep -qxF "$CLUSTER"; then
    on_head sacctmgr -i add cluster "$CLUSTER" >&2 || die "sacctmgr add cluster failed"
fi
if ! alive slurmctld; then
    rm -f "$STATE/run/slurmctld.pid"
    spawn slurmctld bash "$HOSTS/on_host.sh" head /usr/sbin/slurmctld -D
fi
for ((i = 1; i <= N; i++)); do
    if ! alive "slurmd-host$i"; then
        mkdir -p "$STATE/slurmd-host$i"
        rm -f "$STATE/run/slurmd-host$i.pid"
        spawn "slurmd-host$i" bash "$HOSTS/on_host.sh" "host$i" /usr/sbin/slurmd -D -N "host$i"
    fi
done

end=$(($(date +%s) + 40))
until [[ $(on_head sinfo -h -p "$PARTITION" -o '%D %T' 2>/dev/null) == "$N idle" ]]; do
    state=$(on_head sinfo -h -N -p "$PARTITION" -o '%N:%T' 2>/dev/null | tr '\n' ' ')
    if [[ $state =~ (down|drain) ]]; then
        on_head scontrol update nodename="$nodes" state=resume >/dev/null 2>&1 || true
    fi
    (($(date +%s) < end)) || die "nodes not idle: $state (see $LOG/)"
    sleep 0.3
done
registered() { on_head sacctmgr -n -P list cluster format=Cluster,ControlHost | grep -qxF "$CLUSTER|198.18.0.1"; }
wait_for 30 "cluster registered" registered ||
    die "slurmctld did not register with slurmdbd (see $LOG/slurmctld.log, $LOG/slurmdbd.log)"
log "multi-node cluster up: $N nodes ($nodes), partition $PARTITION, SLURM_CONF=$SLURM_CONF"
echo "$PARTITION"
