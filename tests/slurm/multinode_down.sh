#!/usr/bin/env bash
# Stop what tests/slurm/multinode_up.sh started (by recorded pid, never by name), then take the
# hosts down (tests/hosts/hosts_down.sh kills anything left in their namespaces).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE=${RLCOMM_SLURM_MN_STATE:-/var/lib/rlcomm-slurm-multinode}
PIDS=$STATE/pids
export SLURM_CONF=/etc/rlcomm-slurm-multinode/slurm.conf
log() { printf '[multinode_down] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# shellcheck source=tests/slurm/pids.sh
source "$HERE/pids.sh"

if [[ -d $PIDS ]]; then
    if alive slurmctld; then
        jobs=$(timeout 10 bash "$HERE/../hosts/on_host.sh" head squeue -h -o %A 2>/dev/null || true)
        # shellcheck disable=SC2086
        [[ -z $jobs ]] || timeout 10 bash "$HERE/../hosts/on_host.sh" head scancel $jobs || true
    fi
    for f in "$PIDS"/slurmd-*.pid "$PIDS/slurmctld.pid" "$PIDS/slurmdbd.pid" "$PIDS/mariadbd.pid" \
        "$PIDS/munged.pid"; do
        [[ -e $f ]] || continue
        name=$(basename "$f" .pid)
        if pid=$(our_pid "$name"); then
            log "stopping $name (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            for ((t = 0; t < 200; t++)); do alive "$name" || break; sleep 0.05; done
            if alive "$name"; then kill -KILL "$pid" 2>/dev/null || true; sleep 0.2; fi
        fi
        rm -f "$f"
    done
    rm -f "$STATE"/run/*.pid
fi
bash "$HERE/../hosts/hosts_down.sh"
log "stopped"
