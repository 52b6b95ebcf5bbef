# Sourced by cluster_up.sh and cluster_down.sh: how a recorded daemon pid is checked.
# Needs $PIDS (the folder of <name>.pid records) and a die() function.

bin_of() {
    case $1 in
    munged | mariadbd | slurmdbd | slurmctld | slurmd) echo "/usr/sbin/$1" ;;
    slurmd-*) echo /usr/sbin/slurmd ;; # one slurmd per host of a multi-node cluster
    *) die "unknown daemon $1" ;;
    esac
}

# pid of our running daemon <name>, or fail. The recorded pid must still run the daemon's binary,
# so a zombie, or a dead daemon's pid reused by another process, is never taken (or signalled).
our_pid() {
    local f=$PIDS/$1.pid pid exe
    [[ -r $f ]] || return 1
    pid=$(<"$f")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
    [[ ${exe% (deleted)} == "$(readlink -f "$(bin_of "$1")")" ]] || return 1
    echo "$pid"
}
alive() { our_pid "$1" >/dev/null; }
