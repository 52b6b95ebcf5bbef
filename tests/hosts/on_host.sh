#!/usr/bin/env bash
# Run a command "on" host<i> (or the head node) of tests/hosts/hosts_up.sh: in its network namespace, with its own
# hostname (a UTS namespace) and its /etc/hosts (bind-mounted in a private mount namespace).
#
#   bash tests/hosts/on_host.sh host2 python -m app ...
#
# Only the network namespace is entered (nsenter --net), not `ip netns exec`, which remounts /sys
# and hides this machine's cgroup mounts (slurmd then fails). RLCOMM_HOSTS_FILE replaces the
# host's /etc/hosts for this command (e.g. one where the hostname resolves to 127.0.1.1).
set -euo pipefail
# shellcheck source=tests/hosts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

host=${1:-}
if [[ $host == head ]]; then
    ns=$SWITCH_NS
elif [[ $host =~ ^host([1-9])$ ]]; then
    ns=$(host_ns "${BASH_REMATCH[1]}")
else
    die "usage: $0 head|host<i> CMD..., got '${host}'"
fi
shift
[[ -e /run/netns/$ns ]] || die "$host is not up (run tests/hosts/hosts_up.sh)"
hosts_file=${RLCOMM_HOSTS_FILE:-/etc/netns/$ns/hosts}
exec nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private \
    sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' sh "$host" "$hosts_file" "$@"
