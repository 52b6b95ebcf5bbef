#!/usr/bin/env bash
# Tear down what tests/hosts/hosts_up.sh created, and nothing else: every process still running
# in one of its namespaces is killed (by pid), then the namespaces and /etc/netns/<ns> folders it
# recorded are removed. Harmless when nothing is up.
set -euo pipefail
# shellcheck source=tests/hosts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ -s $RECORD ]] || { log "nothing to tear down"; rm -rf "$STATE"; exit 0; }
[[ $(id -u) == 0 ]] || die "must run as root (network namespaces)"

mapfile -t entries <"$RECORD"
for entry in "${entries[@]}"; do
    [[ $entry == netns\ * ]] || continue
    ns=${entry#netns }
    ip netns list | grep -qw "$ns" || continue
    pids=$(ip netns pids "$ns" || true)
    if [[ -n $pids ]]; then
        log "killing processes left in $ns: $(echo $pids)"
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        for ((t = 0; t < 100; t++)); do [[ -z $(ip netns pids "$ns") ]] && break; sleep 0.05; done
    fi
done
for entry in "${entries[@]}"; do
    case $entry in
    netns\ *) ip netns list | grep -qw "${entry#netns }" && ip netns delete "${entry#netns }" ;;
    etcdir\ /etc/netns/rlcomm-*) rm -rf "${entry#etcdir }" ;;
    esac
done
rmdir /etc/netns 2>/dev/null || true
rm -rf "$STATE"
log "hosts down"
