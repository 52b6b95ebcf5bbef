#!/usr/bin/env bash
# Bring up N "hosts" on this machine: network namespaces joined by a bridge, each with its own
# hostname (host1..hostN, set by on_host.sh), address (198.18.0.11, .12, ...) and /etc/hosts,
# plus a "head" node (198.18.0.1, the switch's own namespace) for controllers and logins.
#
#   bash tests/hosts/hosts_up.sh 2          # then: bash tests/hosts/on_host.sh host1 CMD...
#   bash tests/hosts/hosts_down.sh
#
# Needs root. Idempotent: with N hosts already up it only checks them; with a different N it
# tears its hosts down first. Refuses to start if the machine already routes or uses any address
# of 198.18.0.0/24. Records everything it creates in $RLCOMM_HOSTS_STATE/created (default
# /run/rlcomm-hosts), and hosts_down.sh removes exactly that.
set -euo pipefail
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source=tests/hosts/common.sh
source "$HERE/common.sh"

N=${1:-}
[[ $N =~ ^[1-9]$ ]] || die "usage: $0 N (1..9 hosts), got '${N}'"
[[ $(id -u) == 0 ]] || die "must run as root (network namespaces)"

up_count() { [[ -r $STATE/count ]] && cat "$STATE/count" || echo 0; }
all_up() {
    local i
    ip netns list | grep -qw "$SWITCH_NS" || return 1
    for ((i = 1; i <= N; i++)); do
        ip netns list | grep -qw "$(host_ns "$i")" || return 1
        [[ $(ip -n "$(host_ns "$i")" -o link show eth0 2>/dev/null) == *"state UP"* ]] || return 1
    done
}

if [[ -s $RECORD ]]; then
    if [[ $(up_count) == "$N" ]] && all_up; then
        log "$N hosts already up"
        exit 0
    fi
    log "hosts from an earlier run ($(up_count)) do not match: tearing them down first"
    bash "$HERE/hosts_down.sh"
fi

# The range must be free: no address, no route (any table) of this machine may touch it.
if ip -o addr show | grep -q " $SUBNET\." || ip -o route show table all | grep -q "$SUBNET\."; then
    die "$SUBNET.0/24 is already in use on this machine (see 'ip addr' / 'ip route show table all'); refusing to start"
fi
for ((i = 0; i <= N; i++)); do
    name=$([[ $i == 0 ]] && echo "$SWITCH_NS" || host_ns "$i")
    ip netns list | grep -qw "$name" && die "network namespace $name exists but was not created by this script"
done

mkdir -p "$STATE"
: >"$RECORD"
# A failure half-way leaves nothing behind: undo what this run recorded.
trap 'rc=$?; ((rc == 0)) || bash "$HERE/hosts_down.sh"; exit $rc' EXIT
echo "$N" >"$STATE/count"
record() { echo "$*" >>"$RECORD"; }

ip netns add "$SWITCH_NS"
record netns "$SWITCH_NS"
ip -n "$SWITCH_NS" link add br0 type bridge
ip -n "$SWITCH_NS" link set br0 up
# The switch is also the "head" node (a login/controller node: slurmctld, sbatch), at .1.
ip -n "$SWITCH_NS" link set lo up
ip -n "$SWITCH_NS" addr add "$SUBNET.1/24" dev br0

hosts_text="127.0.0.1 localhost"$'\n'"$SUBNET.1 head"
for ((i = 1; i <= N; i++)); do hosts_text+=$'\n'"$(host_addr "$i") host$i"; done
mkdir -p "/etc/netns/$SWITCH_NS"
record etcdir "/etc/netns/$SWITCH_NS"
printf '%s\n' "$hosts_text" >"/etc/netns/$SWITCH_NS/hosts"

for ((i = 1; i <= N; i++)); do
    ns=$(host_ns "$i")
    ip netns add "$ns"
    record netns "$ns"
    ip -n "$ns" link set lo up
    # both ends are created inside their namespaces: nothing appears in the root namespace
    ip -n "$SWITCH_NS" link add "rlc-host$i" type veth peer name eth0 netns "$ns"
    ip -n "$SWITCH_NS" link set "rlc-host$i" master br0 up
    ip -n "$ns" addr add "$(host_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    etc=/etc/netns/$ns
    mkdir -p "$etc"
    record etcdir "$etc"
    printf '%s\n' "$hosts_text" >"$etc/hosts"
    echo "host$i" >"$etc/hostname"
done

# reaches <i> <j>: a TCP connect from host i to a closed port of host j is refused (a reset came
# back), rather than timing out or finding no route. (There is no ping on these machines.)
reaches() {
    local err
    err=$(nsenter --net="/run/netns/$(host_ns "$1")" timeout 2 bash -c \
        "exec 3<>/dev/tcp/$(host_addr "$2")/9" 2>&1) && return 0
    [[ $err == *"Connection refused"* ]]
}

# Every host reaches every other before we say "up" (the bridge needs a moment to forward).
for ((i = 1; i <= N; i++)); do
    for ((j = 1; j <= N; j++)); do
        ((i == j)) && continue
        for ((t = 0; t < 50; t++)); do reaches "$i" "$j" && continue 2; sleep 0.1; done
        die "host$i cannot reach host$j ($(host_addr "$j"))"
    done
done
log "$N hosts up: $(for ((i = 1; i <= N; i++)); do printf 'host%s=%s ' "$i" "$(host_addr "$i")"; done)"
