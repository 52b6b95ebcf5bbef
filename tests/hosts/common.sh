# Sourced by hosts_up.sh, hosts_down.sh and on_host.sh: names, addresses and the record of what
# hosts_up.sh created. Host i (1-based) is network namespace rlcomm-host<i>, hostname host<i>,
# address $SUBNET.$((10 + i)) on eth0; every host's eth0 is one end of a veth pair whose other end
# (rlc-host<i>) sits on bridge br0 inside namespace rlcomm-switch. Nothing is added to the root
# namespace: no traffic can leave the machine, and the machine's own routes stay untouched.
SUBNET=198.18.0                       # 198.18.0.0/24: reserved for benchmarking (RFC 2544)
SWITCH_NS=rlcomm-switch
HOST_NS_PREFIX=rlcomm-host
STATE=${RLCOMM_HOSTS_STATE:-/run/rlcomm-hosts}
RECORD=$STATE/created                 # one line per thing we created: "netns NAME" / "etcdir PATH"

host_ns() { echo "$HOST_NS_PREFIX$1"; }
host_addr() { echo "$SUBNET.$((10 + $1))"; }

log() { printf '[%s] %s\n' "$(basename "$0" .sh)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
