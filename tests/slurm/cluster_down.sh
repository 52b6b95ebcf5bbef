#!/usr/bin/env bash
# Stop the local SLURM cluster started by tests/slurm/cluster_up.sh.
#
#   bash tests/slurm/cluster_down.sh
#
# Cancels the jobs still on the cluster, then stops exactly the daemons cluster_up.sh started, by
# the pids it recorded in $RLCOMM_SLURM_STATE/pids (never by name): SIGTERM, then SIGKILL after a
# bounded wait. Removes the pid files. Harmless when nothing is running. Configs, the job state and
# the accounting database are kept, so the next cluster_up.sh is fast and job ids keep counting.
#
# Environment:
#   RLCOMM_SLURM_STATE         state dir, default /var/lib/rlcomm-slurm (same as cluster_up.sh)
#   RLCOMM_SLURM_STOP_TIMEOUT  seconds to wait for each daemon after SIGTERM, default 20
set -euo pipefail

STATE=${RLCOMM_SLURM_STATE:-/var/lib/rlcomm-slurm}
PIDS=$STATE/pids
RUN=$STATE/run
STOP_TIMEOUT=${RLCOMM_SLURM_STOP_TIMEOUT:-20}
export SLURM_CONF=/etc/slurm/slurm.conf

log() { printf '[cluster_down] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ -d $PIDS ]] || { log "nothing to stop (no $PIDS)"; exit 0; }
[[ $(id -u) == 0 ]] || die "must run as root (try: sudo -E bash $0)"
[[ $STOP_TIMEOUT =~ ^[0-9]+$ ]] || die "bad RLCOMM_SLURM_STOP_TIMEOUT: $STOP_TIMEOUT"

# shellcheck source=tests/slurm/pids.sh
source "$(dirname "${BASH_SOURCE[0]}")/pids.sh"

stop() {
    local name=$1 pid i
    if pid=$(our_pid "$name"); then
        log "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < STOP_TIMEOUT * 20; i++)); do alive "$name" || break; sleep 0.05; done
        if alive "$name"; then
            log "$name (pid $pid) still running after ${STOP_TIMEOUT}s: SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            for ((i = 0; i < 200; i++)); do alive "$name" || break; sleep 0.05; done
            alive "$name" && die "$name (pid $pid) survived SIGKILL"
        fi
    elif [[ -e $PIDS/$name.pid ]]; then
        log "$name was not running (stale pid file)"
    fi
    rm -f "$PIDS/$name.pid"
}

# Cancel leftover jobs first, so that no job step outlives slurmd.
if alive slurmctld; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null || true)
    if [[ -n $jobs ]]; then
        log "cancelling jobs: $(echo $jobs)"
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs >&2 || true
        for ((i = 0; i < 150; i++)); do
            [[ -z $(timeout 5 squeue -h -o %A 2>/dev/null | head -c1) ]] && break
            sleep 0.1
        done
    fi
fi

for name in slurmd slurmctld slurmdbd mariadbd munged; do
    stop "$name"
done

# pid files the daemons could not remove themselves (slurm daemons drop to the slurm user and
# their root-owned pid files stay behind; a SIGKILLed daemon leaves its own behind)
rm -f "$RUN"/slurmctld.pid "$RUN"/slurmd.pid "$RUN"/slurmdbd.pid
for f in /run/mysqld/mysqld.pid /run/munge/munged.pid; do
    if [[ -r $f ]]; then
        pid=$(<"$f")
        [[ $pid =~ ^[0-9]+$ ]] && readlink "/proc/$pid/exe" >/dev/null 2>&1 || rm -f "$f"
    fi
done
log "stopped"
