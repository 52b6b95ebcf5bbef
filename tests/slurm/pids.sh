# Sourced by cluster_up.sh, multinode_up.sh and the down scripts: how a daemon is started and its
# recorded pid checked. Needs $PIDS (the folder of <name>.pid records), $LOG, log() and die().

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

# spawn <name> <command...>: start a daemon in the foreground of its own session, detached from our
# stdio (so `$(cluster_up.sh)` does not wait for it), and record its pid.
spawn() {
    local name=$1 pid i
    shift
    (
        # close inherited descriptors other than 0-2: a daemon holding a caller's pipe would hang it
        fds=(/proc/$BASHPID/fd/*)
        for f in "${fds[@]}"; do
            n=${f##*/}
            if [[ $n =~ ^[0-9]+$ ]] && ((n > 2)) && [[ -e $f ]]; then eval "exec $n>&-"; fi
        done
        exec setsid "$@" </dev/null >>"$LOG/$name.out" 2>&1
    ) &
    pid=$!
    echo "$pid" >"$PIDS/$name.pid"
    for ((i = 0; i < 100; i++)); do # until the subshell has exec'd the daemon
        alive "$name" && { log "started $name (pid $pid)"; return 0; }
        [[ -e /proc/$pid/exe ]] || break
        sleep 0.05
    done
    rm -f "$PIDS/$name.pid"
    tail -n 20 "$LOG/$name.out" >&2 || true
    die "$name did not start (see $LOG/$name.out)"
}
